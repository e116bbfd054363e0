"""A decode step captured in a CUDA graph replays correctly after an in-place metadata rebuild.

``run`` has no host sync and no data-dependent allocation, and the
builder writes each step's metadata into buffers allocated at init. So an engine captures
``impl.forward_decode`` once per (batch size, qlen), then for every later step of that shape
copies the new inputs into its static buffers, rebuilds the metadata in place and replays.
Skipped without CUDA (the ``gpu`` marker).
"""

from __future__ import annotations

import importlib.util
import math

import attrs
import pytest
import torch

import mla
from mla.testing import assert_matches_reference, emulated_provider
from mla.tools.reference import reference_decode

pytestmark = pytest.mark.gpu

HEADS, RANK, ROPE = 16, 512, 64
BLOCK, MAX_SEQS, MAX_MODEL_LEN = 16, 4, 320
BF16 = torch.bfloat16


def _providers() -> list[object]:
    params: list[object] = [
        pytest.param("torch", id="torch"),
        pytest.param("aiter-emulated", id="torch-as-aiter-gfx950"),
    ]
    if importlib.util.find_spec("triton") is not None:
        params.append(pytest.param("triton", id="triton"))
    return params


def _backend(provider: str, strategy: type[mla.DecodeStrategy], qlen: int) -> mla.MLABackend:
    device = torch.device("cuda")
    if provider == "aiter-emulated":
        # aiter's constraints (16-head granularity, qlen padding 2,3 -> 4) on the torch kernels.
        platform = attrs.evolve(mla.simulated_platform("gfx950"), device_type="cuda")
        prov: str | mla.KernelProvider = emulated_provider("aiter", "gfx950")
        heads = 8
    else:
        if provider == "triton":
            try:
                mla.get_provider("triton")
            except mla.ProviderUnavailableError as exc:
                pytest.skip(f"triton provider unavailable: {exc}")
        platform = mla.detect_platform(device)
        prov = provider
        heads = HEADS
    return mla.MLABackend(
        mla.MLADims(heads, RANK, ROPE, softmax_scale=(128 + ROPE) ** -0.5),
        mla.KVCacheSpec(BLOCK, BF16, num_blocks=MAX_SEQS * MAX_MODEL_LEN // BLOCK + 1),
        mla.EngineLimits(
            MAX_SEQS, MAX_MODEL_LEN, MAX_SEQS * qlen, max_decode_qlen=qlen, graph_mode=mla.GraphMode.FULL
        ),
        model_dtype=BF16,
        provider=prov,
        platform=platform,
        device=device,
        decode_strategy=strategy,
        preallocate=False,
    )


@attrs.define
class StaticInputs:
    """The engine's persistent input buffers for one captured shape."""

    q: torch.Tensor
    kv_cache: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor

    def step(self, num_decodes: int) -> mla.StepInputs:
        return mla.StepInputs(
            query_start_loc_cpu=self.query_start_loc.cpu(),
            query_start_loc=self.query_start_loc,
            seq_lens=self.seq_lens,
            block_table=self.block_table,
            num_decodes=num_decodes,
            num_decode_tokens=self.q.shape[0],
        )


def _fill(static: StaticInputs, qlen: int, gen: torch.Generator) -> None:
    """New random batch of the same shape: the last request is a graph-padding one (seq 0)."""
    num_blocks = static.kv_cache.shape[0]
    seq_lens = [int(torch.randint(qlen, MAX_MODEL_LEN + 1, (1,), generator=gen)) for _ in range(MAX_SEQS - 1)]
    seq_lens.append(0)
    perm = torch.randperm(num_blocks, generator=gen)
    table = perm[: MAX_SEQS * (MAX_MODEL_LEN // BLOCK)].view(MAX_SEQS, -1).to(torch.int32)
    static.seq_lens.copy_(torch.tensor(seq_lens, dtype=torch.int32))
    static.block_table.copy_(table)
    static.q.copy_(torch.randn(static.q.shape, generator=gen).to(BF16))
    static.kv_cache.copy_(torch.randn(static.kv_cache.shape, generator=gen).to(BF16))
    static.out.fill_(math.nan)
    static.lse.fill_(math.nan)


def _check(static: StaticInputs, scale: float, label: str) -> None:
    torch.cuda.synchronize()
    ref = reference_decode(
        static.q,
        static.kv_cache,
        static.block_table,
        static.seq_lens,
        static.query_start_loc,
        softmax_scale=scale,
        kv_lora_rank=RANK,
    )
    assert_matches_reference(static.out, static.lse, *ref, context=label)


def _tensor_fields(plan: object) -> dict[str, int]:
    return {
        field.name: value.data_ptr()
        for field in attrs.fields(type(plan))
        if isinstance(value := getattr(plan, field.name), torch.Tensor)
    }


@pytest.mark.parametrize("provider", _providers())
@pytest.mark.parametrize("qlen", [1, 3])
@pytest.mark.parametrize("strategy", mla.DECODE_STRATEGIES, ids=lambda s: s.NAME)
def test_decode_replays_after_in_place_rebuild(
    provider: str, qlen: int, strategy: type[mla.DecodeStrategy]
) -> None:
    backend = _backend(provider, strategy, qlen)
    device, heads = backend.device, backend.dims.num_heads
    gen = torch.Generator().manual_seed(qlen)
    num_blocks = backend.cache.num_blocks or 0
    static = StaticInputs(
        q=torch.empty(MAX_SEQS * qlen, heads, RANK + ROPE, dtype=BF16, device=device),
        kv_cache=torch.empty(num_blocks, BLOCK, RANK + ROPE, dtype=BF16, device=device),
        query_start_loc=torch.arange(0, (MAX_SEQS + 1) * qlen, qlen, dtype=torch.int32, device=device),
        seq_lens=torch.empty(MAX_SEQS, dtype=torch.int32, device=device),
        block_table=torch.empty(MAX_SEQS, MAX_MODEL_LEN // BLOCK, dtype=torch.int32, device=device),
        out=torch.empty(MAX_SEQS * qlen, heads, RANK, dtype=BF16, device=device),
        lse=torch.empty(MAX_SEQS * qlen, heads, dtype=torch.float32, device=device),
    )
    _fill(static, qlen, gen)
    try:
        metadata = backend.builder.build(static.step(MAX_SEQS))
    except mla.UnsupportedError as exc:
        explanation = exc.explanation
        reasons = explanation.candidate(strategy.NAME).reasons if explanation is not None else ()
        pytest.skip(f"{strategy.NAME}: {'; '.join(str(r) for r in reasons) or exc}")
    assert metadata.decode is not None
    assert metadata.decode.strategy == strategy.NAME

    def forward() -> None:
        backend.impl.forward_decode(metadata, static.q, static.kv_cache, out=static.out, lse=static.lse)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            forward()
    torch.cuda.current_stream().wait_stream(side)
    _check(static, backend.dims.scale, "eager")

    graph = torch.cuda.CUDAGraph()
    static.out.fill_(math.nan)
    static.lse.fill_(math.nan)
    with torch.cuda.graph(graph):
        forward()
    graph.replay()
    _check(static, backend.dims.scale, "first replay")

    for round_ in range(2):
        _fill(static, qlen, gen)
        rebuilt = backend.builder.build(static.step(MAX_SEQS))
        assert rebuilt.decode is not None
        assert rebuilt.decode.strategy == strategy.NAME
        # In place: the rebuilt plan reads the very buffers the graph captured.
        assert _tensor_fields(rebuilt.decode) == _tensor_fields(metadata.decode)
        graph.replay()
        _check(static, backend.dims.scale, f"replay after rebuild {round_}")
