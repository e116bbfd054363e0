# mypy: disable-error-code="no-untyped-def, untyped-decorator"
"""A Triton top-k of float32 rows by radix select: the indexer's ``k`` of ``n`` (2048 of up to
hundreds of thousands) in a few passes over each row, without sorting the row.

One program owns one row. Each float is mapped to a 32-bit key in the same order
(:func:`_order_key`: the sign bit flipped for positives, every bit for negatives). Three passes
over the row build histograms of the keys' 11-, 11- and 10-bit digits, high digits first, each
among the keys that match the digits chosen so far; after each pass the digit that holds the
``need``-th largest remaining key is fixed, so after three passes the threshold key ``T`` of
the ``k``-th largest value is exact. A fourth pass writes the positions of the keys above ``T``
(prefix sums give each its slot) and as many keys equal to ``T`` as are still needed (ties: the
first positions). The ``k`` chosen positions are then sorted by value, descending (a bitonic
sort of ``key · 2³² + position`` in registers); positions whose value is ``-inf`` (not visible)
become ``-1``, as do the columns past ``min(k, n)``. The result is what ``torch.topk(scores,
k, sorted=True)`` followed by ``-inf → -1`` gives, up to the order of equal values.

Cost: four reads of the row (from L2 when it fits) and one sort of ``k`` values; it grows with
``n`` linearly, not with ``n·log n``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla.core.errors import InvalidInputError
from mla.providers.triton.launch_cache import LaunchCache

CHUNK = 2048
"""Scores per step of each pass over a row."""
NUM_BINS = 2048
"""Histogram bins per pass (11-bit digits: 11 + 11 + 10 bits cover a 32-bit key)."""


@triton.jit
def _order_key(x):
    """uint32 keys in the order of the float32 values ``x`` (larger value, larger key)."""
    bits = x.to(tl.uint32, bitcast=True)
    negative = (bits >> 31) == 1
    all_bits = tl.full(bits.shape, 0xFFFFFFFF, tl.uint32)
    sign_bit = tl.full(bits.shape, 0x80000000, tl.uint32)
    return bits ^ tl.where(negative, all_bits, sign_bit)


@triton.jit
def _select_digit(
    row_ptr, n, prefix, need,
    SHIFT: tl.constexpr, HIGH_MASK: tl.constexpr, CHUNK: tl.constexpr, NUM_BINS: tl.constexpr,
):  # fmt: skip
    """One radix pass: among the keys whose bits above ``SHIFT + 11`` equal ``prefix``'s
    (``HIGH_MASK``), the digit ``(key >> SHIFT) % NUM_BINS`` holding the ``need``-th largest; returns
    ``prefix`` with that digit set and ``need`` less the keys above it."""
    hist = tl.zeros([NUM_BINS], tl.int32)
    high = tl.full([], HIGH_MASK, tl.uint32)
    offs = tl.arange(0, CHUNK)
    for c0 in range(0, n, CHUNK):
        pos = c0 + offs
        ok = pos < n
        key = _order_key(tl.load(row_ptr + pos, mask=ok, other=0.0))
        match = ok & ((key & high) == prefix)
        digit = ((key >> SHIFT) & (NUM_BINS - 1)).to(tl.int32)
        hist += tl.histogram(digit, NUM_BINS, mask=match)
    bins = tl.arange(0, NUM_BINS)
    at_least = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist  # keys whose digit is >= bin
    # The highest digit with at least `need` keys at or above it (0 when the row has fewer).
    digit = tl.max(tl.where(at_least >= need, bins, 0), 0)
    above = tl.sum(tl.where(bins == digit, at_least - hist, 0), 0)
    return prefix | (digit.to(tl.uint32) << SHIFT), need - above


@triton.jit
def _topk_kernel(
    scores_ptr,
    out_ptr,
    n,
    k,
    stride_s,
    stride_o,
    CHUNK: tl.constexpr,
    NUM_BINS: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Program ``r``: ``out[r, :k]`` = the positions of row ``r``'s ``k`` largest scores,
    descending, ``-1`` for ``-inf`` scores and past ``min(k, n)``."""
    r = tl.program_id(0).to(tl.int64)
    row_ptr = scores_ptr + r * stride_s
    out_row = out_ptr + r * stride_o
    count = tl.minimum(k, n)
    prefix = tl.zeros([], tl.uint32)
    need = count
    prefix, need = _select_digit(row_ptr, n, prefix, need, 21, 0x00000000, CHUNK, NUM_BINS)
    prefix, need = _select_digit(row_ptr, n, prefix, need, 10, 0xFFE00000, CHUNK, NUM_BINS)
    prefix, need = _select_digit(row_ptr, n, prefix, need, 0, 0xFFFFFC00, CHUNK, NUM_BINS)

    # The keys above the threshold first (count - need of them), then `need` keys equal to it.
    offs = tl.arange(0, CHUNK)
    base_gt = tl.zeros([], tl.int32)
    base_eq = count - need
    for c0 in range(0, n, CHUNK):
        pos = c0 + offs
        ok = pos < n
        key = _order_key(tl.load(row_ptr + pos, mask=ok, other=0.0))
        gt = ok & (key > prefix)
        eq = ok & (key == prefix)
        slot_gt = base_gt + tl.cumsum(gt.to(tl.int32), 0) - 1
        slot_eq = base_eq + tl.cumsum(eq.to(tl.int32), 0) - 1
        tl.store(out_row + slot_gt, pos, mask=gt)
        tl.store(out_row + slot_eq, pos, mask=eq & (slot_eq < count))
        base_gt += tl.sum(gt.to(tl.int32), 0)
        base_eq += tl.sum(eq.to(tl.int32), 0)
    tl.debug_barrier()  # the positions written above are read back by other threads

    sel = tl.arange(0, BLOCK_K)
    chosen = sel < count
    pos = tl.load(out_row + sel, mask=chosen, other=0)
    key = _order_key(tl.load(row_ptr + pos, mask=chosen, other=float("-inf")))
    packed = (key.to(tl.uint64) << 32) | pos.to(tl.uint32).to(tl.uint64)
    packed = tl.where(chosen, packed, tl.zeros_like(packed))
    packed = tl.sort(packed, descending=True)
    key = (packed >> 32).to(tl.uint32)
    pos = packed.to(tl.uint32).to(tl.int32)  # the low 32 bits
    neg_inf_key = _order_key(tl.full([BLOCK_K], float("-inf"), tl.float32))
    result = tl.where(chosen & (key > neg_inf_key), pos, -1)
    tl.store(out_row + sel, result, mask=sel < k)


TOPK_LAUNCH = LaunchCache(_topk_kernel)


def topk_positions(scores: torch.Tensor, out: torch.Tensor) -> None:
    """``out[r] =`` the positions of the ``out.shape[1]`` largest values of ``scores[r]`` in
    descending order (ties in either order), ``-1`` for ``-inf`` values and past the row's
    length. ``scores`` float32 ``[rows, n]``, ``out`` int32 ``[rows, k]``, last dims contiguous;
    ``k ≤ 16384``."""
    rows, n = scores.shape
    k = out.shape[1]
    if scores.dtype != torch.float32:
        raise InvalidInputError("scores", f"needs float32, got {scores.dtype}")
    if out.dtype != torch.int32:
        raise InvalidInputError("out", f"needs int32, got {out.dtype}")
    if out.shape[0] != rows:
        raise InvalidInputError("out", f"needs {rows} rows, got {out.shape[0]}")
    if scores.stride(-1) != 1 or out.stride(-1) != 1:
        raise InvalidInputError("scores", "scores and out need a contiguous last dim")
    if k > 16384:
        raise InvalidInputError("out", f"top-k of at most 16384 positions, got {k}")
    if rows == 0 or k == 0:
        return
    if n == 0:
        out.fill_(-1)
        return
    block_k = triton.next_power_of_2(k)
    TOPK_LAUNCH.launch(
        (rows,),
        scores,
        out,
        n,
        k,
        scores.stride(0),
        out.stride(0),
        CHUNK=CHUNK,
        NUM_BINS=NUM_BINS,
        BLOCK_K=block_k,
        num_warps=8 if block_k >= 2048 else 4,
    )


__all__ = ["topk_positions"]
