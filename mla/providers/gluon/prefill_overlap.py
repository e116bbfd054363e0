# mypy: disable-error-code="no-untyped-def, untyped-decorator"
"""The pipelined consumer warpgroup of the Gluon prefill (``PrefillKernel.OVERLAP``, ``MODE 3``
of :func:`~mla.providers.gluon.prefill.mla_prefill_kernel`).

The split kernel's layout (a 4-warp producer, each consumer warpgroup a partition of its own
with 64 query rows), with the softmax of a key tile overlapping the tensor cores' work: at
step ``t`` the warpgroup holds ``S_t`` (done) while ``P_{t-1}·V_{t-1}`` may still run, and

1. runs the online softmax of ``S_t`` (``P·V`` of the tile before in flight);
2. waits for that ``P·V`` and releases its V slot, then rescales the output;
3. issues ``S_{t+1} = q·K_{t+1}ᵀ``, then ``O += P_t·V_t`` (both asynchronous; ``P_t`` from a
   shared buffer of the warpgroup's own, written once the ``P·V`` before is done: a ``P`` in
   registers read by a ``wgmma`` still running across the loop's back edge makes ptxas
   serialise every ``wgmma``);
4. waits for ``S_{t+1}`` only (``wgmma`` groups complete in order) and releases its K slot.

The tiles every row sees run with the unmasked softmax; the rest, and always the last tile,
with the masked one (a tile every row sees gives the same result masked). The producer cleans
the V of every masked tile (non-finite lanes zeroed, per-key flags), as in the split kernel.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)

from mla.providers.gluon.prefill_epilogue import _store_rows
from mla.providers.gluon.prefill_parts import (
    _consumer_rows,
    _issue_scores,
    _mma_layout,
    _release,
    _softmax_step,
)

WARPS = gl.constexpr(4)
"""Warps of a consumer partition (one warpgroup)."""
M = gl.constexpr(64)
"""Query rows of a consumer warpgroup."""


@gluon.jit
def _step(
    q_smem, k_ring, v_ring, flags, p_buf, k_ready, v_ready, k_empty, v_empty, acc, m_i, l_i, sc, t,
    row_last, qk_scale,
    MASKED: gl.constexpr, ISSUE_NEXT: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
    S_LAYOUT: gl.constexpr, O_LAYOUT: gl.constexpr, W: gl.constexpr,
):  # fmt: skip
    """Step ``t`` (see the module docstring): ``sc`` is ``S_t`` (done), ``acc`` the output with
    ``P_{t-1}·V_{t-1}`` possibly in flight. Returns the output with ``P_t·V_t`` in flight, the
    running max and sum, and ``S_{t+1}`` (done; ``sc`` itself without ``ISSUE_NEXT``)."""
    s = t % NUM_STAGES
    phase = (t // NUM_STAGES) & 1
    o_rows: gl.constexpr = gl.SliceLayout(1, O_LAYOUT)
    keys_layout: gl.constexpr = gl.SliceLayout(0, S_LAYOUT)
    if MASKED:
        # the cleaned V tile and which of its keys had a non-finite lane
        mbarrier.wait(v_ready.index(s), phase)
        key_bad = flags.index(s).load(keys_layout)
    else:
        key_bad = m_i  # (unread)
    p, alpha, m_new, row_bad = _softmax_step(sc, m_i, key_bad, row_last, t, qk_scale, MASKED, BLOCK_N)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    p16 = p.to(q_smem.dtype)
    # P·V of tile t - 1 done: its V slot and the P buffer are free (none before tile 0)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    p_buf.store(p16)
    fence_async_shared()
    gl.thread_barrier()
    mbarrier.arrive(v_empty.index((t + NUM_STAGES - 1) % NUM_STAGES), pred=t > 0)
    acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
    if MASKED:
        acc = acc + gl.convert_layout(gl.where(row_bad > 0.0, float("nan"), 0.0), o_rows)[:, None]
    if ISSUE_NEXT:
        sc = _issue_scores(q_smem, k_ring, k_ready, t + 1, W, M, NUM_STAGES, S_LAYOUT, sc)
    if not MASKED:
        mbarrier.wait(v_ready.index(s), phase)
    acc = warpgroup_mma(p_buf, v_ring.index(s), acc, is_async=True)
    if ISSUE_NEXT:
        sc = warpgroup_mma_wait(num_outstanding=1, deps=(sc,))
        _release(k_empty.index((t + 1) % NUM_STAGES))
    return acc, m_new, l_i, sc


@gluon.jit
def overlap_consumer(
    args, p_smem, BLOCK_N: gl.constexpr, D_V: gl.constexpr, NUM_STAGES: gl.constexpr,
    WRITE_LSE: gl.constexpr, W: gl.constexpr,
):  # fmt: skip
    """Consumer warpgroup ``W`` (query rows ``[64·W, 64·(W+1))`` of the tile): every key tile,
    pipelined as in the module docstring, then its output rows (and their LSE). ``args``: the
    kernel's buffers, barriers, query tile and strides (the tuple of the other consumers)."""
    (
        q_smem, k_ring, v_ring, flags, q_bar, k_ready, v_ready, k_empty, v_empty, _k_desc, _v_desc, out_ptr,
        lse_ptr, q_begin, m0, seq_q, seq_k, _k_row0, _k_col, _v_col, h, shift, n_full, n_tiles,
        stride_ot, stride_oh, stride_lt, stride_lh, qk_scale,
    ) = args  # fmt: skip
    s_layout: gl.constexpr = _mma_layout(WARPS, BLOCK_N)
    o_layout: gl.constexpr = _mma_layout(WARPS, D_V)
    p_buf = p_smem.index(W)
    # The partition reads its arguments before anything of it writes shared memory.
    gl.thread_barrier()
    rows, row_last, acc, m_i, l_i = _consumer_rows(q_bar, shift, seq_k, W, M, D_V, s_layout, o_layout)
    if n_tiles > 0:
        s_zero = gl.zeros([M, BLOCK_N], gl.float32, layout=s_layout)
        sc = _issue_scores(q_smem, k_ring, k_ready, 0, W, M, NUM_STAGES, s_layout, s_zero)
        sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc,))
        _release(k_empty.index(0))
        # (the output is carried through the loops with its P·V in flight)
        acc = warpgroup_mma_init(acc)
        # every tile but the last with the next tile's QKᵀ issued ahead: the unmasked ones, then
        # the masked ones; the last tile always masked
        for t in range(gl.minimum(n_full, n_tiles - 1)):
            acc, m_i, l_i, sc = _step(
                q_smem, k_ring, v_ring, flags, p_buf, k_ready, v_ready, k_empty, v_empty, acc, m_i, l_i, sc,
                t, row_last, qk_scale, False, True, BLOCK_N, NUM_STAGES, s_layout, o_layout, W,
            )  # fmt: skip
        for t in range(n_full, n_tiles - 1):
            acc, m_i, l_i, sc = _step(
                q_smem, k_ring, v_ring, flags, p_buf, k_ready, v_ready, k_empty, v_empty, acc, m_i, l_i, sc,
                t, row_last, qk_scale, True, True, BLOCK_N, NUM_STAGES, s_layout, o_layout, W,
            )  # fmt: skip
        last = n_tiles - 1
        acc, m_i, l_i, sc = _step(
            q_smem, k_ring, v_ring, flags, p_buf, k_ready, v_ready, k_empty, v_empty, acc, m_i, l_i, sc,
            last, row_last, qk_scale, True, False, BLOCK_N, NUM_STAGES, s_layout, o_layout, W,
        )  # fmt: skip
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        _release(v_empty.index(last % NUM_STAGES))
    _store_rows(
        acc, m_i, l_i, rows, out_ptr, lse_ptr, q_begin, m0, seq_q, h, stride_ot, stride_oh, stride_lt,
        stride_lh, W, M, D_V, WRITE_LSE, o_layout,
    )  # fmt: skip


__all__ = ["overlap_consumer"]
