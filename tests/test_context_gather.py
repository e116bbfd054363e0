"""The chunked-context gather (:class:`mla.providers.calls.GatherContextCall`): its partition
(:func:`mla.providers.context_gather.context_rows_inside`) against its definition, a stable sort
of the chunk's tokens by request with the tokens outside the cache (and past the last request)
in one bin after every request; the torch form and the Triton kernels against that definition
(the kernels in Triton's CPU interpreter without a GPU, compiled on one); every rejected call."""

from __future__ import annotations

from collections.abc import Callable

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mla.core.errors import InvalidInputError
from mla.prefill.base import ContextChunk
from mla.prefill.flash_varlen import gather_context
from mla.providers.calls import GatherContextCall
from mla.providers.context_gather import context_rows_inside, gather_context_rows, zero_rows
from mla.providers.torch_ref import TorchProvider

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _triton_gather(call: GatherContextCall) -> None:
    pytest.importorskip("triton")
    from mla.providers.triton.context_gather import gather_context as triton_gather

    triton_gather(call)


GATHERS: dict[str, Callable[[GatherContextCall], None]] = {
    "torch": gather_context_rows,
    "triton": _triton_gather,
}
CACHE_ROWS = 12


def _partition_by_definition(
    ids: list[int], cu: list[int], cache_rows: int
) -> tuple[list[int], list[bool], list[int]]:
    """``(rows, inside, cu_seqlens_k)`` by a stable sort on (request if inside else B)."""
    requests = len(cu) - 1

    def request_of(position: int) -> int:
        return next((r for r in range(requests) if position < cu[r + 1]), requests)

    keys = [
        request_of(p) if 0 <= token < cache_rows and p < cu[-1] else requests for p, token in enumerate(ids)
    ]
    order = sorted(range(len(ids)), key=lambda p: keys[p])
    counts = [sum(1 for key in keys if key == r) for r in range(requests)]
    cu_inside = [sum(counts[:r]) for r in range(requests + 1)]
    rows = [min(max(ids[p], 0), cache_rows - 1) for p in order]
    return rows, [keys[p] < requests for p in order], cu_inside


@st.composite
def chunks(draw: st.DrawFn) -> tuple[ContextChunk, list[int], list[int]]:
    lens = draw(st.lists(st.integers(0, 6), min_size=1, max_size=5))
    cu = [sum(lens[:r]) for r in range(len(lens) + 1)]
    spare = draw(st.integers(0, 3))  # workspace entries past the chunk's tokens (never read)
    past = draw(st.integers(0, 2))  # tokens past the last request's (no request attends them)
    count = cu[-1] + past
    tokens = draw(st.lists(st.integers(-3, CACHE_ROWS + 3), min_size=count, max_size=count))
    workspace = torch.tensor([*tokens, *[-7] * spare], dtype=torch.int32)
    chunk = ContextChunk(
        token_indices=workspace,
        cu_seqlens_k=torch.tensor(cu, dtype=torch.int32),
        max_seqlen_k=max(lens),
        num_tokens=count,
    )
    return chunk, tokens, cu


@settings(max_examples=200, deadline=None)
@given(chunks())
def test_partition_matches_its_definition(case: tuple[ContextChunk, list[int], list[int]]) -> None:
    chunk, tokens, cu = case
    rows, inside, cu_inside = context_rows_inside(
        chunk.token_indices[: chunk.num_tokens], chunk.cu_seqlens_k, CACHE_ROWS
    )
    want_rows, want_inside, want_cu = _partition_by_definition(tokens, cu, CACHE_ROWS)
    assert rows.tolist() == want_rows
    assert inside.tolist() == want_inside
    assert cu_inside.dtype == torch.int32
    assert cu_inside.tolist() == want_cu


def test_gathered_rows_outside_the_cache_are_zero_even_where_the_cache_is_nan() -> None:
    cache = torch.full((CACHE_ROWS, 4), float("nan"))
    cache[3] = 1.0
    cache[5] = 2.0
    chunk = ContextChunk(
        token_indices=torch.tensor([5, -1, 3, 99, 3], dtype=torch.int32),
        cu_seqlens_k=torch.tensor([0, 2, 5], dtype=torch.int32),
        max_seqlen_k=3,
        num_tokens=5,
    )
    latent, cu_inside = gather_context(TorchProvider(), chunk, cache, None, torch.float32)
    assert cu_inside.tolist() == [0, 1, 3]
    want = torch.tensor([[2.0] * 4, [1.0] * 4, [1.0] * 4, [0.0] * 4, [0.0] * 4])
    torch.testing.assert_close(latent, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("width", [576, 4, 3, 1])
def test_zero_rows_writes_positive_zeros_over_nan_rows_only(width: int, dtype: torch.dtype) -> None:
    """Rows of 8-byte multiples take the 64-bit view, the others the plain fill: both +0.0."""
    rows = torch.full((5, width), float("nan"), dtype=dtype)
    rows[1] = -1.5
    rows[3] = 2.0
    kept = rows.clone()
    mask = torch.tensor([True, False, True, False, True])
    zero_rows(rows, mask)
    assert (rows[mask] == 0).all()
    assert not torch.signbit(rows[mask].float()).any()
    torch.testing.assert_close(rows[~mask], kept[~mask])


# (cache dtype, out dtype, kv_scale): as is, the 16-bit casts, an fp8 cache dequantized
DTYPES = {
    "f32": (torch.float32, torch.float32, None),
    "bf16": (torch.bfloat16, torch.bfloat16, None),
    "f16-to-f32": (torch.float16, torch.float32, None),
    "e4m3-to-bf16": (torch.float8_e4m3fn, torch.bfloat16, 0.5),
    "e4m3-to-f32-unscaled": (torch.float8_e4m3fn, torch.float32, None),
}


def _cache(rows: int, width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    values = torch.randint(-16, 17, (rows, width), generator=gen).float() / 4  # exact in e4m3
    return values.to(dtype).to(DEVICE)


def _want(cache: torch.Tensor, tokens: list[int], cu: list[int], out_dtype: torch.dtype, scale: float | None):
    rows, inside, want_cu = _partition_by_definition(tokens, cu, cache.shape[0])
    values = cache.cpu().float()[torch.tensor(rows, dtype=torch.int64)] if rows else cache.cpu().float()[:0]
    if scale is not None:
        values = values * scale
    values[~torch.tensor(inside, dtype=torch.bool)] = 0.0
    return values.to(out_dtype), want_cu


@pytest.mark.parametrize("dtypes", sorted(DTYPES))
@pytest.mark.parametrize("gather", sorted(GATHERS))
@settings(max_examples=25, deadline=None)
@given(case=chunks(), width=st.sampled_from([576, 24, 5]))
def test_gather_matches_its_definition(
    gather: str, dtypes: str, case: tuple[ContextChunk, list[int], list[int]], width: int
) -> None:
    chunk, tokens, cu = case
    cache_dtype, out_dtype, scale = DTYPES[dtypes]
    cache = _cache(CACHE_ROWS, width, cache_dtype, seed=len(tokens))
    n = chunk.num_tokens
    out = torch.full((n, width), float("nan"), dtype=out_dtype, device=DEVICE)
    cu_out = torch.full_like(chunk.cu_seqlens_k, -5).to(DEVICE)
    call = GatherContextCall(
        cache=cache, token_ids=chunk.token_indices[:n].to(DEVICE), cu_seqlens_k=chunk.cu_seqlens_k.to(DEVICE),
        kv_scale=None if scale is None else torch.tensor([scale], device=DEVICE), out=out,
        cu_seqlens_out=cu_out,
    )  # fmt: skip
    GATHERS[gather](call)
    want, want_cu = _want(cache, tokens, cu, out_dtype, scale)
    assert cu_out.tolist() == want_cu
    assert torch.equal(out.cpu(), want)  # every row written (no NaN left), bitwise
    assert not torch.signbit(out.cpu().float()[out.cpu().float() == 0]).any()  # +0.0 rows


@pytest.mark.parametrize("gather", sorted(GATHERS))
def test_an_empty_chunk_writes_zero_offsets(gather: str) -> None:
    cu_out = torch.full((3,), 7, dtype=torch.int32, device=DEVICE)
    call = GatherContextCall(
        cache=_cache(4, 8, torch.float32, 0), token_ids=torch.empty(0, dtype=torch.int32, device=DEVICE),
        cu_seqlens_k=torch.zeros(3, dtype=torch.int32, device=DEVICE), kv_scale=None,
        out=torch.empty(0, 8, device=DEVICE), cu_seqlens_out=cu_out,
    )  # fmt: skip
    GATHERS[gather](call)
    assert cu_out.tolist() == [0, 0, 0]


def _good_call() -> GatherContextCall:
    return GatherContextCall(
        cache=torch.zeros(6, 8), token_ids=torch.tensor([0, 1, 2], dtype=torch.int32),
        cu_seqlens_k=torch.tensor([0, 3], dtype=torch.int32), kv_scale=None, out=torch.empty(3, 8),
        cu_seqlens_out=torch.empty(2, dtype=torch.int32),
    )  # fmt: skip


BAD_CALLS = {
    "cache": {"cache": torch.zeros(6)},
    "cache-strided": {"cache": torch.zeros(8, 6).t()},
    "token_ids": {"token_ids": torch.tensor([0, 1, 2])},
    "token_ids-2d": {"token_ids": torch.zeros(3, 1, dtype=torch.int32)},
    "cu_seqlens_k": {"cu_seqlens_k": torch.tensor([0, 3])},
    "cu_seqlens_k-empty": {"cu_seqlens_k": torch.empty(0, dtype=torch.int32)},
    "out": {"out": torch.empty(3, 7)},
    "out-dtype": {"out": torch.empty(3, 8, dtype=torch.int32)},
    "out-strided": {"out": torch.empty(8, 3).t()},
    "cu_seqlens_out": {"cu_seqlens_out": torch.empty(2, dtype=torch.int64)},
    "kv_scale": {"kv_scale": torch.ones(2)},
}


@pytest.mark.parametrize("gather", sorted(GATHERS))
@pytest.mark.parametrize("bad", sorted(BAD_CALLS))
def test_a_bad_call_is_rejected_naming_its_field(gather: str, bad: str) -> None:
    call = attrs.evolve(_good_call(), **BAD_CALLS[bad])
    with pytest.raises(InvalidInputError) as info:
        GATHERS[gather](call)
    assert info.value.argument == bad.split("-", maxsplit=1)[0]


def test_the_torch_form_takes_a_good_call() -> None:
    call = _good_call()
    gather_context_rows(call)
    assert call.cu_seqlens_out.tolist() == [0, 3]


def test_the_torch_form_takes_a_cache_that_requires_grad() -> None:
    """A traced layer's cache may require grad; ``index_select``'s ``out=`` form refuses one."""
    call = attrs.evolve(_good_call(), cache=torch.arange(48.0).reshape(6, 8).requires_grad_())
    gather_context_rows(call)
    torch.testing.assert_close(call.out, torch.arange(24.0).reshape(3, 8))
