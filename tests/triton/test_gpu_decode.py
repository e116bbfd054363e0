"""Triton and Gluon decode on a GPU: every decode strategy with real MLA dims (512 + 64), bf16 and
fp8 caches, graph-padded rows, and CUDA-graph capture + replay after an in-place metadata rebuild,
on each GPU provider (``gluon`` only where it is available: NVIDIA sm_90).

Skipped without CUDA (``gpu`` marker). Run: ``pytest -m gpu tests/triton/test_gpu_decode.py``.
"""

from __future__ import annotations

import math

import pytest
import torch

from mla.core.config import EngineLimits, GraphMode, KVCacheSpec, MLADims
from mla.core.platform import detect_platform
from mla.decode.asm_non_persistent import AsmNonPersistent
from mla.decode.asm_padded_persistent import PaddedAsmPersistent
from mla.decode.base import DecodeStrategy
from mla.decode.gluon import GluonDecode
from mla.decode.gluon_verify_flatten import GluonVerifyFlatten
from mla.engine.backend import MLABackend, StepInputs
from mla.providers import get_provider
from mla.providers.base import KernelProvider
from mla.providers.calls import WriteKVCall
from mla.providers.torch_ref import TorchProvider
from mla.providers.triton import TritonProvider
from mla.testing import DecodeCase, assert_matches_reference, check_decode_strategy
from mla.tools.reference import reference_decode

pytestmark = pytest.mark.gpu

FP8 = torch.float8_e4m3fn

# (strategy, heads, qlens, seq_lens, block_size, extra graph rows)
STRATEGY_CASES: list[tuple[type[DecodeStrategy], int, tuple[int, ...], tuple[int, ...], int, int]] = [
    (GluonDecode, 8, (1, 1, 1, 1), (700, 1, 0, 2049), 64, 3),
    (GluonDecode, 16, (1,) * 6, (4096, 33, 1000, 0, 64, 5), 1, 0),
    (GluonVerifyFlatten, 12, (3, 3, 3), (300, 3, 1500), 16, 2),
    (PaddedAsmPersistent, 16, (1,) * 8, (4096, 17, 900, 0, 2500, 64, 1, 3000), 64, 2),
    (PaddedAsmPersistent, 16, (4, 4, 4), (1200, 4, 0), 1, 0),
    (PaddedAsmPersistent, 128, (1, 2, 1), (800, 300, 2), 64, 1),
    (PaddedAsmPersistent, 12, (2, 3, 1), (520, 40, 9), 16, 0),
    (AsmNonPersistent, 16, (1,) * 5, (3000, 1, 0, 700, 64), 64, 2),
    (AsmNonPersistent, 8, (2, 2), (1900, 2), 1, 1),
    (AsmNonPersistent, 128, (1, 1), (640, 5), 16, 0),
    (AsmNonPersistent, 1, (1, 1, 1), (200, 77, 0), 16, 1),
    (PaddedAsmPersistent, 5, (8, 1, 3), (2000, 9, 300), 16, 0),
    (AsmNonPersistent, 16, (2, 2, 2), (700, 2, 1500), 64, 1),
    (PaddedAsmPersistent, 64, (1, 1), (3000, 65), 1, 0),
]
PROVIDERS = ["triton", "gluon"]


def _gpu_provider(name: str) -> KernelProvider:
    provider = get_provider(name)
    support = provider.availability()
    if not support:
        pytest.skip(f"provider {name!r} is unavailable here: {support}")
    return provider


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize(
    ("strategy", "heads", "qlens", "seq_lens", "block_size", "extra"),
    STRATEGY_CASES,
    ids=[f"{c[0].NAME}-h{c[1]}-q{max(c[2])}-bs{c[4]}" for c in STRATEGY_CASES],
)
def test_strategy_on_gpu(
    strategy: type[DecodeStrategy],
    heads: int,
    qlens: tuple[int, ...],
    seq_lens: tuple[int, ...],
    block_size: int,
    extra: int,
    kv_dtype: torch.dtype,
    provider: str,
) -> None:
    prov = _gpu_provider(provider)
    case = DecodeCase(
        heads=heads,
        qlens=qlens,
        seq_lens=seq_lens,
        block_size=block_size,
        q_dtype=torch.bfloat16,
        kv_dtype=kv_dtype,
        extra_rows=extra,
        kv_lora_rank=512,
        rope_dim=64,
        seed=heads + block_size,
    )
    result = check_decode_strategy(
        strategy, case, provider=prov, platform=detect_platform("cuda"), device="cuda"
    )
    result.assert_passed()


def _step(qlen: int, seq_lens: list[int], block_table: torch.Tensor, extra: int) -> StepInputs:
    qsl = torch.arange(len(seq_lens) + 1, dtype=torch.int32) * qlen
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return StepInputs(
        query_start_loc_cpu=qsl,
        query_start_loc=qsl.cuda(),
        seq_lens=lens.cuda(),
        seq_lens_cpu=lens,
        block_table=block_table,
        num_decodes=len(seq_lens),
        num_decode_tokens=len(seq_lens) * qlen + extra,
    )


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize(
    ("strategy", "heads", "qlen", "kv_dtype"),
    [
        (GluonDecode, 8, 1, torch.bfloat16),
        (GluonVerifyFlatten, 4, 2, torch.bfloat16),
        (PaddedAsmPersistent, 16, 1, torch.bfloat16),
        (PaddedAsmPersistent, 16, 3, FP8),
        (AsmNonPersistent, 16, 1, FP8),
        (AsmNonPersistent, 12, 2, torch.bfloat16),
    ],
    ids=lambda x: getattr(x, "NAME", str(x)),
)
def test_cuda_graph_replay_after_metadata_rebuild(
    strategy: type[DecodeStrategy], heads: int, qlen: int, kv_dtype: torch.dtype, provider: str
) -> None:
    """Capture one decode step, rebuild the metadata in place for new lengths/tables, replay.

    An fp8 cache's ``kv_scale`` is a device tensor that holds a wrong value at capture and the
    right one before the replay: the replay must read the current value."""
    prov = _gpu_provider(provider)
    gen = torch.Generator().manual_seed(heads * 10 + qlen)
    batch, block, max_len, extra = 4, 16, 2048, 0
    blocks = batch * (max_len // block)
    dims = MLADims(num_heads=heads, kv_lora_rank=512, qk_rope_head_dim=64, softmax_scale=0.07)
    limits = EngineLimits(
        max_num_seqs=batch, max_model_len=max_len, max_num_batched_tokens=batch * qlen + extra,
        max_decode_qlen=qlen, graph_mode=GraphMode.FULL,
    )  # fmt: skip
    backend = MLABackend(
        dims,
        KVCacheSpec(block, kv_dtype, num_blocks=blocks),
        limits,
        model_dtype=torch.bfloat16,
        provider=prov,
        platform=detect_platform("cuda"),
        device="cuda",
        decode_strategy=strategy,
        preallocate=False,
    )
    kv_scale = 0.05 if kv_dtype == FP8 else None
    values = torch.randn(blocks, block, 576, generator=gen)
    cache = (values / (kv_scale or 1.0)).clamp(-448, 448).to(kv_dtype).cuda()
    scale_t = None if kv_scale is None else torch.full((1,), 10 * kv_scale, device="cuda")
    tokens = batch * qlen + extra
    q = torch.randn(tokens, heads, 576, generator=gen).to(torch.bfloat16).cuda()
    out = torch.full((tokens, heads, 512), math.nan, dtype=torch.bfloat16, device="cuda")
    lse = torch.full((tokens, heads), math.nan, dtype=torch.float32, device="cuda")
    table = torch.randperm(blocks, generator=gen)[: batch * (max_len // block)].view(batch, -1)
    table_gpu = table.to(torch.int32).cuda()

    first = backend.builder.build(_step(qlen, [1500, 40, qlen, 900], table_gpu, extra))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        backend.impl.forward_decode(first, q, cache, out=out, lse=lse, kv_scale=scale_t)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        backend.impl.forward_decode(first, q, cache, out=out, lse=lse, kv_scale=scale_t)

    new_lens = [33, 2048, 700, 0]
    new_table = torch.randperm(blocks, generator=gen)[: batch * (max_len // block)].view(batch, -1)
    table_gpu.copy_(new_table.to(torch.int32))
    second = backend.builder.build(_step(qlen, new_lens, table_gpu, extra))
    assert second.decode is not None
    assert second.decode.strategy == strategy.NAME
    q.copy_(torch.randn(tokens, heads, 576, generator=gen).to(torch.bfloat16))
    out.fill_(math.nan)
    lse.fill_(math.nan)
    if scale_t is not None:
        scale_t.fill_(kv_scale)
    graph.replay()
    torch.cuda.synchronize()
    qsl = torch.arange(batch + 1, dtype=torch.int32) * qlen
    ref_out, ref_lse = reference_decode(
        q.cpu(), cache.cpu(), new_table.to(torch.int32), torch.tensor(new_lens), qsl,
        softmax_scale=0.07, kv_lora_rank=512, kv_scale=kv_scale,
    )  # fmt: skip
    assert_matches_reference(out, lse, ref_out, ref_lse, context=f"{strategy.NAME} replay")


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, FP8, torch.float8_e5m2], ids=str)
def test_write_kv_and_utilities_on_gpu(kv_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    triton_p, ref = TritonProvider(), TorchProvider()
    cache = torch.zeros(8, 16, 576, dtype=kv_dtype, device="cuda")
    want = cache.clone()
    kv_c = (torch.randn(20, 512, generator=gen) * 4).to(torch.bfloat16).cuda()
    k_pe = (torch.randn(20, 64, generator=gen) * 4).to(torch.bfloat16).cuda()
    slots = torch.randperm(128, generator=gen)[:20].cuda()
    slots[3] = -1
    scale = None if kv_dtype == torch.bfloat16 else torch.tensor([0.02], device="cuda")
    triton_p.write_kv(WriteKVCall(kv_c=kv_c, k_pe=k_pe, kv_cache=cache, slot_mapping=slots, kv_scale=scale))
    ref.write_kv(WriteKVCall(kv_c=kv_c, k_pe=k_pe, kv_cache=want, slot_mapping=slots, kv_scale=scale))
    assert torch.equal(cache.view(torch.uint8), want.view(torch.uint8))
