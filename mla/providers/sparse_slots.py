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
