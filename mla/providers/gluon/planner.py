"""Launch heuristic and split-KV planning of the Gluon MLA decode (pure Python, CPU-testable).

Up to :data:`FEW_ROWS_MAX` packed rows (heads × qlen) run on the transposed few-rows kernel
(:mod:`.transposed`, 16- or 32-row tiles on one warpgroup; 16 rows of an fp8 cache on the
dual-chain kernel of :mod:`.dual`, a loader warpgroup and two MMA warpgroups taking alternate
tiles), more in 64-row tiles: on the ping-pong kernel (:mod:`.pingpong`, a loader warpgroup and
two MMA warpgroups taking alternate KV tiles) for 16-bit caches, on the 64-row kernel
(:mod:`.kernels`, 8 warps) for fp8 caches. Each fills the shared memory of an SM (the 64-row
kernel: query tile 72 KB, a two-stage ring of 64-token bf16 KV tiles 144 KB, the token-id ring;
221 KB in all; the ping-pong kernel 231 KB; the dual-chain kernel 171 KB; the few-rows kernel
165–222 KB), so one program is resident per SM (compiler report for sm_90,
``probes/gluon_compile.py``). A wave is ``num_sms`` programs, and rows above the tile run
as ``ceil(rows / row_tile)`` row blocks over the same KV range (adjacent programs, so
the second read of a tile hits L2).

Tile shape: 64-token tiles in a two-stage ring, serial MMAs, were the fastest on every case
swept (32- and 16-token tiles with deeper rings and overlapped MMAs were slower;
``docs/performance.md``, "Kernel choices").

Time grows with the number of tiles, not with the bytes: every tile re-reads the whole 64×576
query tile from shared memory for QKᵀ in both warpgroups (144 KB per tile, the wgmma A operand)
besides the softmax's cross-warpgroup exchanges, so the largest tile that fits (64 tokens, two
stages) wins, and the software-pipelined loop (``overlap``) does not pay it back.

The transposed kernel on two warpgroups (64 rows, each warpgroup owning 32) measured slower than
the 64-row kernel at 64 rows (verify q4 and 128 heads; ``docs/performance.md``, "Kernel
choices"): both warpgroups read the whole K tile for QKᵀ and Vᵀ for PV (about 350 KB of shared
memory per tile against 280 KB), so 33–64 rows stay on the 64-row kernel;
``GluonLaunchConfig(row_tile=64, transposed=True)`` selects it explicitly.

Splits are sized in whole waves (a program in a mostly empty second wave costs a full one):

* non-persistent: the split count ``k`` minimises ``ceil(P·k / slots) / k`` for
  ``P = requests × row blocks`` programs, capped at ``MAX_SPLITS`` and at one split per
  ``MIN_SPLIT_TOKENS`` tokens;
* persistent (planned :class:`~mla.providers.split_kv.SplitKVSchedule`): the planner's unit count is the
  largest power of two <= ``num_sms / row_blocks``, so power-of-two batches and lengths are cut
  into equal items (the Triton provider's device planner fills the schedule).
"""

from __future__ import annotations

import attrs
import torch

from mla.core.errors import InvalidInputError

MIN_SPLIT_TOKENS = 256
"""Smallest KV range a split is given (non-persistent) and the persistent planner's min chunk."""
MAX_SPLITS = 128
"""Upper bound on non-persistent splits per request (bounds the partial buffer)."""
FP8_KV_DTYPES = frozenset({torch.float8_e4m3fn, torch.float8_e5m2})
"""fp8 cache formats the Gluon kernel widens (Hopper converts both to 16-bit)."""
BLOCK_M = 64
"""Packed query rows per program (the wgmma M tile of one warpgroup pair)."""
FEW_ROWS_MAX = 32
"""Largest packed row count the transposed few-rows kernel takes (its ``Oᵀ`` accumulator is
``512 × rows`` fp32 on one warpgroup: 128 registers per thread at 32 rows)."""
NUM_WARPS = 8
"""Two warpgroups, each holding half of the 64×512 fp32 output accumulator."""
SUPPORTED_LATENT = 512
"""The only latent width the kernel is built for (two warpgroups × 256-wide wgmma N)."""
SUPPORTED_ROPE = 64
"""The only rope width the kernel is built for."""


@attrs.frozen
class GluonLaunchConfig:
    """Compile-time shape of one Gluon decode launch plus its run-time split count."""

    block_n: int = 64
    """KV tokens per tile (the wgmma N of QKᵀ and K of PV)."""
    num_stages: int = 2
    """Depth of the shared-memory KV ring (16-bit caches: tiles in flight = ``num_stages - 1``;
    the few-rows kernel's fp8 ring refills a slot once its tile is widened into the one fp16
    tile, so all ``num_stages`` fp8 tiles are in flight). Two stages fill the shared memory of
    the 16-bit kernels; on fp8, three measured no better than two
    (``docs/performance.md``, "Kernel choices")."""
    num_splits: int = 1
    """Non-persistent mode: KV splits per request (1 writes the output directly)."""
    overlap: bool = False
    """Software-pipeline the MMAs (PV of tile t with QKᵀ of tile t+1); needs ``num_stages >= 3``."""
    row_tile: int = BLOCK_M
    """Packed query rows per program: 16, 32 or 64."""
    transposed: bool = attrs.field(
        default=attrs.Factory(lambda self: self.row_tile != BLOCK_M, takes_self=True)
    )
    """Run the transposed few-rows kernel of :mod:`.transposed` (rows as the MMA N dimension; 64
    rows on two warpgroups) instead of the 64-row kernel of :mod:`.kernels`. Default: exactly
    when ``row_tile`` is below 64 (the 64-row kernel takes only 64)."""
    pingpong: bool = False
    """Run 64 rows on the ping-pong kernel of :mod:`.pingpong` (two MMA warpgroups taking
    alternate KV tiles, a loader warpgroup; 16-bit caches, 64-token tiles, two stages) instead of
    the 64-row kernel of :mod:`.kernels`. :func:`launch_config` picks it for every 16-bit launch
    of 64-row tiles: it was faster on every 64-row case measured
    (``docs/performance.md``, "Kernel choices")."""

    dual: bool = False
    """Run 16 rows of an fp8 cache on the dual-chain kernel of :mod:`.dual` (a loader
    warpgroup that gathers the fp8 tiles, two MMA warpgroups taking alternate tiles, each
    widening its own in registers, with a running output each, merged at the end) instead of
    the few-rows kernel. :func:`launch_config` picks it for every fp8 launch of 16-row tiles: it
    takes about 40% off the few-rows kernel's time on fp8 (``docs/performance.md``, "Kernel choices")."""

    fold: bool = False
    """Fold the split reduce into the few-rows kernel (:mod:`.fold`: a cooperative launch, a
    grid barrier, then each split's program merges ``1 / num_splits`` of its row block's output)
    instead of launching the separate reduce. Needs the transposed kernel (16-bit or fp8 cache),
    ``num_splits`` that :func:`.fold.fold_slice` accepts (a power of two from 2 up: 128 splits of
    a 16-row block merge 64 values each) and the whole grid in one wave (checked at launch).
    :func:`launch_config` leaves it off: it ties the separate reduce on one long request and
    loses at two splits (``docs/performance.md``, "Kernel choices")."""

    def row_blocks(self, rows: int) -> int:
        return -(-rows // self.row_tile)


def decode_kernel(
    *, q_dtype: torch.dtype, kv_dtype: torch.dtype, kv_lora_rank: int, rope_dim: int
) -> tuple[str, str]:
    """Which kernel serves a decode: ``("gluon", why)`` or ``("triton", why)``.

    The Gluon kernels are built for 16-bit queries, a cache of the query's dtype or fp8 (e4m3 /
    e5m2, widened to fp16 in shared memory) and the 512 + 64 latent/rope split; everything else
    runs on the Triton provider's decode kernel. The Gluon kernels measured 1.8–3x faster on fp8
    than the Triton kernel (``docs/performance.md``, "Kernel choices").
    """
    if (kv_lora_rank, rope_dim) != (SUPPORTED_LATENT, SUPPORTED_ROPE):
        return "triton", (
            f"latent/rope dims {kv_lora_rank}+{rope_dim}: the Gluon kernel is built for "
            f"{SUPPORTED_LATENT}+{SUPPORTED_ROPE}"
        )
    if q_dtype not in (torch.bfloat16, torch.float16):
        return "triton", f"query dtype {q_dtype}: the Gluon kernel takes bf16/fp16 queries"
    if kv_dtype in FP8_KV_DTYPES:
        return "gluon", f"fp8 cache ({kv_dtype}), widened to fp16 in shared memory, 512+64 dims"
    if kv_dtype != q_dtype:
        return "triton", f"cache dtype {kv_dtype} differs from the query dtype {q_dtype}"
    return "gluon", "16-bit cache, 512+64 dims"


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
    *, batch: int, rows: int, max_seqlen_k: int, num_sms: int, persistent: bool, kv_fp8: bool
) -> GluonLaunchConfig:
    """The launch configuration for ``batch`` requests of ``rows`` = heads × qlen packed rows.

    Tiles and splits are the same for 16-bit and fp8 caches; 64-row tiles of a 16-bit cache
    (``kv_fp8=False``) run on the ping-pong kernel, 16-row tiles of an fp8 cache on the
    dual-chain kernel. Persistent launches take their splits from
    the schedule (``num_splits`` stays 1).
    """
    row_tile = few_rows_tile(rows)
    tile = GluonLaunchConfig(
        row_tile=row_tile, pingpong=row_tile == BLOCK_M and not kv_fp8, dual=row_tile == 16 and kv_fp8
    )
    if persistent:
        return tile
    cap = min(MAX_SPLITS, max(1, -(-max_seqlen_k // MIN_SPLIT_TOKENS)))
    splits = wave_splits(batch * tile.row_blocks(max(rows, 1)), slots=max(1, num_sms), cap=cap)
    return attrs.evolve(tile, num_splits=splits)


def check_config(config: GluonLaunchConfig, *, kv_fp8: bool) -> None:
    """Raise :class:`InvalidInputError` (argument ``config``) for a launch the kernels cannot
    run: the transposed kernel takes 16, 32 or 64 rows (fp8: 16 or 32, shared memory), 64-token
    tiles and no overlap; the 64-row kernel takes 64 rows; the ping-pong kernel 64 rows of a
    16-bit cache in 64-token tiles, two stages, no overlap; the dual-chain kernel 16 rows of an
    fp8 cache in 64-token tiles, no overlap (it has its own fp8 ring: ``num_stages`` is unused).
    Only the transposed kernel folds the split reduce (``fold``; the launch checks the grid)."""
    if config.dual:
        _require_fixed_shape(
            config, kv_fp8, kernel="dual-chain", flag="dual", fp8_cache=True,
            shape={
                "row_tile": 16, "transposed": True, "block_n": 64, "overlap": False, "pingpong": False,
                "fold": False,
            },
        )  # fmt: skip
        return
    if config.pingpong:
        _require_fixed_shape(
            config, kv_fp8, kernel="ping-pong", flag="pingpong", fp8_cache=False,
            shape={
                "row_tile": BLOCK_M, "transposed": False, "block_n": 64, "num_stages": 2, "overlap": False,
                "fold": False,
            },
        )  # fmt: skip
        return
    if config.transposed:
        tiles = (16, 32) if kv_fp8 else (16, 32, BLOCK_M)
        if config.row_tile not in tiles or config.block_n != 64 or config.overlap:
            raise InvalidInputError(
                "config",
                f"the transposed kernel takes row_tile in {tiles}, block_n=64 and overlap=False "
                f"(got row_tile={config.row_tile}, block_n={config.block_n}, overlap={config.overlap}); "
                "or set transposed=False for the 64-row kernel",
            )
    elif config.row_tile != BLOCK_M or config.fold:
        raise InvalidInputError(
            "config",
            f"the 64-row kernel takes row_tile={BLOCK_M} and no fold (got row_tile={config.row_tile}, "
            f"fold={config.fold}); set transposed=True for 16 or 32 rows or a folded reduce",
        )


def _require_fixed_shape(
    config: GluonLaunchConfig,
    kv_fp8: bool,
    *,
    kernel: str,
    flag: str,
    fp8_cache: bool,
    shape: dict[str, object],
) -> None:
    """Raise :class:`InvalidInputError` unless ``config`` has exactly the fields of ``shape`` and
    the cache is fp8 exactly when ``fp8_cache`` (a kernel built for one launch shape)."""
    got = {name: getattr(config, name) for name in shape}
    if kv_fp8 != fp8_cache or got != shape:
        cache = "an fp8 cache" if fp8_cache else "a 16-bit cache"
        wanted = ", ".join(f"{name}={value}" for name, value in shape.items())
        seen = ", ".join(f"{name}={value}" for name, value in got.items())
        raise InvalidInputError(
            "config",
            f"the {kernel} kernel takes {cache} and {wanted} (got fp8={kv_fp8}, {seen}); or set {flag}=False",
        )


def few_rows_tile(rows: int) -> int:
    """The row tile for ``rows`` packed rows: 16 or 32 (transposed kernel) when they fit, else 64."""
    if rows <= FEW_ROWS_MAX:
        return 16 if rows <= 16 else 32
    return BLOCK_M


def schedule_units(*, num_sms: int, rows: int) -> int:
    """Work items the persistent planner aims for: the largest power of two <= ``num_sms``
    divided by the row blocks of ``rows``."""
    tile = few_rows_tile(max(rows, 1))
    per_wave = max(1, num_sms // (-(-max(rows, 1) // tile)))
    return 1 << (per_wave.bit_length() - 1)


__all__ = [
    "BLOCK_M",
    "FEW_ROWS_MAX",
    "FP8_KV_DTYPES",
    "MAX_SPLITS",
    "MIN_SPLIT_TOKENS",
    "NUM_WARPS",
    "GluonLaunchConfig",
    "check_config",
    "decode_kernel",
    "launch_config",
    "schedule_units",
    "wave_splits",
]
