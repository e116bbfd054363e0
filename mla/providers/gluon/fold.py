# mypy: disable-error-code="no-untyped-def, untyped-decorator"
"""The split reduce folded into the few-rows decode kernel: a grid barrier, then an in-kernel merge.

A one-request decode (B1 S65536: 128 splits of 8 tiles) spends about a seventh of its time after
the last split finishes: the separate reduce launch and its 4 MB of partials. When every program of
a non-persistent split launch is resident at once (at most one wave, launched cooperatively so
the driver guarantees it), the kernel combines its own partials instead:

1. each program writes its fp32 partial (as for the separate reduce), then arrives at a grid
   barrier (:func:`grid_barrier`);
2. program (request, split ``s``, row block) then merges slice ``s`` of its row block's
   flattened ``rows × L`` output (``rows · L / S`` values, whole runs of one row at a time) over
   all ``S`` splits of its request (:func:`merge_output_slice`), from L2, where the partials
   were just written, and writes the output (and the LSE, where a slice starts a row).

At B1 S65536 a 16-row program merges 64 values of one row: one LSE and one 256-byte run per
split. (Cutting the latent columns instead, 4 columns of all 16 rows, gathered 16-byte pieces
and 16 LSEs per split and measured slower than the separate reduce.)

Measured, the fold ties the separate reduce on one long request (the barrier and the merge cost
about what the reduce and its launch do) and loses elsewhere, so :func:`.planner.launch_config`
never picks it (``docs/performance.md``, "Kernel choices").

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

MERGE_VALUES = 8192
"""fp32 values of one ``[splits, values]`` step of the in-kernel merge (64 a thread on 4 warps,
the main loop's registers free by then): all 128 splits of a 64-value slice in one step."""
MERGE_STEP = 512
"""Most values of a program's slice merged in one pass over the splits: one latent row (the
pass's running output: 4 registers a thread on a 4-warp kernel)."""


def fold_slice(*, num_splits: int, rows: int, rank: int) -> int:
    """Values of a row block's flattened ``rows × rank`` output that each split's program merges:
    ``rows · rank / num_splits``, taken :func:`merge_step` values a pass, each pass inside one row
    (so a pass reads one LSE and one contiguous run of each split). 0 when that does not work
    out (one split; splits not dividing ``rows · rank``; a pass that is not a power of two or does
    not divide the latent width)."""
    if num_splits < 2 or (rows * rank) % num_splits:
        return 0
    values = rows * rank // num_splits
    step: int = merge_step(values)
    if step & (step - 1) or values % step or rank % step:
        return 0
    return values


@gluon.constexpr_function
def merge_step(values: int) -> int:
    """Values of a ``values``-wide slice merged in one pass: at most :data:`MERGE_STEP`. A
    constexpr function: the kernel and the host call the same one."""
    return min(values, MERGE_STEP)


@gluon.constexpr_function
def fold_block_splits(*, num_splits: int, values: int) -> int:
    """Splits per step of a pass of the in-kernel merge over ``values`` values: a power of two
    dividing ``num_splits``, at most :data:`MERGE_VALUES` values a step. A constexpr function
    (the kernel derives its step)."""
    block = 1
    while block < num_splits and 2 * block * values <= MERGE_VALUES and num_splits % (2 * block) == 0:
        block *= 2
    return block


def foldable_splits(num_splits: int, *, rows: int, rank: int) -> int:
    """The most splits, at most ``num_splits``, whose :func:`fold_slice` is not 0; 0 when there is
    none (``num_splits < 2``)."""
    for splits in range(num_splits, 1, -1):
        if fold_slice(num_splits=splits, rows=rows, rank=rank):
            return splits
    return 0


def _capturing(device: torch.device) -> bool:
    """Whether ``device``'s current stream is capturing a CUDA graph."""
    with torch.cuda.device(device):
        return torch.cuda.is_current_stream_capturing()


_BARRIERS: dict[torch.device, torch.Tensor] = {}


def barrier_words(device: torch.device) -> torch.Tensor | None:
    """The ``[arrived, generation]`` int32 words of ``device`` (zeros when made), or ``None``
    while the current stream is capturing a graph and there are none yet (making them then
    would place them in the graph's private memory pool). Any other device (the CPU launch
    recorder of the tests) gets zeros of its own."""
    if device == torch.device("cuda"):  # no index: the current device's words
        device = torch.device("cuda", torch.cuda.current_device())
    words = _BARRIERS.get(device)
    if words is None:
        if device.type == "cuda" and _capturing(device):
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
def merge_output_slice(
    part_o_ptr, part_lse_ptr, out_ptr, lse_ptr, req, split, rb, q_start, qlen,
    stride_po_w, stride_po_q, stride_po_h, stride_pl_w, stride_pl_q,
    stride_o_t, stride_o_h, stride_lse_t, stride_lse_h,
    H: gl.constexpr, NR: gl.constexpr, L: gl.constexpr, SPLITS: gl.constexpr, WRITE_LSE: gl.constexpr,
):  # fmt: skip
    """LSE-merge values ``[split·E, (split+1)·E)`` (``E = NR·L / SPLITS``, :func:`fold_slice`)
    of row block ``rb``'s flattened ``NR × L`` output over the ``SPLITS`` partials of request
    ``req`` (work items ``req·SPLITS …``) into ``out`` (and ``lse``, by the pass that starts a
    row, with ``WRITE_LSE``). A pass of :func:`merge_step` values lies in one row: it reads one
    LSE and one contiguous run of :func:`fold_block_splits` splits a step; padding rows
    (``qi >= qlen``) read and write nothing. The same math as the separate reduce
    (:mod:`mla.providers.triton.merge`): one pass with a running maximum; a NaN partial makes
    the row NaN; rows with no visible key get ``o = 0``, ``lse = -inf``."""
    E: gl.constexpr = NR * L // SPLITS
    STEP: gl.constexpr = merge_step(E)
    BLOCK_S: gl.constexpr = fold_block_splits(num_splits=SPLITS, values=STEP)
    # [splits, values] steps: 4 fp32 values (16 bytes) a thread, the warps stacked over the splits.
    layout: gl.constexpr = _row_copy_layout(STEP, 4, gl.num_warps())
    split_layout: gl.constexpr = gl.SliceLayout(1, layout)
    value_layout: gl.constexpr = gl.SliceLayout(0, layout)
    offs_s = gl.arange(0, BLOCK_S, layout=split_layout)
    offs_v = gl.arange(0, STEP, layout=value_layout)
    # A step waits for its loads (over a microsecond, from L2; the output stores
    # of a pass keep the next pass's loads behind them), so a pass takes every split at once where
    # that fits (MERGE_VALUES); masks rather than branches.
    for e0 in range(0, E, STEP):
        flat = split * E + e0
        row = rb * NR + flat // L
        qi = row // H
        head = row % H
        col = gl.multiple_of(flat % L, STEP)  # STEP divides L: 16-byte loads of the partials
        ok = qi < qlen  # padding rows of the block: nothing to read or write
        o_base = part_o_ptr + qi * stride_po_q + head * stride_po_h + col + offs_v
        lse_base = part_lse_ptr + qi * stride_pl_q + head
        top = gl.max(gl.full([BLOCK_S], float("-inf"), gl.float32, layout=split_layout), 0)
        denom = gl.sum(gl.zeros([BLOCK_S], gl.float32, layout=split_layout), 0)
        acc = gl.zeros([STEP], gl.float32, layout=value_layout)
        for c in gl.static_range(0, SPLITS, BLOCK_S):
            wk = (req * SPLITS + c + offs_s).to(gl.int64)
            lse_s = gl.load(lse_base + wk * stride_pl_w, mask=ok, other=float("-inf"))
            o_s = gl.load(o_base[None, :] + (wk * stride_po_w)[:, None], mask=ok, other=0.0)
            new_top = gl.maximum(top, gl.max(lse_s, 0))
            new_use = gl.where(new_top == float("-inf"), 0.0, new_top)
            rescale = gl.exp(top - new_use)
            weight = gl.exp(lse_s - new_use)
            acc = acc * rescale + gl.sum(o_s * weight[:, None], 0)
            denom = denom * rescale + gl.sum(weight, 0)
            top = new_top
        has_keys = denom != 0.0
        safe = gl.where(has_keys, denom, 1.0)
        token = (q_start + qi).to(gl.int64)
        o_ptrs = out_ptr + token * stride_o_t + head * stride_o_h + col + offs_v
        gl.store(o_ptrs, (acc / safe).to(out_ptr.dtype.element_ty), mask=ok)
        if WRITE_LSE:
            top_use = gl.where(top == float("-inf"), 0.0, top)
            lse = gl.where(has_keys, top_use + gl.log(safe), float("-inf"))
            gl.store(lse_ptr + token * stride_lse_t + head * stride_lse_h, lse, mask=ok & (col == 0))


__all__ = [
    "MERGE_STEP",
    "MERGE_VALUES",
    "barrier_words",
    "fold_block_splits",
    "fold_slice",
    "foldable_splits",
    "grid_barrier",
    "merge_output_slice",
    "merge_step",
]
