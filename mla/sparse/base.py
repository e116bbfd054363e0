"""Sparse MLA strategy base: the step's query rows, their plan, and the persistent buffers.

DeepSeek Sparse Attention runs every query row (decode, verify and prefill alike) in the
absorbed MQA form over only the cache rows its indexer selected. A step's rows are mapped once
on the device (:meth:`SparseBuffers.map_rows`: the request of each row and how many positions its
causal window shows); each phase's plan holds views of that map. ``run`` turns a layer's
request-local top-k positions into cache slots (invalid ones masked and counted, never read) and
each row's length (``1 +`` its last valid column), and calls the provider's ``sparse-attention``
kernel with both, so a kernel skips the ``-1`` tail of a short row (a causal prefill's early
rows, a short request's decode).
"""

from __future__ import annotations

from typing import ClassVar, TypeVar

import attrs
import torch

from mla.core.capabilities import Contract
from mla.core.config import FLOAT_DTYPES, dtype_name
from mla.core.context import DecodeContext, PrefillContext
from mla.core.errors import InvalidInputError
from mla.core.support import ReasonCollector
from mla.providers.calls import SparseAttentionCall, SparseSlotsCall
from mla.strategy import PlanBase, Strategy, StrategyKind, StrategySetup, check_tensor, require_dtype

CtxT = TypeVar("CtxT", DecodeContext, PrefillContext)


@attrs.define
class SparseBuffers:
    """Persistent buffers of a sparse backend, sized at init from the engine limits.

    ``row_request``/``row_keys`` hold the step's row map (:meth:`map_rows`), ``slots`` the cache
    slots of the rows' top-k positions and ``lengths`` each row's slot count up to its last valid
    one (both rewritten by every layer's run), ``invalid_count`` the number of top-k entries
    masked because they were outside their row's window or the cache.
    """

    row_request: torch.Tensor
    """int32 ``[max_rows]``: the block-table row (request) of each query row."""
    row_keys: torch.Tensor
    """int32 ``[max_rows]``: positions ``0 .. row_keys[t] - 1`` are visible to row ``t``."""
    slots: torch.Tensor
    """int32 ``[max_rows, index_topk]``."""
    lengths: torch.Tensor
    """int32 ``[max_rows]``: ``1 +`` the last column of each row's ``slots`` that is valid (0:
    none), :attr:`~mla.providers.calls.SparseSlotsCall.lengths`."""
    invalid_count: torch.Tensor
    """int32 ``[1]``, cumulative since the backend was made (or last reset)."""

    @classmethod
    def allocate(cls, setup: StrategySetup) -> SparseBuffers:
        limits, dev = setup.limits, setup.device
        topk = setup.dims.index_topk
        if topk is None:
            raise InvalidInputError("dims", "sparse buffers need MLADims.index_topk")
        rows = max(limits.max_num_batched_tokens, limits.max_decode_tokens)
        return cls(
            row_request=torch.zeros(rows, dtype=torch.int32, device=dev),
            row_keys=torch.zeros(rows, dtype=torch.int32, device=dev),
            slots=torch.full((rows, topk), -1, dtype=torch.int32, device=dev),
            lengths=torch.zeros(rows, dtype=torch.int32, device=dev),
            invalid_count=torch.zeros(1, dtype=torch.int32, device=dev),
        )

    @property
    def max_rows(self) -> int:
        return self.row_request.shape[0]

    def map_rows(
        self,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        num_rows: int,
        max_keys: int,
    ) -> None:
        """Write the row map of a step with ``num_rows`` query rows (device ops, no host sync).

        Row ``t`` belongs to request ``b`` when ``query_start_loc[b] <= t < query_start_loc[b+1]``
        and, as row ``i`` of ``q_b`` rows with ``s_b`` keys, sees positions ``0 .. s_b - q_b + i``
        (right-aligned causal), at most ``max_keys`` (the block table's capacity, capped by the
        engine's ``max_model_len``). Rows past the last request (graph padding) see nothing.
        """
        if num_rows == 0:
            return
        device = seq_lens.device
        qsl = query_start_loc.to(torch.int64)
        requests = seq_lens.shape[0]
        rows = torch.arange(num_rows, device=device)
        request = torch.searchsorted(qsl[1:], rows, right=True)
        owned = request < requests
        request = torch.clamp(request, max=max(requests - 1, 0))
        start, end = qsl[request], qsl[request + 1]
        keys = seq_lens.to(torch.int64)[request] - (end - start) + (rows - start) + 1
        keys = torch.clamp(keys, min=0, max=max_keys)
        self.row_keys[:num_rows].copy_(torch.where(owned, keys, 0))
        self.row_request[:num_rows].copy_(request)


@attrs.frozen
class SparseGeometry:
    """What a sparse plan was built for; ``run`` checks its inputs against it."""

    num_heads: int
    num_rows: int
    topk: int
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    max_keys: int
    """Bound on any row's visible positions (sizes the indexer's work)."""


@attrs.frozen(eq=False)
class SparsePlan(PlanBase):
    """One phase's sparse rows: views of the backend's row map, slot and length buffers (fixed
    buffers: a captured CUDA graph replays on what later runs write into them)."""

    geometry: SparseGeometry
    block_table: torch.Tensor
    """int32 ``[B, max_blocks]``: the step's block table (``row_request`` indexes its rows)."""
    row_request: torch.Tensor
    """int32 ``[num_rows]`` view."""
    row_keys: torch.Tensor
    """int32 ``[num_rows]`` view."""
    slots: torch.Tensor
    """int32 ``[num_rows, topk]`` view."""
    lengths: torch.Tensor
    """int32 ``[num_rows]`` view: written by ``run``'s slot conversion, read by its attention."""
    invalid_count: torch.Tensor


@attrs.frozen(eq=False)
class SparseRows:
    """The rows of one phase of a sparse step, as the builder hands them to ``build_metadata``."""

    block_table: torch.Tensor
    row_start: int
    """First row of the phase in the step's row map."""
    num_rows: int
    max_keys: int


def rows_plan(name: str, setup: StrategySetup, buffers: SparseBuffers, rows: SparseRows) -> SparsePlan:
    """The plan of ``rows`` for the strategy (or indexer) called ``name``: views of ``buffers``."""
    start, end = rows.row_start, rows.row_start + rows.num_rows
    topk = setup.dims.index_topk
    assert topk is not None
    return SparsePlan(
        strategy=name,
        geometry=SparseGeometry(
            num_heads=setup.dims.num_heads,
            num_rows=rows.num_rows,
            topk=topk,
            q_dtype=setup.q_dtype,
            kv_dtype=setup.cache.dtype,
            max_keys=rows.max_keys,
        ),
        block_table=rows.block_table,
        row_request=buffers.row_request[start:end],
        row_keys=buffers.row_keys[start:end],
        slots=buffers.slots[start:end],
        lengths=buffers.lengths[start:end],
        invalid_count=buffers.invalid_count,
    )


class SparseStrategy(Strategy[CtxT]):
    """Sparse MLA over the indexer's selection, in the absorbed MQA form.

    ``run(plan, q, kv_cache, topk_indices, *, kv_scale, out, lse)``: q ``[T, H, L+R]`` in the
    model dtype, ``kv_cache`` ``[blocks, block_size, W]`` (bf16/fp16/fp32 or per-tensor fp8 with
    ``W = L+R``; ``fp8_ds_mla`` bytes with ``W = 656``), ``topk_indices`` int ``[T, K]``
    request-local positions (``-1`` pads, ``K <= index_topk``), out ``[T, H, L]`` (q's dtype),
    lse ``[T, H]`` float32 or ``None``.
    """

    KIND: ClassVar[StrategyKind] = StrategyKind.SPARSE
    REQUIRES: ClassVar[frozenset[Contract]] = frozenset({Contract.SPARSE_ATTENTION})

    def __init__(self, setup: StrategySetup, buffers: SparseBuffers | None = None) -> None:
        super().__init__(setup)
        self.buffers = buffers or SparseBuffers.allocate(setup)

    @classmethod
    def check(cls, ctx: CtxT, reasons: ReasonCollector) -> None:
        caps = ctx.capabilities
        reasons.require(
            ctx.kv_dtype in caps.sparse_kv_dtypes,
            "kv-dtype",
            f"KV cache {dtype_name(ctx.kv_dtype)}: provider {caps.provider!r}'s sparse attention reads "
            f"{sorted(dtype_name(d) for d in caps.sparse_kv_dtypes)}",
        )
        require_dtype(reasons, "q-dtype", "query", ctx.q_dtype, FLOAT_DTYPES, "sparse attention")

    def build_metadata(self, rows: SparseRows) -> SparsePlan:
        """Views of the step's row map (written by the builder) for this phase's rows."""
        return rows_plan(self.NAME, self.setup, self.buffers, rows)

    def check_inputs(
        self,
        plan: SparsePlan,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        topk_indices: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor | None,
    ) -> None:
        """The engine's check of a run's tensors against ``plan`` (typed errors naming each
        argument), made once before :meth:`run`."""
        self.check_plan(plan)
        geo = plan.geometry
        dims, cache = self.setup.dims, self.setup.cache
        rows = geo.num_rows
        check_tensor("q", q, shape=(rows, geo.num_heads, dims.latent_dim), dtype=geo.q_dtype)
        check_sparse_cache(
            kv_cache,
            block_size=cache.block_size,
            width=cache.row_width(dims),
            dtype=geo.kv_dtype,
            device=q.device,
            num_blocks=cache.num_blocks or 0,
        )
        check_tensor(
            "out", out, shape=(rows, geo.num_heads, dims.kv_lora_rank), dtype=geo.q_dtype, device=q.device
        )
        if lse is not None:
            check_tensor("lse", lse, shape=(rows, geo.num_heads), dtype=torch.float32, device=q.device)
        check_topk_indices(topk_indices, rows=rows, topk=geo.topk, device=q.device)

    def run(
        self,
        plan: SparsePlan,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        topk_indices: torch.Tensor,
        *,
        kv_scale: torch.Tensor | None,
        out: torch.Tensor,
        lse: torch.Tensor | None = None,
    ) -> None:
        """Convert positions to slots (and each row's length, ``1 +`` its last valid column) and
        attend over each row's first ``length`` slots, on inputs checked against ``plan``
        (:meth:`check_inputs`, which the engine runs at its door; only the plan's strategy and
        row count are asserted here). ``kv_scale``: the float32 ``[1]`` device tensor the engine
        converted (``None`` unless the cache is per-tensor fp8)."""
        self.check_plan(plan)
        assert q.shape[0] == out.shape[0] == plan.geometry.num_rows, "run: inputs of another plan"
        dims, cache = self.setup.dims, self.setup.cache
        width = cache.row_width(dims)
        k = topk_indices.shape[1]
        slots = plan.slots[:, :k]
        provider = self.setup.provider
        provider.sparse_slots(
            SparseSlotsCall(
                indices=topk_indices,
                block_table=plan.block_table,
                row_request=plan.row_request,
                row_keys=plan.row_keys,
                block_size=cache.block_size,
                num_blocks=kv_cache.shape[0],
                slots=slots,
                invalid_count=plan.invalid_count,
                lengths=plan.lengths,
            )
        )
        provider.sparse_attention(
            SparseAttentionCall(
                q=q,
                kv_cache=kv_cache.view(-1, width),
                slots=slots,
                out=out,
                lse=lse,
                kv_lora_rank=dims.kv_lora_rank,
                rope_dim=dims.qk_rope_head_dim,
                softmax_scale=dims.scale,
                kv_scale=kv_scale,
                lengths=plan.lengths,
            )
        )


def check_sparse_cache(
    kv_cache: torch.Tensor,
    *,
    block_size: int,
    width: int,
    dtype: torch.dtype,
    device: torch.device,
    num_blocks: int = 0,
) -> None:
    """The latent cache a sparse run reads: ``[blocks >= num_blocks, block_size, width]`` of
    ``dtype`` (``num_blocks``: ``KVCacheSpec.num_blocks`` when known)."""
    if not isinstance(kv_cache, torch.Tensor):
        raise InvalidInputError("kv_cache", f"expected a torch.Tensor, got {type(kv_cache).__name__}")
    if kv_cache.dtype != dtype or kv_cache.dim() != 3 or tuple(kv_cache.shape[1:]) != (block_size, width):
        raise InvalidInputError(
            "kv_cache",
            f"expected [num_blocks, {block_size}, {width}] {dtype_name(dtype)} (the backend's "
            f"KVCacheSpec format), got {tuple(kv_cache.shape)} {dtype_name(kv_cache.dtype)}",
        )
    if kv_cache.device.type != device.type:
        raise InvalidInputError("kv_cache", f"expected device {device}, got {kv_cache.device}")
    if not kv_cache.is_contiguous():
        raise InvalidInputError("kv_cache", "must be contiguous (the kernels read it as flat rows)")
    if kv_cache.shape[0] < num_blocks:
        raise InvalidInputError(
            "kv_cache",
            f"has {kv_cache.shape[0]} blocks but KVCacheSpec.num_blocks is {num_blocks}; pass the cache "
            "the block table indexes",
        )


def check_topk_indices(topk_indices: torch.Tensor, *, rows: int, topk: int, device: torch.device) -> None:
    """``topk_indices``: int32/int64 ``[rows, K]`` with ``K <= topk`` on the data's device."""
    if not isinstance(topk_indices, torch.Tensor):
        raise InvalidInputError("topk_indices", f"expected a torch.Tensor, got {type(topk_indices).__name__}")
    if topk_indices.dtype not in (torch.int32, torch.int64) or topk_indices.dim() != 2:
        raise InvalidInputError(
            "topk_indices",
            f"expected int32 [rows, K] request-local positions, got {dtype_name(topk_indices.dtype)} "
            f"{tuple(topk_indices.shape)}",
        )
    if topk_indices.shape[0] != rows:
        raise InvalidInputError(
            "topk_indices", f"expected {rows} rows (the step's), got {topk_indices.shape[0]}"
        )
    if topk_indices.shape[1] > topk:
        raise InvalidInputError(
            "topk_indices",
            f"has {topk_indices.shape[1]} columns, more than the backend's index buffer "
            f"(MLADims.index_topk={topk}); pass at most index_topk positions per row",
        )
    if topk_indices.device.type != device.type:
        raise InvalidInputError("topk_indices", f"expected device {device}, got {topk_indices.device}")


def check_topk_positions(topk_indices: torch.Tensor, row_keys: torch.Tensor) -> None:
    """Host check (``validate="full"``; copies both to the host): every entry of row ``t`` is
    ``-1`` or a position ``0 <= p < row_keys[t]`` its causal window shows."""
    indices = topk_indices.detach().cpu().to(torch.int64)
    keys = row_keys.detach().cpu().to(torch.int64)[: indices.shape[0], None]
    bad = (indices != -1) & ((indices < 0) | (indices >= keys))
    if bool(bad.any()):
        row, col = (int(v) for v in torch.nonzero(bad)[0])
        raise InvalidInputError(
            "topk_indices",
            f"row {row} entry {col} is position {int(indices[row, col])}, outside the row's request "
            f"window 0..{int(keys[row, 0]) - 1} (request-local positions the row may see, or -1)",
        )
