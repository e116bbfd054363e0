"""Launch heuristic and split-KV planning of the Gluon MLA decode (pure Python, CPU-testable).

Up to :data:`FEW_ROWS_MAX` packed rows (heads × qlen) run on the transposed few-rows kernel
(:mod:`.transposed`, 16- or 32-row tiles on one warpgroup; 16 rows of an fp8 cache on the
dual-chain kernel of :mod:`.dual`, a loader warpgroup and two MMA warpgroups taking alternate
tiles; 16 rows of ``fp8_ds_mla`` rows on the kernel of :mod:`.ds_mla_rows`, a producer that
gathers and dequantizes beside one MMA warpgroup), more in 64-row tiles: on the ping-pong
kernel (:mod:`.pingpong`, a loader warpgroup and two MMA warpgroups taking alternate KV tiles)
for 16-bit caches, on the 64-row kernel (:mod:`.kernels`, 8 warps) for fp8 caches, on the
kernel of :mod:`.ds_mla_heads` (a producer dequantizing each tile where its fp8 bytes landed,
a scores and an output warpgroup) for ``fp8_ds_mla`` rows. Each fills
the shared memory of an SM (the 64-row kernel: query tile 72 KB, a two-stage ring of 64-token
bf16 KV tiles 144 KB, the token-id ring; 221 KB in all; the ping-pong kernel 231 KB; the
dual-chain kernel 171 KB; the few-rows kernel 165–222 KB; the ``fp8_ds_mla`` kernel 223–226
KB), so one program is resident per SM (compiler report for sm_90,
``probes/gluon_compile.py``). A wave is ``num_sms`` programs, and rows above the tile run
as ``ceil(rows / row_tile)`` row blocks over the same KV range (adjacent programs, so
the second read of a tile hits L2).

Tile shape: 64-token tiles in a two-stage ring, serial MMAs, were the fastest on every case
swept (32- and 16-token tiles with deeper rings and overlapped MMAs were slower;
``docs/performance.md``, "Kernel choices").

Time grows with the number of tiles, not with the bytes: every tile re-reads the whole 64×576
query tile from shared memory for QKᵀ in both warpgroups (144 KB per tile, the wgmma A operand)
besides the softmax's cross-warpgroup exchanges, so the largest tile that fits (64 tokens, two
stages) wins, and the software-pipelined loop (``overlap``) does not pay it back (measured
again with its MMAs no longer serialised: ``fp8_ds_mla`` H128 B128 q2 670 µs against 542).

The transposed kernel on two warpgroups (64 rows, each warpgroup owning 32) measured slower than
the 64-row kernel at 64 rows (verify q4 and 128 heads; ``docs/performance.md``, "Kernel
choices"): both warpgroups read the whole K tile for QKᵀ and Vᵀ for PV (about 350 KB of shared
memory per tile against 280 KB), so 33–64 rows stay on the 64-row kernel;
``GluonLaunchConfig(row_tile=64, kernel=GluonKernel.ROWS)`` selects it explicitly.

Which kernel takes which launch is one table, :data:`KERNEL_TABLE` (a :class:`KernelRule` per
:class:`GluonKernel`: the row tiles it takes on 16-bit and fp8 caches, the launch fields it is
built for, whether it may overlap its MMAs or fold the split reduce, and the (row tile, cache)
pairs :func:`launch_config` picks it for). :func:`check_config` and :func:`launch_config` read
only the table; the launcher of each kernel is :data:`mla.providers.gluon.decode.LAUNCHERS`.

Splits are sized in whole waves (a program in a mostly empty second wave costs a full one):

* non-persistent: the split count ``k`` minimises ``ceil(P·k / slots) / k`` for
  ``P = requests × row blocks`` programs, capped at ``MAX_SPLITS`` and at one split per
  ``MIN_SPLIT_TOKENS`` tokens;
* persistent (planned :class:`~mla.providers.split_kv.SplitKVSchedule`): the planner's unit count is the
  largest power of two <= ``num_sms / row_blocks``, so power-of-two batches and lengths are cut
  into equal items (the Triton provider's device planner fills the schedule).
"""

from __future__ import annotations

import enum

import attrs
import torch

from mla.core.errors import InvalidInputError
from mla.providers.split_kv import wave_splits

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
DS_MLA_STAGES = 3
"""Ring depth of the few-rows kernel (:attr:`GluonKernel.ROWS`) on 16-row tiles of
``fp8_ds_mla`` rows, the fastest it measured (two tiles in flight: its ring slot holds the bf16
rope lanes the MMAs read, so it is refilled a tile later than a per-tensor fp8 slot; 32-row
tiles fit two stages only). :func:`launch_config` gives 16-row tiles of those rows to
:attr:`GluonKernel.DS_MLA`; a launch that names the few-rows kernel sets this itself."""


class GluonKernel(enum.Enum):
    """The Gluon decode kernels (what each takes: :data:`KERNEL_TABLE`)."""

    ROWS = "rows"
    """The transposed few-rows kernel of :mod:`.transposed` (rows as the MMA N dimension)."""
    ROW64 = "row64"
    """The 64-row kernel of :mod:`.kernels` (8 warps; each MMA split across two warpgroups)."""
    PINGPONG = "pingpong"
    """The ping-pong kernel of :mod:`.pingpong` (a loader warpgroup, two MMA warpgroups taking
    alternate KV tiles)."""
    DUAL = "dual"
    """The dual-chain fp8 kernel of :mod:`.dual` (a loader warpgroup, two MMA warpgroups taking
    alternate tiles, each widening its own, merged at the end)."""
    DS_MLA = "ds_mla"
    """The ``fp8_ds_mla`` few-rows kernel of :mod:`.ds_mla_rows` (a producer partition that
    gathers and dequantizes the rows into bf16 tiles, one MMA warpgroup)."""
    DS_MLA_HEADS = "ds_mla_heads"
    """The ``fp8_ds_mla`` 64-row kernel of :mod:`.ds_mla_heads` (a producer that dequantizes each
    tile in place, where its fp8 bytes landed, a scores warpgroup and an output warpgroup)."""


@attrs.frozen
class KernelRule:
    """One row of the Gluon decode kernel table: the launches one kernel takes.

    A launch packs ``rows = heads × qlen`` query rows into tiles of ``row_tile`` rows
    (``ceil(rows / row_tile)`` row blocks over the same KV range), so a kernel's row tiles are
    the head × qlen products it serves per program, whatever the qlen. Every Gluon kernel takes
    bf16 or fp16 queries with a cache of the query's dtype ("16-bit") or fp8 (e4m3/e5m2);
    :func:`decode_kernel` routes every other case to the Triton kernel.
    """

    kernel: GluonKernel
    name: str
    """How messages call it."""
    tiles: tuple[int, ...]
    """Row tiles it takes on a 16-bit cache (empty: it takes no 16-bit cache)."""
    fp8_tiles: tuple[int, ...]
    """Row tiles it takes on an fp8 cache (empty: it takes no fp8 cache)."""
    block_n: int | None = 64
    """The KV tile it is built for (``None``: any)."""
    num_stages: int | None = None
    """The ring depth it is built for (``None``: any, or unused)."""
    overlap: bool = False
    """Whether it may software-pipeline its MMAs (``GluonLaunchConfig.overlap``)."""
    fold: bool = False
    """Whether it may fold the split reduce into itself (``GluonLaunchConfig.fold``)."""
    ds_mla: bool = False
    """Whether it reads ``fp8_ds_mla`` rows (its fp8 row tiles, each 128-wide latent tile
    dequantized by its scale; the sparse attention's cache format)."""
    ds_mla_only: bool = False
    """Whether ``fp8_ds_mla`` rows are all it reads (no 16-bit, no per-tensor fp8 cache)."""
    picked_for: tuple[tuple[int, bool], ...] = ()
    """The ``(row tile, fp8 cache)`` launches :func:`launch_config` gives it (each one measured
    fastest there: ``docs/performance.md``, "Kernel choices")."""
    ds_mla_picked_for: tuple[int, ...] = ()
    """The row tiles of ``fp8_ds_mla`` rows :func:`launch_config` gives it."""

    def tiles_for(self, kv_fp8: bool) -> tuple[int, ...]:
        """The row tiles it takes on an fp8 (``kv_fp8``) or a 16-bit cache."""
        return self.fp8_tiles if kv_fp8 else self.tiles


KERNEL_TABLE: tuple[KernelRule, ...] = (
    # 64 rows of fp8 do not fit: the fp8 ring and the widened tile beside a 512 x 64 Oᵀ.
    KernelRule(GluonKernel.ROWS, "transposed few-rows", (16, 32, BLOCK_M), (16, 32), fold=True,
               ds_mla=True, picked_for=((16, False), (32, False), (32, True)), ds_mla_picked_for=(32,)),
    KernelRule(GluonKernel.ROW64, "64-row", (BLOCK_M,), (BLOCK_M,), block_n=None, overlap=True,
               ds_mla=True, picked_for=((BLOCK_M, True),)),
    KernelRule(GluonKernel.PINGPONG, "ping-pong", (BLOCK_M,), (), num_stages=2,
               picked_for=((BLOCK_M, False),)),
    # num_stages is unused: the kernel has its own fp8 ring.
    KernelRule(GluonKernel.DUAL, "dual-chain", (), (16,), picked_for=((16, True),)),
    # num_stages is unused: the kernel has its own rings (ds_mla_rows.RINGS).
    KernelRule(GluonKernel.DS_MLA, "fp8_ds_mla few-rows", (), (16, 32), overlap=True, ds_mla=True,
               ds_mla_only=True, ds_mla_picked_for=(16,)),
    # its ring is its own (ds_mla_heads.NUM_STAGES). It takes split launches too (H100, top-k
    # 2048, 128 heads, qlen 1: B16 4 splits 45.2 µs against 47.7 on the 64-row kernel, B8 8 splits
    # 30.9 against 31.8; 64 heads B32 4 splits 50.8 against 50.2).
    KernelRule(GluonKernel.DS_MLA_HEADS, "fp8_ds_mla 64-row", (), (BLOCK_M,), ds_mla=True, ds_mla_only=True,
               ds_mla_picked_for=(BLOCK_M,)),
)  # fmt: skip
"""The Gluon decode kernels: what each takes and where the launch heuristic picks it. A new
kernel is a row here, a :class:`GluonKernel` member and a launcher in
:data:`mla.providers.gluon.decode.LAUNCHERS` (``docs/adding-a-kernel.md``)."""

RULES: dict[GluonKernel, KernelRule] = {rule.kernel: rule for rule in KERNEL_TABLE}
""":data:`KERNEL_TABLE` by kernel."""


def pick_kernel(row_tile: int, *, kv_fp8: bool, ds_mla: bool = False) -> GluonKernel:
    """The kernel :data:`KERNEL_TABLE` picks for tiles of ``row_tile`` rows of an fp8
    (``kv_fp8``) or a 16-bit cache, or of ``fp8_ds_mla`` rows (``ds_mla``: the rule whose
    ``ds_mla_picked_for`` names the tile); exactly one row claims each tile :func:`few_rows_tile`
    gives (a test checks it). :class:`InvalidInputError` naming ``row_tile`` when none does."""
    for rule in KERNEL_TABLE:
        if ds_mla:
            if row_tile in rule.ds_mla_picked_for:
                return rule.kernel
        elif (row_tile, kv_fp8) in rule.picked_for:
            return rule.kernel
    cache = "an fp8" if kv_fp8 else "a 16-bit"
    raise InvalidInputError(
        "row_tile", f"no Gluon decode kernel is picked for {row_tile}-row tiles of {cache} cache"
    )


def _default_kernel(config: GluonLaunchConfig) -> GluonKernel:
    return GluonKernel.ROWS if config.row_tile != BLOCK_M else GluonKernel.ROW64


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
    """Software-pipeline the MMAs (PV of tile t with QKᵀ of tile t+1); the 64-row kernel needs
    ``num_stages >= 3`` for it, the ``fp8_ds_mla`` kernel (:attr:`GluonKernel.DS_MLA`) nothing."""
    row_tile: int = BLOCK_M
    """Packed query rows per program: 16, 32 or 64."""
    kernel: GluonKernel = attrs.field(default=attrs.Factory(_default_kernel, takes_self=True))
    """The kernel that runs the launch (:data:`KERNEL_TABLE`). Default: the few-rows kernel for
    tiles below 64 rows, the 64-row kernel for 64 (:func:`launch_config` picks from the table:
    the ping-pong kernel for 64-row tiles of a 16-bit cache, the dual-chain kernel for 16-row
    tiles of an fp8 cache, :attr:`GluonKernel.DS_MLA` for 16-row tiles of ``fp8_ds_mla`` rows)."""
    fold: bool = False
    """Fold the split reduce into the few-rows kernel (:mod:`.fold`: a cooperative launch, a
    grid barrier, then each split's program merges ``1 / num_splits`` of its row block's output)
    instead of launching the separate reduce. Needs a kernel that folds (the table's ``fold``:
    the few-rows kernel, 16-bit or fp8 cache),
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


def launch_config(
    *,
    batch: int,
    rows: int,
    max_seqlen_k: int,
    num_sms: int,
    persistent: bool,
    kv_fp8: bool,
    ds_mla: bool = False,
) -> GluonLaunchConfig:
    """The launch configuration for ``batch`` requests of ``rows`` = heads × qlen packed rows.

    The row tile is :func:`few_rows_tile`'s and the kernel the table's pick for it
    (:func:`pick_kernel`: 64-row tiles of a 16-bit cache on the ping-pong kernel, of an fp8
    cache on the 64-row kernel; 16-row tiles of an fp8 cache on the dual-chain kernel; the
    others on the few-rows kernel). Tiles and splits are the same for 16-bit and fp8 caches.
    Persistent launches take their splits from the schedule (``num_splits`` stays 1).
    ``fp8_ds_mla`` rows (``ds_mla``, an fp8 cache) run on the kernel of :mod:`.ds_mla_rows` (16-row
    tiles), the few-rows kernel (32) or the kernel of :mod:`.ds_mla_heads` (64).
    """
    row_tile = few_rows_tile(rows)
    tile = GluonLaunchConfig(row_tile=row_tile, kernel=pick_kernel(row_tile, kv_fp8=kv_fp8, ds_mla=ds_mla))
    if persistent:
        return tile
    cap = min(MAX_SPLITS, max(1, -(-max_seqlen_k // MIN_SPLIT_TOKENS)))
    splits = wave_splits(batch * tile.row_blocks(max(rows, 1)), slots=max(1, num_sms), cap=cap)
    return attrs.evolve(tile, num_splits=splits)


def check_config(config: GluonLaunchConfig, *, kv_fp8: bool, ds_mla: bool = False) -> None:
    """Raise :class:`InvalidInputError` (argument ``config``) for a launch its kernel cannot
    run, by the kernel's row of :data:`KERNEL_TABLE`: a row tile it takes on this cache, the KV
    tile and ring depth it is built for, overlap and a folded reduce only where it has them (the
    launch checks a fold's grid), ``fp8_ds_mla`` rows only where it reads them, other rows only
    where it reads more than those. The message names every mismatch and the kernels that take
    the row tile on this cache."""
    rule = RULES[config.kernel]
    cache = "an fp8 cache" if kv_fp8 else "a 16-bit cache"
    tiles = rule.tiles_for(kv_fp8)
    wrong = []
    if config.row_tile not in tiles:
        wrong.append(f"row_tile={config.row_tile} (it takes {list(tiles) or 'no tile'} on {cache})")
    if rule.block_n is not None and config.block_n != rule.block_n:
        wrong.append(f"block_n={config.block_n} (it is built for {rule.block_n})")
    if rule.num_stages is not None and config.num_stages != rule.num_stages:
        wrong.append(f"num_stages={config.num_stages} (it is built for {rule.num_stages})")
    if config.overlap and not rule.overlap:
        wrong.append("overlap=True (it does not overlap its MMAs)")
    if config.fold and not rule.fold:
        wrong.append("fold=True (it does not fold the split reduce)")
    if ds_mla and not rule.ds_mla:
        wrong.append("fp8_ds_mla rows (it reads per-tensor fp8 or 16-bit rows only)")
    if rule.ds_mla_only and not ds_mla:
        wrong.append(f"{'per-tensor fp8' if kv_fp8 else '16-bit'} rows (it reads fp8_ds_mla rows only)")
    if wrong:
        others = [r.kernel.value for r in KERNEL_TABLE if config.row_tile in r.tiles_for(kv_fp8)]
        raise InvalidInputError(
            "config",
            f"the {rule.name} kernel (kernel={config.kernel.value}) cannot take {'; '.join(wrong)}; "
            f"kernels taking {config.row_tile}-row tiles of {cache}: {', '.join(others) or 'none'}",
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
    "DS_MLA_STAGES",
    "FEW_ROWS_MAX",
    "FP8_KV_DTYPES",
    "KERNEL_TABLE",
    "MAX_SPLITS",
    "MIN_SPLIT_TOKENS",
    "NUM_WARPS",
    "RULES",
    "GluonKernel",
    "GluonLaunchConfig",
    "KernelRule",
    "check_config",
    "decode_kernel",
    "launch_config",
    "pick_kernel",
    "schedule_units",
    "wave_splits",
]
