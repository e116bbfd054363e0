"""Request-local top-k positions to cache slots on the device (the default of
:meth:`mla.providers.base.KernelProvider.sparse_slots`, any device, no host sync)."""

from __future__ import annotations

import torch

from mla.providers.calls import SparseSlotsCall


def slot_lengths(slots: torch.Tensor) -> torch.Tensor:
    """int32 ``[T]``: ``1 +`` the last column of each row of ``slots`` (``[T, K]``) that holds a
    slot (``>= 0``), 0 for a row with none: the
    :attr:`~mla.providers.calls.SparseAttentionCall.lengths` of those slots."""
    if slots.shape[1] == 0:
        return torch.zeros(slots.shape[0], dtype=torch.int32, device=slots.device)
    ends = torch.arange(1, slots.shape[1] + 1, dtype=torch.int32, device=slots.device)
    return torch.where(slots >= 0, ends, 0).amax(dim=1).to(torch.int32)


def sparse_slots(call: SparseSlotsCall) -> None:
    """Fill ``call.slots`` from ``call.indices`` (see :class:`SparseSlotsCall`) and, when
    ``call.lengths`` is given, its first ``T`` entries with each row's ``1 +`` last valid column
    (0 for a row with none, every row when ``K == 0``)."""
    indices, slots = call.indices, call.slots
    rows, width = indices.shape
    if rows == 0:
        return
    if width == 0:
        if call.lengths is not None:
            call.lengths[:rows].zero_()
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
    if call.lengths is not None:
        call.lengths[:rows].copy_(slot_lengths(slots))
    bad = (~valid & (positions != -1)).sum(dtype=torch.int32)
    call.invalid_count.add_(bad.reshape(1))


__all__ = ["slot_lengths", "sparse_slots"]
