# mypy: disable-error-code="no-untyped-def, untyped-decorator"
"""Epilogues of the Triton attention kernels (the varlen prefill, :mod:`.prefill`, and the fp8
prefill, :mod:`.fp8_prefill`): a finished online softmax (``acc``, ``l_i``, ``m_i`` in the exp2
domain) to its output rows and natural-log LSE, alone (:func:`finalize_rows`) or merged into a
prior state of the same rows (:func:`merge_prior_rows`), and the store (:func:`store_rows`).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def finalize_rows(acc, l_i, m_i, extra_scale):
    """``(out, lse)`` of a finished online softmax: ``out = acc * extra_scale / l`` (0 where no key
    was seen) and the natural-log LSE (``-inf`` there)."""
    seen = l_i != 0.0  # a NaN sum (a key the row sees is NaN) stays NaN
    inv_l = tl.where(seen, extra_scale / tl.where(seen, l_i, 1.0), 0.0)
    out = tl.where(seen[:, None], acc * inv_l[:, None], 0.0)
    lse = tl.where(seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    return out, lse


@triton.jit
def merge_prior_rows(acc, l_i, m_i, PriorOut, PriorLse, stride_pt, stride_plt, rows_ok, D_V: tl.constexpr,
                     BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr):  # fmt: skip
    """``(out, lse)`` of a finished online softmax merged by LSE into the prior state of its
    rows (``[BLOCK_M, BLOCK_DV]`` output rows at ``PriorOut``, their natural-log LSE at
    ``PriorLse``): the ``merge-states`` rule of :func:`finalize_rows`'s result and the prior one,
    without rounding this block's result first. A state with no key (LSE ``-inf``, or ``l_i``
    0) contributes nothing, whatever its rows hold; rows with neither get ``out = 0`` and
    ``lse = -inf``; a NaN on either side (a NaN key or value seen) stays NaN."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    prior_lse = tl.load(PriorLse + offs_m * stride_plt, mask=rows_ok, other=float("-inf"))
    prior_ptrs = PriorOut + offs_m[:, None] * stride_pt + offs_dv[None, :]
    if D_V < BLOCK_DV:
        prior = tl.load(prior_ptrs, mask=rows_ok[:, None] & (offs_dv < D_V)[None, :], other=0.0)
    else:
        prior = tl.load(prior_ptrs, mask=rows_ok[:, None], other=0.0)
    prior = prior.to(tl.float32)
    seen = l_i != 0.0  # (a NaN sum stays NaN)
    lse_new = tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)), float("-inf"))  # log2 domain
    lse_old = prior_lse * 1.4426950408889634
    top = tl.maximum(lse_old, lse_new, propagate_nan=tl.PropagateNan.ALL)
    empty = top == float("-inf")
    top = tl.where(empty, 0.0, top)
    w_old = tl.math.exp2(lse_old - top)  # 0 for a prior row with no state
    w_acc = tl.where(seen, tl.math.exp2(m_i - top), 0.0)  # acc's factor: weight of the new part / l_i
    total = w_old + l_i * w_acc
    inv = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, total))
    mixed = tl.where((w_old == 0.0)[:, None], 0.0, prior * w_old[:, None]) + acc * w_acc[:, None]
    out = tl.where(empty[:, None], 0.0, mixed * inv[:, None])
    lse = (top + tl.math.log2(tl.where(empty, 1.0, total))) * 0.6931471805599453
    lse = tl.where(empty, float("-inf"), lse)
    return out, lse


@triton.jit
def store_rows(Out, Lse, out, lse, stride_ot, stride_lt, rows_ok, D_V: tl.constexpr, BLOCK_DV: tl.constexpr,
               BLOCK_M: tl.constexpr):  # fmt: skip
    """Write a ``[BLOCK_M, BLOCK_DV]`` output block (row 0 at ``Out``) and its LSE (at ``Lse``)."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    o_ptrs = Out + offs_m[:, None] * stride_ot + offs_dv[None, :]
    if D_V < BLOCK_DV:
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=rows_ok[:, None] & (offs_dv < D_V)[None, :])
    else:
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=rows_ok[:, None])
    tl.store(Lse + offs_m * stride_lt, lse, mask=rows_ok)
