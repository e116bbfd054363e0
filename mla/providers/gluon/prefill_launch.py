"""Host side of the Gluon varlen prefill (:mod:`.prefill`): the route, the launch config and
the launcher.

:func:`prefill_route` (pure Python, reads only dtypes, shapes, strides and addresses) says
whether a ``varlen-prefill`` call runs on the Gluon kernel; the gluon provider runs the Triton
provider's kernel otherwise. :func:`launch_gluon_prefill` builds the three TMA descriptors and
launches one program per (128-row query tile, request, head).
"""

from __future__ import annotations

import enum
import functools

import attrs
import torch

from mla.core.errors import InvalidInputError
from mla.providers.calls import VarlenPrefillCall
from mla.providers.gluon.descriptors import TMA_ALIGN, token_descriptor

PREFILL_DIMS: frozenset[tuple[int, int]] = frozenset({(192, 128), (128, 128)})
"""``(Dqk, Dv)`` pairs the kernel is built for."""
PREFILL_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)
"""q/k/v dtypes the kernel takes (one dtype for the three)."""
LOG2E = 1.4426950408889634
QUERY_TILE = 128
"""Query rows per program (``prefill.BLOCK_M``)."""


class PrefillKernel(enum.Enum):
    """How :func:`~mla.providers.gluon.prefill.mla_prefill_kernel` splits its warps."""

    PLAIN = 0
    """8 consumer warps (two warpgroups, the 128-row tile) that also issue the TMA loads."""
    PRODUCER = 1
    """A one-warp TMA producer partition and the 8 consumer warps (one partition)."""
    SPLIT = 2
    """A 4-warp producer (TMA, and the V clean-up of masked tiles) and each consumer warpgroup a
    partition of its own (64 query rows each), so the two run out of step. In the fp8 kernel
    the producer also transposes every V tile into a ring of ``[Dv, keys]`` tiles
    (:mod:`~mla.providers.gluon.prefill_fp8_split`)."""
    OVERLAP = 3
    """The split layout with each consumer warpgroup pipelined: the next tile's QKᵀ and this
    tile's PV in flight while it runs the softmax of the next (:mod:`.prefill_overlap`); P goes
    through shared memory (16 KiB more at 128-key tiles: at 192/128 only 64-key tiles fit)."""
    PERSISTENT = 4
    """The split layout with one program per SM looping over the query tiles
    (:mod:`.prefill_persistent`): the next tile's loads go out under the current one's last key
    tiles and epilogue. With the chunked-context forms too. The fp8 kernel's form is
    :mod:`~mla.providers.gluon.prefill_fp8_persistent`."""


CONTEXT_KERNELS = frozenset({PrefillKernel.SPLIT, PrefillKernel.PERSISTENT})
"""The layouts that take the chunked-context operands (``k_pe``, a prior state)."""
APPENDED_KERNELS = frozenset({PrefillKernel.SPLIT, PrefillKernel.PERSISTENT})
"""The layouts that take appended keys (:class:`~mla.providers.calls.AppendedKeys`)."""


@attrs.frozen
class PrefillLaunchConfig:
    """The launch of :func:`~mla.providers.gluon.prefill.mla_prefill_kernel`.

    ``block_n`` keys per K/V tile, ``num_stages`` ring slots, ``kernel`` the warp split."""

    block_n: int = 128
    num_stages: int = 2
    kernel: PrefillKernel = PrefillKernel.PRODUCER

    def __attrs_post_init__(self) -> None:
        if self.block_n not in (64, 128):
            raise ValueError(f"block_n must be 64 or 128, got {self.block_n}")
        if self.num_stages < 2:
            raise ValueError(f"num_stages must be >= 2, got {self.num_stages}")


SPLIT_V_LANDING = 2
"""V landing slots of the fp8 kernel's split layout (its ``V_LANDING``; the producer issues tile
``t``'s V before it transposes tile ``t - 1``'s), counted by ``fp8_shared_bytes``."""
SHARED_MEMORY_BYTES = 232448
"""Shared memory a Hopper block may use (227 KiB)."""


def shared_bytes(qk_dim: int, v_dim: int, config: PrefillLaunchConfig) -> int:
    """Shared memory of a launch: the query tile, the K/V ring (16-bit), the per-key flags, the
    overlap kernel's P tiles and the barriers (the persistent kernel's query buffer has one
    more)."""
    ring = config.num_stages * config.block_n * (qk_dim + v_dim) * 2
    flags = 4 * config.num_stages * config.block_n
    p_tiles = QUERY_TILE * config.block_n * 2 if config.kernel is PrefillKernel.OVERLAP else 0
    barriers = 2 + 4 * config.num_stages + (config.kernel is PrefillKernel.PERSISTENT)
    return QUERY_TILE * qk_dim * 2 + ring + flags + p_tiles + 8 * barriers


STORE_SCRATCH_BYTES = 4160
"""Shared memory the bf16 split layouts' 16-byte output stores add (their two consumer
warpgroups' layout conversion, sm_90 compile); launches that leave it free use them."""


@functools.cache
def vec_store(qk_dim: int, v_dim: int, config: PrefillLaunchConfig) -> bool:
    """Whether launch ``config`` stores its output rows with 16-byte stores (the kernels'
    ``VEC_STORE``): the split and persistent layouts, whose consumers are single warpgroups,
    where :data:`STORE_SCRATCH_BYTES` of shared memory are left (192/128: yes; 128/128 at 3
    stages: no)."""
    return (
        config.kernel in (PrefillKernel.SPLIT, PrefillKernel.PERSISTENT)
        and shared_bytes(qk_dim, v_dim, config) + STORE_SCRATCH_BYTES <= SHARED_MEMORY_BYTES
    )


PERSISTENT_MAX_SEQLEN_Q = 2048
"""The longest request (in queries) the default launch runs on the persistent layout. Its one
program per SM saves the block start, barrier set-up, first loads and epilogue latency of each
query tile (about 6.7 µs against 2.24 µs a 128 x 128 key tile on the H200): 5–10% at 256–2048
queries a request; at 4096 and up, where a query tile has up to 32 key tiles, the one-tile
launch's hardware scheduling balances the causal tiles as well or better at 128 heads (H200,
2026-12-04: docs/performance.md, "Kernel choices"); calls of few heads keep the persistent
layout (:data:`PERSISTENT_ANY_LENGTH_MAX_HEADS`)."""


PERSISTENT_ANY_LENGTH_MAX_HEADS = 16
"""Calls of at most this many heads (a tensor-parallel rank of a 128-head model at TP8) run on
the persistent layout at any request length. H200, 192/128 causal bf16, persistent against
split: H16 4 x 4096 531.1 / 553.7 / 564.9 against 511.5 / 517.7 / 537.1 TFLOP/s (three benchmark
runs, 2026-12-04 and 2026-12-05), H16 2 x 8192 581.3 / 581.8 against 571.5 / 560.4; at H128 4 x
4096 the split layout stays faster (549.4 against 505.5). Head counts between 16 and 128 at
more than :data:`PERSISTENT_MAX_SEQLEN_Q` queries are unmeasured and keep the split layout."""


def default_kernel(
    max_seqlen_q: int, *, context: bool, num_heads: int, appended: bool = False
) -> PrefillKernel:
    """The default layout of a call. A context chunk's first pass with the new tokens' keys
    appended (``appended``) runs on the persistent layout: H200, H16 4 x (2048 new + 16384
    cached), 192/128, the chunk's keys with ``k_pe`` and the appended keys in one launch,
    2355.9 µs against 2433.5 on the split layout (medians of seven interleaved rounds,
    2026-12-05). The other chunked-context passes (``context``: ``k_pe`` or a prior state, long
    non-causal rows, where the persistent layout measured no faster) run on the
    one-tile-a-program split layout, and so do calls past :data:`PERSISTENT_MAX_SEQLEN_Q` queries
    a request with more than :data:`PERSISTENT_ANY_LENGTH_MAX_HEADS` heads; the rest on the
    persistent layout."""
    if appended:
        return PrefillKernel.PERSISTENT
    if context:
        return PrefillKernel.SPLIT
    if max_seqlen_q <= PERSISTENT_MAX_SEQLEN_Q or num_heads <= PERSISTENT_ANY_LENGTH_MAX_HEADS:
        return PrefillKernel.PERSISTENT
    return PrefillKernel.SPLIT


@functools.cache
def prefill_config(
    qk_dim: int, v_dim: int, kernel: PrefillKernel = PrefillKernel.SPLIT
) -> PrefillLaunchConfig:
    """The default launch of layout ``kernel`` (:func:`default_kernel` picks it): 128-key tiles
    and the most ring slots (up to 3) that fit in shared memory (2 for 192/128: 48 KiB query
    tile + 2 × 80 KiB)."""
    best = PrefillLaunchConfig(num_stages=2, kernel=kernel)
    for stages in (3,):
        config = attrs.evolve(best, num_stages=stages)
        if shared_bytes(qk_dim, v_dim, config) <= SHARED_MEMORY_BYTES:
            best = config
    return best


def _tma_problem(name: str, x: torch.Tensor) -> str | None:
    """Why ``x`` (``[tokens, H, D]``) cannot be read by the kernel's TMA boxes (``None``: it can).

    The kernel reads head ``h`` as the box at column ``h·stride(1)`` of the 2-D view
    ``[tokens, (H - 1)·stride(1) + D]`` with row stride ``stride(0)``."""
    tokens, heads, dim = x.shape
    esize = x.element_size()
    if x.stride(2) != 1:
        return f"{name}'s last dim is not contiguous"
    if x.data_ptr() % TMA_ALIGN:
        return f"{name}'s base address is not {TMA_ALIGN}-byte aligned"
    if tokens > 1 and (x.stride(0) * esize) % TMA_ALIGN:
        return f"{name}'s token stride ({x.stride(0)} elements) is not a multiple of {TMA_ALIGN} bytes"
    if heads > 1 and (x.stride(1) * esize) % TMA_ALIGN:
        return f"{name}'s head stride ({x.stride(1)} elements) is not a multiple of {TMA_ALIGN} bytes"
    if x.stride(0) < 0 or x.stride(1) < 0:
        return f"{name} has a negative stride"
    if tokens > 1 and (heads - 1) * x.stride(1) + dim > x.stride(0):
        return f"{name}'s heads do not lie within one token row (strides {tuple(x.stride())})"
    if tokens >= 2**31:
        return f"{name} has more than 2**31 tokens"
    return None


def prefill_route(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> tuple[str, str]:
    """``("gluon" | "triton", why)``: whether the Gluon prefill kernel takes a ``varlen-prefill``
    call with these tensors (16-bit q/k/v of one dtype, ``(Dqk, Dv)`` in :data:`PREFILL_DIMS`,
    layouts TMA can read, at least one key). Reads no tensor memory; the caller has checked
    the device (sm_90)."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        return "triton", "q, k and v are not [tokens, heads, dim]"
    if q.dtype not in PREFILL_DTYPES:
        return "triton", f"query dtype {q.dtype} (the Gluon prefill takes bf16/fp16)"
    if k.dtype != q.dtype or v.dtype != q.dtype:
        return "triton", f"mixed dtypes q {q.dtype}, k {k.dtype}, v {v.dtype}"
    if out.dtype not in (*PREFILL_DTYPES, torch.float32):
        return "triton", f"output dtype {out.dtype}"
    dims = (int(q.shape[2]), int(v.shape[2]))
    if dims not in PREFILL_DIMS:
        return "triton", f"head dims {dims[0]}/{dims[1]} (the Gluon prefill takes 192/128 and 128/128)"
    if k.shape[0] == 0:
        return "triton", "no keys (a TMA descriptor needs at least one row)"
    for name, x in (("q", q), ("k", k), ("v", v)):
        problem = _tma_problem(name, x)
        if problem is not None:
            return "triton", problem
    return "gluon", f"16-bit {dims[0]}/{dims[1]} q/k/v with TMA-readable layouts"


CONTEXT_ROPE = 64
"""The rope lanes a ``k_pe`` operand may have on the Gluon kernel: one TMA box of each key tile."""


def prefill_call_route(call: VarlenPrefillCall) -> tuple[str, str]:
    """:func:`prefill_route` for a whole call, with the chunked-context forms: ``k_pe`` of
    :data:`CONTEXT_ROPE` lanes that TMA can read (the kernel loads it as each key tile's last
    box) and a prior state (merged in the epilogue) run on the Gluon kernel's split layouts
    (:data:`CONTEXT_KERNELS`), appended keys TMA can read on the split and persistent layouts
    (:data:`APPENDED_KERNELS`)."""
    kernel, why = prefill_route(call.q, call.k, call.v, call.out)
    if kernel != "gluon":
        return kernel, why
    appended = call.appended
    if appended is not None:
        if appended.k.dim() != 3 or appended.v.dim() != 3:
            return "triton", "appended k and v are not [tokens, heads, dim]"
        if appended.k.dtype != call.q.dtype or appended.v.dtype != call.q.dtype:
            return "triton", f"appended keys of {appended.k.dtype}/{appended.v.dtype}, q of {call.q.dtype}"
        if appended.k.shape[0] == 0:
            return "triton", "no appended keys (a TMA descriptor needs at least one row)"
        for name, x in (("appended.k", appended.k), ("appended.v", appended.v)):
            problem = _tma_problem(name, x)
            if problem is not None:
                return "triton", problem
        why = f"{why}; the appended keys after each request's keys, through the same ring"
    if call.k_pe is None:
        return kernel, why
    k_pe = call.k_pe
    if k_pe.dim() != 2 or k_pe.shape[1] != CONTEXT_ROPE:
        return "triton", f"k_pe of shape {tuple(k_pe.shape)} (the Gluon prefill takes [Tk, {CONTEXT_ROPE}])"
    if k_pe.dtype != call.q.dtype:
        return "triton", f"k_pe dtype {k_pe.dtype} is not q's {call.q.dtype}"
    problem = _tma_problem("k_pe", k_pe[:, None, :])
    if problem is not None:
        return "triton", problem
    return "gluon", f"{why}; k_pe's {CONTEXT_ROPE} rope lanes as each key tile's last box"


def try_gluon_prefill(call: VarlenPrefillCall) -> bool:
    """Run ``call`` on the Gluon prefill kernel (its default launch) and return ``True`` when
    :func:`prefill_call_route` takes it; return ``False``, launching nothing, when the route
    sends it to the Triton kernel. The gluon provider's ``varlen_attention`` (one route a call:
    the launch's host time counts against the prefill's)."""
    if prefill_call_route(call)[0] != "gluon":
        return False
    _launch(call, None, write_lse=True, routed=True)
    return True


def launch_gluon_prefill(
    call: VarlenPrefillCall, config: PrefillLaunchConfig | None = None, *, write_lse: bool = True
) -> None:
    """Launch the Gluon varlen prefill for ``call`` (the ``varlen-prefill`` contract; ``lse``
    written only with ``write_lse``, or when the call merges into a prior state, whose merged
    LSE is part of the result). Raises :class:`InvalidInputError` for a call
    :func:`prefill_call_route` sends to the Triton kernel, or for the chunked-context operands
    on a layout outside :data:`CONTEXT_KERNELS`."""
    _launch(call, config, write_lse=write_lse, routed=False)


def _launch(
    call: VarlenPrefillCall, config: PrefillLaunchConfig | None, *, write_lse: bool, routed: bool
) -> None:
    """:func:`launch_gluon_prefill`; ``routed``: the caller's route took the call already."""
    from mla.providers.gluon.prefill import (  # noqa: PLC0415 (kernels load lazily)
        BOX,
        CONSUMER_WARPS,
        PREFILL_LAUNCH,
        SPLIT_PRODUCER_WARPS,
        TILE_LAYOUT,
    )
    from mla.providers.gluon.prefill_persistent import PERSISTENT_LAUNCH  # noqa: PLC0415
    from mla.providers.triton.attention_host import check_varlen_call  # noqa: PLC0415
    from mla.providers.triton.decode_launch import num_sms  # noqa: PLC0415

    q, k, v, out, lse = call.q, call.k, call.v, call.out, call.lse
    k_pe, prior_out, prior_lse, appended = call.k_pe, call.prior_out, call.prior_lse, call.appended
    if not call.checked:  # (see VarlenPrefillCall.checked)
        check_varlen_call(call)
    if not routed:
        kernel, why = prefill_call_route(call)
        if kernel != "gluon":
            raise InvalidInputError("q", f"not a Gluon prefill case ({why}): use the Triton provider")
    heads, qk_dim, v_dim = int(q.shape[1]), int(q.shape[2]), int(v.shape[2])
    context = k_pe is not None or prior_out is not None or appended is not None
    cfg = config or prefill_config(
        qk_dim, v_dim,
        default_kernel(call.max_seqlen_q, context=context, num_heads=heads, appended=appended is not None),
    )  # fmt: skip
    for operands_name, takes, layouts in (
        ("the chunked-context operands (k_pe, a prior state)", context, CONTEXT_KERNELS),
        ("appended keys", appended is not None, APPENDED_KERNELS),
    ):
        if takes and cfg.kernel not in layouts:
            names = " or ".join(sorted(f"PrefillKernel.{k.name}" for k in layouts))
            raise InvalidInputError("config", f"{cfg}: {operands_name} run on the split layouts ({names})")
    batch = call.cu_seqlens_q.numel() - 1
    if q.shape[0] == 0 or batch <= 0 or call.max_seqlen_q <= 0:
        return
    if shared_bytes(qk_dim, v_dim, cfg) > SHARED_MEMORY_BYTES:
        raise InvalidInputError(
            "config", f"{cfg} needs {shared_bytes(qk_dim, v_dim, cfg)} bytes of shared memory at "
            f"{qk_dim}/{v_dim}; a Hopper block has {SHARED_MEMORY_BYTES}",
        )  # fmt: skip
    num_m_blocks = -(-call.max_seqlen_q // QUERY_TILE)
    num_tiles = num_m_blocks * batch * heads
    box = BOX.value  # (each descriptor: [rows, 64] boxes over the 2-D view _tma_problem checked)
    k_desc = token_descriptor(k, cfg.block_n, box, TILE_LAYOUT)
    operands = (
        token_descriptor(q, QUERY_TILE, box, TILE_LAYOUT), k_desc,
        token_descriptor(v, cfg.block_n, box, TILE_LAYOUT),
        out, lse, call.cu_seqlens_q, call.cu_seqlens_k,
        q.stride(1), k.stride(1), v.stride(1), out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
    )  # fmt: skip
    rows = (q.shape[0], k.shape[0], call.softmax_scale * LOG2E)
    # The chunked-context operands (without them their slots take the call's own descriptor and
    # outputs); a merge writes the LSE, part of its result.
    prior_o, prior_l = (out, lse) if prior_out is None or prior_lse is None else (prior_out, prior_lse)
    context_operands = (
        k_desc if k_pe is None else token_descriptor(k_pe[:, None, :], cfg.block_n, box, TILE_LAYOUT),
        prior_o, prior_l, prior_o.stride(0), prior_o.stride(1), prior_l.stride(0), prior_l.stride(1),
    )  # fmt: skip
    constants = {
        "D_QK": qk_dim, "D_V": v_dim, "BLOCK_N": cfg.block_n, "NUM_STAGES": cfg.num_stages,
        "CAUSAL": call.causal, "WRITE_LSE": write_lse or prior_out is not None, "HAS_K_PE": k_pe is not None,
        "HAS_PRIOR": prior_out is not None, "HAS_APPENDED": appended is not None,
        "VEC_STORE": vec_store(qk_dim, v_dim, cfg),
    }  # fmt: skip
    # (without appended keys their slots take the call's own keys)
    appended_operands = (k_desc, operands[2], call.cu_seqlens_k, k.stride(1), v.stride(1), k.shape[0])
    if appended is not None:
        kn, vn = appended.k, appended.v
        appended_operands = (
            token_descriptor(kn, cfg.block_n, box, TILE_LAYOUT),
            token_descriptor(vn, cfg.block_n, box, TILE_LAYOUT), appended.cu_seqlens_k,
            kn.stride(1), vn.stride(1), kn.shape[0],
        )  # fmt: skip
    if cfg.kernel is PrefillKernel.PERSISTENT:  # one program per SM (at most one per query tile)
        PERSISTENT_LAUNCH.launch(
            (min(num_sms(q.device), num_tiles),), *operands, heads, num_m_blocks, num_tiles, *rows,
            *context_operands, *appended_operands, **constants, num_warps=SPLIT_PRODUCER_WARPS.value,
        )  # fmt: skip
        return
    PREFILL_LAUNCH.launch(
        (num_tiles,), *operands, heads, num_m_blocks, *rows, *context_operands, *appended_operands,
        **constants, MODE=cfg.kernel.value,
        num_warps=(SPLIT_PRODUCER_WARPS if cfg.kernel.value >= 2 else CONSUMER_WARPS).value,
    )  # fmt: skip


__all__ = [
    "APPENDED_KERNELS",
    "CONTEXT_KERNELS",
    "CONTEXT_ROPE",
    "PERSISTENT_ANY_LENGTH_MAX_HEADS",
    "PERSISTENT_MAX_SEQLEN_Q",
    "PREFILL_DIMS",
    "PrefillKernel",
    "PrefillLaunchConfig",
    "default_kernel",
    "launch_gluon_prefill",
    "prefill_call_route",
    "prefill_config",
    "prefill_route",
    "shared_bytes",
    "try_gluon_prefill",
    "vec_store",
]
