# mypy: disable-error-code="no-untyped-def, untyped-decorator"
"""Gluon (Hopper) varlen prefill, persistent: the split layout of :mod:`.prefill` with one
program per SM looping over the query tiles.

The per-program cost of the one-tile-a-program kernel (the block's start, the barriers' set-up,
the latency of the query tile and of the first K/V tiles, the epilogue) is about 6.7 µs on the
H200 against 2.24 µs a 128 x 128 key tile: a third of a 16 x 1024 batch's time. Here each
program keeps its shared memory, barriers and partitions across query tiles:

* **Tiles.** The program's query tiles, round by round, as :mod:`.prefill_rounds` deals them (a
  snake over the rounds). Both partitions load the ``cu_seqlens`` entries of their next round's
  tile a round ahead (:func:`.prefill_rounds._tile_bounds`; the consumers of the appended-keys
  form load them in their round: carried, they spilled) and read the grid size where they use
  it (:func:`.prefill_rounds._grid`), so a query tile starts without a global load and the
  program has no local memory.
* **Producer** (the launch's 4 warps): per query tile, its key tiles into the ring as in the
  split layout (the V of a masked tile cleaned in shared memory, its per-key flags written),
  and after the first of them, once both consumer warpgroups are done with the previous query
  tile (``q_empty``, two arrivals), its query tile into ``q_smem`` (``q_bar``). The ring's slot
  and phase count on across query tiles (``g``), so the next query tile's first key tile goes
  out while the consumers still finish the previous one's last tiles and epilogue, ahead of
  the query tile that has to wait for them.
* **Consumers** (two warpgroups of 64 query rows): per query tile, the phase ``n & 1`` of
  ``q_bar`` (``n``: the program's query tiles so far), every key tile (ring tile ``g + t``),
  then the epilogue of their rows. Each arrives on ``q_empty`` once its last ``QKᵀ`` of the tile
  is done (:func:`.prefill_parts._release_scores`), so the next query tile loads during the last
  tile's softmax and ``P·V`` and the epilogue. (Loading the tile a warpgroup's half at a time,
  each half once its own warpgroup released it, measured within the runs' spread on an H100.)
  They take turns at the tensor cores as in the split layout (``turns``; the count of a
  warpgroup's waits runs on across query tiles: one per query tile and one per key tile).

Every rule of :mod:`.prefill` holds (causal masking on the diagonal tiles only, the NaN rules,
varlen clamping, LSE), and so does its chunked-context form (``HAS_K_PE``: each key tile's last
box from ``kpe_desc``; ``HAS_PRIOR``: the rows merged by LSE into a prior state in the epilogue;
``HAS_APPENDED``: after the request's own keys, which every row then sees whole, its appended
keys' tiles through the same ring, causal by ``CAUSAL`` over the appended range alone).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from mla.providers.gluon.prefill import _attend_appended, _attend_range
from mla.providers.gluon.prefill_epilogue import _store_rows
from mla.providers.gluon.prefill_parts import (
    BLOCK_M,
    BOX,
    FLAGS_LAYOUT,
    SPLIT_CONSUMER_REGS,
    SPLIT_PRODUCER_WARPS,
    TILE_LAYOUT,
    _cleans_v,
    _consumer_rows,
    _hand_turn,
    _key_range,
    _key_range_from,
    _load_key_tile,
    _mma_layout,
    _query_rope_regs,
    _query_tile_from,
    _take_turn,
)
from mla.providers.gluon.prefill_rounds import _grid, _load_query, _round_bounds, _snake_tile, _tile_bounds
from mla.providers.triton.launch_cache import LaunchCache


@gluon.jit
def _persistent_producer(
    q_desc, k_desc, v_desc, q_smem, k_ring, v_ring, flags, q_bar, q_empty, k_ready, v_ready, v_landed,
    k_empty, v_empty, cu_seqlens_q_ptr, cu_seqlens_k_ptr, stride_qh, stride_kh, stride_vh, num_heads,
    num_m_blocks, num_tiles, num_q_rows, num_k_rows, kpe_desc, appended, CAUSAL: gl.constexpr,
    BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, HAS_K_PE: gl.constexpr, HAS_APPENDED: gl.constexpr,
):  # fmt: skip
    """The producer partition: the key tiles of each of the program's query tiles, the query
    tile itself after the first of them (see the module docstring). With ``HAS_APPENDED`` the
    request's keys are seen whole and its appended keys' tiles follow them
    (:func:`_load_appended`; ``appended = (kn_desc, vn_desc, cu_seqlens_kn_ptr, stride_knh,
    stride_vnh, num_kn_rows)``)."""
    OWN_CAUSAL: gl.constexpr = CAUSAL and not HAS_APPENDED
    g = 0
    done = 0
    cleaned = 0
    bounds = _tile_bounds(0, num_tiles, cu_seqlens_q_ptr, cu_seqlens_k_ptr, num_heads, num_m_blocks)
    for r in range(gl.cdiv(num_tiles, _grid())):
        tile = _snake_tile(r, num_tiles)
        current, bounds = _round_bounds(
            r, bounds, num_tiles, cu_seqlens_q_ptr, cu_seqlens_k_ptr, num_heads, num_m_blocks, True
        )
        q_lo, q_hi, k_lo, k_hi = current
        if tile < num_tiles:
            b, h, q_begin, seq_q, m0 = _query_tile_from(tile, q_lo, q_hi, num_heads, num_m_blocks, num_q_rows)
            if m0 < seq_q:
                k_begin, seq_k, _shift, _n_full, n_tiles = _key_range_from(
                    k_lo, k_hi, num_k_rows, seq_q, m0, OWN_CAUSAL, BLOCK_N
                )
                k_col = h * stride_kh
                v_col = h * stride_vh
                for t in range(n_tiles):
                    cleaned = _load_key_tile(
                        k_desc, kpe_desc, v_desc, k_ring, v_ring, flags, k_ready, v_ready, v_landed, k_empty,
                        v_empty, k_begin + t * BLOCK_N, k_col, v_col, (g + t) % NUM_STAGES,
                        ((g + t) // NUM_STAGES) & 1, _cleans_v(t, seq_k, BLOCK_N), cleaned, HAS_K_PE,
                    )  # fmt: skip
                    if t == 0:
                        _load_query(q_desc, q_begin, m0, h, stride_qh, q_bar, q_smem, q_empty, done)
                if HAS_APPENDED:
                    n_tiles_n, cleaned = _load_appended(
                        appended, q_desc, k_ring, v_ring, flags, k_ready, v_ready, v_landed, k_empty, v_empty,
                        q_bar, q_smem, q_empty, q_begin, m0, h, stride_qh, b, seq_q, g + n_tiles,
                        n_tiles == 0, done, cleaned, CAUSAL, BLOCK_N, NUM_STAGES,
                    )  # fmt: skip
                    g += n_tiles_n
                elif n_tiles == 0:
                    _load_query(q_desc, q_begin, m0, h, stride_qh, q_bar, q_smem, q_empty, done)
                g += n_tiles
                done += 1


@gluon.jit
def _load_appended(
    appended, q_desc, k_ring, v_ring, flags, k_ready, v_ready, v_landed, k_empty, v_empty, q_bar, q_smem,
    q_empty, q_begin, m0, h, stride_qh, b, seq_q, g0, query_pending, done, cleaned, CAUSAL: gl.constexpr,
    BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
):  # fmt: skip
    """The producer's appended keys of the query tile at ``m0`` of request ``b``, head ``h``: their
    key tiles (whole keys from ``kn_desc``/``vn_desc``, causal by ``CAUSAL`` over the appended
    range alone) as ring tiles ``g0 + t``, each V cleaned where the tile reaches past the
    request's appended keys; the query tile after the first of them when ``query_pending`` (the
    request had no key tile of its own), or at once when there is none. Returns ``(n_tiles_n,
    cleaned)``."""
    kn_desc, vn_desc, cu_seqlens_kn_ptr, stride_knh, stride_vnh, num_kn_rows = appended
    kn_begin, seq_kn, _shift, _n_full, n_tiles_n = _key_range(
        cu_seqlens_kn_ptr, b, num_kn_rows, seq_q, m0, CAUSAL, BLOCK_N
    )
    for t in range(n_tiles_n):
        cleaned = _load_key_tile(
            kn_desc, kn_desc, vn_desc, k_ring, v_ring, flags, k_ready, v_ready, v_landed, k_empty, v_empty,
            kn_begin + t * BLOCK_N, h * stride_knh, h * stride_vnh, (g0 + t) % NUM_STAGES,
            ((g0 + t) // NUM_STAGES) & 1, _cleans_v(t, seq_kn, BLOCK_N), cleaned, False,
        )  # fmt: skip
        if query_pending & (t == 0):
            _load_query(q_desc, q_begin, m0, h, stride_qh, q_bar, q_smem, q_empty, done)
    if query_pending & (n_tiles_n == 0):
        _load_query(q_desc, q_begin, m0, h, stride_qh, q_bar, q_smem, q_empty, done)
    return n_tiles_n, cleaned


@gluon.jit
def _persistent_consumer(
    q_smem, k_ring, v_ring, flags, q_bar, q_empty, k_ready, v_ready, k_empty, v_empty, out_ptr, lse_ptr,
    cu_seqlens_q_ptr, cu_seqlens_k_ptr, stride_ot, stride_oh, stride_lt, stride_lh, num_heads, num_m_blocks,
    num_tiles, num_q_rows, num_k_rows, qk_scale, prior, appended, CAUSAL: gl.constexpr,
    BLOCK_N: gl.constexpr, D_V: gl.constexpr, NUM_STAGES: gl.constexpr, WRITE_LSE: gl.constexpr,
    W: gl.constexpr, HAS_PRIOR: gl.constexpr, VEC_STORE: gl.constexpr, HAS_APPENDED: gl.constexpr,
    turns,
):  # fmt: skip
    """Consumer warpgroup ``W`` (query rows ``[64·W, 64·(W+1))`` of each query tile): every key
    tile of each of the program's query tiles (with ``HAS_APPENDED`` then those of the request's
    appended keys, as :func:`_persistent_producer` loads them), then the rows' epilogue (see the
    module docstring)."""
    OWN_CAUSAL: gl.constexpr = CAUSAL and not HAS_APPENDED
    M: gl.constexpr = 64
    s_layout: gl.constexpr = _mma_layout(4, BLOCK_N)
    o_layout: gl.constexpr = _mma_layout(4, D_V)
    tiles = (q_smem, k_ring, v_ring, flags, k_ready, v_ready, k_empty, v_empty)
    AHEAD: gl.constexpr = not HAS_APPENDED
    g = 0
    done = 0
    bounds = _tile_bounds(0, num_tiles, cu_seqlens_q_ptr, cu_seqlens_k_ptr, num_heads, num_m_blocks)
    for r in range(gl.cdiv(num_tiles, _grid())):
        tile = _snake_tile(r, num_tiles)
        current, bounds = _round_bounds(
            r, bounds, num_tiles, cu_seqlens_q_ptr, cu_seqlens_k_ptr, num_heads, num_m_blocks, AHEAD
        )
        q_lo, q_hi, k_lo, k_hi = current
        if tile < num_tiles:
            b, h, q_begin, seq_q, m0 = _query_tile_from(tile, q_lo, q_hi, num_heads, num_m_blocks, num_q_rows)
            if m0 < seq_q:
                _k_begin, seq_k, shift, n_full, n_tiles = _key_range_from(
                    k_lo, k_hi, num_k_rows, seq_q, m0, OWN_CAUSAL, BLOCK_N
                )
                rows, row_last, acc, m_i, l_i = _consumer_rows(
                    q_bar, shift, seq_k, W, M, D_V, s_layout, o_layout, done & 1
                )
                q_reg = None
                if not HAS_APPENDED:  # (with the appended keys' loop too its consumers would spill)
                    q_reg = _query_rope_regs(q_smem, W, M, s_layout)
                turn = (turns.index(W), turns.index(1 - W), done + 1)
                _take_turn(turn, g - 1)
                n_tiles_n = 0
                if HAS_APPENDED:
                    _kn_desc, _vn_desc, cu_seqlens_kn_ptr, _sk, _sv, num_kn_rows = appended
                    _kn_begin, seq_kn, shift_n, n_full_n, n_tiles_n = _key_range(
                        cu_seqlens_kn_ptr, b, num_kn_rows, seq_q, m0, CAUSAL, BLOCK_N
                    )
                # the query buffer is released after the tile's last QKᵀ (ring tile g_last)
                q_release = (q_empty, g + n_tiles + n_tiles_n - 1)
                # (the producer issues every load: no ring operands for _attend_range)
                acc, m_i, l_i = _attend_range(
                    tiles, None, acc, m_i, l_i, n_full, n_tiles, g, row_last, seq_k, qk_scale, False,
                    BLOCK_N, D_V, NUM_STAGES, s_layout, o_layout, W, M, True, turn, True, q_release, q_reg,
                )  # fmt: skip
                if HAS_APPENDED:
                    acc, m_i, l_i = _attend_appended(
                        tiles, None, acc, m_i, l_i, rows, (seq_kn, shift_n, n_full_n, n_tiles_n), g + n_tiles,
                        qk_scale, BLOCK_N, D_V, NUM_STAGES, s_layout, o_layout, W, M, True, turn, True,
                        q_release,
                    )  # fmt: skip
                    g += n_tiles_n
                _hand_turn(turn)
                # (a query tile without key tiles never read the buffer)
                mbarrier.arrive(q_empty, pred=n_tiles + n_tiles_n == 0)
                _store_rows(
                    acc, m_i, l_i, rows, out_ptr, lse_ptr, q_begin, m0, seq_q, h, stride_ot, stride_oh,
                    stride_lt, stride_lh, W, M, D_V, WRITE_LSE, o_layout, prior, HAS_PRIOR, VEC_STORE,
                )  # fmt: skip
                g += n_tiles
                done += 1


@gluon.jit
def mla_prefill_persistent_kernel(
    q_desc,
    k_desc,
    v_desc,
    out_ptr,
    lse_ptr,
    cu_seqlens_q_ptr,
    cu_seqlens_k_ptr,
    stride_qh,
    stride_kh,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_lt,
    stride_lh,
    num_heads,
    num_m_blocks,
    num_tiles,
    num_q_rows,
    num_k_rows,
    qk_scale,
    kpe_desc,
    prior_out_ptr,
    prior_lse_ptr,
    stride_pot,
    stride_poh,
    stride_plt,
    stride_plh,
    kn_desc,
    vn_desc,
    cu_seqlens_kn_ptr,
    stride_knh,
    stride_vnh,
    num_kn_rows,
    D_QK: gl.constexpr,
    D_V: gl.constexpr,
    BLOCK_N: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    CAUSAL: gl.constexpr,
    WRITE_LSE: gl.constexpr,
    HAS_K_PE: gl.constexpr,
    HAS_PRIOR: gl.constexpr,
    VEC_STORE: gl.constexpr,
    HAS_APPENDED: gl.constexpr,
    num_warps: gl.constexpr,
):
    gl.static_assert(num_warps == SPLIT_PRODUCER_WARPS, "launch warps: the producer's")
    gl.static_assert(NUM_STAGES >= 2, "a ring of two or more slots")
    dtype: gl.constexpr = q_desc.dtype
    NQ: gl.constexpr = D_QK // BOX
    q_smem = gl.allocate_shared_memory(dtype, [NQ, BLOCK_M, BOX], TILE_LAYOUT)
    k_ring = gl.allocate_shared_memory(dtype, [NUM_STAGES * NQ, BLOCK_N, BOX], TILE_LAYOUT)
    v_ring = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, D_V], TILE_LAYOUT)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_landed = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    flags = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, BLOCK_N], FLAGS_LAYOUT)
    # the consumer warpgroups' turns at the tensor cores; warpgroup 0 starts with the turn
    turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(turns.index(i), count=1)
    mbarrier.arrive(turns.index(0))
    mbarrier.init(q_bar, count=1)
    mbarrier.init(q_empty, count=2)
    mbarrier.init(v_landed, count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)
        mbarrier.init(v_empty.index(i), count=2)
    # The query buffer and every ring slot start free (phase 0 of their empty barriers).
    mbarrier.arrive(q_empty, count=2)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.arrive(k_empty.index(i), count=2)
        mbarrier.arrive(v_empty.index(i), count=2)
    fence_async_shared()
    prior = (prior_out_ptr, prior_lse_ptr, stride_pot, stride_poh, stride_plt, stride_plh)
    appended = (kn_desc, vn_desc, cu_seqlens_kn_ptr, stride_knh, stride_vnh, num_kn_rows)
    gl.warp_specialize(
        [
            (
                _persistent_producer,
                (
                    q_desc, k_desc, v_desc, q_smem, k_ring, v_ring, flags, q_bar, q_empty, k_ready, v_ready,
                    v_landed, k_empty, v_empty, cu_seqlens_q_ptr, cu_seqlens_k_ptr, stride_qh, stride_kh,
                    stride_vh, num_heads, num_m_blocks, num_tiles, num_q_rows, num_k_rows, kpe_desc, appended,
                    CAUSAL, BLOCK_N, NUM_STAGES, HAS_K_PE, HAS_APPENDED,
                ),
            ),
            (
                _persistent_consumer,
                (
                    q_smem, k_ring, v_ring, flags, q_bar, q_empty, k_ready, v_ready, k_empty, v_empty,
                    out_ptr, lse_ptr, cu_seqlens_q_ptr, cu_seqlens_k_ptr, stride_ot, stride_oh, stride_lt,
                    stride_lh, num_heads, num_m_blocks, num_tiles, num_q_rows, num_k_rows, qk_scale, prior,
                    appended, CAUSAL, BLOCK_N, D_V, NUM_STAGES, WRITE_LSE, 0, HAS_PRIOR, VEC_STORE,
                    HAS_APPENDED, turns,
                ),
            ),
            (
                _persistent_consumer,
                (
                    q_smem, k_ring, v_ring, flags, q_bar, q_empty, k_ready, v_ready, k_empty, v_empty,
                    out_ptr, lse_ptr, cu_seqlens_q_ptr, cu_seqlens_k_ptr, stride_ot, stride_oh, stride_lt,
                    stride_lh, num_heads, num_m_blocks, num_tiles, num_q_rows, num_k_rows, qk_scale, prior,
                    appended, CAUSAL, BLOCK_N, D_V, NUM_STAGES, WRITE_LSE, 1, HAS_PRIOR, VEC_STORE,
                    HAS_APPENDED, turns,
                ),
            ),
        ],
        [4, 4],
        [SPLIT_CONSUMER_REGS, SPLIT_CONSUMER_REGS],
    )  # fmt: skip


PERSISTENT_LAUNCH = LaunchCache(mla_prefill_persistent_kernel)
"""``mla_prefill_persistent_kernel[grid](...)`` through the cached launch
(:mod:`mla.providers.triton.launch_cache`)."""


__all__ = ["PERSISTENT_LAUNCH", "mla_prefill_persistent_kernel"]
