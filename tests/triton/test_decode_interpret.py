"""Triton decode-side kernels in the CPU interpreter against the torch reference provider.

Runs with ``TRITON_INTERPRET=1`` (set by tests/conftest.py when no GPU is present); on a GPU the
same tests run compiled. The interpreter computes ``tl.dot`` on bf16 wrongly, so inputs are
fp16/fp32, and dims are tiny (kv_lora_rank 32 or 48, rope 16 or 8) to keep the file fast.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import attrs
import pytest
import torch

pytest.importorskip("triton")

from mla.core.capabilities import Contract
from mla.core.platform import simulated_platform
from mla.decode.asm_non_persistent import AsmNonPersistent
from mla.decode.asm_padded_persistent import PaddedAsmPersistent
from mla.decode.gluon import GluonDecode
from mla.decode.gluon_verify_flatten import GluonVerifyFlatten
from mla.providers import get_provider
from mla.providers.calls import (
    ExpandPagesCall,
    MergeStatesCall,
    PagedDecodeCall,
    PlanDecodeScheduleCall,
    SmallHeadDecodeCall,
    WriteKVCall,
)
from mla.providers.split_kv import SplitKVSchedule
from mla.providers.torch_ref import TorchProvider
from mla.providers.triton import TritonProvider
from mla.providers.triton.decode import launch_kernel, paged_decode
from mla.providers.triton.decode_launch import DecodeInputs, launch_split_decode
from mla.providers.triton.schedule import DecodeLaunchConfig, allocate_schedule, decode_launch_config
from mla.testing import DecodeCase, check_decode_strategy

pytestmark = pytest.mark.interpret

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
REF = TorchProvider()
TRITON = TritonProvider()


def _indptr(lengths: list[int]) -> torch.Tensor:
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    out[1:] = torch.cumsum(torch.tensor(lengths), 0)
    return out.to(DEVICE)


def _poisoned(rows: int, heads: int, dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.full((rows, heads, dim), math.nan, dtype=dtype, device=DEVICE)
    return out, torch.full((rows, heads), math.nan, dtype=torch.float32, device=DEVICE)


def _assert_close(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    (o, lse), (o_ref, lse_ref) = got, want
    assert not torch.isnan(o).any(), "unwritten output rows"
    assert not torch.isnan(lse).any(), "unwritten lse rows"
    assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_ref))
    tol = 2e-3 if o.dtype == torch.float16 else 1e-5
    torch.testing.assert_close(o.float(), o_ref.float(), atol=tol, rtol=tol)
    finite = torch.isfinite(lse_ref)
    torch.testing.assert_close(lse[finite], lse_ref[finite], atol=1e-4, rtol=1e-4)


class _PagedBatch:
    """Mixed-qlen batch with an empty request and a request whose early rows see no key."""

    def __init__(
        self, *, heads: int, rank: int, rope: int, dtype: torch.dtype, kv_dtype: torch.dtype
    ) -> None:
        gen = torch.Generator().manual_seed(heads * 7 + rank)
        self.qlens = [1, 3, 2, 0, 4]
        self.seq_lens = [37, 5, 70, 0, 2]  # the last request: rows 0 and 1 see no key
        self.heads, self.rank = heads, rank
        total = sum(self.seq_lens)
        num_tok = total + 20
        cache = torch.randn(num_tok, rank + rope, generator=gen) * (2.0 if kv_dtype.itemsize == 1 else 1.0)
        self.kv_scale = torch.tensor([0.5], device=DEVICE) if kv_dtype.itemsize == 1 else None
        self.cache = cache.to(kv_dtype).to(DEVICE)
        self.kv_indices = torch.randperm(num_tok, generator=gen)[:total].to(torch.int32).to(DEVICE)
        self.kv_indptr = _indptr(self.seq_lens)
        self.qo_indptr = _indptr(self.qlens)
        self.q = torch.randn(sum(self.qlens), heads, rank + rope, generator=gen).to(dtype).to(DEVICE)
        self.dtype = dtype

    def run(
        self, decode: Callable[..., None], *, schedule: SplitKVSchedule | None = None, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run ``decode`` (``paged_mqa_decode`` or a launcher taking its call) into poisoned outputs."""
        out, lse = _poisoned(self.q.shape[0], self.heads, self.rank, self.dtype)
        call = PagedDecodeCall(
            q=self.q,
            kv_cache=self.cache,
            kv_indptr=self.kv_indptr,
            kv_indices=self.kv_indices,
            qo_indptr=self.qo_indptr,
            out=out,
            lse=lse,
            max_qlen=4,
            max_seqlen_k=80,
            page_size=1,
            softmax_scale=0.3,
            kv_scale=self.kv_scale,
            schedule=schedule,
        )
        decode(call, **kwargs)
        return out, lse


@pytest.mark.parametrize(
    ("heads", "rank", "rope", "dtype", "kv_dtype", "splits", "reg_pipeline"),
    [
        (4, 32, 16, torch.float16, torch.float16, 1, False),
        (4, 32, 16, torch.float16, torch.float16, 3, True),
        (3, 48, 8, torch.float32, torch.float32, 2, False),
        (5, 32, 16, torch.float16, torch.float8_e4m3fn, 2, True),
        (2, 32, 16, torch.float32, torch.float8_e5m2, 1, False),
    ],
)
def test_paged_decode_non_persistent(
    heads: int,
    rank: int,
    rope: int,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    splits: int,
    reg_pipeline: bool,
) -> None:
    batch = _PagedBatch(heads=heads, rank=rank, rope=rope, dtype=dtype, kv_dtype=kv_dtype)
    config = DecodeLaunchConfig(
        block_m=16, block_n=16, num_warps=4, num_stages=1, num_splits=splits, reg_pipeline=reg_pipeline
    )
    _assert_close(batch.run(paged_decode, config=config), batch.run(REF.paged_mqa_decode))


def test_paged_decode_heuristic_and_multiple_row_blocks() -> None:
    # 12 heads x qlen 4 = 48 rows: with 16-row tiles that is three row blocks per work item.
    batch = _PagedBatch(heads=12, rank=32, rope=16, dtype=torch.float16, kv_dtype=torch.float16)
    config = DecodeLaunchConfig(block_m=16, block_n=32, num_warps=4, num_stages=1, num_splits=2)
    want = batch.run(REF.paged_mqa_decode)
    _assert_close(batch.run(paged_decode, config=config), want)
    _assert_close(batch.run(TRITON.paged_mqa_decode), want)


def test_plan_matches_torch_schedule_and_scheduled_decode() -> None:
    batch = _PagedBatch(heads=4, rank=32, rope=16, dtype=torch.float16, kv_dtype=torch.float16)
    num_requests = len(batch.qlens)
    schedule = allocate_schedule(
        max_batch=num_requests + 2,
        max_kernel_qlen=4,
        kernel_heads=4,
        kv_lora_rank=32,
        num_sms=3,
        device=DEVICE,
    )
    schedule.min_chunk = 16  # several splits per request at these tiny lengths
    reference = SplitKVSchedule.allocate(
        max_batch=num_requests + 2,
        max_kernel_qlen=4,
        kernel_heads=4,
        kv_lora_rank=32,
        num_units=schedule.num_units,
        device=DEVICE,
        min_chunk=16,
    )
    schedule.work_info.fill_(7)
    TRITON.plan_decode_schedule(
        PlanDecodeScheduleCall(
            schedule=schedule,
            qo_indptr=batch.qo_indptr,
            kv_indptr=batch.kv_indptr,
            batch_size=num_requests,
            kernel_qlen=4,
            uniform_qlen=False,
        )
    )
    reference.plan(batch.kv_indptr, num_requests)
    assert torch.equal(schedule.work_info, reference.work_info)
    assert torch.equal(schedule.split_indptr[: num_requests + 1], reference.split_indptr[: num_requests + 1])
    assert torch.equal(schedule.chunk, reference.chunk)
    assert int((schedule.split_indptr[1:] - schedule.split_indptr[:-1])[:num_requests].max()) > 1
    _assert_close(batch.run(TRITON.paged_mqa_decode, schedule=schedule), batch.run(REF.paged_mqa_decode))


def _key_counts(batch: _PagedBatch) -> torch.Tensor:
    """Per-request key counts for ``DecodeInputs.lengths``: a cut, none, past the span, negative."""
    return torch.tensor([20, 5, 41, 3, -4], dtype=torch.int32, device=DEVICE)[: len(batch.seq_lens)]


def _tail_masked(batch: _PagedBatch, counts: torch.Tensor) -> torch.Tensor:
    """``kv_indices`` with each request's ids at or past its count set to -1 (what the counts mean)."""
    starts = batch.kv_indptr[:-1].tolist()
    ids = batch.kv_indices.clone()
    for start, length, count in zip(starts, batch.seq_lens, counts.tolist(), strict=True):
        keep = min(max(count, 0), length)
        ids[start + keep : start + length] = -1
    return ids


@pytest.mark.parametrize("mode", ["one split", "three splits", "scheduled"])
def test_decode_lengths_end_each_request_keys(mode: str) -> None:
    """``DecodeInputs.lengths`` ends a request's keys there, causal limits unchanged: the same
    as its later ids masked (-1), in the split and the scheduled modes."""
    batch = _PagedBatch(heads=4, rank=32, rope=16, dtype=torch.float16, kv_dtype=torch.float16)
    counts = _key_counts(batch)
    schedule = None
    if mode == "scheduled":
        schedule = allocate_schedule(
            max_batch=8, max_kernel_qlen=4, kernel_heads=4, kv_lora_rank=32, num_sms=3, device=DEVICE
        )
        schedule.min_chunk = 16
        TRITON.plan_decode_schedule(
            PlanDecodeScheduleCall(
                schedule=schedule, qo_indptr=batch.qo_indptr, kv_indptr=batch.kv_indptr,
                batch_size=len(batch.qlens), kernel_qlen=4, uniform_qlen=False,
            )
        )  # fmt: skip
    config = DecodeLaunchConfig(
        block_m=16, block_n=16, num_warps=4, num_stages=1, num_splits=3 if mode == "three splits" else 1
    )

    def with_lengths(call: PagedDecodeCall) -> None:
        inputs = DecodeInputs.paged(call, provider="triton", block_table=True)._replace(lengths=counts)
        launch_split_decode(
            inputs, row_tile=config.block_m, num_splits=config.num_splits,
            launch=lambda decode: launch_kernel(config, decode),
        )  # fmt: skip

    got = batch.run(with_lengths, schedule=schedule)
    every_key = batch.run(REF.paged_mqa_decode)
    assert (got[0].float() - every_key[0].float()).abs().max() > 0.05, "the counts changed nothing"
    batch.kv_indices = _tail_masked(batch, counts)
    _assert_close(got, batch.run(REF.paged_mqa_decode))
    _assert_close(got, batch.run(paged_decode, schedule=schedule, config=config))


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.float8_e4m3fn])
def test_small_head_decode_strided_views(kv_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    heads, rank, rope = 3, 32, 16
    lengths = [9, 0, 40]
    num_tok = 64
    cache = (torch.randn(num_tok, rank + rope, generator=gen) * 2).to(kv_dtype).to(DEVICE)
    kv_scale = torch.tensor([0.5], device=DEVICE) if kv_dtype.itemsize == 1 else None
    table = torch.randperm(num_tok, generator=gen)[: sum(lengths)].to(torch.int32).to(DEVICE)
    q = torch.randn(len(lengths), heads, rank + rope, generator=gen).to(torch.float16).to(DEVICE)
    results = []
    for provider in (TRITON, REF):
        out, lse = _poisoned(len(lengths), heads, rank, torch.float16)
        provider.small_head_decode(
            SmallHeadDecodeCall(
                q_nope=q[..., :rank],
                q_pe=q[..., rank:],
                kv_cache=cache,
                page_table=table,
                seq_info=_indptr(lengths),
                out=out,
                lse=lse,
                max_seqlen_k=40,
                page_size=1,
                softmax_scale=0.25,
                kv_scale=kv_scale,
            )
        )
        results.append((out, lse))
    _assert_close(results[0], results[1])
    assert bool(torch.isneginf(results[0][1][1]).all())
    assert bool((results[0][0][1] == 0).all())


class _BlockTableBatch:
    """The mixed batch above over a paged cache (page size 4, or ``page``): each request's
    block-table row, with a negative block and a block past the cache in the middle of request
    2, and the flat per-token ids of the same keys (-1 for those two blocks' keys) for the
    reference."""

    def __init__(self, *, heads: int, dtype: torch.dtype, page: int = 4) -> None:
        gen = torch.Generator().manual_seed(heads)
        self.qlens, self.seq_lens, self.heads, self.dtype = [1, 3, 2, 0, 4], [37, 5, 70, 0, 2], heads, dtype
        self.page, num_blocks, width = page, 40, -(-72 // page)
        self.cache = torch.randn(num_blocks * self.page, 48, generator=gen).to(dtype).to(DEVICE)
        table = torch.randint(0, num_blocks, (len(self.seq_lens), width), generator=gen, dtype=torch.int32)
        # Request 2: keys 12..15 and 36..39 masked (pages of 4), or 16..31 and 48..63 (pages of 16).
        masked = (3, 9) if page == 4 else (16 // page, 48 // page)
        table[2, masked[0]], table[2, masked[1]] = -2, num_blocks + 5
        ids = []
        for b, length in enumerate(self.seq_lens):
            for p in range(length):
                block = int(table[b, p // self.page])
                ids.append(block * self.page + p % self.page if 0 <= block < num_blocks else -1)
        self.table = table.to(DEVICE)
        self.kv_indices = torch.tensor(ids, dtype=torch.int32, device=DEVICE)
        self.kv_indptr, self.qo_indptr = _indptr(self.seq_lens), _indptr(self.qlens)
        self.q = torch.randn(sum(self.qlens), heads, 48, generator=gen).to(dtype).to(DEVICE)

    def run(
        self, decode: Callable[..., None], *, block_table: bool, schedule: SplitKVSchedule | None = None,
        **kwargs: object,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        out, lse = _poisoned(self.q.shape[0], self.heads, 32, self.dtype)
        decode(
            PagedDecodeCall(
                q=self.q, kv_cache=self.cache, kv_indptr=self.kv_indptr,
                kv_indices=None if block_table else self.kv_indices, qo_indptr=self.qo_indptr, out=out,
                lse=lse, max_qlen=4, max_seqlen_k=80, page_size=self.page, softmax_scale=0.3, kv_scale=None,
                schedule=schedule, block_table=self.table if block_table else None,
            ),
            **kwargs,
        )  # fmt: skip
        return out, lse


@pytest.mark.parametrize(
    ("splits", "block_n", "reg_pipeline", "page"),
    [
        (1, 16, False, 4), (3, 16, True, 4), (2, 32, False, 4),
        # a tile inside one page (non-persistent, pages a multiple of the tile): one block id
        (1, 16, False, 16), (3, 16, True, 16), (2, 16, False, 32), (3, 16, False, 16),
    ],
)  # fmt: skip
def test_paged_decode_reads_the_block_table(splits: int, block_n: int, reg_pipeline: bool, page: int) -> None:
    """The kernel over the block table (one block id per page of a tile, or per tile when a
    tile lies inside one page; a negative block and one past the cache mid-request masked)
    equals the reference over the flat ids, tiles of 16 and 32 keys spanning several pages of
    4 or inside pages of 16 and 32, split or not."""
    batch = _BlockTableBatch(heads=4, dtype=torch.float16, page=page)
    config = DecodeLaunchConfig(
        block_m=16, block_n=block_n, num_warps=4, num_stages=1, num_splits=splits, reg_pipeline=reg_pipeline
    )
    want = batch.run(REF.paged_mqa_decode, block_table=False)
    _assert_close(batch.run(paged_decode, block_table=True, config=config), want)
    _assert_close(batch.run(REF.paged_mqa_decode, block_table=True), want)


@pytest.mark.parametrize("page", [4, 16])
def test_scheduled_decode_reads_the_block_table(page: int) -> None:
    """The planned schedule's ranges start anywhere: tiles span two pages of 16 (two block
    ids a tile)."""
    batch = _BlockTableBatch(heads=3, dtype=torch.float32, page=page)
    num_requests = len(batch.qlens)
    schedule = allocate_schedule(
        max_batch=num_requests, max_kernel_qlen=4, kernel_heads=3, kv_lora_rank=32, num_sms=3, device=DEVICE
    )
    schedule.min_chunk = 16
    TRITON.plan_decode_schedule(
        PlanDecodeScheduleCall(
            schedule=schedule, qo_indptr=batch.qo_indptr, kv_indptr=batch.kv_indptr,
            batch_size=num_requests, kernel_qlen=4, uniform_qlen=False,
        )
    )  # fmt: skip
    want = batch.run(REF.paged_mqa_decode, block_table=False)
    _assert_close(batch.run(TRITON.paged_mqa_decode, block_table=True, schedule=schedule), want)


def test_small_head_rows_read_their_requests_block_table_rows() -> None:
    """Verify rows as the small-head contract takes them on a block-table provider: a row map
    (row -> request, row's key count) over the block table, no per-row token list."""
    batch = _BlockTableBatch(heads=2, dtype=torch.float16)
    row_request = torch.tensor([2, 2, 2, 0, 1, 0], dtype=torch.int32, device=DEVICE)
    windows = [68, 69, 70, 37, 4, 0]  # prefixes of their requests' keys (the last: graph padding)
    seq_info = _indptr(windows)
    flat = torch.cat(
        [
            batch.kv_indices[int(batch.kv_indptr[r]) :][:w]
            for r, w in zip(row_request.tolist(), windows, strict=True)
        ]
    )
    q = torch.randn(len(windows), 2, 48, generator=torch.Generator().manual_seed(1)).half().to(DEVICE)
    results = []
    for provider, table in ((TRITON, True), (REF, True), (REF, False)):
        out, lse = _poisoned(len(windows), 2, 32, torch.float16)
        provider.small_head_decode(
            SmallHeadDecodeCall(
                q_nope=q[..., :32], q_pe=q[..., 32:], kv_cache=batch.cache,
                page_table=None if table else flat, seq_info=seq_info, out=out, lse=lse, max_seqlen_k=80,
                page_size=batch.page, softmax_scale=0.25, kv_scale=None,
                block_table=batch.table if table else None, row_request=row_request if table else None,
            )
        )  # fmt: skip
        results.append((out, lse))
    _assert_close(results[0], results[2])
    _assert_close(results[1], results[2])
    assert bool(torch.isneginf(results[0][1][5]).all())


def test_merge_states_with_empty_rows_and_alias() -> None:
    gen = torch.Generator().manual_seed(5)
    o_a = torch.randn(6, 3, 40, generator=gen).to(DEVICE)
    o_b = torch.randn(6, 3, 40, generator=gen).to(DEVICE)
    lse_a = torch.randn(6, 3, generator=gen).to(DEVICE)
    lse_b = torch.randn(6, 3, generator=gen).to(DEVICE)
    lse_a[0, 0] = lse_b[0, 0] = -math.inf  # both empty
    lse_a[1, 1] = -math.inf
    o_a[1, 1] = math.nan  # an empty state's output is never read
    want_o, want_lse = torch.empty_like(o_a), torch.empty_like(lse_a)
    REF.merge_states(
        MergeStatesCall(o_a=o_a.nan_to_num(), lse_a=lse_a, o_b=o_b, lse_b=lse_b, out=want_o, lse_out=want_lse)
    )
    got_lse = torch.full_like(lse_a, math.nan)
    # out aliases o_a
    TRITON.merge_states(MergeStatesCall(o_a=o_a, lse_a=lse_a, o_b=o_b, lse_b=lse_b, out=o_a, lse_out=got_lse))
    torch.testing.assert_close(o_a, want_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_lse, want_lse)


@pytest.mark.parametrize("block_size", [1, 16])
def test_expand_page_indices(block_size: int) -> None:
    gen = torch.Generator().manual_seed(block_size)
    lengths = [5, 0, 33, 0, 17]
    table = torch.randint(0, 50, (len(lengths), 40), generator=gen, dtype=torch.int32).to(DEVICE)
    indptr = _indptr(lengths)
    total = sum(lengths)
    got = torch.full((total + 3,), -7, dtype=torch.int32, device=DEVICE)
    want = got.clone()
    for provider, out in ((TRITON, got), (REF, want)):
        provider.expand_page_indices(
            ExpandPagesCall(
                block_table=table, kv_indptr=indptr, out=out, block_size=block_size, num_tokens=total
            )
        )
    assert torch.equal(got, want)


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.float8_e4m3fn])
def test_write_kv_skips_negative_slots(kv_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(9)
    cache = torch.randn(4, 8, 48, generator=gen).to(kv_dtype).to(DEVICE)
    want = cache.clone()
    # Quarter steps: value / 0.25 is an integer in [-16, 16], exact in fp8 (the interpreter's own
    # fp8 rounding is off near powers of two, so rounded values would not compare exactly).
    kv_c = (torch.randint(-16, 17, (5, 32), generator=gen) / 4).to(torch.float16).to(DEVICE)
    k_pe = (torch.randint(-16, 17, (5, 16), generator=gen) / 4).to(torch.float16).to(DEVICE)
    slots = torch.tensor([3, -1, 17, 31, 0], device=DEVICE)
    # The fp8 scale is read from its device tensor: changed after the call is built, it still counts.
    kv_scale = torch.tensor([1.0], device=DEVICE) if kv_dtype.itemsize == 1 else None
    calls = [
        WriteKVCall(kv_c=kv_c, k_pe=k_pe, kv_cache=target, slot_mapping=slots, kv_scale=kv_scale)
        for target in (cache, want)
    ]
    if kv_scale is not None:
        kv_scale.fill_(0.25)
    TRITON.write_kv(calls[0])
    REF.write_kv(calls[1])
    assert torch.equal(cache.view(torch.uint8), want.view(torch.uint8))
    if kv_scale is not None:
        expected = (torch.cat([kv_c[0], k_pe[0]]).float() * 4).to(kv_dtype)
        assert torch.equal(cache.view(-1, 48)[3].view(torch.uint8), expected.view(torch.uint8))


def test_capabilities_availability_and_heuristic() -> None:
    assert get_provider("triton").availability()
    caps = TRITON.capabilities(simulated_platform("sm90"))
    assert caps.head_granularity == 1
    assert torch.float8_e4m3fn in caps.kv_dtypes
    assert caps.has(Contract.FP8_PREFILL)
    assert caps.has(Contract.DECODE_SCHEDULE)
    old = TRITON.capabilities(simulated_platform("sm80"))  # no e4m3 conversion, no fp8 dots
    assert torch.float8_e4m3fn not in old.kv_dtypes
    assert torch.float8_e5m2 in old.kv_dtypes
    assert not old.has(Contract.FP8_PREFILL)
    assert "triton" in TRITON.describe_probes()
    # 16 heads, qlen 1, B=1 on 132 SMs: many splits; B=128: few; persistent: none.
    one = decode_launch_config(
        batch=1, rows=16, max_seqlen_k=65536, num_sms=132, kv_elem_size=2, persistent=False
    )
    many = decode_launch_config(
        batch=128, rows=16, max_seqlen_k=8192, num_sms=132, kv_elem_size=2, persistent=False
    )
    assert one.num_splits > many.num_splits >= 1
    assert (
        decode_launch_config(
            batch=1, rows=128, max_seqlen_k=4096, num_sms=132, kv_elem_size=2, persistent=True
        ).num_splits
        == 1
    )


STRATEGY_CASES = [
    (GluonDecode, DecodeCase(heads=3, qlens=(1, 1, 1), seq_lens=(20, 1, 45), block_size=16, extra_rows=2)),
    (GluonVerifyFlatten, DecodeCase(heads=4, qlens=(3, 2), seq_lens=(30, 2), block_size=1)),
    (PaddedAsmPersistent, DecodeCase(heads=8, qlens=(2, 2, 2), seq_lens=(33, 0, 12), block_size=16)),
    (PaddedAsmPersistent, DecodeCase(heads=16, qlens=(1, 4), seq_lens=(60, 9), block_size=64, extra_rows=1)),
    (AsmNonPersistent, DecodeCase(heads=12, qlens=(1, 1), seq_lens=(50, 7), block_size=1)),
    (
        AsmNonPersistent,
        DecodeCase(heads=2, qlens=(4, 1), seq_lens=(26, 3), block_size=16, kv_dtype=torch.float8_e4m3fn),
    ),
]


@pytest.mark.parametrize(("strategy", "case"), STRATEGY_CASES, ids=lambda x: getattr(x, "NAME", None) or x.id)
@pytest.mark.parametrize("q_dtype", [torch.float16, torch.float32])
def test_strategy_conformance(strategy: type, case: DecodeCase, q_dtype: torch.dtype) -> None:
    case = attrs.evolve(
        case,
        q_dtype=q_dtype,
        kv_dtype=case.kv_dtype if case.kv_is_fp8 else q_dtype,
        kv_lora_rank=32,
        rope_dim=16,
    )
    platform = "cpu" if DEVICE.type == "cpu" else None
    result = check_decode_strategy(
        strategy, case, provider="triton", platform=platform or "sm90", device=DEVICE
    )
    result.assert_passed()
