# mypy: disable-error-code="no-untyped-def, untyped-decorator"
"""The staged producers of the ``fp8_ds_mla`` decode kernels (``STAGED`` of :mod:`.ds_mla_heads`
and :mod:`.ds_mla_rows`; :attr:`~.planner.GluonKernel.DS_MLA_STAGED`).

A tile's fp8 latent is handled in chunks of 128 columns (one scale tile). Chunk ``c``'s 64 rows
× 128 bytes land by ``cp.async`` in the first half of the 16 KB its bf16 values take in the
128-byte-swizzled ``[64, 512]`` MMA tile (swizzle atom ``2c`` of the tile's words view,
:data:`STAGED_WORDS`), one commit group a chunk. Once a chunk's group has landed, each thread
reads back exactly the words it copied, the producer's warps meet at a barrier, and the bf16
values (``fp8 · scale``) are written over the chunk's columns (:func:`_widen_staged`). A whole
tile's bytes are in flight with no registers and no staging buffer; the tile's rope lanes land
by ``cp.async`` in its rope tile, in the last chunk's group. Token ids are loaded two tiles
ahead and the row scales one tile ahead, as plain loads into registers.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from mla.providers.gluon.ds_mla_words import CHUNK, _dequantize
from mla.providers.gluon.kernels import _tile_ids

STAGED_WORDS = gl.SwizzledSharedLayout(vec=16, per_phase=1, max_phase=2, order=[1, 0])
"""Shared layout of a bf16 ``[rows, L]`` MMA tile read as 32-bit words ``[L / 64, rows, 32]``:
the tile's ``L / 64`` swizzle atoms (64 columns, 128 bytes a row, the 128-byte swizzle's unit)
in address order, each ``rows`` rows of 32 words with the two 64-byte halves of every odd row
swapped. Chunk ``c``'s fp8 bytes are staged in atom ``2c``, the first half of the 16 KB its
bf16 values take."""


@gluon.constexpr_function
def _chunk_layout(warps):
    """Register layout of a ``[64, 32]``-word chunk (16 bytes a thread on each of 4 rows): the
    staging copies, their read-back, the scale loads (its row slice) and, through
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
    """The :data:`STAGED_WORDS` view of a bf16 ``[rows, L]`` MMA tile."""
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


@gluon.jit
def _row_scales(kv_row, ok, L: gl.constexpr):
    """The four float32 tile scales of the rows ``kv_row`` (fp8 pointers to each token's row), 0
    for rows not ``ok``; plain loads, in flight until the chunks are dequantized."""
    base = (kv_row + L).to(gl.pointer_type(gl.float32))
    s0 = gl.load(base, mask=ok, other=0.0)
    s1 = gl.load(base + 1, mask=ok, other=0.0)
    s2 = gl.load(base + 2, mask=ok, other=0.0)
    s3 = gl.load(base + 3, mask=ok, other=0.0)
    return s0, s1, s2, s3


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
def _widen_staged(words, lat, scale, C: gl.constexpr):
    """Dequantize chunk ``C`` in place, once its group has landed: each thread reads back the
    words it copied (:func:`_stage_chunk`'s layout), the caller's warps meet, then the bf16 values
    overwrite the chunk's columns of ``lat`` (atoms ``2C`` and ``2C + 1``), fenced for the MMAs."""
    ld: gl.constexpr = _chunk_layout(gl.num_warps())
    x = words.index(2 * C).load(ld)
    # Every thread's words are read before any bf16 value overwrites them.
    gl.thread_barrier()
    lat.slice(C * CHUNK, CHUNK, dim=1).store(_dequantize(x, scale))
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _stage_half(
    words, rope_dst, id_slot, empty_bar, phase, kv_row, ok, live, HALF: gl.constexpr, L: gl.constexpr,
    R: gl.constexpr,
):  # fmt: skip
    """Half ``HALF`` of a tile's copies into its ring slot (``words``: the slot's
    :data:`.ds_mla_words.STAGED_WORDS` view), once its warpgroup freed that half (``empty_bar``
    at ``phase``): chunks ``2·HALF`` and ``2·HALF + 1``, one commit group each; the first half
    also writes the tile's key words into ``id_slot``, the second puts the rope copies into the
    last chunk's group. Not ``live`` (no such tile): no wait and no copy, the groups committed
    empty."""
    if live:
        mbarrier.wait(empty_bar, phase)
        if HALF == 0:
            id_slot.store(gl.where(ok, 0, -1))
    _stage_chunk(words, kv_row, ok, live, 2 * HALF)
    if HALF == 1:  # noqa: SIM102 (HALF is a constexpr: this if is resolved at compile time)
        if live:
            _stage_rope(rope_dst, kv_row, ok, L, R)
    _stage_chunk(words, kv_row, ok, live, 2 * HALF + 1)


@gluon.jit
def _widen_and_announce(words, lat, scale, ready, s, C: gl.constexpr):
    """Chunk ``C`` of ring slot ``s`` dequantized in place (:func:`.ds_mla_words._widen_staged`;
    its group has landed) and announced on ``ready[s·CHUNKS + C]``."""
    _widen_staged(words, lat, scale, C)
    mbarrier.arrive(ready.index(s * (lat.shape[1] // CHUNK) + C))


@gluon.jit
def heads_staged_producer(
    kv_ptr, index_base, lo, hi, id_limit, stride_kv, lat_ring, rope_ring, id_ring, ready, empty,
    L: gl.constexpr, R: gl.constexpr, BLOCK_N: gl.constexpr, PAGE_SIZE: gl.constexpr,
):  # fmt: skip
    """The staged producer partition: tile ``t``'s fp8 bytes land by ``cp.async`` inside its own
    bf16 ring slot (chunk ``c`` in the first half of the 16 KB its bf16 values take) and are
    dequantized there chunk by chunk as their groups land. Tile ``t + 1``'s copies go out half by
    half as the two warpgroups free the slot of tile ``t - 1``: the first half after this tile's
    chunk 1, the second after its chunk 3, so up to a tile of bytes is in flight while the
    producer dequantizes. Token ids are loaded two tiles ahead, scales one tile ahead (plain
    loads, in registers)."""
    NUM_STAGES: gl.constexpr = lat_ring.shape[0]
    rows: gl.constexpr = gl.SliceLayout(1, _chunk_layout(gl.num_warps()))
    n_tiles = gl.cdiv(hi - lo, BLOCK_N)
    ids, ok = _tile_ids(index_base, lo, hi, 0, id_limit, BLOCK_N, rows, PAGE_SIZE)
    row = kv_ptr + ids.to(gl.int64) * stride_kv
    nids, nok = _tile_ids(index_base, lo, hi, 1, id_limit, BLOCK_N, rows, PAGE_SIZE)
    s0, s1, s2, s3 = _row_scales(row, ok, L)
    live = n_tiles > 0
    words = _tile_words(lat_ring.index(0))
    _stage_half(words, rope_ring.index(0), id_ring.index(0), empty.index(0), 0, row, ok, live, 0, L, R)
    _stage_half(words, rope_ring.index(0), id_ring.index(0), empty.index(1), 0, row, ok, live, 1, L, R)
    # Groups in flight at the top of tile t: its chunks 0..3 (and, at t = 0, the query's, older).
    for t in range(n_tiles):
        s = t % NUM_STAGES
        u = (t + 1) % NUM_STAGES
        next_phase = ((t + 1) // NUM_STAGES) & 1
        next_live = t + 1 < n_tiles
        nrow = kv_ptr + nids.to(gl.int64) * stride_kv
        nnids, nnok = _tile_ids(index_base, lo, hi, t + 2, id_limit, BLOCK_N, rows, PAGE_SIZE)
        lat = lat_ring.index(s)
        words = _tile_words(lat)
        next_words = _tile_words(lat_ring.index(u))
        async_copy.wait_group(3)
        _widen_and_announce(words, lat, s0, ready, s, 0)
        async_copy.wait_group(2)
        _widen_and_announce(words, lat, s1, ready, s, 1)
        _stage_half(
            next_words, rope_ring.index(u), id_ring.index(u), empty.index(u * 2), next_phase, nrow, nok,
            next_live, 0, L, R,
        )  # fmt: skip
        n0, n1, n2, n3 = _row_scales(nrow, nok, L)
        # In flight: chunks 2 and 3, then the next tile's 0 and 1.
        async_copy.wait_group(3)
        _widen_and_announce(words, lat, s2, ready, s, 2)
        async_copy.wait_group(2)
        _widen_and_announce(words, lat, s3, ready, s, 3)
        _stage_half(
            next_words, rope_ring.index(u), id_ring.index(u), empty.index(u * 2 + 1), next_phase, nrow, nok,
            next_live, 1, L, R,
        )  # fmt: skip
        s0, s1, s2, s3 = n0, n1, n2, n3
        nids, nok = nnids, nnok
    # No copy of these threads outlives the program.
    async_copy.wait_group(0)


@gluon.jit
def _stage_tile(words, rope_dst, kv_row, ok, live, L: gl.constexpr, R: gl.constexpr):
    """A tile's copies into its bf16 tile (``words``: its :data:`.ds_mla_words.STAGED_WORDS`
    view) and rope tile: its four latent chunks, one commit group each, the rope lanes in the
    last chunk's group; not ``live`` (no such tile): the groups committed empty."""
    for c in gl.static_range(L // CHUNK):
        if c == L // CHUNK - 1:  # noqa: SIM102 (c is a constexpr: this if is resolved at compile time)
            if live:
                _stage_rope(rope_dst, kv_row, ok, L, R)
        _stage_chunk(words, kv_row, ok, live, c)


@gluon.jit
def rows_staged_producer(
    kv_ptr, index_base, lo, hi, id_limit, stride_kv, wide, rope_ring, wide_ready, wide_free, rope_free,
    L: gl.constexpr, R: gl.constexpr, PAGE_SIZE: gl.constexpr, OVERLAP: gl.constexpr,
):  # fmt: skip
    """The staged producer partition (``STAGED``): tile ``t``'s fp8 bytes land by ``cp.async``
    inside bf16 tile ``t % 2`` (chunk ``c`` in the first half of the 16 KB its bf16 values take)
    and are dequantized there chunk by chunk as their groups land; the tile is announced on
    ``wide_ready`` after its last chunk. Tile ``t + 1`` goes out into the tiles of ``t - 1`` once
    the MMA freed them (``wide_free``, ``rope_free``): after tile ``t``'s first two chunks, or,
    with ``OVERLAP`` (whose MMA frees tile ``t - 1`` only once tile ``t`` is announced), after
    tile ``t``'s announcement. Token ids are loaded two tiles ahead, scales one tile ahead."""
    rows: gl.constexpr = gl.SliceLayout(1, _chunk_layout(gl.num_warps()))
    CHUNKS: gl.constexpr = L // CHUNK
    ISSUE_AT: gl.constexpr = CHUNKS if OVERLAP else CHUNKS // 2
    BLOCK_N: gl.constexpr = wide.shape[1]
    n_tiles = gl.cdiv(hi - lo, BLOCK_N)
    ids, ok = _tile_ids(index_base, lo, hi, 0, id_limit, BLOCK_N, rows, PAGE_SIZE)
    row = kv_ptr + ids.to(gl.int64) * stride_kv
    nids, nok = _tile_ids(index_base, lo, hi, 1, id_limit, BLOCK_N, rows, PAGE_SIZE)
    s0, s1, s2, s3 = _row_scales(row, ok, L)
    live = n_tiles > 0
    if live:
        mbarrier.wait(wide_free.index(0), 0)
        mbarrier.wait(rope_free.index(0), 0)
    _stage_tile(_tile_words(wide.index(0)), rope_ring.index(0), row, ok, live, L, R)
    for t in range(n_tiles):
        s = t % 2
        u = (t + 1) % 2
        next_live = t + 1 < n_tiles
        nrow = kv_ptr + nids.to(gl.int64) * stride_kv
        nnids, nnok = _tile_ids(index_base, lo, hi, t + 2, id_limit, BLOCK_N, rows, PAGE_SIZE)
        k_lat = wide.index(s)
        words = _tile_words(k_lat)
        scales = (s0, s1, s2, s3)
        for c in gl.static_range(CHUNKS):
            if c == ISSUE_AT:
                # Tile t + 1 into the tiles of t - 1, freed by the MMA.
                if next_live:
                    mbarrier.wait(wide_free.index(u), ((t + 1) // 2) & 1)
                    mbarrier.wait(rope_free.index(u), ((t + 1) // 2) & 1)
                _stage_tile(_tile_words(wide.index(u)), rope_ring.index(u), nrow, nok, next_live, L, R)
                s0, s1, s2, s3 = _row_scales(nrow, nok, L)
            # In flight: this tile's chunks c.., and the next tile's after ISSUE_AT.
            async_copy.wait_group(CHUNKS - 1 - c + (CHUNKS if c >= ISSUE_AT else 0))
            _widen_staged(words, k_lat, scales[c], c)
        mbarrier.arrive(wide_ready.index(s))
        if ISSUE_AT == CHUNKS:
            if next_live:
                mbarrier.wait(wide_free.index(u), ((t + 1) // 2) & 1)
                mbarrier.wait(rope_free.index(u), ((t + 1) // 2) & 1)
            _stage_tile(_tile_words(wide.index(u)), rope_ring.index(u), nrow, nok, next_live, L, R)
            s0, s1, s2, s3 = _row_scales(nrow, nok, L)
        nids, nok = nnids, nnok
    # No copy of these threads outlives the program.
    async_copy.wait_group(0)


__all__ = ["STAGED_WORDS", "heads_staged_producer", "rows_staged_producer"]
