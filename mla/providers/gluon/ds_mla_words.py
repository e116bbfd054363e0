# mypy: disable-error-code="no-untyped-def, untyped-decorator"
"""``fp8_ds_mla`` rows staged in the bf16 MMA tile they are dequantized into: the helpers of the
producer of :mod:`.ds_mla_heads`.

A 656-byte row holds 512 e4m3 latent values, one float32 scale per 128-wide latent tile and 64
bf16 rope values. A tile's latent is handled in chunks of 128 columns (one scale tile). Chunk
``c``'s 64 rows × 128 bytes land by ``cp.async`` in the first half of the 16 KB its bf16 values
take in the 128-byte-swizzled ``[64, 512]`` MMA tile (swizzle atom ``2c`` of the tile's words
view, :data:`STAGED_WORDS`), one commit group a chunk (:func:`_stage_chunk`). Once the groups of
two chunks have landed, each thread reads back exactly the words it copied, the producer's warps
meet at a barrier, and the bf16 values (``fp8 · scale``, :func:`_dequantize`) are written over
the chunks' columns (:func:`_widen_staged_pair`): a whole tile's bytes in flight with no
registers and no staging buffer.

The e4m3 → bf16 dequantization itself (:func:`_dequantize`, :func:`_bias_scales`: bit moves and
one bf16x2 multiply, no conversion instruction) is also the one of the few-rows kernels'
widening (:func:`.kernels._widen_ds_mla`).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared

CHUNK = gl.constexpr(128)
"""Latent columns of a chunk: one scale tile of an ``fp8_ds_mla`` row."""


E4M3_BIAS = gl.constexpr(1.329227995784916e36)
"""``2**120``: an e4m3 value's bits moved into a bf16 (:func:`_e4m3_words_to_bf16`) read as the
value times ``2**-120``, so each tile scale is multiplied by this before it meets them."""


@gluon.jit
def _bias_scales(scale):
    """The packed bf16x2 multiplier (both halves ``scale · 2**120`` in bf16, as int32 bits) of
    each float32 tile scale in ``scale``: exact for power-of-two scales below ``2**8``; a scale of
    ``2**8`` or more overflows to ``inf``."""
    bits = (scale * E4M3_BIAS).to(gl.bfloat16).to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
    return bits | (bits << 16)


@gluon.jit
def _e4m3_words_to_bf16(x, scale2):
    """The four bf16 values ``e4m3 · scale`` of each int32 word of ``x`` (four e4m3 values, the
    first in the low byte), in byte order, with ``scale2`` the word's packed multiplier
    (:func:`_bias_scales`, broadcast against ``x``).

    No conversion instruction: each byte, sign-extended into a 16-bit lane (``prmt``), shifted
    left by 4 and masked to ``0x87f0`` is the bf16 whose sign, low four exponent bits and top
    three mantissa bits are the e4m3 value's (subnormals included), that is the value times
    ``2**-120``; one ``bf16x2`` multiply by the scale times ``2**120`` finishes two values. Four
    instructions for two values, where e4m3 → f16 → f32 × scale → bf16 takes six. The product is
    exact for power-of-two scales; another scale is rounded to bf16 first (a relative error of
    at most ``2**-8`` before the product's own rounding). An e4m3 NaN byte (``0x7f``, ``0xff``)
    reads as ``±480 · scale``. The block has side effects, so the compiler keeps it where the
    code puts it (after a producer's read-back and its barrier)."""
    return gl.inline_asm_elementwise(
        """{
        .reg .b32 lo, hi;
        prmt.b32 lo, $4, $4, 0x9180;
        prmt.b32 hi, $4, $4, 0xb3a2;
        shl.b32 lo, lo, 4;
        shl.b32 hi, hi, 4;
        and.b32 lo, lo, 0x87f087f0;
        and.b32 hi, hi, 0x87f087f0;
        mul.rn.bf16x2 lo, lo, $5;
        mul.rn.bf16x2 hi, hi, $5;
        mov.b32 {$0, $1}, lo;
        mov.b32 {$2, $3}, hi;
        }""",
        "=h,=h,=h,=h,r,r",
        [x, scale2],
        dtype=(gl.bfloat16, gl.bfloat16, gl.bfloat16, gl.bfloat16),
        is_pure=False,
        pack=1,
    )


@gluon.jit
def _dequantize(x, scale):
    """The bf16 values ``fp8 · scale`` of ``x`` (``[..., w]`` int32 words of four e4m3 values, the
    first in the low byte) and ``scale`` (``[...]``, float32: a word's scale is its row's), as
    ``[..., w, 2, 2]``: value ``2·b + a`` of word ``w`` at ``[..., w, b, a]``, so the values are
    in order once the caller merges the last three dimensions (:func:`_e4m3_words_to_bf16`)."""
    y0, y1, y2, y3 = _e4m3_words_to_bf16(x, gl.expand_dims(_bias_scales(scale), -1))
    return gl.join(gl.join(y0, y2), gl.join(y1, y3))


STAGED_WORDS = gl.SwizzledSharedLayout(vec=16, per_phase=1, max_phase=2, order=[1, 0])
"""Shared layout of a bf16 ``[rows, L]`` MMA tile read as 32-bit words ``[L / 64, rows, 32]``:
the tile's ``L / 64`` swizzle atoms (64 columns, 128 bytes a row, the 128-byte swizzle's unit)
in address order, each ``rows`` rows of 32 words with the two 64-byte halves of every odd row
swapped. Chunk ``c``'s fp8 bytes are staged in atom ``2c``, the first half of the 16 KB its
bf16 values take."""


@gluon.constexpr_function
def _chunk_layout(warps):
    """Register layout of a ``[64, 32]``-word chunk (16 bytes a thread on each of its rows, 4 at
    4 warps): the staging copies, their read-back, the rows' scales (its row slice) and, through
    :func:`_dequantize`, the bf16 stores. A quarter warp's 8 lanes hold the first 64 bytes of
    two adjacent rows (lane bit 2 steps a row, lane bit 3 the other 64 bytes), which
    :data:`STAGED_WORDS` puts in different bank halves and the 128-byte swizzle of the bf16 tile
    in different 16-byte units: every access of a wavefront on its own banks."""
    warp_rows = [[4 << w, 0] for w in range(warps.bit_length() - 1)]
    rows_per_pass = 4 * warps
    reg_rows = [[rows_per_pass << r, 0] for r in range((64 // rows_per_pass).bit_length() - 1)]
    return gl.DistributedLinearLayout(
        [[0, 1], [0, 2], *reg_rows], [[0, 4], [0, 8], [1, 0], [0, 16], [2, 0]], warp_rows, [], [64, 32]
    )


@gluon.jit
def _tile_words(lat):
    """The :data:`STAGED_WORDS` view of a bf16 ``[rows, L]`` MMA tile in
    :data:`.kernels.MMA_TILE_LAYOUT` (the 128-byte swizzle whose atoms the view walks)."""
    return lat._reinterpret(gl.int32, [lat.shape[1] // 64, lat.shape[0], 32], STAGED_WORDS)


@gluon.jit
def _stage_rope(rope_dst, kv_row, ok, L: gl.constexpr, R: gl.constexpr):
    """``cp.async`` the bf16 rope lanes of the rows ``kv_row`` (rows not ``ok`` zero-filled) into
    ``rope_dst`` (the MMA layout), 16 bytes a thread; the caller commits the group."""
    rope_ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
    rope_row = gl.convert_layout(kv_row, gl.SliceLayout(1, rope_ld))
    rope_ok = gl.convert_layout(ok, gl.SliceLayout(1, rope_ld))
    rope_src = (rope_row + L + 4 * (L // CHUNK)).to(gl.pointer_type(gl.bfloat16))
    rope_cols = gl.arange(0, R, layout=gl.SliceLayout(0, rope_ld))
    async_copy.async_copy_global_to_shared(
        rope_dst, rope_src[:, None] + rope_cols[None, :], mask=rope_ok[:, None]
    )


@gluon.constexpr_function
def _scales_layout(warps):
    """Register layout of the ``[64, 4]`` float32 tile scales of a tile's rows: a row's four
    scales (16 bytes) in one thread's registers, the rows where :func:`_chunk_layout` holds them
    (the lanes that share a row read the same 16 bytes): the chunk layout with its first two
    register bases as the four scales and its lanes' word offsets dropped."""
    chunk = _chunk_layout(warps)
    lanes = [[row, 0] for row, _word in chunk.lane_bases]
    return gl.DistributedLinearLayout(chunk.reg_bases, lanes, chunk.warp_bases, [], [64, 4])


@gluon.jit
def _row_scales(kv_row, ok, L: gl.constexpr):
    """The four float32 tile scales of the rows ``kv_row`` (fp8 pointers to each token's row), 0
    for rows not ``ok``: one 16-byte load a row (:func:`_scales_layout`), in flight until the
    chunks are dequantized; returned in ``kv_row``'s layout."""
    rows: gl.constexpr = kv_row.type.layout
    sl: gl.constexpr = _scales_layout(gl.num_warps())
    row = gl.convert_layout(kv_row, gl.SliceLayout(1, sl))
    row_ok = gl.convert_layout(ok, gl.SliceLayout(1, sl))
    cols = gl.arange(0, 4, layout=gl.SliceLayout(0, sl))
    base = (row + L).to(gl.pointer_type(gl.float32))
    scales = gl.load(base[:, None] + cols[None, :], mask=row_ok[:, None], other=0.0)
    even, odd = gl.split(scales.reshape([64, 2, 2]))
    s0, s2 = gl.split(even)
    s1, s3 = gl.split(odd)
    return (
        gl.convert_layout(s0, rows),
        gl.convert_layout(s1, rows),
        gl.convert_layout(s2, rows),
        gl.convert_layout(s3, rows),
    )


@gluon.jit
def _stage_chunk(words, kv_row, ok, live, C: gl.constexpr):
    """One ``cp.async`` commit group: when ``live``, chunk ``C``'s fp8 bytes of the rows
    ``kv_row`` (rows not ``ok`` zero-filled) into atom ``2C`` of ``words`` (:data:`STAGED_WORDS`);
    the group is committed either way, so the caller's ``wait_group`` counts hold."""
    ld: gl.constexpr = _chunk_layout(gl.num_warps())
    if live:
        cols = gl.arange(0, CHUNK // 4, layout=gl.SliceLayout(0, ld))
        src = kv_row.to(gl.pointer_type(gl.int32))[:, None] + (C * (CHUNK // 4) + cols)[None, :]
        async_copy.async_copy_global_to_shared(words.index(2 * C), src, mask=ok[:, None])
    async_copy.commit_group()


@gluon.jit
def _widen_staged_pair(words, lat, scale_a, scale_b, C: gl.constexpr):
    """Dequantize chunks ``C`` and ``C + 1`` in place, once both groups have landed: each thread
    reads back the words it copied (:func:`_stage_chunk`'s layout), the caller's warps meet once,
    then the bf16 values (``scale_a`` for chunk ``C``, ``scale_b`` for ``C + 1``) overwrite the
    chunks' columns of ``lat`` (atoms ``2C`` to ``2C + 3``), fenced for the MMAs. Two meetings for
    the two chunks: the compiler adds one after every ``wait_group`` too."""
    ld: gl.constexpr = _chunk_layout(gl.num_warps())
    xa = words.index(2 * C).load(ld)
    xb = words.index(2 * C + 2).load(ld)
    # Every thread's words are read before any bf16 value overwrites them.
    gl.thread_barrier()
    lat.slice(C * CHUNK, CHUNK, dim=1).store(_dequantize(xa, scale_a).reshape([xa.shape[0], CHUNK]))
    lat.slice((C + 1) * CHUNK, CHUNK, dim=1).store(_dequantize(xb, scale_b).reshape([xb.shape[0], CHUNK]))
    fence_async_shared()
    gl.thread_barrier()
