"""Request-local top-k positions to cache slots on the device (the default of
:meth:`mla.providers.base.KernelProvider.sparse_slots`, any device, no host sync)."""

from __future__ import annotations

import torch

from mla.providers.calls import SparseSlotsCall


def sparse_slots(call: SparseSlotsCall) -> None:
    """Fill ``call.slots`` from ``call.indices`` (see :class:`SparseSlotsCall`)."""
    indices, slots = call.indices, call.slots
    rows = indices.shape[0]
    if rows == 0 or indices.shape[1] == 0:
        return
    table = call.block_table
    positions = indices.to(torch.int64)
    keys = call.row_keys[:rows].to(torch.int64)[:, None]
    in_range = (positions >= 0) & (positions < keys) & (positions < table.shape[1] * call.block_size)
    block_index = torch.where(in_range, positions // call.block_size, 0)
    request = torch.clamp(call.row_request[:rows].to(torch.int64), 0, max(table.shape[0] - 1, 0))
    request = request[:, None].expand_as(positions)
    block = table[request, block_index].to(torch.int64)
    valid = in_range & (block >= 0) & (block < call.num_blocks)
    flat = block * call.block_size + positions % call.block_size
    slots.copy_(torch.where(valid, flat, -1).to(slots.dtype))
    bad = (~valid & (positions != -1)).sum(dtype=torch.int32)
    call.invalid_count.add_(bad.reshape(1))


def compact_slots(slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's valid slots (``>= 0``, in their order) packed end to end: ``(token_ids
    int32 [T*K], indptr int32 [T+1])`` with row ``t``'s slots at ``token_ids[indptr[t]:
    indptr[t+1]]`` (entries past ``indptr[T]`` are unused). Device ops of fixed shapes, no host
    sync: the per-row key lists of the small-head decode contract (page size 1), so a kernel
    that reads per-row token lists serves sparse attention."""
    rows, width = slots.shape
    valid = slots >= 0
    counts = valid.sum(dim=1, dtype=torch.int32)
    indptr = torch.zeros(rows + 1, dtype=torch.int32, device=slots.device)
    torch.cumsum(counts, dim=0, out=indptr[1:])
    rank = torch.cumsum(valid, dim=1, dtype=torch.int64) - 1
    target = torch.where(valid, indptr[:-1, None].to(torch.int64) + rank, rows * width)
    token_ids = torch.zeros(rows * width + 1, dtype=torch.int32, device=slots.device)
    token_ids.scatter_(0, target.reshape(-1), slots.reshape(-1).to(torch.int32))
    return token_ids[:-1], indptr
