# mypy: disable-error-code="no-untyped-def, untyped-decorator"
"""The chunked-context gather (:class:`~mla.providers.calls.GatherContextCall`) in two Triton
kernels around one scan: each token's inside flag, their prefix sums (``cumsum_``), then every
token's row read once and written once, to its place in the inside-first partition (zeros for
a token outside the cache), the fp8 dequantization and the cast folded in, and
``cu_seqlens_out`` looked up from the sums.

The torch form (:func:`mla.providers.context_gather.gather_context_rows`) takes a dozen small
kernels and two passes over the rows (the gather, then the zeroing). Graph-capturable: grids come
from tensor shapes, never from tensor values; no host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla.core.config import is_fp8
from mla.providers.calls import GatherContextCall
from mla.providers.context_gather import check_gather_call
from mla.providers.triton.launch_cache import LaunchCache

FLAG_BLOCK = 1024
"""Tokens per program of the flag kernel."""
ROW_ELEMENTS = 8192
"""Row elements (padded to a power of two) per program of the row kernel."""
PER_CALL = ("num_tokens", "num_requests", "cache_rows")
"""The ints that change per call: not specialized on."""


@triton.jit
def _inside(ids_ptr, cu_ptr, p, num_tokens, num_requests, cache_rows):
    """Whether positions ``p`` are inside (the call's rule) and their token ids."""
    live = p < num_tokens
    ids = tl.load(ids_ptr + p, mask=live, other=-1)
    end = tl.load(cu_ptr + num_requests)
    return live & (ids >= 0) & (ids < cache_rows) & (p < end), ids


@triton.jit(do_not_specialize=PER_CALL)
def _flags_kernel(ids_ptr, cu_ptr, before_ptr, num_tokens, num_requests, cache_rows, BLOCK: tl.constexpr):
    """``before[p + 1]`` = token ``p``'s inside flag (0/1); ``before[0]`` = 0."""
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside, _ids = _inside(ids_ptr, cu_ptr, p, num_tokens, num_requests, cache_rows)
    tl.store(before_ptr + 1 + p, inside.to(tl.int32), mask=p < num_tokens)
    if tl.program_id(0) == 0:
        tl.store(before_ptr, 0)


@triton.jit(do_not_specialize=PER_CALL)
def _rows_kernel(
    cache_ptr, ids_ptr, cu_ptr, before_ptr, out_ptr, cu_out_ptr, scale_ptr, num_tokens, num_requests,
    cache_rows, stride_cache, WIDTH: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    DEQUANT: tl.constexpr, HAS_SCALE: tl.constexpr,
):  # fmt: skip
    """Tokens ``[pid·BLOCK_T, (pid+1)·BLOCK_T)``: each row to its partition place (``before``
    holds the inclusive sums of the flags after a zero); entries of ``cu_seqlens_out`` at the
    same positions."""
    pid = tl.program_id(0)
    p = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    live = p < num_tokens
    inside, ids = _inside(ids_ptr, cu_ptr, p, num_tokens, num_requests, cache_rows)
    before = tl.load(before_ptr + p, mask=live, other=0)
    total = tl.load(before_ptr + num_tokens)
    dest = tl.where(inside, before, total + p - before).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    in_row = cols < WIDTH
    src = tl.where(inside, ids, 0).to(tl.int64)
    read = inside[:, None] & in_row[None, :]
    rows = tl.load(cache_ptr + src[:, None] * stride_cache + cols[None, :], mask=read)
    if DEQUANT:
        rows = rows.to(tl.float32)
        if HAS_SCALE:
            rows = rows * tl.load(scale_ptr)
    rows = tl.where(read, rows, 0.0)  # (no ``other=``: the interpreter cannot cast it to fp8)
    tl.store(
        out_ptr + dest[:, None] * WIDTH + cols[None, :],
        rows.to(out_ptr.dtype.element_ty),
        mask=live[:, None] & in_row[None, :],
    )
    r = p
    has_entry = r <= num_requests
    start = tl.load(cu_ptr + r, mask=has_entry, other=0)
    start = tl.minimum(tl.maximum(start, 0), num_tokens)
    tl.store(cu_out_ptr + r, tl.load(before_ptr + start, mask=has_entry, other=0), mask=has_entry)


FLAGS_LAUNCH = LaunchCache(_flags_kernel)
ROWS_LAUNCH = LaunchCache(_rows_kernel)


def gather_context(call: GatherContextCall) -> None:
    """:class:`~mla.providers.calls.GatherContextCall` on the device: the flag kernel, an int32
    ``cumsum_`` over the flags, then the row kernel (``ROW_ELEMENTS // BLOCK_D`` tokens a
    program). Checks the call first (:func:`~mla.providers.context_gather.check_gather_call`)."""
    check_gather_call(call)
    ids, cu, cache = call.token_ids, call.cu_seqlens_k, call.cache
    num_tokens, num_requests = ids.numel(), cu.numel() - 1
    if num_tokens == 0:
        call.cu_seqlens_out.zero_()
        return
    before = torch.empty(num_tokens + 1, dtype=torch.int32, device=ids.device)
    cache_rows = cache.shape[0]
    FLAGS_LAUNCH.launch(
        (triton.cdiv(num_tokens, FLAG_BLOCK),), ids, cu, before, num_tokens, num_requests, cache_rows,
        BLOCK=FLAG_BLOCK, num_warps=4,
    )  # fmt: skip
    before[1:].cumsum_(0)
    width = cache.shape[1]
    block_d = triton.next_power_of_2(width)
    block_t = max(1, ROW_ELEMENTS // block_d)
    dequant = is_fp8(cache.dtype)
    scale = call.kv_scale
    ROWS_LAUNCH.launch(
        (triton.cdiv(max(num_tokens, num_requests + 1), block_t),),
        cache, ids, cu, before, call.out, call.cu_seqlens_out, scale if scale is not None else before,
        num_tokens, num_requests, cache_rows, cache.stride(0),
        WIDTH=width, BLOCK_T=block_t, BLOCK_D=block_d, DEQUANT=dequant,
        HAS_SCALE=dequant and scale is not None, num_warps=4,
    )  # fmt: skip


__all__ = ["gather_context"]
