# mypy: disable-error-code="no-untyped-def, untyped-decorator"
"""Pieces shared by the Gluon prefill kernels (:mod:`.prefill`, :mod:`.prefill_overlap`): the
launch constants, the tile range of a query tile, the TMA box copies into the K/V ring, the
split kernel's producers (TMA, and the V clean-up of masked tiles; one for a call with appended
keys), the consumers' ``QKᵀ`` issue and the ring-slot release (the epilogue: :mod:`.prefill_epilogue`)."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma

BLOCK_M = gl.constexpr(128)
"""Query rows per program (two warpgroups of 64)."""
CONSUMER_WARPS = gl.constexpr(8)
"""Warps of the consumer (default) partition: the launch's ``num_warps``."""
PRODUCER_WARPS = gl.constexpr(1)
"""Warps of the TMA producer partition (warp-specialized kernel)."""
PRODUCER_REGS = gl.constexpr(24)
"""Registers per producer thread (``setmaxnreg``): it only issues TMA copies."""
TILE_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
"""Shared layout of every q/K/V tile and of its TMA descriptor's boxes: 128-byte swizzle."""
SPLIT_PRODUCER_WARPS = gl.constexpr(4)
"""Warps of the split kernel's producer (its default partition: the launch's ``num_warps``)."""
SPLIT_CONSUMER_REGS = gl.constexpr(240)
"""Registers per consumer thread of the split kernel (``setmaxnreg``; 64-row S and O: 128; the
query's rope box as an A operand: 16), the producer getting what is left (24)."""
FLAGS_LAYOUT = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
"""Shared layout of the split kernel's per-key flags."""
BOX = gl.constexpr(64)
"""Columns of a TMA box: 128 bytes, one swizzle row (192 is not a power of two: 3 boxes)."""


@gluon.jit
def _query_tile(cu_seqlens_q_ptr, num_heads, num_m_blocks, num_q_rows):
    """This program's query tile (:func:`_query_tile_at` of its program id)."""
    return _query_tile_at(gl.program_id(0), cu_seqlens_q_ptr, num_heads, num_m_blocks, num_q_rows)


@gluon.jit
def _query_tile_at(tile, cu_seqlens_q_ptr, num_heads, num_m_blocks, num_q_rows):
    """Query tile number ``tile``: ``(b, h, q_begin, seq_q, m0)``, the request and head, the
    request's first token and query count, and the tile's first row (``m0 >= seq_q``: nothing
    to do). Tiles are numbered flat, the tile index fastest and reversed (the heaviest causal
    tiles first). Each range is clamped into the tensor: a bad indptr touches no row outside it
    (the call checks the values and raises)."""
    b, _h, _m_block = _tile_request(tile, num_heads, num_m_blocks)
    return _query_tile_from(
        tile,
        gl.load(cu_seqlens_q_ptr + b),
        gl.load(cu_seqlens_q_ptr + b + 1),
        num_heads,
        num_m_blocks,
        num_q_rows,
    )


@gluon.jit
def _tile_request(tile, num_heads, num_m_blocks):
    """Query tile number ``tile``'s ``(b, h, m_block)``: request, head and row block (numbered
    as :func:`_query_tile_at` says)."""
    bh = tile // num_m_blocks
    return bh // num_heads, bh % num_heads, num_m_blocks - 1 - tile % num_m_blocks


@gluon.jit
def _query_tile_from(tile, q_lo, q_hi, num_heads, num_m_blocks, num_q_rows):
    """:func:`_query_tile_at` with the request's ``cu_seqlens_q`` entries ``q_lo``, ``q_hi``
    already loaded."""
    b, h, m_block = _tile_request(tile, num_heads, num_m_blocks)
    q_begin = gl.minimum(gl.maximum(q_lo, 0), num_q_rows)
    seq_q = gl.minimum(gl.maximum(q_hi, q_begin), num_q_rows) - q_begin
    return b, h, q_begin, seq_q, m_block * BLOCK_M


@gluon.jit
def _key_range(cu_seqlens_k_ptr, b, num_k_rows, seq_q, m0, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr):
    """Request ``b``'s keys for the query tile at ``m0``: ``(k_begin, seq_k, shift, n_full,
    n_tiles)`` (:func:`_tile_range`), the range clamped into the tensor."""
    return _key_range_from(
        gl.load(cu_seqlens_k_ptr + b),
        gl.load(cu_seqlens_k_ptr + b + 1),
        num_k_rows,
        seq_q,
        m0,
        CAUSAL,
        BLOCK_N,
    )


@gluon.jit
def _key_range_from(k_lo, k_hi, num_k_rows, seq_q, m0, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr):
    """:func:`_key_range` with the request's ``cu_seqlens_k`` entries ``k_lo``, ``k_hi`` already
    loaded."""
    k_begin = gl.minimum(gl.maximum(k_lo, 0), num_k_rows)
    seq_k = gl.minimum(gl.maximum(k_hi, k_begin), num_k_rows) - k_begin
    shift, n_full, n_tiles = _tile_range(seq_q, seq_k, m0, CAUSAL, BLOCK_N)
    return k_begin, seq_k, shift, n_full, n_tiles


@gluon.jit
def _tile_range(seq_q, seq_k, m0, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr):
    """``(shift, n_full, n_tiles)`` of the query tile at row ``m0``: row ``r`` of the tile sees
    key ``n`` iff ``n <= r + shift`` and ``n < seq_k``; key tiles ``[0, n_full)`` are seen whole
    by every row, ``[n_full, n_tiles)`` need the mask."""
    shift = m0 + seq_k - seq_q if CAUSAL else seq_k - 1
    full_end = gl.minimum(gl.maximum(shift + 1, 0), seq_k)
    masked_end = gl.minimum(gl.maximum(shift + BLOCK_M, 0), seq_k)
    return shift, full_end // BLOCK_N, gl.cdiv(masked_end, BLOCK_N)


@gluon.jit
def _issue_kv(
    k_desc, v_desc, k_ring, v_ring, k_ready, v_ready, k_empty, v_empty, k_row0, k_col, v_col, t,
    BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
):  # fmt: skip
    """Once its slot's previous tile is released, TMA key tile ``t`` (K, then V) into ring slot
    ``t % NUM_STAGES``; each lands on its slot's ``ready`` barrier."""
    s = t % NUM_STAGES
    phase = (t // NUM_STAGES) & 1
    row = k_row0 + t * BLOCK_N
    NK: gl.constexpr = k_ring.shape[0] // NUM_STAGES
    mbarrier.wait(k_empty.index(s), phase)
    _copy_boxes(k_desc, row, k_col, k_ready.index(s), k_ring, s * NK, NK, False)
    mbarrier.wait(v_empty.index(s), phase)
    _copy_boxes(v_desc, row, v_col, v_ready.index(s), v_ring.index(s), 0, v_ring.shape[2] // BOX, True)


@gluon.jit
def _consumer_prologue(
    ring, n_tiles, ISSUE_LOADS: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr
):
    """A consumer partition's start: with a producer partition, a barrier (the partition reads
    its arguments before anything of it writes shared memory); without one (``ISSUE_LOADS``),
    the loads of the first ``NUM_STAGES - 1`` key tiles. ``ring``: the loads' operands
    ``(k_desc, v_desc, k_ring, v_ring, k_ready, v_ready, k_empty, v_empty, k_row0, k_col,
    v_col)``."""
    if not ISSUE_LOADS:
        gl.thread_barrier()
    else:
        k_desc, v_desc, k_ring, v_ring, k_ready, v_ready, k_empty, v_empty, k_row0, k_col, v_col = ring
        for t in gl.static_range(NUM_STAGES - 1):
            if t < n_tiles:
                _issue_kv(
                    k_desc, v_desc, k_ring, v_ring, k_ready, v_ready, k_empty, v_empty, k_row0, k_col,
                    v_col, t, BLOCK_N, NUM_STAGES,
                )  # fmt: skip


@gluon.jit
def _issue_ahead(
    ring, t, n_tiles, ISSUE_LOADS: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr
):
    """Without a producer partition (``ISSUE_LOADS``): before attending key tile ``t``, the loads
    of tile ``t + NUM_STAGES - 1`` when there is one (``ring``: as :func:`_consumer_prologue`)."""
    if ISSUE_LOADS:  # noqa: SIM102 (a constexpr: resolved at compile time)
        if t + NUM_STAGES - 1 < n_tiles:
            k_desc, v_desc, k_ring, v_ring, k_ready, v_ready, k_empty, v_empty, k_row0, k_col, v_col = ring
            _issue_kv(
                k_desc, v_desc, k_ring, v_ring, k_ready, v_ready, k_empty, v_empty, k_row0, k_col, v_col,
                t + NUM_STAGES - 1, BLOCK_N, NUM_STAGES,
            )  # fmt: skip


@gluon.jit
def _row_last(rows, shift, seq_k):
    """Each query row's last visible key of a range of ``seq_k`` keys (bottom-right causal:
    ``row + shift``, at most ``seq_k - 1``; ``shift`` as :func:`_tile_range` gives it)."""
    return gl.minimum(rows + shift, seq_k - 1)


@gluon.jit
def _consumer_rows(
    q_bar, shift, seq_k, W: gl.constexpr, M: gl.constexpr, D_V: gl.constexpr, S_LAYOUT: gl.constexpr,
    O_LAYOUT: gl.constexpr, q_phase=0,
):  # fmt: skip
    """A consumer's query rows ``[W·M, (W+1)·M)`` of the tile, each row's last visible key
    (bottom-right causal: ``row + shift``, at most ``seq_k - 1``), and its empty output, row max
    and row sum, once the query tile has landed (phase ``q_phase`` of ``q_bar``): ``(rows,
    row_last, acc, m_i, l_i)``."""
    s_rows: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)
    rows = W * M + gl.arange(0, M, layout=s_rows)
    row_last = _row_last(rows, shift, seq_k)
    acc = gl.zeros([M, D_V], gl.float32, layout=O_LAYOUT)
    m_i = gl.full([M], float("-inf"), gl.float32, layout=s_rows)
    l_i = gl.zeros([M], gl.float32, layout=s_rows)
    mbarrier.wait(q_bar, q_phase)
    return rows, row_last, acc, m_i, l_i


@gluon.jit
def _hand_turn(turn):
    """Hand the turn at the tensor cores to the other warpgroup (``turn`` as in
    :func:`_take_turn`)."""
    mbarrier.arrive(turn[1])


@gluon.jit
def _take_turn(turn, g):
    """Wait for this consumer warpgroup's turn at the tensor cores (``turn = (mine, other,
    base)``: its turn barrier, the other warpgroup's, and the count of its waits before the
    ``P·V`` of ring tile 0): the ``base + g``-th wait on ``mine``, which the other warpgroup's
    arrivals on it complete one by one (one after each of its ``QKᵀ`` issues and one after
    each query tile). The two warpgroups meet the same key tiles, so the turns alternate."""
    mbarrier.wait(turn[0], (turn[2] + g) & 1)


@gluon.jit
def _copy_boxes(desc, row, col, bar, dst, first, N: gl.constexpr, SLICED: gl.constexpr):
    """TMA the ``[rows, N·BOX]`` tile at ``(row, col)`` as ``N`` boxes of ``BOX`` columns (a TMA
    box and a shared buffer are a power of two wide), all on ``bar``'s transaction count: into
    boxes ``dst[first + c]`` of a box array, or (``SLICED``) into column slices of ``dst``."""
    mbarrier.expect(bar, desc.block_type.nbytes * N)
    for c in gl.static_range(N):
        box = dst.slice(c * BOX, BOX, dim=1) if SLICED else dst.index(first + c)
        tma.async_copy_global_to_shared(desc, [row, col + c * BOX], bar, box)


@gluon.jit
def _copy_key_boxes(k_desc, kpe_desc, row, col, bar, dst, first, N: gl.constexpr, HAS_K_PE: gl.constexpr):
    """TMA the ``N`` boxes of a key tile at ``(row, col)`` into boxes ``dst[first + c]``, all on
    ``bar``: with ``HAS_K_PE`` the first ``N - 1`` from ``k_desc`` (each head's own lanes) and the
    last from ``kpe_desc`` at column 0 (the rope lanes every head shares: one ``BOX``-wide box)."""
    if HAS_K_PE:
        mbarrier.expect(bar, k_desc.block_type.nbytes * N)
        for c in gl.static_range(N - 1):
            tma.async_copy_global_to_shared(k_desc, [row, col + c * BOX], bar, dst.index(first + c))
        tma.async_copy_global_to_shared(kpe_desc, [row, 0], bar, dst.index(first + N - 1))
    else:
        _copy_boxes(k_desc, row, col, bar, dst, first, N, False)


@gluon.jit
def _split_producer(
    k_desc, v_desc, k_ring, v_ring, flags, k_ready, v_ready, v_landed, k_empty, v_empty, k_row0, k_col,
    v_col, n_full, n_tiles, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, LAST_MASKED: gl.constexpr,
    kpe_desc=None, HAS_K_PE: gl.constexpr = False, seq_k=0, OWN_KEYS: gl.constexpr = False, appended=None,
    HAS_APPENDED: gl.constexpr = False,
):  # fmt: skip
    """The split kernels' producer (their 4-warp default partition): every key tile into the
    ring (with ``HAS_K_PE`` its last box from ``kpe_desc``, :func:`_copy_key_boxes`). The V of a
    masked tile (``t >= n_full``, and the last tile with ``LAST_MASKED``; with ``OWN_KEYS`` only
    a tile reaching past the request's ``seq_k`` keys, :func:`_cleans_v`) lands on
    ``v_landed``; the producer zeroes its non-finite lanes in shared memory, writes which keys
    had one into ``flags[s]``, then announces it on ``v_ready[s]`` (both consumer warpgroups read
    the cleaned tile: neither writes it). With ``HAS_APPENDED``: :func:`_appended_producer`
    (``appended = (kn_desc, vn_desc, kn_row0, kn_col, vn_col, seq_kn, n_tiles_n)``)."""
    if HAS_APPENDED:
        kn_desc, vn_desc, kn_row0, kn_col, vn_col, seq_kn, n_tiles_n = appended
        _appended_producer(
            k_desc, v_desc, kn_desc, vn_desc, k_ring, v_ring, flags, k_ready, v_ready, v_landed, k_empty,
            v_empty, k_row0, k_col, v_col, n_tiles, seq_k, kn_row0, kn_col, vn_col, n_tiles_n, seq_kn,
            kpe_desc, BLOCK_N, NUM_STAGES, HAS_K_PE,
        )  # fmt: skip
        return
    cleaned = 0
    for t in range(n_tiles):
        if OWN_KEYS:
            masked = _cleans_v(t, seq_k, BLOCK_N)
        elif LAST_MASKED:
            masked = (t >= n_full) | (t == n_tiles - 1)
        else:
            masked = t >= n_full
        cleaned = _load_key_tile(
            k_desc, kpe_desc, v_desc, k_ring, v_ring, flags, k_ready, v_ready, v_landed, k_empty, v_empty,
            k_row0 + t * BLOCK_N, k_col, v_col, t % NUM_STAGES, (t // NUM_STAGES) & 1, masked, cleaned,
            HAS_K_PE,
        )  # fmt: skip


@gluon.jit
def _appended_producer(
    k_desc, v_desc, kn_desc, vn_desc, k_ring, v_ring, flags, k_ready, v_ready, v_landed, k_empty, v_empty,
    k_row0, k_col, v_col, n_tiles, seq_k, kn_row0, kn_col, vn_col, n_tiles_n, seq_kn, kpe_desc,
    BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, HAS_K_PE: gl.constexpr,
):  # fmt: skip
    """The split kernel's producer with appended keys: the ``n_tiles`` key tiles of the request's
    keys (``k_desc``/``v_desc``, with ``HAS_K_PE`` each tile's last box from ``kpe_desc``), then
    the ``n_tiles_n`` tiles of its appended keys (``kn_desc``/``vn_desc``, whole keys) as ring
    tiles ``n_tiles + t``; each range's V cleaned where a tile reaches past that range's keys
    (``seq_k``, ``seq_kn``; :func:`_cleans_v`), as in :func:`_split_producer`."""
    cleaned = 0
    for t in range(n_tiles):
        cleaned = _load_key_tile(
            k_desc, kpe_desc, v_desc, k_ring, v_ring, flags, k_ready, v_ready, v_landed, k_empty, v_empty,
            k_row0 + t * BLOCK_N, k_col, v_col, t % NUM_STAGES, (t // NUM_STAGES) & 1,
            _cleans_v(t, seq_k, BLOCK_N), cleaned, HAS_K_PE,
        )  # fmt: skip
    for t in range(n_tiles_n):
        g = n_tiles + t
        cleaned = _load_key_tile(
            kn_desc, kn_desc, vn_desc, k_ring, v_ring, flags, k_ready, v_ready, v_landed, k_empty, v_empty,
            kn_row0 + t * BLOCK_N, kn_col, vn_col, g % NUM_STAGES, (g // NUM_STAGES) & 1,
            _cleans_v(t, seq_kn, BLOCK_N), cleaned, False,
        )  # fmt: skip


@gluon.jit
def _cleans_v(t, seq_k, BLOCK_N: gl.constexpr):
    """Whether key tile ``t`` of a request of ``seq_k`` keys reaches past them (into another
    request's rows or past the tensor): the split and persistent layouts clean the V of those
    tiles only. A tile of the request's own keys goes to ``P·V`` as it is, so a non-finite V
    lane of a later key of the request reaches the earlier rows of its diagonal tile as
    ``0·NaN``, as in the paged decode kernels; memory no request owns never does."""
    return (t + 1) * BLOCK_N > seq_k


@gluon.jit
def _load_key_tile(
    k_desc, kpe_desc, v_desc, k_ring, v_ring, flags, k_ready, v_ready, v_landed, k_empty, v_empty, row, k_col,
    v_col, s, phase, masked, cleaned, HAS_K_PE: gl.constexpr,
):  # fmt: skip
    """Once ring slot ``s`` is released (its empty barriers' phase ``phase``), the key tile at
    ``row`` into it: K on ``k_ready[s]`` (:func:`_copy_key_boxes`); V on ``v_ready[s]``, or, when
    ``masked``, on ``v_landed`` (its ``cleaned``-th landing), its non-finite lanes zeroed and its
    ``flags[s]`` written (:func:`_clean_v`), then announced on ``v_ready[s]``. Returns the count
    of cleaned tiles."""
    NUM_STAGES: gl.constexpr = v_ring.shape[0]
    NK: gl.constexpr = k_ring.shape[0] // NUM_STAGES
    NV: gl.constexpr = v_ring.shape[2] // BOX
    mbarrier.wait(k_empty.index(s), phase)
    _copy_key_boxes(k_desc, kpe_desc, row, k_col, k_ready.index(s), k_ring, s * NK, NK, HAS_K_PE)
    mbarrier.wait(v_empty.index(s), phase)
    if masked:
        _copy_boxes(v_desc, row, v_col, v_landed, v_ring.index(s), 0, NV, True)
        mbarrier.wait(v_landed, cleaned & 1)
        _clean_v(v_ring.index(s), flags.index(s), v_ring.shape[1])
        mbarrier.arrive(v_ready.index(s))
        cleaned += 1
    else:
        _copy_boxes(v_desc, row, v_col, v_ready.index(s), v_ring.index(s), 0, NV, True)
    return cleaned


@gluon.jit
def _clean_v(v_slot, flag_slot, BLOCK_N: gl.constexpr):
    """Zero the non-finite lanes of a V tile in shared memory, 16 keys at a time, and write 1.0
    into ``flag_slot[n]`` for each key ``n`` that had one (0.0 otherwise); by the 4 producer warps."""
    CH: gl.constexpr = 16
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [SPLIT_PRODUCER_WARPS, 1], [1, 0])
    for r in gl.static_range(BLOCK_N // CH):
        chunk = v_slot.slice(r * CH, CH, dim=0)
        v = chunk.load(ld).to(gl.float32)
        finite = (v - v) == 0.0
        chunk.store(gl.where(finite, v, 0.0).to(v_slot.dtype))
        flag_slot.slice(r * CH, CH, dim=0).store(gl.max(gl.where(finite, 0.0, 1.0), axis=1))
    fence_async_shared()
    gl.thread_barrier()


@gluon.constexpr_function
def _mma_layout(warps, cols):
    """The accumulator layout of a consumer's ``[16·warps, cols]`` wgmma (scores or output)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, cols, 16])


@gluon.jit
def _softmax_step(sc, m_i, key_bad, row_last, t, qk_scale, MASKED: gl.constexpr, BLOCK_N: gl.constexpr):
    """The online-softmax step of score tile ``t`` (``sc``, raw scores; exp2 domain): ``(p,
    alpha, m_new, row_bad)``. ``MASKED``: key ``n`` counts for row ``r`` only when ``n <=
    row_last[r]``, and ``row_bad`` marks the rows that see a key with a non-finite V lane
    (``key_bad``); unmasked, ``row_bad`` is 0."""
    if MASKED:
        keys = t * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, sc.type.layout))
        seen = keys[None, :] <= row_last[:, None]
        sc = gl.where(seen, sc, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(sc, axis=1) * qk_scale)
        # rows that have seen no key yet keep m = -inf: subtract 0 so exp2 gives 0, not NaN
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(sc * qk_scale - m_safe[:, None])
        alpha = gl.exp2(m_i - m_safe)
        row_bad = gl.max(gl.where(seen, key_bad[None, :], 0.0), axis=1)
    else:
        m_new = gl.maximum(m_i, gl.max(sc, axis=1) * qk_scale)
        p = gl.exp2(sc * qk_scale - m_new[:, None])
        alpha = gl.exp2(m_i - m_new)
        row_bad = gl.zeros_like(m_new)
    return p, alpha, m_new, row_bad


@gluon.jit
def _release(bar):
    """Every consumer thread is done with a ring slot (its ``wgmma`` reads waited for): one
    arrival on the slot's ``empty`` barrier."""
    gl.thread_barrier()
    mbarrier.arrive(bar)


@gluon.jit
def _release_scores(k_empty, g, NUM_STAGES: gl.constexpr, q_release=None):
    """The ring's ``g``-th ``QKᵀ`` was waited for: its K slot released (:func:`_release`) and,
    with ``q_release = (q_empty, g_last)`` when ``g`` is ``g_last`` (the warpgroup's last
    ``QKᵀ`` of the query tile, its last read of the query buffer), one arrival on ``q_empty``, so
    a persistent program's producer loads the next query tile while this one's last softmax,
    ``P·V`` and epilogue run. ``None``: the K slot only (the buffer holds one query tile for
    the program's life)."""
    _release(k_empty.index(g % NUM_STAGES))
    if q_release is not None:
        q_empty, g_last = q_release
        mbarrier.arrive(q_empty, pred=g == g_last)


@gluon.jit
def _issue_scores(q_smem, k_ring, k_ready, g, W: gl.constexpr, M: gl.constexpr, NUM_STAGES: gl.constexpr,
                  S_LAYOUT: gl.constexpr, sc=None, q_reg=None):  # fmt: skip
    """Once the ring's ``g``-th K tile has landed (slot ``g % NUM_STAGES``, a box a slot of
    ``k_ring`` per box of ``q_smem``), issue ``S = q·Kᵀ`` for the query rows ``[W·M, (W+1)·M)``
    of the tile (asynchronous). ``sc``: a ``[M, BLOCK_N]`` fp32 tensor in ``S_LAYOUT`` the
    products overwrite (the tile before's scores: no second set of registers for a zero
    accumulator); ``None``, a zero one. ``q_reg``: the last query box in registers
    (:func:`_query_rope_regs`), its step's A operand; ``None``, every box from ``q_smem``. Every
    prefill consumer's ``QKᵀ``, bf16 or fp8."""
    s = g % NUM_STAGES
    mbarrier.wait(k_ready.index(s), (g // NUM_STAGES) & 1)
    if sc is None:
        BLOCK_N: gl.constexpr = k_ring.shape[1]
        sc = gl.zeros([M, BLOCK_N], gl.float32, layout=S_LAYOUT)
    NQ: gl.constexpr = q_smem.shape[0]
    FROM_SMEM: gl.constexpr = NQ if q_reg is None else NQ - 1
    for c in gl.static_range(FROM_SMEM):
        k_box = k_ring.index(s * NQ + c).permute((1, 0))
        sc = warpgroup_mma(_query_box(q_smem, c, W, M), k_box, sc, use_acc=c > 0, is_async=True)
    if q_reg is not None:
        sc = warpgroup_mma(q_reg, k_ring.index(s * NQ + NQ - 1).permute((1, 0)), sc, is_async=True)
    return sc


@gluon.jit
def _query_box(q_smem, c, W: gl.constexpr, M: gl.constexpr):
    """Box ``c`` of the query tile, the rows ``[W·M, (W+1)·M)`` of it when the tile has more."""
    return q_smem.index(c) if q_smem.shape[1] == M else q_smem.index(c).slice(W * M, M, dim=0)


@gluon.jit
def _query_rope_regs(q_smem, W: gl.constexpr, M: gl.constexpr, S_LAYOUT: gl.constexpr):
    """The last box of the warpgroup's query rows (the rope lanes at 192/128) in registers, as
    the ``q_reg`` A operand of :func:`_issue_scores`."""
    box = _query_box(q_smem, q_smem.shape[0] - 1, W, M)
    return box.load(gl.DotOperandLayout(operand_index=0, parent=S_LAYOUT, k_width=2))
