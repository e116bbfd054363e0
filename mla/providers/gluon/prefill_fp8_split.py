# mypy: disable-error-code="no-untyped-def, untyped-decorator"
"""The split warp layout of the Gluon fp8 prefill (``PrefillKernel.SPLIT``, ``MODE 2`` of
:func:`~mla.providers.gluon.prefill_fp8.mla_fp8_prefill_kernel`), as FA3's fp8 kernel splits it.

* **Producer** (the launch's 4 warps, the default partition; ``setmaxnreg`` leaves it what the
  consumers do not take: 56 registers): at step ``t`` it issues the TMA loads of key tile ``t``
  (K into the K ring slot ``t % NUM_STAGES`` on ``k_ready``; V into a landing slot ``t %
  V_LANDING`` on ``v_landed``), then transposes the V tile before it from its landing slot into
  the ``[Dv, keys]`` V^T ring slot (keys contiguous: the K-major B operand of the fp8 ``P·V``;
  in the order of :func:`.prefill_fp8_parts._pv_key_order`, in which P needs no shuffle to
  become the operand), 64 value lanes (one TMA box) at a time through registers, fences the
  generic stores against the async proxy, meets its warps at a barrier and arrives on
  ``vt_ready``. In a tile reaching past the request's keys (the bf16 split layouts' rule,
  :func:`.prefill_parts._cleans_v`) it zeroes the non-finite lanes on the way and writes, per
  key, 1.0 into ``flags`` where its value row had one (0.0 otherwise). A diagonal tile of the
  request's own keys goes to ``P·V`` as it is, so a non-finite V lane of a later key reaches the
  earlier rows of that tile as ``0·NaN``, as on the bf16 split layouts; memory no request owns
  never does. (The cleaning transpose runs about 940 instructions a warp against 140; cleaning
  every masked tile made the 16 x 1024 rows 5–14% slower: ``docs/performance.md``, "Kernel
  choices".) The landing slots are the producer's alone: it has read a slot before it issues
  the copy that reuses it, two tiles later.
* **Consumers**: two worker partitions of one warpgroup each (query rows ``[64·W, 64·(W+1))``,
  ``FP8_SPLIT_CONSUMER_REGS`` registers), running ``S = q·Kᵀ`` (fp8 ``wgmma``), the online
  softmax (P in e4m3 scaled by ``2**8``, as in the plain and producer layouts) and ``O += P·V``
  (fp8 ``wgmma``: P from registers, V as the V^T slot read K-major). Each releases its K slot
  once its ``QKᵀ`` is done and its V^T slot once its ``P·V`` is done; ``k_empty`` and
  ``vt_empty`` count two arrivals, so the two warpgroups run out of step (one's softmax can
  overlap the other's ``wgmma``; the bf16 layouts' software-pipelined loop,
  :mod:`.prefill_pipelined`, turns at the tensor cores, and the next tile's ``QKᵀ`` issued
  before this tile's softmax measured no faster here: ``docs/performance.md``, "Kernel
  choices"). No consumer writes shared memory the other
  reads; in a masked tile a consumer reads the slot's flags (of a cleaned tile; 0 otherwise)
  after ``vt_ready`` and before it releases the slot, as the bf16 split kernel does.

Shared memory per ring stage: a K tile, a V^T tile (8-bit) and the stage's flags; plus the
query tile and ``V_LANDING`` V tiles (:func:`~.prefill_fp8_launch.fp8_shared_bytes`): 218 KiB
at 192/128 with 128-key tiles and 4 stages.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from mla.providers.gluon.prefill_epilogue import _store_rows
from mla.providers.gluon.prefill_fp8_parts import (
    FP8_TILE_LAYOUT,
    _fp8_mma_layout,
    _pv_key_order,
    _softmax_step_fp8,
    _vt_layout,
)
from mla.providers.gluon.prefill_launch import SPLIT_V_LANDING
from mla.providers.gluon.prefill_parts import (
    BLOCK_M,
    BOX,
    FLAGS_LAYOUT,
    SPLIT_PRODUCER_WARPS,
    _cleans_v,
    _consumer_rows,
    _copy_boxes,
    _issue_scores,
    _release,
    _release_scores,
)
from mla.providers.gluon.prefill_rounds import _load_query

V_LANDING = gl.constexpr(SPLIT_V_LANDING)
"""V landing slots (the producer issues tile ``t``'s V before it transposes tile ``t - 1``'s;
:func:`~.prefill_fp8_launch.fp8_shared_bytes` counts them)."""
FP8_SPLIT_CONSUMER_REGS = gl.constexpr(224)
"""Registers per consumer thread (``setmaxnreg``); the producer gets what is left (56)."""
CONSUMER_M = gl.constexpr(64)
"""Query rows of a consumer warpgroup."""


@gluon.constexpr_function
def _vt_load_layout(keys, lanes, warps):
    """The producer's register layout of a ``[keys, lanes]`` V box for :func:`_transpose_v_split`:
    4 value lanes of 4 keys a thread, keys ``n, n+1, n+8, n+9`` (which
    :func:`.prefill_fp8_parts._pv_key_order` makes 4 consecutive places): 32-bit loads along
    the lanes and 32-bit stores along the keys of the V^T tile.

    At 128 keys the lanes step keys 2, 4 and 16 and value lanes 4 and 8 (the value lanes 16 and
    32 are register bits): a quarter warp's 8 stores reach 16 banks of the 128-byte-swizzled V^T
    rows, where lanes stepping value lanes 16 reached 8 (Gluon's bank model: one excess access a
    store wavefront against three; the loads spend one either way, key bit 0 being a register
    bit that picks the bank half of a 64-byte row)."""
    assert keys in (64, 128), keys
    assert lanes == 64, lanes
    assert warps == 4, warps  # (the warp bases below split the keys in four)
    if keys == 128:
        regs = [[1, 0], [8, 0], [0, 1], [0, 2], [0, 16], [0, 32]]
        threads = [[2, 0], [4, 0], [0, 4], [0, 8], [16, 0]]
        warp_bases = [[32, 0], [64, 0]]
    else:
        regs = [[1, 0], [8, 0], [0, 1], [0, 2], [0, 32]]
        threads = [[0, 4], [0, 8], [0, 16], [2, 0], [4, 0]]
        warp_bases = [[16, 0], [32, 0]]
    return gl.DistributedLinearLayout(regs, threads, warp_bases, [], [keys, lanes])


@gluon.jit
def _transpose_v_split(
    v_slot, vt_slot, flag_slot, MASKED: gl.constexpr, BLOCK_N: gl.constexpr, D_V: gl.constexpr
):
    """Copy the ``[keys, Dv]`` V tile ``v_slot`` into ``vt_slot`` (``[Dv, keys]``, the keys in
    ``P·V``'s order, :func:`.prefill_fp8_parts._pv_key_order`), by the 4 producer warps, ``BOX``
    value lanes at a time (one TMA box of ``v_slot``, ``BOX`` rows of ``vt_slot``); ``MASKED``:
    zero its non-finite lanes (e4m3fn has no infinity: NaN is ``x & 0x7f == 0x7f``) and write 1.0
    into ``flag_slot[n]`` for each key ``n`` that had one (0.0 otherwise). Then fence (the stores
    before any ``wgmma`` reads them) and meet at a barrier."""
    ld: gl.constexpr = _vt_load_layout(BLOCK_N, BOX, SPLIT_PRODUCER_WARPS)
    key_bad = gl.zeros([BLOCK_N], gl.float32, layout=gl.SliceLayout(1, ld))
    for c in gl.static_range(D_V // BOX):
        v = v_slot.slice(c * BOX, BOX, dim=1).load(ld)
        if MASKED:
            bits = v.to(gl.int8, bitcast=True)
            bad = (bits & 0x7F) == 0x7F
            key_bad = gl.maximum(key_bad, gl.max(gl.where(bad, 1.0, 0.0), axis=1))
            v = gl.where(bad, 0, bits).to(v.dtype, bitcast=True)
        vt_slot.slice(c * BOX, BOX, dim=0).store(_pv_key_order(gl.permute(v, (1, 0))))
    if MASKED:
        flag_slot.store(key_bad)
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _issue_key_tile(
    k_desc, v_desc, k_ring, v_land, k_ready, k_empty, v_landed, g, row, k_col, v_col, NUM_STAGES: gl.constexpr
):  # fmt: skip
    """The producer's TMA loads of the ring's ``g``-th key tile (keys from row ``row``): K into
    ring slot ``g % NUM_STAGES`` once both consumers released it (``k_empty``), landing on
    ``k_ready``; V into landing slot ``g % V_LANDING``, landing on ``v_landed`` (the slot was
    last read by the producer's own transpose of ring tile ``g - V_LANDING``, done)."""
    NK: gl.constexpr = k_ring.shape[0] // NUM_STAGES
    NV: gl.constexpr = v_land.shape[2] // BOX
    s = g % NUM_STAGES
    mbarrier.wait(k_empty.index(s), (g // NUM_STAGES) & 1)
    _copy_boxes(k_desc, row, k_col, k_ready.index(s), k_ring, s * NK, NK, False)
    lv = g % V_LANDING
    _copy_boxes(v_desc, row, v_col, v_landed.index(lv), v_land.index(lv), 0, NV, True)


@gluon.jit
def _transpose_key_tile(
    v_land, vt_ring, flags, v_landed, vt_ready, vt_empty, u, masked, BLOCK_N: gl.constexpr,
    NUM_STAGES: gl.constexpr,
):  # fmt: skip
    """The producer's transpose of the ring's ``u``-th V tile, once it has landed and its V^T
    slot is free, announced on ``vt_ready`` (``masked``: a tile reaching past the request's
    keys, :func:`_transpose_v_split` with ``MASKED``)."""
    D_V: gl.constexpr = v_land.shape[2]
    s = u % NUM_STAGES
    mbarrier.wait(v_landed.index(u % V_LANDING), (u // V_LANDING) & 1)
    mbarrier.wait(vt_empty.index(s), (u // NUM_STAGES) & 1)
    v_slot = v_land.index(u % V_LANDING)
    if masked:
        _transpose_v_split(v_slot, vt_ring.index(s), flags.index(s), True, BLOCK_N, D_V)
    else:
        _transpose_v_split(v_slot, vt_ring.index(s), flags.index(s), False, BLOCK_N, D_V)
    mbarrier.arrive(vt_ready.index(s))


@gluon.jit
def _produce_key_tiles(
    k_desc, v_desc, k_ring, v_land, vt_ring, flags, k_ready, k_empty, v_landed, vt_ready, vt_empty, g0,
    k_row0, k_col, v_col, seq_k, n_tiles, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, query=None,
):  # fmt: skip
    """The producer's work for one query tile: at step ``t`` K and V of key tile ``t`` (ring tile
    ``g0 + t``) into their slots, then V of key tile ``t - 1`` transposed into its V^T ring slot
    (cleaned where it reaches past the request's ``seq_k`` keys, :func:`.prefill_parts._cleans_v`),
    the last one included before it returns. ``query``: the arguments of
    :func:`.prefill_parts._load_query`, the persistent layout's query tile, loaded after the
    first key tile's loads are issued (at once when there is none)."""
    for t in range(n_tiles + 1):
        if t < n_tiles:
            _issue_key_tile(
                k_desc, v_desc, k_ring, v_land, k_ready, k_empty, v_landed, g0 + t, k_row0 + t * BLOCK_N,
                k_col, v_col, NUM_STAGES,
            )  # fmt: skip
        if t > 0:
            _transpose_key_tile(
                v_land, vt_ring, flags, v_landed, vt_ready, vt_empty, g0 + t - 1,
                _cleans_v(t - 1, seq_k, BLOCK_N), BLOCK_N, NUM_STAGES,
            )  # fmt: skip
        if query is not None:  # noqa: SIM102 (a compile-time test around a run-time one)
            if t == 0:
                q_desc, q_begin, m0, h, stride_qh, q_bar, q_smem, q_empty, done = query
                _load_query(q_desc, q_begin, m0, h, stride_qh, q_bar, q_smem, q_empty, done)


@gluon.jit
def _fp8_split_producer(
    k_desc, v_desc, k_ring, v_land, vt_ring, flags, k_ready, k_empty, v_landed, vt_ready, vt_empty, k_row0,
    k_col, v_col, seq_k, n_tiles, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
):  # fmt: skip
    """The producer partition (see the module docstring): the query tile's key tiles
    (:func:`_produce_key_tiles`)."""
    # The partition reads its arguments before anything of it writes shared memory.
    gl.thread_barrier()
    _produce_key_tiles(
        k_desc, v_desc, k_ring, v_land, vt_ring, flags, k_ready, k_empty, v_landed, vt_ready, vt_empty, 0,
        k_row0, k_col, v_col, seq_k, n_tiles, BLOCK_N, NUM_STAGES,
    )  # fmt: skip


@gluon.jit
def _fp8_split_tile(
    q_smem, k_ring, vt_ring, flags, k_ready, k_empty, vt_ready, vt_empty, acc, m_i, l_i, g, t, row_last,
    seq_k, qk_scale, MASKED: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
    S_LAYOUT: gl.constexpr, O_LAYOUT: gl.constexpr, W: gl.constexpr, q_release=None,
):  # fmt: skip
    """Online softmax of key tile ``t`` (the ring's ``g``-th) into ``(acc, m_i, l_i)`` for the
    query rows ``[64·W, 64·(W+1))``; ``MASKED``: key ``n`` counts for row ``r`` only when ``n <=
    row_last[r]``, and the rows that see a key whose value row had a non-finite lane (``flags``)
    get NaN (flags of the tiles the producer cleans: those reaching past the request's ``seq_k``
    keys). ``q_release``: as in :func:`.prefill_parts._release_scores`."""
    s = g % NUM_STAGES
    phase = (g // NUM_STAGES) & 1
    M: gl.constexpr = CONSUMER_M
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=4)
    o_rows: gl.constexpr = gl.SliceLayout(1, O_LAYOUT)
    keys_layout: gl.constexpr = gl.SliceLayout(0, S_LAYOUT)
    sc = _issue_scores(q_smem, k_ring, k_ready, g, W, M, NUM_STAGES, S_LAYOUT)
    sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc,))
    _release_scores(k_empty, g, NUM_STAGES, q_release)
    if MASKED:
        # the transposed V tile, and which of its keys had a non-finite value lane
        mbarrier.wait(vt_ready.index(s), phase)
        key_bad = gl.where(_cleans_v(t, seq_k, BLOCK_N), flags.index(s).load(keys_layout), 0.0)
    else:
        key_bad = m_i  # (unread)
    p, alpha, m_new, row_bad = _softmax_step_fp8(sc, m_i, key_bad, row_last, t, qk_scale, MASKED, BLOCK_N)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
    if MASKED:
        acc = acc + gl.convert_layout(gl.where(row_bad > 0.0, float("nan"), 0.0), o_rows)[:, None]
    else:
        mbarrier.wait(vt_ready.index(s), phase)
    p8 = gl.convert_layout(_pv_key_order(p).to(vt_ring.dtype), p_layout)
    acc = warpgroup_mma(p8, vt_ring.index(s).permute((1, 0)), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    _release(vt_empty.index(s))
    return acc, m_new, l_i


@gluon.jit
def _fp8_attend_tiles(
    q_smem, k_ring, vt_ring, flags, k_ready, k_empty, vt_ready, vt_empty, acc, m_i, l_i, g0, n_full, n_tiles,
    seq_k, row_last, qk_scale, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, S_LAYOUT: gl.constexpr,
    O_LAYOUT: gl.constexpr, W: gl.constexpr, q_release=None,
):  # fmt: skip
    """A consumer warpgroup's key tiles ``0 … n_tiles - 1`` of a query tile (ring tiles ``g0 +
    t``): the ``n_full`` tiles every row sees whole, unmasked, then the diagonal and partial
    ones, masked (:func:`_fp8_split_tile`). Returns ``(acc, m_i, l_i)``."""
    for masked in gl.static_range(2):
        first = n_full if masked else 0
        last = n_tiles if masked else n_full
        for t in range(first, last):
            acc, m_i, l_i = _fp8_split_tile(
                q_smem, k_ring, vt_ring, flags, k_ready, k_empty, vt_ready, vt_empty, acc, m_i, l_i,
                g0 + t, t, row_last, seq_k, qk_scale, masked == 1, BLOCK_N, NUM_STAGES, S_LAYOUT, O_LAYOUT,
                W, q_release,
            )  # fmt: skip
    return acc, m_i, l_i


@gluon.jit
def _fp8_split_consumer(
    args, BLOCK_N: gl.constexpr, D_V: gl.constexpr, NUM_STAGES: gl.constexpr, WRITE_LSE: gl.constexpr,
    W: gl.constexpr,
):  # fmt: skip
    """Consumer warpgroup ``W``: every key tile of the query tile for its 64 rows, then its output
    rows of the request (and their LSE). ``args``: buffers, barriers, tile and strides."""
    (
        q_smem, k_ring, vt_ring, flags, q_bar, k_ready, k_empty, vt_ready, vt_empty, out_ptr, lse_ptr,
        q_begin, m0, seq_q, seq_k, h, shift, n_full, n_tiles, stride_ot, stride_oh, stride_lt, stride_lh,
        qk_scale, v_scale,
    ) = args  # fmt: skip
    M: gl.constexpr = CONSUMER_M
    s_layout: gl.constexpr = _fp8_mma_layout(4, BLOCK_N)
    o_layout: gl.constexpr = _fp8_mma_layout(4, D_V)
    # The partition reads its arguments before anything of it writes shared memory.
    gl.thread_barrier()
    rows, row_last, acc, m_i, l_i = _consumer_rows(q_bar, shift, seq_k, W, M, D_V, s_layout, o_layout)
    acc, m_i, l_i = _fp8_attend_tiles(
        q_smem, k_ring, vt_ring, flags, k_ready, k_empty, vt_ready, vt_empty, acc, m_i, l_i, 0, n_full,
        n_tiles, seq_k, row_last, qk_scale, BLOCK_N, NUM_STAGES, s_layout, o_layout, W,
    )  # fmt: skip
    _store_rows(
        acc * v_scale, m_i, l_i, rows, out_ptr, lse_ptr, q_begin, m0, seq_q, h, stride_ot, stride_oh,
        stride_lt, stride_lh, W, M, D_V, WRITE_LSE, o_layout,
    )  # fmt: skip


@gluon.jit
def _fp8_split_shared(
    dtype: gl.constexpr, D_QK: gl.constexpr, D_V: gl.constexpr, BLOCK_N: gl.constexpr,
    NUM_STAGES: gl.constexpr,
):  # fmt: skip
    """The split layout's shared memory and barriers, initialised, every ring slot free (phase 0
    of its empty barriers): ``(q_smem, k_ring, v_land, vt_ring, flags, q_bar, k_ready, k_empty,
    vt_ready, vt_empty, v_landed)``. The caller fences them before any asynchronous use."""
    NQ: gl.constexpr = D_QK // BOX
    q_smem = gl.allocate_shared_memory(dtype, [NQ, BLOCK_M, BOX], FP8_TILE_LAYOUT)
    k_ring = gl.allocate_shared_memory(dtype, [NUM_STAGES * NQ, BLOCK_N, BOX], FP8_TILE_LAYOUT)
    v_land = gl.allocate_shared_memory(dtype, [V_LANDING, BLOCK_N, D_V], FP8_TILE_LAYOUT)
    vt_ring = gl.allocate_shared_memory(dtype, [NUM_STAGES, D_V, BLOCK_N], _vt_layout(BLOCK_N))
    flags = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, BLOCK_N], FLAGS_LAYOUT)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    vt_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    vt_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_landed = gl.allocate_shared_memory(gl.int64, [V_LANDING, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(V_LANDING):
        mbarrier.init(v_landed.index(i), count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(vt_ready.index(i), count=1)
        # (one release per consumer warpgroup)
        mbarrier.init(k_empty.index(i), count=2)
        mbarrier.init(vt_empty.index(i), count=2)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.arrive(k_empty.index(i), count=2)
        mbarrier.arrive(vt_empty.index(i), count=2)
    return q_smem, k_ring, v_land, vt_ring, flags, q_bar, k_ready, k_empty, vt_ready, vt_empty, v_landed


@gluon.jit
def fp8_split_attention(
    q_desc, k_desc, v_desc, out_ptr, lse_ptr, q_begin, m0, seq_q, seq_k, k_begin, h, shift, n_full, n_tiles,
    stride_qh, stride_kh, stride_vh, stride_ot, stride_oh, stride_lt, stride_lh, qk_scale, v_scale,
    D_QK: gl.constexpr, D_V: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
    WRITE_LSE: gl.constexpr,
):  # fmt: skip
    """The split layout's shared memory, barriers and partitions for one query tile (called by
    the kernel once it has the tile's key range and scales)."""
    NQ: gl.constexpr = D_QK // BOX
    q_smem, k_ring, v_land, vt_ring, flags, q_bar, k_ready, k_empty, vt_ready, vt_empty, v_landed = (
        _fp8_split_shared(q_desc.dtype, D_QK, D_V, BLOCK_N, NUM_STAGES)
    )
    fence_async_shared()

    _copy_boxes(q_desc, q_begin + m0, h * stride_qh, q_bar, q_smem, 0, NQ, False)

    consumer_args = (
        q_smem, k_ring, vt_ring, flags, q_bar, k_ready, k_empty, vt_ready, vt_empty, out_ptr, lse_ptr,
        q_begin, m0, seq_q, seq_k, h, shift, n_full, n_tiles, stride_ot, stride_oh, stride_lt, stride_lh,
        qk_scale, v_scale,
    )  # fmt: skip
    gl.warp_specialize(
        [
            (
                _fp8_split_producer,
                (
                    k_desc, v_desc, k_ring, v_land, vt_ring, flags, k_ready, k_empty, v_landed, vt_ready,
                    vt_empty, k_begin, h * stride_kh, h * stride_vh, seq_k, n_tiles, BLOCK_N, NUM_STAGES,
                ),
            ),
            (_fp8_split_consumer, (consumer_args, BLOCK_N, D_V, NUM_STAGES, WRITE_LSE, 0)),
            (_fp8_split_consumer, (consumer_args, BLOCK_N, D_V, NUM_STAGES, WRITE_LSE, 1)),
        ],
        [4, 4],
        [FP8_SPLIT_CONSUMER_REGS, FP8_SPLIT_CONSUMER_REGS],
    )  # fmt: skip


__all__ = ["FP8_SPLIT_CONSUMER_REGS", "V_LANDING", "fp8_split_attention"]
