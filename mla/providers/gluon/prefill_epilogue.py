# mypy: disable-error-code="no-untyped-def, untyped-decorator"
"""The Gluon prefill kernels' epilogue: a consumer warpgroup's output rows (normalised, in
16-byte stores where shared memory allows) and their LSE, merged into a prior state in the
chunked-context form."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

LN2 = gl.constexpr(0.6931471805599453)


@gluon.constexpr_function
def _store_layout(rows, cols):
    """The accumulator layout of a ``[rows, cols]`` wgmma (``rows // 16`` warps) with each quad's
    column blocks transposed: a thread holds 8 consecutive columns (one 16-byte store of 16-bit
    lanes) of the same two rows, and every element stays in its warp."""
    col_bits = (cols // 8).bit_length() - 1  # (8-column blocks: the accumulator's register bits)
    reg_bases = [[0, 1], [0, 2], [0, 4], [8, 0]] + [[0, 8 << (2 + i)] for i in range(col_bits - 2)]
    lane_bases = [[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]]
    warp_bases = [[16 << i, 0] for i in range((rows // 16).bit_length() - 1)]
    return gl.DistributedLinearLayout(reg_bases, lane_bases, warp_bases, [], [rows, cols])


@gluon.jit
def _store_rows(
    acc, m_i, l_i, rows, out_ptr, lse_ptr, q_begin, m0, seq_q, h, stride_ot, stride_oh, stride_lt,
    stride_lh, W: gl.constexpr, M: gl.constexpr, D_V: gl.constexpr, WRITE_LSE: gl.constexpr,
    O_LAYOUT: gl.constexpr, prior=None, HAS_PRIOR: gl.constexpr = False, VEC_STORE: gl.constexpr = False,
):  # fmt: skip
    """The epilogue of query rows ``m0 + W·M + [0, M)`` (``rows``: those rows relative to ``m0``,
    in the score row layout): the output ``acc / l`` (0 where no key was seen) and the natural
    log LSE (``-inf`` there), only for rows of the request. ``HAS_PRIOR``: merged by LSE into
    the state ``prior = (prior_out_ptr, prior_lse_ptr, stride_pot, stride_poh, stride_plt,
    stride_plh)`` of the same rows first (:func:`_merge_prior`; it may be ``out``/``lse`` itself:
    each element is read by the thread that then writes it)."""
    o_rows: gl.constexpr = gl.SliceLayout(1, O_LAYOUT)
    seen = l_i != 0.0  # (a NaN sum, from a key the row sees, stays NaN)
    inv_l = gl.where(seen, 1.0 / gl.where(seen, l_i, 1.0), 0.0)
    o = acc * gl.convert_layout(inv_l, o_rows)[:, None]
    rows_o = m0 + W * M + gl.arange(0, M, layout=o_rows)
    cols = gl.arange(0, D_V, layout=gl.SliceLayout(0, O_LAYOUT))
    tok = (q_begin + rows_o).to(gl.int64)
    lse = gl.where(seen, (m_i + gl.log2(gl.where(seen, l_i, 1.0))) * LN2, float("-inf"))
    rows_s = m0 + rows
    tok_s = (q_begin + rows_s).to(gl.int64)
    if HAS_PRIOR:
        o, lse = _merge_prior(o, lse, prior, tok, tok_s, rows_o < seq_q, rows_s < seq_q, h, cols, o_rows)
    if VEC_STORE:
        # from a layout of 8 consecutive lanes a thread (16-byte stores; the conversion takes
        # STORE_SCRATCH_BYTES of shared memory)
        st: gl.constexpr = _store_layout(M, D_V)
        o_st = gl.convert_layout(o.to(out_ptr.dtype.element_ty), st)
        rows_st = m0 + W * M + gl.arange(0, M, layout=gl.SliceLayout(1, st))
        cols_st = gl.arange(0, D_V, layout=gl.SliceLayout(0, st))
        tok_st = (q_begin + rows_st).to(gl.int64)
        o_ptrs = out_ptr + tok_st[:, None] * stride_ot + h.to(gl.int64) * stride_oh + cols_st[None, :]
        gl.store(o_ptrs, o_st, mask=(rows_st < seq_q)[:, None])
    else:
        o_ptrs = out_ptr + tok[:, None] * stride_ot + h.to(gl.int64) * stride_oh + cols[None, :]
        gl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=(rows_o < seq_q)[:, None])
    if WRITE_LSE:
        gl.store(lse_ptr + tok_s * stride_lt + h.to(gl.int64) * stride_lh, lse, mask=rows_s < seq_q)


@gluon.jit
def _merge_prior(o, lse, prior, tok, tok_s, ok_o, ok_s, h, cols, O_ROWS: gl.constexpr):
    """``(o*, lse*)``: this pass's normalised rows ``o`` (``[M, Dv]``) and natural-log ``lse`` merged
    with the prior state's rows: ``lse* = log(e^lse + e^lse_p)``, ``o* = e^(lse - lse*)·o +
    e^(lse_p - lse*)·o_p``. A state with ``lse = -inf`` weighs nothing whatever its rows hold (both
    ``-inf``: ``o* = 0``, ``lse* = -inf``); a NaN LSE stays NaN."""
    prior_out_ptr, prior_lse_ptr, stride_pot, stride_poh, stride_plt, stride_plh = prior
    hd = h.to(gl.int64)
    lse_p = gl.load(prior_lse_ptr + tok_s * stride_plt + hd * stride_plh, mask=ok_s, other=float("-inf"))
    top = gl.maximum(lse, lse_p)
    top = gl.where(top == float("-inf"), 0.0, top)  # (both -inf: weights 0, no inf - inf)
    w = gl.exp(lse - top)
    w_p = gl.exp(lse_p - top)
    total = w + w_p
    merged_lse = top + gl.log(total)  # (-inf for a total of 0; NaN stays NaN)
    some = total > 0.0
    inv = gl.where(some, 1.0 / gl.where(some, total, 1.0), 0.0)
    a = gl.convert_layout(w * inv, O_ROWS)
    b = gl.convert_layout(w_p * inv, O_ROWS)[:, None]
    p_ptrs = prior_out_ptr + tok[:, None] * stride_pot + hd * stride_poh + cols[None, :]
    o_p = gl.load(p_ptrs, mask=ok_o[:, None], other=0.0).to(gl.float32)
    # a prior row of weight 0 adds nothing, even where it holds NaN (a NaN weight stays NaN)
    return o * a[:, None] + gl.where(b == 0.0, 0.0, o_p * b), merged_lse
