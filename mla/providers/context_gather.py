"""The chunked-context gather (:class:`~mla.providers.calls.GatherContextCall`): its checks and
its torch form, the default of :meth:`KernelProvider.gather_context`.

The partition needs no sort: the requests' tokens are contiguous and in request order, so a
token inside the cache goes to the count of inside tokens before it, one outside after all of
them, at the count of outside tokens before it (prefix sums and one scatter).
"""

from __future__ import annotations

import torch

from mla.core.config import is_fp8
from mla.core.errors import InvalidInputError
from mla.providers.calls import GatherContextCall

_FLOAT_OUT = (torch.float16, torch.bfloat16, torch.float32)


def check_gather_call(call: GatherContextCall) -> None:
    """:class:`InvalidInputError` naming the field of ``call`` that breaks its contract."""
    cache, ids, cu, out, cu_out = call.cache, call.token_ids, call.cu_seqlens_k, call.out, call.cu_seqlens_out
    if cache.dim() != 2 or (cache.shape[1] > 1 and cache.stride(1) != 1):
        raise InvalidInputError(
            "cache", f"must be [rows, D] with a contiguous last dim, got {tuple(cache.shape)}"
        )
    for name, index in (("token_ids", ids), ("cu_seqlens_k", cu)):
        if index.dim() != 1 or index.dtype != torch.int32:
            raise InvalidInputError(
                name, f"must be a 1-D int32 tensor, got {index.dtype} {tuple(index.shape)}"
            )
    if cu.numel() == 0:
        raise InvalidInputError("cu_seqlens_k", "must have B+1 >= 1 entries")
    n, width = ids.numel(), cache.shape[1]
    if out.shape != (n, width) or not out.is_contiguous() or out.dtype not in _FLOAT_OUT:
        raise InvalidInputError(
            "out", f"must be a contiguous [{n}, {width}] float16/bfloat16/float32 tensor, "
            f"got {out.dtype} {tuple(out.shape)}",
        )  # fmt: skip
    if cu_out.shape != cu.shape or cu_out.dtype != torch.int32:
        raise InvalidInputError("cu_seqlens_out", f"must be int32 {tuple(cu.shape)} like cu_seqlens_k")
    if call.kv_scale is not None and call.kv_scale.numel() != 1:
        raise InvalidInputError("kv_scale", f"must have one element, got {tuple(call.kv_scale.shape)}")
    devices = {t.device for t in (cache, ids, cu, out, cu_out)}
    if len(devices) > 1:
        raise InvalidInputError(
            "out", f"every tensor of the call must be on one device, got {sorted(map(str, devices))}"
        )


def context_rows_inside(
    token_ids: torch.Tensor, cu_seqlens_k: torch.Tensor, cache_rows: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The partition of :class:`~mla.providers.calls.GatherContextCall` on the device (no sync):
    ``(row ids clamped into the cache, int32; the inside mask of each position; cu_seqlens_out,
    int32)``, positions in ``out``'s order."""
    ids = token_ids
    n = ids.numel()
    position = torch.arange(n, device=ids.device)
    inside = (ids >= 0) & (position < cu_seqlens_k[-1])
    if cache_rows <= torch.iinfo(ids.dtype).max:
        inside &= ids < cache_rows
    before = torch.zeros(n + 1, dtype=torch.int64, device=ids.device)  # inside tokens before each
    torch.cumsum(inside, 0, out=before[1:])
    total = before[n]
    destination = torch.where(inside, before[:n], total + position - before[:n])
    order = torch.empty_like(position).scatter_(0, destination, position)
    cu_inside = before[cu_seqlens_k.clamp(0, n)].to(torch.int32)
    rows = ids.clamp(0, max(cache_rows - 1, 0)).index_select(0, order)
    return rows, position < total, cu_inside


def zero_rows(rows: torch.Tensor, mask: torch.Tensor) -> None:
    """Set the rows of the contiguous ``rows`` ``[n, D]`` where ``mask`` (bool ``[n]``) holds to
    +0.0, in place. Through a 64-bit integer view of each row where its bytes allow (zero bits
    are +0.0 in every float dtype): a row-broadcast mask over 8-byte words instead of 2-byte
    elements, less than half the time for bf16 rows."""
    row_bytes = rows.shape[-1] * rows.element_size()
    if rows.numel() and rows.is_contiguous() and row_bytes % 8 == 0 and rows.data_ptr() % 8 == 0:
        rows.view(torch.int64).masked_fill_(mask[:, None], 0)
    else:
        rows.masked_fill_(mask[:, None], 0.0)


def gather_context_rows(call: GatherContextCall) -> None:
    """The torch form of :class:`~mla.providers.calls.GatherContextCall` (any device, no host
    sync): the partition (:func:`context_rows_inside`), one gather in the cache dtype, one cast
    where the dtypes differ (an fp8 cache: dequantized in float32 first), the outside rows
    zeroed in place."""
    check_gather_call(call)
    rows, inside, cu_inside = context_rows_inside(call.token_ids, call.cu_seqlens_k, call.cache.shape[0])
    call.cu_seqlens_out.copy_(cu_inside)
    if rows.numel() == 0:
        return
    tracked = torch.is_grad_enabled() and call.cache.requires_grad  # (out= refuses such a cache)
    if call.cache.dtype == call.out.dtype and not tracked:
        torch.index_select(call.cache, 0, rows, out=call.out)
    else:
        latent = call.cache.index_select(0, rows)
        if is_fp8(latent.dtype):
            latent = latent.to(torch.float32)
            if call.kv_scale is not None:
                latent = latent * call.kv_scale
        call.out.copy_(latent)
    zero_rows(call.out, ~inside)


__all__ = ["check_gather_call", "context_rows_inside", "gather_context_rows", "zero_rows"]
