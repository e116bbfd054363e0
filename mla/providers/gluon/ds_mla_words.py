# mypy: disable-error-code="no-untyped-def, untyped-decorator"
"""``fp8_ds_mla`` rows read into registers and dequantized there: the helpers of the register
producer of :mod:`.ds_mla_heads` (the staged producers are :mod:`.ds_mla_staged`'s).

A 656-byte row holds 512 e4m3 latent values, one float32 scale per 128-wide latent tile and 64
bf16 rope values. A producer loads a 128-column chunk of a tile's rows (one scale tile) as
32-bit words, four fp8 values each, holds a few chunks in flight in its registers, and writes
each as bf16 into the MMA tile once the tile's slot is free.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

CHUNK = gl.constexpr(128)
"""Latent columns of a chunk: one scale tile of an ``fp8_ds_mla`` row."""


@gluon.jit
def _fetch_chunk(kv_row, ok, C: gl.constexpr, L: gl.constexpr, LD: gl.constexpr):
    """Load chunk ``C`` (latent columns ``[C·CHUNK, (C+1)·CHUNK)``) of the rows ``kv_row`` (fp8
    pointers to each token's row, in the row slice of ``LD``) as 32-bit words of four fp8 values,
    and each row's scale of that chunk; rows not ``ok`` read nothing (zeros). Words, not fp8
    values: a chunk carried across the tile loop as fp8 took a register a value (64 a thread)
    and spilled."""
    cols = gl.arange(0, CHUNK // 4, layout=gl.SliceLayout(0, LD))
    words = kv_row.to(gl.pointer_type(gl.int32))[:, None] + (C * (CHUNK // 4) + cols)[None, :]
    x = gl.load(words, mask=ok[:, None], other=0)
    scale = gl.load((kv_row + L).to(gl.pointer_type(gl.float32)) + C, mask=ok, other=0.0)
    return x, scale


@gluon.jit
def _dequantize(x, scale):
    """The bf16 values ``fp8 · scale`` of ``x`` (``[rows, w]`` words of four e4m3 values, the
    first in the low byte) and ``scale`` (``[rows]``, float32; power-of-two scales: exact for
    every value in bf16's range), as ``[rows, 4·w]`` in row order. The ``e4m3x2 → f16x2``
    conversions are an inline-asm block with side effects, so the compiler keeps them after the
    producer's wait for the ring slot and the words stay packed until then."""
    h0, h1, h2, h3 = gl.inline_asm_elementwise(
        """{
        .reg .b16 lo, hi;
        .reg .b32 a, b;
        mov.b32 {lo, hi}, $4;
        cvt.rn.f16x2.e4m3x2 a, lo;
        cvt.rn.f16x2.e4m3x2 b, hi;
        mov.b32 {$0, $1}, a;
        mov.b32 {$2, $3}, b;
        }""",
        "=h,=h,=h,=h,r",
        [x],
        dtype=(gl.float16, gl.float16, gl.float16, gl.float16),
        is_pure=False,
        pack=1,
    )
    sc = scale[:, None]
    y0 = (h0.to(gl.float32) * sc).to(gl.bfloat16)
    y1 = (h1.to(gl.float32) * sc).to(gl.bfloat16)
    y2 = (h2.to(gl.float32) * sc).to(gl.bfloat16)
    y3 = (h3.to(gl.float32) * sc).to(gl.bfloat16)
    # [r, w, a, b] holds value 2·b + a of word w: value order is (w, b, a).
    y = gl.join(gl.join(y0, y1), gl.join(y2, y3)).permute((0, 1, 3, 2))
    return y.reshape([x.shape[0], 4 * x.shape[1]])
