"""The attention impl: the engine's door for running a step. Each call checks what the caller
passed once (kinds, devices, the cache dtype, the fp8 ``kv_scale``, which the backend's
:class:`~mla.engine.backend.scale.KVScale` converts once) and calls one custom op of
:mod:`mla.engine.backend.ops`, whose body checks the tensors against the current plan and runs
it; nothing after that checks again."""

from __future__ import annotations

import torch

from mla.core.errors import InvalidInputError
from mla.core.validate import check_slots, require_cache_dtype, require_index
from mla.engine.backend import ops
from mla.engine.backend.checks import check_kv_write, require_instance, require_on_q_device, require_tensors
from mla.engine.backend.state import BackendState
from mla.engine.backend.step import MLAMetadata
from mla.prefill.base import ContextExpander
from mla.sparse.base import check_topk_positions


class AttentionImpl:
    """Runs decode, prefill and the KV write through the custom ops of :mod:`mla.engine.backend.ops`.

    Each method checks its inputs, then calls one op with the backend's handle; the op runs the
    backend's current plan. Eager calls also check that ``metadata`` is the current step's
    (:class:`PlanMismatchError` otherwise) and hold the backend (a second thread's concurrent
    call raises :class:`~mla.core.errors.ConcurrentUseError`). Under ``torch.compile`` the
    metadata argument is not read, so the compiled graph neither guards on it nor changes from
    step to step.
    """

    def __init__(self, backend: BackendState) -> None:
        self.backend = backend

    def forward_decode(
        self,
        metadata: MLAMetadata,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        *,
        out: torch.Tensor,
        lse: torch.Tensor | None = None,
        kv_scale: float | torch.Tensor | None = None,
    ) -> None:
        """q ``[num_decode_tokens, H, L+R]``; writes out ``[.., H, L]`` and, when given, lse
        ``[.., H]`` float32. ``lse=None`` (plain decode; the LSE is only needed to merge states,
        e.g. under decode context parallelism) lets the provider skip computing it.
        ``kv_scale`` (fp8 cache) is a float or a one-element device tensor; kernels read it on
        the device, so a captured graph replays with the tensor's current value."""
        be = self.backend
        eager = be.hold("impl.forward_decode")  # False under torch.compile
        try:
            if eager:
                require_instance("metadata", metadata, MLAMetadata)
                self._require_dense("forward_decode", "forward_sparse_decode")
                be.check_current(metadata, "decode")
            require_tensors(q=q, kv_cache=kv_cache, out=out)
            require_on_q_device(q, kv_cache=kv_cache, out=out, lse=lse)
            require_cache_dtype(kv_cache, be.cache.dtype)  # before kv_scale: the cache is the cause
            scale = be.kv_scale.tensor(kv_scale, device=q.device)
            ops.decode(q, kv_cache, out, lse, scale, be.op_id)
        finally:
            if eager:
                be.in_use.release()

    def forward_prefill(
        self,
        metadata: MLAMetadata,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        out: torch.Tensor,
        lse: torch.Tensor | None = None,
        kv_cache: torch.Tensor | None = None,
        kv_scale: float | torch.Tensor | None = None,
        expand_context: ContextExpander | ops.ContextExpanderHandle | None = None,
    ) -> None:
        """q/k ``[num_prefill_tokens, H, Dqk]``, v ``[.., H, Dv]``; writes out ``[.., H, Dv]``.

        ``expand_context``: the engine's latent -> (k, v) callback, or (required under
        ``torch.compile``) its handle from :func:`mla.register_context_expander`.
        """
        be = self.backend
        eager = be.hold("impl.forward_prefill")
        try:
            if eager:
                require_instance("metadata", metadata, MLAMetadata)
                self._require_dense("forward_prefill", "forward_sparse_prefill")
                be.check_current(metadata, "prefill")
            require_tensors(q=q, k=k, v=v, out=out)
            require_on_q_device(q, k=k, v=v, out=out, lse=lse, kv_cache=kv_cache)
            if kv_cache is None and kv_scale is not None:
                raise InvalidInputError("kv_scale", "was given without a kv_cache; pass both or neither")
            require_cache_dtype(kv_cache, be.cache.dtype)
            scale = be.kv_scale.tensor(kv_scale, device=q.device, required=False)
            if lse is None:
                lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device)
            if expand_context is None or isinstance(expand_context, ops.ContextExpanderHandle):
                expander_id = 0 if expand_context is None else expand_context.id
                ops.prefill(q, k, v, out, lse, kv_cache, scale, be.op_id, expander_id)
                return
            if not eager:
                raise InvalidInputError(
                    "expand_context",
                    "under torch.compile pass a handle: register the callback once with "
                    "mla.register_context_expander(fn) (e.g. at layer init) and pass the handle",
                )
            handle = ops.register_context_expander(expand_context)
            try:
                ops.prefill(q, k, v, out, lse, kv_cache, scale, be.op_id, handle.id)
            finally:
                handle.release()
        finally:
            if eager:
                be.in_use.release()

    def write_kv(
        self,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        *,
        kv_scale: float | torch.Tensor | None = None,
    ) -> None:
        """Write the step's new latent rows ``kv_c [N, L]`` and rope rows ``k_pe [N, R]`` into
        ``kv_cache [blocks, block_size, L+R]`` at flat slots ``slot_mapping [N]`` (negative
        slots are skipped, and slots outside the cache too; ``validate="full"`` rejects those
        and shared slots on the host; vLLM's ``concat_and_cache_mla`` argument order). fp8
        caches store ``value / kv_scale``."""
        be = self.backend
        eager = be.hold("impl.write_kv")
        try:
            check_kv_write(kv_c, k_pe, kv_cache, slot_mapping, kv_scale, be.validate)
            ops.write_kv(kv_c, k_pe, kv_cache, slot_mapping, be.kv_scale.convert(kv_scale), be.provider_id)
        finally:
            if eager:
                be.in_use.release()

    # -- sparse (DeepSeek Sparse Attention) ------------------------------------------------------

    def _require_dense(self, method: str, sparse_method: str) -> None:
        if self.backend.dims.is_sparse:
            raise InvalidInputError(
                "metadata",
                f"this backend serves a sparse model (index_topk={self.backend.dims.index_topk}): "
                f"call impl.{sparse_method} with the indexer's top-k positions instead of impl.{method}",
            )

    def forward_sparse_decode(
        self,
        metadata: MLAMetadata,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        topk_indices: torch.Tensor,
        *,
        out: torch.Tensor,
        lse: torch.Tensor | None = None,
        kv_scale: float | torch.Tensor | None = None,
    ) -> None:
        """Sparse decode of the step's decode rows: q ``[num_decode_tokens, H, L+R]`` (absorbed),
        ``topk_indices`` int ``[num_decode_tokens, K]`` request-local positions (``-1`` pads,
        ``K <= index_topk``); writes out ``[.., H, L]`` and, when given, lse ``[.., H]`` float32.
        Positions outside a row's causal window or the cache are masked and counted
        (:meth:`MLABackend.invalid_index_count`), never read."""
        self._sparse(metadata, "sparse_decode", q, kv_cache, topk_indices, out, lse, kv_scale)

    def forward_sparse_prefill(
        self,
        metadata: MLAMetadata,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        topk_indices: torch.Tensor,
        *,
        out: torch.Tensor,
        lse: torch.Tensor | None = None,
        kv_scale: float | torch.Tensor | None = None,
    ) -> None:
        """Sparse prefill of the step's prefill rows, in the absorbed form like
        :meth:`forward_sparse_decode` (the new tokens' latent rows must be in the cache)."""
        self._sparse(metadata, "sparse_prefill", q, kv_cache, topk_indices, out, lse, kv_scale)

    def _sparse(
        self,
        metadata: MLAMetadata,
        phase: str,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        topk_indices: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor | None,
        kv_scale: float | torch.Tensor | None,
    ) -> None:
        be = self.backend
        eager = be.hold(f"impl.forward_{phase}")
        try:
            if eager:
                require_instance("metadata", metadata, MLAMetadata)
                if not be.dims.is_sparse:
                    raise InvalidInputError(
                        "metadata", "this backend serves a dense model (MLADims.index_topk is None)"
                    )
                be.check_current(metadata, phase)
                if be.validate == "full" and isinstance(topk_indices, torch.Tensor):
                    plan = getattr(metadata, phase)
                    check_topk_positions(topk_indices, plan.row_keys)
            require_tensors(q=q, kv_cache=kv_cache, topk_indices=topk_indices, out=out)
            require_on_q_device(q, kv_cache=kv_cache, topk_indices=topk_indices, out=out, lse=lse)
            scale = be.kv_scale.tensor(kv_scale, device=q.device)
            prefill = phase == "sparse_prefill"
            ops.sparse_attention(q, kv_cache, topk_indices, out, lse, scale, be.op_id, prefill)
        finally:
            if eager:
                be.in_use.release()

    def index_topk(
        self,
        metadata: MLAMetadata,
        q: torch.Tensor,
        weights: torch.Tensor,
        index_cache: torch.Tensor,
        *,
        out: torch.Tensor,
    ) -> None:
        """The indexer over every row of the step (decode rows first): index queries ``q [T, Hi,
        D]`` (after their rope), per-head ``weights [T, Hi]`` (the model's, e.g.
        ``weights_proj(x) * Hi ** -0.5``), the paged ``index_cache``; writes the top
        ``index_topk`` request-local positions of each row into ``out`` (int32 ``[T, index_topk]``,
        in no particular order, ``-1`` pads). With fp8 index keys ``q`` may be e4m3, quantized
        per (row, head) with the scale folded into ``weights`` (DeepSeek-V3.2's form,
        :func:`mla.providers.formats.quantize_index_queries`): the Triton indexer then runs fp8
        dots."""
        be = self.backend
        eager = be.hold("impl.index_topk")
        try:
            if eager:
                require_instance("metadata", metadata, MLAMetadata)
                if not be.dims.is_sparse:
                    raise InvalidInputError(
                        "metadata", "this backend serves a dense model: it has no indexer"
                    )
                be.check_current(metadata, "index")
            require_tensors(index_q=q, index_weights=weights, index_cache=index_cache, out=out)
            require_on_q_device(q, index_weights=weights, index_cache=index_cache, out=out)
            ops.index_topk(q, weights, index_cache, out, be.op_id)
        finally:
            if eager:
                be.in_use.release()

    def write_index_keys(
        self, keys: torch.Tensor, index_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Write the step's index keys ``[N, D]`` (after the key norm and rope) into the index-key
        cache at ``slot_mapping [N]`` (negative slots skipped); fp8 keys are quantized per token."""
        be = self.backend
        eager = be.hold("impl.write_index_keys")
        try:
            require_tensors(index_k=keys, index_cache=index_cache)
            require_index("slot_mapping", slot_mapping, ndim=1)
            require_on_q_device(keys, index_cache=index_cache, slot_mapping=slot_mapping)
            if be.validate == "full":
                check_slots(
                    slot_mapping.cpu(), num_blocks=index_cache.shape[0], block_size=index_cache.shape[1]
                )
            ops.write_index_keys(keys, index_cache, slot_mapping, be.op_id)
        finally:
            if eager:
                be.in_use.release()
