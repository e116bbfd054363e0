# mypy: disable-error-code="no-untyped-def, untyped-decorator"
"""The unmasked key tiles of the Gluon bf16 prefill's consumers that a producer partition feeds
(``MODE`` 1 and 2 of :func:`~mla.providers.gluon.prefill.mla_prefill_kernel`, and
:mod:`.prefill_persistent`), software-pipelined within the consumer warpgroup
(FlashAttention-3's intra-warpgroup overlap).

Tile ``t``'s ``S = q·Kᵀ`` and tile ``t - 1``'s ``O += P·V`` are issued together (inside the
warpgroup's tensor-core turn when the two warpgroups take turns); the warpgroup waits for
``S`` only (``wgmma`` groups complete in order), runs the softmax of tile ``t`` while ``P·V``
runs, then waits for ``P·V`` and rescales the output. Every ``wgmma`` is waited for before the
loop's back edge, so ``P`` stays in registers (the pipelined ``OVERLAP`` consumer of
:mod:`.prefill_overlap` keeps its ``P·V`` in flight across the back edge and so stages ``P``
in shared memory). The masked tiles after them run one at a time
(:func:`.prefill._attend_tile`).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from mla.providers.gluon.prefill_parts import BLOCK_M, _hand_turn, _release, _softmax_step, _take_turn


@gluon.jit
def _issue_qk(q_smem, k_ring, k_ready, g, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
              S_LAYOUT: gl.constexpr, W: gl.constexpr, M: gl.constexpr):  # fmt: skip
    """Issue ``S = q·Kᵀ`` of the ring's ``g``-th key tile for the query rows ``[W·M, (W+1)·M)``
    once its K tile has landed (asynchronous)."""
    s = g % NUM_STAGES
    mbarrier.wait(k_ready.index(s), (g // NUM_STAGES) & 1)
    sc = gl.zeros([M, BLOCK_N], gl.float32, layout=S_LAYOUT)
    NQ: gl.constexpr = q_smem.shape[0]
    for c in gl.static_range(NQ):
        k_box = k_ring.index(s * NQ + c).permute((1, 0))
        q_box = q_smem.index(c) if M == BLOCK_M else q_smem.index(c).slice(W * M, M, dim=0)
        sc = warpgroup_mma(q_box, k_box, sc, use_acc=c > 0, is_async=True)
    return sc


@gluon.jit
def _attend_pipelined(
    tiles, acc, m_i, l_i, n_full, g0, row_last, qk_scale, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
    S_LAYOUT: gl.constexpr, O_LAYOUT: gl.constexpr, W: gl.constexpr, M: gl.constexpr, turn=None,
    PINGPONG: gl.constexpr = False,
):  # fmt: skip
    """The unmasked key tiles ``[0, n_full)`` (``n_full > 0``; the ring's tiles ``g0 + t``) into
    ``(acc, m_i, l_i)``, software-pipelined within the warpgroup (FlashAttention-3's
    intra-warpgroup overlap): tile ``t``'s ``QKᵀ`` and tile ``t - 1``'s ``P·V`` are in flight
    together, the softmax of tile ``t`` runs while ``P·V`` does, and the output is rescaled once
    ``P·V`` is done. ``PINGPONG``: the two issues are this warpgroup's turn
    (:func:`.prefill_parts._take_turn`), as in :func:`.prefill._attend_tile`."""
    q_smem, k_ring, v_ring, _flags, k_ready, v_ready, k_empty, v_empty = tiles
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=2)
    o_rows: gl.constexpr = gl.SliceLayout(1, O_LAYOUT)
    sc = _issue_qk(q_smem, k_ring, k_ready, g0, BLOCK_N, NUM_STAGES, S_LAYOUT, W, M)
    if PINGPONG:
        _hand_turn(turn)
    sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc,))
    _release(k_empty.index(g0 % NUM_STAGES))
    p, alpha, m_i, _bad = _softmax_step(sc, m_i, m_i, row_last, 0, qk_scale, False, BLOCK_N)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
    mbarrier.wait(v_ready.index(g0 % NUM_STAGES), (g0 // NUM_STAGES) & 1)
    p16 = gl.convert_layout(p.to(q_smem.dtype), p_layout)
    for t in range(1, n_full):
        g = g0 + t
        prev = (g - 1) % NUM_STAGES
        if PINGPONG:
            _take_turn(turn, g - 1)
        sc = _issue_qk(q_smem, k_ring, k_ready, g, BLOCK_N, NUM_STAGES, S_LAYOUT, W, M)
        acc = warpgroup_mma(p16, v_ring.index(prev), acc, is_async=True)
        if PINGPONG:
            _hand_turn(turn)
        # QKᵀ of tile t (the older group) done; P·V of tile t - 1 may still run.
        sc = warpgroup_mma_wait(num_outstanding=1, deps=(sc,))
        _release(k_empty.index(g % NUM_STAGES))
        p, alpha, m_i, _bad = _softmax_step(sc, m_i, m_i, row_last, t, qk_scale, False, BLOCK_N)
        l_i = l_i * alpha + gl.sum(p, axis=1)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        _release(v_empty.index(prev))
        acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
        mbarrier.wait(v_ready.index(g % NUM_STAGES), (g // NUM_STAGES) & 1)
        p16 = gl.convert_layout(p.to(q_smem.dtype), p_layout)
    last = g0 + n_full - 1
    if PINGPONG:
        _take_turn(turn, last)
    acc = warpgroup_mma(p16, v_ring.index(last % NUM_STAGES), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    _release(v_empty.index(last % NUM_STAGES))
    return acc, m_i, l_i
