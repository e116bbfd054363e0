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
  counts two arrivals), and the two take turns at the tensor cores (two ``turns`` barriers):
  a warpgroup issues a tile's ``P·V`` and the next tile's ``QKᵀ`` in its turn, then hands the
  turn to the other, so one's softmax runs while the other's ``wgmma`` does (FlashAttention-3's
  ping-pong schedule). In the 8-warp consumer both warpgroups meet at a barrier at each
  release. ``3`` (overlap, :mod:`.prefill_overlap`): the split layout, each consumer pipelined.
* **Consumer.** ``S = q·Kᵀ``, ``O += P·V`` by ``warpgroup_mma`` (q, K from shared memory; ``P``,
  and in the split and persistent layouts q's last 64 columns, from registers; not in the
  persistent one with appended keys), the online softmax in fp32 in the exp2 domain (scale·log2 e
  folded into one multiply), normalisation deferred to the epilogue. In ``MODE`` 1 and 2 the
  unmasked key tiles are software-pipelined within the warpgroup (:mod:`.prefill_pipelined`).
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
  arrives on ``v_ready``), so neither consumer warpgroup writes a tile the other reads. The
  split layout (``MODE == 2``) and the persistent one clean only the tiles that reach past the
  request's keys (``_cleans_v``): a later key of the row's own request in its diagonal tile may
  reach it as ``0·NaN`` (a row that sees no key then too), as in the paged decode kernels, while
  memory no request owns never does; the other layouts clean every masked tile. A row that
  sees no key gets ``out = 0`` and ``lse = -inf``.
* **Chunked-context form** (``HAS_K_PE``, ``HAS_PRIOR``; the split layout here and the
  persistent one of :mod:`.prefill_persistent`). The keys' last ``BOX`` lanes come from
  ``kpe_desc`` (``k_pe [Tk, 64]``, shared by every head) as each key tile's last box, so no
  whole key tensor is assembled; the rows are merged by LSE into a prior state
  (``prior_out``/``prior_lse``, possibly ``out``/``lse`` themselves) in the epilogue, a prior
  row of ``lse = -inf`` weighing nothing. ``HAS_APPENDED`` (the split layout here, and the
  persistent one): after its own keys, which every row then sees whole, each request's appended
  keys (``kn_desc``/``vn_desc``, rows from ``cu_seqlens_kn``; the new tokens' own keys) go
  through the same ring, masked by ``CAUSAL`` over the appended range alone: a context chunk
  and the new tokens in one pass.

The grid is flat, the query tile index fastest and reversed: the programs of one
(request, head) run together (its K/V stays in L2) and the heaviest causal tiles start first.
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
from mla.providers.gluon.prefill_overlap import overlap_consumer
from mla.providers.gluon.prefill_parts import (
    BLOCK_M,
    BOX,
    CONSUMER_WARPS,
    FLAGS_LAYOUT,
    PRODUCER_REGS,
    PRODUCER_WARPS,
    SPLIT_CONSUMER_REGS,
    SPLIT_PRODUCER_WARPS,
    TILE_LAYOUT,
    _cleans_v,
    _consumer_prologue,
    _consumer_rows,
    _copy_boxes,
    _hand_turn,
    _issue_ahead,
    _issue_kv,
    _issue_scores,
    _key_range,
    _mma_layout,
    _query_rope_regs,
    _query_tile,
    _release,
    _release_scores,
    _row_last,
    _softmax_step,
    _split_producer,
    _take_turn,
)
from mla.providers.gluon.prefill_pipelined import _attend_pipelined
from mla.providers.triton.launch_cache import LaunchCache


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
    q_smem, k_ring, v_ring, flags, k_ready, v_ready, k_empty, v_empty, acc, m_i, l_i, t, g, row_last,
    qk_scale, MASKED: gl.constexpr, BLOCK_N: gl.constexpr, D_V: gl.constexpr, NUM_STAGES: gl.constexpr,
    S_LAYOUT: gl.constexpr, O_LAYOUT: gl.constexpr, W: gl.constexpr, M: gl.constexpr,
    FLAGS: gl.constexpr, seq_k=0, turn=None, PINGPONG: gl.constexpr = False, q_release=None, q_reg=None,
):  # fmt: skip
    """Online softmax of key tile ``t`` (the ring's ``g``-th tile: slot ``g % NUM_STAGES``; ``g``
    counts on across a persistent program's query tiles, else ``g = t``) into ``(acc, m_i, l_i)``
    for the query rows ``[W·M, (W+1)·M)`` of the tile; ``MASKED``: key ``n`` counts for row ``r``
    only when ``n <= row_last[r]``. In a masked tile the V tile's non-finite lanes are zeroed
    here, or (``FLAGS``) were zeroed by the producer, which wrote which keys had one in
    ``flags[s]``, when the tile reaches past the request's ``seq_k`` keys
    (:func:`.prefill_parts._cleans_v`; its flags are read then only). ``PINGPONG``: the two
    consumer warpgroups take turns at the tensor cores (``turn = (mine, other, base)``,
    :func:`.prefill_parts._take_turn`): this one issues its ``P·V`` and the next tile's ``QKᵀ``
    in its turn, then hands the turn over, so its softmax runs while the other's products do.
    ``q_release``: as :func:`.prefill_parts._release_scores`."""
    s = g % NUM_STAGES
    phase = (g // NUM_STAGES) & 1
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=2)
    o_rows: gl.constexpr = gl.SliceLayout(1, O_LAYOUT)
    keys_layout: gl.constexpr = gl.SliceLayout(0, S_LAYOUT)
    sc = _issue_scores(q_smem, k_ring, k_ready, g, W, M, NUM_STAGES, S_LAYOUT, None, q_reg)
    if PINGPONG:
        _hand_turn(turn)
    if MASKED:
        # (while QKᵀ runs) the tile's V, its non-finite lanes zeroed
        mbarrier.wait(v_ready.index(s), phase)
        if FLAGS:
            key_bad = gl.where(_cleans_v(t, seq_k, BLOCK_N), flags.index(s).load(keys_layout), 0.0)
        else:
            key_bad = _sanitize_v(v_ring.index(s), BLOCK_N, D_V, keys_layout)
    sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc,))
    _release_scores(k_empty, g, NUM_STAGES, q_release)
    if not MASKED:
        key_bad = m_i  # (unread)
    p, alpha, m_new, row_bad = _softmax_step(sc, m_i, key_bad, row_last, t, qk_scale, MASKED, BLOCK_N)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
    if MASKED:
        acc = acc + gl.convert_layout(gl.where(row_bad > 0.0, float("nan"), 0.0), o_rows)[:, None]
    else:
        mbarrier.wait(v_ready.index(s), phase)
    p16 = gl.convert_layout(p.to(q_smem.dtype), p_layout)
    if PINGPONG:
        _take_turn(turn, g)
    acc = warpgroup_mma(p16, v_ring.index(s), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    _release(v_empty.index(s))
    return acc, m_new, l_i


@gluon.jit
def _attend_range(
    tiles, ring, acc, m_i, l_i, n_full, n_tiles, g0, row_last, seq_k, qk_scale, ISSUE_LOADS: gl.constexpr,
    BLOCK_N: gl.constexpr, D_V: gl.constexpr, NUM_STAGES: gl.constexpr, S_LAYOUT: gl.constexpr,
    O_LAYOUT: gl.constexpr, W: gl.constexpr, M: gl.constexpr, FLAGS: gl.constexpr, turn=None,
    PINGPONG: gl.constexpr = False, q_release=None, q_reg=None,
):  # fmt: skip
    """The key tiles ``[0, n_tiles)`` of one key range of ``seq_k`` keys (the ring's tiles ``g0 +
    t``) into ``(acc, m_i, l_i)``: those every row sees whole (``[0, n_full)``) unmasked, then
    the diagonal and partial ones masked by ``row_last`` (:func:`_attend_tile`). ``tiles``: the
    query tile, the rings, flags and barriers; ``ring``: the loads' operands when the consumer
    issues them itself (``ISSUE_LOADS``, :func:`.prefill_parts._issue_ahead`); ``q_release``: as
    :func:`.prefill_parts._release_scores`."""
    q_smem, k_ring, v_ring, flags, k_ready, v_ready, k_empty, v_empty = tiles
    if not ISSUE_LOADS:  # noqa: SIM102 (ISSUE_LOADS is a constexpr: this if is resolved at compile time)
        if n_full > 0:
            acc, m_i, l_i = _attend_pipelined(
                tiles, acc, m_i, l_i, n_full, g0, row_last, qk_scale, BLOCK_N, NUM_STAGES, S_LAYOUT, O_LAYOUT,
                W, M, turn, PINGPONG, q_release, q_reg,
            )  # fmt: skip
    for masked in gl.static_range(0 if ISSUE_LOADS else 1, 2):
        first = n_full if masked else 0
        last = n_tiles if masked else n_full
        for t in range(first, last):
            _issue_ahead(ring, t, n_tiles, ISSUE_LOADS, BLOCK_N, NUM_STAGES)
            acc, m_i, l_i = _attend_tile(
                q_smem, k_ring, v_ring, flags, k_ready, v_ready, k_empty, v_empty, acc, m_i, l_i, t, g0 + t,
                row_last, qk_scale, masked == 1, BLOCK_N, D_V, NUM_STAGES, S_LAYOUT, O_LAYOUT, W, M, FLAGS,
                seq_k, turn, PINGPONG, q_release, q_reg,
            )  # fmt: skip
    return acc, m_i, l_i


@gluon.jit
def _attend_appended(
    tiles, ring, acc, m_i, l_i, rows, appended, g0, qk_scale, BLOCK_N: gl.constexpr, D_V: gl.constexpr,
    NUM_STAGES: gl.constexpr, S_LAYOUT: gl.constexpr, O_LAYOUT: gl.constexpr, W: gl.constexpr,
    M: gl.constexpr, FLAGS: gl.constexpr, turn=None, PINGPONG: gl.constexpr = False, q_release=None,
):  # fmt: skip
    """The appended keys' tiles (the ring's tiles ``g0 + t``, after the request's own) into
    ``(acc, m_i, l_i)``, masked by the causal rule over the appended range alone: ``appended =
    (seq_kn, shift_n, n_full_n, n_tiles_n)`` as :func:`.prefill_parts._key_range` gives them for
    it. The producer issues their loads."""
    seq_kn, shift_n, n_full_n, n_tiles_n = appended
    return _attend_range(
        tiles, ring, acc, m_i, l_i, n_full_n, n_tiles_n, g0, _row_last(rows, shift_n, seq_kn), seq_kn,
        qk_scale, False, BLOCK_N, D_V, NUM_STAGES, S_LAYOUT, O_LAYOUT, W, M, FLAGS, turn, PINGPONG, q_release,
    )  # fmt: skip


@gluon.jit
def _consumer(
    args, BLOCK_N: gl.constexpr, D_V: gl.constexpr, NUM_STAGES: gl.constexpr, WRITE_LSE: gl.constexpr,
    ISSUE_LOADS: gl.constexpr, W: gl.constexpr, WARPS: gl.constexpr, prior=None,
    HAS_PRIOR: gl.constexpr = False, VEC_STORE: gl.constexpr = False, appended=None,
    HAS_APPENDED: gl.constexpr = False, turns=None, PINGPONG: gl.constexpr = False,
):  # fmt: skip
    """A consumer partition of ``WARPS`` warps (8: both warpgroups, the whole query tile; 4: one
    warpgroup, query rows ``[64·W, 64·(W+1))`` of the split kernel): every key tile of the
    query tile (with ``HAS_APPENDED`` then those of the appended keys, ``appended = (seq_kn,
    shift_n, n_full_n, n_tiles_n)`` as :func:`.prefill_parts._key_range` gives them, the ring's
    tiles ``n_tiles + t``), then its output rows of the request (and their LSE; with
    ``HAS_PRIOR`` merged into the ``prior`` state, :func:`.prefill_epilogue._store_rows`).
    ``ISSUE_LOADS``: no producer partition, the consumer keeps ``NUM_STAGES - 1`` tiles in flight
    itself. ``args``: the kernel's buffers, barriers, query tile and strides (one tuple)."""
    M: gl.constexpr = 16 * WARPS
    FLAGS: gl.constexpr = WARPS == 4
    (
        q_smem, k_ring, v_ring, flags, q_bar, k_ready, v_ready, k_empty, v_empty, k_desc, v_desc, out_ptr,
        lse_ptr, q_begin, m0, seq_q, seq_k, k_row0, k_col, v_col, h, shift, n_full, n_tiles,
        stride_ot, stride_oh, stride_lt, stride_lh, qk_scale,
    ) = args  # fmt: skip
    s_layout: gl.constexpr = _mma_layout(WARPS, BLOCK_N)
    o_layout: gl.constexpr = _mma_layout(WARPS, D_V)
    ring = (k_desc, v_desc, k_ring, v_ring, k_ready, v_ready, k_empty, v_empty, k_row0, k_col, v_col)
    _consumer_prologue(ring, n_tiles, ISSUE_LOADS, BLOCK_N, NUM_STAGES)
    rows, row_last, acc, m_i, l_i = _consumer_rows(q_bar, shift, seq_k, W, M, D_V, s_layout, o_layout)
    tiles = (q_smem, k_ring, v_ring, flags, k_ready, v_ready, k_empty, v_empty)
    turn = None
    if PINGPONG:
        turn = (turns.index(W), turns.index(1 - W), 1)
        _take_turn(turn, -1)
    q_reg = None
    if FLAGS:
        q_reg = _query_rope_regs(q_smem, W, M, s_layout)
    acc, m_i, l_i = _attend_range(
        tiles, ring, acc, m_i, l_i, n_full, n_tiles, 0, row_last, seq_k, qk_scale, ISSUE_LOADS, BLOCK_N, D_V,
        NUM_STAGES, s_layout, o_layout, W, M, FLAGS, turn, PINGPONG, None, q_reg,
    )  # fmt: skip
    if HAS_APPENDED:
        acc, m_i, l_i = _attend_appended(
            tiles, ring, acc, m_i, l_i, rows, appended, n_tiles, qk_scale, BLOCK_N, D_V, NUM_STAGES, s_layout,
            o_layout, W, M, FLAGS, turn, PINGPONG,
        )  # fmt: skip
    if PINGPONG:
        _hand_turn(turn)
    _store_rows(
        acc, m_i, l_i, rows, out_ptr, lse_ptr, q_begin, m0, seq_q, h, stride_ot, stride_oh, stride_lt,
        stride_lh, W, M, D_V, WRITE_LSE, o_layout, prior, HAS_PRIOR, VEC_STORE,
    )  # fmt: skip


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
    MODE: gl.constexpr,
    HAS_K_PE: gl.constexpr,
    HAS_PRIOR: gl.constexpr,
    VEC_STORE: gl.constexpr,
    HAS_APPENDED: gl.constexpr,
    num_warps: gl.constexpr,
):
    # MODE 0: plain (8 consumer warps issue the loads); 1: a one-warp TMA producer partition and
    # the 8 consumer warps; 2 (split): the launch's 4 warps are the producer (TMA and the V
    # clean-up of masked tiles), each consumer warpgroup a partition of its own. The
    # chunked-context form (HAS_K_PE: each key tile's last box from kpe_desc, the rope lanes
    # every head shares; HAS_PRIOR: the rows merged into a prior state; HAS_APPENDED: each
    # request's appended keys, kn_desc/vn_desc rows from cu_seqlens_kn, after its own keys, which
    # every row then sees whole) is the split layout's.
    gl.static_assert(num_warps == (SPLIT_PRODUCER_WARPS if MODE >= 2 else CONSUMER_WARPS), "launch warps")
    gl.static_assert(
        MODE == 2 or not (HAS_K_PE or HAS_PRIOR or HAS_APPENDED), "the chunked-context form: split layout"
    )
    gl.static_assert(NUM_STAGES >= 2, "a ring of two or more slots")
    dtype: gl.constexpr = q_desc.dtype

    # -- the query tile of this program --------------------------------------------------------
    b, h, q_begin, seq_q, m0 = _query_tile(cu_seqlens_q_ptr, num_heads, num_m_blocks, num_q_rows)
    if m0 >= seq_q:
        return
    OWN_CAUSAL: gl.constexpr = CAUSAL and not HAS_APPENDED
    k_begin, seq_k, shift, n_full, n_tiles = _key_range(
        cu_seqlens_k_ptr, b, num_k_rows, seq_q, m0, OWN_CAUSAL, BLOCK_N
    )

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
    RELEASES: gl.constexpr = 2 if MODE >= 2 else 1
    # (split layout) the consumer warpgroups' turns at the tensor cores; warpgroup 0 starts with
    # the turn
    turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    mbarrier.init(v_landed, count=1)
    for i in gl.static_range(2):
        mbarrier.init(turns.index(i), count=1)
    mbarrier.arrive(turns.index(0))
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
    if MODE == 3:
        # each consumer warpgroup's P tile (the operand of its P·V)
        p_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M // 2, BLOCK_N], TILE_LAYOUT)
        gl.warp_specialize(
            [
                (
                    _split_producer,
                    (
                        k_desc, v_desc, k_ring, v_ring, flags, k_ready, v_ready, v_landed, k_empty, v_empty,
                        k_begin, k_col, v_col, n_full, n_tiles, BLOCK_N, NUM_STAGES, True,
                    ),
                ),
                (overlap_consumer, (consumer_args, p_smem, BLOCK_N, D_V, NUM_STAGES, WRITE_LSE, 0)),
                (overlap_consumer, (consumer_args, p_smem, BLOCK_N, D_V, NUM_STAGES, WRITE_LSE, 1)),
            ],
            [4, 4],
            [SPLIT_CONSUMER_REGS, SPLIT_CONSUMER_REGS],
        )  # fmt: skip
    elif MODE == 2:
        prior = (prior_out_ptr, prior_lse_ptr, stride_pot, stride_poh, stride_plt, stride_plh)
        if HAS_APPENDED:
            kn_begin, seq_kn, shift_n, n_full_n, n_tiles_n = _key_range(
                cu_seqlens_kn_ptr, b, num_kn_rows, seq_q, m0, CAUSAL, BLOCK_N
            )
            appended = (seq_kn, shift_n, n_full_n, n_tiles_n)
            loads_n = (kn_desc, vn_desc, kn_begin, h * stride_knh, h * stride_vnh, seq_kn, n_tiles_n)
        else:  # (placeholders, unread without HAS_APPENDED)
            appended = (seq_k, shift, n_full, n_tiles)
            loads_n = (k_desc, v_desc, k_begin, k_col, v_col, seq_k, n_tiles)
        gl.warp_specialize(
            [
                (
                    _split_producer,
                    (
                        k_desc, v_desc, k_ring, v_ring, flags, k_ready, v_ready, v_landed, k_empty, v_empty,
                        k_begin, k_col, v_col, n_full, n_tiles, BLOCK_N, NUM_STAGES, False, kpe_desc,
                        HAS_K_PE, seq_k, True, loads_n, HAS_APPENDED,
                    ),
                ),
                (
                    _consumer,
                    (
                        consumer_args, BLOCK_N, D_V, NUM_STAGES, WRITE_LSE, False, 0, 4, prior, HAS_PRIOR,
                        VEC_STORE, appended, HAS_APPENDED, turns, True,
                    ),
                ),
                (
                    _consumer,
                    (
                        consumer_args, BLOCK_N, D_V, NUM_STAGES, WRITE_LSE, False, 1, 4, prior, HAS_PRIOR,
                        VEC_STORE, appended, HAS_APPENDED, turns, True,
                    ),
                ),
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


PREFILL_LAUNCH = LaunchCache(mla_prefill_kernel)
"""``mla_prefill_kernel[grid](...)`` through the cached launch (:mod:`mla.providers.triton.launch_cache`)."""


__all__ = [
    "BLOCK_M",
    "BOX",
    "CONSUMER_WARPS",
    "PREFILL_LAUNCH",
    "SPLIT_PRODUCER_WARPS",
    "TILE_LAYOUT",
    "mla_prefill_kernel",
]
