# mypy: disable-error-code="no-untyped-def, untyped-decorator"
"""Gluon (Hopper) MLA decode for 64 packed query rows, two MMA warpgroups in ping-pong.

The 64-row kernel of :mod:`.kernels` splits every product of a KV tile across its two
warpgroups, so both read the whole 64×576 query tile for QKᵀ of every tile and the tile's
QKᵀ, softmax and PV run one after another. Here (the split FlashMLA uses on Hopper) the
warpgroups take **alternate 64-token tiles** for QKᵀ and the softmax, and both add every
tile's ``P·V`` into the half of the 64×512 output they own:

* warpgroup ``w`` owns tiles ``t ≡ w (mod 2)``: ``S = q·Kᵀ`` (N = 64: the query tile is read
  once per tile), the online softmax against the running row max left by the other warpgroup's
  tile ``t - 1`` (in shared memory), then ``P`` (16-bit), the rescale ``alpha``, the new row
  max and row sum into shared memory, announced on ``p_ready[t % 2]``;
* both warpgroups rescale their 64×256 fp32 output half by ``alpha`` and add ``P·V_t`` over
  their 256 columns: the owner with ``P`` from registers, the other with ``P`` from shared
  memory, after the announcement. While one warpgroup runs its softmax, the other runs MMAs.

One ``P`` buffer suffices: the warpgroup that overwrites it with ``P_{t+1}`` is the one that
read ``P_t`` from it (and waited for that MMA), and the owner of ``t`` reads ``P_t`` from
registers. The running row sum travels with the row max (each tile's owner publishes both), so
after the last tile both warpgroups hold the final ones and exchange nothing more. While a
warpgroup runs the softmax of its tile ``t`` the ``P·V`` of the other's tile ``t - 1`` is in
flight (the first tile is peeled off the loop, which then has no branch: ptxas serialises wgmma
around branches that touch the accumulators).

A **loader** warpgroup (the default partition, so the MMA partitions' reductions stay within
warps) gathers the KV tiles by token id with ``cp.async`` into a two-stage ring. A slot is
released and refilled **by halves**: warpgroup ``w`` frees latent columns
``[256·w, 256·(w+1))`` (the second half with the rope part) when its ``P·V`` is done
(``empty[s·2 + w]``), and the loader refills the half the tile's owner frees first, first.
Each 128-column chunk lands on its own barrier (``ready[s·CHUNKS + c]``: one arrival per loader
thread), and ``QKᵀ`` runs chunk by chunk as they land, starting with the owner's half. Without
the halves and chunks both MMA warpgroups spent most of their time waiting for whole tiles
(the halves and chunks took about 7% off both 64-row cases: ``docs/performance.md``).

Each MMA warpgroup publishes its row max, rescale and row sum in a buffer of its own (one writer,
one reader); the warpgroup owning the last tile writes the LSE. compute-sanitizer's racecheck
flags none of the kernel's buffers, only ``gl.warp_specialize``'s start-up hand-off (as the
probe ``probes/ws_mbarrier_probe.py`` shows). Picked by the planner's kernel table
(``GluonKernel.PINGPONG``) for every 64-row tile of a 16-bit cache (fp8 caches run on
:mod:`.kernels`). Work items, masking, NaN rules and outputs are those of :mod:`.kernels`; a
16-bit output leaves through shared memory (each MMA warpgroup's half staged in its own column
half of ring slot 0, dead by then) in 16-byte stores: with 4-byte stores from the accumulator
layout the epilogue of a sparse prefill program took about 5 µs of its 80.
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

from mla.providers.gluon.kernels import (
    _id_limit,
    _key_operand,
    _online_softmax,
    _query_copy,
    _ring_key_ok,
    _row_info,
    _row_lse,
    _safe_sum,
    _slot_block,
    _store_staged,
    _tile_ids,
    _tile_in_page,
    _work_item,
    _work_range,
)

LOADER_WARPS = gl.constexpr(4)
"""Warps of the loader, the default partition (the launch's ``num_warps``)."""
CHUNK = gl.constexpr(128)
"""Latent columns per ``ready`` barrier: QKᵀ of a tile starts when its first chunk lands."""
CHUNKS = gl.constexpr(4)
"""Chunks per 512-wide latent row (the second half's last one also brings the rope part)."""
MMA_REGS = gl.constexpr(232)
"""Registers per MMA-warpgroup thread (``setmaxnreg``): the 64×256 fp32 output half is 128."""


@gluon.jit
def _load_half(
    kv_row, ok, lat_slot, rope_slot, ready, empty, s, phase,
    HALF: gl.constexpr, L: gl.constexpr, R: gl.constexpr, LD: gl.constexpr, ids=None,
):  # fmt: skip
    """Once its last reader released it, fill one half of ring slot ``s``: latent columns
    ``[HALF·L/2, (HALF+1)·L/2)`` (and, for ``HALF == 1``, the rope part) for the rows ``kv_row``
    (``[BLOCK_N, 1]`` pointers to each token's row); each ``CHUNK`` of columns arrives on its
    own ``ready`` barrier; ``ids``: the tile's ``(id slot, sources, mask)`` (the owner's half)."""
    mbarrier.wait(empty.index(s * 2 + HALF), phase)
    if ids is not None:
        async_copy.async_copy_global_to_shared(ids[0], ids[1], mask=ids[2])
    for i in gl.static_range(CHUNKS // 2):
        _load_chunk(kv_row, ok, lat_slot, rope_slot, ready, s, HALF * (CHUNKS // 2) + i, L, R, LD)


@gluon.jit
def _load_chunk(
    kv_row, ok, lat_slot, rope_slot, ready, s, C: gl.constexpr, L: gl.constexpr, R: gl.constexpr,
    LD: gl.constexpr,
):  # fmt: skip
    """Chunk ``C`` of a tile (the last one with the rope part) into ring slot ``s``, announced
    on ``ready[s·CHUNKS + C]`` when this thread's copies land."""
    cols = gl.arange(0, CHUNK, layout=gl.SliceLayout(0, LD))
    dst = lat_slot.slice(C * CHUNK, CHUNK, dim=1)
    async_copy.async_copy_global_to_shared(dst, kv_row + (C * CHUNK + cols)[None, :], mask=ok[:, None])
    if C == CHUNKS - 1:
        cr = gl.arange(0, R, layout=gl.SliceLayout(0, LD))
        async_copy.async_copy_global_to_shared(rope_slot, kv_row + (L + cr)[None, :], mask=ok[:, None])
    async_copy.mbarrier_arrive(ready.index(s * CHUNKS + C), increment_count=False)


@gluon.jit
def _loader(
    kv_ptr, index_base, lo, hi, id_limit, stride_kv, lat_ring, rope_ring, id_ring, ready, empty,
    L: gl.constexpr, R: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
    PAGE_SIZE: gl.constexpr, IN_PAGE: gl.constexpr,
):  # fmt: skip
    """The loader partition: every tile of ``[lo, hi)`` into ring slot ``t % NUM_STAGES``, half
    by half as the MMA warpgroups release them (the half its owner frees first, first). Token
    ids are loaded one tile ahead. The copy layout puts 8 threads on each 128-byte row segment
    (one swizzle line: no bank conflicts) and 4 rows on each thread, so the ids and addresses
    fit the few registers this partition keeps. What the key operand holds for a tile's positions
    goes into ``id_ring`` as well, for the MMA warpgroups' key check (:func:`_id_copy`)."""
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [LOADER_WARPS, 1], [1, 0])
    rows: gl.constexpr = gl.SliceLayout(1, ld)
    n_tiles = gl.cdiv(hi - lo, BLOCK_N)
    ids, ok = _tile_ids(index_base, lo, hi, 0, id_limit, BLOCK_N, rows, PAGE_SIZE)
    for t in range(n_tiles):
        s = t % NUM_STAGES
        phase = (t // NUM_STAGES) & 1
        nids, nok = _tile_ids(index_base, lo, hi, t + 1, id_limit, BLOCK_N, rows, PAGE_SIZE)
        kv_row = kv_ptr + ids.to(gl.int64)[:, None] * stride_kv
        lat, rope = lat_ring.index(s), rope_ring.index(s)
        ids_in = _id_copy(id_ring.index(s), index_base, lo, hi, t, id_limit, BLOCK_N, PAGE_SIZE, IN_PAGE)
        if t % 2 == 0:
            _load_half(kv_row, ok, lat, rope, ready, empty, s, phase, 0, L, R, ld, ids_in)
            _load_half(kv_row, ok, lat, rope, ready, empty, s, phase, 1, L, R, ld)
        else:
            _load_half(kv_row, ok, lat, rope, ready, empty, s, phase, 1, L, R, ld, ids_in)
            _load_half(kv_row, ok, lat, rope, ready, empty, s, phase, 0, L, R, ld)
        ids, ok = nids, nok
    # No copy of these threads outlives the program (the query tile's, when there is no tile).
    async_copy.commit_group()
    async_copy.wait_group(0)


@gluon.jit
def _id_copy(
    id_slot, index_base, lo, hi, t, id_limit, BLOCK_N: gl.constexpr, PAGE_SIZE: gl.constexpr,
    IN_PAGE: gl.constexpr,
):  # fmt: skip
    """The copy (destination, sources, mask) of tile ``t``'s id-ring slot: what the key operand
    holds for its positions; with ``IN_PAGE`` one word, the tile's block id where that is outside
    the cache (never 0: the kernel runs no tile when no block is inside) and 0 (masked: zero-fill)
    where inside, so the MMA warpgroups check a tile against 0, without the cache's bound."""
    one: gl.constexpr = gl.BlockedLayout([1], [32], [LOADER_WARPS], [0])
    if IN_PAGE:  # (the tile's first position is < hi: t is a tile of the range)
        src = index_base + (lo + t * BLOCK_N + gl.zeros([1], gl.int32, layout=one)) // PAGE_SIZE
        copy = (id_slot.slice(0, 1), src, gl.load(src).to(gl.uint32, bitcast=True) >= id_limit)
    else:
        n = lo + t * BLOCK_N + gl.arange(0, BLOCK_N, layout=one)
        copy = (id_slot, index_base + n // (PAGE_SIZE if PAGE_SIZE > 0 else 1), n < hi)
    return copy


@gluon.jit
def _slot(t, hi, NUM_STAGES: gl.constexpr):
    """Ring slot of tile ``t``. With two stages and alternate tiles a warpgroup's own tiles all
    land in one slot; the compiler then folds the slot and keeps a wgmma descriptor per K step
    live across the loop (register spills). ``hi // (hi + 1)`` (0, as ``hi >= 0``) keeps the
    slot a run-time value."""
    return (t + hi // (hi + 1)) % NUM_STAGES


@gluon.jit
def _scores(
    q_nope_smem, q_pe_smem, lat_ring, rope_ring, ready, s_zero, t, hi,
    W: gl.constexpr, NUM_STAGES: gl.constexpr,
):  # fmt: skip
    """Issue ``S = q·Kᵀ`` for tile ``t`` (asynchronous), chunk by chunk as the columns land,
    starting with the half warpgroup ``W`` itself released (the one the loader refilled first)."""
    s = _slot(t, hi, NUM_STAGES)
    phase = (t // NUM_STAGES) & 1
    lat = lat_ring.index(s)
    sc = s_zero
    for i in gl.static_range(CHUNKS):
        # (the chunk index is written inline: a name assigned in the loop would be a run-time value)
        sc = _chunk_scores(
            q_nope_smem, q_pe_smem, lat, rope_ring.index(s), ready, sc, s, phase,
            (i + W * (CHUNKS // 2)) % CHUNKS, i > 0,
        )  # fmt: skip
    return sc


@gluon.jit
def _chunk_scores(
    q_nope_smem, q_pe_smem, lat, rope, ready, sc, s, phase, C: gl.constexpr, USE_ACC: gl.constexpr
):  # fmt: skip
    """Wait for chunk ``C`` of ring slot ``s`` and issue its part of ``S = q·Kᵀ``."""
    mbarrier.wait(ready.index(s * CHUNKS + C), phase)
    fence_async_shared()
    k = lat.slice(C * CHUNK, CHUNK, dim=1).permute((1, 0))
    sc = warpgroup_mma(q_nope_smem.slice(C * CHUNK, CHUNK, dim=1), k, sc, use_acc=USE_ACC, is_async=True)
    if C == CHUNKS - 1:
        sc = warpgroup_mma(q_pe_smem, rope.permute((1, 0)), sc, is_async=True)
    return sc


@gluon.jit
def _add_own_tile(
    lat_ring, p_smem, m_smem, alpha_smem, l_smem, p_ready, empty, acc, p, alpha, m_i, l_i, t, hi,
    W: gl.constexpr, COLS: gl.constexpr, NUM_STAGES: gl.constexpr, O_ROWS: gl.constexpr,
    P_LAYOUT: gl.constexpr,
):  # fmt: skip
    """Publish this warpgroup's tile ``t`` (``P``, ``alpha``, the running row max and row sum
    into shared memory, announced on ``p_ready``), then ``acc = alpha·acc + P·V_t`` over this
    warpgroup's columns with ``P`` from registers; release the ring slot. Returns the output and
    the running row sum in the output's row layout."""
    p16 = p.to(p_smem.dtype)
    # This warpgroup's reads of the previous P, alpha and row max are done (it waited for its
    # P·V of tile t - 1), and the other warpgroup reads them only after p_ready.
    p_smem.store(p16)
    alpha_smem.index(W).store(alpha)
    m_smem.index(W).store(m_i)
    l_smem.index(W).store(l_i)
    fence_async_shared()
    gl.thread_barrier()
    # alpha and the row sum in the output's row layout, read back before the announcement lets
    # the other warpgroup (the owner of tile t + 1) overwrite them.
    alpha_o = alpha_smem.index(W).load(O_ROWS)
    l_o = l_smem.index(W).load(O_ROWS)
    gl.thread_barrier()
    mbarrier.arrive(p_ready.index(t % 2))
    acc = acc * alpha_o[:, None]
    s = _slot(t, hi, NUM_STAGES)
    v = lat_ring.index(s).slice(W * COLS, COLS, dim=1)
    acc = warpgroup_mma(gl.convert_layout(p16, P_LAYOUT), v, acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    mbarrier.arrive(empty.index(s * 2 + W))
    return acc, l_o


@gluon.jit
def _issue_other_tile(
    lat_ring, p_smem, m_smem, alpha_smem, l_smem, p_ready, acc, t, hi,
    W: gl.constexpr, COLS: gl.constexpr, NUM_STAGES: gl.constexpr,
    S_ROWS: gl.constexpr, O_ROWS: gl.constexpr,
):  # fmt: skip
    """Start adding tile ``t`` of the other warpgroup to this one's output columns: wait for its
    ``P``, rescale by its ``alpha``, issue ``acc += P·V_t`` (asynchronous: the caller waits, then
    releases the ring slot). Returns the in-flight output, the running row sum after tile ``t``
    (in the score and the output row layouts) and the running row max."""
    mbarrier.wait(p_ready.index(t % 2), (t // 2) & 1)
    fence_async_shared()
    alpha_o = alpha_smem.index(1 - W).load(O_ROWS)
    l_i = l_smem.index(1 - W).load(S_ROWS)
    l_o = l_smem.index(1 - W).load(O_ROWS)
    m_i = m_smem.index(1 - W).load(S_ROWS)
    acc = acc * alpha_o[:, None]
    v = lat_ring.index(_slot(t, hi, NUM_STAGES)).slice(W * COLS, COLS, dim=1)
    acc = warpgroup_mma(p_smem, v, acc, is_async=True)
    return acc, l_i, l_o, m_i


@gluon.jit
def _mma_warpgroup(
    args, W: gl.constexpr, H: gl.constexpr, L: gl.constexpr, BLOCK_N: gl.constexpr,
    NUM_STAGES: gl.constexpr, WRITE_LSE: gl.constexpr, IN_PAGE: gl.constexpr,
):  # fmt: skip
    """MMA warpgroup ``W``: QKᵀ and the softmax of tiles ``t ≡ W (mod 2)``, ``P·V`` of every
    tile over output columns ``[W·L/2, (W+1)·L/2)``, then those columns of the output (and the
    LSE, when this warpgroup owns the last tile). ``args``: the kernel's buffers, barriers, work
    item and strides (one tuple for both warpgroups). ``IN_PAGE``: every tile lies inside one
    page (:func:`.kernels._tile_in_page`), checked once from its id-ring word (0: its block is
    inside the cache, :func:`_id_copy`)."""
    (
        q_nope_smem, q_pe_smem, lat_ring, rope_ring, id_ring, p_smem, m_smem, alpha_smem, l_smem,
        ready, empty, p_ready,
        out_ptr, lse_ptr, part_o_ptr, part_lse_ptr, lo, hi, kv_len, qlen, q_start, rb, work, direct,
        id_limit,
        stride_o_t, stride_o_h, stride_lse_t, stride_lse_h, stride_po_w, stride_po_q, stride_po_h,
        stride_pl_w, stride_pl_q, qk_scale,
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
    # The partition reads its arguments before anything of it writes shared memory.
    gl.thread_barrier()

    keys: gl.constexpr = gl.SliceLayout(0, s_layout)
    _qi, _hd, _ok, row_limit = _row_info(rb, qlen, kv_len, H, BLOCK_M, s_rows)
    # Keys past hi are masked by the row limit, ids outside the cache by the id ring (a word a
    # tile with IN_PAGE, else each key's id; global re-reads here doubled the loop's spills), all
    # tile-relative (offs_n < limit - first position: no key positions in registers, no adds).
    row_limit = gl.minimum(row_limit, hi)
    offs_n = gl.arange(0, BLOCK_N, layout=keys)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    acc = gl.zeros([BLOCK_M, COLS], gl.float32, layout=o_layout)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=s_rows)
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=s_rows)
    l_o = gl.zeros([BLOCK_M], gl.float32, layout=o_rows)
    n_tiles = gl.cdiv(hi - lo, BLOCK_N)
    if W == 0:  # noqa: SIM102 (W is a constexpr: this if is resolved at compile time)
        # Tile 0 has no tile before it: peeled, so the loop below has no branch (ptxas then
        # serialises no wgmma to protect the accumulators).
        if n_tiles > 0:
            sc = _scores(q_nope_smem, q_pe_smem, lat_ring, rope_ring, ready, s_zero, 0, hi, W, NUM_STAGES)
            ids_0 = id_ring.index(_slot(0, hi, NUM_STAGES))
            key_ok = None if IN_PAGE else _ring_key_ok(ids_0, id_limit, keys)
            limit = gl.where(_slot_block(ids_0) == 0, row_limit, 0) if IN_PAGE else row_limit
            scores = warpgroup_mma_wait(num_outstanding=0, deps=(sc,))
            p, alpha, m_i, l_i = _online_softmax(scores, m_i, l_i, offs_n, key_ok, limit - lo, qk_scale, 1)
            acc, l_o = _add_own_tile(
                lat_ring, p_smem, m_smem, alpha_smem, l_smem, p_ready, empty, acc, p, alpha, m_i, l_i,
                0, hi, W, COLS, NUM_STAGES, o_rows, p_layout,
            )  # fmt: skip
    for t in range(2 - W, n_tiles, 2):
        sc = _scores(q_nope_smem, q_pe_smem, lat_ring, rope_ring, ready, s_zero, t, hi, W, NUM_STAGES)
        # The other warpgroup's tile t - 1 (its running max is this tile's starting point): its
        # P·V runs while this tile's softmax does; its ring slot is released once it is done.
        acc, l_i, l_o, m_i = _issue_other_tile(
            lat_ring, p_smem, m_smem, alpha_smem, l_smem, p_ready, acc, t - 1, hi,
            W, COLS, NUM_STAGES, s_rows, o_rows,
        )  # fmt: skip
        scores = warpgroup_mma_wait(num_outstanding=1, deps=(sc,))
        ids_t = id_ring.index(_slot(t, hi, NUM_STAGES))
        key_ok = None if IN_PAGE else _ring_key_ok(ids_t, id_limit, keys)
        limit = gl.where(_slot_block(ids_t) == 0, row_limit, 0) if IN_PAGE else row_limit
        limit = limit - (t * BLOCK_N + lo)
        p, alpha, m_i, l_i = _online_softmax(scores, m_i, l_i, offs_n, key_ok, limit, qk_scale, 1)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index(_slot(t - 1, hi, NUM_STAGES) * 2 + W))
        acc, l_o = _add_own_tile(
            lat_ring, p_smem, m_smem, alpha_smem, l_smem, p_ready, empty, acc, p, alpha, m_i, l_i,
            t, hi, W, COLS, NUM_STAGES, o_rows, p_layout,
        )  # fmt: skip
    # The other warpgroup's last tile, when it comes after this warpgroup's last one.
    last = n_tiles - 1
    if (last >= 0) & (last % 2 != W):
        acc, _l_i, l_o, _m_i = _issue_other_tile(
            lat_ring, p_smem, m_smem, alpha_smem, l_smem, p_ready, acc, last, hi,
            W, COLS, NUM_STAGES, s_rows, o_rows,
        )  # fmt: skip
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index(_slot(last, hi, NUM_STAGES) * 2 + W))

    # -- epilogue: this warpgroup's output columns; the LSE by the warpgroup that owns the last
    # tile (its row max and row sum in registers are the final ones; warpgroup 0 when there is
    # no tile) -----------------------------------------------------------------------------------
    o = acc / _safe_sum(l_o)[:, None]
    qi_o, head_o, ok_o, _lim_o = _row_info(rb, qlen, kv_len, H, BLOCK_M, o_rows)
    cols_o = W * COLS + gl.arange(0, COLS, layout=gl.SliceLayout(0, o_layout))
    lse = _row_lse(m_i, l_i)
    qi_s, head_s, ok_s, _lim_s = _row_info(rb, qlen, kv_len, H, BLOCK_M, s_rows)
    ok_s = ok_s & (gl.maximum(last, 0) % 2 == W)
    if direct:
        if out_ptr.dtype.element_ty == lat_ring.dtype:
            # Staged in this warpgroup's column half of ring slot 0, dead by now: every QKᵀ (the
            # only reader of both halves) is done before either warpgroup's last P·V (each tile's
            # P needs the previous tile's row max), the other warpgroup's P·V reads its own half,
            # and every tile has landed (waited for here, directly or through p_ready).
            stage = lat_ring.index(0).slice(W * COLS, COLS, dim=1)
            _store_staged(
                o.to(lat_ring.dtype), stage, out_ptr, rb, qlen, kv_len, q_start, stride_o_t, stride_o_h,
                H, BLOCK_M, W * COLS,
            )  # fmt: skip
        else:
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


# ``num_splits`` is never specialised (as in :mod:`.kernels`).
@gluon.jit(do_not_specialize=["num_splits"])
def mla_decode_pingpong_kernel(
    q_nope_ptr, q_pe_ptr, kv_ptr, kv_indptr_ptr, kv_indices_ptr, qo_indptr_ptr, work_info_ptr,
    split_indptr_ptr, out_ptr, lse_ptr, part_o_ptr, part_lse_ptr, kv_scale_ptr, num_splits,
    stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h, stride_kv, stride_o_t, stride_o_h,
    stride_lse_t, stride_lse_h, stride_po_w, stride_po_q, stride_po_h, stride_pl_w, stride_pl_q,
    sm_scale_log2, num_kv_rows, stride_bt, row_request_ptr, lengths_ptr, H: gl.constexpr, L: gl.constexpr,
    R: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, ROW_BLOCKS: gl.constexpr,
    MODE: gl.constexpr, UNIT_QLEN: gl.constexpr, WRITE_LSE: gl.constexpr, PAGE_SIZE: gl.constexpr,
    ROW_MAP: gl.constexpr, HAS_LENGTHS: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    BLOCK_M: gl.constexpr = 64
    gl.static_assert(num_warps == LOADER_WARPS, "the launch's warps are the loader warpgroup")
    gl.static_assert(BLOCK_N == 64, "64-token tiles (the QKᵀ N of one warpgroup)")
    gl.static_assert(L == CHUNK * CHUNKS, "the latent row is CHUNKS chunks of CHUNK columns")
    dtype: gl.constexpr = q_nope_ptr.dtype.element_ty
    mma_smem: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    vec_smem: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])

    # -- the work item (as in the 64-row kernel) -----------------------------------------------
    rb, work, req = _work_item(num_splits, work_info_ptr, ROW_BLOCKS, MODE)
    if MODE != 0:  # noqa: SIM102 (MODE is a constexpr: this if is resolved at compile time)
        if req < 0:
            return
    kv_start, kv_len, lo, hi, direct, q_start, qlen = _work_range(
        req, work, num_splits, kv_indptr_ptr, work_info_ptr, split_indptr_ptr, qo_indptr_ptr, lengths_ptr,
        MODE, UNIT_QLEN, BLOCK_N, HAS_LENGTHS,
    )  # fmt: skip

    # -- shared memory and barriers --------------------------------------------------------------
    q_nope_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, L], mma_smem)
    q_pe_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, R], mma_smem)
    lat_ring = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, L], mma_smem)
    rope_ring = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, R], mma_smem)
    id_ring = gl.allocate_shared_memory(gl.int32, [NUM_STAGES, BLOCK_N], vec_smem)  # flat/block ids
    p_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_N], mma_smem)
    # The row max, rescale and row sum of a tile, one buffer per publishing warpgroup (each
    # buffer has one writer and one reader).
    m_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M], vec_smem)
    alpha_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M], vec_smem)
    l_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M], vec_smem)
    # ready[s·CHUNKS + c]: chunk c of slot s landed (one arrival per loader thread);
    # empty[s·2 + w]: warpgroup w is done with half w of slot s (its P·V columns).
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES * CHUNKS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES * 2, 1], mbarrier.MBarrierLayout())
    p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES * CHUNKS):
        mbarrier.init(ready.index(i), count=LOADER_WARPS * 32)
    for i in gl.static_range(NUM_STAGES * 2):
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(p_ready.index(i), count=1)
    # Every ring slot starts free (both MMA warpgroups' arrivals of phase 0).
    for i in gl.static_range(NUM_STAGES * 2):
        mbarrier.arrive(empty.index(i))

    # -- the query tile (by the 4 loader warps), every piece in flight at once by cp.async, and
    # still in flight while the loader partition fetches the first tiles' ids and rows. Nothing
    # waits for it here: a cp.async arrival on an mbarrier completes once every earlier copy of
    # the arriving thread has landed, so each ring chunk's ``ready`` (arrived on by these same
    # threads after these copies) also says the query tile is in shared memory. ------------------
    _query_copy(
        q_nope_ptr, q_pe_ptr, q_nope_smem, q_pe_smem, rb, qlen, kv_len, q_start,
        stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h, H, BLOCK_M, L, R,
    )  # fmt: skip
    # (the barriers' initialisation, as before the partitions start)
    fence_async_shared()
    gl.thread_barrier()

    index_base = _key_operand(kv_indices_ptr, kv_start, req, stride_bt, row_request_ptr, PAGE_SIZE, ROW_MAP)
    id_limit = _id_limit(num_kv_rows, PAGE_SIZE)
    IN_PAGE: gl.constexpr = _tile_in_page(MODE, PAGE_SIZE, BLOCK_N)
    if IN_PAGE:  # (no block inside the cache: no tile, every row sees no key, as all masked)
        hi = gl.where(id_limit == 0, lo, hi)
    mma_args = (
        q_nope_smem, q_pe_smem, lat_ring, rope_ring, id_ring, p_smem, m_smem, alpha_smem, l_smem,
        ready, empty, p_ready,
        out_ptr, lse_ptr, part_o_ptr, part_lse_ptr, lo, hi, kv_len, qlen, q_start, rb, work, direct,
        id_limit,
        stride_o_t, stride_o_h, stride_lse_t, stride_lse_h, stride_po_w, stride_po_q, stride_po_h,
        stride_pl_w, stride_pl_q, sm_scale_log2,
    )  # fmt: skip
    gl.warp_specialize(
        [
            (
                _loader,
                (
                    kv_ptr, index_base, lo, hi, id_limit, stride_kv, lat_ring, rope_ring, id_ring,
                    ready, empty, L, R, BLOCK_N, NUM_STAGES, PAGE_SIZE, IN_PAGE,
                ),
            ),
            (_mma_warpgroup, (mma_args, 0, H, L, BLOCK_N, NUM_STAGES, WRITE_LSE, IN_PAGE)),
            (_mma_warpgroup, (mma_args, 1, H, L, BLOCK_N, NUM_STAGES, WRITE_LSE, IN_PAGE)),
        ],
        [4, 4],
        [MMA_REGS, MMA_REGS],
    )  # fmt: skip


__all__ = ["mla_decode_pingpong_kernel"]
