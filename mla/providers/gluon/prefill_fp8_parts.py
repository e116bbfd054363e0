# mypy: disable-error-code="no-untyped-def, untyped-decorator"
"""Pieces shared by the warp layouts of the Gluon fp8 prefill (:mod:`.prefill_fp8`'s plain and
producer layouts, :mod:`.prefill_fp8_split`'s split layout): the 8-bit shared layouts, the fp8
``wgmma`` accumulator layout, the key order of the split layout's ``P·V`` and the online-softmax
step with P scaled by ``2**P_OFFSET``."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

FP8_TILE_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)
"""Shared layout of the q/K/V tiles and of their TMA boxes (64 e4m3 columns: 64 bytes)."""
P_OFFSET = gl.constexpr(8.0)
"""log2 of P's scale: the running max is kept this far below the true max (``p <= 2**8``)."""


@gluon.constexpr_function
def _fp8_mma_layout(warps, cols):
    """The accumulator layout of an 8-bit ``[16·warps, cols]`` wgmma (k = 32 per instruction)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, cols, 32])


@gluon.jit
def _pv_key_order(x):
    """``x[:, π(k)]`` for a ``[rows, keys]`` tensor (``keys`` a multiple of 32): the order in
    which the split layout's ``P·V`` reads the keys. Within each 32 keys, key
    ``16h + 8g + 2c + e`` (``h, g, e < 2``, ``c < 4``) goes to place ``16h + 4c + 2g + e``.

    An 8-bit ``wgmma`` A operand gives thread ``c`` of a quad 4 consecutive keys of a row
    (``4c…4c+3``, and ``16+4c…``), where the fp32 accumulator holding the scores gives it pairs
    (``2c, 2c+1, 8+2c, 9+2c``, …): in this order P becomes the operand in the registers that hold
    it, without the shuffles of a layout conversion (FlashAttention-3 reorders V's keys for the
    same reason). The V^T tile is written in the same order, so ``P·V`` sums the same products;
    every reader of the V^T ring permutes its P with this function."""
    R: gl.constexpr = x.shape[0]
    N: gl.constexpr = x.shape[1]
    gl.static_assert(N % 32 == 0, "whole 32-key groups")
    x = gl.reshape(x, [R, N // 32, 2, 2, 4, 2])
    return gl.reshape(gl.permute(x, [0, 1, 2, 4, 3, 5]), [R, N])


@gluon.constexpr_function
def _vt_layout(keys):
    """Shared layout of the transposed ``[Dv, keys]`` V tile (keys contiguous)."""
    return gl.NVMMASharedLayout(swizzle_byte_width=min(128, keys), element_bitwidth=8, rank=2)


@gluon.jit
def _dequant_scales(q_scale_ptr, k_scale_ptr, v_scale_ptr, softmax_scale_log2e):
    """The per-tensor scales read on the device (no host sync): ``(qk_scale, v_scale)``, the
    scores' factor into the exp2 domain (``q_scale · k_scale · softmax_scale · log2 e``) and the
    output's."""
    return gl.load(q_scale_ptr) * gl.load(k_scale_ptr) * softmax_scale_log2e, gl.load(v_scale_ptr)


@gluon.jit
def _softmax_step_fp8(sc, m_i, key_bad, row_last, t, qk_scale, MASKED: gl.constexpr, BLOCK_N: gl.constexpr):
    """:func:`.prefill_parts._softmax_step` with the running max ``m`` kept ``P_OFFSET`` below
    the scaled scores' max, so ``p <= 2**P_OFFSET``: ``(p, alpha, m_new, row_bad)``."""
    if MASKED:
        keys = t * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, sc.type.layout))
        seen = keys[None, :] <= row_last[:, None]
        sc = gl.where(seen, sc, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(sc, axis=1) * qk_scale - P_OFFSET)
        # rows that have seen no key yet keep m = -inf: subtract 0 so exp2 gives 0, not NaN
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(sc * qk_scale - m_safe[:, None])
        alpha = gl.exp2(m_i - m_safe)
        row_bad = gl.max(gl.where(seen, key_bad[None, :], 0.0), axis=1)
    else:
        m_new = gl.maximum(m_i, gl.max(sc, axis=1) * qk_scale - P_OFFSET)
        p = gl.exp2(sc * qk_scale - m_new[:, None])
        alpha = gl.exp2(m_i - m_new)
        row_bad = gl.zeros_like(m_new)
    return p, alpha, m_new, row_bad


__all__ = ["FP8_TILE_LAYOUT", "P_OFFSET"]
