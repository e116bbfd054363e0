# mypy: disable-error-code="no-untyped-def, untyped-decorator"
"""Gluon MLA decode of 16 query rows on an fp8 cache, two MMA chains per SM.

On the few-rows kernel of :mod:`.transposed` one warpgroup gathers, widens and multiplies every
fp8 tile in series, so an fp8 tile (half the bytes of a bf16 one) takes as long as a bf16 tile:
the chain of that one warpgroup, not the memory, sets the pace. Here the chain is split three
ways, with the products of :mod:`.transposed` (the 16 rows as the MMA N dimension):

* a **loader** warpgroup (the default partition) only copies: tile ``t``'s fp8 cache rows into
  ring slot ``s = t % 4`` (a whole 64-token tile, 36 KB) once the tile before in it has been
  read (``free[s]``), announced on ``landed[s]`` when the copies land. A tile
  of 64 consecutive cache rows (a 64-token page, or consecutive pages) comes by TMA, any other
  by ``cp.async`` gathers by token id;
* two **MMA** warpgroups take alternate tiles (warpgroup ``w`` owns tiles ``t ≡ w (mod 2)``;
  tile ``t`` lands in ring slot ``t % 4``, so each warpgroup has the next of its tiles coming
  while it works on one). ``Sᵀ = K·Qᵀ`` takes K from registers: the warpgroup reads the fp8
  tile once, 64 columns a step, widened in registers as the wgmma A operand (one step's MMA in
  flight while the next step is read). ``Oᵀ += Vᵀ·Pᵀ`` takes Vᵀ from registers too: each
  ``[64, 128]`` latent box of the slot, read transposed as 16-bit pairs of fp8 values
  (``ldmatrix.trans``; :func:`_box_pairs`), splits into its even and its odd columns with one
  byte permutation and widens with packed conversions (:func:`_split_widen`): two ``[64, 64]``
  fp16 A operands whose rows are latent columns ``2i`` and ``2i + 1``, each with its own
  ``[64, 16]`` accumulator (eight in all, the output's 64 registers a thread). The slot is
  released once the last box is in registers. Running max, sum and output are the
  warpgroup's own; nothing passes between the warpgroups until the end.

**The softmax keeps a reference max.** The keys of ``Sᵀ`` lie across the warpgroup's four warps,
so a row's max over a tile is a cross-warp reduction, and a compiler reduction costs two
barriers of the warpgroup (the row sum two more). Instead ``P`` is taken against the row's
reference max ``m`` (the same in every thread), stored, and each warp leaves its rows' maxima
of the tile in a slot of its own before the barrier that publishes ``P`` to PV; after it every
thread reads the four slots. While no row's tile max exceeds ``m + REF_SLACK``, ``P`` stands
(entries below ``2**8``; the output needs no rescale); otherwise, in the same branch for the
whole warpgroup, ``m`` moves to the new max, ``P`` is taken and stored again and the output and
sums are rescaled: at a row's first tile with keys, then only where its scores jump
(``test_late_score_spikes`` in the GPU tests makes them jump). The row sums stay per
thread (``[keys, rows]``) and are summed across the warps once, after the loop. This takes
every cross-warp reduction out of the loop but one shared-memory exchange (about 11% off the
kernel; ``docs/performance.md``, "Kernel choices").

The K tile and the query are read in the column order of :func:`.kernels._paired_k`: the four
columns a thread holds of every 16 of a 16-bit register operand are then four adjacent fp8
bytes, and the compiler reads the tile with ``ldmatrix`` (18 per warp and tile) instead of
two-byte loads (144). ``QKᵀ`` sums over the columns, so it does not change. PV reads the ring
in the cache's own column order; the output store maps accumulator rows back to columns.

Each tile thus moves through shared memory as fp8 only: written once by the copies and read
twice by its warpgroup (for QKᵀ and for PV). The design before this one stored the widened
latent part as an fp16 V tile of 64 KB per tile for PV to read (128 KB of shared memory for the
two warpgroups' tiles); reading Vᵀ from the fp8 slot instead took 10% off the kernel
(``docs/performance.md``, "Kernel choices").

At the end warpgroup 1 hands its output, row max and row sum to warpgroup 0 through the
program's slot of a global merge buffer (fp32, ``16 × (512 + 2)`` values per program, allocated
by the launcher; it stays in L2), announced on the ``merged`` mbarrier (release/acquire at CTA
scope: the stores are ordered before warpgroup 0's loads). Warpgroup 0 merges them into its own
and writes the outputs: the request's rows directly, or fp32 partials for the split reduce.
An earlier version handed over through shared memory, equally fast, but compute-sanitizer's
racecheck flagged it; through global memory it flags nothing of the merge.

Shared memory (16 rows): query 18 KB, fp8 ring 144 KB (four slots; per slot four ``[64, 128]``
latent boxes and a ``[64, 64]`` rope box, the TMA boxes), ``P`` 4 KB, the row-max slots
512 B (171,168 B with the barriers and the partitions' state).
fp8 caches and 16 rows only (the fp32 output accumulators are 64 registers per thread; at 32
rows they would be 128). Work items, masking, NaN rules, scales and
outputs are those of :mod:`.transposed`.

Each step of this design (the loader's own widening before it, the paired column order, TMA
for whole tiles, PV from the fp8 slot, the reference-max softmax) was timed against the one
before it; those measurements are in ``docs/history/`` ("The dual-chain fp8 kernel"), the
current times in ``docs/performance.md``.

Its MMA warps are issue-bound, so its time follows the SM clock, and at large batches it draws
close to the GPU's power cap: sustained, it runs some 9% slower than from a cool GPU
(``docs/performance.md``, "The power cap").

compute-sanitizer: memcheck reports no errors. racecheck reports the ``gl.warp_specialize``
start-up (see :mod:`.pingpong`) and, on tiles that come by ``cp.async``, can report the
warpgroups' reads of a ring slot against the loader's copies into it:
``probes/ws_mbarrier_probe.py ring`` reproduces that with a 60-line copier and reader whose
values are right; racecheck does not take an mbarrier wait as ordering the ``cp.async`` writes
issued after it.
:func:`.planner.launch_config` picks it for every fp8 launch of 16-row tiles.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from mla.providers.gluon.kernels import (
    _id_limit,
    _issue_ids,
    _key_operand,
    _paired_k,
    _query_to_smem,
    _ring_key_ok,
    _row_info,
    _scales,
    _tile_ids,
    _tile_in_page,
    _tile_key_limit,
    _work_item,
    _work_range,
)
from mla.providers.gluon.transposed import _store_rows_output

LOADER_WARPS = gl.constexpr(4)
"""Warps of the loader, the default partition (the launch's ``num_warps``)."""
QK_CHUNK = gl.constexpr(64)
"""Latent columns per register-operand QKᵀ step (64 fp16 values a thread)."""
MMA_REGS = gl.constexpr(232)
"""Registers per MMA-warpgroup thread (``setmaxnreg``): output 64, two QKᵀ register operands in
flight, or a PV box's pairs and its two widened halves. 232 leaves the loader 48 and ptxas 6
spill stores (216: 14, and 3–5% slower)."""
REF_SLACK = gl.constexpr(8.0)
"""How far (log2 units) a tile's row max may exceed the row's reference max before P is taken
against the new max instead (P then stays below ``2**8``)."""
SLOTS = gl.constexpr(4)
"""fp8 ring slots, a whole tile each: tile ``t`` lands in slot ``t % SLOTS`` (a power of two:
the slot and phase are a mask and a shift). Five timed 5–6% slower, three 7%."""

BOX_COLS = gl.constexpr(128)
"""Latent columns of one ring box: 128 fp8 bytes a row, the widest row of a 128-byte swizzle."""
LAT_BOX_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
"""Shared layout of a ``[64, 128]`` latent box of the fp8 ring (and of its TMA descriptor):
16-byte chunks swizzled by row, so the warpgroups' ``ldmatrix`` reads meet no bank conflict."""
ROPE_BOX_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)
"""Shared layout of the ``[64, 64]`` rope box of the fp8 ring (and of its TMA descriptor)."""
LAT_BOX16_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
"""A latent box's bytes as ``[64, 64]`` 16-bit pairs: the same 128-byte swizzle of the same
128-byte rows, so PV's transposed reads (``ldmatrix.trans``) see the box as it landed."""


@gluon.constexpr_function
def _box_copy_layout(cols):
    """Register layout of a ``cp.async`` gather into a ``[64, cols]`` fp8 box: 16 bytes (16 fp8
    values) a thread, the loader's warps stacked over the rows."""
    return gl.BlockedLayout([1, 16], [32 * 16 // cols, cols // 16], [LOADER_WARPS, 1], [1, 0])


@gluon.jit
def _gather_tile(
    kv_ptr, ids, ok, idr, okr, stride_kv, lat_ring, rope_ring, landed, w,
    L: gl.constexpr, R: gl.constexpr,
):  # fmt: skip
    """Gather one tile (token ids ``ids``/``idr`` in the two box copy layouts, rows not ``ok``
    zero-filled) into ring slot ``w`` with ``cp.async``, and thread 0's plain arrival on
    ``landed[w]`` (the copies arrive on their own)."""
    LB: gl.constexpr = L // BOX_COLS
    box_ld: gl.constexpr = _box_copy_layout(BOX_COLS)
    rope_ld: gl.constexpr = _box_copy_layout(R)
    cols = gl.arange(0, BOX_COLS, layout=gl.SliceLayout(0, box_ld))
    cr = gl.arange(0, R, layout=gl.SliceLayout(0, rope_ld))
    row_ptrs = kv_ptr + ids.to(gl.int64)[:, None] * stride_kv + cols[None, :]
    for b in gl.static_range(LB):
        async_copy.async_copy_global_to_shared(
            lat_ring.index(w * LB + b), row_ptrs + b * BOX_COLS, mask=ok[:, None]
        )
    ptr_r = kv_ptr + idr.to(gl.int64)[:, None] * stride_kv + L + cr[None, :]
    async_copy.async_copy_global_to_shared(rope_ring.index(w), ptr_r, mask=okr[:, None])
    mbarrier.arrive(landed.index(w))


@gluon.jit
def _tma_tile(
    lat_desc, rope_desc, first, lat_ring, rope_ring, landed, w,
    L: gl.constexpr, R: gl.constexpr, BLOCK_N: gl.constexpr,
):  # fmt: skip
    """One whole tile of the consecutive cache rows ``first ..`` into ring slot ``w`` by TMA, five
    boxes on ``landed[w]``'s transaction count (thread 0's arrival)."""
    LB: gl.constexpr = L // BOX_COLS
    mbarrier.expect(landed.index(w), BLOCK_N * (L + R))
    for b in gl.static_range(LB):
        tma.async_copy_global_to_shared(
            lat_desc, [first, b * BOX_COLS], landed.index(w), lat_ring.index(w * LB + b)
        )
    tma.async_copy_global_to_shared(rope_desc, [first, L], landed.index(w), rope_ring.index(w))


@gluon.jit
def _load_pages(
    kv_ptr, lat_desc, rope_desc, index_base, lo, hi, id_limit, stride_kv, lat_ring, rope_ring, id_ring,
    landed, free, L: gl.constexpr, R: gl.constexpr, BLOCK_N: gl.constexpr, PAGE_SIZE: gl.constexpr,
):  # fmt: skip
    """:func:`_loader` for tiles that lie inside one page (:func:`.kernels._tile_in_page`): one
    block id a tile (a scalar load, one tile ahead), checked once. The tile of a block inside the
    cache comes by TMA when whole; a tail tile, or the tile of a block outside the cache (no row
    read), by the ``cp.async`` gather."""
    rows: gl.constexpr = gl.SliceLayout(1, _box_copy_layout(BOX_COLS))
    rope_rows: gl.constexpr = gl.SliceLayout(1, _box_copy_layout(R))
    id_ld: gl.constexpr = gl.BlockedLayout([1], [32], [LOADER_WARPS], [0])
    offs = gl.arange(0, BLOCK_N, layout=rows)
    offs_r = gl.arange(0, BLOCK_N, layout=rope_rows)
    n_tiles = gl.cdiv(hi - lo, BLOCK_N)
    blk = gl.load(index_base + lo // PAGE_SIZE, mask=lo < hi, other=-1)
    for t in range(n_tiles):
        w = t % SLOTS
        n0 = lo + t * BLOCK_N
        nxt = gl.load(index_base + (n0 + BLOCK_N) // PAGE_SIZE, mask=n0 + BLOCK_N < hi, other=-1)
        mbarrier.wait(free.index(w), (t // SLOTS) & 1)
        _issue_ids(index_base, id_ring, t, lo, hi, BLOCK_N, SLOTS, id_ld, PAGE_SIZE)
        first = blk * PAGE_SIZE + n0 % PAGE_SIZE
        inside = blk.to(gl.uint32, bitcast=True) < id_limit
        if inside & (n0 + BLOCK_N <= hi):
            _tma_tile(lat_desc, rope_desc, first, lat_ring, rope_ring, landed, w, L, R, BLOCK_N)
        else:
            tile_hi = gl.where(inside, hi, n0)
            _gather_tile(
                kv_ptr, first + offs, n0 + offs < tile_hi, first + offs_r, n0 + offs_r < tile_hi, stride_kv,
                lat_ring, rope_ring, landed, w, L, R,
            )  # fmt: skip
        async_copy.mbarrier_arrive(landed.index(w), increment_count=False)
        blk = nxt


@gluon.jit
def _loader(
    kv_ptr, lat_desc, rope_desc, index_base, lo, hi, id_limit, stride_kv, lat_ring, rope_ring, id_ring,
    landed, free, L: gl.constexpr, R: gl.constexpr, BLOCK_N: gl.constexpr, PAGE_SIZE: gl.constexpr,
    IN_PAGE: gl.constexpr,
):  # fmt: skip
    """The loader partition: every tile ``t`` of ``[lo, hi)``, as fp8, into ring slot ``t % SLOTS``
    once the tile before in it has been read, announced on ``landed[t % SLOTS]`` when the
    copies land. A whole tile of 64 consecutive cache rows (a 64-token page, or consecutive
    pages) comes by TMA, five boxes (``lat_desc``, ``rope_desc``) on the barrier's transaction
    count; any other tile by ``cp.async`` gathers by token id (rows past ``hi`` zero-filled).
    Each tile takes one arrival per loader thread (its ``cp.async`` copies, none for a TMA
    tile) and one of thread 0 (with the TMA bytes, or plain). Token ids run one tile ahead.
    What the key operand holds for the tile's positions is copied into ``id_ring[t % SLOTS]``
    as well (landing before the arrival), for the MMA warpgroups' key check. ``IN_PAGE``: every
    tile inside one page (:func:`_load_pages`)."""
    if IN_PAGE:
        _load_pages(
            kv_ptr, lat_desc, rope_desc, index_base, lo, hi, id_limit, stride_kv, lat_ring, rope_ring,
            id_ring, landed, free, L, R, BLOCK_N, PAGE_SIZE,
        )  # fmt: skip
        return
    box_ld: gl.constexpr = _box_copy_layout(BOX_COLS)
    rope_ld: gl.constexpr = _box_copy_layout(R)
    rows: gl.constexpr = gl.SliceLayout(1, box_ld)
    id_ld: gl.constexpr = gl.BlockedLayout([1], [32], [LOADER_WARPS], [0])
    offs = gl.arange(0, BLOCK_N, layout=rows)
    n_tiles = gl.cdiv(hi - lo, BLOCK_N)
    ids, ok = _tile_ids(index_base, lo, hi, 0, id_limit, BLOCK_N, rows, PAGE_SIZE)
    idr, okr = _tile_ids(index_base, lo, hi, 0, id_limit, BLOCK_N, gl.SliceLayout(1, rope_ld), PAGE_SIZE)
    for t in range(n_tiles):
        w = t % SLOTS
        mbarrier.wait(free.index(w), (t // SLOTS) & 1)
        # (the ids of the next tile are loaded after the wait: fewer live registers here)
        _issue_ids(index_base, id_ring, t, lo, hi, BLOCK_N, SLOTS, id_ld, PAGE_SIZE)
        nids, nok = _tile_ids(index_base, lo, hi, t + 1, id_limit, BLOCK_N, rows, PAGE_SIZE)
        nidr, nokr = _tile_ids(
            index_base, lo, hi, t + 1, id_limit, BLOCK_N, gl.SliceLayout(1, rope_ld), PAGE_SIZE
        )
        first = gl.min(ids, axis=0)
        # (a row whose id is outside the cache breaks the run: such a tile is gathered, that row
        # not read)
        consecutive = gl.sum(((ids != first + offs) | ~ok).to(gl.int32), axis=0) == 0
        if consecutive & (lo + (t + 1) * BLOCK_N <= hi):
            _tma_tile(lat_desc, rope_desc, first, lat_ring, rope_ring, landed, w, L, R, BLOCK_N)
        else:
            _gather_tile(kv_ptr, ids, ok, idr, okr, stride_kv, lat_ring, rope_ring, landed, w, L, R)
        async_copy.mbarrier_arrive(landed.index(w), increment_count=False)
        ids, ok, idr, okr = nids, nok, nidr, nokr


@gluon.jit
def _ring_chunk(lat_ring, first_box, c: gl.constexpr):
    """Latent columns ``[c·QK_CHUNK, (c+1)·QK_CHUNK)`` of the tile in the ring slot whose boxes
    start at ``first_box``, in the column order of :func:`.kernels._paired_k`."""
    per_box: gl.constexpr = BOX_COLS // QK_CHUNK
    box = _paired_k(_row_swizzled(lat_ring.index(first_box + c // per_box)))
    # The column order moves columns only within groups of 16, so it commutes with the slice.
    return box.slice((c % per_box) * QK_CHUNK, QK_CHUNK, dim=1)


@gluon.constexpr_function
def _row_swizzled_layout(box_layout):
    """The row-swizzled shared layout with the bytes of an fp8 ring box in ``box_layout`` (an
    NVMMA swizzle of ``S`` bytes on rows of ``S`` bytes: 16-byte chunk ``^ (row // (128 / S)) %
    (S / 16)``)."""
    swizzle = box_layout.swizzle_byte_width
    return gl.SwizzledSharedLayout(vec=16, per_phase=128 // swizzle, max_phase=swizzle // 16, order=[1, 0])


@gluon.jit
def _row_swizzled(box):
    """Ring box ``box`` as the same bytes in :func:`_row_swizzled_layout`, which, unlike the
    NVMMA layout, can be reshaped and sliced narrower than its swizzle."""
    layout: gl.constexpr = _row_swizzled_layout(box.layout)
    return box._reinterpret(box.dtype, box.shape, layout)


@gluon.jit
def _mma_warpgroup(
    args, W: gl.constexpr, H: gl.constexpr, L: gl.constexpr, NR: gl.constexpr, BLOCK_N: gl.constexpr,
    WRITE_LSE: gl.constexpr, IN_PAGE: gl.constexpr,
):  # fmt: skip
    """MMA warpgroup ``W``: tiles ``t ≡ W (mod 2)`` from ring slot ``t % SLOTS`` (``Sᵀ = K·Qᵀ``
    and ``Oᵀ += Vᵀ·Pᵀ``, both with the fp8 tile widened in registers, and the softmax against a
    reference max), then the merge: warpgroup 1 leaves its output, row max and row sum in the
    global merge buffer, warpgroup 0 merges them and writes the outputs. ``args``: the kernel's
    buffers, barriers, output pointers and strides (``outs``) and work item (one tuple for both
    warpgroups)."""
    (
        q_nope_smem, q_pe_smem, lat_ring, rope_ring, id_ring, p_smem, red_smem, merge_ptr, landed, free,
        merged, outs, lo, hi, kv_len, qlen, q_start, rb, work, direct, qk_scale, v_scale, id_limit,
    ) = args  # fmt: skip
    # The partition reads its arguments before anything of it writes shared memory.
    gl.thread_barrier()
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, NR, 16]
    )
    rows_layout: gl.constexpr = gl.SliceLayout(0, st_layout)
    _qi, _hd, _ok, row_limit = _row_info(rb, qlen, kv_len, H, NR, rows_layout)
    # Keys past hi are masked by the row limit, ids outside the cache by the id ring (a global
    # re-read of the ids here doubled the loop's spills).
    row_limit = gl.minimum(row_limit, hi)
    # The row's reference max (log2 domain) and per-thread partial row sums.
    m_i = gl.full([NR], float("-inf"), gl.float32, layout=rows_layout)
    s_zero = gl.zeros([BLOCK_N, NR], gl.float32, layout=st_layout)
    l_part = gl.zeros([BLOCK_N, NR], gl.float32, layout=st_layout)
    red_w = red_smem.slice(W * 4 * NR, 4 * NR)
    red_rows_w = red_smem.reshape([2 * 4, NR]).slice(W * 4, 4, dim=0)
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, st_layout))
    # QKᵀ's A operand (the K tile) comes from registers: read from the fp8 ring, widened.
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=st_layout, k_width=2)
    # The tile is read in the column order of _paired_k (the query's too): ldmatrix reads.
    LB: gl.constexpr = L // BOX_COLS
    kv_dtype: gl.constexpr = lat_ring.dtype
    p_w = p_smem.index(W)
    z = gl.zeros([BOX_COLS // 2, NR], gl.float32, layout=st_layout)
    # Output rows: box b's even (odd) accumulator row i is latent column 128·b + 2·i (+ 1).
    o0e, o0o, o1e, o1o, o2e, o2o, o3e, o3o = z, z, z, z, z, z, z, z
    n_tiles = gl.cdiv(hi - lo, BLOCK_N)
    for t in range(W, n_tiles, 2):
        s = t % SLOTS
        n = t * BLOCK_N + lo + offs_n
        mbarrier.wait(landed.index(s), (t // SLOTS) & 1)
        key_ok = None if IN_PAGE else _ring_key_ok(id_ring.index(s), id_limit, gl.SliceLayout(1, st_layout))
        limit = _tile_key_limit(id_ring.index(s), row_limit, hi, id_limit, IN_PAGE)
        a = _ring_chunk(lat_ring, s * LB, 0).load(a_layout).to(gl.float16)
        q_0 = q_nope_smem.slice(0, QK_CHUNK, dim=1).permute((1, 0))
        sc = warpgroup_mma(a, q_0, s_zero, use_acc=False, is_async=True)
        for c in gl.static_range(1, L // QK_CHUNK):
            a = _ring_chunk(lat_ring, s * LB, c).load(a_layout).to(gl.float16)
            sc = warpgroup_mma(
                a, q_nope_smem.slice(c * QK_CHUNK, QK_CHUNK, dim=1).permute((1, 0)), sc, is_async=True
            )
            sc, a = warpgroup_mma_wait(num_outstanding=1, deps=(sc, a))
        a_r = _paired_k(_row_swizzled(rope_ring.index(s))).load(a_layout).to(gl.float16)
        sc = warpgroup_mma(a_r, q_pe_smem.permute((1, 0)), sc, is_async=True)
        sc, a_r = warpgroup_mma_wait(num_outstanding=0, deps=(sc, a_r))
        visible = gl.expand_dims(n, 1) < gl.expand_dims(limit, 0)
        if key_ok is not None:
            visible = visible & gl.expand_dims(key_ok, 1)
        sc = gl.where(visible, sc * qk_scale, float("-inf"))
        # Each warp's row maxima of this tile into its slot; every warp reads all four after
        # the barrier that publishes P, so the exchange adds no barrier of its own.
        red_rows_w.store(gl.max(gl.reshape(sc, [4, BLOCK_N // 4, NR]), 1))
        # P against the reference max m_i (the same in every thread): kept unless a row's max
        # in this tile exceeds it by more than REF_SLACK.
        p = gl.exp2(sc - gl.expand_dims(gl.where(m_i == float("-inf"), 0.0, m_i), 0))
        p_w.store(p.to(p_w.dtype))
        fence_async_shared()
        gl.thread_barrier()
        tile_max = gl.maximum(
            gl.maximum(red_w.slice(0, NR).load(rows_layout), red_w.slice(NR, NR).load(rows_layout)),
            gl.maximum(red_w.slice(2 * NR, NR).load(rows_layout), red_w.slice(3 * NR, NR).load(rows_layout)),
        )
        alpha = gl.full([NR], 1.0, gl.float32, layout=rows_layout)
        if gl.max((tile_max > m_i + REF_SLACK).to(gl.int32), 0) > 0:
            m_new = gl.maximum(m_i, tile_max)
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.exp2(m_i - m_use)
            p = gl.exp2(sc - gl.expand_dims(m_use, 0))
            m_i = m_new
            p_w.store(p.to(p_w.dtype))
            fence_async_shared()
            gl.thread_barrier()
        l_part = l_part * gl.expand_dims(alpha, 0) + p
        al = alpha[None, :]
        o0e, o0o = _pv_box(lat_ring, s * LB + 0, p_w, o0e * al, o0o * al, a_layout, kv_dtype)
        o1e, o1o = _pv_box(lat_ring, s * LB + 1, p_w, o1e * al, o1o * al, a_layout, kv_dtype)
        o0e, o0o, o1e, o1o = warpgroup_mma_wait(num_outstanding=2, deps=(o0e, o0o, o1e, o1o))
        o2e, o2o = _pv_box(lat_ring, s * LB + 2, p_w, o2e * al, o2o * al, a_layout, kv_dtype)
        o1e, o1o, o2e, o2o = warpgroup_mma_wait(num_outstanding=2, deps=(o1e, o1o, o2e, o2o))
        v3e, v3o = _split_widen(_box_pairs(lat_ring, s * LB + 3).load(a_layout), kv_dtype)
        # Every read of the ring slot is done (the last box is in registers): it may be refilled.
        gl.thread_barrier()
        mbarrier.arrive(free.index(s))
        o3e = warpgroup_mma(v3e, p_w, o3e * al, is_async=True)
        o3o = warpgroup_mma(v3o, p_w, o3o * al, is_async=True)
        o2e, o2o, o3e, o3o = warpgroup_mma_wait(num_outstanding=0, deps=(o2e, o2o, o3e, o3o))

    l_i = gl.sum(l_part, 0)
    # Warpgroup 1 hands its output, row max and row sum to warpgroup 0 through this program's
    # slot of the global merge buffer (L2): no shared memory changes hands after the loop.
    NRL: gl.constexpr = NR * L
    base = merge_ptr + gl.program_id(0).to(gl.int64) * (NRL + 2 * NR)
    offs_i = gl.arange(0, BOX_COLS // 2, layout=gl.SliceLayout(1, st_layout))
    offs_r = gl.arange(0, NR, layout=rows_layout)
    pieces = (o0e, o0o, o1e, o1o, o2e, o2o, o3e, o3o)
    if W == 1:
        for j in gl.static_range(2 * LB):
            gl.store(_piece_ptrs(base, j, offs_i, offs_r, NR), pieces[j])
        gl.store(base + NRL + offs_r, m_i)
        gl.store(base + NRL + NR + offs_r, l_i)
        # Every thread's stores precede the single-thread arrive (release at CTA scope).
        gl.thread_barrier()
        mbarrier.arrive(merged)
    else:
        mbarrier.wait(merged, 0)
        m_1 = gl.load(base + NRL + offs_r)
        l_1 = gl.load(base + NRL + NR + offs_r)
        m_new = gl.maximum(m_i, m_1)
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        a_0 = gl.exp2(m_i - m_use)
        a_1 = gl.exp2(m_1 - m_use)
        l_i = l_i * a_0 + l_1 * a_1
        for j in gl.static_range(2 * LB):
            other = gl.load(_piece_ptrs(base, j, offs_i, offs_r, NR))
            piece = pieces[j] * a_0[None, :] + other * a_1[None, :]
            _store_rows_output(
                piece, m_new, l_i, v_scale, rb, qlen, kv_len, q_start, work, direct, outs, H, NR,
                BOX_COLS // 2, WRITE_LSE, st_layout,
                COL_START=(j // 2) * BOX_COLS + (j % 2), COL_STEP=2, STORE_LSE=j == 0,
            )  # fmt: skip


@gluon.jit
def _piece_ptrs(base, j: gl.constexpr, offs_i, offs_r, NR: gl.constexpr):
    """Merge-buffer pointers of output accumulator ``j`` (``o0e, o0o, o1e, ...``): its row ``i``
    is latent column ``BOX_COLS·(j // 2) + 2·i + j % 2``, stored as ``NR`` values a column."""
    cols = (j // 2) * BOX_COLS + 2 * offs_i + (j % 2)
    return base + cols[:, None] * NR + offs_r[None, :]


@gluon.jit
def _box_pairs(lat_ring, box):
    """Ring box ``box`` transposed, as 16-bit pairs of fp8 values: ``[64, keys]``, row ``i``
    holding latent columns ``2i`` (low byte) and ``2i + 1`` of the box."""
    pairs = lat_ring.index(box)._reinterpret(gl.int16, [lat_ring.shape[1], BOX_COLS // 2], LAT_BOX16_LAYOUT)
    return pairs.permute((1, 0))


@gluon.jit
def _split_widen(x, kv_dtype: gl.constexpr):
    """Each 16-bit value of ``x`` holds two fp8 values (the even latent column in the low byte):
    the fp16 tensors of the low and of the high bytes. Two values of ``x`` (consecutive keys) a
    32-bit register: one byte permutation and two packed conversions."""
    fmt: gl.constexpr = "e4m3x2" if kv_dtype == gl.float8e4nv else "e5m2x2"
    return gl.inline_asm_elementwise(
        "{ .reg .b32 t; .reg .b16 lo, hi;\n"
        "prmt.b32 t, $2, 0, 0x3120;\n"
        "mov.b32 {lo, hi}, t;\n"
        f"cvt.rn.f16x2.{fmt} $0, lo;\n"
        f"cvt.rn.f16x2.{fmt} $1, hi; }}",
        "=r,=r,r",
        [x],
        dtype=(gl.float16, gl.float16),
        is_pure=True,
        pack=2,
    )


@gluon.jit
def _pv_box(lat_ring, box, p_w, acc_e, acc_o, a_layout: gl.constexpr, kv_dtype: gl.constexpr):
    """``Oᵀ += Vᵀ·Pᵀ`` for the 128 latent columns of ring box ``box``: the box read transposed
    as 16-bit pairs of fp8 values (``ldmatrix.trans``), split into the even and the odd
    columns, widened to fp16 in registers (the wgmma A operands)."""
    x = _box_pairs(lat_ring, box).load(a_layout)
    even, odd = _split_widen(x, kv_dtype)
    acc_e = warpgroup_mma(even, p_w, acc_e, is_async=True)
    acc_o = warpgroup_mma(odd, p_w, acc_o, is_async=True)
    return acc_e, acc_o


# ``num_splits`` is never specialised (as in :mod:`.kernels`).
@gluon.jit(do_not_specialize=["num_splits"])
def mla_decode_dual_kernel(
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
    merge_ptr,
    lat_desc,
    rope_desc,
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
    ROW_BLOCKS: gl.constexpr,
    MODE: gl.constexpr,
    UNIT_QLEN: gl.constexpr,
    WRITE_LSE: gl.constexpr,
    PAGE_SIZE: gl.constexpr,
    ROW_MAP: gl.constexpr,
    HAS_LENGTHS: gl.constexpr,
    num_warps: gl.constexpr,
):
    gl.static_assert(num_warps == LOADER_WARPS, "the launch's warps are the loader warpgroup")
    gl.static_assert(NR == 16, "16 rows (the merge holds two 512x16 fp32 outputs)")
    gl.static_assert(BLOCK_N == 64, "64-token tiles (the QKᵀ M of one warpgroup)")
    gl.static_assert(kv_ptr.dtype.element_ty.primitive_bitwidth == 8, "fp8 caches")
    kv_dtype: gl.constexpr = kv_ptr.dtype.element_ty
    # The MMAs run in fp16: fp8 widens to fp16 exactly; the query is rounded to fp16.
    dtype: gl.constexpr = gl.float16
    mma_smem: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    p_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=NR * 2, element_bitwidth=16, rank=2)

    # -- the work item (as in the 64-row kernel) -----------------------------------------------
    rb, work, req = _work_item(num_splits, work_info_ptr, ROW_BLOCKS, MODE)
    if MODE != 0:  # noqa: SIM102 (MODE is a constexpr: this if is resolved at compile time)
        if req < 0:
            return
    kv_start, kv_len, lo, hi, direct, q_start, qlen = _work_range(
        req, work, num_splits, kv_indptr_ptr, work_info_ptr, split_indptr_ptr, qo_indptr_ptr, lengths_ptr,
        MODE, UNIT_QLEN, BLOCK_N, HAS_LENGTHS,
    )  # fmt: skip
    qk_scale, v_scale = _scales(sm_scale_log2, kv_scale_ptr, True)

    # -- shared memory and barriers --------------------------------------------------------------
    q_nope_smem = gl.allocate_shared_memory(dtype, [NR, L], mma_smem)
    q_pe_smem = gl.allocate_shared_memory(dtype, [NR, R], mma_smem)
    # The fp8 ring: SLOTS full-tile slots, each as four [64, 128] latent boxes and one [64, 64]
    # rope box (the TMA boxes; the cp.async gathers fill the same layout).
    lat_ring = gl.allocate_shared_memory(
        kv_dtype, [SLOTS * (L // BOX_COLS), BLOCK_N, BOX_COLS], LAT_BOX_LAYOUT
    )
    rope_ring = gl.allocate_shared_memory(kv_dtype, [SLOTS, BLOCK_N, R], ROPE_BOX_LAYOUT)
    # What the key operand holds for each slot's tile (flat or block ids), for the key check.
    id_ring = gl.allocate_shared_memory(
        gl.int32, [SLOTS, BLOCK_N], gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    )
    p_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, NR], p_layout)
    red_smem = gl.allocate_shared_memory(
        gl.float32, [2 * 4 * NR], gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    )
    # landed[s]: ring slot s's copies landed (one arrival per loader thread and one of thread 0,
    # see _loader); free[s]: the warpgroup of its tile has read it; merged: warpgroup 1's output
    # is in the merge buffer.
    landed = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    merged = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(SLOTS):
        mbarrier.init(landed.index(i), count=LOADER_WARPS * 32 + 1)
        mbarrier.init(free.index(i), count=1)
    mbarrier.init(merged, count=1)
    # Every ring slot starts free (phase 0 of each "free" barrier completes).
    for i in gl.static_range(SLOTS):
        mbarrier.arrive(free.index(i))

    # -- the NR query rows, rounded to fp16 (by the loader warps) --------------------------------
    _query_to_smem(
        q_nope_ptr, q_pe_ptr, q_nope_smem, q_pe_smem, rb, qlen, kv_len, q_start,
        stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h, H, NR, L, R, True,
    )  # fmt: skip
    fence_async_shared()
    gl.thread_barrier()

    # The output pointers and strides in the order :func:`~.transposed._store_rows_output` takes.
    outs = (
        out_ptr, lse_ptr, part_o_ptr, part_lse_ptr, stride_o_t, stride_o_h, stride_lse_t, stride_lse_h,
        stride_po_w, stride_po_q, stride_po_h, stride_pl_w, stride_pl_q,
    )  # fmt: skip
    index_base = _key_operand(kv_indices_ptr, kv_start, req, stride_bt, row_request_ptr, PAGE_SIZE, ROW_MAP)
    id_limit = _id_limit(num_kv_rows, PAGE_SIZE)
    IN_PAGE: gl.constexpr = _tile_in_page(MODE, PAGE_SIZE, BLOCK_N)
    mma_args = (
        q_nope_smem, q_pe_smem, lat_ring, rope_ring, id_ring, p_smem, red_smem, merge_ptr, landed, free,
        merged, outs, lo, hi, kv_len, qlen, q_start, rb, work, direct, qk_scale, v_scale, id_limit,
    )  # fmt: skip
    gl.warp_specialize(
        [
            (
                _loader,
                (
                    kv_ptr, lat_desc, rope_desc, index_base, lo, hi, id_limit, stride_kv, lat_ring,
                    rope_ring, id_ring, landed, free, L, R, BLOCK_N, PAGE_SIZE, IN_PAGE,
                ),
            ),
            (_mma_warpgroup, (mma_args, 0, H, L, NR, BLOCK_N, WRITE_LSE, IN_PAGE)),
            (_mma_warpgroup, (mma_args, 1, H, L, NR, BLOCK_N, WRITE_LSE, IN_PAGE)),
        ],
        [4, 4],
        [MMA_REGS, MMA_REGS],
    )  # fmt: skip
