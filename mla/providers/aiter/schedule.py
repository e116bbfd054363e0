"""aiter's persistent work schedules: decode (device-planned) and fp8 prefill (host-planned).

Both are aiter's own format: six buffers (``work_metadata_ptrs``, ``work_indptr``,
``work_info_set``, ``reduce_indptr``, ``reduce_final_map``, ``reduce_partial_map``) whose shapes
aiter's ``*_info_v1`` functions give. The decode schedule is allocated once at init and re-planned
in place every step (``get_mla_metadata_v1``, on the device), so a captured decode graph stays
valid; it records the geometry it was sized for, and every plan and run is checked against it
(vLLM PRs #38615, #45227, #46997: buffers sized for other heads, qlen or dtypes than the run).

aiter's planner and kernel take the buffers' shapes as the layout of the plan (tile counts per
request, partial rows), so a step at kernel qlen ``q`` is handed views of exactly the shapes
``get_mla_metadata_info_v1`` gives for ``q``: one storage per buffer, sized for the largest
qlen, and a fixed set of views per qlen into it (fixed addresses, so graphs stay valid).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from mla.core.config import dtype_name
from mla.core.errors import PlanMismatchError

BufferSpec = tuple[Any, torch.dtype]
"""One ``(shape, dtype)`` pair as aiter's ``*_info_v1`` functions return them."""

FP8_PREFILL_TILE_Q = 256
"""Query rows per tile of ``mla_prefill_ps_asm_fwd`` (vLLM's ``_FP8_PREFILL_TILE_Q``)."""
FP8_PREFILL_KV_GRANULARITY = 128
"""``kvlen_granularity`` vLLM passes to ``get_ps_metadata_v1`` (a power of two)."""
DECODE_KV_GRANULARITY = 16
"""``kv_granularity`` of ``get_mla_metadata_v1`` (page size 1: tokens)."""


def _shape(spec: Any) -> tuple[int, ...]:
    return tuple(int(s) for s in spec) if isinstance(spec, Sequence) else (int(spec),)


SixBuffers = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def allocate(specs: Sequence[BufferSpec], device: torch.device) -> SixBuffers:
    """``torch.empty`` buffers for aiter's ``(shape, dtype)`` pairs (six, in aiter's order)."""
    if len(specs) != 6:
        raise PlanMismatchError(f"aiter returned {len(specs)} metadata buffer specs, expected 6")
    a, b, c, d, e, f = (torch.empty(_shape(shape), dtype=dtype, device=device) for shape, dtype in specs)
    return a, b, c, d, e, f


def _prefix_view(storage: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The first ``prod(shape)`` elements of contiguous ``storage`` viewed as ``shape``."""
    count = 1
    for dim in shape:
        count *= dim
    return storage.reshape(-1)[:count].view(shape)


def largest(spec_sets: Sequence[Sequence[BufferSpec]]) -> list[BufferSpec]:
    """Elementwise largest shapes over several ``*_info_v1`` answers (same dtypes)."""
    out: list[BufferSpec] = []
    for column in zip(*spec_sets, strict=True):
        shapes = [_shape(shape) for shape, _ in column]
        dtypes = {dtype for _, dtype in column}
        if len(dtypes) != 1 or len({len(s) for s in shapes}) != 1:
            raise PlanMismatchError(f"aiter metadata buffer specs disagree across qlens: {column}")
        out.append((tuple(max(dims) for dims in zip(*shapes, strict=True)), dtypes.pop()))
    return out


@attrs.define
class AiterDecodeSchedule:
    """The six ``get_mla_metadata_v1`` buffers of one backend, plus the geometry they fit.

    Sized by ``get_mla_metadata_info_v1`` for every kernel qlen ``1..max_kernel_qlen`` (aiter's
    tile count is not monotonic in qlen, so each storage has the largest shape), with the same
    kernel heads and q/kv dtypes that :meth:`check` demands of every plan and run. A step at
    kernel qlen ``q`` is handed ``views[q]``: the six buffers in the exact shapes the info call
    gave for ``q``, over the same storage.
    """

    work_metadata: torch.Tensor
    work_indptr: torch.Tensor
    work_info_set: torch.Tensor
    reduce_indptr: torch.Tensor
    reduce_final_map: torch.Tensor
    reduce_partial_map: torch.Tensor
    views: dict[int, SixBuffers]
    """Per kernel qlen: the six buffers (aiter's info order) shaped as the info call for that
    qlen says, viewing the storage above."""
    kv_last_page_lens: torch.Tensor
    """int32 ``[max_batch]`` of ones (page size 1)."""
    max_batch: int
    max_kernel_qlen: int
    kernel_heads: int
    """Heads aiter sees (the strategy's kernel heads; 24 runs as 32 with an fp8 cache)."""
    q_dtype: torch.dtype
    """The query dtype aiter sees (``aiter.dtypes.fp8`` for an fp8 cache)."""
    kv_dtype: torch.dtype
    planned_qlen: int | None = None
    """Kernel qlen of the last plan (``None``: not planned yet)."""
    planned_batch: int | None = None

    @classmethod
    def allocate(
        cls,
        info: Callable[[int], Sequence[BufferSpec]],
        *,
        max_batch: int,
        max_kernel_qlen: int,
        kernel_heads: int,
        q_dtype: torch.dtype,
        kv_dtype: torch.dtype,
        device: torch.device,
    ) -> AiterDecodeSchedule:
        """``info(qlen)`` calls ``get_mla_metadata_info_v1`` for one kernel qlen."""
        per_qlen = {qlen: list(info(qlen)) for qlen in range(1, max_kernel_qlen + 1)}
        storage = allocate(largest(list(per_qlen.values())), device)
        views: dict[int, SixBuffers] = {}
        for qlen, specs in per_qlen.items():
            a, b, c, d, e, f = (
                _prefix_view(buffer, _shape(shape)) for buffer, (shape, _) in zip(storage, specs, strict=True)
            )
            views[qlen] = (a, b, c, d, e, f)
        meta, indptr, info_set, reduce_indptr, final_map, partial_map = storage
        return cls(
            work_metadata=meta,
            work_indptr=indptr,
            work_info_set=info_set,
            reduce_indptr=reduce_indptr,
            reduce_final_map=final_map,
            reduce_partial_map=partial_map,
            views=views,
            kv_last_page_lens=torch.ones(max_batch, dtype=torch.int32, device=device),
            max_batch=max_batch,
            max_kernel_qlen=max_kernel_qlen,
            kernel_heads=kernel_heads,
            q_dtype=q_dtype,
            kv_dtype=kv_dtype,
        )

    def _views(self, qlen: int) -> SixBuffers:
        if qlen not in self.views:
            raise PlanMismatchError(
                f"aiter decode schedule: kernel qlen {qlen} is not one of the {sorted(self.views)} "
                "the buffers were sized for"
            )
        return self.views[qlen]

    def buffers(self, qlen: int) -> tuple[torch.Tensor, ...]:
        """The six buffers for kernel qlen ``qlen`` in ``get_mla_metadata_v1``'s positional
        order (``work_info_set`` before ``work_indptr``)."""
        meta, indptr, info_set, reduce_indptr, final_map, partial_map = self._views(qlen)
        return (meta, info_set, indptr, reduce_indptr, final_map, partial_map)

    def decode_kwargs(self, qlen: int) -> dict[str, torch.Tensor]:
        """All six buffers for kernel qlen ``qlen`` as ``mla_decode_fwd`` keywords (always all
        of them)."""
        meta, indptr, info_set, reduce_indptr, final_map, partial_map = self._views(qlen)
        return {
            "work_meta_data": meta,
            "work_indptr": indptr,
            "work_info_set": info_set,
            "reduce_indptr": reduce_indptr,
            "reduce_final_map": final_map,
            "reduce_partial_map": partial_map,
        }

    def check(
        self, *, batch: int, qlen: int, heads: int, q_dtype: torch.dtype, kv_dtype: torch.dtype
    ) -> None:
        """Raise :class:`PlanMismatchError` unless a step of this geometry fits the buffers."""
        problems = []
        if batch > self.max_batch:
            problems.append(f"{batch} requests > the {self.max_batch} the buffers hold")
        if qlen > self.max_kernel_qlen:
            problems.append(f"kernel qlen {qlen} > the {self.max_kernel_qlen} the buffers were sized for")
        if heads != self.kernel_heads:
            problems.append(f"{heads} kernel heads != the {self.kernel_heads} the buffers were sized for")
        if (q_dtype, kv_dtype) != (self.q_dtype, self.kv_dtype):
            problems.append(
                f"q/kv dtypes {dtype_name(q_dtype)}/{dtype_name(kv_dtype)} != "
                f"{dtype_name(self.q_dtype)}/{dtype_name(self.kv_dtype)} of the buffers"
            )
        if problems:
            raise PlanMismatchError("aiter decode schedule: " + "; ".join(problems))

    def check_planned(self, *, batch: int, qlen: int) -> None:
        """Raise unless the last plan was made for this batch size and kernel qlen."""
        if (self.planned_batch, self.planned_qlen) != (batch, qlen):
            raise PlanMismatchError(
                f"aiter decode schedule was planned for {self.planned_batch} requests at kernel qlen "
                f"{self.planned_qlen}, but the run has {batch} at {qlen}; plan every step in build_metadata"
            )


@attrs.frozen(eq=False)
class AiterPrefillSchedule:
    """One step's fp8 prefill plan from ``get_ps_metadata_v1`` (host planner, device buffers)."""

    work_metadata: torch.Tensor
    work_indptr: torch.Tensor
    work_info: torch.Tensor
    reduce_indptr: torch.Tensor
    reduce_final_map: torch.Tensor
    reduce_partial_map: torch.Tensor
    kv_indices: torch.Tensor
    """int32 ``arange(total kv tokens)``: page indices with page size 1."""
    num_partial_tiles: int
    """``reduce_indptr[-1]``: partial tiles the kernel writes (sizes the fp32 partials)."""
    max_seqlen_q: int
    cu_seqlens_q: tuple[int, ...]
    """Host copies (the LSE pass loops over requests)."""
    cu_seqlens_k: tuple[int, ...]
    num_heads: int
    causal: bool
