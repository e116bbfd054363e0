# mypy: disable-error-code="no-untyped-def, untyped-decorator"
"""The split-KV reduce: LSE-merge the fp32 partials of a request's KV splits into its output.

Shared by the Triton and Gluon decode kernels, which write partials in one layout:
``part_o [W, max_qlen, H, L]`` (normalised partial outputs) and ``part_lse [W, max_qlen, H]``
(natural-log partial LSEs) of ``W`` work items; :func:`split_work` gives a launch its work items
and partial buffers.

A program owns one query row of one head and ``BLOCK_D`` latent lanes, and merges the request's
splits in one pass, ``BLOCK_S`` splits per step, with a running maximum (the loads of a step do
not wait on each other or on the previous step). The launch sizes ``BLOCK_D`` so that the grid
has at least two programs per SM and ``BLOCK_S`` to the split count: with a 2-way split at
H16 q1 B64 the reduce reads 4 MB, and a reduce program per 64 lanes that walked its splits twice
(maximum pass, then weighted-sum pass, 64 splits a step) spent a quarter of the step's time
on it, latency-bound.

NaN handling: a partial whose LSE is NaN (a key its rows see is NaN) makes the merged row NaN;
rows with no visible key in any split come out as ``o = 0``, ``lse = -inf``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla.core.errors import PlanMismatchError
from mla.providers.split_kv import SplitKVSchedule
from mla.providers.triton.pdl import pdl_options, wait_for_previous

MERGE_TILE = 8192
"""fp32 elements of one ``[BLOCK_S, BLOCK_D]`` step (32 KB: 64 registers a thread on 4 warps)."""
MIN_BLOCK_D = 32
"""Narrowest latent chunk a program merges (more programs for small batches). 32 measured
2–3% faster than 64 on one and two long requests, and 16 no better than 32
(``docs/performance.md``, "Kernel choices")."""
MAX_BLOCK_S_SCHEDULED = 64
"""Most splits per step of a planned schedule. Its split counts are known only on the device:
the planner spreads about ``num_sms`` items over the requests, so a step takes
``2·num_sms / requests`` splits (a power of two, at most this)."""


@triton.jit
def request_rows(qo_indptr_ptr, req, UNIT_QLEN: tl.constexpr):
    """``(q_start, qlen)`` of request ``req``: from ``qo_indptr``, or row ``req`` alone when
    ``UNIT_QLEN`` (every row its own qlen-1 request). Shared with the decode kernels (Triton and
    Gluon)."""
    if UNIT_QLEN:
        q_start = req
        qlen = 1
    else:
        q_start = tl.load(qo_indptr_ptr + req)
        qlen = tl.load(qo_indptr_ptr + req + 1) - q_start
    return q_start, qlen


@triton.jit
def _merge_splits_kernel(
    part_o_ptr,
    part_lse_ptr,
    out_ptr,
    lse_ptr,
    qo_indptr_ptr,
    split_indptr_ptr,
    num_splits,
    max_qlen,
    stride_po_w,
    stride_po_q,
    stride_po_h,
    stride_pl_w,
    stride_pl_q,
    stride_o_t,
    stride_o_h,
    stride_lse_t,
    stride_lse_h,
    L: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SCHEDULED: tl.constexpr,
    UNIT_QLEN: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (request·max_qlen + query row, head, latent chunk): merge the request's splits;
    the merged LSE is stored only with ``WRITE_LSE`` (by the chunk-0 program)."""
    wait_for_previous(PDL)
    req = tl.program_id(0) // max_qlen
    qi = tl.program_id(0) % max_qlen
    head = tl.program_id(1)
    q_start, qlen = request_rows(qo_indptr_ptr, req, UNIT_QLEN)
    if qi >= qlen:
        return
    if SCHEDULED:
        s0 = tl.load(split_indptr_ptr + req)
        s1 = tl.load(split_indptr_ptr + req + 1)
        if s1 - s0 == 1:
            return  # the decode kernel wrote this request directly
    else:
        s0 = req * num_splits
        s1 = s0 + num_splits
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = offs_d < L
    lse_base = part_lse_ptr + qi * stride_pl_q + head
    o_base = part_o_ptr + qi * stride_po_q + head * stride_po_h
    top = tl.max(tl.full([BLOCK_S], float("-inf"), tl.float32), 0)
    top_use = tl.max(tl.zeros([BLOCK_S], tl.float32), 0)
    denom = tl.sum(tl.zeros([BLOCK_S], tl.float32), 0)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for c in range(s0, s1, BLOCK_S):
        split = c + offs_s
        ok = split < s1
        wk = split.to(tl.int64)
        lse_s = tl.load(lse_base + wk * stride_pl_w, mask=ok, other=float("-inf"))
        o_mask = ok[:, None] & d_ok[None, :]
        o_s = tl.load(o_base + wk[:, None] * stride_po_w + offs_d[None, :], mask=o_mask, other=0.0)
        new_top = tl.maximum(top, tl.max(lse_s, 0))
        new_use = tl.where(new_top == float("-inf"), 0.0, new_top)
        rescale = tl.math.exp(top - new_use)
        weight = tl.math.exp(lse_s - new_use)
        acc = acc * rescale + tl.sum(o_s * weight[:, None], 0)
        denom = denom * rescale + tl.sum(weight, 0)
        top = new_top
        top_use = new_use
    has_keys = denom != 0.0
    safe = tl.where(has_keys, denom, 1.0)
    token = (q_start + qi).to(tl.int64)
    o_ptrs = out_ptr + token * stride_o_t + head * stride_o_h + offs_d
    tl.store(o_ptrs, (acc / safe).to(out_ptr.dtype.element_ty), mask=d_ok)
    if WRITE_LSE and tl.program_id(2) == 0:
        tl.store(
            lse_ptr + token * stride_lse_t + head * stride_lse_h,
            tl.where(has_keys, top_use + tl.log(safe), float("-inf")),
        )


def split_work(
    *,
    schedule: SplitKVSchedule | None,
    num_splits: int,
    num_requests: int,
    max_qlen: int,
    heads: int,
    rank: int,
    kv_indptr: torch.Tensor,
    out: torch.Tensor,
) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(num_work, part_o, part_lse, work_info, split_indptr)`` of one decode launch.

    ``schedule is None`` (non-persistent): ``num_requests * num_splits`` items, fresh fp32
    partial buffers when ``num_splits > 1`` (one-element stand-ins otherwise: every item writes
    its request's output directly), and ``kv_indptr`` as the unused schedule pointers. A planned
    ``schedule``: its ``max_work`` items, work list and partial buffers, which must hold
    ``max_qlen`` rows of ``heads`` heads and ``rank`` lanes (:class:`PlanMismatchError`
    otherwise)."""
    if schedule is None:
        num_work = num_requests * num_splits
        if num_splits > 1:
            part_o = torch.empty(num_work, max_qlen, heads, rank, dtype=torch.float32, device=out.device)
            part_lse = torch.empty(num_work, max_qlen, heads, dtype=torch.float32, device=out.device)
        else:
            part_o = out.new_empty(1, 1, 1, 1, dtype=torch.float32)
            part_lse = out.new_empty(1, 1, 1, dtype=torch.float32)
        return num_work, part_o, part_lse, kv_indptr, kv_indptr
    part_o = schedule.partial_o
    if part_o.shape[1] < max_qlen or part_o.shape[2] != heads or part_o.shape[3] != rank:
        raise PlanMismatchError(
            f"schedule: partial buffers {tuple(part_o.shape)} were allocated for another geometry than "
            f"qlen {max_qlen} x {heads} heads x rank {rank}; allocate them with "
            "decode_schedule_buffers for this kernel's heads and max qlen"
        )
    return schedule.max_work, part_o, schedule.partial_lse, schedule.work_info, schedule.split_indptr


def merge_tiles(
    *, num_requests: int, max_qlen: int, heads: int, rank: int, num_splits: int | None, num_sms: int
) -> tuple[int, int]:
    """``(BLOCK_S, BLOCK_D)`` of a reduce over ``num_requests × max_qlen`` query rows × ``heads``.

    ``BLOCK_D`` is the latent width (rounded up to a power of two), halved down to
    :data:`MIN_BLOCK_D` while the grid has fewer than two programs per SM; ``BLOCK_S`` is the
    split count (a power of two; ``num_splits=None``, a planned schedule: see
    :data:`MAX_BLOCK_S_SCHEDULED`) capped so one step holds :data:`MERGE_TILE` values.
    """
    rows = num_requests * max_qlen
    block_d = max(16, triton.next_power_of_2(rank))
    while block_d > MIN_BLOCK_D and rows * heads * triton.cdiv(rank, block_d) < 2 * num_sms:
        block_d //= 2
    if num_splits is None:
        expected = -(-2 * num_sms // max(1, num_requests))
        wanted = min(MAX_BLOCK_S_SCHEDULED, triton.next_power_of_2(expected))
    else:
        wanted = triton.next_power_of_2(max(1, num_splits))
    return max(1, min(wanted, MERGE_TILE // block_d)), block_d


def launch_merge(
    *,
    part_o: torch.Tensor,
    part_lse: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    qo_indptr: torch.Tensor | None,
    split_indptr: torch.Tensor,
    num_requests: int,
    max_qlen: int,
    num_splits: int | None,
    num_sms: int,
) -> None:
    """LSE-merge split-KV partials into ``out`` (and ``lse`` unless ``None``).

    ``part_o [W, max_qlen, H, L]`` fp32 normalised partial outputs and ``part_lse [W, max_qlen, H]``
    natural-log partial LSEs of ``W`` work items. ``num_splits`` set: request ``b`` owns items
    ``b·num_splits ..`` (non-persistent); ``None``: items ``split_indptr[b] .. split_indptr[b+1]``
    of a planned schedule, where a request with one item was written directly and is skipped.
    ``qo_indptr is None`` means request ``b`` is query row ``b`` (qlen 1). ``num_sms`` sizes
    the grid (:func:`merge_tiles`).
    """
    heads, rank = part_o.shape[2], part_o.shape[3]
    rows = num_requests * max_qlen
    unit_qlen = qo_indptr is None
    qo = split_indptr if qo_indptr is None else qo_indptr
    write_lse = lse is not None
    lse_arg = lse if lse is not None else out.new_empty(1, 1, dtype=torch.float32)
    block_s, block_d = merge_tiles(
        num_requests=num_requests, max_qlen=max_qlen, heads=heads, rank=rank, num_splits=num_splits,
        num_sms=num_sms,
    )  # fmt: skip
    _merge_splits_kernel[(rows, heads, triton.cdiv(rank, block_d))](
        part_o,
        part_lse,
        out,
        lse_arg,
        qo,
        split_indptr,
        num_splits or 1,
        max_qlen,
        part_o.stride(0),
        part_o.stride(1),
        part_o.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        out.stride(0),
        out.stride(1),
        lse_arg.stride(0),
        lse_arg.stride(1),
        L=rank,
        BLOCK_S=block_s,
        BLOCK_D=block_d,
        SCHEDULED=num_splits is None,
        UNIT_QLEN=unit_qlen,
        WRITE_LSE=write_lse,
        **pdl_options(out.device),
        num_warps=4 if block_s * block_d <= 4096 else 8,
    )


__all__ = ["MERGE_TILE", "launch_merge", "merge_tiles", "request_rows", "split_work"]
