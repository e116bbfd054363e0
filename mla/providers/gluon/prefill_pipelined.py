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
(:func:`.prefill._attend_tile`). FlashAttention-3's order, the masked tiles first and the last
of them opening the pipelined run, measured 3–6% slower on the split layout and no faster on the
persistent one (H100, 2026-12-06). Continuing the pipelined run through the masked tiles within
the request's keys (a masked softmax without per-key flags; a tile reaching past the keys still
alone after it) measured 1–4% slower on the split layout and 15–37% slower on the persistent
one, whose consumers then spilled (H100, 2026-12-06).

What ptxas makes of it (Triton 3.6, sm_90): it schedules the wait for ``P·V``, and the V slot's
release behind it, right after the row maximum, so the exponentials run once ``P·V`` is done and
what overlaps ``P·V`` is the wait for ``S`` and the maximum. Storing the row sums to shared
memory before that wait keeps every exponential ahead of it (ptxas does not move a wgmma wait
above a store); it measured no faster on an H100 (2026-12-06: within ±2% on the four benchmark
shapes of both layouts), so the loop leaves the order to ptxas.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from mla.providers.gluon.prefill_parts import (
    _hand_turn,
    _issue_scores,
    _release,
    _release_scores,
    _softmax_step,
    _take_turn,
)


@gluon.jit
def _tile_softmax(sc, m_i, l_i, t, g, row_last, qk_scale, k_empty, OUTSTANDING: gl.constexpr,
                  NUM_STAGES: gl.constexpr, BLOCK_N: gl.constexpr, q_release=None):  # fmt: skip
    """Unmasked tile ``t`` (the ring's ``g``-th) once its ``QKᵀ`` is done (``OUTSTANDING``: the
    ``wgmma`` groups issued after it, left running): its K slot released (and the query buffer,
    :func:`.prefill_parts._release_scores`) and its online-softmax step. Returns ``(p, alpha,
    m_i, l_i)``."""
    sc = warpgroup_mma_wait(num_outstanding=OUTSTANDING, deps=(sc,))
    _release_scores(k_empty, g, NUM_STAGES, q_release)
    p, alpha, m_i, _bad = _softmax_step(sc, m_i, m_i, row_last, t, qk_scale, False, BLOCK_N)
    return p, alpha, m_i, l_i * alpha + gl.sum(p, axis=1)


@gluon.jit
def _rescale(
    acc, p, alpha, g, v_ready, dtype: gl.constexpr, NUM_STAGES: gl.constexpr, O_LAYOUT: gl.constexpr
):
    """The output (every ``P·V`` before the ring's ``g``-th tile done) rescaled by that tile's
    ``alpha``, and its ``P`` as the ``P·V`` operand once its V has landed: ``(acc, p16)``."""
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_LAYOUT))[:, None]
    mbarrier.wait(v_ready.index(g % NUM_STAGES), (g // NUM_STAGES) & 1)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=2)
    return acc, gl.convert_layout(p.to(dtype), p_layout)


@gluon.jit
def _attend_pipelined(
    tiles, acc, m_i, l_i, n_full, g0, row_last, qk_scale, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
    S_LAYOUT: gl.constexpr, O_LAYOUT: gl.constexpr, W: gl.constexpr, M: gl.constexpr, turn=None,
    PINGPONG: gl.constexpr = False, q_release=None, q_reg=None,
):  # fmt: skip
    """The unmasked key tiles ``[0, n_full)`` (``n_full > 0``; the ring's tiles ``g0 + t``) into
    ``(acc, m_i, l_i)``, software-pipelined within the warpgroup (FlashAttention-3's
    intra-warpgroup overlap): tile ``t``'s ``QKᵀ`` and tile ``t - 1``'s ``P·V`` are in flight
    together, the softmax of tile ``t`` runs while ``P·V`` does, and the output is rescaled once
    ``P·V`` is done. ``PINGPONG``: the two issues are this warpgroup's turn
    (:func:`.prefill_parts._take_turn`), as in :func:`.prefill._attend_tile`. ``q_release``: as
    :func:`.prefill_parts._release_scores`."""
    q_smem, k_ring, v_ring, _flags, k_ready, v_ready, k_empty, v_empty = tiles
    sc = _issue_scores(q_smem, k_ring, k_ready, g0, W, M, NUM_STAGES, S_LAYOUT, None, q_reg)
    if PINGPONG:
        _hand_turn(turn)
    p, alpha, m_i, l_i = _tile_softmax(
        sc, m_i, l_i, 0, g0, row_last, qk_scale, k_empty, 0, NUM_STAGES, BLOCK_N, q_release
    )
    acc, p16 = _rescale(acc, p, alpha, g0, v_ready, q_smem.dtype, NUM_STAGES, O_LAYOUT)
    for t in range(1, n_full):
        g = g0 + t
        prev = (g - 1) % NUM_STAGES
        if PINGPONG:
            _take_turn(turn, g - 1)
        sc = _issue_scores(q_smem, k_ring, k_ready, g, W, M, NUM_STAGES, S_LAYOUT, None, q_reg)
        acc = warpgroup_mma(p16, v_ring.index(prev), acc, is_async=True)
        if PINGPONG:
            _hand_turn(turn)
        # QKᵀ of tile t (the older group) done; P·V of tile t - 1 may still run.
        p, alpha, m_i, l_i = _tile_softmax(
            sc, m_i, l_i, t, g, row_last, qk_scale, k_empty, 1, NUM_STAGES, BLOCK_N, q_release
        )
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        _release(v_empty.index(prev))
        acc, p16 = _rescale(acc, p, alpha, g, v_ready, q_smem.dtype, NUM_STAGES, O_LAYOUT)
    last = g0 + n_full - 1
    if PINGPONG:
        _take_turn(turn, last)
    acc = warpgroup_mma(p16, v_ring.index(last % NUM_STAGES), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    _release(v_empty.index(last % NUM_STAGES))
    return acc, m_i, l_i
