"""The torch provider's decode (:mod:`mla.providers.torch_attention`): a planned split-KV
schedule counts each key as often as its work items cover it (what LSE-merging the items'
partials gives on the kernels), the work follows the call's batch and bounds, not the sizes of
the buffers it is handed, and nothing reads a tensor's values on the host.

The expected values are computed here item by item in float64: each work item's partial softmax
over its own range, then the LSE merge, as a kernel and the split reduce compute them.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mla.providers import TorchProvider
from mla.providers.calls import PagedDecodeCall
from mla.providers.split_kv import SplitKVSchedule
from mla.providers.torch_attention import schedule_coverage

HEADS, RANK, ROPE = 4, 32, 16
SCALE = 0.2


def _call(
    qlens: list[int],
    kv_lens: list[int],
    *,
    schedule: SplitKVSchedule | None,
    index_room: int = 0,
    seed: int = 0,
) -> PagedDecodeCall:
    gen = torch.Generator().manual_seed(seed)
    tokens, keys = sum(qlens), sum(kv_lens)
    cache = torch.randn(keys + 8, RANK + ROPE, generator=gen)
    kv_indices = torch.full((keys + 1 + index_room,), 10**6, dtype=torch.int32)  # unused: outside the cache
    kv_indices[:keys] = torch.randperm(keys + 8, generator=gen)[:keys].to(torch.int32)
    return PagedDecodeCall(
        q=torch.randn(tokens + 1, HEADS, RANK + ROPE, generator=gen),  # one graph-padding row
        kv_cache=cache,
        kv_indptr=torch.tensor([0, *torch.tensor(kv_lens).cumsum(0).tolist()], dtype=torch.int32),
        kv_indices=kv_indices,
        qo_indptr=torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32),
        out=torch.full((tokens + 1, HEADS, RANK), math.nan),
        lse=torch.full((tokens + 1, HEADS), math.nan),
        max_qlen=max(qlens),
        max_seqlen_k=max(kv_lens),
        page_size=1,
        softmax_scale=SCALE,
        kv_scale=None,
        schedule=schedule,
    )


def _schedule(batch: int, qlen: int, items: list[list[int]], *, spare: int = 0) -> SplitKVSchedule:
    """A schedule holding exactly ``items`` (``[request, start, end, ordinal]``), then idle ones."""
    schedule = SplitKVSchedule.allocate(
        max_batch=batch, max_kernel_qlen=qlen, kernel_heads=HEADS, kv_lora_rank=RANK,
        num_units=len(items) + spare, device=torch.device("cpu"),
    )  # fmt: skip
    info = torch.tensor([[-1, 0, 0, 0]] * schedule.max_work, dtype=torch.int32)
    info[: len(items)] = torch.tensor(items, dtype=torch.int32)
    schedule.work_info.copy_(info)
    return schedule


def _merged_items(call: PagedDecodeCall, items: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 o, lse: each live item's partial over its keys the row sees, LSE-merged per token."""
    qo, kv = call.qo_indptr.tolist(), call.kv_indptr.tolist()
    tokens = call.q.shape[0]
    out = torch.zeros(tokens, HEADS, RANK, dtype=torch.float64)
    lse = torch.full((tokens, HEADS), -math.inf, dtype=torch.float64)
    rows = call.kv_cache.to(torch.float64)[call.kv_indices[: kv[-1]].long()]
    q = call.q.to(torch.float64)
    for b in range(len(qo) - 1):
        qlen, kv_len = qo[b + 1] - qo[b], kv[b + 1] - kv[b]
        for i in range(qlen):
            t, seen = qo[b] + i, kv[b] + kv_len - qlen + i + 1  # keys before `seen` (absolute)
            parts = []
            for req, start, end, _ in items:
                keys = rows[start : min(end, seen)] if req == b and start < min(end, seen) else None
                if keys is not None:
                    s = q[t] @ keys.T * SCALE  # [H, k]
                    part_lse = torch.logsumexp(s, -1)
                    parts.append((torch.softmax(s, -1) @ keys[:, :RANK], part_lse))
            if parts:
                all_lse = torch.stack([p[1] for p in parts])
                lse[t] = torch.logsumexp(all_lse, 0)
                weights = torch.exp(all_lse - lse[t])
                out[t] = sum(w[:, None] * o for (o, _), w in zip(parts, weights, strict=True))
    return out, lse


@pytest.mark.parametrize(
    ("qlens", "kv_lens", "items"),
    [
        # A correct schedule: each request's keys cut into contiguous items.
        ([1, 1], [30, 17], [[0, 0, 12, 0], [0, 12, 24, 1], [0, 24, 30, 2], [1, 30, 47, 0]]),
        # Verify rows (qlen 3) over items that split inside the causal windows.
        ([3, 3], [20, 9], [[0, 0, 19, 0], [0, 19, 20, 1], [1, 20, 25, 0], [1, 25, 29, 1]]),
        # Key 5..9 of request 0 covered twice: it counts twice, as the merge of the two partials.
        ([1, 2], [16, 10], [[0, 0, 10, 0], [0, 5, 16, 1], [1, 16, 26, 0]]),
        # Keys 8..16 of request 0 in no item: left out, as on the kernels.
        ([1, 1], [16, 10], [[0, 0, 8, 0], [1, 16, 26, 0]]),
        # A request with no item at all: o = 0, lse = -inf.
        ([1, 1], [16, 10], [[0, 0, 16, 0]]),
    ],
    ids=["exact-cover", "verify-rows", "double-cover", "gap", "no-item"],
)
def test_a_schedule_counts_each_key_as_its_items_cover_it(
    qlens: list[int], kv_lens: list[int], items: list[list[int]]
) -> None:
    call = _call(qlens, kv_lens, schedule=_schedule(len(kv_lens), max(qlens), items, spare=3))
    TorchProvider().paged_mqa_decode(call)
    out, lse = _merged_items(call, items)
    torch.testing.assert_close(call.out.to(torch.float64), out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(call.lse.to(torch.float64), lse, atol=1e-5, rtol=1e-5)
    assert call.out[-1].eq(0).all()  # the graph-padding row
    assert call.lse[-1].eq(-math.inf).all()


def test_the_planned_schedule_gives_the_unscheduled_result() -> None:
    plain = _call([2, 1, 2], [40, 7, 0], schedule=None)
    schedule = SplitKVSchedule.allocate(
        max_batch=5, max_kernel_qlen=2, kernel_heads=HEADS, kv_lora_rank=RANK, num_units=6,
        device=torch.device("cpu"), min_chunk=4,
    )  # fmt: skip
    schedule.plan(plain.kv_indptr, 3)
    planned = _call([2, 1, 2], [40, 7, 0], schedule=schedule)
    provider = TorchProvider()
    provider.paged_mqa_decode(plain)
    provider.paged_mqa_decode(planned)
    torch.testing.assert_close(planned.out, plain.out)
    torch.testing.assert_close(planned.lse, plain.lse)
    assert torch.isneginf(plain.lse[3:5]).all()  # the request with no key


def test_coverage_ignores_idle_and_inverted_items() -> None:
    kv_indptr = torch.tensor([0, 6, 10], dtype=torch.int32)
    # idle items with stale ranges, an inverted item (end before start), one outside the batch
    items = [[0, 0, 6, 0], [-1, 2, 9, 0], [1, 8, 7, 0], [1, 6, 10, 1], [5, 0, 10, 0]]
    coverage = schedule_coverage(_schedule(2, 1, items), kv_indptr, batch=2, max_len=6)
    assert coverage.tolist() == [[1.0] * 6, [1.0] * 4 + [0.0] * 2]


class _Recorder(TorchDispatchMode):
    """The largest tensor any op of the block makes (elements)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        result = func(*args, **(kwargs or {}))
        for value in result if isinstance(result, tuple | list) else (result,):
            if isinstance(value, torch.Tensor):
                self.largest = max(self.largest, value.numel())
        return result


@pytest.mark.parametrize("scheduled", [False, True], ids=["direct", "scheduled"])
def test_the_work_follows_the_batch_not_the_buffers(scheduled: bool) -> None:
    """The same two requests, handed an index buffer and a schedule sized for a large engine."""

    def largest(index_room: int, spare_units: int) -> int:
        items = [[0, 0, 30, 0], [1, 30, 47, 0]]
        schedule = _schedule(2, 1, items, spare=spare_units) if scheduled else None
        call = _call([1, 1], [30, 17], schedule=schedule, index_room=index_room)
        with _Recorder() as recorder:
            TorchProvider().paged_mqa_decode(call)
        return recorder.largest

    small = largest(index_room=0, spare_units=0)
    # The gathered rows (3 tokens, one of them graph padding, x max_seqlen_k x (L + R)) are the
    # largest tensor.
    assert small == 3 * 30 * (RANK + ROPE)
    # The index buffer's size does not matter; of the schedule, only its work list (read whole:
    # 4 ints an item) grows with it, and none of its partial buffers is touched.
    assert largest(index_room=1 << 20, spare_units=0) == small
    if scheduled:
        max_work = 2 + 2 + 4096  # requests + units
        assert largest(index_room=0, spare_units=4096) <= max(small, 4 * max_work)


@pytest.mark.parametrize("scheduled", [False, True], ids=["direct", "scheduled"])
def test_the_decode_reads_no_value_on_the_host(scheduled: bool) -> None:
    """On the meta device a value read (``.item()``, ``.tolist()``, a data-dependent shape)
    raises: the decode, with and without a schedule, reads none."""
    meta = torch.device("meta")
    schedule = None
    if scheduled:
        schedule = SplitKVSchedule.allocate(
            max_batch=4, max_kernel_qlen=2, kernel_heads=HEADS, kv_lora_rank=RANK, num_units=8, device=meta
        )
    call = PagedDecodeCall(
        q=torch.empty(7, HEADS, RANK + ROPE, device=meta),
        kv_cache=torch.empty(64, RANK + ROPE, device=meta),
        kv_indptr=torch.empty(5, dtype=torch.int32, device=meta),
        kv_indices=torch.empty(65, dtype=torch.int32, device=meta),
        qo_indptr=torch.empty(5, dtype=torch.int32, device=meta),
        out=torch.empty(7, HEADS, RANK, device=meta),
        lse=torch.empty(7, HEADS, device=meta),
        max_qlen=2,
        max_seqlen_k=16,
        page_size=1,
        softmax_scale=SCALE,
        kv_scale=None,
        schedule=schedule,
    )
    TorchProvider().paged_mqa_decode(call)
