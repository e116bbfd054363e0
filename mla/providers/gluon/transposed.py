# mypy: disable-error-code="no-untyped-def, untyped-decorator"
"""Gluon MLA decode for few query rows (heads × qlen <= 64): transposed MMAs, rows as the N dim.

A 64-row query tile wastes most of its MMA rows when a request has 16 (or 32) packed rows, and
with the query as the wgmma A operand every KV tile re-reads the whole 64×576 query tile from
shared memory. This kernel computes the transposed products instead, so the few query rows are
the MMA N dimension (``NR`` = 16 or 32 on one warpgroup, 64 on two warpgroups that each own 32
of the rows) and the KV tile is the M dimension:

* ``Sᵀ [BLOCK_N, NR] = K [BLOCK_N, 576] · Qᵀ`` (A = the K tile, K-major; B = the ``NR``-row query
  tile, 18 or 36 KB of shared memory);
* ``Oᵀ [512, NR] += Vᵀ [512, BLOCK_N] · Pᵀ`` (A = the same tile read transposed, B = ``Pᵀ``
  stored to shared memory as bf16/fp16, 2–4 KB).

Per 64-token tile that is about 250 KB of shared-memory traffic instead of about 370 KB, a
quarter of the MMA work, no cross-warpgroup exchange (one warpgroup of 4 warps holds the
``Oᵀ`` accumulator: 64 or 128 registers per thread), and room left for the KV ring. The token
ids, the cp.async KV ring, the work items (non-persistent splits, planned schedule, unit-qlen
rows) and the outputs (direct, or fp32 partials for the split reduce) are those of
:mod:`.kernels`; with ``FOLD_SPLITS`` the kernel merges the partials itself after a grid barrier
(:mod:`.fold`, a cooperative launch of one wave).

fp8 caches (``KV_FP8``) are gathered as fp8 (a 64-token tile is 36 KB) into a ring of
``NUM_STAGES`` unswizzled slots and widened once per tile into one fp16 tile in shared memory
that both MMAs read. A slot is refilled with the tile ``NUM_STAGES`` ahead as soon as its tile
is widened. The widening moves 8 values per thread so that neither its reads nor its writes
into the 128-byte-swizzled fp16 tile conflict on a bank: with 16 values per thread (two
conflicting 16-byte writes and a 64-byte-swizzled ring) it took a quarter of the kernel's time.
The per-tensor scale, read on the device from a one-element float32 tensor, is
folded into the score scale and the output. With an fp8 cache
the MMAs run in fp16 (fp8 widens to fp16 in one conversion per two values and fp16 holds every
fp8 value exactly); the query is rounded to fp16, as in the Triton provider's fp8 path.
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

from mla.providers.gluon.fold import grid_barrier, merge_output_slice
from mla.providers.gluon.kernels import (
    _id_limit,
    _issue_ids,
    _issue_tile,
    _key_operand,
    _kv_copy_layouts,
    _kv_rings,
    _mma_operands,
    _online_softmax,
    _query_to_smem,
    _ring_key_ok,
    _row_info,
    _row_lse,
    _safe_sum,
    _scale_ring,
    _scales,
    _take_tile,
    _tile_in_page,
    _tile_key_limit,
    _work_item,
    _work_range,
)


@gluon.jit
def _store_rows_output(
    acc, m_i, l_i, v_scale, rb, qlen, kv_len, q_start, work, direct, outs,
    H: gl.constexpr, NR: gl.constexpr, L: gl.constexpr, WRITE_LSE: gl.constexpr,
    LAYOUT: gl.constexpr, COL_START: gl.constexpr = 0, COL_STEP: gl.constexpr = 1,
    STORE_LSE: gl.constexpr = True,
):  # fmt: skip
    """Write the transposed output ``acc`` (``[L, NR]`` fp32 in ``LAYOUT``, unnormalised) and
    the LSE from the running max ``m_i`` and sum ``l_i``: the request's rows directly, or fp32
    partials of work item ``work`` for the split reduce. ``outs``: the output pointers and
    strides, in the kernels' argument order. Row ``k`` of ``acc`` is output column
    ``COL_START + COL_STEP·k``: ``acc`` may be a part of the output (the dual-chain kernel's
    accumulators hold every other column of 128). ``STORE_LSE``: write the LSE (or the
    partial's) too; of an output written in parts, one part does."""
    (
        out_ptr, lse_ptr, part_o_ptr, part_lse_ptr, stride_o_t, stride_o_h, stride_lse_t, stride_lse_h,
        stride_po_w, stride_po_q, stride_po_h, stride_pl_w, stride_pl_q,
    ) = outs  # fmt: skip
    lse = _row_lse(m_i, l_i)
    o = acc * (v_scale / _safe_sum(l_i))[None, :]
    qi_o, head_o, ok_o, _lim_o = _row_info(rb, qlen, kv_len, H, NR, gl.SliceLayout(0, LAYOUT))
    cols_o = COL_START + COL_STEP * gl.arange(0, L, layout=gl.SliceLayout(1, LAYOUT))
    if direct:
        tok_o = (q_start + qi_o).to(gl.int64)
        o_ptrs = out_ptr + (tok_o * stride_o_t + head_o * stride_o_h)[None, :] + cols_o[:, None]
        gl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=ok_o[None, :])
        if WRITE_LSE and STORE_LSE:
            gl.store(lse_ptr + tok_o * stride_lse_t + head_o * stride_lse_h, lse, mask=ok_o)
    else:
        wk = work.to(gl.int64)
        base = part_o_ptr + wk * stride_po_w + qi_o * stride_po_q + head_o * stride_po_h
        gl.store(base[None, :] + cols_o[:, None], o, mask=ok_o[None, :])
        if STORE_LSE:
            gl.store(part_lse_ptr + wk * stride_pl_w + qi_o * stride_pl_q + head_o, lse, mask=ok_o)


@gluon.jit(do_not_specialize=["num_splits"])
def mla_decode_rows_kernel(
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
    barrier_ptr,
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
    NR: gl.constexpr,
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
    FOLD_SPLITS: gl.constexpr,
    num_warps: gl.constexpr,
):
    gl.static_assert(num_warps == 4 or num_warps == 8, "one or two warpgroups")  # noqa: PLR1714 (constexprs)
    gl.static_assert(BLOCK_N == 64, "the KV tile is the wgmma M dimension (64 rows per warpgroup)")
    kv_dtype: gl.constexpr = kv_ptr.dtype.element_ty
    # The MMA operand dtype: the query's, or fp16 for per-tensor fp8 caches (fp8 -> fp16 is one
    # conversion per two values, fp16 holds every fp8 value exactly; the query is rounded to
    # fp16). fp8_ds_mla keeps the query's (bf16: its rope lanes are bf16, its scaled values may
    # pass fp16's range).
    dtype: gl.constexpr = gl.float16 if KV_FP8 and not KV_DS_MLA else q_nope_ptr.dtype.element_ty

    # Two warpgroups (8 warps) each own half of the NR query rows (the N dimension of both
    # products): both read the whole K tile, neither needs the other's softmax statistics.
    WARPGROUPS: gl.constexpr = num_warps // 4
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, WARPGROUPS], instr_shape=[16, NR // WARPGROUPS, 16]
    )
    ot_layout: gl.constexpr = st_layout
    lat_ld: gl.constexpr = _kv_copy_layouts(KV_FP8, num_warps)[0]
    rope_ld: gl.constexpr = _kv_copy_layouts(KV_FP8 and not KV_DS_MLA, num_warps)[1]
    id_ld: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    id_smem: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    # fp8: a ring of NUM_STAGES fp8 slots, all in flight while one widened fp16 tile feeds the
    # MMAs (a slot is refilled as soon as its tile is widened); token ids run a ring ahead.
    ID_SLOTS: gl.constexpr = 2 * NUM_STAGES
    mma_smem: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    p_smem_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=NR * 2, element_bitwidth=16, rank=2)

    # -- the work item (as in the 64-row kernel) -----------------------------------------------
    rb, work, req = _work_item(num_splits, work_info_ptr, ROW_BLOCKS, MODE)
    if MODE != 0:  # noqa: SIM102 (MODE is a constexpr: this if is resolved at compile time)
        if req < 0:
            return
    kv_start, kv_len, lo, hi, direct, q_start, qlen = _work_range(
        req, work, num_splits, kv_indptr_ptr, work_info_ptr, split_indptr_ptr, qo_indptr_ptr, lengths_ptr,
        MODE, UNIT_QLEN, BLOCK_N, HAS_LENGTHS,
    )  # fmt: skip
    qk_scale, v_scale = _scales(sm_scale_log2, kv_scale_ptr, KV_FP8 and not KV_DS_MLA)

    q_nope_smem = gl.allocate_shared_memory(dtype, [NR, L], mma_smem)
    q_pe_smem = gl.allocate_shared_memory(dtype, [NR, R], mma_smem)
    p_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, NR], p_smem_layout)
    idx_ring = gl.allocate_shared_memory(gl.int32, [ID_SLOTS, BLOCK_N], id_smem)
    lat_ring, rope_ring, lat_wide, rope_wide = _kv_rings(
        kv_dtype, dtype, NUM_STAGES, 1, BLOCK_N, L, R, KV_FP8, KV_DS_MLA
    )
    scale_ring = _scale_ring(NUM_STAGES, BLOCK_N, L) if KV_DS_MLA else None

    index_base = _key_operand(kv_indices_ptr, kv_start, req, stride_bt, row_request_ptr, PAGE_SIZE, ROW_MAP)
    id_limit = _id_limit(num_kv_rows, PAGE_SIZE)
    IN_PAGE: gl.constexpr = _tile_in_page(MODE, PAGE_SIZE, BLOCK_N)
    # Per-tensor fp8 refills a slot right after widening its tile, so all NUM_STAGES tiles start
    # in flight. fp8_ds_mla's MMAs read the bf16 rope lanes in the ring slot itself, so its slot
    # is refilled a tile later, as a 16-bit cache's.
    EARLY_REFILL: gl.constexpr = KV_FP8 and not KV_DS_MLA
    AHEAD: gl.constexpr = NUM_STAGES if EARLY_REFILL else NUM_STAGES - 1
    for j in gl.static_range(ID_SLOTS if EARLY_REFILL else 2 * NUM_STAGES - 1):
        _issue_ids(index_base, idx_ring, j, lo, hi, BLOCK_N, ID_SLOTS, id_ld, PAGE_SIZE)
    async_copy.commit_group()
    async_copy.wait_group(0)
    gl.thread_barrier()
    for st in gl.static_range(AHEAD):
        _issue_tile(
            kv_ptr, idx_ring, st, lo, hi, id_limit, stride_kv, lat_ring.index(st), rope_ring.index(st),
            L, R, BLOCK_N, ID_SLOTS, lat_ld, rope_ld, scale_ring, st, KV_DS_MLA, PAGE_SIZE, IN_PAGE,
        )  # fmt: skip
        async_copy.commit_group()

    # -- the NR query rows -----------------------------------------------------------------------
    _query_to_smem(
        q_nope_ptr, q_pe_ptr, q_nope_smem, q_pe_smem, rb, qlen, kv_len, q_start,
        stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h, H, NR, L, R,
    )  # fmt: skip

    _qi, _hd, _ok, row_limit = _row_info(rb, qlen, kv_len, H, NR, gl.SliceLayout(0, st_layout))
    # Keys past hi are masked by the row limit; ids outside the cache by _tile_key_limit (a tile
    # inside one page) or _ring_key_ok.
    row_limit = gl.minimum(row_limit, hi)
    m_i = gl.full([NR], float("-inf"), gl.float32, layout=gl.SliceLayout(0, st_layout))
    l_i = gl.zeros([NR], gl.float32, layout=gl.SliceLayout(0, st_layout))
    acc = gl.zeros([L, NR], gl.float32, layout=ot_layout)
    s_zero = gl.zeros([BLOCK_N, NR], gl.float32, layout=st_layout)
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, st_layout))

    n_tiles = gl.cdiv(hi - lo, BLOCK_N)
    for t in range(n_tiles):
        # Tile t's key check, from its id slot before this iteration's refill can reuse the slot
        # (with EARLY_REFILL the ids of tile t + ID_SLOTS go there).
        ids_t = idx_ring.index(t % ID_SLOTS)
        key_ok = None if IN_PAGE else _ring_key_ok(ids_t, id_limit, gl.SliceLayout(1, st_layout))
        limit = _tile_key_limit(ids_t, row_limit, hi, id_limit, IN_PAGE)
        if EARLY_REFILL:
            # Tile t landed (tiles t+1 .. t+NUM_STAGES-1 still in flight): widen it (the barrier
            # inside also tells that every warp is past the last tile's PV), then refill its slot
            # with tile t+NUM_STAGES, whose ids came with tile t, and fetch the ids a ring further.
            async_copy.wait_group(NUM_STAGES - 1)
            k_lat, k_rope = _mma_operands(
                lat_ring, rope_ring, lat_wide, rope_wide, t, NUM_STAGES, 1, BLOCK_N, True
            )
            ahead = t + NUM_STAGES
            _issue_tile(
                kv_ptr, idx_ring, ahead, lo, hi, id_limit, stride_kv, lat_ring.index(t % NUM_STAGES),
                rope_ring.index(t % NUM_STAGES), L, R, BLOCK_N, ID_SLOTS, lat_ld, rope_ld,
                scale_ring, t % NUM_STAGES, KV_DS_MLA, PAGE_SIZE, IN_PAGE,
            )  # fmt: skip
            _issue_ids(index_base, idx_ring, ahead + NUM_STAGES, lo, hi, BLOCK_N, ID_SLOTS, id_ld, PAGE_SIZE)
            async_copy.commit_group()
        else:
            k_lat, k_rope = _take_tile(
                kv_ptr, idx_ring, index_base, t, lo, hi, id_limit, stride_kv, lat_ring, rope_ring,
                lat_wide, rope_wide, 0, L, R, BLOCK_N, NUM_STAGES, 1, ID_SLOTS, KV_DS_MLA,
                lat_ld, rope_ld, id_ld, scale_ring, KV_DS_MLA, PAGE_SIZE, IN_PAGE,
            )  # fmt: skip
        sc = warpgroup_mma(k_lat, q_nope_smem.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        sc = warpgroup_mma(k_rope, q_pe_smem.permute((1, 0)), sc, is_async=True)
        n = t * BLOCK_N + lo + offs_n
        sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc,))

        p, alpha, m_i, l_i = _online_softmax(sc, m_i, l_i, n, key_ok, limit, qk_scale, 0)
        acc = acc * alpha[None, :]
        p_smem.store(p.to(dtype))
        fence_async_shared()
        gl.thread_barrier()
        acc = warpgroup_mma(k_lat.permute((1, 0)), p_smem, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    async_copy.wait_group(0)

    # -- epilogue --------------------------------------------------------------------------------
    outs = (
        out_ptr, lse_ptr, part_o_ptr, part_lse_ptr, stride_o_t, stride_o_h, stride_lse_t, stride_lse_h,
        stride_po_w, stride_po_q, stride_po_h, stride_pl_w, stride_pl_q,
    )  # fmt: skip
    _store_rows_output(
        acc, m_i, l_i, v_scale, rb, qlen, kv_len, q_start, work, direct, outs, H, NR, L, WRITE_LSE, ot_layout
    )
    if FOLD_SPLITS > 0:
        # The split reduce, in the kernel (a cooperative launch of FOLD_SPLITS splits a request).
        grid_barrier(barrier_ptr)
        merge_output_slice(
            part_o_ptr, part_lse_ptr, out_ptr, lse_ptr, req, work % FOLD_SPLITS, rb, q_start, qlen,
            stride_po_w, stride_po_q, stride_po_h, stride_pl_w, stride_pl_q,
            stride_o_t, stride_o_h, stride_lse_t, stride_lse_h,
            H, NR, L, FOLD_SPLITS, WRITE_LSE,
        )  # fmt: skip
