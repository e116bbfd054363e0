"""The chunked-context gather's partition (:func:`mla.prefill.flash_varlen.context_rows_inside`)
against its definition: a stable sort of the chunk's tokens by request, tokens outside the cache
(and past the last request) in one bin after every request."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mla.prefill.base import ContextChunk
from mla.prefill.flash_varlen import context_rows_inside, gather_context, zero_rows

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
    rows, inside, cu_inside = context_rows_inside(chunk, CACHE_ROWS)
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
    latent, cu_inside = gather_context(chunk, cache, None, torch.float32)
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
