# mypy: disable-error-code="no-untyped-def, untyped-decorator"
"""FP8 persistent prefill in Triton: a host-planned tile schedule, fp32 partials and an LSE reduce.

Work decomposition (planned once per step on the host by :func:`plan_fp8_prefill`):

* each request's query rows are cut into tiles of ``tile_q`` rows (the kernel's ``BLOCK_M``);
* a tile's visible key range (causal: up to its last row's diagonal) is cut into KV splits of at
  most ``kv_split`` keys, so no work unit is much longer than the rest;
* a *unit* is one (tile, split, head). Tiles with one split write ``out``/``lse`` directly; tiles
  with several write fp32 partials ``[slot, row, head, Dv]`` that :func:`_fp8_reduce_kernel`
  merges by LSE;
* the kernel runs ``num_programs`` programs; program ``p`` takes units ``p, p + P, p + 2P, ...``.
  Units are ordered request by request (most work first), head by head, longest split first, so
  programs running at the same time share one head's K/V in L2. The GPU planner launches one
  program per unit: the hardware block scheduler balanced the uneven causal units 11-19% faster
  than a static round-robin over one program per SM (192/128 causal; ``docs/performance.md``).
  ``num_programs < num_units`` gives that persistent round-robin (the tests exercise it).

Precision: QK runs as an fp8 x fp8 tensor-core dot (fp32 accumulation), so scores are exact
products of the stored values; ``q_scale * k_scale * softmax_scale`` is applied to the fp32
scores. PV runs in fp16: v's fp8 values convert to fp16 exactly (e4m3/e5m2 ranges fit fp16) and
the probabilities (in [0, 1]) round to fp16 (relative error 2^-11). Quantizing P to e4m3 instead
(3 mantissa bits) costs ~2.5% relative error on diffuse attention, over this module's 2e-2 budget
against the reference on the dequantized inputs; ``v_scale`` is applied once in the epilogue.
"""

from __future__ import annotations

import functools

import attrs
import torch
import triton
import triton.language as tl

from mla.core.config import FP8_DTYPES
from mla.core.errors import InvalidInputError, PlanMismatchError
from mla.providers.calls import Fp8PrefillCall
from mla.providers.triton.attention_epilogue import finalize_rows, store_rows
from mla.providers.triton.attention_host import (
    AttentionLaunchConfig,
    check_attention_args,
    head_dim_blocks,
)
from mla.providers.triton.host_math import cdiv
from mla.providers.triton.launch_cache import LaunchCache
from mla.providers.triton.prefill import LOG2E, attend_range, load_q_block

UNIT_FIELDS = 8
"""int32 fields per unit row: q_begin, q_rows, k_begin, num_keys, shift, slot, head, (pad)."""
GROUP_FIELDS = 4
"""int32 fields per split-tile row: q_begin, q_rows, first_slot, num_splits."""
MIN_KV_SPLIT = 1024
"""Shortest KV split the GPU planner makes (keys); shorter units pay their epilogue too often."""
KV_SPLIT_ALIGN = 128
"""KV splits are multiples of this, so every launch's ``BLOCK_N`` divides them."""
UNITS_PER_PROGRAM = 4
"""The planner sizes splits so each persistent program gets at least this many units."""
REDUCE_BLOCK_ROWS = 32
_MAX_GRID = (1 << 31) - 1
"""CUDA's grid x limit: the GPU plan's program count is ``min(num_units, _MAX_GRID)``."""


@attrs.frozen(eq=False)
class Fp8PrefillPlan:
    """The tile schedule of one fp8 prefill step (built on the host, read by the device).

    ``units`` int32 ``[num_units, 8]`` and ``groups`` int32 ``[num_groups, 4]`` live on the
    step's device; the ints size the launches. A unit's ``shift`` encodes the mask: row ``r`` of
    the tile sees split key ``n`` iff ``n <= r + shift``.
    """

    units: torch.Tensor
    groups: torch.Tensor
    num_units: int
    num_groups: int
    num_slots: int
    num_heads: int
    num_tokens: int
    num_kv_tokens: int
    causal: bool
    tile_q: int
    kv_split: int
    num_programs: int


@functools.lru_cache(maxsize=16)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def _visible_tiles(
    cu_q: list[int], cu_k: list[int], tile_q: int, causal: bool
) -> list[list[tuple[int, int, int]]]:
    """Per request, its tiles as ``(row0, rows, visible_keys)`` (request-relative rows)."""
    out: list[list[tuple[int, int, int]]] = []
    for b in range(len(cu_q) - 1):
        seq_q, seq_k = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
        tiles = []
        for row0 in range(0, seq_q, tile_q):
            rows = min(tile_q, seq_q - row0)
            visible = min(seq_k, max(0, row0 + rows + seq_k - seq_q)) if causal else seq_k
            tiles.append((row0, rows, visible))
        out.append(tiles)
    return out


def choose_kv_split(
    cu_seqlens_q: list[int], cu_seqlens_k: list[int], *, num_heads: int, causal: bool, tile_q: int,
    num_programs: int, min_split: int = MIN_KV_SPLIT,
) -> int:  # fmt: skip
    """KV split length (keys): the total visible work over ``UNITS_PER_PROGRAM * num_programs``
    units, rounded up to ``KV_SPLIT_ALIGN``, and at least ``min_split``. Large batches get no
    splits (one pass per tile); few long tiles get split until every program has work."""
    total = sum(
        visible * num_heads
        for tiles in _visible_tiles(cu_seqlens_q, cu_seqlens_k, tile_q, causal)
        for _, _, visible in tiles
    )
    per_unit = -(-total // (UNITS_PER_PROGRAM * max(1, num_programs)))
    return max(min_split, -(-per_unit // KV_SPLIT_ALIGN) * KV_SPLIT_ALIGN)


def build_fp8_prefill_plan(
    cu_seqlens_q_cpu: torch.Tensor,
    cu_seqlens_k_cpu: torch.Tensor,
    *,
    num_heads: int,
    causal: bool,
    device: torch.device,
    tile_q: int,
    kv_split: int,
    num_programs: int,
) -> Fp8PrefillPlan:
    """The schedule for explicit tile/split sizes (see the module docstring for the layout)."""
    if num_heads <= 0:
        raise InvalidInputError("num_heads", f"must be positive, got {num_heads}")
    if tile_q < 16 or tile_q & (tile_q - 1):
        raise InvalidInputError("tile_q", f"must be a power of two >= 16, got {tile_q}")
    if kv_split <= 0:
        raise InvalidInputError("kv_split", f"must be positive, got {kv_split}")
    cu_q = [int(x) for x in cu_seqlens_q_cpu.tolist()]
    cu_k = [int(x) for x in cu_seqlens_k_cpu.tolist()]
    if len(cu_q) != len(cu_k) or not cu_q:
        raise InvalidInputError("cu_seqlens_k", f"has {len(cu_k)} entries, cu_seqlens_q {len(cu_q)}")
    requests: list[tuple[int, int, list[tuple[int, ...]]]] = []
    groups: list[tuple[int, int, int, int]] = []
    num_slots = 0
    for b, tiles in enumerate(_visible_tiles(cu_q, cu_k, tile_q, causal)):
        seq_q, seq_k = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
        items: list[tuple[int, ...]] = []
        for row0, rows, visible in tiles:
            starts = list(range(0, visible, kv_split)) or [0]
            first_slot = num_slots if len(starts) > 1 else -1
            if len(starts) > 1:
                groups.append((cu_q[b] + row0, rows, num_slots, len(starts)))
                num_slots += len(starts)
            for index, k0 in enumerate(starts):
                num_keys = min(kv_split, visible - k0)
                shift = row0 + seq_k - seq_q - k0 if causal else num_keys - 1
                slot = -1 if first_slot < 0 else first_slot + index
                items.append((cu_q[b] + row0, rows, cu_k[b] + k0, num_keys, shift, slot))
        items.sort(key=lambda item: -item[3])
        requests.append((sum(item[3] for item in items), b, items))
    requests.sort(key=lambda request: (-request[0], request[1]))
    units = [(*item, head, 0) for _, _, items in requests for head in range(num_heads) for item in items]
    units_tensor = torch.tensor(units or [(0,) * UNIT_FIELDS], dtype=torch.int32).reshape(-1, UNIT_FIELDS)
    groups_tensor = torch.tensor(groups or [(0,) * GROUP_FIELDS], dtype=torch.int32).reshape(-1, GROUP_FIELDS)
    return Fp8PrefillPlan(
        units=units_tensor.to(device),
        groups=groups_tensor.to(device),
        num_units=len(units),
        num_groups=len(groups),
        num_slots=num_slots,
        num_heads=num_heads,
        num_tokens=cu_q[-1],
        num_kv_tokens=cu_k[-1],
        causal=causal,
        tile_q=tile_q,
        kv_split=kv_split,
        num_programs=max(1, min(num_programs, len(units))),
    )


def plan_fp8_prefill(
    cu_seqlens_q_cpu: torch.Tensor,
    cu_seqlens_k_cpu: torch.Tensor,
    *,
    num_heads: int,
    causal: bool,
    device: torch.device,
) -> Fp8PrefillPlan:
    """Host-side tiling for :func:`fp8_prefill_fwd` (the provider's ``plan_fp8_prefill``).

    GPU: 128-row tiles, one program per unit (see the module docstring), splits from
    :func:`choose_kv_split` sized for the SM count (>= 1024 keys). CPU (Triton interpreter):
    32-row tiles, 4 programs, splits >= 64 keys, so small test batches exercise the persistent
    loop and the partial + reduce path.
    """
    on_gpu = device.type == "cuda"
    tile_q = 128 if on_gpu else 32
    num_programs = _num_sms(device)
    cu_q = [int(x) for x in cu_seqlens_q_cpu.tolist()]
    cu_k = [int(x) for x in cu_seqlens_k_cpu.tolist()]
    kv_split = choose_kv_split(
        cu_q, cu_k, num_heads=num_heads, causal=causal, tile_q=tile_q, num_programs=num_programs,
        min_split=MIN_KV_SPLIT if on_gpu else 64,
    )  # fmt: skip
    return build_fp8_prefill_plan(
        cu_seqlens_q_cpu, cu_seqlens_k_cpu, num_heads=num_heads, causal=causal, device=device,
        tile_q=tile_q, kv_split=kv_split, num_programs=_MAX_GRID if on_gpu else num_programs,
    )  # fmt: skip


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _fp8_prefill_kernel(
    Q,
    K,
    V,
    Out,
    Lse,
    PartOut,
    PartLse,
    Units,
    QScale,
    KScale,
    VScale,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_lt,
    stride_lh,
    stride_ps,
    stride_pt,
    stride_ph,
    stride_pls,
    stride_plt,
    num_units,
    softmax_scale_log2e,
    D_QK: tl.constexpr,
    D_V: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DA: tl.constexpr,
    BLOCK_DB: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    qk_scale = tl.load(QScale) * tl.load(KScale) * softmax_scale_log2e
    v_scale = tl.load(VScale)
    for unit in range(tl.program_id(0), num_units, tl.num_programs(0)):
        fields = Units + unit * 8
        q_begin = tl.load(fields + 0).to(tl.int64)
        q_rows = tl.load(fields + 1)
        k_begin = tl.load(fields + 2).to(tl.int64)
        num_keys = tl.load(fields + 3)
        shift = tl.load(fields + 4)
        slot = tl.load(fields + 5)
        h = tl.load(fields + 6).to(tl.int64)
        rows_ok = tl.arange(0, BLOCK_M) < q_rows
        q_a, q_b = load_q_block(
            Q + q_begin * stride_qt + h * stride_qh, stride_qt, rows_ok, D_QK, BLOCK_DA, BLOCK_DB, BLOCK_M, 0
        )
        acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        acc, l_i, m_i = attend_range(
            acc, l_i, m_i, q_a, q_b,
            K + k_begin * stride_kt + h * stride_kh, V + k_begin * stride_vt + h * stride_vh,
            stride_kt, stride_vt, num_keys, shift, qk_scale,
            D_QK, D_V, BLOCK_M, BLOCK_N, BLOCK_DA, BLOCK_DB, BLOCK_DV, tl.float16, "tf32", None, 0, 0,
        )  # fmt: skip
        out, lse = finalize_rows(acc, l_i, m_i, v_scale)
        if slot < 0:
            store_rows(
                Out + q_begin * stride_ot + h * stride_oh, Lse + q_begin * stride_lt + h * stride_lh,
                out, lse, stride_ot, stride_lt, rows_ok, D_V, BLOCK_DV, BLOCK_M,
            )  # fmt: skip
        else:
            slot64 = slot.to(tl.int64)
            store_rows(
                PartOut + slot64 * stride_ps + h * stride_ph, PartLse + slot64 * stride_pls + h,
                out, lse, stride_pt, stride_plt, rows_ok, D_V, BLOCK_DV, BLOCK_M,
            )  # fmt: skip


@triton.jit
def _fp8_reduce_kernel(
    Out,
    Lse,
    PartOut,
    PartLse,
    Groups,
    stride_ot,
    stride_oh,
    stride_lt,
    stride_lh,
    stride_ps,
    stride_pt,
    stride_ph,
    stride_pls,
    stride_plt,
    D_V: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """Merge the fp32 partials of split tiles by LSE: one program per (tile, row block, head)."""
    g = tl.program_id(0)
    r0 = tl.program_id(1) * BLOCK_R
    h = tl.program_id(2).to(tl.int64)
    q_begin = tl.load(Groups + g * 4 + 0).to(tl.int64)
    q_rows = tl.load(Groups + g * 4 + 1)
    first_slot = tl.load(Groups + g * 4 + 2).to(tl.int64)
    num_splits = tl.load(Groups + g * 4 + 3)
    if r0 >= q_rows:
        return
    rows = r0 + tl.arange(0, BLOCK_R)
    rows_ok = rows < q_rows
    offs_dv = tl.arange(0, BLOCK_DV)
    tile_ok = rows_ok[:, None] & (offs_dv < D_V)[None, :]
    acc = tl.zeros([BLOCK_R, BLOCK_DV], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
    m_i = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    for split in range(num_splits):
        slot64 = first_slot + split
        lse_s = tl.load(
            PartLse + slot64 * stride_pls + rows * stride_plt + h, mask=rows_ok, other=float("-inf")
        )
        o_s = tl.load(
            PartOut + slot64 * stride_ps + h * stride_ph + rows[:, None] * stride_pt + offs_dv[None, :],
            mask=tile_ok,
            other=0.0,
        )
        m_new = tl.maximum(m_i, lse_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        weight = tl.exp(lse_s - m_safe)
        # A split without keys for a row (weight 0) adds nothing, whatever its partial holds.
        acc = acc * alpha[:, None] + tl.where(weight[:, None] == 0.0, 0.0, o_s * weight[:, None])
        l_i = l_i * alpha + weight
        m_i = m_new
    seen = l_i != 0.0
    out = tl.where(seen[:, None], acc * tl.where(seen, 1.0 / tl.where(seen, l_i, 1.0), 0.0)[:, None], 0.0)
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    o_ptrs = Out + (q_begin + rows[:, None]) * stride_ot + h * stride_oh + offs_dv[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=tile_ok)
    tl.store(Lse + (q_begin + rows) * stride_lt + h * stride_lh, lse, mask=rows_ok)


# --------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------

FP8_PREFILL_LAUNCH = LaunchCache(_fp8_prefill_kernel)
"""The fp8 prefill kernel's launches, through :mod:`.launch_cache` (cached compiled kernels)."""
FP8_REDUCE_LAUNCH = LaunchCache(_fp8_reduce_kernel)
"""The fp8 reduce kernel's launches, likewise."""


def choose_fp8_config(device: torch.device, qk_dim: int, v_dim: int, tile_q: int) -> AttentionLaunchConfig:
    """Launch heuristic for :func:`fp8_prefill_fwd` (``block_m`` is the plan's tile).

    NVIDIA sm89+ with ``Dqk, Dv <= 256``: ``BLOCK_N`` 64, 8 warps, 3 stages (fp8 K/V stages are
    half the bytes of bf16 ones): the best swept at 16 x 1024 tokens (192/128 causal); at
    4 x 4096 ``BLOCK_N`` 128 with 3 stages was 7-8% faster (not yet chosen by tile length;
    ``docs/performance.md``). Elsewhere (interpreter, AMD): ``BLOCK_N`` 32/64, 4 warps.
    """
    if device.type != "cuda":
        return AttentionLaunchConfig(tile_q, 32, 4, 1)
    if torch.version.hip is None and qk_dim <= 256 and v_dim <= 256:
        return AttentionLaunchConfig(tile_q, 64, 8 if tile_q >= 128 else 4, 3)
    return AttentionLaunchConfig(tile_q, 64, 4, 1)


def _check_scale(name: str, scale: torch.Tensor, device: torch.device) -> None:
    if scale.numel() != 1 or scale.dtype != torch.float32 or scale.device != device:
        raise InvalidInputError(
            name, f"expected a one-element float32 tensor on {device}, got {scale.dtype} "
            f"{tuple(scale.shape)} on {scale.device}",
        )  # fmt: skip


def fp8_prefill_fwd(call: Fp8PrefillCall, *, config: AttentionLaunchConfig | None = None) -> None:
    """FP8 persistent prefill (the ``fp8-prefill`` contract; ``call.schedule`` is the plan).

    q ``[T, H, Dqk]``, k ``[Tk, H, Dqk]``, v ``[Tk, H, Dv]`` in one fp8 dtype (value = stored x
    scale; scales are fp32 one-element tensors read in the kernel, no sync); ``plan`` from
    :func:`plan_fp8_prefill` for these cu_seqlens (the device copies are not re-read here);
    writes out ``[T, H, Dv]`` (out's dtype) and lse fp32 ``[T, H]``. Split tiles use an fp32
    workspace of ``num_slots * tile_q * H * Dv`` floats, sized from the plan.
    """
    q, k, v, out, lse = call.q, call.k, call.v, call.out, call.lse
    cu_seqlens_q, cu_seqlens_k = call.cu_seqlens_q, call.cu_seqlens_k
    plan, causal, softmax_scale = call.schedule, call.causal, call.softmax_scale
    q_scale, k_scale, v_scale = call.q_scale, call.k_scale, call.v_scale
    if not isinstance(plan, Fp8PrefillPlan):
        raise PlanMismatchError(f"plan: expected an Fp8PrefillPlan from plan_fp8_prefill, got {type(plan)}")
    check_attention_args(q, k, v, cu_seqlens_q, cu_seqlens_k, out, lse, softmax_scale)
    if q.dtype not in FP8_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise InvalidInputError("q", f"q, k, v must share an fp8 dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    for name, scale in (("q_scale", q_scale), ("k_scale", k_scale), ("v_scale", v_scale)):
        _check_scale(name, scale, q.device)
    num_heads, qk_dim, v_dim = q.shape[1], q.shape[2], v.shape[2]
    if (plan.num_heads, plan.num_tokens, plan.num_kv_tokens, plan.causal) != (
        num_heads, q.shape[0], k.shape[0], causal,
    ):  # fmt: skip
        raise PlanMismatchError(
            f"plan: built for heads={plan.num_heads}, tokens={plan.num_tokens}, kv tokens="
            f"{plan.num_kv_tokens}, causal={plan.causal}; called with heads={num_heads}, tokens="
            f"{q.shape[0]}, kv tokens={k.shape[0]}, causal={causal}; rebuild it with plan_fp8_prefill"
        )
    if plan.units.device != q.device:
        raise PlanMismatchError(f"plan: its tensors are on {plan.units.device}, the inputs on {q.device}")
    if plan.num_units == 0:
        return
    cfg = config or choose_fp8_config(q.device, qk_dim, v_dim, plan.tile_q)
    if cfg.block_m != plan.tile_q:
        raise InvalidInputError("config", f"block_m {cfg.block_m} must equal the plan's tile_q {plan.tile_q}")
    blocks = head_dim_blocks(qk_dim, v_dim, 32)  # fp8 dots reduce over >= 32
    slots = max(plan.num_slots, 1)
    part_out = torch.empty(slots, plan.tile_q, num_heads, v_dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(slots, plan.tile_q, num_heads, dtype=torch.float32, device=q.device)
    part_strides = (
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
    )
    FP8_PREFILL_LAUNCH.launch(
        (plan.num_programs,),
        q, k, v, out, lse, part_out, part_lse, plan.units, q_scale, k_scale, v_scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1), *part_strides,
        plan.num_units, softmax_scale * LOG2E,
        D_QK=qk_dim, D_V=v_dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_DA=blocks.block_a, BLOCK_DB=blocks.block_b, BLOCK_DV=blocks.block_v,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if plan.num_groups:
        FP8_REDUCE_LAUNCH.launch(
            (plan.num_groups, cdiv(plan.tile_q, REDUCE_BLOCK_ROWS), num_heads),
            out, lse, part_out, part_lse, plan.groups,
            out.stride(0), out.stride(1), lse.stride(0), lse.stride(1), *part_strides,
            D_V=v_dim, BLOCK_DV=blocks.block_v, BLOCK_R=REDUCE_BLOCK_ROWS,
            num_warps=4,
        )  # fmt: skip
