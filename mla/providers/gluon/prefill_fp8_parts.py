# mypy: disable-error-code="no-untyped-def, untyped-decorator"
"""Pieces shared by the warp layouts of the Gluon fp8 prefill (:mod:`.prefill_fp8`'s plain and
producer layouts, :mod:`.prefill_fp8_split`'s split layout): the 8-bit shared layouts, the fp8
``wgmma`` accumulator layout and the online-softmax step with P scaled by ``2**P_OFFSET``."""

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


@gluon.constexpr_function
def _vt_layout(keys):
    """Shared layout of the transposed ``[Dv, keys]`` V tile (keys contiguous)."""
    return gl.NVMMASharedLayout(swizzle_byte_width=min(128, keys), element_bitwidth=8, rank=2)


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
