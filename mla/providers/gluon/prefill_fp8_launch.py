"""Host side of the Gluon fp8 varlen prefill (:mod:`.prefill_fp8`): its plan, route, launch
config and launcher.

The gluon provider runs it by default (``GluonProvider(fp8_prefill="gluon")``; ``"triton"``
keeps the Triton fp8 kernels): that provider's ``plan_fp8_prefill`` returns a
:class:`GluonFp8PrefillPlan`, which wraps the Triton provider's plan (so a call the route
declines still runs on the Triton fp8 kernel) and records the
longest request's query length (the grid: one program per 128-row query tile, request and
head; the call carries no ``max_seqlen_q``). :func:`fp8_prefill_route` (pure Python, reads only
dtypes, shapes, strides and addresses) says whether a call runs on the Gluon kernel.
"""

from __future__ import annotations

import itertools

import attrs
import torch

from mla.core.errors import InvalidInputError, PlanMismatchError
from mla.providers.calls import Fp8PrefillCall, Fp8PrefillPlanCall
from mla.providers.gluon.descriptors import token_descriptor
from mla.providers.gluon.prefill_launch import (
    LOG2E,
    PREFILL_DIMS,
    QUERY_TILE,
    SHARED_MEMORY_BYTES,
    SPLIT_V_LANDING,
    PrefillKernel,
    PrefillLaunchConfig,
    _tma_problem,
)

FP8_PREFILL_DTYPES: tuple[torch.dtype, ...] = (torch.float8_e4m3fn,)
"""q/k/v dtypes the kernel takes (e4m3: P is quantized to e4m3 for the fp8 ``P·V``)."""
FP8_OUT_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, torch.float32)
FP8_KERNELS: tuple[PrefillKernel, ...] = (
    PrefillKernel.PLAIN, PrefillKernel.PRODUCER, PrefillKernel.SPLIT, PrefillKernel.PERSISTENT,
)  # fmt: skip
"""The warp splits the fp8 kernel has (``PERSISTENT``, :mod:`.prefill_fp8_persistent`, is
:func:`fp8_prefill_config`'s default: the split layout of :mod:`.prefill_fp8_split` with one
program per SM; ``SPLIT``, one program a query tile, and the others through the launch
config)."""
SPLIT_FP8_KERNELS = frozenset({PrefillKernel.SPLIT, PrefillKernel.PERSISTENT})
"""The fp8 layouts with a V-transposing producer warpgroup (:mod:`.prefill_fp8_split`)."""
MAX_STAGES = 4


@attrs.frozen(eq=False)
class GluonFp8PrefillPlan:
    """The gluon provider's fp8 prefill plan (``fp8_prefill="gluon"``, the default): the Triton
    provider's plan (for the calls the route declines) and the batch's sizes."""

    triton: object
    """The Triton provider's ``plan_fp8_prefill`` result."""
    max_seqlen_q: int
    num_heads: int
    num_tokens: int
    num_kv_tokens: int
    causal: bool


def plan_gluon_fp8_prefill(call: Fp8PrefillPlanCall, triton_plan: object) -> GluonFp8PrefillPlan:
    """The plan of ``call`` around ``triton_plan`` (reads the host cu_seqlens)."""
    cu_q = [int(x) for x in call.cu_seqlens_q_cpu.tolist()]
    cu_k = [int(x) for x in call.cu_seqlens_k_cpu.tolist()]
    lengths = [b - a for a, b in itertools.pairwise(cu_q)]
    return GluonFp8PrefillPlan(
        triton=triton_plan,
        max_seqlen_q=max(lengths, default=0),
        num_heads=call.num_heads,
        num_tokens=cu_q[-1] if cu_q else 0,
        num_kv_tokens=cu_k[-1] if cu_k else 0,
        causal=call.causal,
    )


def fp8_shared_bytes(qk_dim: int, v_dim: int, config: PrefillLaunchConfig) -> int:
    """Shared memory of a launch (8-bit tiles): the query tile, and per ring stage a K and a V
    tile; plus one transposed V tile (plain and producer layouts), or (split layout) per stage
    a transposed V tile and the stage's per-key flags (float32), and :data:`SPLIT_V_LANDING` V
    tiles instead of one a stage; and the barriers (the persistent layout's ``q_empty`` too)."""
    stages, keys = config.num_stages, config.block_n
    if config.kernel in SPLIT_FP8_KERNELS:
        tiles = stages * keys * (qk_dim + v_dim + 4) + SPLIT_V_LANDING * keys * v_dim
        barriers = 1 + 4 * stages + SPLIT_V_LANDING + (config.kernel is PrefillKernel.PERSISTENT)
    else:
        tiles = stages * keys * (qk_dim + v_dim) + v_dim * keys
        barriers = 1 + 4 * stages
    return QUERY_TILE * qk_dim + tiles + 8 * barriers


def fp8_prefill_config(qk_dim: int, v_dim: int) -> PrefillLaunchConfig:
    """The default launch: 128-key tiles (64-key tiles measured 12–22% slower), the split warp
    layout (a producer warpgroup that transposes V, two consumer warpgroups: the fastest layout on
    the H200) in its persistent form (one program per SM: 3–16% faster than one program a query
    tile on an H100), the most ring slots (up to :data:`MAX_STAGES`) that fit in shared memory
    (``docs/performance.md``, "Kernel choices")."""
    best = PrefillLaunchConfig(num_stages=2, kernel=PrefillKernel.PERSISTENT)
    for stages in range(3, MAX_STAGES + 1):
        config = attrs.evolve(best, num_stages=stages)
        if fp8_shared_bytes(qk_dim, v_dim, config) <= SHARED_MEMORY_BYTES:
            best = config
    return best


def _scale_problem(name: str, scale: torch.Tensor, device: torch.device) -> str | None:
    if scale.numel() != 1 or scale.dtype != torch.float32 or scale.device != device:
        return f"{name} is not a one-element float32 tensor on {device}"
    return None


def fp8_prefill_route(call: Fp8PrefillCall) -> tuple[str, str]:
    """``("gluon" | "triton", why)``: whether the Gluon fp8 prefill kernel takes ``call``
    (e4m3 q/k/v, ``(Dqk, Dv)`` in :data:`~.prefill_launch.PREFILL_DIMS`, a bf16/fp16/fp32
    output, one-element float32 scales on q's device, at least one key, layouts TMA can read,
    and a :class:`GluonFp8PrefillPlan`). Reads no tensor memory; the caller has checked the
    device (sm_90)."""
    q, k, v, out = call.q, call.k, call.v, call.out
    if not isinstance(call.schedule, GluonFp8PrefillPlan):
        return "triton", f"the schedule is a {type(call.schedule).__name__}, not a GluonFp8PrefillPlan"
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        return "triton", "q, k and v are not [tokens, heads, dim]"
    if q.dtype not in FP8_PREFILL_DTYPES:
        return "triton", f"query dtype {q.dtype} (the Gluon fp8 prefill takes float8_e4m3fn)"
    if k.dtype != q.dtype or v.dtype != q.dtype:
        return "triton", f"mixed dtypes q {q.dtype}, k {k.dtype}, v {v.dtype}"
    if out.dtype not in FP8_OUT_DTYPES:
        return "triton", f"output dtype {out.dtype}"
    dims = (int(q.shape[2]), int(v.shape[2]))
    if dims not in PREFILL_DIMS:
        return "triton", f"head dims {dims[0]}/{dims[1]} (the Gluon fp8 prefill takes 192/128 and 128/128)"
    if k.shape[0] == 0:
        return "triton", "no keys (a TMA descriptor needs at least one row)"
    for name, scale in (("q_scale", call.q_scale), ("k_scale", call.k_scale), ("v_scale", call.v_scale)):
        problem = _scale_problem(name, scale, q.device)
        if problem is not None:
            return "triton", problem
    for name, x in (("q", q), ("k", k), ("v", v)):
        problem = _tma_problem(name, x)
        if problem is not None:
            return "triton", problem
    return "gluon", f"e4m3 {dims[0]}/{dims[1]} q/k/v with TMA-readable layouts"


def _check_plan(call: Fp8PrefillCall, plan: GluonFp8PrefillPlan) -> None:
    q, k = call.q, call.k
    if (plan.num_heads, plan.num_tokens, plan.num_kv_tokens, plan.causal) != (
        q.shape[1], q.shape[0], k.shape[0], call.causal,
    ):  # fmt: skip
        raise PlanMismatchError(
            f"plan: built for heads={plan.num_heads}, tokens={plan.num_tokens}, kv tokens="
            f"{plan.num_kv_tokens}, causal={plan.causal}; called with heads={q.shape[1]}, tokens="
            f"{q.shape[0]}, kv tokens={k.shape[0]}, causal={call.causal}; rebuild it with plan_fp8_prefill"
        )


def try_gluon_fp8_prefill(call: Fp8PrefillCall) -> bool:
    """Run ``call`` on the Gluon fp8 prefill kernel (its default launch) and return ``True`` when
    :func:`fp8_prefill_route` takes it; return ``False``, launching nothing, when the route sends
    it to the Triton kernels. The gluon provider's ``fp8_prefill`` (one route a call)."""
    if fp8_prefill_route(call)[0] != "gluon":
        return False
    _launch(call, None, write_lse=True, routed=True)
    return True


def launch_gluon_fp8_prefill(
    call: Fp8PrefillCall, config: PrefillLaunchConfig | None = None, *, write_lse: bool = True
) -> None:
    """Launch the Gluon fp8 varlen prefill for ``call`` (the ``fp8-prefill`` contract, its
    schedule a :class:`GluonFp8PrefillPlan`; ``lse`` written only with ``write_lse``). Raises
    :class:`InvalidInputError` for a call :func:`fp8_prefill_route` sends to the Triton kernel."""
    _launch(call, config, write_lse=write_lse, routed=False)


def _launch(
    call: Fp8PrefillCall, config: PrefillLaunchConfig | None, *, write_lse: bool, routed: bool
) -> None:
    """:func:`launch_gluon_fp8_prefill`; ``routed``: the caller's route took the call already."""
    from mla.providers.gluon.prefill_fp8 import FP8_PREFILL_LAUNCH, FP8_TILE_LAYOUT  # noqa: PLC0415 (lazy)
    from mla.providers.gluon.prefill_fp8_persistent import FP8_PERSISTENT_LAUNCH  # noqa: PLC0415
    from mla.providers.gluon.prefill_parts import BOX, CONSUMER_WARPS, SPLIT_PRODUCER_WARPS  # noqa: PLC0415
    from mla.providers.triton.attention_host import check_attention_args  # noqa: PLC0415
    from mla.providers.triton.decode_launch import num_sms  # noqa: PLC0415

    q, k, v, out, lse = call.q, call.k, call.v, call.out, call.lse
    check_attention_args(q, k, v, call.cu_seqlens_q, call.cu_seqlens_k, out, lse, call.softmax_scale)
    if not routed:
        kernel, why = fp8_prefill_route(call)
        if kernel != "gluon":
            raise InvalidInputError("q", f"not a Gluon fp8 prefill case ({why}): use the Triton provider")
    plan = call.schedule
    assert isinstance(plan, GluonFp8PrefillPlan)  # (the route checked it)
    _check_plan(call, plan)
    batch = call.cu_seqlens_q.numel() - 1
    if q.shape[0] == 0 or batch <= 0 or plan.max_seqlen_q <= 0:
        return
    heads, qk_dim, v_dim = int(q.shape[1]), int(q.shape[2]), int(v.shape[2])
    cfg = config or fp8_prefill_config(qk_dim, v_dim)
    if cfg.kernel not in FP8_KERNELS:
        names = ", ".join(kernel.name for kernel in FP8_KERNELS)
        raise InvalidInputError("config", f"the fp8 kernel has the {names} warp splits, got {cfg.kernel}")
    if fp8_shared_bytes(qk_dim, v_dim, cfg) > SHARED_MEMORY_BYTES:
        raise InvalidInputError(
            "config", f"{cfg} needs {fp8_shared_bytes(qk_dim, v_dim, cfg)} bytes of shared memory at "
            f"{qk_dim}/{v_dim}; a Hopper block has {SHARED_MEMORY_BYTES}",
        )  # fmt: skip
    num_m_blocks = -(-plan.max_seqlen_q // QUERY_TILE)
    num_tiles = num_m_blocks * batch * heads
    box = BOX.value  # (each descriptor: [rows, 64] boxes over the 2-D view the route checked)
    operands = (
        token_descriptor(q, QUERY_TILE, box, FP8_TILE_LAYOUT),
        token_descriptor(k, cfg.block_n, box, FP8_TILE_LAYOUT),
        token_descriptor(v, cfg.block_n, box, FP8_TILE_LAYOUT),
        out, lse, call.cu_seqlens_q, call.cu_seqlens_k, call.q_scale, call.k_scale, call.v_scale,
        q.stride(1), k.stride(1), v.stride(1), out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
    )  # fmt: skip
    constants = {
        "D_QK": qk_dim, "D_V": v_dim, "BLOCK_N": cfg.block_n, "NUM_STAGES": cfg.num_stages,
        "CAUSAL": call.causal, "WRITE_LSE": write_lse,
    }  # fmt: skip
    log2_scale = call.softmax_scale * LOG2E
    if cfg.kernel is PrefillKernel.PERSISTENT:  # one program per SM (at most one per query tile)
        FP8_PERSISTENT_LAUNCH.launch(
            (min(num_sms(q.device), num_tiles),), *operands, heads, num_m_blocks, num_tiles, q.shape[0],
            k.shape[0], log2_scale, **constants, num_warps=SPLIT_PRODUCER_WARPS.value,
        )  # fmt: skip
        return
    FP8_PREFILL_LAUNCH.launch(
        (num_tiles,), *operands, heads, num_m_blocks, q.shape[0], k.shape[0], log2_scale, **constants,
        MODE=cfg.kernel.value,
        num_warps=(SPLIT_PRODUCER_WARPS if cfg.kernel is PrefillKernel.SPLIT else CONSUMER_WARPS).value,
    )  # fmt: skip


__all__ = [
    "FP8_KERNELS",
    "FP8_PREFILL_DTYPES",
    "SPLIT_FP8_KERNELS",
    "GluonFp8PrefillPlan",
    "fp8_prefill_config",
    "fp8_prefill_route",
    "fp8_shared_bytes",
    "launch_gluon_fp8_prefill",
    "plan_gluon_fp8_prefill",
    "try_gluon_fp8_prefill",
]
