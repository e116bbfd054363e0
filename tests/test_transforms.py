"""Property tests of the index and tensor transforms the strategies share.

Head padding, qlen padding maps, verify-row windows, the split-KV schedule, the per-row page
table gather, page-index expansion, KV writes and state merges, each against its definition.
Device-side planners also run on the ``meta`` device, which has no values: any host read or
value-dependent shape there raises, so they need no host sync.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mla.core.errors import PlanMismatchError
from mla.providers import TorchProvider
from mla.providers.calls import ExpandPagesCall, FillPagesCall, MergeStatesCall, WriteKVCall
from mla.providers.split_kv import SplitKVSchedule
from mla.providers.transforms import (
    HeadPadding,
    HeadPadMode,
    gather_row_page_table,
    qlen_padding_maps,
    verify_row_lengths,
)
from mla.tools.reference import causal_visible, merge_reference

SETTINGS = settings(max_examples=40, deadline=None)
META = torch.device("meta")


def _indptr(lengths: list[int]) -> torch.Tensor:
    out = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    out[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
    return out


# -- head padding -----------------------------------------------------------------------------


@st.composite
def head_counts(draw: st.DrawFn) -> tuple[int, int]:
    heads = draw(st.integers(1, 40))
    # The aiter rule (next multiple of 16) or any larger count.
    kernel = -(-heads // 16) * 16 if draw(st.booleans()) else draw(st.integers(heads, 3 * heads + 5))
    return heads, kernel


@SETTINGS
@given(counts=head_counts(), tokens=st.integers(1, 5))
def test_head_padding_round_trip(counts: tuple[int, int], tokens: int) -> None:
    heads, kernel_heads = counts
    padding = HeadPadding(heads, kernel_heads)
    q = torch.randn(tokens, heads, 3)
    padded = padding.pad(q, torch.full((tokens, kernel_heads, 3), math.nan))
    assert not torch.isnan(padded).any()
    assert torch.equal(padding.unpad(padded), q)
    # Every kernel head is a copy of a real head (so its output is a real head's output).
    mode = padding.mode
    for j in range(kernel_heads):
        source = (
            j
            if mode is HeadPadMode.NONE
            else (j // (kernel_heads // heads) if mode is HeadPadMode.REPEAT else j % heads)
        )
        assert torch.equal(padded[:, j], q[:, source])


def test_head_padding_modes() -> None:
    assert HeadPadding(8, 16).mode is HeadPadMode.REPEAT
    assert HeadPadding(12, 16).mode is HeadPadMode.TILE
    assert HeadPadding(24, 32).mode is HeadPadMode.TILE
    assert HeadPadding(16, 16).mode is HeadPadMode.NONE
    with pytest.raises(ValueError, match="kernel_heads 4 < num_heads 8"):
        HeadPadding(8, 4)


# -- qlen padding -----------------------------------------------------------------------------


@st.composite
def padded_batches(draw: st.DrawFn) -> tuple[list[int], int, int, list[int]]:
    """(qlens <= kernel qlen, kernel qlen, extra trailing rows, seq lens; 0 = graph padding)."""
    kernel_qlen = draw(st.integers(1, 8))
    qlens = draw(st.lists(st.integers(0, kernel_qlen), min_size=1, max_size=6))
    extra = draw(st.integers(0, 4))
    seq_lens = [draw(st.integers(q, 40)) if draw(st.booleans()) or q else 0 for q in qlens]
    return qlens, kernel_qlen, extra, seq_lens


@SETTINGS
@given(batch=padded_batches())
def test_qlen_padding_maps(batch: tuple[list[int], int, int, list[int]]) -> None:
    qlens, kernel_qlen, extra, _ = batch
    qsl = _indptr(qlens)
    tokens = int(qsl[-1]) + extra
    maps = qlen_padding_maps(qsl, tokens, kernel_qlen)
    num_kernel = len(qlens) * kernel_qlen
    assert maps.num_kernel_rows == num_kernel
    assert maps.qo_indptr.dtype == torch.int32
    assert maps.qo_indptr.tolist() == list(range(0, num_kernel + 1, kernel_qlen))
    for b, qlen in enumerate(qlens):
        rows = maps.source_token[b * kernel_qlen : (b + 1) * kernel_qlen].tolist()
        lead = kernel_qlen - qlen
        # Zero rows are prepended; the request's tokens follow in order.
        assert rows == [-1] * lead + list(range(int(qsl[b]), int(qsl[b]) + qlen))
        for i in range(qlen):
            kernel_row = int(maps.kernel_row[int(qsl[b]) + i])
            assert int(maps.source_token[kernel_row]) == int(qsl[b]) + i
    # Rows no request owns read the sink row.
    assert maps.kernel_row[int(qsl[-1]) :].tolist() == [num_kernel] * extra


def test_qlen_padding_rejects_a_request_longer_than_the_kernel_qlen() -> None:
    with pytest.raises(ValueError, match="qlen 5 > kernel qlen 4"):
        qlen_padding_maps(torch.tensor([0, 5]), 5, 4)


# -- verify rows ------------------------------------------------------------------------------


@SETTINGS
@given(batch=padded_batches())
def test_verify_row_lengths_are_right_aligned_causal_windows(
    batch: tuple[list[int], int, int, list[int]],
) -> None:
    qlens, _, extra, seq_lens = batch
    qsl = _indptr(qlens)
    tokens = int(qsl[-1]) + extra
    request, window = verify_row_lengths(qsl, torch.tensor(seq_lens), tokens)
    assert request.shape == window.shape == (tokens,)
    for b, (qlen, s) in enumerate(zip(qlens, seq_lens, strict=True)):
        expected = causal_visible(qlen, s).sum(dim=1).tolist() if s else [0] * qlen
        lo, hi = int(qsl[b]), int(qsl[b + 1])
        assert window[lo:hi].tolist() == expected
        assert request[lo:hi].tolist() == [b] * qlen
    assert request[int(qsl[-1]) :].tolist() == [-1] * extra
    assert window[int(qsl[-1]) :].tolist() == [0] * extra


# -- split-KV schedule --------------------------------------------------------------------------


@SETTINGS
@given(
    kv_lens=st.lists(st.integers(0, 300), min_size=1, max_size=8),
    spare=st.integers(0, 3),
    num_units=st.integers(1, 40),
    min_chunk=st.sampled_from([1, 16, 64]),
)
def test_split_kv_schedule_covers_each_request_once(
    kv_lens: list[int], spare: int, num_units: int, min_chunk: int
) -> None:
    batch = len(kv_lens)
    schedule = SplitKVSchedule.allocate(
        max_batch=batch + spare,
        max_kernel_qlen=2,
        kernel_heads=4,
        kv_lora_rank=8,
        num_units=num_units,
        device=torch.device("cpu"),
        min_chunk=min_chunk,
    )
    indptr = _indptr(kv_lens).to(torch.int32)
    schedule.plan(torch.cat([indptr, indptr[-1:].repeat(spare)]), batch)
    info = schedule.work_info.tolist()
    assert len(info) == schedule.max_work == batch + spare + num_units
    live = [item for item in info if item[0] >= 0]
    assert all(item == [-1, 0, 0, 0] for item in info[len(live) :])  # idle items trail
    split = schedule.split_indptr[: batch + 1].tolist()
    assert split[0] == 0
    for b in range(batch):
        items = [item for item in live if item[0] == b]
        assert len(items) >= 1
        assert [item[3] for item in items] == list(range(len(items)))
        assert split[b + 1] - split[b] == len(items)
        # Contiguous, non-overlapping, exactly the request's KV range.
        assert items[0][1] == int(indptr[b])
        assert items[-1][2] == int(indptr[b + 1])
        for first, second in itertools.pairwise(items):
            assert first[2] == second[1]
        assert all(item[1] <= item[2] for item in items)
        assert all(item[2] - item[1] <= int(schedule.chunk[0]) for item in items)
    assert int(schedule.chunk[0]) >= min_chunk


def test_split_kv_schedule_plans_without_host_reads() -> None:
    schedule = SplitKVSchedule.allocate(
        max_batch=8, max_kernel_qlen=4, kernel_heads=16, kv_lora_rank=8, num_units=32, device=META
    )
    schedule.plan(torch.empty(9, dtype=torch.int32, device=META), 8)


def test_split_kv_schedule_rejects_a_batch_over_its_size() -> None:
    schedule = SplitKVSchedule.allocate(
        max_batch=2,
        max_kernel_qlen=1,
        kernel_heads=1,
        kv_lora_rank=8,
        num_units=4,
        device=torch.device("cpu"),
    )
    with pytest.raises(PlanMismatchError, match="batch_size 3 exceeds"):
        schedule.plan(torch.zeros(4, dtype=torch.int32), 3)


# -- per-row page tables -------------------------------------------------------------------------


@SETTINGS
@given(batch=padded_batches(), seed=st.integers(0, 1000))
def test_gather_row_page_table(batch: tuple[list[int], int, int, list[int]], seed: int) -> None:
    qlens, _, extra, seq_lens = batch
    gen = torch.Generator().manual_seed(seed)
    qsl = _indptr(qlens)
    tokens = int(qsl[-1]) + extra
    kv_indptr = _indptr(seq_lens)
    kv_indices = torch.randint(0, 10_000, (int(kv_indptr[-1]) + 3,), generator=gen, dtype=torch.int32)
    request, window = verify_row_lengths(qsl, torch.tensor(seq_lens), tokens)
    row_indptr = _indptr(window.tolist())
    total = int(row_indptr[-1])
    out = torch.full((total + 5,), -7, dtype=torch.int32)
    gather_row_page_table(kv_indices, kv_indptr, request, row_indptr, total=total, out=out)
    for t in range(tokens):
        length = int(window[t])
        got = out[int(row_indptr[t]) : int(row_indptr[t]) + length].tolist()
        if length:
            start = int(kv_indptr[int(request[t])])
            assert got == kv_indices[start : start + length].tolist()
    assert out[total:].tolist() == [-7] * 5


def test_gather_row_page_table_without_host_reads() -> None:
    out = torch.empty(64, dtype=torch.int32, device=META)
    gather_row_page_table(
        torch.empty(64, dtype=torch.int32, device=META),
        torch.empty(4, dtype=torch.int32, device=META),
        torch.empty(6, dtype=torch.int64, device=META),
        torch.empty(7, dtype=torch.int64, device=META),
        total=30,
        out=out,
    )


# -- page-index expansion -------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [1, 16, 64])
@settings(max_examples=20, deadline=None)
@given(seq_lens=st.lists(st.integers(0, 150), min_size=1, max_size=5), seed=st.integers(0, 1000))
def test_expand_page_indices(block_size: int, seq_lens: list[int], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    width = max(1, -(-max(seq_lens) // block_size))
    table = torch.randint(0, 500, (len(seq_lens), width), generator=gen, dtype=torch.int32)
    indptr = _indptr(seq_lens).to(torch.int32)
    total = int(indptr[-1])
    out = torch.full((total + 4,), -9, dtype=torch.int32)
    TorchProvider().expand_page_indices(
        ExpandPagesCall(block_table=table, kv_indptr=indptr, out=out, block_size=block_size, num_tokens=total)
    )
    expected = [
        int(table[r, t // block_size]) * block_size + t % block_size
        for r, s in enumerate(seq_lens)
        for t in range(s)
    ]
    assert out[:total].tolist() == expected
    assert out[total:].tolist() == [-9] * 4


def test_expand_page_indices_without_host_reads() -> None:
    TorchProvider().expand_page_indices(
        ExpandPagesCall(
            block_table=torch.empty(4, 3, dtype=torch.int32, device=META),
            kv_indptr=torch.empty(5, dtype=torch.int32, device=META),
            out=torch.empty(64, dtype=torch.int32, device=META),
            block_size=16,
            num_tokens=40,
        )
    )


def _fill_expected(
    table: torch.Tensor, seq_lens: list[int], block_size: int, max_len: int, num_blocks: int | None
) -> tuple[list[int], list[int]]:
    """:class:`FillPagesCall`'s definition, spelled out: (kv_indptr, kv_indices[:total])."""
    indptr, indices = [0], []
    for r, raw in enumerate(seq_lens):
        length = min(max(raw, 0), max_len)
        for t in range(length):
            block = int(table[r, t // block_size])
            # Outside the cache: marked -1 (the readers mask it), never clamped into a block.
            outside = block < 0 or (num_blocks is not None and block >= num_blocks)
            indices.append(-1 if outside else block * block_size + t % block_size)
        indptr.append(indptr[-1] + length)
    return indptr, indices


def fill_case(
    block_size: int, seq_lens: list[int], seed: int, num_blocks: int | None, *, token_ids: bool = True
) -> tuple[FillPagesCall, torch.Tensor, int]:
    """A fill call over a random table (ids -3..40, some outside ``num_blocks``), with lengths
    from -2 up past the table's capacity, and its query indptr to copy; ``token_ids=False``:
    no per-token list (the indptr and the count alone, for kernels that read the table)."""
    gen = torch.Generator().manual_seed(seed)
    width = max(1, -(-max(*seq_lens, 1) // block_size))
    max_len = max(0, min(width * block_size, max(seq_lens) - 3))
    table = torch.randint(-3, 40, (len(seq_lens), width), generator=gen, dtype=torch.int32)
    qsl = torch.randint(0, 3, (len(seq_lens) + 1,), generator=gen).cumsum(0)
    qsl[0] = 0
    call = FillPagesCall(
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
        block_table=table,
        kv_indptr=torch.full((len(seq_lens) + 1,), 77, dtype=torch.int32),
        kv_indices=(torch.full((len(seq_lens) * max_len + 1,), -9, dtype=torch.int32) if token_ids else None),
        block_size=block_size,
        max_len=max_len,
        num_blocks=num_blocks,
        query_start_loc=qsl,
        qo_indptr=torch.full((len(seq_lens) + 1,), -5, dtype=torch.int32),
        invalid_count=torch.full((1,), 5, dtype=torch.int32),
        length_count=torch.full((1,), 3, dtype=torch.int32),
    )
    return call, qsl, max_len


def check_fill(call: FillPagesCall, qsl: torch.Tensor, seq_lens: list[int], max_len: int) -> None:
    indptr, indices = _fill_expected(call.block_table, seq_lens, call.block_size, max_len, call.num_blocks)
    assert call.kv_indptr.tolist() == indptr
    if call.kv_indices is not None:
        assert call.kv_indices[: indptr[-1]].tolist() == indices
    assert call.qo_indptr is not None
    assert call.qo_indptr.tolist() == qsl.tolist()
    # The tokens outside the cache (the -1 marks) are added to the counter (it started at 5).
    assert call.invalid_count is not None
    assert int(call.invalid_count) == 5 + indices.count(-1)
    # The requests with a bad length (negative, past max_len, or 0 < seq_len < qlen) are added
    # to their counter (it started at 3).
    qlens = (qsl[1:] - qsl[:-1]).tolist()
    bad = sum(1 for s, q in zip(seq_lens, qlens, strict=True) if s < 0 or s > max_len or 0 < s < q)
    assert call.length_count is not None
    assert int(call.length_count) == 3 + bad


@pytest.mark.parametrize("token_ids", [True, False], ids=["per-token", "block-table"])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("num_blocks", [None, 25])
@settings(max_examples=20, deadline=None)
@given(seq_lens=st.lists(st.integers(-2, 90), min_size=1, max_size=6), seed=st.integers(0, 1000))
def test_fill_page_indices_default(
    token_ids: bool, block_size: int, num_blocks: int | None, seq_lens: list[int], seed: int
) -> None:
    call, qsl, max_len = fill_case(block_size, seq_lens, seed, num_blocks, token_ids=token_ids)
    TorchProvider().fill_page_indices(call)
    check_fill(call, qsl, seq_lens, max_len)


@pytest.mark.parametrize("token_ids", [True, False], ids=["per-token", "block-table"])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("num_blocks", [None, 25])
@pytest.mark.parametrize(
    "seq_lens",
    [[5], [0, 17, -2, 90, 33], [40] * 130, [1, 1024, 0, 3000, 7]],
    ids=["one", "mixed", "130-requests", "long"],
)
def test_fill_page_indices_triton_kernel(
    token_ids: bool, block_size: int, num_blocks: int | None, seq_lens: list[int]
) -> None:
    """The Triton provider's one-launch fill (interpreted on a CPU): the same definition,
    including more requests than one prefix block (128) and several token (or page) chunks
    (1024), and the count of the tokens outside the cache."""
    pytest.importorskip("triton")
    from mla.providers.triton import TritonProvider

    call, qsl, max_len = fill_case(block_size, seq_lens, 3, num_blocks, token_ids=token_ids)
    TritonProvider().fill_page_indices(call)
    check_fill(call, qsl, seq_lens, max_len)


def test_fill_page_indices_without_host_reads() -> None:
    TorchProvider().fill_page_indices(
        FillPagesCall(
            seq_lens=torch.empty(4, dtype=torch.int32, device=META),
            block_table=torch.empty(4, 3, dtype=torch.int32, device=META),
            kv_indptr=torch.empty(5, dtype=torch.int32, device=META),
            kv_indices=torch.empty(4 * 48 + 1, dtype=torch.int32, device=META),
            block_size=16,
            max_len=48,
            num_blocks=12,
            query_start_loc=torch.empty(5, dtype=torch.int32, device=META),
            qo_indptr=torch.empty(5, dtype=torch.int32, device=META),
        )
    )


# -- KV writes --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
@settings(max_examples=15, deadline=None)
@given(
    rows=st.integers(1, 12), skip=st.lists(st.booleans(), min_size=12, max_size=12), seed=st.integers(0, 1000)
)
def test_write_kv(dtype: torch.dtype, rows: int, skip: list[bool], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    blocks, block_size, rank, rope = 4, 4, 8, 4
    fp8 = dtype == torch.float8_e4m3fn
    kv_scale = torch.tensor([0.1]) if fp8 else None
    cache = (torch.randn(blocks, block_size, rank + rope, generator=gen) / (0.1 if fp8 else 1.0)).to(dtype)
    before = cache.clone()
    slots = torch.randperm(blocks * block_size, generator=gen)[:rows]
    slots = torch.where(torch.tensor(skip[:rows]), torch.full_like(slots, -1), slots)
    kv_c = torch.randn(rows, rank, generator=gen)
    k_pe = torch.randn(rows, rope, generator=gen)
    TorchProvider().write_kv(
        WriteKVCall(kv_c=kv_c, k_pe=k_pe, kv_cache=cache, slot_mapping=slots, kv_scale=kv_scale)
    )
    flat, flat_before = cache.view(-1, rank + rope).float(), before.view(-1, rank + rope).float()
    values = torch.cat([kv_c, k_pe], dim=-1)
    expected_rows = (values if kv_scale is None else values / kv_scale).to(dtype).float()
    written = set()
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            written.add(slot)
            assert torch.equal(flat[slot], expected_rows[i])
    for slot in range(blocks * block_size):
        if slot not in written:
            assert torch.equal(flat[slot], flat_before[slot]), f"slot {slot} was not to be written"


# -- state merge ------------------------------------------------------------------------------


@SETTINGS
@given(
    tokens=st.integers(1, 6),
    heads=st.integers(1, 4),
    empty_a=st.lists(st.booleans(), min_size=24, max_size=24),
    empty_b=st.lists(st.booleans(), min_size=24, max_size=24),
    seed=st.integers(0, 1000),
    alias=st.booleans(),
)
def test_merge_states_matches_reference(
    tokens: int, heads: int, empty_a: list[bool], empty_b: list[bool], seed: int, alias: bool
) -> None:
    gen = torch.Generator().manual_seed(seed)
    dim = 5
    o_a, o_b = torch.randn(tokens, heads, dim, generator=gen), torch.randn(tokens, heads, dim, generator=gen)
    lse_a, lse_b = (
        3 * torch.randn(tokens, heads, generator=gen),
        3 * torch.randn(tokens, heads, generator=gen),
    )
    count = tokens * heads
    mask_a = torch.tensor(empty_a[:count]).view(tokens, heads)
    mask_b = torch.tensor(empty_b[:count]).view(tokens, heads)
    # An empty state has lse -inf and o 0 (the provider contract for rows with no key).
    lse_a, lse_b = lse_a.masked_fill(mask_a, -math.inf), lse_b.masked_fill(mask_b, -math.inf)
    o_a, o_b = o_a.masked_fill(mask_a[..., None], 0.0), o_b.masked_fill(mask_b[..., None], 0.0)
    ref_o, ref_lse = merge_reference(o_a, lse_a, o_b, lse_b)
    out = o_a.clone() if alias else torch.full_like(o_a, math.nan)
    lse_out = torch.full_like(lse_a, math.nan)
    TorchProvider().merge_states(
        MergeStatesCall(
            o_a=out if alias else o_a, lse_a=lse_a, o_b=o_b, lse_b=lse_b, out=out, lse_out=lse_out
        )
    )
    assert torch.equal(torch.isneginf(lse_out), torch.isneginf(ref_lse))
    assert torch.equal(torch.isneginf(lse_out), mask_a & mask_b)
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse_out[finite].double(), ref_lse[finite], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.double(), ref_o, rtol=1e-5, atol=1e-6)
