"""mla's split-KV decode schedule: balanced work items over the device's compute units.

Shared by the torch and Triton providers (aiter plans its own format). Planned on the device
into buffers allocated once, so planning needs no host sync and a captured decode graph stays
valid after re-planning.

Planning rule (FlashMLA-style even split): with ``total`` KV tokens in the batch and ``U``
compute units, every request is cut into chunks of ``chunk = max(ceil(total / U), min_chunk)``
tokens (at least one item per request, so empty requests still produce their ``-inf`` rows).
Since ``sum ceil(len_b / chunk) <= total / chunk + B <= U + B``, ``max_batch + U`` work items
always suffice.
"""

from __future__ import annotations

import attrs
import torch

from mla.core.errors import PlanMismatchError

SPLIT_MIN_GAIN = 0.1
"""Least fraction of the waves per unit of work a split must save over no split (a split costs
its partial outputs and the reduce). Without it, 65,536 programs on 132 SMs took 2 splits for
0.1% fewer waves: the H200's sparse prefill (H128, 4 x 8192 rows, top-k 2048) ran 24% slower
split than unsplit."""


def wave_splits(programs: int, *, slots: int, cap: int) -> int:
    """Split count ``k`` in ``1..cap`` with the fewest waves per unit of work,
    ``ceil(programs·k / slots) / k`` (the smallest such ``k``), or 1 unless that saves at least
    :data:`SPLIT_MIN_GAIN` of the unsplit waves: the non-persistent split rule of the Triton and
    Gluon decode launches, where a program that starts in a second, mostly empty wave costs as
    much as a full one."""
    programs = max(1, programs)
    unsplit = float(-(-programs // slots))
    best, best_cost = 1, unsplit
    for k in range(2, max(1, cap) + 1):
        cost = -(-programs * k // slots) / k
        if cost < best_cost:
            best, best_cost = k, cost
    return best if best_cost <= (1.0 - SPLIT_MIN_GAIN) * unsplit else 1


WORK_FIELDS = 4
"""Columns of ``work_info``: request (``-1`` = idle item), kv_start, kv_end, split ordinal."""


@attrs.define
class SplitKVSchedule:
    """Fixed buffers of one persistent decode schedule (allocated at init, filled per step)."""

    work_info: torch.Tensor
    """int32 ``[max_work, 4]``: request, kv_start, kv_end (absolute positions in kv_indices),
    split ordinal within the request; request ``-1`` marks an idle item."""
    split_indptr: torch.Tensor
    """int32 ``[max_batch + 1]``: the work items of request ``b`` are
    ``split_indptr[b] .. split_indptr[b+1]`` (items are ordered by request)."""
    chunk: torch.Tensor
    """int32 ``[1]``: the KV chunk length of this step."""
    partial_o: torch.Tensor
    """float32 ``[max_work, max_kernel_qlen, kernel_heads, L]``: per-item partial outputs."""
    partial_lse: torch.Tensor
    """float32 ``[max_work, max_kernel_qlen, kernel_heads]``: per-item partial LSEs."""
    num_units: int
    min_chunk: int

    @property
    def max_work(self) -> int:
        return int(self.work_info.shape[0])

    @property
    def max_batch(self) -> int:
        return int(self.split_indptr.shape[0]) - 1

    @classmethod
    def allocate(
        cls,
        *,
        max_batch: int,
        max_kernel_qlen: int,
        kernel_heads: int,
        kv_lora_rank: int,
        num_units: int,
        device: torch.device,
        min_chunk: int = 256,
    ) -> SplitKVSchedule:
        max_work = max_batch + num_units
        return cls(
            work_info=torch.zeros(max_work, WORK_FIELDS, dtype=torch.int32, device=device),
            split_indptr=torch.zeros(max_batch + 1, dtype=torch.int32, device=device),
            chunk=torch.ones(1, dtype=torch.int32, device=device),
            partial_o=torch.empty(
                max_work,
                max_kernel_qlen,
                kernel_heads,
                kv_lora_rank,
                dtype=torch.float32,
                device=device,
            ),
            partial_lse=torch.empty(
                max_work, max_kernel_qlen, kernel_heads, dtype=torch.float32, device=device
            ),
            num_units=num_units,
            min_chunk=min_chunk,
        )

    def plan(self, kv_indptr: torch.Tensor, batch_size: int) -> None:
        """Fill the buffers for requests ``0 .. batch_size-1`` of ``kv_indptr`` (device ops)."""
        if batch_size > self.max_batch:
            raise PlanMismatchError(f"batch_size {batch_size} exceeds the schedule's {self.max_batch}")
        indptr = kv_indptr[: batch_size + 1].to(torch.int64)
        units = self.num_units
        # total = indptr[B] - indptr[0]; chunk = max(ceil(total / units), min_chunk), as [1]
        chunk = ((indptr[-1:] - indptr[:1] + (units - 1)) // units).clamp_(min=self.min_chunk)
        self.chunk.copy_(chunk)
        self.split_indptr[:1].zero_()  # a device fill: assigning a Python 0 copies from the host
        if batch_size == 0:
            self.work_info.zero_()[:, 0] = -1
            return
        splits = ((indptr[1:] - indptr[:-1] + (chunk - 1)) // chunk).clamp_(min=1)
        ends = torch.cumsum(splits, 0)
        self.split_indptr[1 : batch_size + 1].copy_(ends)
        work = torch.arange(self.max_work, device=indptr.device)
        req = torch.searchsorted(ends, work, right=True)
        valid = req < batch_size
        req = req.clamp_(max=batch_size - 1)
        ordinal = work - (ends - splits).index_select(0, req)
        start = indptr.index_select(0, req) + ordinal * chunk
        end = torch.minimum(start + chunk, indptr[1:].index_select(0, req))
        # Idle items (past the last request's): [-1, 0, 0, 0].
        info = torch.stack([req + 1, start, end, ordinal], dim=1).mul_(valid[:, None])
        info[:, 0] -= 1
        self.work_info.copy_(info)
