# mypy: disable-error-code="no-untyped-def, untyped-decorator"
"""The split reduce folded into the few-rows decode kernel: a grid barrier, then an in-kernel merge.

A one-request decode (B1 S65536: 128 splits of 8 tiles) spends about 4 µs of its 28 after the
last split finishes: the separate reduce launch and its 4 MB of partials. When every program of
a non-persistent split launch is resident at once (at most one wave, launched cooperatively so
the driver guarantees it), the kernel combines its own partials instead:

1. each program writes its fp32 partial (as for the separate reduce), then arrives at a grid
   barrier (:func:`grid_barrier`);
2. program (request, split ``s``, row block) then merges, for its row block, latent columns
   ``[s·L/S, (s+1)·L/S)`` of all ``S`` splits of its request (:func:`merge_column_chunk`), from
   L2, where the partials were just written, and writes the output (and the LSE, split 0).

The barrier is two int32 words, ``[arrived, generation]``, that the kernel leaves as it found
them (the last program to arrive resets ``arrived`` before it advances ``generation``), so a
launch needs no memset and a captured graph replays without one. :func:`barrier_words` keeps one
pair per device, made on the first eager launch; a launch captured into a graph before they
exist runs the separate reduce instead. Two folded launches must not run at the same time on
one device (on two streams): they would count each other's arrivals.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from mla.providers.gluon.kernels import _row_copy_layout

MERGE_VALUES = 4096
"""fp32 values of one ``[splits, values]`` step of the in-kernel merge (32 a thread on 4 warps)."""
MERGE_STEP = 512
"""Values of a program's ``rows × chunk`` piece merged in one pass over the splits (the running
maximum, sum and output of a pass: 16 registers a thread each on a 4-warp kernel)."""


def fold_chunk(*, num_splits: int, rank: int) -> int:
    """Latent columns each split's program merges: ``rank / num_splits``; 0 when the splits do not
    divide the latent width into chunks of at least 4 columns (16 bytes of fp32) evenly, or
    there is one split (nothing to merge)."""
    if num_splits < 2 or rank % num_splits or rank // num_splits < 4:
        return 0
    return rank // num_splits


@gluon.constexpr_function
def merge_step(values: int) -> int:
    """Values of a ``values``-wide piece (a power of two) merged in one pass: at most
    :data:`MERGE_STEP`. A constexpr function: the kernel and the host call the same one."""
    return min(values, MERGE_STEP)


@gluon.constexpr_function
def fold_block_splits(*, num_splits: int, rows: int, chunk: int) -> int:
    """Splits per step of the in-kernel merge of ``rows × chunk`` values a split, taken
    :func:`merge_step` values at a time: a power of two dividing ``num_splits``, at most
    :data:`MERGE_VALUES` values a step. A constexpr function (the kernel derives its step)."""
    values: int = merge_step(rows * chunk)
    block = 1
    while block < num_splits and 2 * block * values <= MERGE_VALUES and num_splits % (2 * block) == 0:
        block *= 2
    return block


_BARRIERS: dict[torch.device, torch.Tensor] = {}


def barrier_words(device: torch.device) -> torch.Tensor | None:
    """The ``[arrived, generation]`` int32 words of ``device`` (zeros when made), or ``None``
    while the current stream is capturing a graph and there are none yet (making them then
    would place them in the graph's private memory pool). Any other device (the CPU launch
    recorder of the tests) gets zeros of its own."""
    words = _BARRIERS.get(device)
    if words is None:
        if device.type == "cuda" and torch.cuda.current_stream(device).is_capturing():
            return None
        words = torch.zeros(2, dtype=torch.int32, device=device)
        _BARRIERS[device] = words
    return words


@gluon.jit
def grid_barrier(barrier_ptr):
    """Wait until every program of the grid has called this (after its global stores).

    ``barrier_ptr``: ``[arrived, generation]`` int32, ``arrived == 0`` on entry of the first
    program; the grid must be co-resident (a cooperative launch). The last arrival resets
    ``arrived`` and advances ``generation`` (release); the others spin on ``generation``
    (acquire). Scalar atomics run on one thread of the program, between two thread barriers."""
    gl.thread_barrier()
    generation = gl.atomic_add(barrier_ptr + 1, 0, sem="relaxed", scope="gpu")
    arrived = gl.atomic_add(barrier_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == gl.num_programs(0) - 1:
        gl.atomic_xchg(barrier_ptr, 0, sem="relaxed", scope="gpu")
        gl.atomic_xchg(barrier_ptr + 1, generation + 1, sem="release", scope="gpu")
    else:
        while gl.atomic_add(barrier_ptr + 1, 0, sem="acquire", scope="gpu") == generation:
            pass
    gl.thread_barrier()


@gluon.jit
def merge_column_chunk(
    part_o_ptr, part_lse_ptr, out_ptr, lse_ptr, req, split, rb, q_start, qlen,
    stride_po_w, stride_po_q, stride_po_h, stride_pl_w, stride_pl_q,
    stride_o_t, stride_o_h, stride_lse_t, stride_lse_h,
    H: gl.constexpr, NR: gl.constexpr, L: gl.constexpr, SPLITS: gl.constexpr, WRITE_LSE: gl.constexpr,
):  # fmt: skip
    """LSE-merge columns ``[split·CW, (split+1)·CW)`` (``CW = L / SPLITS``) of the ``NR`` packed
    rows of row block ``rb`` over the ``SPLITS`` partials of request ``req`` (work items
    ``req·SPLITS …``) into ``out`` (and ``lse``, by split 0, with ``WRITE_LSE``), in passes of
    :func:`merge_step` values, :func:`fold_block_splits` splits a step. The same math as the separate reduce
    (:mod:`mla.providers.triton.merge`): one pass with a running maximum; a NaN partial makes
    the row NaN; rows with no visible key get ``o = 0``, ``lse = -inf``."""
    CW: gl.constexpr = L // SPLITS
    E: gl.constexpr = NR * CW
    STEP: gl.constexpr = merge_step(E)
    BLOCK_S: gl.constexpr = fold_block_splits(num_splits=SPLITS, rows=NR, chunk=CW)
    # [splits, values] steps: 4 fp32 values (16 bytes) a thread, the warps stacked over the splits.
    layout: gl.constexpr = _row_copy_layout(STEP, 4, gl.num_warps())
    offs_s = gl.arange(0, BLOCK_S, layout=gl.SliceLayout(1, layout))
    for e0 in range(0, E, STEP):
        e = e0 + gl.arange(0, STEP, layout=gl.SliceLayout(0, layout))
        row = rb * NR + e // CW
        qi = row // H
        head = row % H
        ok = qi < qlen
        col = split * CW + e % CW
        o_base = part_o_ptr + qi * stride_po_q + head * stride_po_h + col
        lse_base = part_lse_ptr + qi * stride_pl_q + head
        top = gl.full([STEP], float("-inf"), gl.float32, layout=gl.SliceLayout(0, layout))
        acc = gl.zeros([STEP], gl.float32, layout=gl.SliceLayout(0, layout))
        denom = gl.zeros([STEP], gl.float32, layout=gl.SliceLayout(0, layout))
        for c in range(0, SPLITS, BLOCK_S):
            wk = (req * SPLITS + c + offs_s).to(gl.int64)
            lse_s = gl.load(
                lse_base[None, :] + (wk * stride_pl_w)[:, None], mask=ok[None, :], other=float("-inf")
            )
            o_s = gl.load(o_base[None, :] + (wk * stride_po_w)[:, None], mask=ok[None, :], other=0.0)
            new_top = gl.maximum(top, gl.max(lse_s, 0))
            new_use = gl.where(new_top == float("-inf"), 0.0, new_top)
            rescale = gl.exp(top - new_use)
            weight = gl.exp(lse_s - new_use[None, :])
            acc = acc * rescale + gl.sum(o_s * weight, 0)
            denom = denom * rescale + gl.sum(weight, 0)
            top = new_top
        top_use = gl.where(top == float("-inf"), 0.0, top)
        has_keys = denom != 0.0
        safe = gl.where(has_keys, denom, 1.0)
        token = (q_start + qi).to(gl.int64)
        o_ptrs = out_ptr + token * stride_o_t + head * stride_o_h + col
        gl.store(o_ptrs, (acc / safe).to(out_ptr.dtype.element_ty), mask=ok)
        if WRITE_LSE:
            lse = gl.where(has_keys, top_use + gl.log(safe), float("-inf"))
            gl.store(lse_ptr + token * stride_lse_t + head * stride_lse_h, lse, mask=ok & (col == 0))


__all__ = [
    "MERGE_STEP",
    "MERGE_VALUES",
    "barrier_words",
    "fold_block_splits",
    "fold_chunk",
    "grid_barrier",
    "merge_column_chunk",
    "merge_step",
]
