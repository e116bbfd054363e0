# mypy: disable-error-code="no-untyped-def, untyped-decorator"
"""Gluon (Hopper) varlen prefill: the ``varlen-prefill`` contract with TMA and ``wgmma``.

One program owns a 128-row query tile of one (request, head): ``BLOCK_M = 128`` rows, the two
warpgroups of the 8-warp consumer partition taking 64 rows each (one ``wgmma`` M of 64 per
warpgroup). q/k head dim ``D_QK`` (192 or 128), v head dim ``D_V`` (128).

* **Loads by TMA.** Each of q, k and v is read through one 2-D descriptor over the flat view
  ``[tokens, (H - 1)·stride_h + D]`` (row stride ``stride_t``): the tile of head ``h`` is the box
  ``[rows, D]`` at column ``h·stride_h``, so any 16-byte-aligned token and head strides work
  (checked by :func:`mla.providers.gluon.prefill_launch.prefill_route`). The query tile lands once;
  K and V tiles of ``BLOCK_N`` keys go through a ``NUM_STAGES`` ring with a ``ready``
  (transaction-count) and an ``empty`` barrier per slot for K and for V apart, so ``QKᵀ`` of a
  tile waits only for its K.
* **Warp split** (``MODE``, :class:`~mla.providers.gluon.prefill_launch.PrefillKernel`):
  ``1`` (the default) a one-warp producer partition issues every load (``gl.warp_specialize``),
  up to ``NUM_STAGES`` tiles ahead of one 8-warp consumer partition; ``0`` (plain) the
  consumers issue the loads themselves, ``NUM_STAGES - 1`` tiles ahead (same ring, same
  barriers, no worker); ``2`` (split) a 4-warp producer (the launch's warps) and each consumer
  warpgroup a partition of its own, 64 query rows each, releasing ring slots apart (``empty``
  counts two arrivals), so the two warpgroups run out of step and one's softmax overlaps the
  other's ``wgmma``. In the 8-warp consumer both warpgroups meet at a barrier at each release.
* **Consumer.** ``S = q·Kᵀ`` and ``O += P·V`` by ``warpgroup_mma`` (q and K from shared memory,
  ``P`` from registers), the online softmax in fp32 in the exp2 domain (``softmax_scale·log2 e``
  folded into one multiply), normalisation deferred to the epilogue.
* **Causal** (bottom-right: row ``i`` of a request sees keys ``<= i + Sk - Sq``). Key tiles that
  every row of the query tile sees run without a mask; only the tiles that straddle the
  diagonal or the end of the request's keys are masked, and tiles no row sees are never
  loaded. Non-causal: only the last, partial key tile is masked.
* **Varlen.** Boxes are addressed from the request's first token, so a box may run into the
  next request's rows (or past the tensor: TMA fills those with zeros). Keys at or past the
  request's key count score ``-inf``; query rows past the request's end are computed and not
  written (the output and LSE stores are masked).
* **NaN rules** (those of the Triton kernel): in a masked tile a value row a query row must not
  see (a later key of its request, or the next request's) is read as 0 (non-finite lanes of
  the V tile are zeroed in shared memory before ``P·V``, so ``0·NaN`` cannot reach the row),
  and a row that does see a non-finite value gets NaN. The 8-warp consumer cleans the tile
  itself; in the split kernel the producer does (V of a masked tile lands on ``v_landed``,
  the producer cleans it, records the keys that had a non-finite lane in ``flags`` and then
  arrives on ``v_ready``), so neither consumer warpgroup writes a tile the other reads. A row
  that sees no key gets ``out = 0`` and ``lse = -inf``.

The grid is flat, the query tile index fastest and reversed: the programs of one
(request, head) run together (its K/V stays in L2) and the heaviest causal tiles start first.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

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
SPLIT_CONSUMER_REGS = gl.constexpr(232)
"""Registers per consumer thread of the split kernel (``setmaxnreg``; 64-row S and O: 128)."""
FLAGS_LAYOUT = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
"""Shared layout of the split kernel's per-key flags."""
BOX = gl.constexpr(64)
"""Columns of a TMA box: 128 bytes, one swizzle row (192 is not a power of two: 3 boxes)."""
LN2 = gl.constexpr(0.6931471805599453)


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
def _copy_boxes(desc, row, col, bar, dst, first, N: gl.constexpr, SLICED: gl.constexpr):
    """TMA the ``[rows, N·BOX]`` tile at ``(row, col)`` as ``N`` boxes of ``BOX`` columns (a TMA
    box and a shared buffer are a power of two wide), all on ``bar``'s transaction count: into
    boxes ``dst[first + c]`` of a box array, or (``SLICED``) into column slices of ``dst``."""
    mbarrier.expect(bar, desc.block_type.nbytes * N)
    for c in gl.static_range(N):
        box = dst.slice(c * BOX, BOX, dim=1) if SLICED else dst.index(first + c)
        tma.async_copy_global_to_shared(desc, [row, col + c * BOX], bar, box)


@gluon.jit
def _producer(
    k_desc, v_desc, k_ring, v_ring, k_ready, v_ready, k_empty, v_empty, k_row0, k_col, v_col, n_tiles,
    BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
):  # fmt: skip
    """The producer partition: every key tile of the query tile, in order, into the ring."""
    for t in range(n_tiles):
        _issue_kv(
            k_desc, v_desc, k_ring, v_ring, k_ready, v_ready, k_empty, v_empty, k_row0, k_col, v_col, t,
            BLOCK_N, NUM_STAGES,
        )  # fmt: skip


@gluon.jit
def _split_producer(
    k_desc, v_desc, k_ring, v_ring, flags, k_ready, v_ready, v_landed, k_empty, v_empty, k_row0, k_col,
    v_col, n_full, n_tiles, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
):  # fmt: skip
    """The split kernel's producer (its 4-warp default partition): every key tile into the ring.
    The V of a masked tile (``t >= n_full``) lands on ``v_landed``; the producer zeroes its
    non-finite lanes in shared memory, writes which keys had one into ``flags[s]``, then
    announces it on ``v_ready[s]`` (both consumer warpgroups read the cleaned tile: neither
    writes it)."""
    NK: gl.constexpr = k_ring.shape[0] // NUM_STAGES
    NV: gl.constexpr = v_ring.shape[2] // BOX
    for t in range(n_tiles):
        s = t % NUM_STAGES
        phase = (t // NUM_STAGES) & 1
        row = k_row0 + t * BLOCK_N
        mbarrier.wait(k_empty.index(s), phase)
        _copy_boxes(k_desc, row, k_col, k_ready.index(s), k_ring, s * NK, NK, False)
        mbarrier.wait(v_empty.index(s), phase)
        if t < n_full:
            _copy_boxes(v_desc, row, v_col, v_ready.index(s), v_ring.index(s), 0, NV, True)
        else:
            _copy_boxes(v_desc, row, v_col, v_landed, v_ring.index(s), 0, NV, True)
            mbarrier.wait(v_landed, (t - n_full) & 1)
            _clean_v(v_ring.index(s), flags.index(s), BLOCK_N)
            mbarrier.arrive(v_ready.index(s))


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


@gluon.jit
def _release(bar):
    """Every consumer thread is done with a ring slot (its ``wgmma`` reads waited for): one
    arrival on the slot's ``empty`` barrier."""
    gl.thread_barrier()
    mbarrier.arrive(bar)


@gluon.jit
def _sanitize_v(v_slot, BLOCK_N: gl.constexpr, D_V: gl.constexpr, KEYS: gl.constexpr):
    """Zero the non-finite lanes of a V tile in shared memory (so that ``0·NaN`` cannot reach a
    row that does not see the key); returns, per key, 1.0 where its value row had one (layout
    ``KEYS``)."""
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [CONSUMER_WARPS, 1], [1, 0])
    v = v_slot.load(ld).to(gl.float32)
    finite = (v - v) == 0.0
    key_bad = gl.max(gl.where(finite, 0.0, 1.0), axis=1)
    v_slot.store(gl.where(finite, v, 0.0).to(v_slot.dtype))
    fence_async_shared()
    gl.thread_barrier()
    return gl.convert_layout(key_bad, KEYS)


@gluon.jit
def _attend_tile(
    q_smem, k_ring, v_ring, flags, k_ready, v_ready, k_empty, v_empty, acc, m_i, l_i, t, row_last, qk_scale,
    MASKED: gl.constexpr, BLOCK_N: gl.constexpr, D_V: gl.constexpr, NUM_STAGES: gl.constexpr,
    S_LAYOUT: gl.constexpr, O_LAYOUT: gl.constexpr, W: gl.constexpr, M: gl.constexpr,
    FLAGS: gl.constexpr,
):  # fmt: skip
    """Online softmax of key tile ``t`` (ring slot ``t % NUM_STAGES``) into ``(acc, m_i, l_i)``
    for the query rows ``[W·M, (W+1)·M)`` of the tile; ``MASKED``: key ``n`` counts for row ``r``
    only when ``n <= row_last[r]``. In a masked tile the V tile's non-finite lanes are zeroed
    here, or (``FLAGS``) were zeroed by the producer, which wrote which keys had one in
    ``flags[s]``."""
    s = t % NUM_STAGES
    phase = (t // NUM_STAGES) & 1
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=2)
    o_rows: gl.constexpr = gl.SliceLayout(1, O_LAYOUT)
    keys_layout: gl.constexpr = gl.SliceLayout(0, S_LAYOUT)
    mbarrier.wait(k_ready.index(s), phase)
    s_zero = gl.zeros([M, BLOCK_N], gl.float32, layout=S_LAYOUT)
    NQ: gl.constexpr = q_smem.shape[0]
    sc = s_zero
    for c in gl.static_range(NQ):
        k_box = k_ring.index(s * NQ + c).permute((1, 0))
        q_box = q_smem.index(c) if M == BLOCK_M else q_smem.index(c).slice(W * M, M, dim=0)
        sc = warpgroup_mma(q_box, k_box, sc, use_acc=c > 0, is_async=True)
    if MASKED:
        # (while QKᵀ runs) the tile's V, its non-finite lanes zeroed
        mbarrier.wait(v_ready.index(s), phase)
        if FLAGS:
            key_bad = flags.index(s).load(keys_layout)
        else:
            key_bad = _sanitize_v(v_ring.index(s), BLOCK_N, D_V, keys_layout)
    sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc,))
    _release(k_empty.index(s))
    if MASKED:
        keys = t * BLOCK_N + gl.arange(0, BLOCK_N, layout=keys_layout)
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
    l_i = l_i * alpha + gl.sum(p, axis=1)
    acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
    if MASKED:
        acc = acc + gl.convert_layout(gl.where(row_bad > 0.0, float("nan"), 0.0), o_rows)[:, None]
    else:
        mbarrier.wait(v_ready.index(s), phase)
    p16 = gl.convert_layout(p.to(q_smem.dtype), p_layout)
    acc = warpgroup_mma(p16, v_ring.index(s), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    _release(v_empty.index(s))
    return acc, m_new, l_i


@gluon.jit
def _consumer(
    args, BLOCK_N: gl.constexpr, D_V: gl.constexpr, NUM_STAGES: gl.constexpr, WRITE_LSE: gl.constexpr,
    ISSUE_LOADS: gl.constexpr, W: gl.constexpr, WARPS: gl.constexpr,
):  # fmt: skip
    """A consumer partition of ``WARPS`` warps (8: both warpgroups, the whole query tile; 4: one
    warpgroup, query rows ``[64·W, 64·(W+1))`` of the split kernel): every key tile of the
    query tile, then its output rows of the request (and their LSE). ``ISSUE_LOADS``: no
    producer partition, the consumer keeps ``NUM_STAGES - 1`` tiles in flight itself. ``args``:
    the kernel's buffers, barriers, query tile and strides (one tuple)."""
    M: gl.constexpr = 16 * WARPS
    FLAGS: gl.constexpr = WARPS == 4
    (
        q_smem, k_ring, v_ring, flags, q_bar, k_ready, v_ready, k_empty, v_empty, k_desc, v_desc, out_ptr,
        lse_ptr, q_begin, m0, seq_q, seq_k, k_row0, k_col, v_col, h, shift, n_full, n_tiles,
        stride_ot, stride_oh, stride_lt, stride_lh, qk_scale,
    ) = args  # fmt: skip
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, BLOCK_N, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, D_V, 16]
    )
    s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    if not ISSUE_LOADS:
        # The partition reads its arguments before anything of it writes shared memory.
        gl.thread_barrier()
    else:
        for t in gl.static_range(NUM_STAGES - 1):
            if t < n_tiles:
                _issue_kv(
                    k_desc, v_desc, k_ring, v_ring, k_ready, v_ready, k_empty, v_empty, k_row0, k_col,
                    v_col, t, BLOCK_N, NUM_STAGES,
                )  # fmt: skip

    rows = W * M + gl.arange(0, M, layout=s_rows)
    row_last = gl.minimum(rows + shift, seq_k - 1)
    acc = gl.zeros([M, D_V], gl.float32, layout=o_layout)
    m_i = gl.full([M], float("-inf"), gl.float32, layout=s_rows)
    l_i = gl.zeros([M], gl.float32, layout=s_rows)
    mbarrier.wait(q_bar, 0)
    for t in range(n_full):
        if ISSUE_LOADS:  # noqa: SIM102 (a constexpr: resolved at compile time)
            if t + NUM_STAGES - 1 < n_tiles:
                _issue_kv(
                    k_desc, v_desc, k_ring, v_ring, k_ready, v_ready, k_empty, v_empty, k_row0, k_col,
                    v_col, t + NUM_STAGES - 1, BLOCK_N, NUM_STAGES,
                )  # fmt: skip
        acc, m_i, l_i = _attend_tile(
            q_smem, k_ring, v_ring, flags, k_ready, v_ready, k_empty, v_empty, acc, m_i, l_i, t, row_last,
            qk_scale, False, BLOCK_N, D_V, NUM_STAGES, s_layout, o_layout, W, M, FLAGS,
        )  # fmt: skip
    for t in range(n_full, n_tiles):
        if ISSUE_LOADS:  # noqa: SIM102 (a constexpr: resolved at compile time)
            if t + NUM_STAGES - 1 < n_tiles:
                _issue_kv(
                    k_desc, v_desc, k_ring, v_ring, k_ready, v_ready, k_empty, v_empty, k_row0, k_col,
                    v_col, t + NUM_STAGES - 1, BLOCK_N, NUM_STAGES,
                )  # fmt: skip
        acc, m_i, l_i = _attend_tile(
            q_smem, k_ring, v_ring, flags, k_ready, v_ready, k_empty, v_empty, acc, m_i, l_i, t, row_last,
            qk_scale, True, BLOCK_N, D_V, NUM_STAGES, s_layout, o_layout, W, M, FLAGS,
        )  # fmt: skip

    # -- epilogue: normalise, write the request's rows ------------------------------------------
    seen = l_i != 0.0  # (a NaN sum, from a key the row sees, stays NaN)
    inv_l = gl.where(seen, 1.0 / gl.where(seen, l_i, 1.0), 0.0)
    o = acc * gl.convert_layout(inv_l, o_rows)[:, None]
    rows_o = m0 + W * M + gl.arange(0, M, layout=o_rows)
    cols = gl.arange(0, D_V, layout=gl.SliceLayout(0, o_layout))
    tok = (q_begin + rows_o).to(gl.int64)
    o_ptrs = out_ptr + tok[:, None] * stride_ot + h.to(gl.int64) * stride_oh + cols[None, :]
    gl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=(rows_o < seq_q)[:, None])
    if WRITE_LSE:
        lse = gl.where(seen, (m_i + gl.log2(gl.where(seen, l_i, 1.0))) * LN2, float("-inf"))
        rows_s = m0 + rows
        tok_s = (q_begin + rows_s).to(gl.int64)
        gl.store(lse_ptr + tok_s * stride_lt + h.to(gl.int64) * stride_lh, lse, mask=rows_s < seq_q)


@gluon.jit
def mla_prefill_kernel(
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
    qk_scale,
    D_QK: gl.constexpr,
    D_V: gl.constexpr,
    BLOCK_N: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    CAUSAL: gl.constexpr,
    WRITE_LSE: gl.constexpr,
    MODE: gl.constexpr,
    num_warps: gl.constexpr,
):
    # MODE 0: plain (8 consumer warps issue the loads); 1: a one-warp TMA producer partition and
    # the 8 consumer warps; 2 (split): the launch's 4 warps are the producer (TMA and the V
    # clean-up of masked tiles), each consumer warpgroup a partition of its own.
    gl.static_assert(num_warps == (SPLIT_PRODUCER_WARPS if MODE == 2 else CONSUMER_WARPS), "launch warps")
    gl.static_assert(NUM_STAGES >= 2, "a ring of two or more slots")
    dtype: gl.constexpr = q_desc.dtype

    # -- the query tile of this program --------------------------------------------------------
    pid = gl.program_id(0)
    m_block = num_m_blocks - 1 - pid % num_m_blocks
    bh = pid // num_m_blocks
    b = bh // num_heads
    h = bh % num_heads
    q_begin = gl.load(cu_seqlens_q_ptr + b)
    seq_q = gl.load(cu_seqlens_q_ptr + b + 1) - q_begin
    m0 = m_block * BLOCK_M
    if m0 >= seq_q:
        return
    k_begin = gl.load(cu_seqlens_k_ptr + b)
    seq_k = gl.load(cu_seqlens_k_ptr + b + 1) - k_begin
    shift, n_full, n_tiles = _tile_range(seq_q, seq_k, m0, CAUSAL, BLOCK_N)

    # -- shared memory and barriers --------------------------------------------------------------
    # q and K tiles as D_QK / BOX boxes of BOX columns (192 is not a power of two).
    NQ: gl.constexpr = D_QK // BOX
    q_smem = gl.allocate_shared_memory(dtype, [NQ, BLOCK_M, BOX], TILE_LAYOUT)
    k_ring = gl.allocate_shared_memory(dtype, [NUM_STAGES * NQ, BLOCK_N, BOX], TILE_LAYOUT)
    v_ring = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, D_V], TILE_LAYOUT)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    # (split kernel) V of a masked tile lands here; the producer cleans it up, then arrives on
    # v_ready; flags[s]: which keys of slot s had a non-finite value lane.
    v_landed = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    flags = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, BLOCK_N], FLAGS_LAYOUT)
    # (one release per consumer partition)
    RELEASES: gl.constexpr = 2 if MODE == 2 else 1
    mbarrier.init(q_bar, count=1)
    mbarrier.init(v_landed, count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=RELEASES)
        mbarrier.init(v_empty.index(i), count=RELEASES)
    # Every ring slot starts free (phase 0 of its empty barriers).
    for i in gl.static_range(NUM_STAGES):
        mbarrier.arrive(k_empty.index(i), count=RELEASES)
        mbarrier.arrive(v_empty.index(i), count=RELEASES)
    # (the initialised barriers before the async proxy's first transaction on them)
    fence_async_shared()

    # The query tile, by TMA (rows past the request are computed and not written).
    _copy_boxes(q_desc, q_begin + m0, h * stride_qh, q_bar, q_smem, 0, NQ, False)

    k_col = h * stride_kh
    v_col = h * stride_vh
    consumer_args = (
        q_smem, k_ring, v_ring, flags, q_bar, k_ready, v_ready, k_empty, v_empty, k_desc, v_desc, out_ptr,
        lse_ptr, q_begin, m0, seq_q, seq_k, k_begin, k_col, v_col, h, shift, n_full, n_tiles,
        stride_ot, stride_oh, stride_lt, stride_lh, qk_scale,
    )  # fmt: skip
    if MODE == 2:
        gl.warp_specialize(
            [
                (
                    _split_producer,
                    (
                        k_desc, v_desc, k_ring, v_ring, flags, k_ready, v_ready, v_landed, k_empty, v_empty,
                        k_begin, k_col, v_col, n_full, n_tiles, BLOCK_N, NUM_STAGES,
                    ),
                ),
                (_consumer, (consumer_args, BLOCK_N, D_V, NUM_STAGES, WRITE_LSE, False, 0, 4)),
                (_consumer, (consumer_args, BLOCK_N, D_V, NUM_STAGES, WRITE_LSE, False, 1, 4)),
            ],
            [4, 4],
            [SPLIT_CONSUMER_REGS, SPLIT_CONSUMER_REGS],
        )  # fmt: skip
    elif MODE == 1:
        gl.warp_specialize(
            [
                (_consumer, (consumer_args, BLOCK_N, D_V, NUM_STAGES, WRITE_LSE, False, 0, CONSUMER_WARPS)),
                (
                    _producer,
                    (
                        k_desc, v_desc, k_ring, v_ring, k_ready, v_ready, k_empty, v_empty, k_begin, k_col,
                        v_col, n_tiles, BLOCK_N, NUM_STAGES,
                    ),
                ),
            ],
            [PRODUCER_WARPS],
            [PRODUCER_REGS],
        )  # fmt: skip
    else:
        _consumer(consumer_args, BLOCK_N, D_V, NUM_STAGES, WRITE_LSE, True, 0, CONSUMER_WARPS)


__all__ = ["BLOCK_M", "CONSUMER_WARPS", "TILE_LAYOUT", "mla_prefill_kernel"]
