# mypy: disable-error-code="no-untyped-def, untyped-decorator"
"""Gluon MLA decode of 64 packed query rows on ``fp8_ds_mla`` rows: a producer that gathers each
tile's fp8 bytes into its bf16 ring slot and dequantizes them there, a scores warpgroup and an
output warpgroup.

At 64 rows and more (128 heads, or 64 heads × qlen 2) the 64-row kernel of :mod:`.kernels`
gathers each tile's fp8 rows into shared memory and both of its warpgroups dequantize them into
the bf16 MMA tile, then meet at a barrier; every tile's ``QKᵀ`` is split across them, so both
read the whole query tile, and the dequantization, the softmax and the MMAs run one after
another. Here the work is split in three partitions (``gl.warp_specialize``), handing tiles over
through mbarriers:

* the **producer** (the default partition, :data:`PRODUCER_WARPS` warps) copies each 64-token
  tile's fp8 latent by ``cp.async`` into the tile's own bf16 ring slot, 128 columns (one scale
  tile) a commit group, each chunk in the first half of the 16 KB its bf16 values take
  (:mod:`.ds_mla_words`); as each pair of chunks (0 and 1, 2 and 3) lands it reads both
  back, multiplies them by their rows' scales, writes the bf16 values over them (the MMA
  layout) and announces the pair on ``ready[slot·PAIRS + pair]``. Once a tile is announced, the
  next tile's copies go out half by half as the two warpgroups free the slot of the tile before,
  so up to a tile of bytes is in flight while the MMAs run, with no registers and no fp8 staging
  buffer: the query tile and the two-slot bf16 ring fill the shared memory. The bf16
  rope lanes go straight into the slot's rope tile (in the last chunk's group), and a word a
  key (0: its id is inside the cache, -1: not) into the slot's id word ring for the key check;
* the **scores** warpgroup (``SCORE_REGS``) runs every tile's ``S = q·Kᵀ`` two chunks at a time
  as the pairs are announced (the query's rope lanes held in its registers, the A operand of the
  rope step, so that step reads only the keys from shared memory), the online softmax, publishes
  ``P`` and the rescale ``alpha`` in shared memory (``p_ready``), and adds ``P·V`` over output
  columns ``[0, L/2)`` with ``P`` from registers;
* the **output** warpgroup (``OUTPUT_REGS``) adds every tile's ``P·V`` over columns ``[L/2, L)``
  with ``P`` from shared memory after rescaling by ``alpha``, then frees ``P`` (``p_free``).

A ring slot is released by halves: the scores warpgroup frees latent columns ``[0, L/2)`` (its
``QKᵀ`` of the tile is done before its ``P·V``), the output warpgroup the other half and the rope
(its ``P·V`` starts after the tile's ``P``, so after its ``QKᵀ``). Each of a warpgroup's 128
threads arrives on the slot's ``empty`` barrier (and the output warpgroup's on ``p_free``) once
its own wait for the ``P·V`` returned (:func:`.kernels._release`), with no barrier among the
warpgroup's warps before it. This is the split of
FlashMLA's sparse decode on Hopper; at 128 heads its two CTAs of a cluster share the
dequantization, which Gluon cannot express with Triton 3.6 (``docs/performance.md``), so each
program here dequantizes every key its rows attend.

Work items, masking, NaN rules and outputs are those of :mod:`.pingpong` (a 16-bit output leaves
through ring slot 0, dead by then, in 16-byte stores). The MMAs run in bf16 (the query is bf16).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from mla.providers.gluon.ds_mla_words import (
    CHUNK,
    _chunk_layout,
    _row_scales,
    _stage_chunk,
    _stage_rope,
    _tile_words,
    _widen_staged_pair,
)
from mla.providers.gluon.kernels import (
    MMA_TILE_LAYOUT,
    RELEASE_ARRIVALS,
    _id_limit,
    _key_operand,
    _online_softmax,
    _query_copy,
    _release,
    _ring_key_ok,
    _row_info,
    _row_lse,
    _safe_sum,
    _store_staged,
    _tile_ids,
    _work_item,
    _work_range,
)
from mla.providers.gluon.pingpong import _slot

PRODUCER_WARPS = gl.constexpr(4)
"""Warps of the producer, the default partition (the launch's ``num_warps``). Not 8: a program of
512 threads is compiled at 128 registers a thread (the register file over its threads), and
ptxas then refuses the MMA warpgroups' ``wgmma``, which need 158 (sm_90 compile)."""
SCORE_REGS = 224
"""Registers per scores-warpgroup thread (``setmaxnreg``): the 64×256 fp32 output half is 128,
the 64×64 scores 32, the query's ``[64, 64]`` rope box 16 (sm_90 compile: no spills at 224)."""
OUTPUT_REGS = 160
"""Registers per output-warpgroup thread: its 64×256 fp32 output half is 128. The producer gets
the rest of the register file (120 a thread in the sm_90 build). When a partition needs more
than its budget, ptxas drops every ``setmaxnreg`` (at 152 here the whole program ran at 168
registers and spilled)."""
CHUNKS = gl.constexpr(4)
"""Chunks per 512-wide latent row."""
PAIRS = gl.constexpr(2)
"""Pairs of chunks a tile: the producer dequantizes and announces two chunks at a time."""
NUM_STAGES = gl.constexpr(2)
"""bf16 ring slots (each a 64-token tile of latent and rope)."""


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
def _widen_pair_and_announce(words, lat, scale_a, scale_b, ready, s, C: gl.constexpr):
    """Chunks ``C`` and ``C + 1`` of ring slot ``s`` dequantized in place together
    (:func:`.ds_mla_words._widen_staged_pair`; both groups have landed) and announced on
    ``ready[s·PAIRS + C / 2]``."""
    _widen_staged_pair(words, lat, scale_a, scale_b, C)
    mbarrier.arrive(ready.index(s * PAIRS + C // 2))


@gluon.jit
def _producer(
    kv_ptr, index_base, lo, hi, id_limit, stride_kv, lat_ring, rope_ring, id_ring, ready, empty,
    L: gl.constexpr, R: gl.constexpr, BLOCK_N: gl.constexpr, PAGE_SIZE: gl.constexpr,
):  # fmt: skip
    """The producer partition: tile ``t``'s fp8 bytes land by ``cp.async`` inside its own
    bf16 ring slot (chunk ``c`` in the first half of the 16 KB its bf16 values take) and are
    dequantized there two chunks at a time as their groups land. Once the whole tile is
    announced, tile ``t + 1``'s copies go out half by half as the two warpgroups free the slot of
    tile ``t - 1`` (the scores warpgroup frees its half just before its ``QKᵀ`` of tile ``t``,
    so waiting for it before dequantizing chunks 2 and 3 would stall that ``QKᵀ``). Token ids
    are loaded two tiles ahead, scales one tile ahead (one 16-byte load a row, in registers)."""
    rows: gl.constexpr = gl.SliceLayout(1, _chunk_layout(PRODUCER_WARPS))
    n_tiles = gl.cdiv(hi - lo, BLOCK_N)
    ids, ok = _tile_ids(index_base, lo, hi, 0, id_limit, BLOCK_N, rows, PAGE_SIZE)
    row = kv_ptr + ids.to(gl.int64) * stride_kv
    nids, nok = _tile_ids(index_base, lo, hi, 1, id_limit, BLOCK_N, rows, PAGE_SIZE)
    s0, s1, s2, s3 = _row_scales(row, ok, L)
    live = n_tiles > 0
    words = _tile_words(lat_ring.index(0))
    _stage_half(words, rope_ring.index(0), id_ring.index(0), empty[0].index(0), 0, row, ok, live, 0, L, R)
    _stage_half(words, rope_ring.index(0), id_ring.index(0), empty[1].index(0), 0, row, ok, live, 1, L, R)
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
        async_copy.wait_group(2)
        _widen_pair_and_announce(words, lat, s0, s1, ready, s, 0)
        async_copy.wait_group(0)
        _widen_pair_and_announce(words, lat, s2, s3, ready, s, 2)
        _stage_half(
            next_words, rope_ring.index(u), id_ring.index(u), empty[0].index(u), next_phase, nrow, nok,
            next_live, 0, L, R,
        )  # fmt: skip
        n0, n1, n2, n3 = _row_scales(nrow, nok, L)
        _stage_half(
            next_words, rope_ring.index(u), id_ring.index(u), empty[1].index(u), next_phase, nrow, nok,
            next_live, 1, L, R,
        )  # fmt: skip
        s0, s1, s2, s3 = n0, n1, n2, n3
        nids, nok = nnids, nnok
    # No copy of these threads outlives the program.
    async_copy.wait_group(0)


@gluon.jit
def _tile_scores(q_nope_smem, q_pe, lat_ring, rope_ring, ready, s_zero, t, hi):
    """Issue ``S = q·Kᵀ`` for tile ``t`` (asynchronous), two chunks at a time as the producer
    announces each pair."""
    s = _slot(t, hi, NUM_STAGES)
    phase = (t // NUM_STAGES) & 1
    lat = lat_ring.index(s)
    sc = s_zero
    for c in gl.static_range(CHUNKS):
        if c % 2 == 0:
            mbarrier.wait(ready.index(s * PAIRS + c // 2), phase)
            fence_async_shared()
        k = lat.slice(c * CHUNK, CHUNK, dim=1).permute((1, 0))
        sc = warpgroup_mma(q_nope_smem.slice(c * CHUNK, CHUNK, dim=1), k, sc, use_acc=c > 0, is_async=True)
    return warpgroup_mma(q_pe, rope_ring.index(s).permute((1, 0)), sc, is_async=True)


@gluon.jit
def _store_half(
    acc, l_o, lat_ring, out_ptr, part_o_ptr, rb, qlen, kv_len, q_start, work, direct,
    stride_o_t, stride_o_h, stride_po_w, stride_po_q, stride_po_h,
    W: gl.constexpr, H: gl.constexpr, BLOCK_M: gl.constexpr, COLS: gl.constexpr, O_LAYOUT: gl.constexpr,
):  # fmt: skip
    """Output columns ``[W·COLS, (W+1)·COLS)`` of the row block: ``acc / l`` into the output
    (16-bit: staged in this warpgroup's column half of ring slot 0, dead by then) or the split's
    fp32 partial."""
    o_rows: gl.constexpr = gl.SliceLayout(1, O_LAYOUT)
    o = acc / _safe_sum(l_o)[:, None]
    qi_o, head_o, ok_o, _lim_o = _row_info(rb, qlen, kv_len, H, BLOCK_M, o_rows)
    cols_o = W * COLS + gl.arange(0, COLS, layout=gl.SliceLayout(0, O_LAYOUT))
    if direct:
        if out_ptr.dtype.element_ty == lat_ring.dtype:
            stage = lat_ring.index(0).slice(W * COLS, COLS, dim=1)
            _store_staged(
                o.to(lat_ring.dtype), stage, out_ptr, rb, qlen, kv_len, q_start, stride_o_t, stride_o_h,
                H, BLOCK_M, W * COLS,
            )  # fmt: skip
        else:
            tok_o = (q_start + qi_o).to(gl.int64)
            o_ptrs = out_ptr + tok_o[:, None] * stride_o_t + head_o[:, None] * stride_o_h + cols_o[None, :]
            gl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=ok_o[:, None])
    else:
        wk = work.to(gl.int64)
        po_ptrs = part_o_ptr + wk * stride_po_w + qi_o[:, None] * stride_po_q + head_o[:, None] * stride_po_h
        gl.store(po_ptrs + cols_o[None, :], o, mask=ok_o[:, None])


@gluon.jit
def _scores_warpgroup(args, H: gl.constexpr, L: gl.constexpr, BLOCK_N: gl.constexpr, WRITE_LSE: gl.constexpr):
    """Every tile's ``QKᵀ`` and online softmax, ``P`` and ``alpha`` published for the output
    warpgroup, ``P·V`` over output columns ``[0, L/2)``; then those columns, the final row sum
    (for the output warpgroup, on ``done``) and the LSE. ``args``: the kernel's buffers,
    barriers, output pointers and strides and work item."""
    (
        q_nope_smem, q_pe_smem, lat_ring, rope_ring, id_ring, p_smem, alpha_smem, l_smem,
        ready, empty, p_ready, p_free, done,
        out_ptr, lse_ptr, part_o_ptr, part_lse_ptr, lo, hi, kv_len, qlen, q_start, rb, work, direct,
        id_limit, stride_o_t, stride_o_h, stride_lse_t, stride_lse_h, stride_po_w, stride_po_q,
        stride_po_h, stride_pl_w, stride_pl_q, qk_scale,
    ) = args  # fmt: skip
    BLOCK_M: gl.constexpr = 64
    COLS: gl.constexpr = L // 2
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, COLS, 16]
    )
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    keys: gl.constexpr = gl.SliceLayout(0, s_layout)
    # The partition reads its arguments before anything of it writes shared memory.
    gl.thread_barrier()
    _qi, _hd, _ok, row_limit = _row_info(rb, qlen, kv_len, H, BLOCK_M, s_rows)
    row_limit = gl.minimum(row_limit, hi)
    offs_n = gl.arange(0, BLOCK_N, layout=keys)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    acc = gl.zeros([BLOCK_M, COLS], gl.float32, layout=o_layout)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=s_rows)
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=s_rows)
    n_tiles = gl.cdiv(hi - lo, BLOCK_N)
    # The query's rope lanes in registers, the A operand of every tile's last QKᵀ step, once the
    # query's copies landed (the producer announces tile 0's first pair after them).
    if n_tiles > 0:
        mbarrier.wait(ready.index(0), 0)
    q_pe = q_pe_smem.load(gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2))
    # (once here, or the compiler puts a barrier before every tile's first wait on ``ready``)
    gl.thread_barrier()
    for t in range(n_tiles):
        sc = _tile_scores(q_nope_smem, q_pe, lat_ring, rope_ring, ready, s_zero, t, hi)
        s = _slot(t, hi, NUM_STAGES)
        scores = warpgroup_mma_wait(num_outstanding=0, deps=(sc,))
        key_ok = _ring_key_ok(id_ring.index(s), id_limit, keys)
        limit = row_limit - (t * BLOCK_N + lo)
        p, alpha, m_i, l_i = _online_softmax(scores, m_i, l_i, offs_n, key_ok, limit, qk_scale, 1)
        p16 = p.to(p_smem.dtype)
        # The output warpgroup is done with the previous P and alpha (phase 0: pre-arrived).
        mbarrier.wait(p_free, t & 1)
        p_smem.store(p16)
        alpha_smem.store(alpha)
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(p_ready)
        acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
        v = lat_ring.index(s).slice(0, COLS, dim=1)
        acc = warpgroup_mma(gl.convert_layout(p16, p_layout), v, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        # (each thread: its wgmma reads waited for, its loads of the slot's ids used)
        _release(empty[0].index(s))
    # The final row sum for the output warpgroup.
    l_smem.store(l_i)
    gl.thread_barrier()
    mbarrier.arrive(done)
    _store_half(
        acc, gl.convert_layout(l_i, o_rows), lat_ring, out_ptr, part_o_ptr, rb, qlen, kv_len, q_start, work,
        direct, stride_o_t, stride_o_h, stride_po_w, stride_po_q, stride_po_h, 0, H, BLOCK_M, COLS, o_layout,
    )  # fmt: skip
    lse = _row_lse(m_i, l_i)
    qi_s, head_s, ok_s, _lim_s = _row_info(rb, qlen, kv_len, H, BLOCK_M, s_rows)
    if direct:
        if WRITE_LSE:
            tok_s = (q_start + qi_s).to(gl.int64)
            gl.store(lse_ptr + tok_s * stride_lse_t + head_s * stride_lse_h, lse, mask=ok_s)
    else:
        wk = work.to(gl.int64)
        gl.store(part_lse_ptr + wk * stride_pl_w + qi_s * stride_pl_q + head_s, lse, mask=ok_s)


@gluon.jit
def _output_warpgroup(args, H: gl.constexpr, L: gl.constexpr, BLOCK_N: gl.constexpr):
    """Every tile's ``P·V`` over output columns ``[L/2, L)`` with the scores warpgroup's ``P``
    (rescaled by its ``alpha`` first); then those columns, divided by the final row sum.
    ``args``: the buffers, barriers, work item and output strides it uses."""
    (
        lat_ring, p_smem, alpha_smem, l_smem, empty, p_ready, p_free, done, out_ptr, part_o_ptr,
        lo, hi, kv_len, qlen, q_start, rb, work, direct, stride_o_t, stride_o_h, stride_po_w,
        stride_po_q, stride_po_h,
    ) = args  # fmt: skip
    BLOCK_M: gl.constexpr = 64
    COLS: gl.constexpr = L // 2
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, COLS, 16]
    )
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    gl.thread_barrier()
    acc = gl.zeros([BLOCK_M, COLS], gl.float32, layout=o_layout)
    n_tiles = gl.cdiv(hi - lo, BLOCK_N)
    for t in range(n_tiles):
        s = _slot(t, hi, NUM_STAGES)
        mbarrier.wait(p_ready, t & 1)
        fence_async_shared()
        acc = acc * alpha_smem.load(o_rows)[:, None]
        v = lat_ring.index(s).slice(COLS, COLS, dim=1)
        acc = warpgroup_mma(p_smem, v, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        _release(p_free)
        _release(empty[1].index(s))
    mbarrier.wait(done, 0)
    l_o = l_smem.load(o_rows)
    _store_half(
        acc, l_o, lat_ring, out_ptr, part_o_ptr, rb, qlen, kv_len, q_start, work, direct,
        stride_o_t, stride_o_h, stride_po_w, stride_po_q, stride_po_h, 1, H, BLOCK_M, COLS, o_layout,
    )  # fmt: skip


# ``num_splits`` is never specialised (as in :mod:`.kernels`).
@gluon.jit(do_not_specialize=["num_splits"])
def mla_decode_ds_mla_heads_kernel(
    q_nope_ptr, q_pe_ptr, kv_ptr, kv_indptr_ptr, kv_indices_ptr, qo_indptr_ptr, work_info_ptr,
    split_indptr_ptr, out_ptr, lse_ptr, part_o_ptr, part_lse_ptr, kv_scale_ptr, num_splits,
    stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h, stride_kv, stride_o_t, stride_o_h,
    stride_lse_t, stride_lse_h, stride_po_w, stride_po_q, stride_po_h, stride_pl_w, stride_pl_q,
    sm_scale_log2, num_kv_rows, stride_bt, row_request_ptr, lengths_ptr, H: gl.constexpr, L: gl.constexpr,
    R: gl.constexpr, BLOCK_N: gl.constexpr, ROW_BLOCKS: gl.constexpr,
    MODE: gl.constexpr, UNIT_QLEN: gl.constexpr, WRITE_LSE: gl.constexpr, PAGE_SIZE: gl.constexpr,
    ROW_MAP: gl.constexpr, HAS_LENGTHS: gl.constexpr, SCORE_REGS: gl.constexpr, OUTPUT_REGS: gl.constexpr,
    num_warps: gl.constexpr,
):  # fmt: skip
    """``fp8_ds_mla`` rows (``kv_ptr`` an fp8 view of the byte rows), 64 packed query rows a
    program; operands and work items as :func:`.pingpong.mla_decode_pingpong_kernel`'s
    (``kv_scale_ptr`` unused: the rows carry their scales)."""
    BLOCK_M: gl.constexpr = 64
    gl.static_assert(num_warps == PRODUCER_WARPS, "the launch's warps are the producer")
    gl.static_assert(BLOCK_N == 64, "64-token tiles (the QKᵀ N of the scores warpgroup)")
    gl.static_assert(L == CHUNK * CHUNKS, "the latent row is CHUNKS scale tiles of CHUNK columns")
    dtype: gl.constexpr = q_nope_ptr.dtype.element_ty
    vec_smem: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])

    rb, work, req = _work_item(num_splits, work_info_ptr, ROW_BLOCKS, MODE)
    if MODE != 0:  # noqa: SIM102 (MODE is a constexpr: this if is resolved at compile time)
        if req < 0:
            return
    kv_start, kv_len, lo, hi, direct, q_start, qlen = _work_range(
        req, work, num_splits, kv_indptr_ptr, work_info_ptr, split_indptr_ptr, qo_indptr_ptr, lengths_ptr,
        MODE, UNIT_QLEN, BLOCK_N, HAS_LENGTHS,
    )  # fmt: skip

    q_nope_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, L], MMA_TILE_LAYOUT)
    q_pe_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, R], MMA_TILE_LAYOUT)
    lat_ring = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, L], MMA_TILE_LAYOUT)
    rope_ring = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, R], MMA_TILE_LAYOUT)
    id_ring = gl.allocate_shared_memory(gl.int32, [NUM_STAGES, BLOCK_N], vec_smem)  # 0 / -1 a key
    p_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_N], MMA_TILE_LAYOUT)
    alpha_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M], vec_smem)
    l_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M], vec_smem)
    # ready[s·PAIRS + p]: chunks 2p and 2p + 1 of slot s are in (the producer's one arrival; the
    # last pair's also waits for the rope copies); empty[w][s]: warpgroup w is done with its half
    # of slot s (two allocations: the compiler's barrier analysis tells a wait on one from a wait
    # on the other, where it puts a warp barrier between two waits on one allocation).
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES * PAIRS, 1], mbarrier.MBarrierLayout())
    empty = (
        gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout()),
        gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout()),
    )
    p_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    p_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES * PAIRS):
        mbarrier.init(ready.index(i), count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(empty[0].index(i), count=RELEASE_ARRIVALS)
        mbarrier.init(empty[1].index(i), count=RELEASE_ARRIVALS)
    mbarrier.init(p_ready, count=1)
    mbarrier.init(p_free, count=RELEASE_ARRIVALS)
    mbarrier.init(done, count=1)
    # Every ring slot and the P buffer start free.
    for i in gl.static_range(NUM_STAGES):
        mbarrier.arrive(empty[0].index(i), count=RELEASE_ARRIVALS)
        mbarrier.arrive(empty[1].index(i), count=RELEASE_ARRIVALS)
    mbarrier.arrive(p_free, count=RELEASE_ARRIVALS)

    _query_copy(
        q_nope_ptr, q_pe_ptr, q_nope_smem, q_pe_smem, rb, qlen, kv_len, q_start,
        stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h, H, BLOCK_M, L, R,
    )  # fmt: skip
    fence_async_shared()
    gl.thread_barrier()

    index_base = _key_operand(kv_indices_ptr, kv_start, req, stride_bt, row_request_ptr, PAGE_SIZE, ROW_MAP)
    id_limit = _id_limit(num_kv_rows, PAGE_SIZE)
    scores_args = (
        q_nope_smem, q_pe_smem, lat_ring, rope_ring, id_ring, p_smem, alpha_smem, l_smem,
        ready, empty, p_ready, p_free, done,
        out_ptr, lse_ptr, part_o_ptr, part_lse_ptr, lo, hi, kv_len, qlen, q_start, rb, work, direct,
        id_limit, stride_o_t, stride_o_h, stride_lse_t, stride_lse_h, stride_po_w, stride_po_q,
        stride_po_h, stride_pl_w, stride_pl_q, sm_scale_log2,
    )  # fmt: skip
    output_args = (
        lat_ring, p_smem, alpha_smem, l_smem, empty, p_ready, p_free, done, out_ptr, part_o_ptr,
        lo, hi, kv_len, qlen, q_start, rb, work, direct, stride_o_t, stride_o_h, stride_po_w,
        stride_po_q, stride_po_h,
    )  # fmt: skip
    gl.warp_specialize(
        [
            (
                _producer,
                (
                    kv_ptr, index_base, lo, hi, id_limit, stride_kv, lat_ring, rope_ring, id_ring, ready,
                    empty, L, R, BLOCK_N, PAGE_SIZE,
                ),
            ),
            (_scores_warpgroup, (scores_args, H, L, BLOCK_N, WRITE_LSE)),
            (_output_warpgroup, (output_args, H, L, BLOCK_N)),
        ],
        [4, 4],
        [SCORE_REGS, OUTPUT_REGS],
    )  # fmt: skip


__all__ = ["mla_decode_ds_mla_heads_kernel"]
