# mypy: disable-error-code="no-untyped-def, untyped-decorator"
"""Gluon (Hopper) fp8 varlen prefill, persistent: the split layout of :mod:`.prefill_fp8_split`
with one program per SM looping over the query tiles (``PrefillKernel.PERSISTENT``, the default launch).

The one-tile-a-program split layout pays its program's start (the barriers' set-up, the latency
of the query tile and of the first K/V tiles) and epilogue once a query tile, with nothing of
the SM's to overlap them: one program fills its shared memory. Here each program keeps its
shared memory, barriers and partitions across query tiles, dealt out in rounds as the bf16
persistent layout's (:mod:`.prefill_rounds`: each (request, head)'s tiles together, the heaviest
first; a snake over the rounds; each round's ``cu_seqlens`` entries loaded a round ahead):

* **Producer** (the launch's 4 warps): per query tile, its key tiles as the split layout's
  producer issues and transposes them (:func:`.prefill_fp8_split._produce_key_tiles`; the
  ring's slot and phase count on across query tiles, ``g``), and after the first of them, once
  both consumer warpgroups are done with the previous query tile (``q_empty``, two arrivals),
  the query tile itself. The next query tile's first key tile goes out while the consumers
  finish the previous one's last tiles and epilogue. Each query tile's last V tile is
  transposed before the next query tile starts: a transpose carried over to the next query
  tile with key tiles would leave the consumers waiting for it while the producer waits, at a
  query tile without key tiles, for their release of the query buffer.
* **Consumers** (two warpgroups of 64 query rows, each a partition of its own as in the split
  layout): per query tile, phase ``n & 1`` of ``q_bar`` (``n``: the program's query tiles so
  far), every key tile (:func:`.prefill_fp8_split._fp8_attend_tiles`, ring tiles ``g + t``),
  then the epilogue of their rows. Each arrives on ``q_empty`` once its last ``QKᵀ`` of the
  query tile is done, so the next query tile loads during the last tile's softmax, ``P·V`` and
  epilogue. Each reads the dequantization scales itself (a value computed before
  ``gl.warp_specialize`` reaches a partition through local memory).

Every rule of the split layout holds: causal masking on the diagonal and partial tiles only,
the NaN rules (non-finite V lanes of a tile reaching past the request's keys zeroed, the rows
that see them NaN), varlen clamping, LSE, P in e4m3 scaled by ``2**8``.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from mla.providers.gluon.prefill_epilogue import _store_rows
from mla.providers.gluon.prefill_fp8_parts import _dequant_scales, _fp8_mma_layout
from mla.providers.gluon.prefill_fp8_split import (
    CONSUMER_M,
    FP8_SPLIT_CONSUMER_REGS,
    _fp8_attend_tiles,
    _fp8_split_shared,
    _produce_key_tiles,
)
from mla.providers.gluon.prefill_parts import SPLIT_PRODUCER_WARPS, _consumer_rows
from mla.providers.gluon.prefill_rounds import _grid, _round_query_tile, _tile_bounds
from mla.providers.triton.launch_cache import LaunchCache


@gluon.jit
def _fp8_persistent_producer(
    q_desc, k_desc, v_desc, q_smem, k_ring, v_land, vt_ring, flags, q_bar, q_empty, k_ready, k_empty,
    v_landed, vt_ready, vt_empty, cu_seqlens_q_ptr, cu_seqlens_k_ptr, stride_qh, stride_kh, stride_vh,
    num_heads, num_m_blocks, num_tiles, num_q_rows, num_k_rows, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr,
    NUM_STAGES: gl.constexpr,
):  # fmt: skip
    """The producer partition (see the module docstring)."""
    # The partition reads its arguments before anything of it writes shared memory.
    gl.thread_barrier()
    g = 0
    done = 0
    bounds = _tile_bounds(0, num_tiles, cu_seqlens_q_ptr, cu_seqlens_k_ptr, num_heads, num_m_blocks)
    for r in range(gl.cdiv(num_tiles, _grid())):
        live, h, q_begin, _seq_q, m0, k_begin, seq_k, _shift, _n_full, n_tiles, bounds = _round_query_tile(
            r, bounds, num_tiles, cu_seqlens_q_ptr, cu_seqlens_k_ptr, num_heads, num_m_blocks, num_q_rows,
            num_k_rows, CAUSAL, BLOCK_N,
        )  # fmt: skip
        if live:
            _produce_key_tiles(
                k_desc, v_desc, k_ring, v_land, vt_ring, flags, k_ready, k_empty, v_landed, vt_ready,
                vt_empty, g, k_begin, h * stride_kh, h * stride_vh, seq_k, n_tiles, BLOCK_N, NUM_STAGES,
                (q_desc, q_begin, m0, h, stride_qh, q_bar, q_smem, q_empty, done),
            )  # fmt: skip
            g += n_tiles
            done += 1


@gluon.jit
def _fp8_persistent_consumer(
    args, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, D_V: gl.constexpr, NUM_STAGES: gl.constexpr,
    WRITE_LSE: gl.constexpr, W: gl.constexpr,
):  # fmt: skip
    """Consumer warpgroup ``W`` (query rows ``[64·W, 64·(W+1))`` of each query tile): every key
    tile of each of the program's query tiles, then the rows' epilogue (see the module
    docstring). ``args``: buffers, barriers, pointers, strides and sizes."""
    (
        q_smem, k_ring, vt_ring, flags, q_bar, q_empty, k_ready, k_empty, vt_ready, vt_empty, out_ptr,
        lse_ptr, cu_seqlens_q_ptr, cu_seqlens_k_ptr, scales, stride_ot, stride_oh, stride_lt, stride_lh,
        num_heads, num_m_blocks, num_tiles, num_q_rows, num_k_rows,
    ) = args  # fmt: skip
    M: gl.constexpr = CONSUMER_M
    s_layout: gl.constexpr = _fp8_mma_layout(4, BLOCK_N)
    o_layout: gl.constexpr = _fp8_mma_layout(4, D_V)
    # The partition reads its arguments before anything of it writes shared memory.
    gl.thread_barrier()
    q_scale_ptr, k_scale_ptr, v_scale_ptr, softmax_scale_log2e = scales
    qk_scale, v_scale = _dequant_scales(q_scale_ptr, k_scale_ptr, v_scale_ptr, softmax_scale_log2e)
    g = 0
    done = 0
    bounds = _tile_bounds(0, num_tiles, cu_seqlens_q_ptr, cu_seqlens_k_ptr, num_heads, num_m_blocks)
    for r in range(gl.cdiv(num_tiles, _grid())):
        live, h, q_begin, seq_q, m0, _k_begin, seq_k, shift, n_full, n_tiles, bounds = _round_query_tile(
            r, bounds, num_tiles, cu_seqlens_q_ptr, cu_seqlens_k_ptr, num_heads, num_m_blocks, num_q_rows,
            num_k_rows, CAUSAL, BLOCK_N,
        )  # fmt: skip
        if live:
            rows, row_last, acc, m_i, l_i = _consumer_rows(
                q_bar, shift, seq_k, W, M, D_V, s_layout, o_layout, done & 1
            )
            # the query buffer is released after the tile's last QKᵀ (ring tile g + n_tiles - 1)
            acc, m_i, l_i = _fp8_attend_tiles(
                q_smem, k_ring, vt_ring, flags, k_ready, k_empty, vt_ready, vt_empty, acc, m_i, l_i, g,
                n_full, n_tiles, seq_k, row_last, qk_scale, BLOCK_N, NUM_STAGES, s_layout,
                o_layout, W, (q_empty, g + n_tiles - 1),
            )  # fmt: skip
            # (a query tile without key tiles never read the buffer)
            mbarrier.arrive(q_empty, pred=n_tiles == 0)
            _store_rows(
                acc * v_scale, m_i, l_i, rows, out_ptr, lse_ptr, q_begin, m0, seq_q, h, stride_ot, stride_oh,
                stride_lt, stride_lh, W, M, D_V, WRITE_LSE, o_layout,
            )  # fmt: skip
            g += n_tiles
            done += 1


@gluon.jit
def mla_fp8_prefill_persistent_kernel(
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
    num_tiles,
    num_q_rows,
    num_k_rows,
    softmax_scale_log2e,
    D_QK: gl.constexpr,
    D_V: gl.constexpr,
    BLOCK_N: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    CAUSAL: gl.constexpr,
    WRITE_LSE: gl.constexpr,
    num_warps: gl.constexpr,
):
    gl.static_assert(num_warps == SPLIT_PRODUCER_WARPS, "launch warps: the producer's")
    gl.static_assert(NUM_STAGES >= 2, "a ring of two or more slots")
    q_smem, k_ring, v_land, vt_ring, flags, q_bar, k_ready, k_empty, vt_ready, vt_empty, v_landed = (
        _fp8_split_shared(q_desc.dtype, D_QK, D_V, BLOCK_N, NUM_STAGES)
    )
    q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(q_empty, count=2)
    # The query buffer starts free (phase 0 of q_empty).
    mbarrier.arrive(q_empty, count=2)
    fence_async_shared()
    scales = (q_scale_ptr, k_scale_ptr, v_scale_ptr, softmax_scale_log2e)
    consumer_args = (
        q_smem, k_ring, vt_ring, flags, q_bar, q_empty, k_ready, k_empty, vt_ready, vt_empty, out_ptr,
        lse_ptr, cu_seqlens_q_ptr, cu_seqlens_k_ptr, scales, stride_ot, stride_oh, stride_lt, stride_lh,
        num_heads, num_m_blocks, num_tiles, num_q_rows, num_k_rows,
    )  # fmt: skip
    gl.warp_specialize(
        [
            (
                _fp8_persistent_producer,
                (
                    q_desc, k_desc, v_desc, q_smem, k_ring, v_land, vt_ring, flags, q_bar, q_empty, k_ready,
                    k_empty, v_landed, vt_ready, vt_empty, cu_seqlens_q_ptr, cu_seqlens_k_ptr, stride_qh,
                    stride_kh, stride_vh, num_heads, num_m_blocks, num_tiles, num_q_rows, num_k_rows, CAUSAL,
                    BLOCK_N, NUM_STAGES,
                ),
            ),
            (_fp8_persistent_consumer, (consumer_args, CAUSAL, BLOCK_N, D_V, NUM_STAGES, WRITE_LSE, 0)),
            (_fp8_persistent_consumer, (consumer_args, CAUSAL, BLOCK_N, D_V, NUM_STAGES, WRITE_LSE, 1)),
        ],
        [4, 4],
        [FP8_SPLIT_CONSUMER_REGS, FP8_SPLIT_CONSUMER_REGS],
    )  # fmt: skip


FP8_PERSISTENT_LAUNCH = LaunchCache(mla_fp8_prefill_persistent_kernel)
"""``mla_fp8_prefill_persistent_kernel[grid](...)`` through the cached launch
(:mod:`mla.providers.triton.launch_cache`)."""


__all__ = ["FP8_PERSISTENT_LAUNCH", "mla_fp8_prefill_persistent_kernel"]
