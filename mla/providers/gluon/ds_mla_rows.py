# mypy: disable-error-code="no-untyped-def, untyped-decorator"
"""Gluon MLA decode of 16 (or 32) query rows on ``fp8_ds_mla`` rows: a producer that gathers and
dequantizes, one MMA warpgroup.

``fp8_ds_mla`` is the sparse attention's cache format: a 656-byte row holds 512 e4m3 latent
values, one float32 scale per 128-wide latent tile and 64 bf16 rope values. On the few-rows
kernel of :mod:`.transposed` one warpgroup waits for each gathered tile, dequantizes it into the
bf16 MMA tile, then runs ``QKᵀ``, the softmax and ``PV`` in series, so nothing hides the
gather's latency or the dequantization behind the MMAs (1.76 TB/s at H16 B128 q2 top-k 2048,
where bf16 rows reach 3.24 TB/s on the same kernel). Here the work is split in two
partitions (``gl.warp_specialize``), handing tiles over through mbarriers:

* the **producer** (the default partition, :data:`PRODUCER_WARPS` warps: the launch's
  ``num_warps``) gathers every 64-token tile of the work item's key range in chunks of
  ``CHUNK`` rows with ``cp.async`` (the token ids through a ``cp.async`` id ring running
  ``FP8_SLOTS`` chunks ahead, :func:`.kernels._issue_ids`; the rows by
  :func:`.kernels._issue_tile`: ids outside the cache, a ``-1`` pad among them, and positions
  past the range read nothing and are zero-filled): the fp8 latent and the tile scales into a
  ring of ``FP8_SLOTS`` chunk slots, the bf16 rope lanes straight into a ring of ``ROPE_SLOTS``
  MMA-layout rope tiles. It then dequantizes each chunk (fp8 × its 128-wide tile's scale →
  bf16, :func:`.kernels._widen_ds_mla`) into a ring of ``WIDE_SLOTS`` bf16 ``[64, 512]`` MMA
  tiles and announces a whole tile on ``wide_ready``. A chunk slot is refilled as soon as it
  is widened; ``FP8_SLOTS - 1`` chunks are in flight while one is widened;
* the **MMA** warpgroup (4 warps at ``MMA_REGS`` registers, ``setmaxnreg``) computes the
  products of :mod:`.transposed` with the ``NR`` query rows as the MMA N dimension: ``Sᵀ = K·Qᵀ``
  from the bf16 tile and the rope tile (which it releases on ``rope_free`` once done), the
  online softmax (exp2 domain, fp32; the row sums' terms stay in each thread until the last
  tile), then ``Oᵀ += Vᵀ·Pᵀ`` with ``Pᵀ`` through shared memory, and releases the bf16 tile on
  ``wide_free``. With ``OVERLAP`` it issues ``QKᵀ`` of tile ``t + 1`` right behind ``PV`` of
  tile ``t`` (the wait for the next tile and its key ids run while ``PV`` does, both products
  are in flight together) and releases tile ``t`` once ``PV`` is done; without it (the
  planner's pick) the loop is serial and releases each bf16 tile as soon as its ``PV`` is done,
  before it waits for the next (the producer then never waits for a slot the MMA could have
  freed).

At 16 rows and 8 producer warps the program is 12 warps: the MMA warpgroup runs at 160
registers a thread, the producer at 168 (the rest of the register file); neither spills
(``tests/gluon/test_ds_mla_registers.py``).

Shared memory at 16 rows (``RINGS[16]``: 32-row chunks, 2 chunk slots, 2 rope tiles, 2 bf16
tiles): query 18 KB, bf16 tiles 128 KB, rope tiles 16 KB, fp8 chunks 32 KB + 1 KB scales, id
ring, ``Pᵀ`` 2 KB: :func:`shared_bytes` (about 198 KB of the 227 KB an SM gives a block). At 32
rows (query 36 KB, ``Pᵀ`` 4 KB) the rings are shaped for the larger query (``RINGS[32]``). One
program per SM. (Dequantizing in place, with each tile's fp8 bytes staged inside its own bf16
tile as the 64-row kernel's producer does, measured slower here: two bf16 tiles are all that
fit beside the ring, so one tile is in flight at a time. Two MMA warpgroups taking alternate
tiles, merged at the end, measured slower too: the producer, left 80–96 registers, is the
bottleneck; 16 producer warps were slower as well. So was the per-tensor fp8 kernel's layout,
:mod:`.dual`, with the tile scales: a loader warpgroup and two MMA warpgroups dequantizing
alternate tiles in registers, whose MMA chains alone took about as long as this kernel: the
measurements are in ``docs/performance.md``, "Kernel choices".)

Work items (non-persistent splits, the planned schedule, unit-qlen rows), masking, NaN rules and
the outputs (direct, or fp32 partials for the split reduce; ``o = 0``, ``lse = -inf`` for a row
with no key) are those of :mod:`.transposed` (:func:`.transposed._store_rows_output`). The MMAs
run in bf16 (the query is bf16; scaled values may pass fp16's range).
:func:`.planner.launch_config` picks it for ``fp8_ds_mla`` launches of 16-row tiles.
"""

from __future__ import annotations

from typing import NamedTuple

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
    MMA_TILE_LAYOUT,
    PLAIN_LAYOUT,
    RELEASE_ARRIVALS,
    _issue_ids,
    _issue_tile,
    _key_ok,
    _key_operand,
    _kv_copy_layouts,
    _online_softmax_unsummed,
    _query_copy,
    _release,
    _row_info,
    _scales,
    _wait_for_previous,
    _widen_ds_mla,
    _work_item,
    _work_range,
)
from mla.providers.gluon.transposed import _store_rows_output


class DsMlaRings(NamedTuple):
    """The ring shapes of one launch (constexprs of :func:`mla_decode_ds_mla_kernel`)."""

    chunk: int
    """Cache rows per gathered and widened chunk (16, 32 or 64: a 64-token tile is ``64 / chunk``
    chunks)."""
    fp8_slots: int
    """Chunk slots of the fp8 ring (latent and tile scales)."""
    rope_slots: int
    """bf16 rope tiles (the MMA reads them in place)."""
    wide_slots: int
    """bf16 latent tiles the producer dequantizes into (the MMA's K and V)."""


PRODUCER_WARPS = 8
"""Warps of the producer, the default partition (the launch's ``num_warps``): the
dequantization is the kernel's heaviest work (32768 values a tile)."""
MMA_REGS = 160
"""Registers per MMA-warpgroup thread (``setmaxnreg``): ``Oᵀ`` is 64 (16 rows) or 128 (32 rows)
fp32 a thread; the producer gets the rest of the register file."""
MMA_REGS_32 = 232
"""The same at 32 rows (``Oᵀ`` 128 registers a thread)."""
RINGS: dict[int, DsMlaRings] = {16: DsMlaRings(32, 2, 2, 2), 32: DsMlaRings(16, 4, 3, 2)}
"""Ring shapes by row tile (the launcher's). At 16 rows, two 32-row fp8 chunks and two rope
tiles measured fastest of five shapes on the H200 (H16, top-k 2048: 155.1 µs at B128 qlen 2
against 161.8 with three of each; 16-row chunks 196–204); a third fp8 chunk alone,
``DsMlaRings(32, 3, 2, 2)``, was slower still on an H100 (184.5 against 160.6 µs)."""
TILE = 64
"""Tokens per MMA tile (the wgmma M dimension of one warpgroup)."""
BLOCK_N = gl.constexpr(TILE)
""":data:`TILE`, for the kernels."""


def shared_bytes(rows: int, rings: DsMlaRings, *, rank: int = 512, rope: int = 64) -> int:
    """Shared memory the kernel's buffers take (without the compiler's own few hundred bytes):
    query, bf16 and rope tiles, fp8 chunks with their scales, the id ring, ``Pᵀ``, barriers."""
    block_n = TILE
    query = rows * (rank + rope) * 2
    tiles = rings.wide_slots * block_n * rank * 2 + rings.rope_slots * block_n * rope * 2
    chunks = rings.fp8_slots * rings.chunk * (rank + 4 * (rank // 128))
    ids = 2 * rings.fp8_slots * rings.chunk * 4
    barriers = 8 * (2 * rings.wide_slots + rings.rope_slots)
    return query + tiles + chunks + ids + block_n * rows * 2 + barriers


def ring_ok(rings: DsMlaRings) -> bool:
    """Whether the producer never waits for a rope tile the MMA can only free after a tile the
    producer has yet to widen (it issues chunk ``c + fp8_slots - 1``, whose rope tile is freed by
    the QKᵀ of ``rope_slots`` tiles earlier, before it widens chunk ``c``)."""
    block_n = TILE
    per_tile = block_n // rings.chunk
    return (
        block_n % rings.chunk == 0
        and rings.fp8_slots >= 2
        and rings.wide_slots >= 2
        and rings.rope_slots >= 1 + (per_tile + rings.fp8_slots - 2) // per_tile
    )


@gluon.jit
def _issue_chunk(
    kv_ptr, idx_ring, index_base, t, n_tiles, lo, hi, num_rows, stride_kv, lat_ring, scale_ring,
    rope_ring, rope_free, PART: gl.constexpr,
    L: gl.constexpr, R: gl.constexpr, CHUNK: gl.constexpr, FP8_SLOTS: gl.constexpr,
    ROPE_SLOTS: gl.constexpr, LAT_LD: gl.constexpr, ROPE_LD: gl.constexpr, ID_LD: gl.constexpr,
    PAGE_SIZE: gl.constexpr,
):  # fmt: skip
    """One ``cp.async`` group: chunk ``PART`` of tile ``t`` (``j = t·64/CHUNK + PART``, when ``t <
    n_tiles``) into fp8 slot ``j % FP8_SLOTS`` and its rope rows into rope tile ``t %
    ROPE_SLOTS`` (the first chunk of a tile waits until the MMA freed that tile), and the token
    ids of chunk ``j + FP8_SLOTS`` into the id ring."""
    PER_TILE: gl.constexpr = BLOCK_N // CHUNK
    ID_SLOTS: gl.constexpr = 2 * FP8_SLOTS
    j = t * PER_TILE + PART
    if t < n_tiles:
        if PART == 0:
            mbarrier.wait(rope_free.index(t % ROPE_SLOTS), (t // ROPE_SLOTS) & 1)
        rope_dst = rope_ring.index(t % ROPE_SLOTS).slice(PART * CHUNK, CHUNK, dim=0)
        _issue_tile(
            kv_ptr, idx_ring, j, lo, hi, num_rows, stride_kv, lat_ring.index(j % FP8_SLOTS), rope_dst,
            L, R, CHUNK, ID_SLOTS, LAT_LD, ROPE_LD, scale_ring, j % FP8_SLOTS, True, PAGE_SIZE,
        )  # fmt: skip
    _issue_ids(index_base, idx_ring, j + FP8_SLOTS, lo, hi, CHUNK, ID_SLOTS, ID_LD, PAGE_SIZE)
    async_copy.commit_group()


@gluon.jit
def _producer(
    kv_ptr, index_base, lo, hi, num_rows, stride_kv, idx_ring, lat_ring, scale_ring, rope_ring, wide,
    wide_ready, wide_free, rope_free,
    L: gl.constexpr, R: gl.constexpr, CHUNK: gl.constexpr, FP8_SLOTS: gl.constexpr,
    ROPE_SLOTS: gl.constexpr, WIDE_SLOTS: gl.constexpr, PAGE_SIZE: gl.constexpr,
):  # fmt: skip
    """The producer partition: chunk ``c`` of ``[lo, hi)`` (``64 / CHUNK`` a tile) gathered into fp8
    slot ``c % FP8_SLOTS`` (``FP8_SLOTS - 1`` chunks ahead of the one it widens), then dequantized
    into its rows of bf16 tile ``t % WIDE_SLOTS`` of its tile ``t`` once the MMA freed that tile;
    the last chunk of a tile announces it on ``wide_ready`` (its rope rows, in the groups of the
    tile's chunks, have landed by then)."""
    warps: gl.constexpr = gl.num_warps()
    lat_ld: gl.constexpr = _kv_copy_layouts(True, warps)[0]
    rope_ld: gl.constexpr = _kv_copy_layouts(False, warps)[1]
    id_ld: gl.constexpr = gl.BlockedLayout([1], [32], [warps], [0])
    PER_TILE: gl.constexpr = BLOCK_N // CHUNK
    n_tiles = gl.cdiv(hi - lo, BLOCK_N)
    # The ids of the first FP8_SLOTS chunks; each chunk's group then brings the ids FP8_SLOTS
    # chunks further, so no gather waits on an id load.
    for j in gl.static_range(FP8_SLOTS):
        _issue_ids(index_base, idx_ring, j, lo, hi, CHUNK, 2 * FP8_SLOTS, id_ld, PAGE_SIZE)
    async_copy.commit_group()
    async_copy.wait_group(0)
    gl.thread_barrier()
    for j in gl.static_range(FP8_SLOTS - 1):
        _issue_chunk(
            kv_ptr, idx_ring, index_base, j // PER_TILE, n_tiles, lo, hi, num_rows, stride_kv, lat_ring,
            scale_ring, rope_ring, rope_free, j % PER_TILE, L, R, CHUNK, FP8_SLOTS, ROPE_SLOTS, lat_ld,
            rope_ld, id_ld, PAGE_SIZE,
        )  # fmt: skip
    for t in range(n_tiles):
        w = t % WIDE_SLOTS
        for part in gl.static_range(PER_TILE):
            # Chunk c + FP8_SLOTS - 1 into the slot of chunk c - 1, widened last (every producer
            # warp is past it).
            _issue_chunk(
                kv_ptr, idx_ring, index_base, t + (part + FP8_SLOTS - 1) // PER_TILE, n_tiles, lo, hi,
                num_rows, stride_kv, lat_ring, scale_ring, rope_ring, rope_free,
                (part + FP8_SLOTS - 1) % PER_TILE, L, R, CHUNK, FP8_SLOTS, ROPE_SLOTS, lat_ld, rope_ld,
                id_ld, PAGE_SIZE,
            )  # fmt: skip
            async_copy.wait_group(FP8_SLOTS - 1)
            gl.thread_barrier()
            if part == 0:
                mbarrier.wait(wide_free.index(w), (t // WIDE_SLOTS) & 1)
            s = (t * PER_TILE + part) % FP8_SLOTS
            dst = wide.index(w).slice(part * CHUNK, CHUNK, dim=0)
            _widen_ds_mla(lat_ring.index(s), scale_ring.index(s), dst, CHUNK, L, CHUNK)
            fence_async_shared()
            gl.thread_barrier()
        mbarrier.arrive(wide_ready.index(w))
    async_copy.wait_group(0)


@gluon.jit
def _scores(q_nope_smem, q_pe_smem, wide, rope_ring, wide_ready, s_zero, t, WIDE_SLOTS: gl.constexpr,
            ROPE_SLOTS: gl.constexpr):  # fmt: skip
    """Wait for bf16 tile ``t`` and issue ``Sᵀ = K·Qᵀ`` over its latent and rope parts (two
    asynchronous MMAs)."""
    mbarrier.wait(wide_ready.index(t % WIDE_SLOTS), (t // WIDE_SLOTS) & 1)
    # (the producer fenced its stores before the arrival; this fence after the wait, as in the
    # other kernels' consumers, costs nothing measurable: taking it out was no faster)
    fence_async_shared()
    k_lat = wide.index(t % WIDE_SLOTS)
    sc = warpgroup_mma(k_lat, q_nope_smem.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    return warpgroup_mma(rope_ring.index(t % ROPE_SLOTS), q_pe_smem.permute((1, 0)), sc, is_async=True)


@gluon.jit
def _softmax_pv(
    sc, acc, m_i, l_part, n, key_ok, row_limit, qk_scale, wide, p_smem, t, WIDE_SLOTS: gl.constexpr
):  # fmt: skip
    """Tile ``t``'s online-softmax step on the raw scores ``sc`` (``[64, NR]``, waited), the
    rescale of ``acc`` (not in flight), ``Pᵀ`` into shared memory, ``Oᵀ += Vᵀ·Pᵀ`` issued. Returns
    the in-flight output, the running max and row sums' terms (``[64, NR]``: sum them on axis 0)."""
    p, alpha, m_i = _online_softmax_unsummed(sc, m_i, n, key_ok, row_limit, qk_scale, 0)
    l_part = l_part * alpha[None, :] + p
    acc = acc * alpha[None, :]
    p_smem.store(p.to(p_smem.dtype))
    fence_async_shared()
    gl.thread_barrier()
    acc = warpgroup_mma(wide.index(t % WIDE_SLOTS).permute((1, 0)), p_smem, acc, is_async=True)
    return acc, m_i, l_part


@gluon.jit
def _mma_partition(
    args, H: gl.constexpr, L: gl.constexpr, NR: gl.constexpr, WIDE_SLOTS: gl.constexpr,
    ROPE_SLOTS: gl.constexpr, WRITE_LSE: gl.constexpr, PAGE_SIZE: gl.constexpr, OVERLAP: gl.constexpr,
):  # fmt: skip
    """The MMA warpgroup: every tile's ``Sᵀ = K·Qᵀ``, online softmax and ``Oᵀ += Vᵀ·Pᵀ`` from the
    producer's bf16 and rope tiles (released on ``wide_free`` / ``rope_free`` when read), then the
    outputs. ``args``: the kernel's buffers, barriers, output pointers and strides (``outs``)
    and work item."""
    (
        q_nope_smem, q_pe_smem, wide, rope_ring, p_smem, wide_ready, wide_free, rope_free, outs,
        lo, hi, kv_len, qlen, q_start, rb, work, direct, qk_scale, v_scale, index_base, num_rows,
    ) = args  # fmt: skip
    # The partition reads its arguments before anything of it writes shared memory.
    gl.thread_barrier()
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, NR, 16]
    )
    _qi, _hd, _ok, row_limit = _row_info(rb, qlen, kv_len, H, NR, gl.SliceLayout(0, st_layout))
    m_i = gl.full([NR], float("-inf"), gl.float32, layout=gl.SliceLayout(0, st_layout))
    l_part = gl.zeros([BLOCK_N, NR], gl.float32, layout=st_layout)
    acc = gl.zeros([L, NR], gl.float32, layout=st_layout)
    s_zero = gl.zeros([BLOCK_N, NR], gl.float32, layout=st_layout)
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, st_layout))
    n_tiles = gl.cdiv(hi - lo, BLOCK_N)
    if OVERLAP:
        # QKᵀ of tile t + 1 is issued behind PV of tile t; the first tile's QKᵀ and the last
        # tile's PV are peeled, so the loop has no branch around the in-flight accumulators.
        if n_tiles > 0:
            n = lo + offs_n
            key_ok = _key_ok(index_base, n, hi, num_rows, PAGE_SIZE)
            sc = _scores(
                q_nope_smem, q_pe_smem, wide, rope_ring, wide_ready, s_zero, 0, WIDE_SLOTS, ROPE_SLOTS
            )
            sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc,))
            _release(rope_free.index(0))
            for t in range(n_tiles - 1):
                acc, m_i, l_part = _softmax_pv(
                    sc, acc, m_i, l_part, n, key_ok, row_limit, qk_scale, wide, p_smem, t, WIDE_SLOTS
                )
                n = (t + 1) * BLOCK_N + lo + offs_n
                key_ok = _key_ok(index_base, n, hi, num_rows, PAGE_SIZE)
                sc = _scores(
                    q_nope_smem, q_pe_smem, wide, rope_ring, wide_ready, s_zero, t + 1, WIDE_SLOTS, ROPE_SLOTS
                )
                # PV of tile t (the older group) done: its bf16 tile is free.
                acc = warpgroup_mma_wait(num_outstanding=2, deps=(acc,))
                _release(wide_free.index(t % WIDE_SLOTS))
                sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc,))
                _release(rope_free.index((t + 1) % ROPE_SLOTS))
            last = n_tiles - 1
            acc, m_i, l_part = _softmax_pv(
                sc, acc, m_i, l_part, n, key_ok, row_limit, qk_scale, wide, p_smem, last, WIDE_SLOTS
            )
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            _release(wide_free.index(last % WIDE_SLOTS))
    else:
        for t in range(n_tiles):
            n = t * BLOCK_N + lo + offs_n
            key_ok = _key_ok(index_base, n, hi, num_rows, PAGE_SIZE)
            sc = _scores(
                q_nope_smem, q_pe_smem, wide, rope_ring, wide_ready, s_zero, t, WIDE_SLOTS, ROPE_SLOTS
            )
            sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc,))
            _release(rope_free.index(t % ROPE_SLOTS))
            acc, m_i, l_part = _softmax_pv(
                sc, acc, m_i, l_part, n, key_ok, row_limit, qk_scale, wide, p_smem, t, WIDE_SLOTS
            )
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            _release(wide_free.index(t % WIDE_SLOTS))
    l_i = gl.sum(l_part, 0)
    _store_rows_output(
        acc, m_i, l_i, v_scale, rb, qlen, kv_len, q_start, work, direct, outs, H, NR, L, WRITE_LSE, st_layout
    )


# ``num_splits`` is never specialised (as in :mod:`.kernels`).
@gluon.jit(do_not_specialize=["num_splits"])
def mla_decode_ds_mla_kernel(
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
    NR: gl.constexpr,
    BLOCK_N: gl.constexpr,
    CHUNK: gl.constexpr,
    FP8_SLOTS: gl.constexpr,
    ROPE_SLOTS: gl.constexpr,
    WIDE_SLOTS: gl.constexpr,
    MMA_REGS: gl.constexpr,
    OVERLAP: gl.constexpr,
    ROW_BLOCKS: gl.constexpr,
    MODE: gl.constexpr,
    UNIT_QLEN: gl.constexpr,
    WRITE_LSE: gl.constexpr,
    PAGE_SIZE: gl.constexpr,
    ROW_MAP: gl.constexpr,
    HAS_LENGTHS: gl.constexpr,
    PDL: gl.constexpr,
    num_warps: gl.constexpr,
):
    """``fp8_ds_mla`` decode of ``NR`` packed query rows per program (module docstring). ``kv_ptr``:
    the cache's byte rows as e4m3 (``[rows, L + 4·L/128 + 2·R]``); q bf16; ``kv_scale_ptr`` unused
    (the rows carry their scales). Launched with ``num_warps`` producer warps."""
    gl.static_assert(NR == 16 or NR == 32, "16 or 32 query rows (the MMA N dimension)")  # noqa: PLR1714
    gl.static_assert(BLOCK_N == 64, "64-token tiles (the wgmma M dimension of one warpgroup)")
    gl.static_assert(BLOCK_N % CHUNK == 0, "whole chunks per tile")
    gl.static_assert(FP8_SLOTS >= 2 and WIDE_SLOTS >= 2, "a chunk in flight while one is widened")
    PER_TILE: gl.constexpr = BLOCK_N // CHUNK
    gl.static_assert(ROPE_SLOTS >= 1 + (PER_TILE + FP8_SLOTS - 2) // PER_TILE, "rope tiles (ring_ok)")
    gl.static_assert(q_nope_ptr.dtype.element_ty == gl.bfloat16, "fp8_ds_mla rows carry bf16 rope lanes")
    dtype: gl.constexpr = gl.bfloat16
    kv_dtype: gl.constexpr = kv_ptr.dtype.element_ty
    p_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=NR * 2, element_bitwidth=16, rank=2)
    vec_smem: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])

    _wait_for_previous(PDL)
    # -- the work item (as in the 64-row kernel) -----------------------------------------------
    rb, work, req = _work_item(num_splits, work_info_ptr, ROW_BLOCKS, MODE)
    if MODE != 0:  # noqa: SIM102 (MODE is a constexpr: this if is resolved at compile time)
        if req < 0:
            return
    kv_start, kv_len, lo, hi, direct, q_start, qlen = _work_range(
        req, work, num_splits, kv_indptr_ptr, work_info_ptr, split_indptr_ptr, qo_indptr_ptr, lengths_ptr,
        MODE, UNIT_QLEN, BLOCK_N, HAS_LENGTHS,
    )  # fmt: skip
    qk_scale, v_scale = _scales(sm_scale_log2, kv_scale_ptr, False)

    # -- shared memory and barriers --------------------------------------------------------------
    q_nope_smem = gl.allocate_shared_memory(dtype, [NR, L], MMA_TILE_LAYOUT)
    q_pe_smem = gl.allocate_shared_memory(dtype, [NR, R], MMA_TILE_LAYOUT)
    wide = gl.allocate_shared_memory(dtype, [WIDE_SLOTS, BLOCK_N, L], MMA_TILE_LAYOUT)
    rope_ring = gl.allocate_shared_memory(dtype, [ROPE_SLOTS, BLOCK_N, R], MMA_TILE_LAYOUT)
    lat_ring = gl.allocate_shared_memory(kv_dtype, [FP8_SLOTS, CHUNK, L], PLAIN_LAYOUT)
    scale_ring = gl.allocate_shared_memory(gl.float32, [FP8_SLOTS, CHUNK, L // 128], PLAIN_LAYOUT)
    idx_ring = gl.allocate_shared_memory(gl.int32, [2 * FP8_SLOTS, CHUNK], vec_smem)
    p_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, NR], p_layout)
    # wide_ready[w]: bf16 tile w is widened (one arrival, the producer's); wide_free[w]: the MMA's
    # PV read it; rope_free[r]: the MMA's QKᵀ read rope tile r.
    wide_ready = gl.allocate_shared_memory(gl.int64, [WIDE_SLOTS, 1], mbarrier.MBarrierLayout())
    wide_free = gl.allocate_shared_memory(gl.int64, [WIDE_SLOTS, 1], mbarrier.MBarrierLayout())
    rope_free = gl.allocate_shared_memory(gl.int64, [ROPE_SLOTS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(WIDE_SLOTS):
        mbarrier.init(wide_ready.index(i), count=1)
        mbarrier.init(wide_free.index(i), count=RELEASE_ARRIVALS)
    for i in gl.static_range(ROPE_SLOTS):
        mbarrier.init(rope_free.index(i), count=RELEASE_ARRIVALS)
    # Every slot starts free (phase 0 of each "free" barrier completes).
    for i in gl.static_range(WIDE_SLOTS):
        mbarrier.arrive(wide_free.index(i), count=RELEASE_ARRIVALS)
    for i in gl.static_range(ROPE_SLOTS):
        mbarrier.arrive(rope_free.index(i), count=RELEASE_ARRIVALS)

    # -- the NR query rows (by the producer warps), in flight with the producer's first token ids:
    # its first wait for the id group waits for this older group too, and the MMA warpgroup
    # reads the rows after the producer's first wide_ready arrival. ------------------------------
    _query_copy(
        q_nope_ptr, q_pe_ptr, q_nope_smem, q_pe_smem, rb, qlen, kv_len, q_start,
        stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h, H, NR, L, R,
    )  # fmt: skip
    # (the barriers' initialisation, as before the partitions start)
    fence_async_shared()
    gl.thread_barrier()

    # The output pointers and strides in the order _store_rows_output takes.
    outs = (
        out_ptr, lse_ptr, part_o_ptr, part_lse_ptr, stride_o_t, stride_o_h, stride_lse_t, stride_lse_h,
        stride_po_w, stride_po_q, stride_po_h, stride_pl_w, stride_pl_q,
    )  # fmt: skip
    index_base = _key_operand(kv_indices_ptr, kv_start, req, stride_bt, row_request_ptr, PAGE_SIZE, ROW_MAP)
    mma_args = (
        q_nope_smem, q_pe_smem, wide, rope_ring, p_smem, wide_ready, wide_free, rope_free, outs,
        lo, hi, kv_len, qlen, q_start, rb, work, direct, qk_scale, v_scale, index_base, num_kv_rows,
    )  # fmt: skip
    gl.warp_specialize(
        [
            (
                _producer,
                (
                    kv_ptr, index_base, lo, hi, num_kv_rows, stride_kv, idx_ring, lat_ring, scale_ring,
                    rope_ring, wide, wide_ready, wide_free, rope_free,
                    L, R, CHUNK, FP8_SLOTS, ROPE_SLOTS, WIDE_SLOTS, PAGE_SIZE,
                ),
            ),
            (_mma_partition, (mma_args, H, L, NR, WIDE_SLOTS, ROPE_SLOTS, WRITE_LSE, PAGE_SIZE, OVERLAP)),
        ],
        [4],
        [MMA_REGS],
    )  # fmt: skip


__all__ = [
    "MMA_REGS",
    "MMA_REGS_32",
    "PRODUCER_WARPS",
    "RINGS",
    "DsMlaRings",
    "mla_decode_ds_mla_kernel",
    "ring_ok",
    "shared_bytes",
]
