"""Decode kernels that read the block table (issue #31, item 3), on the engine path.

* Block ids outside the cache, a past-the-cache id and a negative id in the middle of a request,
  are masked (the output is the reference over the other keys) and counted on the device
  (``backend.invalid_index_count()``), on every decode strategy that runs verify rows, on the
  providers that read the block table (torch; Triton in its CPU interpreter) and on one that
  takes the flat per-token view (the torch provider with aiter's record).
* A backend sized for 256 requests x 163,840 tokens on a block-table provider owns no per-token
  list: init plus one small build stay within 64 MB of tensors.
"""

from __future__ import annotations

import pytest
import torch

import mla
from mla.providers.torch_ref import TorchProvider
from mla.testing import reference_provider_with
from mla.tools.reference import reference_sparse

RANK, ROPE, HEADS, BLOCK, NUM_BLOCKS = 64, 16, 4, 16, 8
SCALE = 0.125
FAR_BLOCK = 1 << 20
"""A block id far past the 8-block cache: reading it would leave the allocation."""

QLENS, SEQ_LENS = (2, 1), (40, 37)
TABLE = ((3, -1, 0), (5, FAR_BLOCK, 2))
"""Request 0 (two verify rows) has a negative block in the middle (its keys 16..31), request 1
(one row) a block past the cache (its keys 16..31): 32 masked keys, 45 kept."""
MASKED_KEYS = 32


def _provider(name: str) -> str | TorchProvider:
    if name == "torch-per-token":
        # The torch provider under a record whose kernels take flat ids (as aiter's).
        return reference_provider_with(decode_reads_block_table=False)
    return name


def _backend(provider: str, strategy: str, num_blocks: int | None) -> mla.MLABackend:
    return mla.MLABackend(
        mla.MLADims(HEADS, RANK, ROPE, 32, 24, softmax_scale=SCALE),
        mla.KVCacheSpec(BLOCK, torch.float32, num_blocks=num_blocks),
        mla.EngineLimits(4, 64, 64, max_decode_qlen=2),
        model_dtype=torch.float32,
        provider=_provider(provider),  # type: ignore[arg-type]
        platform="cpu",
        decode_strategy=strategy,
        preallocate=False,  # the forced strategy runs this step's qlen (2), not every qlen
    )


def _step() -> mla.StepInputs:
    qsl = torch.tensor([0, *torch.tensor(QLENS).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(SEQ_LENS, dtype=torch.int32)
    return mla.StepInputs(
        query_start_loc_cpu=qsl,
        query_start_loc=qsl.clone(),
        seq_lens=lens.clone(),
        seq_lens_cpu=lens,
        block_table=torch.tensor(TABLE, dtype=torch.int32),
        num_decodes=len(QLENS),
        num_decode_tokens=sum(QLENS),
    )


def _reference_without_outside_keys(
    q: torch.Tensor, cache: torch.Tensor, step: mla.StepInputs
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference math over every key whose block is inside the cache: the sparse reference
    with each row selecting exactly those positions (so no outside block is ever indexed)."""
    table = step.block_table
    rows = []
    for b, (qlen, length) in enumerate(zip(QLENS, SEQ_LENS, strict=True)):
        kept = [p for p in range(length) if 0 <= int(table[b, p // BLOCK]) < NUM_BLOCKS]
        rows += [kept + [-1] * (64 - len(kept))] * qlen
    return reference_sparse(
        q,
        cache,
        table.clamp(0, NUM_BLOCKS - 1),  # only kept positions are read; the clamp is never used
        step.seq_lens,
        step.query_start_loc,
        torch.tensor(rows),
        softmax_scale=SCALE,
        kv_lora_rank=RANK,
    )


PROVIDERS = [
    "torch",
    pytest.param("triton", marks=pytest.mark.interpret),
    "torch-per-token",
]


@pytest.mark.parametrize("strategy", ["gluon-verify-flatten", "asm-padded-persistent", "asm-non-persistent"])
@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("num_blocks", [NUM_BLOCKS, None], ids=["blocks-known", "blocks-unknown"])
def test_outside_block_ids_are_masked_and_counted(
    provider: str, strategy: str, num_blocks: int | None
) -> None:
    """A past-the-cache block id and a negative one mid-request: the output is the reference
    without those keys, and the count grows by their keys at each build (negative ids always;
    ids past the cache when ``KVCacheSpec.num_blocks`` says where the cache ends: without it
    they are still masked by the kernels, against the cache tensor they are handed)."""
    if provider == "triton" and not mla.get_provider("triton").availability():
        pytest.skip("triton is unavailable here")
    backend = _backend(provider, strategy, num_blocks)
    if provider != "torch-per-token":
        assert backend.index_buffers.kv_indices is None  # no per-token list on these providers
    gen = torch.Generator().manual_seed(11)
    cache = torch.randn(NUM_BLOCKS, BLOCK, RANK + ROPE, generator=gen)
    q = torch.randn(sum(QLENS), HEADS, RANK + ROPE, generator=gen)
    step = _step()
    metadata = backend.builder.build(step)
    assert metadata.decode_decision is not None
    assert metadata.decode_decision.name == strategy
    out = torch.full((sum(QLENS), HEADS, RANK), float("nan"))
    lse = torch.full((sum(QLENS), HEADS), float("nan"))
    backend.impl.forward_decode(metadata, q, cache, out=out, lse=lse)
    want_out, want_lse = _reference_without_outside_keys(q, cache, step)
    torch.testing.assert_close(out, want_out.to(torch.float32), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, want_lse.to(torch.float32), atol=2e-5, rtol=2e-5)
    per_build = MASKED_KEYS if num_blocks is not None else 16  # unknown end: the negative block's
    assert backend.invalid_index_count() == per_build
    backend.builder.build(_step())  # counted once per build, not per layer run
    backend.impl.forward_decode(backend.current_metadata, q, cache, out=out, lse=lse)  # type: ignore[arg-type]
    assert backend.invalid_index_count() == 2 * per_build


def test_valid_steps_count_nothing() -> None:
    backend = _backend("torch", "gluon-verify-flatten", NUM_BLOCKS)
    step = _step()
    step.block_table[0, 1] = 1
    step.block_table[1, 1] = 4
    backend.builder.build(step)
    assert backend.invalid_index_count() == 0


# -- memory ---------------------------------------------------------------------------------------


def owned_tensor_bytes(root: object) -> int:
    """Bytes of the distinct tensor storages reachable from ``root`` through instance
    attributes (``__dict__`` and ``__slots__``), containers and named tuples; each storage once."""
    storages: dict[int, int] = {}
    seen: set[int] = set()
    stack: list[object] = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
            continue
        if isinstance(obj, (str, bytes, int, float, bool, type, torch.dtype, torch.device)) or obj is None:
            continue
        if isinstance(obj, dict):
            stack.extend(obj.values())
            continue
        if isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
            continue
        if hasattr(obj, "__dict__"):
            stack.extend(vars(obj).values())
        for cls in type(obj).__mro__:
            for name in getattr(cls, "__slots__", ()):
                if isinstance(name, str) and hasattr(obj, name):
                    stack.append(getattr(obj, name))
    return sum(storages.values())


def _sized_backend(provider: str | TorchProvider, max_model_len: int) -> mla.MLABackend:
    return mla.MLABackend(
        mla.MLADims(16, 512, 64, 128, 128, softmax_scale=192**-0.5),
        mla.KVCacheSpec(64, torch.bfloat16, num_blocks=4096),
        mla.EngineLimits(256, max_model_len, 8192, max_decode_qlen=4),
        model_dtype=torch.bfloat16,
        provider=provider,
        platform="cpu",
    )


def _small_build(backend: mla.MLABackend) -> None:
    """One verify step of two requests (qlen 4, 300 and 70 keys)."""
    qsl = torch.tensor([0, 4, 8], dtype=torch.int32)
    lens = torch.tensor([300, 70], dtype=torch.int32)
    width = backend.limits.max_model_len // 64
    table = torch.arange(2 * width, dtype=torch.int32).view(2, width) % 4096
    backend.builder.build(
        mla.StepInputs(
            query_start_loc_cpu=qsl, query_start_loc=qsl, seq_lens=lens, seq_lens_cpu=lens,
            block_table=table, num_decodes=2, num_decode_tokens=8,
        )
    )  # fmt: skip


@pytest.mark.interpret
def test_a_block_table_backend_owns_no_per_token_list() -> None:
    """256 requests x 163,840 tokens (block 64, 16 heads, verify qlen 4) on the Triton provider
    (its kernels read the block table): init and one small verify build own at most 64 MB of
    tensors. A per-token list would be 256 x 163,840 x 4 B = 168 MB (and verify rows' list of
    their own, 1,024 x 163,840 x 4 B = 671 MB).

    Measured as the bytes of the tensor storages the backend reaches (strategies, workspaces,
    index buffers, schedules, plans), each storage once: that is what the backend allocated and
    keeps alive, on any device. Process RSS is not used: the CPU allocator serves large zeroed
    tensors from fresh pages that count only once written, so a 168 MB list that a build writes
    a few entries of hardly shows, and the RSS also moves with Python's and Triton's own
    allocations (the interpreter, caches), unrelated to the backend.
    """
    if not mla.get_provider("triton").availability():
        pytest.skip("triton is unavailable here")
    backend = _sized_backend("triton", 163_840)
    assert backend.index_buffers.kv_indices is None
    _small_build(backend)
    owned = owned_tensor_bytes(backend)
    assert owned <= 64 * 2**20, f"{owned / 2**20:.1f} MB"
    # The walk reaches the strategies' buffers: the non-persistent paged workspace (its kernel
    # query and fp32 output rows, 1,024 x 16 heads) is most of it.
    strategy = backend.decode_strategies["asm-non-persistent"]
    assert owned >= strategy.workspace.q_kernel.nbytes + strategy.workspace.o_kernel.nbytes  # type: ignore[attr-defined]


def test_the_walk_sees_a_per_token_list() -> None:
    """The measurement above counts a per-token list when there is one (a provider whose kernels
    take flat ids; a smaller model length keeps this test light)."""
    provider = reference_provider_with(decode_reads_block_table=False)
    backend = _sized_backend(provider, 16_384)
    _small_build(backend)
    indices = backend.index_buffers.kv_indices
    assert indices is not None
    assert indices.numel() == 256 * 16_384 + 1
    assert owned_tensor_bytes(backend) >= indices.nbytes
