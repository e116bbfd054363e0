# mypy: disable-error-code="no-untyped-def, untyped-decorator"
"""Top-k of float32 score rows by threshold selection (the indexer's selection, in Triton).

:func:`radix_topk` writes, per row ``t`` of ``scores [T, N]``, the positions of the ``k``
largest scores among its first ``lengths[t]`` columns, **in ascending position order** (not
by score: the sparse attention that consumes them is order-invariant), then ``-1`` up to the
output's width. ``-inf`` scores are never selected (a row with fewer than ``k`` others keeps
what it has); ``NaN`` scores are never selected either (``torch.topk`` would rank them first).
Ties at the threshold are broken by position (the lowest positions win), so the output is a
deterministic function of the scores.

Passes (each a Triton launch, nothing read on the host, graph-capturable):

1. **Range** (only when the caller has none): per (row, split of positions) the least and
   greatest finite score. The indexer's scores kernel writes the same per (row, chunk) as a
   by-product, so the indexer skips this launch.
2. **Histogram** (grid ``rows x splits``): each program bins its split's scores into
   :data:`NUM_BINS` bins linear in value over the row's ``[min, max]`` (a monotone map: a
   higher bin holds only higher scores) and writes its histogram (``tl.histogram``).
3. **Collect** (grid ``rows x splits``): every program sums the row's split histograms, finds
   the threshold bin ``b`` (the bins above it hold fewer than ``k`` scores, with it at least
   ``k``) and its own offsets (the counts of the splits before it), then writes the positions
   of its split's scores above ``b`` into the output, compacted in position order (one
   ``tl.cumsum`` per tile). The scores in ``b`` go to the output too when all of them are
   needed, otherwise their positions go to a candidate buffer of :attr:`TopkConfig.cand_cap`
   per row.
4. **Finish** (grid ``rows``): where only part of ``b`` is needed, an exact radix select over
   the candidates (or, when ``b`` held more than ``cand_cap``, over the row's scores in ``b``):
   the candidates' order-preserving 32-bit keys, from the bits below their common prefix, a few
   bits a pass (a histogram of the candidates still in play), stopping early once the bin of
   the threshold is taken whole; then the chosen candidates in order, and the ``-1`` padding.
   Up to :attr:`TopkConfig.finish_tile` candidates are loaded once and selected in registers
   (:attr:`TopkConfig.finish_bits` bits a pass); more are selected eight bits a pass, each pass
   reading them again.

The range and histogram passes read only each row's first ``lengths[t]`` columns, so a causal
prefill's invisible half costs nothing here.
"""

from __future__ import annotations

import attrs
import torch
import triton
import triton.language as tl

from mla.core.errors import InvalidInputError
from mla.providers.triton.host_math import next_power_of_2, round_up
from mla.providers.triton.launch_cache import LaunchCache
from mla.providers.triton.pdl import pdl_options, wait_for_previous

NUM_BINS = 64
"""Default linear bins of the histogram pass (:attr:`TopkConfig.bins`). ``tl.histogram`` costs
instructions in proportion to its bins; 64 bins measured faster than 128 and 256 on prefill and
decode rows, and still leave threshold bins of a few hundred scores for the finish pass
(``docs/performance.md``, "Kernel choices")."""
DIGIT_BINS = 256
"""Bins of the finish pass's radix histograms (eight bits of the candidates' keys a pass)."""
FINISH_RADIX_BITS = 4
"""Key bits a pass of the in-register finish select (16-bin histograms: cheap per pass, and
the passes read no memory)."""


@attrs.frozen
class TopkConfig:
    """Tunables of :func:`radix_topk` (see :func:`topk_config` for the defaults)."""

    split: int
    """Positions per program of the range, histogram and collect passes (a multiple of
    ``block``)."""
    block: int = 1024
    """Scores per tile."""
    num_warps: int = 4
    """Warps of the range, histogram and collect programs."""
    finish_warps: int = 4
    """Warps of the finish program (one per row)."""
    cand_cap: int = 4096
    """Candidate positions kept per row for the finish pass; a threshold bin holding more is
    refined over the row itself (correct, slower)."""
    finish_tile: int = 1024
    """Candidates the finish program holds in registers (a power of two): a threshold bin of at
    most this many is loaded once and selected there; a larger one is selected in passes over
    memory."""
    bins: int = NUM_BINS
    """Linear bins of the histogram pass (a power of two from 2 to :data:`DIGIT_BINS`): fewer
    bins cost fewer instructions per score (``tl.histogram`` grows with the bin count) and leave
    a larger threshold bin for the finish pass."""
    finish_bits: int = FINISH_RADIX_BITS
    """Key bits a pass of the in-register finish select (1 to 8): more bits, fewer passes, each
    with a histogram of ``2**finish_bits`` bins."""


DECODE_FINISH_BITS = 6
"""Key bits a finish pass of the split (few-rows) launch: 6 measured a little faster than 4 and 8
on the H200 at 64 rows x 32768, top-k 2048 (``docs/performance.md``, "Kernel choices")."""
MIN_SPLIT = 2048
"""Fewest positions a program of the histogram and collect passes is given when rows are split."""
PROGRAMS_PER_SM = 4


def topk_config(*, rows: int, max_keys: int, num_sms: int) -> TopkConfig:
    """Whole rows per program when rows alone give :data:`PROGRAMS_PER_SM` programs per SM;
    otherwise each row cut into splits of at least :data:`MIN_SPLIT` positions (64 decode rows
    over 32768 positions: 8 splits of 4096), with 8 warps on each row's finish program (one
    program a row: wider programs shorten the few rows' tail) selecting
    :data:`DECODE_FINISH_BITS` bits a pass."""
    block = 1024
    whole = round_up(max(1, max_keys), block)
    target = PROGRAMS_PER_SM * num_sms
    if rows >= target:
        return TopkConfig(split=whole, block=block)
    splits = max(1, min(target // max(1, rows), -(-whole // MIN_SPLIT)))
    split = round_up(-(-whole // splits), block)
    return TopkConfig(split=split, block=block, finish_warps=8, finish_bits=DECODE_FINISH_BITS)


@triton.jit
def _order_key(x):
    """int64 in ``[0, 2**32)``: the float32's bits mapped so that integer order is float order."""
    bits = x.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    return tl.where(bits >= 0x80000000, bits ^ 0xFFFFFFFF, bits | 0x80000000)


@triton.jit
def _row_range(
    stats_ptr, t, parts, stride_st_k, stride_st_t, PART_BLOCK: tl.constexpr, NUM_BINS: tl.constexpr
):
    """``(lo, hi, scale)`` of row ``t``'s bins from its ``parts`` (min, max) pairs: a row without
    a finite score gets ``lo = hi = 0`` (one bin); ``scale`` maps ``x / 2 - lo / 2`` to bins."""
    j = tl.arange(0, PART_BLOCK)
    m = j < parts
    lo = tl.min(tl.load(stats_ptr + t * stride_st_t + j, mask=m, other=float("inf")), 0)
    hi = tl.max(tl.load(stats_ptr + stride_st_k + t * stride_st_t + j, mask=m, other=float("-inf")), 0)
    empty = lo > hi
    lo = tl.where(empty, 0.0, lo)
    hi = tl.where(empty, 0.0, hi)
    # Halves keep ``hi - lo`` finite; a span below 1e-36 gets the scale of 1e-36 (finite for up
    # to 256 bins; its bins stay monotone). float32 throughout (a literal below FLT_MIN made
    # Triton compute every bin in float64) and an approximate division: every pass computes the
    # same scale, which is all the bins need.
    span = hi * 0.5 - lo * 0.5
    bins = tl.full([], NUM_BINS, tl.float32)
    scale = tl.where(span > 0, tl.fdiv(bins, tl.maximum(span, 1.0e-36)), 0.0)
    return lo, hi, scale


@triton.jit
def _bin_of(x, lo, hi, scale, NUM_BINS: tl.constexpr):
    """The linear bin of ``x`` (``x >= lo`` or masked by the caller; ``+inf`` joins the top
    bin): monotone non-decreasing in ``x``, computed the same way by every pass."""
    t = (tl.minimum(x, hi) * 0.5 - lo * 0.5) * scale
    t = tl.minimum(tl.maximum(t, 0.0), NUM_BINS - 1.0)
    return t.to(tl.int32)


@triton.jit
def _threshold(hist_ptr, t, s, splits, k, stride_h_t, SPLIT_BLOCK: tl.constexpr, NUM_BINS: tl.constexpr):
    """From row ``t``'s split histograms: ``(thr, above, eq_total, need, above_before,
    eq_before)``: the threshold bin (``-1`` when the row has at most ``k`` selectable scores:
    all are taken), the count above it, in it, how many of it to take, and the counts above and
    in it of the splits before ``s``."""
    sj = tl.arange(0, SPLIT_BLOCK)
    bins = tl.arange(0, NUM_BINS)
    h = tl.load(
        hist_ptr + t * stride_h_t + sj[:, None] * NUM_BINS + bins[None, :],
        mask=(sj < splits)[:, None],
        other=0,
    )
    tot = tl.sum(h, 0)
    total = tl.sum(tot, 0)
    suffix = tl.cumsum(tot, 0, reverse=True)
    thr = tl.max(tl.where(suffix >= k, bins, -1), 0)
    thr = tl.where(total <= k, -1, thr)
    above = tl.sum(tl.where(bins > thr, tot, 0), 0)
    eq_total = tl.sum(tl.where(bins == thr, tot, 0), 0)
    need = tl.minimum(total, k) - above
    above_s = tl.sum(tl.where((bins > thr)[None, :], h, 0), 1)
    eq_s = tl.sum(tl.where((bins == thr)[None, :], h, 0), 1)
    above_before = tl.sum(tl.where(sj < s, above_s, 0), 0)
    eq_before = tl.sum(tl.where(sj < s, eq_s, 0), 0)
    return thr, above, eq_total, need, above_before, eq_before


@triton.jit
def _topk_range_kernel(
    scores_ptr,
    lengths_ptr,
    stats_ptr,
    max_keys,
    split,
    splits,
    stride_s_t,
    stride_st_k,
    stride_st_t,
    HAS_LENGTHS: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (row, split): least and greatest finite score of the split's visible columns."""
    wait_for_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    n = max_keys
    if HAS_LENGTHS:
        n = tl.minimum(tl.maximum(tl.load(lengths_ptr + t), 0), max_keys)
    p_lo = s * split
    p_hi = tl.minimum(p_lo + split, n)
    lo = tl.full([BLOCK], float("inf"), tl.float32)
    hi = tl.full([BLOCK], float("-inf"), tl.float32)
    row = scores_ptr + t * stride_s_t
    for p0 in range(p_lo, p_hi, BLOCK):
        p = p0 + tl.arange(0, BLOCK)
        x = tl.load(row + p, mask=p < p_hi, other=float("inf"))
        finite = tl.abs(x) < float("inf")
        lo = tl.minimum(lo, tl.where(finite, x, float("inf")))
        hi = tl.maximum(hi, tl.where(finite, x, float("-inf")))
    tl.store(stats_ptr + t * stride_st_t + s, tl.min(lo, 0))
    tl.store(stats_ptr + stride_st_k + t * stride_st_t + s, tl.max(hi, 0))


@triton.jit
def _topk_histogram_kernel(
    scores_ptr,
    lengths_ptr,
    stats_ptr,
    hist_ptr,
    max_keys,
    split,
    parts,
    stride_s_t,
    stride_st_k,
    stride_st_t,
    stride_h_t,
    HAS_LENGTHS: tl.constexpr,
    PART_BLOCK: tl.constexpr,
    NUM_BINS: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (row, split): the histogram of the split's selectable scores over the row's bins."""
    wait_for_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    n = max_keys
    if HAS_LENGTHS:
        n = tl.minimum(tl.maximum(tl.load(lengths_ptr + t), 0), max_keys)
    lo, hi, scale = _row_range(stats_ptr, t, parts, stride_st_k, stride_st_t, PART_BLOCK, NUM_BINS)
    p_lo = s * split
    p_hi = tl.minimum(p_lo + split, n)
    row = scores_ptr + t * stride_s_t
    h = tl.zeros([NUM_BINS], tl.int32)
    for p0 in range(p_lo, p_hi, BLOCK):
        p = p0 + tl.arange(0, BLOCK)
        x = tl.load(row + p, mask=p < p_hi, other=float("-inf"))
        ok = x > float("-inf")
        h += tl.histogram(_bin_of(tl.where(ok, x, lo), lo, hi, scale, NUM_BINS), NUM_BINS, mask=ok)
    tl.store(hist_ptr + t * stride_h_t + s * NUM_BINS + tl.arange(0, NUM_BINS), h)


@triton.jit
def _topk_collect_kernel(
    scores_ptr,
    lengths_ptr,
    stats_ptr,
    hist_ptr,
    out_ptr,
    cand_ptr,
    k,
    max_keys,
    split,
    splits,
    parts,
    cand_cap,
    stride_s_t,
    stride_st_k,
    stride_st_t,
    stride_h_t,
    stride_o_t,
    stride_c_t,
    HAS_LENGTHS: tl.constexpr,
    PART_BLOCK: tl.constexpr,
    SPLIT_BLOCK: tl.constexpr,
    NUM_BINS: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (row, split): the split's positions above the threshold bin into the output, and
    those in it into the output (all needed) or the candidate buffer (fewer needed)."""
    wait_for_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    n = max_keys
    if HAS_LENGTHS:
        n = tl.minimum(tl.maximum(tl.load(lengths_ptr + t), 0), max_keys)
    lo, hi, scale = _row_range(stats_ptr, t, parts, stride_st_k, stride_st_t, PART_BLOCK, NUM_BINS)
    thr, above, eq_total, need, above_before, eq_before = _threshold(
        hist_ptr, t, s, splits, k, stride_h_t, SPLIT_BLOCK, NUM_BINS
    )
    take_eq = need == eq_total
    to_cand = (need < eq_total) & (eq_total <= cand_cap)
    p_lo = s * split
    p_hi = tl.minimum(p_lo + split, n)
    row = scores_ptr + t * stride_s_t
    out_row = out_ptr + t * stride_o_t
    sel_at = above_before - 1
    eq_at = eq_before - 1
    for p0 in range(p_lo, p_hi, BLOCK):
        p = p0 + tl.arange(0, BLOCK)
        x = tl.load(row + p, mask=p < p_hi, other=float("-inf"))
        ok = x > float("-inf")
        d = _bin_of(tl.where(ok, x, lo), lo, hi, scale, NUM_BINS)
        sel = ok & (d > thr)
        eq = ok & (d == thr)
        # One scan for both: the selected count in the low half, the threshold bin's in the high.
        ranks = tl.cumsum(sel.to(tl.int32) + (eq.to(tl.int32) << 16), 0)
        sel_rank = sel_at + (ranks & 0xFFFF)
        eq_rank = eq_at + (ranks >> 16)
        tl.store(out_row + sel_rank, p, mask=sel)
        tl.store(out_row + above + eq_rank, p, mask=eq & take_eq)
        tl.store(cand_ptr + t * stride_c_t + eq_rank, p, mask=eq & to_cand)
        last = tl.max(ranks, 0)
        sel_at += last & 0xFFFF
        eq_at += last >> 16


@triton.jit
def _source_tile(
    row, cand_row, i0, n_src, from_cand, lo, hi, scale, thr, NUM_BINS: tl.constexpr, BLOCK: tl.constexpr
):
    """Tile ``i0`` of the finish pass's source: the candidate buffer, or the row's scores in the
    threshold bin: ``(position, key, valid)``."""
    j = i0 + tl.arange(0, BLOCK)
    in_src = j < n_src
    pos = tl.where(from_cand, tl.load(cand_row + j, mask=in_src & from_cand, other=0), j)
    x = tl.load(row + pos, mask=in_src, other=float("-inf"))
    ok = in_src & (x > float("-inf"))
    valid = ok & (from_cand | (_bin_of(tl.where(ok, x, lo), lo, hi, scale, NUM_BINS) == thr))
    return pos, _order_key(x), valid


@triton.jit
def _common_prefix(kmin, kmax):
    """``(shift, prefix)``: the keys between ``kmin`` and ``kmax`` share their bits from ``shift``
    up, ``prefix`` (``kmax >> shift``); the bits below ``shift`` decide between them."""
    shift = tl.full([], 0, tl.int32)
    diff = kmin ^ kmax
    while (diff >> shift) > 0:
        shift += 1
    return shift, kmax >> shift


@triton.jit
def _radix_step(h, bins, need_rem, prefix, nbits):
    """One radix pass's choice from the histogram ``h`` of the next ``nbits`` bits of the keys in
    play: the digit ``b`` whose bin holds the ``need_rem``-th best key; returns ``(need_rem``
    less the keys above ``b``, the count in ``b``, ``prefix`` extended by ``b)``."""
    suffix = tl.cumsum(h, 0, reverse=True)
    b = tl.max(tl.where(suffix >= need_rem, bins, -1), 0)
    need_rem -= tl.sum(tl.where(bins > b, h, 0), 0)
    in_bin = tl.sum(tl.where(bins == b, h, 0), 0)
    return need_rem, in_bin, (prefix << nbits) | b.to(tl.int64)


@triton.jit
def _select_in_tile(pos, key, valid, need, out_row, above, RADIX_BITS: tl.constexpr):
    """The finish pass on one tile of candidates held in registers (``pos``, ``key``: order
    keys, ``valid``): an exact radix select of the ``need`` best, ``RADIX_BITS`` bits a pass over
    the bits below the candidates' common prefix (no memory traffic between passes), then the
    chosen positions after the ``above`` already written, in position order (ties at the
    threshold key: the lowest positions)."""
    shift, prefix = _common_prefix(
        tl.min(tl.where(valid, key, 0xFFFFFFFF), 0), tl.max(tl.where(valid, key, 0), 0)
    )
    need_rem = need
    go = (shift > 0).to(tl.int32)
    bins = tl.arange(0, 1 << RADIX_BITS)
    while go != 0:
        nbits = tl.minimum(shift, RADIX_BITS)
        low = shift - nbits
        in_play = valid & ((key >> shift) == prefix)
        digit = ((key >> low) & ((1 << nbits) - 1)).to(tl.int32)
        h = tl.histogram(digit, 1 << RADIX_BITS, mask=in_play)
        need_rem, in_bin, prefix = _radix_step(h, bins, need_rem, prefix, nbits)
        shift = low
        go = ((shift > 0) & (in_bin != need_rem)).to(tl.int32)
    top = key >> shift
    gt = valid & (top > prefix)
    eq = valid & (top == prefix)
    eq_rank = tl.cumsum(eq.to(tl.int32), 0) - 1
    take = gt | (eq & (eq_rank < need_rem))
    at = above + tl.cumsum(take.to(tl.int32), 0) - 1
    tl.store(out_row + at, pos, mask=take)


@triton.jit
def _topk_finish_kernel(
    scores_ptr,
    lengths_ptr,
    stats_ptr,
    hist_ptr,
    out_ptr,
    cand_ptr,
    k,
    width,
    max_keys,
    splits,
    parts,
    cand_cap,
    stride_s_t,
    stride_st_k,
    stride_st_t,
    stride_h_t,
    stride_o_t,
    stride_c_t,
    HAS_LENGTHS: tl.constexpr,
    PART_BLOCK: tl.constexpr,
    SPLIT_BLOCK: tl.constexpr,
    NUM_BINS: tl.constexpr,
    DIGIT_BINS: tl.constexpr,
    BLOCK: tl.constexpr,
    TILE: tl.constexpr,
    RADIX_BITS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (row): the part of the threshold bin that is needed (exact radix select), then
    ``-1`` from the row's count to ``width``."""
    wait_for_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    n = max_keys
    if HAS_LENGTHS:
        n = tl.minimum(tl.maximum(tl.load(lengths_ptr + t), 0), max_keys)
    thr, above, eq_total, need, _before, _eq_before = _threshold(
        hist_ptr, t, 0, splits, k, stride_h_t, SPLIT_BLOCK, NUM_BINS
    )
    out_row = out_ptr + t * stride_o_t
    if (need > 0) & (need < eq_total) & (eq_total <= tl.minimum(cand_cap, TILE)):
        # The usual case: few candidates, loaded once and selected in registers.
        j = tl.arange(0, TILE)
        in_src = j < eq_total
        pos = tl.load(cand_ptr + t * stride_c_t + j, mask=in_src, other=0)
        x = tl.load(scores_ptr + t * stride_s_t + pos, mask=in_src, other=float("-inf"))
        _select_in_tile(pos, _order_key(x), in_src & (x > float("-inf")), need, out_row, above, RADIX_BITS)
    elif (need > 0) & (need < eq_total):
        lo, hi, scale = _row_range(stats_ptr, t, parts, stride_st_k, stride_st_t, PART_BLOCK, NUM_BINS)
        row = scores_ptr + t * stride_s_t
        cand_row = cand_ptr + t * stride_c_t
        from_cand = eq_total <= cand_cap
        n_src = tl.where(from_cand, eq_total, n)
        # The candidates' key range: the bits below its common prefix decide.
        kmin = tl.full([], 0xFFFFFFFF, tl.int64)
        kmax = tl.full([], 0, tl.int64)
        for i0 in range(0, n_src, BLOCK):
            _pos, key, valid = _source_tile(
                row, cand_row, i0, n_src, from_cand, lo, hi, scale, thr, NUM_BINS, BLOCK
            )
            kmin = tl.minimum(kmin, tl.min(tl.where(valid, key, 0xFFFFFFFF), 0))
            kmax = tl.maximum(kmax, tl.max(tl.where(valid, key, 0), 0))
        shift, prefix = _common_prefix(kmin, kmax)
        need_rem = need
        go = (shift > 0).to(tl.int32)
        bins = tl.arange(0, DIGIT_BINS)
        while go != 0:
            nbits = tl.minimum(shift, 8)
            low = shift - nbits
            h = tl.zeros([DIGIT_BINS], tl.int32)
            for i0 in range(0, n_src, BLOCK):
                _pos, key, valid = _source_tile(
                    row, cand_row, i0, n_src, from_cand, lo, hi, scale, thr, NUM_BINS, BLOCK
                )
                in_play = valid & ((key >> shift) == prefix)
                digit = ((key >> low) & ((1 << nbits) - 1)).to(tl.int32)
                h += tl.histogram(digit, DIGIT_BINS, mask=in_play)
            need_rem, in_bin, prefix = _radix_step(h, bins, need_rem, prefix, nbits)
            shift = low
            go = ((shift > 0) & (in_bin != need_rem)).to(tl.int32)
        # Everything above the threshold key, then its first ``need_rem`` ties in order.
        eq_seen = tl.full([], 0, tl.int32)
        taken = tl.full([], 0, tl.int32)
        for i0 in range(0, n_src, BLOCK):
            pos, key, valid = _source_tile(
                row, cand_row, i0, n_src, from_cand, lo, hi, scale, thr, NUM_BINS, BLOCK
            )
            top = key >> shift
            gt = valid & (top > prefix)
            eq = valid & (top == prefix)
            eq_rank = eq_seen + tl.cumsum(eq.to(tl.int32), 0) - 1
            take = gt | (eq & (eq_rank < need_rem))
            at = above + taken + tl.cumsum(take.to(tl.int32), 0) - 1
            tl.store(out_row + at, pos, mask=take)
            eq_seen += tl.sum(eq.to(tl.int32), 0)
            taken += tl.sum(take.to(tl.int32), 0)
    count = above + need
    for c0 in range(count, width, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        tl.store(out_row + c, tl.full([BLOCK], -1, tl.int32), mask=c < width)


TOPK_RANGE_LAUNCH = LaunchCache(_topk_range_kernel)
TOPK_HISTOGRAM_LAUNCH = LaunchCache(_topk_histogram_kernel)
TOPK_COLLECT_LAUNCH = LaunchCache(_topk_collect_kernel)
TOPK_FINISH_LAUNCH = LaunchCache(_topk_finish_kernel)


def _pow2(value: int) -> int:
    return next_power_of_2(max(1, value))


def row_range(scores: torch.Tensor, *, lengths: torch.Tensor | None, config: TopkConfig) -> torch.Tensor:
    """float32 ``[2, T, splits]``: per (row, split of ``config.split`` positions) the least
    (``[0]``) and greatest (``[1]``) finite score of the visible columns (``+inf``/``-inf``
    where none)."""
    rows, max_keys = scores.shape
    splits = max(1, triton.cdiv(max_keys, config.split))
    stats = torch.empty(2, rows, splits, dtype=torch.float32, device=scores.device)
    if rows == 0:
        return stats
    TOPK_RANGE_LAUNCH.launch(
        (rows, splits),
        scores,
        scores if lengths is None else lengths,
        stats,
        max_keys,
        config.split,
        splits,
        scores.stride(0),
        stats.stride(0),
        stats.stride(1),
        HAS_LENGTHS=lengths is not None,
        BLOCK=config.block,
        **pdl_options(scores.device),
        num_warps=config.num_warps,
    )
    return stats


def radix_topk(
    scores: torch.Tensor,
    out: torch.Tensor,
    *,
    k: int,
    lengths: torch.Tensor | None = None,
    stats: torch.Tensor | None = None,
    config: TopkConfig | None = None,
    num_sms: int = 132,
) -> None:
    """Fill ``out`` (int32 ``[T, width]``, last dim contiguous) with each row's top-``k``
    positions of ``scores`` (float32 ``[T, N]``, last dim contiguous) in ascending position
    order, then ``-1`` (see the module docstring).

    ``lengths``: int32 ``[T]``, only columns ``< lengths[t]`` of row ``t`` are considered (the
    others may hold anything); ``None``: all ``N``. ``stats``: float32 ``[2, T, P]`` per-row
    (min, max) parts of the considered finite scores (:func:`row_range`, or the indexer's scores
    kernel); ``None`` computes them. ``k`` at most ``width``; any ``k >= 1``."""
    rows, max_keys = scores.shape
    width = out.shape[1]
    if out.shape[0] != rows or not 1 <= k <= width:
        raise InvalidInputError("out", f"expected [{rows}, >= k] with 1 <= k, got {tuple(out.shape)}, k={k}")
    if scores.dtype != torch.float32 or out.dtype != torch.int32:
        raise InvalidInputError("scores", "expected float32 scores and an int32 output")
    if scores.stride(-1) != 1 or out.stride(-1) != 1:
        raise InvalidInputError("scores", "scores and out need a contiguous last dim")
    if rows == 0:
        return
    if config is None:
        config = topk_config(rows=rows, max_keys=max_keys, num_sms=num_sms)
    if config.split % config.block or config.split <= 0:
        raise InvalidInputError(
            "config", f"split {config.split} must be a positive multiple of block {config.block}"
        )
    if config.finish_tile < 16 or config.finish_tile & (config.finish_tile - 1):
        raise InvalidInputError("config", f"finish_tile {config.finish_tile} must be a power of two >= 16")
    if not 1 <= config.finish_bits <= 8:
        raise InvalidInputError("config", f"finish_bits {config.finish_bits} must be from 1 to 8")
    if config.bins not in {1 << b for b in range(1, 9)}:
        raise InvalidInputError("config", f"bins {config.bins} must be a power of two from 2 to {DIGIT_BINS}")
    if stats is None:
        stats = row_range(scores, lengths=lengths, config=config)
    splits = max(1, triton.cdiv(max_keys, config.split))
    device = scores.device
    hist = torch.empty(rows, splits, config.bins, dtype=torch.int32, device=device)
    cand_cap = max(1, min(config.cand_cap, max_keys))
    cand = torch.empty(rows, cand_cap, dtype=torch.int32, device=device)
    lengths_arg = scores if lengths is None else lengths
    parts = stats.shape[2]
    common = {"HAS_LENGTHS": lengths is not None, "PART_BLOCK": _pow2(parts), "NUM_BINS": config.bins}
    TOPK_HISTOGRAM_LAUNCH.launch(
        (rows, splits),
        scores,
        lengths_arg,
        stats,
        hist,
        max_keys,
        config.split,
        parts,
        scores.stride(0),
        stats.stride(0),
        stats.stride(1),
        hist.stride(0),
        **common,
        BLOCK=config.block,
        **pdl_options(scores.device),
        num_warps=config.num_warps,
    )
    TOPK_COLLECT_LAUNCH.launch(
        (rows, splits),
        scores,
        lengths_arg,
        stats,
        hist,
        out,
        cand,
        k,
        max_keys,
        config.split,
        splits,
        parts,
        cand_cap,
        scores.stride(0),
        stats.stride(0),
        stats.stride(1),
        hist.stride(0),
        out.stride(0),
        cand.stride(0),
        **common,
        SPLIT_BLOCK=_pow2(splits),
        BLOCK=config.block,
        **pdl_options(scores.device),
        num_warps=config.num_warps,
    )
    TOPK_FINISH_LAUNCH.launch(
        (rows,),
        scores,
        lengths_arg,
        stats,
        hist,
        out,
        cand,
        k,
        width,
        max_keys,
        splits,
        parts,
        cand_cap,
        scores.stride(0),
        stats.stride(0),
        stats.stride(1),
        hist.stride(0),
        out.stride(0),
        cand.stride(0),
        **common,
        SPLIT_BLOCK=_pow2(splits),
        DIGIT_BINS=DIGIT_BINS,
        BLOCK=config.block,
        TILE=config.finish_tile,
        RADIX_BITS=config.finish_bits,
        **pdl_options(scores.device),
        num_warps=config.finish_warps,
    )


__all__ = ["DIGIT_BINS", "NUM_BINS", "TopkConfig", "radix_topk", "row_range", "topk_config"]
