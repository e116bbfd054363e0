"""Launch heuristic and split-KV planning of the Gluon MLA decode (pure Python, CPU-testable).

The kernel (:mod:`.kernels`) always runs a 64-row query tile (heads × qlen packed, padded) on
8 warps, one program per SM: its shared memory (query tile 72 KB + a two-stage ring of
64-token bf16 KV tiles 144 KB, or the fp8 ring plus one widened tile) and 213–236 registers ×
256 threads leave room for one resident program (compiler report for sm_90,
``benchmarks/gluon_compile.py``). So a wave is ``num_sms`` programs, and rows above 64 run as
``ceil(rows / 64)`` row blocks over the same KV range (adjacent programs, the second read of a
tile hits L2).

==========  =======  ==========  ================================================================
KV dtype    BLOCK_N  NUM_STAGES  why
==========  =======  ==========  ================================================================
16-bit      64       2           one 74 KB tile in flight per SM while the previous is computed;
                                 the 64×576 tile is the FlashMLA page and the wgmma N of QKᵀ
fp8         64       2           same tile, half the bytes; widened to 16-bit in shared memory
==========  =======  ==========  ================================================================

Splits are sized in whole waves (a program in a mostly empty second wave costs a full one):

* non-persistent: the split count ``k`` minimises ``ceil(P·k / slots) / k`` for
  ``P = requests × row blocks`` programs (the Triton provider's :func:`wave_splits`), capped at
  ``MAX_SPLITS`` and at one split per ``MIN_SPLIT_TOKENS`` tokens;
* persistent (planned :class:`~mla.schedule.SplitKVSchedule`): the planner's unit count is the
  largest power of two <= ``num_sms / row_blocks``, so power-of-two batches and lengths are cut
  into equal items (the Triton provider's device planner fills the schedule).
"""

from __future__ import annotations

import attrs

MIN_SPLIT_TOKENS = 256
"""Smallest KV range a split is given (non-persistent) and the persistent planner's min chunk."""
MAX_SPLITS = 128
"""Upper bound on non-persistent splits per request (bounds the partial buffer)."""
BLOCK_M = 64
"""Packed query rows per program (the wgmma M tile of one warpgroup pair)."""
NUM_WARPS = 8
"""Two warpgroups, each holding half of the 64×512 fp32 output accumulator."""
SUPPORTED_LATENT = 512
"""The only latent width the kernel is built for (two warpgroups × 256-wide wgmma N)."""
SUPPORTED_ROPE = 64
"""The only rope width the kernel is built for."""


@attrs.frozen
class GluonLaunchConfig:
    """Compile-time shape of one Gluon decode launch plus its run-time split count."""

    block_n: int = 32
    """KV tokens per tile (the wgmma N of QKᵀ and K of PV)."""
    num_stages: int = 4
    """Depth of the shared-memory KV ring (tiles in flight = ``num_stages - 1``)."""
    num_splits: int = 1
    """Non-persistent mode: KV splits per request (1 writes the output directly)."""
    overlap: bool = True
    """Software-pipeline the MMAs (PV of tile t with QKᵀ of tile t+1); needs ``num_stages >= 3``."""

    def row_blocks(self, rows: int) -> int:
        return -(-rows // BLOCK_M)


def wave_splits(programs: int, *, slots: int, cap: int) -> int:
    """Split count ``k`` in ``1..cap`` with the fewest waves per unit of work,
    ``ceil(programs·k / slots) / k`` (the smallest such ``k``)."""
    programs = max(1, programs)
    best, best_cost = 1, float(-(-programs // slots))
    for k in range(2, max(1, cap) + 1):
        cost = -(-programs * k // slots) / k
        if cost < best_cost:
            best, best_cost = k, cost
    return best


def launch_config(
    *, batch: int, rows: int, max_seqlen_k: int, num_sms: int, kv_elem_size: int, persistent: bool
) -> GluonLaunchConfig:
    """The launch configuration for ``batch`` requests of ``rows`` = heads × qlen packed rows.

    Persistent launches take their splits from the schedule (``num_splits`` stays 1).
    ``kv_elem_size`` (1 for fp8) is accepted so the table can differ per cache width; today
    both widths use the same tile.
    """
    del kv_elem_size
    tile = GluonLaunchConfig()
    if persistent:
        return tile
    cap = min(MAX_SPLITS, max(1, -(-max_seqlen_k // MIN_SPLIT_TOKENS)))
    splits = wave_splits(batch * tile.row_blocks(max(rows, 1)), slots=max(1, num_sms), cap=cap)
    return attrs.evolve(tile, num_splits=splits)


def schedule_units(*, num_sms: int, rows: int) -> int:
    """Work items the persistent planner aims for: the largest power of two <= ``num_sms``
    divided by the row blocks of ``rows``."""
    per_wave = max(1, num_sms // (-(-max(rows, 1) // BLOCK_M)))
    return 1 << (per_wave.bit_length() - 1)


__all__ = [
    "BLOCK_M",
    "MAX_SPLITS",
    "MIN_SPLIT_TOKENS",
    "NUM_WARPS",
    "GluonLaunchConfig",
    "launch_config",
    "schedule_units",
    "wave_splits",
]
