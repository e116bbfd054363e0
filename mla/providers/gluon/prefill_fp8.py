# mypy: disable-error-code="no-untyped-def, untyped-decorator"
"""Gluon (Hopper) fp8 varlen prefill: the ``fp8-prefill`` contract with TMA and fp8 ``wgmma``.

The layout of :mod:`.prefill`'s bf16 kernel (``PLAIN`` and ``PRODUCER`` warp splits: one
program per 128-row query tile of one (request, head), the two warpgroups of an 8-warp
consumer taking 64 rows each; a K/V ring filled by TMA; causal masking only on the tiles that
straddle the diagonal or the end of the request's keys; the same varlen, NaN and LSE rules) over
e4m3 q/k/v whose values are ``stored * scale`` (per-tensor float32 scales, read on the device).
``SPLIT`` (``MODE`` 2) is FA3's fp8 layout instead: a 4-warp producer that loads and transposes
V, and each consumer warpgroup a partition of its own (:mod:`.prefill_fp8_split`); what follows
holds for it but for who transposes V and which tiles' V it cleans (only those reaching past the
request's keys, as the bf16 split layouts).

* **QKᵀ** is an fp8 ``wgmma`` (e4m3 × e4m3 → fp32): the q and K tiles are ``[rows, D]`` with
  ``D`` contiguous, i.e. K-major for both operands, as TMA lands them (64-column boxes of 64
  bytes, 64-byte swizzle). ``q_scale · k_scale · softmax_scale · log2 e`` is one multiply of
  the fp32 scores (the exp2 domain).
* **PV** is an fp8 ``wgmma`` too, and an 8-bit ``wgmma`` B operand must be K-major (keys
  contiguous), which a ``[keys, Dv]`` V tile is not: the consumer loads each V tile from its
  ring slot into registers (its non-finite lanes zeroed in a masked tile, as the bf16 kernel
  does), writes it back transposed into a ``[Dv, keys]`` tile of its own, fences, and releases
  the ring slot right away (``PV`` reads only the transposed copy). The transpose runs while
  the tile's ``QKᵀ`` is in flight.
* **P in e4m3, scaled by 2⁸** (FA3's ``max_offset``): the running max is kept 8 below the true
  one, so ``p = exp2(s - m)`` lies in ``[0, 256]`` (256 is exact in e4m3, whose largest value is
  448) and every ``p`` down to 2⁻¹⁴ of the row max stays a normal e4m3 number. ``l`` sums the
  fp32 ``p`` (the same 2⁸ factor), so ``out = acc / l`` and ``lse = (m + log2 l)·ln 2`` need
  no correction. e4m3 keeps 3 mantissa bits: the output's relative error against the
  reference on the dequantized inputs is about 2-3% on diffuse attention (the Triton fp8
  kernel keeps P in fp16 for that reason). ``v_scale`` multiplies the output in the epilogue.
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

from mla.providers.gluon.prefill import _producer
from mla.providers.gluon.prefill_epilogue import _store_rows
from mla.providers.gluon.prefill_fp8_parts import (
    FP8_TILE_LAYOUT,
    P_OFFSET,
    _dequant_scales,
    _fp8_mma_layout,
    _softmax_step_fp8,
    _vt_layout,
)
from mla.providers.gluon.prefill_fp8_split import fp8_split_attention
from mla.providers.gluon.prefill_parts import (
    BLOCK_M,
    BOX,
    CONSUMER_WARPS,
    PRODUCER_REGS,
    PRODUCER_WARPS,
    SPLIT_PRODUCER_WARPS,
    _consumer_prologue,
    _consumer_rows,
    _copy_boxes,
    _issue_ahead,
    _issue_scores,
    _key_range,
    _query_tile,
    _release,
)
from mla.providers.triton.launch_cache import LaunchCache


@gluon.jit
def _transpose_v(v_slot, vt_smem, MASKED: gl.constexpr, BLOCK_N: gl.constexpr, KEYS: gl.constexpr):
    """Copy the ``[keys, Dv]`` V tile of a ring slot into ``vt_smem`` (``[Dv, keys]``, keys
    contiguous: the K-major B operand of ``P·V``). ``MASKED``: zero its non-finite lanes on the
    way and return, per key, 1.0 where its value row had one (layout ``KEYS``)."""
    # 4 keys x 4 lanes a thread: 32-bit loads along Dv, 32-bit stores along the keys.
    ld: gl.constexpr = gl.BlockedLayout([4, 4], [4, 8], [CONSUMER_WARPS, 1], [1, 0])
    v = v_slot.load(ld)
    if MASKED:
        vf = v.to(gl.float32)
        finite = (vf - vf) == 0.0
        key_bad = gl.convert_layout(gl.max(gl.where(finite, 0.0, 1.0), axis=1), KEYS)
        v = gl.where(finite, vf, 0.0).to(v.dtype)
    else:
        key_bad = gl.zeros([BLOCK_N], gl.float32, layout=KEYS)  # (unread)
    vt_smem.store(gl.permute(v, (1, 0)))
    fence_async_shared()
    gl.thread_barrier()
    return key_bad


@gluon.jit
def _attend_tile_fp8(
    q_smem, k_ring, v_ring, vt_smem, k_ready, v_ready, k_empty, v_empty, acc, m_i, l_i, t, row_last, qk_scale,
    MASKED: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, S_LAYOUT: gl.constexpr,
    O_LAYOUT: gl.constexpr,
):  # fmt: skip
    """Online softmax of key tile ``t`` (ring slot ``t % NUM_STAGES``) into ``(acc, m_i, l_i)``
    for the 128 query rows of the tile; ``MASKED``: key ``n`` counts for row ``r`` only when
    ``n <= row_last[r]`` (and the V tile's non-finite lanes are zeroed in the transpose)."""
    s = t % NUM_STAGES
    phase = (t // NUM_STAGES) & 1
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=4)
    o_rows: gl.constexpr = gl.SliceLayout(1, O_LAYOUT)
    keys_layout: gl.constexpr = gl.SliceLayout(0, S_LAYOUT)
    sc = _issue_scores(q_smem, k_ring, k_ready, t, 0, BLOCK_M, NUM_STAGES, S_LAYOUT)
    # (while QKᵀ runs) V, transposed into vt_smem; its ring slot is free once copied
    mbarrier.wait(v_ready.index(s), phase)
    key_bad = _transpose_v(v_ring.index(s), vt_smem, MASKED, BLOCK_N, keys_layout)
    mbarrier.arrive(v_empty.index(s))
    sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc,))
    _release(k_empty.index(s))
    p, alpha, m_new, row_bad = _softmax_step_fp8(sc, m_i, key_bad, row_last, t, qk_scale, MASKED, BLOCK_N)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
    if MASKED:
        acc = acc + gl.convert_layout(gl.where(row_bad > 0.0, float("nan"), 0.0), o_rows)[:, None]
    p8 = gl.convert_layout(p.to(vt_smem.dtype), p_layout)
    acc = warpgroup_mma(p8, vt_smem.permute((1, 0)), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    # (both warpgroups done reading vt_smem before either transposes the next tile into it)
    gl.thread_barrier()
    return acc, m_new, l_i


@gluon.jit
def _fp8_consumer(
    args, BLOCK_N: gl.constexpr, D_V: gl.constexpr, NUM_STAGES: gl.constexpr, WRITE_LSE: gl.constexpr,
    ISSUE_LOADS: gl.constexpr,
):  # fmt: skip
    """The 8-warp consumer: every key tile of the query tile, then its output rows of the
    request (and their LSE). ``ISSUE_LOADS``: no producer partition, the consumer keeps
    ``NUM_STAGES - 1`` tiles in flight itself. ``args``: the kernel's buffers, barriers, query
    tile, strides and scales (one tuple)."""
    (
        q_smem, k_ring, v_ring, vt_smem, q_bar, k_ready, v_ready, k_empty, v_empty, k_desc, v_desc, out_ptr,
        lse_ptr, q_begin, m0, seq_q, seq_k, k_row0, k_col, v_col, h, shift, n_full, n_tiles,
        stride_ot, stride_oh, stride_lt, stride_lh, qk_scale, v_scale,
    ) = args  # fmt: skip
    s_layout: gl.constexpr = _fp8_mma_layout(CONSUMER_WARPS, BLOCK_N)
    o_layout: gl.constexpr = _fp8_mma_layout(CONSUMER_WARPS, D_V)
    ring = (k_desc, v_desc, k_ring, v_ring, k_ready, v_ready, k_empty, v_empty, k_row0, k_col, v_col)
    _consumer_prologue(ring, n_tiles, ISSUE_LOADS, BLOCK_N, NUM_STAGES)
    rows, row_last, acc, m_i, l_i = _consumer_rows(q_bar, shift, seq_k, 0, BLOCK_M, D_V, s_layout, o_layout)
    # The tiles every row sees whole, unmasked; then the diagonal and partial ones, masked.
    for masked in gl.static_range(2):
        first = n_full if masked else 0
        last = n_tiles if masked else n_full
        for t in range(first, last):
            _issue_ahead(ring, t, n_tiles, ISSUE_LOADS, BLOCK_N, NUM_STAGES)
            acc, m_i, l_i = _attend_tile_fp8(
                q_smem, k_ring, v_ring, vt_smem, k_ready, v_ready, k_empty, v_empty, acc, m_i, l_i, t,
                row_last, qk_scale, masked == 1, BLOCK_N, NUM_STAGES, s_layout, o_layout,
            )  # fmt: skip

    # v_scale: one multiply of the output (the values are stored · v_scale)
    _store_rows(
        acc * v_scale, m_i, l_i, rows, out_ptr, lse_ptr, q_begin, m0, seq_q, h, stride_ot, stride_oh,
        stride_lt, stride_lh, 0, BLOCK_M, D_V, WRITE_LSE, o_layout,
    )  # fmt: skip


@gluon.jit
def _fp8_ring_attention(
    q_desc, k_desc, v_desc, out_ptr, lse_ptr, q_begin, m0, seq_q, seq_k, k_begin, h, shift, n_full, n_tiles,
    stride_qh, stride_kh, stride_vh, stride_ot, stride_oh, stride_lt, stride_lh, qk_scale, v_scale,
    D_QK: gl.constexpr, D_V: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
    WRITE_LSE: gl.constexpr, MODE: gl.constexpr,
):  # fmt: skip
    """The plain (``MODE`` 0) and producer (1) layouts' shared memory, barriers and partitions
    for one query tile: the K/V ring, one transposed V tile, the 8-warp consumer."""
    dtype: gl.constexpr = q_desc.dtype
    # -- shared memory and barriers --------------------------------------------------------------
    NQ: gl.constexpr = D_QK // BOX
    q_smem = gl.allocate_shared_memory(dtype, [NQ, BLOCK_M, BOX], FP8_TILE_LAYOUT)
    k_ring = gl.allocate_shared_memory(dtype, [NUM_STAGES * NQ, BLOCK_N, BOX], FP8_TILE_LAYOUT)
    v_ring = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, D_V], FP8_TILE_LAYOUT)
    vt_smem = gl.allocate_shared_memory(dtype, [D_V, BLOCK_N], _vt_layout(BLOCK_N))
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=1)
    # Every ring slot starts free (phase 0 of its empty barriers).
    for i in gl.static_range(NUM_STAGES):
        mbarrier.arrive(k_empty.index(i))
        mbarrier.arrive(v_empty.index(i))
    fence_async_shared()

    _copy_boxes(q_desc, q_begin + m0, h * stride_qh, q_bar, q_smem, 0, NQ, False)

    k_col = h * stride_kh
    v_col = h * stride_vh
    consumer_args = (
        q_smem, k_ring, v_ring, vt_smem, q_bar, k_ready, v_ready, k_empty, v_empty, k_desc, v_desc, out_ptr,
        lse_ptr, q_begin, m0, seq_q, seq_k, k_begin, k_col, v_col, h, shift, n_full, n_tiles,
        stride_ot, stride_oh, stride_lt, stride_lh, qk_scale, v_scale,
    )  # fmt: skip
    if MODE == 1:
        gl.warp_specialize(
            [
                (_fp8_consumer, (consumer_args, BLOCK_N, D_V, NUM_STAGES, WRITE_LSE, False)),
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
        _fp8_consumer(consumer_args, BLOCK_N, D_V, NUM_STAGES, WRITE_LSE, True)


@gluon.jit
def mla_fp8_prefill_kernel(
    q_desc,
    k_desc,
    v_desc,
    out_ptr,
    lse_ptr,
    cu_seqlens_q_ptr,
    cu_seqlens_k_ptr,
    q_scale_ptr,
    k_scale_ptr,
    v_scale_ptr,
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
    softmax_scale_log2e,
    D_QK: gl.constexpr,
    D_V: gl.constexpr,
    BLOCK_N: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    CAUSAL: gl.constexpr,
    WRITE_LSE: gl.constexpr,
    MODE: gl.constexpr,
    num_warps: gl.constexpr,
):
    # MODE 0: plain (the 8 consumer warps issue the loads); 1: a one-warp TMA producer partition;
    # 2: split (the launch's 4 warps are the producer, each consumer warpgroup its own partition).
    gl.static_assert(num_warps == (SPLIT_PRODUCER_WARPS if MODE == 2 else CONSUMER_WARPS), "launch warps")
    gl.static_assert(MODE <= 2, "the fp8 kernel has the plain, producer and split warp splits")
    gl.static_assert(NUM_STAGES >= 2, "a ring of two or more slots")

    # -- the query tile of this program (as in the bf16 kernel) --------------------------------
    b, h, q_begin, seq_q, m0 = _query_tile(cu_seqlens_q_ptr, num_heads, num_m_blocks, num_q_rows)
    if m0 >= seq_q:
        return
    k_begin, seq_k, shift, n_full, n_tiles = _key_range(
        cu_seqlens_k_ptr, b, num_k_rows, seq_q, m0, CAUSAL, BLOCK_N
    )
    # the dequant scales, read here (no host sync): scores in the exp2 domain, output by v_scale
    qk_scale, v_scale = _dequant_scales(q_scale_ptr, k_scale_ptr, v_scale_ptr, softmax_scale_log2e)
    if MODE == 2:
        fp8_split_attention(
            q_desc, k_desc, v_desc, out_ptr, lse_ptr, q_begin, m0, seq_q, seq_k, k_begin, h, shift, n_full,
            n_tiles, stride_qh, stride_kh, stride_vh, stride_ot, stride_oh, stride_lt, stride_lh, qk_scale,
            v_scale, D_QK, D_V, BLOCK_N, NUM_STAGES, WRITE_LSE,
        )  # fmt: skip
    else:
        _fp8_ring_attention(
            q_desc, k_desc, v_desc, out_ptr, lse_ptr, q_begin, m0, seq_q, seq_k, k_begin, h, shift, n_full,
            n_tiles, stride_qh, stride_kh, stride_vh, stride_ot, stride_oh, stride_lt, stride_lh, qk_scale,
            v_scale, D_QK, D_V, BLOCK_N, NUM_STAGES, WRITE_LSE, MODE,
        )  # fmt: skip


FP8_PREFILL_LAUNCH = LaunchCache(mla_fp8_prefill_kernel)
"""``mla_fp8_prefill_kernel[grid](...)`` through the cached launch
(:mod:`mla.providers.triton.launch_cache`)."""


__all__ = ["FP8_PREFILL_LAUNCH", "FP8_TILE_LAYOUT", "P_OFFSET", "mla_fp8_prefill_kernel"]
