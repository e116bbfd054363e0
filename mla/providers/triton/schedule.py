# mypy: disable-error-code="no-untyped-def, untyped-decorator"
"""Launch geometry of the Triton MLA decode and its device-side split-KV planner.

Two things live here:

* :func:`decode_launch_config`: the documented heuristic that turns (batch, heads × qlen, the
  static KV bound, SM count, cache element size) into block shapes, warps, pipeline depth and
  the non-persistent split count. No run-time autotuning: each distinct answer is one compiled
  specialisation, and the table below keeps them few (three row tiles × two cache widths).
* :func:`plan_split_kv`: a one-program Triton kernel that fills a
  :class:`~mla.providers.split_kv.SplitKVSchedule` with exactly the semantics of
  :meth:`SplitKVSchedule.plan` (the torch reference), without a host sync, so a captured decode
  graph stays valid when the schedule is re-planned in place.

Heuristic (rows = heads × qlen packed into the MMA M dimension, FlashMLA-style):

============  ========  =========  =======  ========  ===================================
rows          BLOCK_M   num_warps  BLOCK_N  per SM    why
============  ========  =========  =======  ========  ===================================
<= 16         16        4          64       2         memory-bound: deep KV tiles, mma m16
17 .. 32      32        8          64       1         verify qlen 2 at 16 heads: same bytes
> 32          64        8          64       1         64-row tile (wgmma); 8 warps keep the
                                                      64×512 fp32 accumulator at 128 regs
============  ========  =========  =======  ========  ===================================

"per SM" (``programs_per_sm``) is how many programs of the tile are resident on one Hopper SM,
read off the compiler's report for sm_90 (bf16 16-row tile: 92 KB shared memory and 232
registers × 128 threads, so two fit; the others are bound to one by shared memory or
registers). Slots = SMs × programs_per_sm is the size of one wave.

fp8 caches use 64-token tiles (32 above 16 rows), 8 warps and a hand-written register prefetch
of the next tile (``reg_pipeline``; Triton does not cp.async-pipeline a tile that is widened
before the dots); 255 registers × 256 threads hold one program per SM. fp8 at 16 heads runs
slower than bf16 on this kernel (the Gluon kernels take fp8 on Hopper; ``docs/performance.md``).
Rows above 64 run as ``ceil(rows / 64)`` row blocks over the same KV range (adjacent
programs, so the second read of a tile hits L2).

Splits are sized in whole waves, because a program that starts in a second, mostly empty wave
costs as much as a full one:

* non-persistent: the split count ``k`` minimises ``ceil(P·k / slots) / k`` (waves per unit of
  work, ``P`` = requests × row blocks), the smallest such ``k``, capped by ``MAX_SPLITS`` and by
  ``MIN_SPLIT_TOKENS`` per split;
* persistent: the planner's unit count is the largest power of two <= slots / row blocks, so
  ``chunk = total / units`` cuts power-of-two batches and lengths into equal items with no
  short tail item (132 units cut B=64 × 4096 tokens into 2 items of 1986 plus one of 124 per
  request; 128 units into 2 of 2048: 18% faster at one program per SM).

Against the previous rule (``2·SMs`` programs, ``2·SMs`` units) these sizes took 15–25% off the
non-persistent and the 128-head persistent cases and left the 16-head persistent ones as they
were (``docs/performance.md``, "Kernel choices").
"""

from __future__ import annotations

import attrs
import torch
import triton
import triton.language as tl

from mla.core.errors import PlanMismatchError
from mla.providers.split_kv import SplitKVSchedule, wave_splits
from mla.providers.triton.launch_cache import LaunchCache

MIN_SPLIT_TOKENS = 256
"""Smallest KV range a split is given (non-persistent) and the persistent planner's min chunk."""
MAX_SPLITS = 128
"""Upper bound on non-persistent splits per request (bounds the partial buffer)."""


@attrs.frozen
class DecodeLaunchConfig:
    """Compile-time shape of one decode launch plus its (run-time) split count."""

    block_m: int
    """Packed query rows (qlen × heads) per program: 16, 32 or 64."""
    block_n: int
    """KV tokens per inner-loop tile."""
    num_warps: int
    num_stages: int
    """Software-pipelining depth of the KV tile loads (cp.async on NVIDIA)."""
    num_splits: int = 1
    """Non-persistent mode: KV splits per request (1 writes the output directly)."""
    reg_pipeline: bool = False
    """Prefetch the next KV tile into registers by hand instead of Triton's cp.async pipeliner
    (fp8 tiles, which are widened before the dots, are not pipelined by Triton)."""
    programs_per_sm: int = 1
    """Programs of this tile resident on one SM at once (from the sm_90 compiler report)."""

    def row_blocks(self, rows: int) -> int:
        return -(-rows // self.block_m)


def row_tile(rows: int, *, kv_elem_size: int) -> DecodeLaunchConfig:
    """The (BLOCK_M, BLOCK_N, warps, stages) row of the heuristic table for ``rows`` packed rows."""
    if kv_elem_size == 1:
        # fp8: hand-pipelined tiles; 8 warps keep the widened tiles out of register spills.
        block_m = min(64, max(16, triton.next_power_of_2(rows)))
        return DecodeLaunchConfig(
            block_m=block_m, block_n=64 if block_m == 16 else 32, num_warps=8, num_stages=1, reg_pipeline=True
        )
    if rows <= 16:
        return DecodeLaunchConfig(block_m=16, block_n=64, num_warps=4, num_stages=2, programs_per_sm=2)
    if rows <= 32:
        return DecodeLaunchConfig(block_m=32, block_n=64, num_warps=8, num_stages=2)
    return DecodeLaunchConfig(block_m=64, block_n=64, num_warps=8, num_stages=2)


def decode_launch_config(
    *,
    batch: int,
    rows: int,
    max_seqlen_k: int,
    num_sms: int,
    kv_elem_size: int,
    persistent: bool,
) -> DecodeLaunchConfig:
    """The launch configuration for a decode of ``batch`` requests with ``rows`` = heads × qlen.

    Persistent launches take their splits from the schedule (``num_splits`` stays 1 here);
    non-persistent ones get :func:`wave_splits` for ``batch × row_blocks`` programs.
    """
    tile = row_tile(rows, kv_elem_size=kv_elem_size)
    if persistent:
        return tile
    cap = min(MAX_SPLITS, max(1, -(-max_seqlen_k // MIN_SPLIT_TOKENS)))
    slots = num_sms * tile.programs_per_sm
    return attrs.evolve(tile, num_splits=wave_splits(batch * tile.row_blocks(rows), slots=slots, cap=cap))


def schedule_units(*, num_sms: int, rows: int) -> int:
    """Work items the persistent planner aims for: the largest power of two <= one wave of
    the tile's slots divided by its row blocks (see the module docstring)."""
    tile = row_tile(rows, kv_elem_size=2)
    per_wave = max(1, num_sms * tile.programs_per_sm // tile.row_blocks(max(rows, 1)))
    return 1 << (per_wave.bit_length() - 1)


def allocate_schedule(
    *,
    max_batch: int,
    max_kernel_qlen: int,
    kernel_heads: int,
    kv_lora_rank: int,
    num_sms: int,
    device: torch.device,
) -> SplitKVSchedule:
    """Fixed schedule buffers sized for the largest (batch, kernel qlen, heads) of the engine."""
    return SplitKVSchedule.allocate(
        max_batch=max_batch,
        max_kernel_qlen=max_kernel_qlen,
        kernel_heads=kernel_heads,
        kv_lora_rank=kv_lora_rank,
        num_units=schedule_units(num_sms=num_sms, rows=kernel_heads * max_kernel_qlen),
        device=device,
        min_chunk=MIN_SPLIT_TOKENS,
    )


@triton.jit
def _plan_split_kv_kernel(
    kv_indptr_ptr,
    work_info_ptr,
    split_indptr_ptr,
    chunk_ptr,
    batch_size,
    max_work,
    num_units,
    min_chunk,
    BLOCK: tl.constexpr,
):
    """One program: ``chunk = max(ceil(total / units), min_chunk)``; request ``b`` gets
    ``max(ceil(len_b / chunk), 1)`` items of ``chunk`` tokens, in request order; the rest idle."""
    offs = tl.arange(0, BLOCK)
    total = tl.load(kv_indptr_ptr + batch_size) - tl.load(kv_indptr_ptr)
    chunk = tl.maximum((total + num_units - 1) // num_units, min_chunk)
    carry = total * 0
    for b0 in range(0, batch_size, BLOCK):
        b = b0 + offs
        live_req = b < batch_size
        lo = tl.load(kv_indptr_ptr + b, mask=live_req, other=0)
        hi = tl.load(kv_indptr_ptr + b + 1, mask=live_req, other=0)
        splits = tl.where(live_req, tl.maximum((hi - lo + chunk - 1) // chunk, 1), 0)
        ends = carry + tl.cumsum(splits, 0)
        tl.store(split_indptr_ptr + b + 1, ends, mask=live_req)
        first = ends - splits
        for j in range(tl.max(splits, 0)):
            live = live_req & (j < splits)
            row = work_info_ptr + (first + j) * 4
            start = lo + j * chunk
            tl.store(row, b, mask=live)
            tl.store(row + 1, start, mask=live)
            tl.store(row + 2, tl.minimum(start + chunk, hi), mask=live)
            tl.store(row + 3, offs * 0 + j, mask=live)
        carry += tl.sum(splits, 0)
    tl.store(split_indptr_ptr, carry * 0)
    for w0 in range(carry, max_work, BLOCK):
        w = w0 + offs
        idle = w < max_work
        row = work_info_ptr + w * 4
        tl.store(row, offs * 0 - 1, mask=idle)
        tl.store(row + 1, offs * 0, mask=idle)
        tl.store(row + 2, offs * 0, mask=idle)
        tl.store(row + 3, offs * 0, mask=idle)
    tl.store(chunk_ptr, chunk)


PLAN_LAUNCH = LaunchCache(_plan_split_kv_kernel)
"""The planner's launches (a persistent decode build's second launch): :mod:`.launch_cache`."""


def plan_split_kv(schedule: SplitKVSchedule, kv_indptr: torch.Tensor, batch_size: int) -> None:
    """Fill ``schedule`` for requests ``0 .. batch_size-1`` of ``kv_indptr`` (int32, device).

    Same result as :meth:`SplitKVSchedule.plan`; one program, no host sync, launched through
    :data:`PLAN_LAUNCH`.
    """
    if batch_size > schedule.max_batch:
        raise PlanMismatchError(
            f"batch_size {batch_size} exceeds the {schedule.max_batch} requests the schedule was sized for"
        )
    PLAN_LAUNCH.launch(
        (1,),
        kv_indptr,
        schedule.work_info,
        schedule.split_indptr,
        schedule.chunk,
        batch_size,
        schedule.max_work,
        schedule.num_units,
        schedule.min_chunk,
        BLOCK=128,
        num_warps=4,
    )
