# mypy: disable-error-code="no-untyped-def, untyped-decorator"
"""Gluon (Hopper) paged MQA decode kernel for MLA: 64-row q tile, shared-memory KV ring, wgmma.

One kernel serves every decode contract of the provider (paged decode, non-persistent or on a
planned :class:`~mla.providers.split_kv.SplitKVSchedule`, and the small-head decode with one qlen-1
request per row). A program owns one work item (request, KV range ``[lo, hi)``) and
``BLOCK_M = 64`` packed query rows (``row = qi·H + head``; more rows run as several row blocks).

Per program (8 warps = two warpgroups):

* the query tile (``q_nope [64, L]``, ``q_pe [64, R]``) is loaded once into NVMMA-swizzled shared
  memory;
* KV tiles of ``BLOCK_N`` cache rows are gathered by flat token id with ``cp.async`` (16 bytes
  per thread) into a ``NUM_STAGES``-deep shared-memory ring: the tile ``NUM_STAGES - 1`` ahead is
  in flight while the current one is computed, and the token ids are loaded one step earlier
  still, so no load waits on an index load;
* ``S = q_nope·K_latᵀ + q_pe·K_ropeᵀ`` and ``O += P·K_lat`` are both ``warpgroup_mma`` reading
  that one shared-memory copy (V is the latent part of the K tile). The accumulator layout puts
  the two warpgroups side by side along N (``warps_per_cta = [4, 2]``): each holds half of the
  64×512 fp32 output (128 registers per thread) and computes half of the score columns; the
  row max/sum of the online softmax (exp2 domain, fp32) cross the warpgroups through shared
  memory (compiler-generated reductions), and P reaches the PV MMA as a register operand;
* fp8 caches (``KV_FP8``) are gathered as fp8 (half the bytes) into an unswizzled fp8 ring and
  widened, 16 rows at a time and 8 values per thread (no bank conflicts), into one bf16/fp16
  tile in shared memory that the MMAs read (Hopper's fp8 wgmma needs both operands K-major,
  which V in the row-major tile is not). The per-tensor scale is read on the device from a
  one-element float32 tensor and folded into the score scale and the output, so a captured
  graph sees updates.

Work items covering a whole request write ``out``/``lse`` directly; split items write fp32
partials (normalised o, natural-log lse) for the Triton provider's split reduce. Rows with no
visible key produce ``o = 0``, ``lse = -inf``. Causal rows are right-aligned: query row ``qi`` of
a request with ``qlen`` rows and ``kv_len`` keys sees relative keys ``< kv_len - qlen + qi + 1``.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from mla.providers.gluon.ds_mla_words import _dequantize
from mla.providers.triton.merge import request_rows

MODE_SPLIT = 0
"""Non-persistent: program ``work`` is (request ``work // num_splits``, split ``work % num_splits``)."""
MODE_SCHEDULED = 1
"""Planned: program ``work`` reads item ``work`` of the schedule's ``work_info``."""
MMA_TILE_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
"""Shared layout of the 64-row and few-rows kernels' 16-bit MMA tiles (128-byte swizzle)."""
PLAIN_LAYOUT = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
"""Shared layout of their unswizzled rows: fp8 ring slots and tile scales."""


@gluon.jit
def _work_item(num_splits, work_info_ptr, ROW_BLOCKS: gl.constexpr, MODE: gl.constexpr):
    """``(rb, work, req)`` of this program: its row block, work item and request (split ``work %
    num_splits`` of request ``work // num_splits``, or the schedule's ``work_info`` row, whose
    request is negative for an unused item: the caller returns then). Shared by the Gluon
    kernels."""
    pid = gl.program_id(0)
    rb = pid % ROW_BLOCKS
    work = pid // ROW_BLOCKS
    # A statement, not a conditional expression: MODE 0 must never load from work_info.
    if MODE == 0:  # noqa: SIM108
        req = work // num_splits
    else:
        req = gl.load(work_info_ptr + work * 4)
    return rb, work, req


@gluon.jit
def _work_range(
    req, work, num_splits, kv_indptr_ptr, work_info_ptr, split_indptr_ptr, qo_indptr_ptr, lengths_ptr,
    MODE: gl.constexpr, UNIT_QLEN: gl.constexpr, BLOCK_N: gl.constexpr, HAS_LENGTHS: gl.constexpr,
):  # fmt: skip
    """``(kv_start, kv_len, lo, hi, direct, q_start, qlen)`` of work item ``work`` of request
    ``req``: the request's KV span, the item's key range ``[lo, hi)`` (its split of
    ``num_splits`` tile-aligned chunks, or the schedule's ``work_info`` row), whether it covers
    the whole request (output written directly), and the request's query rows (from
    ``qo_indptr``, or row ``req`` alone with ``UNIT_QLEN``). ``HAS_LENGTHS``: the keys end at
    ``lengths[req]`` (clamped into the span; the splits divide the keys before it), ``kv_len``
    and so the causal limits stay the span's. Shared by the Gluon kernels."""
    kv_start = gl.load(kv_indptr_ptr + req)
    kv_len = gl.load(kv_indptr_ptr + req + 1) - kv_start
    kv_end = kv_len
    if HAS_LENGTHS:
        kv_end = gl.minimum(gl.maximum(gl.load(lengths_ptr + req), 0), kv_len)
    if MODE == 0:
        split = work % num_splits
        chunk = gl.cdiv(gl.cdiv(kv_end, num_splits), BLOCK_N) * BLOCK_N
        lo = split * chunk
        hi = gl.minimum(lo + chunk, kv_end)
        direct = num_splits == 1
    else:
        lo = gl.load(work_info_ptr + work * 4 + 1) - kv_start
        hi = gl.minimum(gl.load(work_info_ptr + work * 4 + 2) - kv_start, kv_end)
        direct = (gl.load(split_indptr_ptr + req + 1) - gl.load(split_indptr_ptr + req)) == 1
    q_start, qlen = request_rows(qo_indptr_ptr, req, UNIT_QLEN)
    return kv_start, kv_len, lo, hi, direct, q_start, qlen


@gluon.jit
def _scales(sm_scale_log2, kv_scale_ptr, KV_FP8: gl.constexpr):
    """``(qk_scale, v_scale)``: the score scale (log2 domain) and the output scale, with an fp8
    cache's per-tensor scale read on the device and folded into both."""
    qk_scale = sm_scale_log2
    v_scale = 1.0
    if KV_FP8:
        kv_scale = gl.load(kv_scale_ptr)
        qk_scale = qk_scale * kv_scale
        v_scale = kv_scale
    return qk_scale, v_scale


RELEASE_ARRIVALS = gl.constexpr(128)
"""Arrivals that release a buffer read by a warpgroup's ``wgmma``: one from each of its threads
(:func:`_release`)."""


@gluon.jit
def _release(bar):
    """This thread's arrival on ``bar`` (initialised to count :data:`RELEASE_ARRIVALS`), once it
    has waited for the ``wgmma`` that read the buffer ``bar`` guards:
    ``cp.async.mbarrier.arrive.noinc``, which arrives when the thread's earlier ``cp.async``
    copies are done (an MMA warpgroup has none). A ``wgmma`` is one operation of its warpgroup, so
    any thread's wait for it means all of the warpgroup's shared-memory reads are done. Gluon's
    ``mbarrier.arrive`` arrives from one thread and needs the warpgroup's warps to meet first;
    this needs no barrier."""
    async_copy.mbarrier_arrive(bar, increment_count=False)


@gluon.jit
def _online_softmax(sc, m_i, l_i, n, key_ok, row_limit, qk_scale, AXIS: gl.constexpr):
    """One tile's step of the online softmax (exp2 domain, fp32). ``sc``: raw scores with the
    keys along ``AXIS`` (1: ``[rows, keys]``; 0: the transposed kernel's ``[keys, rows]``);
    ``n``: the keys' positions; keys not ``key_ok`` (:func:`_ring_key_ok`; ``None``: all) or
    past a row's ``row_limit`` are masked. Returns ``P``, ``alpha`` (the rescale of what came
    before), the new row max and row sum."""
    p, alpha, m_new = _online_softmax_unsummed(sc, m_i, n, key_ok, row_limit, qk_scale, AXIS)
    return p, alpha, m_new, l_i * alpha + gl.sum(p, AXIS)


@gluon.jit
def _online_softmax_unsummed(sc, m_i, n, key_ok, row_limit, qk_scale, AXIS: gl.constexpr):
    """:func:`_online_softmax` without the row sum: ``P``, ``alpha`` and the new row max. A
    caller that keeps the sum's partial terms in ``P``'s layout (``l = l·alpha + P``, summed once
    after the last tile) saves the per-tile reduction across the keys' threads and warps."""
    keys = gl.expand_dims(n, 1 - AXIS)
    visible = keys < gl.expand_dims(row_limit, AXIS)
    if key_ok is not None:
        visible = visible & gl.expand_dims(key_ok, 1 - AXIS)
    sc = gl.where(visible, sc * qk_scale, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(sc, AXIS))
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_use)
    p = gl.exp2(sc - gl.expand_dims(m_use, AXIS))
    return p, alpha, m_new


@gluon.jit
def _key_operand(
    kv_indices_ptr, kv_start, req, stride_bt, row_request_ptr, PAGE_SIZE: gl.constexpr, ROW_MAP: gl.constexpr
):
    """Where work request ``req`` finds its keys (``index_base`` of the helpers below): its
    slice ``kv_indices[kv_start:]`` of flat token ids (``PAGE_SIZE == 0``), or its block-table row
    (``PAGE_SIZE > 0``: ``kv_indices`` is the table, ``stride_bt`` its row stride; ``ROW_MAP``: the
    row of request ``row_request[req]``, a small-head verify row's)."""
    if PAGE_SIZE > 0:
        if ROW_MAP:  # noqa: SIM108 (a constexpr branch: the other side is not compiled)
            table_row = gl.load(row_request_ptr + req).to(gl.int64)
        else:
            table_row = req.to(gl.int64)
        index_base = kv_indices_ptr + table_row * stride_bt
    else:
        index_base = kv_indices_ptr + kv_start
    return index_base


@gluon.jit
def _wait_for_previous(PDL: gl.constexpr):
    """With ``PDL`` (a launch with ``launch_pdl``): wait until the kernel before this one in the
    stream has completed and its writes are visible (:mod:`mla.providers.triton.pdl`). Call it
    before the kernel's first memory access."""
    if PDL:
        gl.inline_asm_elementwise(
            "griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1
        )


@gluon.jit
def _id_limit(num_rows, PAGE_SIZE: gl.constexpr):
    """The bound an id of the key operand is checked against (unsigned, by :func:`_token_ids`
    and :func:`_ring_key_ok`): the cache's ``num_rows // PAGE_SIZE`` blocks (block table) or
    ``num_rows`` rows (flat ids). Computed once per program, outside the tile loops."""
    if PAGE_SIZE > 0:  # noqa: SIM108 (a constexpr branch: the other side is not compiled)
        limit = num_rows // PAGE_SIZE
    else:
        limit = num_rows
    return limit.to(gl.uint32)


@gluon.jit
def _token_ids(raw, n, id_limit, PAGE_SIZE: gl.constexpr):
    """Cache row ids (int32) of key positions ``n`` (``>= 0``) from what the key operand holds
    for them (``raw``: the flat ids, or with ``PAGE_SIZE > 0`` the block ids ``table[n //
    PAGE_SIZE]``) and whether each is inside the cache: ``0 <= raw < id_limit``
    (:func:`_id_limit`), one unsigned compare. An id outside it (a block id past the cache, a
    ``-1``) is masked by the callers, never clamped into another block."""
    ok = raw.to(gl.uint32, bitcast=True) < id_limit
    if PAGE_SIZE > 0:
        if (PAGE_SIZE & (PAGE_SIZE - 1)) == 0:  # noqa: SIM108 (constexpr branch)
            in_page = n & (PAGE_SIZE - 1)
        else:
            in_page = n % PAGE_SIZE
        ids = raw * PAGE_SIZE + in_page
    else:
        ids = raw
    return ids, ok


@gluon.jit
def _key_ok(index_base, n, hi, num_rows, PAGE_SIZE: gl.constexpr = 0):
    """Whether the keys at positions ``n`` count: inside ``[.., hi)`` and with an id inside the
    cache (:func:`_token_ids`), re-reading the ids from global memory (cached). For kernels
    without an id ring in their MMA partition (the ``fp8_ds_mla`` few-rows kernel); the others
    read their ring (:func:`_ring_key_ok`)."""
    step: gl.constexpr = PAGE_SIZE if PAGE_SIZE > 0 else 1
    raw = gl.load(index_base + n // step, mask=n < hi, other=-1)
    return _token_ids(raw, n, _id_limit(num_rows, PAGE_SIZE), PAGE_SIZE)[1] & (n < hi)


@gluon.jit
def _ring_key_ok(ids_slot, id_limit, LAYOUT: gl.constexpr):
    """Whether each key of a tile has an id inside the cache, from the tile's id-ring slot (in
    ``LAYOUT``): one shared-memory read and one unsigned compare a key (a global re-read of the
    ids, a 64-bit address per key, made the MMA loops spill). Keys past ``hi`` are not checked
    here: the callers take ``min(row_limit, hi)`` as the rows' key limit."""
    return ids_slot.load(LAYOUT).to(gl.uint32, bitcast=True) < id_limit


@gluon.constexpr_function
def _tile_in_page(mode, page_size, block_n):
    """Whether every KV tile of a launch lies inside one page of the block table: the
    non-persistent launches (``MODE`` 0) cut requests at multiples of the tile, so with pages a
    multiple of the tile each tile is one page's run of rows, and its ids are one block id."""
    return mode == 0 and page_size > 0 and page_size % block_n == 0


@gluon.jit
def _slot_block(ids_slot):
    """The first entry of an id-ring slot, as a scalar (one shared-memory read, the same address
    in every thread): the block id of a tile inside one page (:func:`_tile_in_page`)."""
    one: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    return gl.max(ids_slot.slice(0, 1).load(one), 0)


@gluon.jit
def _tile_key_limit(ids_slot, row_limit, hi, id_limit, IN_PAGE: gl.constexpr):
    """The rows' key limit for a tile's softmax (:func:`_online_softmax`), ``row_limit`` being
    ``min(row_limit, hi)`` already: a tile inside one page (``IN_PAGE``) is checked once, from
    its id-ring slot, and a block outside the cache lowers every row's limit to 0. Other tiles
    check each key's id (``key_ok``: :func:`_ring_key_ok`)."""
    if IN_PAGE:
        inside = _slot_block(ids_slot).to(gl.uint32, bitcast=True) < id_limit
        row_limit = gl.minimum(row_limit, gl.where(inside, hi, 0))
    return row_limit


@gluon.jit
def _safe_sum(l_i):
    """The row sum to divide the output by: 1 for a row that saw no key (its output stays 0); a
    NaN sum (a key the row sees is NaN) stays NaN."""
    return gl.where(l_i != 0.0, l_i, 1.0)


@gluon.jit
def _row_lse(m_i, l_i):
    """A row's natural-log LSE from its running max (log2 domain) and sum; ``-inf`` for a row
    that saw no key."""
    return gl.where(l_i != 0.0, (m_i + gl.log2(_safe_sum(l_i))) * 0.6931471805599453, float("-inf"))


@gluon.jit
def _row_info(rb, qlen, kv_len, H: gl.constexpr, BLOCK_M: gl.constexpr, layout: gl.constexpr):
    """Query row ordinal, head, validity and causal key limit of the ``BLOCK_M`` packed rows of
    row block ``rb`` (heads × qlen, head fastest; in ``layout``)."""
    rows = rb * BLOCK_M + gl.arange(0, BLOCK_M, layout=layout)
    qi = rows // H
    head = rows % H
    row_ok = qi < qlen
    row_limit = kv_len - qlen + qi + 1
    return qi, head, row_ok, row_limit


@gluon.jit
def _query_to_smem(
    q_nope_ptr, q_pe_ptr, q_nope_smem, q_pe_smem, rb, qlen, kv_len, q_start,
    stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h,
    H: gl.constexpr, ROWS: gl.constexpr, L: gl.constexpr, R: gl.constexpr,
    PAIRED_K: gl.constexpr = False,
):  # fmt: skip
    """Store the ``ROWS`` packed query rows of row block ``rb`` into shared memory in the
    buffers' dtype (the MMA operand dtype; rows past ``qlen`` are zeros), by every warp of the
    caller. Shared by the 64-row, few-rows and dual-chain kernels. ``PAIRED_K``: in the column
    order of :func:`_paired_k` (the dual-chain kernel's)."""
    _query_part_to_smem(
        q_nope_ptr, q_nope_smem, rb, qlen, kv_len, q_start, stride_qn_t, stride_qn_h, H, ROWS, L, PAIRED_K
    )
    _query_part_to_smem(
        q_pe_ptr, q_pe_smem, rb, qlen, kv_len, q_start, stride_qp_t, stride_qp_h, H, ROWS, R, PAIRED_K
    )


@gluon.constexpr_function
def _row_copy_layout(cols, per_thread, warps):
    """Register layout of a ``[rows, cols]`` copy: ``per_thread`` values a thread (16 bytes of
    fp8, or 8 16-bit values), a warp across up to ``32 · per_thread`` columns, the warps stacked
    over the rows."""
    lanes = min(32, cols // per_thread)
    return gl.BlockedLayout([1, per_thread], [32 // lanes, lanes], [warps, 1], [1, 0])


@gluon.constexpr_function
def _kv_copy_layouts(kv_fp8, warps):
    """Register layouts of a KV tile's latent and rope parts (the 64-row and few-rows kernels'
    ``cp.async`` gathers, and the fp8 widening's 16-bit stores): :func:`_row_copy_layout` with 16
    bytes a thread, a warp across a 512-wide latent row."""
    per_thread = 16 if kv_fp8 else 8
    return _row_copy_layout(32 * per_thread, per_thread, warps), _row_copy_layout(64, per_thread, warps)


@gluon.jit
def _query_part_to_smem(
    q_ptr, q_smem, rb, qlen, kv_len, q_start, stride_t, stride_h,
    H: gl.constexpr, ROWS: gl.constexpr, COLS: gl.constexpr, PAIRED_K: gl.constexpr,
):  # fmt: skip
    """One part of :func:`_query_to_smem`: the ``COLS`` columns of ``q_ptr`` (latent or rope)."""
    layout: gl.constexpr = _row_copy_layout(COLS, 8, gl.num_warps())
    ptrs, ok = _query_ptrs(q_ptr, rb, qlen, kv_len, q_start, stride_t, stride_h, H, ROWS, COLS, layout)
    q = gl.load(ptrs, mask=ok[:, None], other=0.0)
    if PAIRED_K:
        q = _paired_k(q)
    q_smem.store(q.to(q_smem.dtype))


@gluon.jit
def _paired_k(x):
    """``x`` (a ``[rows, cols]`` register tensor or shared-memory view, ``cols`` a multiple of
    16) with its columns reordered within each group of 16: column ``16b + 8h + 2t + e`` of the
    result is column ``16b + 4t + 2h + e`` of ``x``. A 16-bit wgmma register operand (``k_width=2``)
    gives each thread columns ``2t, 2t+1, 2t+8, 2t+9`` of every 16, which this order places in
    the 4 adjacent bytes ``4t .. 4t+3`` of an fp8 row: one 4-byte shared-memory load instead of
    two 2-byte ones. The query and the K tile take the same order, so ``QKᵀ`` is unchanged."""
    rows: gl.constexpr = x.shape[0]
    cols: gl.constexpr = x.shape[1]
    # Column (b, t, h, e) = 16b + 4t + 2h + e of x becomes column 16b + 8h + 2t + e.
    return x.reshape([rows, cols // 16, 4, 2, 2]).permute((0, 1, 3, 2, 4)).reshape([rows, cols])


@gluon.jit
def _tile_ids(
    index_base, lo, hi, t, id_limit, BLOCK_N: gl.constexpr, ROWS: gl.constexpr, PAGE_SIZE: gl.constexpr = 0
):
    """Cache row ids of tile ``t``'s rows of ``[lo, hi)`` (``ROWS``: the row slice of the copy
    layout) and their validity (``< hi`` and an id inside the cache, :func:`_token_ids`; id 0
    where not valid, and such rows are never loaded). Shared by the warp-specialised kernels'
    loaders (ping-pong and dual-chain)."""
    n = lo + t * BLOCK_N + gl.arange(0, BLOCK_N, layout=ROWS)
    step: gl.constexpr = PAGE_SIZE if PAGE_SIZE > 0 else 1
    raw = gl.load(index_base + n // step, mask=n < hi, other=-1)
    ids, inside = _token_ids(raw, n, id_limit, PAGE_SIZE)
    ok = (n < hi) & inside
    return gl.where(ok, ids, 0), ok


@gluon.jit
def _query_ptrs(
    q_ptr, rb, qlen, kv_len, q_start, stride_t, stride_h,
    H: gl.constexpr, ROWS: gl.constexpr, COLS: gl.constexpr, LAYOUT: gl.constexpr,
):  # fmt: skip
    """``[ROWS, COLS]`` pointers (in ``LAYOUT``) to the first ``COLS`` columns of the ``ROWS``
    packed query rows of row block ``rb``, and the rows' validity (rows past ``qlen`` are not
    loaded). Shared by the query loads of every Gluon kernel."""
    qi, head, ok, _lim = _row_info(rb, qlen, kv_len, H, ROWS, gl.SliceLayout(1, LAYOUT))
    tok = (q_start + qi).to(gl.int64)
    cols = gl.arange(0, COLS, layout=gl.SliceLayout(0, LAYOUT))
    return q_ptr + tok[:, None] * stride_t + head[:, None] * stride_h + cols[None, :], ok


@gluon.jit
def _query_copy(
    q_nope_ptr, q_pe_ptr, q_nope_smem, q_pe_smem, rb, qlen, kv_len, q_start,
    stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h,
    H: gl.constexpr, ROWS: gl.constexpr, L: gl.constexpr, R: gl.constexpr,
):  # fmt: skip
    """Issue the ``cp.async`` copies of the ``ROWS`` packed query rows of row block ``rb`` into
    shared memory (the buffers' dtype must be the query's; rows past ``qlen`` are zero-filled),
    by every warp of the caller, every 128-column piece in flight at once, as one commit group.
    Nothing waits here: the caller waits for the group, or lets a later ``cp.async`` arrival of the
    same threads on an mbarrier stand for it (such an arrival completes once every earlier copy of
    the arriving thread has landed). Shared by the ping-pong and ``fp8_ds_mla`` kernels;
    :func:`_query_to_smem` is the register path, for a converted dtype or column order."""
    warps: gl.constexpr = gl.num_warps()
    Q_CHUNK: gl.constexpr = 128
    q_ld: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [warps, 1], [1, 0])
    qr_ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [warps, 1], [1, 0])
    qn_ptrs, ok_q = _query_ptrs(
        q_nope_ptr, rb, qlen, kv_len, q_start, stride_qn_t, stride_qn_h, H, ROWS, Q_CHUNK, q_ld
    )
    qp_ptrs, ok_r = _query_ptrs(
        q_pe_ptr, rb, qlen, kv_len, q_start, stride_qp_t, stride_qp_h, H, ROWS, R, qr_ld
    )
    for c in gl.static_range(L // Q_CHUNK):
        async_copy.async_copy_global_to_shared(
            q_nope_smem.slice(c * Q_CHUNK, Q_CHUNK, dim=1), qn_ptrs + c * Q_CHUNK, mask=ok_q[:, None]
        )
    async_copy.async_copy_global_to_shared(q_pe_smem, qp_ptrs, mask=ok_r[:, None])
    async_copy.commit_group()


@gluon.jit
def _store_staged(
    o16, stage, out_ptr, rb, qlen, kv_len, q_start, stride_o_t, stride_o_h,
    H: gl.constexpr, ROWS: gl.constexpr, COL0,
):  # fmt: skip
    """Store ``o16`` (``[ROWS, C]`` output columns ``[COL0, COL0 + C)`` of row block ``rb``, in the
    output's 16-bit dtype, any register layout) with 16-byte stores: through ``stage`` (a free
    ``[ROWS, C]`` shared buffer of that dtype), read back 8 consecutive columns a thread. An MMA
    accumulator layout gives a thread pairs of columns: 4-byte stores, half a sector each. Rows
    past ``qlen`` are not stored. Needs 4 warps in the caller (one warpgroup). For kernels with
    no free buffer to stage in; the prefill's ``_store_rows`` converts the layout in registers
    instead, through the compiler's own scratch."""
    stage.store(o16)
    gl.thread_barrier()
    vec: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
    o_vec = stage.load(vec)
    qi, head, ok, _lim = _row_info(rb, qlen, kv_len, H, ROWS, gl.SliceLayout(1, vec))
    cols = COL0 + gl.arange(0, stage.shape[1], layout=gl.SliceLayout(0, vec))
    tok = (q_start + qi).to(gl.int64)
    ptrs = out_ptr + tok[:, None] * stride_o_t + head[:, None] * stride_o_h + cols[None, :]
    gl.store(ptrs, o_vec, mask=ok[:, None])


@gluon.jit
def _issue_ids(
    index_base, idx_ring, j, lo, hi, BLOCK_N: gl.constexpr, ID_SLOTS: gl.constexpr, ID_LD: gl.constexpr,
    PAGE_SIZE: gl.constexpr = 0,
):  # fmt: skip
    """cp.async what the key operand holds for tile ``j`` (flat token ids, or with ``PAGE_SIZE > 0``
    each position's block id) into id-ring slot ``j % ID_SLOTS`` (0 past ``hi``)."""
    n = lo + j * BLOCK_N + gl.arange(0, BLOCK_N, layout=ID_LD)
    step: gl.constexpr = PAGE_SIZE if PAGE_SIZE > 0 else 1
    async_copy.async_copy_global_to_shared(idx_ring.index(j % ID_SLOTS), index_base + n // step, mask=n < hi)


@gluon.jit
def _ring_ids(
    ids_slot, n0, hi, id_limit, BLOCK_N: gl.constexpr, LD: gl.constexpr, PAGE_SIZE: gl.constexpr, page=None
):  # fmt: skip
    """The int64 cache row ids of a tile's positions ``n0 ..`` from its id-ring slot (in the
    row slice of copy layout ``LD``) and whether each is loaded (``< hi``, inside the cache).
    The id math stays int32 (a row id fits: the cache's rows are counted in int32 ids).
    ``page``: ``(first row, row limit)`` of a tile inside one page (:func:`_issue_tile`): its
    rows are consecutive, the id ring is not read per row."""
    offs = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LD))
    if page is not None:
        tok = page[0] + offs
        ok = n0 + offs < page[1]
    else:
        n = n0 + offs
        raw = ids_slot.load(gl.SliceLayout(1, LD))
        tok, _inside = _token_ids(raw, n, id_limit, PAGE_SIZE)
        # One unsigned compare a row (the copy's mask stays one predicate, not a select chain):
        # a position past hi takes the id -1, outside every cache.
        ok = (raw | ((hi - 1 - n) >> 31)).to(gl.uint32, bitcast=True) < id_limit
    return tok.to(gl.int64), ok


@gluon.jit
def _issue_tile(
    kv_ptr, idx_ring, a, lo, hi, id_limit, stride_kv, lat_dst, rope_dst,
    L: gl.constexpr, R: gl.constexpr, BLOCK_N: gl.constexpr, ID_SLOTS: gl.constexpr,
    LAT_LD: gl.constexpr, ROPE_LD: gl.constexpr, scale_ring=None, scale_slot=0, DS_MLA: gl.constexpr = False,
    PAGE_SIZE: gl.constexpr = 0, IN_PAGE: gl.constexpr = False,
):  # fmt: skip
    """cp.async the latent and rope parts of tile ``a``'s cache rows (ids from the id ring;
    rows past ``hi``, and rows whose id is outside the cache, zero-filled and never read).
    ``IN_PAGE``: the tile lies inside one page (:func:`_tile_in_page`): one block id, read and
    checked once, and consecutive rows.
    ``DS_MLA``: ``fp8_ds_mla`` rows (``kv_ptr`` an fp8 pointer): the ``L`` fp8 latent bytes, the
    ``L / 128`` float32 tile scales into slot ``scale_slot`` of ``scale_ring`` and the bf16 rope
    after them."""
    ids = idx_ring.index(a % ID_SLOTS)
    n0 = lo + a * BLOCK_N
    page = None
    if IN_PAGE:
        blk = _slot_block(ids)
        inside = blk.to(gl.uint32, bitcast=True) < id_limit
        page = (blk * PAGE_SIZE + n0 % PAGE_SIZE, gl.where(inside, hi, n0))
    tok_l, ok_l = _ring_ids(ids, n0, hi, id_limit, BLOCK_N, LAT_LD, PAGE_SIZE, page)
    cols_l = gl.arange(0, L, layout=gl.SliceLayout(0, LAT_LD))
    ptr_l = kv_ptr + tok_l[:, None] * stride_kv + cols_l[None, :]
    async_copy.async_copy_global_to_shared(lat_dst, ptr_l, mask=ok_l[:, None])
    tok_r, ok_r = _ring_ids(ids, n0, hi, id_limit, BLOCK_N, ROPE_LD, PAGE_SIZE, page)
    cols_r = gl.arange(0, R, layout=gl.SliceLayout(0, ROPE_LD))
    if DS_MLA:
        TILES: gl.constexpr = L // 128
        row_r = (kv_ptr + tok_r * stride_kv + L + 4 * TILES).to(gl.pointer_type(gl.bfloat16))
        ptr_r = row_r[:, None] + cols_r[None, :]
        SCALE_LD: gl.constexpr = gl.BlockedLayout([1, TILES], [32, 1], [gl.num_warps(), 1], [1, 0])
        tok_s, ok_s = _ring_ids(ids, n0, hi, id_limit, BLOCK_N, SCALE_LD, PAGE_SIZE, page)
        cols_s = gl.arange(0, TILES, layout=gl.SliceLayout(0, SCALE_LD))
        row_s = (kv_ptr + tok_s * stride_kv + L).to(gl.pointer_type(gl.float32))
        ptr_s = row_s[:, None] + cols_s[None, :]
        async_copy.async_copy_global_to_shared(scale_ring.index(scale_slot), ptr_s, mask=ok_s[:, None])
    else:
        ptr_r = kv_ptr + tok_r[:, None] * stride_kv + L + cols_r[None, :]
    async_copy.async_copy_global_to_shared(rope_dst, ptr_r, mask=ok_r[:, None])


@gluon.jit
def _refill_ring(
    kv_ptr, idx_ring, index_base, t, lo, hi, id_limit, stride_kv, lat_ring, rope_ring,
    L: gl.constexpr, R: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
    ID_SLOTS: gl.constexpr, LAT_LD: gl.constexpr, ROPE_LD: gl.constexpr, ID_LD: gl.constexpr,
    scale_ring=None, DS_MLA: gl.constexpr = False, PAGE_SIZE: gl.constexpr = 0, IN_PAGE: gl.constexpr = False,
):  # fmt: skip
    """At tile ``t``: wait until every warp is past the MMAs that read the ring slot of tile
    ``t - 1``, then refill that slot with tile ``t + NUM_STAGES - 1`` and fetch the token ids
    ``NUM_STAGES`` tiles further (one cp.async group)."""
    gl.thread_barrier()
    ahead = t + NUM_STAGES - 1
    _issue_tile(
        kv_ptr, idx_ring, ahead, lo, hi, id_limit, stride_kv,
        lat_ring.index(ahead % NUM_STAGES), rope_ring.index(ahead % NUM_STAGES),
        L, R, BLOCK_N, ID_SLOTS, LAT_LD, ROPE_LD, scale_ring, ahead % NUM_STAGES, DS_MLA, PAGE_SIZE, IN_PAGE,
    )  # fmt: skip
    _issue_ids(index_base, idx_ring, ahead + NUM_STAGES, lo, hi, BLOCK_N, ID_SLOTS, ID_LD, PAGE_SIZE)
    async_copy.commit_group()


@gluon.jit
def _widen_ds_mla(
    lat_slot, scale_slot, k_lat, BLOCK_N: gl.constexpr, L: gl.constexpr, STEP: gl.constexpr = 16
):
    """Dequantize an ``fp8_ds_mla`` latent tile: ``k_lat[n, c] = lat_slot[n, c] ·
    scale_slot[n, c // 128]`` in bf16 (:func:`.ds_mla_words._dequantize`: exact for
    power-of-two scales), ``STEP`` rows at a time (each step one store: the compiler puts a
    barrier between two stores into one allocation), two words of four values a thread
    (bank-conflict-free as in :func:`_mma_operands`)."""
    TILES: gl.constexpr = L // 128
    words3: gl.constexpr = gl.BlockedLayout([1, 1, 2], [1, 2, 16], [gl.num_warps(), 1, 1], [2, 1, 0])
    word_tiles = lat_slot._reinterpret(gl.int32, [BLOCK_N, L // 4], lat_slot.layout).reshape(
        [BLOCK_N, TILES, 32]
    )
    for c in gl.static_range(BLOCK_N // STEP):
        x = word_tiles.slice(c * STEP, STEP, dim=0).load(words3)
        sc = scale_slot.slice(c * STEP, STEP, dim=0).load(gl.SliceLayout(2, words3))
        y = _dequantize(x, sc)
        k_lat.slice(c * STEP, STEP, dim=0).store(y.reshape([STEP, L]))


@gluon.jit
def _mma_operands(
    lat_ring, rope_ring, lat_wide, rope_wide, t, NUM_STAGES: gl.constexpr, WIDE_STAGES: gl.constexpr,
    BLOCK_N: gl.constexpr, KV_FP8: gl.constexpr, scale_ring=None, DS_MLA: gl.constexpr = False,
):  # fmt: skip
    """The shared-memory K tile of tile ``t`` for the MMAs, after its cp.async group completed.

    16-bit caches: the ring slot itself. fp8: the slot widened into wide buffer
    ``t % WIDE_STAGES``, 16 rows at a time, 8 values per thread: 8-byte reads of the unswizzled
    fp8 slot and one 16-byte chunk of the 128-byte-swizzled tile written per thread, so neither
    side conflicts on a bank. Ends with the proxy fence and barrier the MMAs need.
    """
    stage = t % NUM_STAGES
    if DS_MLA:
        # The rope lanes arrive as bf16 in the MMA layout; only the latent is widened.
        gl.thread_barrier()
        k_lat = lat_wide.index(t % WIDE_STAGES)
        k_rope = rope_ring.index(stage)
        _widen_ds_mla(lat_ring.index(stage), scale_ring.index(stage), k_lat, BLOCK_N, lat_ring.shape[2])
    elif KV_FP8:
        gl.thread_barrier()
        slot = t % WIDE_STAGES
        k_lat = lat_wide.index(slot)
        k_rope = rope_wide.index(slot)
        warps: gl.constexpr = gl.num_warps()
        lat_ld: gl.constexpr = _kv_copy_layouts(False, warps)[0]
        rope_ld: gl.constexpr = _kv_copy_layouts(False, warps)[1]
        STEP: gl.constexpr = 16
        for c in gl.static_range(BLOCK_N // STEP):
            x = lat_ring.index(stage).slice(c * STEP, STEP, dim=0).load(lat_ld)
            k_lat.slice(c * STEP, STEP, dim=0).store(x.to(k_lat.dtype))
        k_rope.store(rope_ring.index(stage).load(rope_ld).to(k_rope.dtype))
    else:
        k_lat = lat_ring.index(stage)
        k_rope = rope_ring.index(stage)
    fence_async_shared()
    gl.thread_barrier()
    return k_lat, k_rope


@gluon.jit
def _take_tile(
    kv_ptr, idx_ring, index_base, t, lo, hi, id_limit, stride_kv, lat_ring, rope_ring, lat_wide, rope_wide,
    NEXT: gl.constexpr, L: gl.constexpr, R: gl.constexpr, BLOCK_N: gl.constexpr,
    NUM_STAGES: gl.constexpr, WIDE_STAGES: gl.constexpr, ID_SLOTS: gl.constexpr, KV_FP8: gl.constexpr,
    LAT_LD: gl.constexpr, ROPE_LD: gl.constexpr, ID_LD: gl.constexpr,
    scale_ring=None, DS_MLA: gl.constexpr = False, PAGE_SIZE: gl.constexpr = 0, IN_PAGE: gl.constexpr = False,
):  # fmt: skip
    """At tile ``t``: refill the ring (:func:`_refill_ring`), wait until tile ``t + NEXT`` landed
    and return its MMA operands (:func:`_mma_operands`). ``NEXT`` is 0, or 1 for a loop that
    issues the QKᵀ of the next tile beside the PV of this one."""
    _refill_ring(
        kv_ptr, idx_ring, index_base, t, lo, hi, id_limit, stride_kv, lat_ring, rope_ring,
        L, R, BLOCK_N, NUM_STAGES, ID_SLOTS, LAT_LD, ROPE_LD, ID_LD, scale_ring, DS_MLA, PAGE_SIZE, IN_PAGE,
    )  # fmt: skip
    async_copy.wait_group(NUM_STAGES - 1 - NEXT)
    return _mma_operands(
        lat_ring,
        rope_ring,
        lat_wide,
        rope_wide,
        t + NEXT,
        NUM_STAGES,
        WIDE_STAGES,
        BLOCK_N,
        KV_FP8,
        scale_ring,
        DS_MLA,
    )


@gluon.jit
def _kv_rings(
    kv_dtype: gl.constexpr, dtype: gl.constexpr, NUM_STAGES: gl.constexpr, WIDE_STAGES: gl.constexpr,
    BLOCK_N: gl.constexpr, L: gl.constexpr, R: gl.constexpr, KV_FP8: gl.constexpr, KV_DS_MLA: gl.constexpr,
):  # fmt: skip
    """The shared-memory KV buffers of the 64-row and few-rows kernels: ``(lat_ring, rope_ring,
    lat_wide, rope_wide)``. 16-bit caches: ``NUM_STAGES`` MMA-layout slots, read by the MMAs in
    place (the wide buffers are the rings). Per-tensor fp8: unswizzled fp8 slots widened into
    ``WIDE_STAGES`` MMA-layout tiles. ``fp8_ds_mla``: fp8 latent slots widened (with the tile
    scales of :func:`_scale_ring`), bf16 rope lanes in MMA-layout slots read in place."""
    ring_smem: gl.constexpr = PLAIN_LAYOUT if KV_FP8 else MMA_TILE_LAYOUT
    lat_ring = gl.allocate_shared_memory(kv_dtype, [NUM_STAGES, BLOCK_N, L], ring_smem)
    if KV_DS_MLA:
        rope_ring = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, R], MMA_TILE_LAYOUT)
        lat_wide = gl.allocate_shared_memory(dtype, [WIDE_STAGES, BLOCK_N, L], MMA_TILE_LAYOUT)
        rope_wide = rope_ring
    elif KV_FP8:
        rope_ring = gl.allocate_shared_memory(kv_dtype, [NUM_STAGES, BLOCK_N, R], ring_smem)
        lat_wide = gl.allocate_shared_memory(dtype, [WIDE_STAGES, BLOCK_N, L], MMA_TILE_LAYOUT)
        rope_wide = gl.allocate_shared_memory(dtype, [WIDE_STAGES, BLOCK_N, R], MMA_TILE_LAYOUT)
    else:
        rope_ring = gl.allocate_shared_memory(kv_dtype, [NUM_STAGES, BLOCK_N, R], ring_smem)
        lat_wide = lat_ring
        rope_wide = rope_ring
    return lat_ring, rope_ring, lat_wide, rope_wide


@gluon.jit
def _scale_ring(NUM_STAGES: gl.constexpr, BLOCK_N: gl.constexpr, L: gl.constexpr):
    """The float32 ``[NUM_STAGES, BLOCK_N, L / 128]`` ring of ``fp8_ds_mla`` tile scales."""
    return gl.allocate_shared_memory(gl.float32, [NUM_STAGES, BLOCK_N, L // 128], PLAIN_LAYOUT)


# ``num_splits`` is never specialised: Triton 3.6 fails to lower the kernel when a launch with
# one split turns it into the constant 1 (an LLVM-lowering assertion), and one binary serves
# every split count anyway.
@gluon.jit(do_not_specialize=["num_splits"])
def mla_decode_kernel(
    q_nope_ptr,
    q_pe_ptr,
    kv_ptr,
    kv_indptr_ptr,
    kv_indices_ptr,
    qo_indptr_ptr,
    work_info_ptr,
    split_indptr_ptr,
    out_ptr,
    lse_ptr,
    part_o_ptr,
    part_lse_ptr,
    kv_scale_ptr,
    num_splits,
    stride_qn_t,
    stride_qn_h,
    stride_qp_t,
    stride_qp_h,
    stride_kv,
    stride_o_t,
    stride_o_h,
    stride_lse_t,
    stride_lse_h,
    stride_po_w,
    stride_po_q,
    stride_po_h,
    stride_pl_w,
    stride_pl_q,
    sm_scale_log2,
    num_kv_rows,
    stride_bt,
    row_request_ptr,
    lengths_ptr,
    H: gl.constexpr,
    L: gl.constexpr,
    R: gl.constexpr,
    BLOCK_N: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    ROW_BLOCKS: gl.constexpr,
    MODE: gl.constexpr,
    UNIT_QLEN: gl.constexpr,
    WRITE_LSE: gl.constexpr,
    KV_FP8: gl.constexpr,
    KV_DS_MLA: gl.constexpr,
    PAGE_SIZE: gl.constexpr,
    ROW_MAP: gl.constexpr,
    HAS_LENGTHS: gl.constexpr,
    OVERLAP: gl.constexpr,
    num_warps: gl.constexpr,
):
    BLOCK_M: gl.constexpr = 64
    WIDE_STAGES: gl.constexpr = 2 if OVERLAP else 1
    if OVERLAP:
        gl.static_assert(NUM_STAGES >= 3, "the overlapped loop keeps two tiles ahead of the MMAs")
    gl.static_assert(num_warps == 8, "two warpgroups split the output columns")
    dtype: gl.constexpr = q_nope_ptr.dtype.element_ty
    kv_dtype: gl.constexpr = kv_ptr.dtype.element_ty

    # -- layouts -------------------------------------------------------------------------------
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BLOCK_N // 2, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, L // 2, 16]
    )
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    lat_ld: gl.constexpr = _kv_copy_layouts(KV_FP8, num_warps)[0]
    rope_ld: gl.constexpr = _kv_copy_layouts(KV_FP8 and not KV_DS_MLA, num_warps)[1]
    id_ld: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    id_smem: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    ID_SLOTS: gl.constexpr = 2 * NUM_STAGES

    # -- the work item ---------------------------------------------------------------------------
    rb, work, req = _work_item(num_splits, work_info_ptr, ROW_BLOCKS, MODE)
    if MODE != 0:  # noqa: SIM102 (MODE is a constexpr: this if is resolved at compile time)
        if req < 0:
            return
    kv_start, kv_len, lo, hi, direct, q_start, qlen = _work_range(
        req, work, num_splits, kv_indptr_ptr, work_info_ptr, split_indptr_ptr, qo_indptr_ptr, lengths_ptr,
        MODE, UNIT_QLEN, BLOCK_N, HAS_LENGTHS,
    )  # fmt: skip
    qk_scale, v_scale = _scales(sm_scale_log2, kv_scale_ptr, KV_FP8 and not KV_DS_MLA)

    # -- shared memory ---------------------------------------------------------------------------
    q_nope_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, L], MMA_TILE_LAYOUT)
    q_pe_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, R], MMA_TILE_LAYOUT)
    idx_ring = gl.allocate_shared_memory(gl.int32, [ID_SLOTS, BLOCK_N], id_smem)
    lat_ring, rope_ring, lat_wide, rope_wide = _kv_rings(
        kv_dtype, dtype, NUM_STAGES, WIDE_STAGES, BLOCK_N, L, R, KV_FP8, KV_DS_MLA
    )
    scale_ring = _scale_ring(NUM_STAGES, BLOCK_N, L) if KV_DS_MLA else None

    # Token ids travel NUM_STAGES tiles ahead of the KV rows they address, through a ring of
    # 2·NUM_STAGES slots filled by cp.async in the same groups as the KV tiles: the group that
    # brings KV tile a also brings the ids of tile a + NUM_STAGES, so issuing a KV tile never
    # waits on a global load (an id load one tile ahead cost a full memory latency per tile).
    index_base = _key_operand(kv_indices_ptr, kv_start, req, stride_bt, row_request_ptr, PAGE_SIZE, ROW_MAP)
    id_limit = _id_limit(num_kv_rows, PAGE_SIZE)
    IN_PAGE: gl.constexpr = _tile_in_page(MODE, PAGE_SIZE, BLOCK_N)
    for j in gl.static_range(2 * NUM_STAGES - 1):
        _issue_ids(index_base, idx_ring, j, lo, hi, BLOCK_N, ID_SLOTS, id_ld, PAGE_SIZE)
    async_copy.commit_group()
    async_copy.wait_group(0)
    gl.thread_barrier()
    for st in gl.static_range(NUM_STAGES - 1):
        _issue_tile(
            kv_ptr, idx_ring, st, lo, hi, id_limit, stride_kv, lat_ring.index(st), rope_ring.index(st),
            L, R, BLOCK_N, ID_SLOTS, lat_ld, rope_ld, scale_ring, st, KV_DS_MLA, PAGE_SIZE, IN_PAGE,
        )  # fmt: skip
        async_copy.commit_group()

    # -- the query tile (while the first KV tiles are in flight) --------------------------------
    _query_to_smem(
        q_nope_ptr, q_pe_ptr, q_nope_smem, q_pe_smem, rb, qlen, kv_len, q_start,
        stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h, H, BLOCK_M, L, R,
    )  # fmt: skip

    _qi_s, _head_s, _ok_s, row_limit = _row_info(rb, qlen, kv_len, H, BLOCK_M, gl.SliceLayout(1, s_layout))
    # Keys past hi are masked by the row limit; ids outside the cache by _tile_key_limit (a tile
    # inside one page) or _ring_key_ok.
    row_limit = gl.minimum(row_limit, hi)
    keys: gl.constexpr = gl.SliceLayout(0, s_layout)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=gl.SliceLayout(1, s_layout))
    acc = gl.zeros([BLOCK_M, L], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    offs_n = gl.arange(0, BLOCK_N, layout=keys)

    n_tiles = gl.cdiv(hi - lo, BLOCK_N)
    if OVERLAP:
        # Software-pipelined: tile t's PV runs while tile t+1 is taken (widened on fp8 caches),
        # then tile t+1's QKᵀ; both are waited for at the end of the step.
        async_copy.wait_group(NUM_STAGES - 2)
        k_lat, k_rope = _mma_operands(
            lat_ring,
            rope_ring,
            lat_wide,
            rope_wide,
            0,
            NUM_STAGES,
            WIDE_STAGES,
            BLOCK_N,
            KV_FP8,
            scale_ring,
            KV_DS_MLA,
        )
        sc = warpgroup_mma(q_nope_smem, k_lat.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        sc = warpgroup_mma(q_pe_smem, k_rope.permute((1, 0)), sc, is_async=True)
        sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc,))
        for t in range(n_tiles):
            n = t * BLOCK_N + lo + offs_n
            # (tile t's id slot takes new ids in the _take_tile of tile t + 1)
            ids_t = idx_ring.index(t % ID_SLOTS)
            key_ok = None if IN_PAGE else _ring_key_ok(ids_t, id_limit, keys)
            limit = _tile_key_limit(ids_t, row_limit, hi, id_limit, IN_PAGE)
            p, alpha, m_i, l_i = _online_softmax(sc, m_i, l_i, n, key_ok, limit, qk_scale, 1)
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            v_cur = lat_wide.index(t % WIDE_STAGES) if KV_FP8 else lat_ring.index(t % NUM_STAGES)
            acc = warpgroup_mma(p_op, v_cur, acc, is_async=True)
            # Every warp waited for the MMAs of tile t-1 above, so its ring slot can be refilled;
            # then tile t+1 (zero rows past the last tile: its scores are never used).
            k_lat, k_rope = _take_tile(
                kv_ptr, idx_ring, index_base, t, lo, hi, id_limit, stride_kv, lat_ring, rope_ring,
                lat_wide, rope_wide, 1, L, R, BLOCK_N, NUM_STAGES, WIDE_STAGES, ID_SLOTS, KV_FP8,
                lat_ld, rope_ld, id_ld, scale_ring, KV_DS_MLA, PAGE_SIZE, IN_PAGE,
            )  # fmt: skip
            sc = warpgroup_mma(q_nope_smem, k_lat.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            sc = warpgroup_mma(q_pe_smem, k_rope.permute((1, 0)), sc, is_async=True)
            # Both products waited here, not at the loop's top: a wgmma in flight across the back
            # edge with P in registers makes ptxas serialise every wgmma of the kernel.
            sc, acc = warpgroup_mma_wait(num_outstanding=0, deps=(sc, acc))
    else:
        for t in range(n_tiles):
            k_lat, k_rope = _take_tile(
                kv_ptr, idx_ring, index_base, t, lo, hi, id_limit, stride_kv, lat_ring, rope_ring,
                lat_wide, rope_wide, 0, L, R, BLOCK_N, NUM_STAGES, WIDE_STAGES, ID_SLOTS, KV_FP8,
                lat_ld, rope_ld, id_ld, scale_ring, KV_DS_MLA, PAGE_SIZE, IN_PAGE,
            )  # fmt: skip
            sc = warpgroup_mma(q_nope_smem, k_lat.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            sc = warpgroup_mma(q_pe_smem, k_rope.permute((1, 0)), sc, is_async=True)
            n = t * BLOCK_N + lo + offs_n
            ids_t = idx_ring.index(t % ID_SLOTS)
            key_ok = None if IN_PAGE else _ring_key_ok(ids_t, id_limit, keys)
            limit = _tile_key_limit(ids_t, row_limit, hi, id_limit, IN_PAGE)
            sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc,))
            p, alpha, m_i, l_i = _online_softmax(sc, m_i, l_i, n, key_ok, limit, qk_scale, 1)
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            acc = warpgroup_mma(p_op, k_lat, acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    async_copy.wait_group(0)

    # -- epilogue --------------------------------------------------------------------------------
    lse = _row_lse(m_i, l_i)
    inv = gl.convert_layout(v_scale / _safe_sum(l_i), gl.SliceLayout(1, o_layout))
    o = acc * inv[:, None]
    qi_o, head_o, ok_o, _lim_o = _row_info(rb, qlen, kv_len, H, BLOCK_M, gl.SliceLayout(1, o_layout))
    cols_o = gl.arange(0, L, layout=gl.SliceLayout(0, o_layout))
    qi_s, head_s, ok_s, _lim_s = _row_info(rb, qlen, kv_len, H, BLOCK_M, gl.SliceLayout(1, s_layout))
    if direct:
        tok_o = (q_start + qi_o).to(gl.int64)
        o_ptrs = out_ptr + tok_o[:, None] * stride_o_t + head_o[:, None] * stride_o_h + cols_o[None, :]
        gl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=ok_o[:, None])
        if WRITE_LSE:
            tok_s = (q_start + qi_s).to(gl.int64)
            gl.store(lse_ptr + tok_s * stride_lse_t + head_s * stride_lse_h, lse, mask=ok_s)
    else:
        wk = work.to(gl.int64)
        po_ptrs = part_o_ptr + wk * stride_po_w + qi_o[:, None] * stride_po_q + head_o[:, None] * stride_po_h
        gl.store(po_ptrs + cols_o[None, :], o, mask=ok_o[:, None])
        gl.store(part_lse_ptr + wk * stride_pl_w + qi_s * stride_pl_q + head_s, lse, mask=ok_s)
