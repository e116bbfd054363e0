"""The lightning indexer of DeepSeek Sparse Attention as an interchangeable strategy.

An indexer strategy writes the step's index keys into the paged index-key cache and, per layer,
scores every visible cached position for each query row and keeps the top ``index_topk``
(request-local positions, ``-1`` pads). :class:`LightningIndexer` runs the provider's
``indexer`` kernels (torch, Triton; the Gluon provider serves them with the Triton kernels); a
subclass with other kernels registers by being passed as ``MLABackend(indexer_strategy=...)``.
"""

from __future__ import annotations

from typing import ClassVar

import attrs
import torch

from mla.core.capabilities import Contract, ProviderCapabilities
from mla.core.config import FLOAT_DTYPES, IndexerSpec, dtype_name
from mla.core.errors import InvalidInputError
from mla.core.support import Support
from mla.providers.calls import IndexTopkCall, WriteIndexKeysCall
from mla.sparse.base import SparsePlan
from mla.strategy import StrategySetup, check_tensor, provider_reasons


@attrs.frozen
class IndexerContext:
    """What an indexer's ``supports`` may read: the indexer spec, the query dtype, the provider."""

    spec: IndexerSpec
    q_dtype: torch.dtype
    capabilities: ProviderCapabilities
    provider_availability: Support


class IndexerStrategy:
    """Base of indexer strategies: ``supports(ctx)``, ``write_keys`` and ``run`` (device side, no
    host sync, graph-capturable)."""

    NAME: ClassVar[str]
    REQUIRES: ClassVar[frozenset[Contract]] = frozenset({Contract.INDEXER})

    def __init__(self, setup: StrategySetup, spec: IndexerSpec) -> None:
        self.setup, self.spec = setup, spec

    def __repr__(self) -> str:
        return f"{type(self).__name__}(provider={self.setup.provider.name!r})"

    @classmethod
    def supports(cls, ctx: IndexerContext) -> Support:
        reasons = provider_reasons(ctx.provider_availability, ctx.capabilities, cls.REQUIRES)
        caps = ctx.capabilities
        reasons.require(
            ctx.spec.key_dtype in caps.index_key_dtypes,
            "key-dtype",
            f"index keys {dtype_name(ctx.spec.key_dtype)}: provider {caps.provider!r}'s indexer reads "
            f"{sorted(dtype_name(d) for d in caps.index_key_dtypes)}",
        )
        reasons.require(
            ctx.q_dtype in FLOAT_DTYPES,
            "q-dtype",
            f"index queries {dtype_name(ctx.q_dtype)}: the indexer takes bf16, fp16 or fp32",
        )
        return reasons.support()

    def check_cache(self, index_cache: torch.Tensor, device: torch.device) -> None:
        """The index-key cache: ``[blocks, block_size, row_width]`` of the spec's storage dtype."""
        spec, block_size = self.spec, self.setup.cache.block_size
        if not isinstance(index_cache, torch.Tensor):
            raise InvalidInputError(
                "index_cache", f"expected a torch.Tensor, got {type(index_cache).__name__}"
            )
        expected = (block_size, spec.row_width)
        if (
            index_cache.dim() != 3
            or tuple(index_cache.shape[1:]) != expected
            or index_cache.dtype != spec.storage_dtype
        ):
            raise InvalidInputError(
                "index_cache",
                f"expected [num_blocks, {block_size}, {spec.row_width}] {dtype_name(spec.storage_dtype)} "
                f"(IndexerSpec key_dtype {dtype_name(spec.key_dtype)}, the KV cache's block size), got "
                f"{tuple(index_cache.shape)} {dtype_name(index_cache.dtype)}",
            )
        num_blocks = self.setup.cache.num_blocks
        if num_blocks is not None and index_cache.shape[0] != num_blocks:
            raise InvalidInputError(
                "index_cache",
                f"has {index_cache.shape[0]} blocks but the KV cache has {num_blocks} "
                "(KVCacheSpec.num_blocks): the index-key cache shares the KV cache's block table",
            )
        if index_cache.device.type != device.type or not index_cache.is_contiguous():
            raise InvalidInputError("index_cache", f"must be a contiguous tensor on {device}")

    def write_keys(self, keys: torch.Tensor, index_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write ``keys [N, head_dim]`` (after the key norm and rope) at ``slot_mapping [N]``."""
        spec = self.spec
        self.check_cache(index_cache, keys.device)
        rows = slot_mapping.shape[0] if isinstance(slot_mapping, torch.Tensor) else -1
        check_tensor("index_k", keys, shape=(rows, spec.head_dim))
        self.setup.provider.write_index_keys(
            WriteIndexKeysCall(
                keys=keys, index_cache=index_cache, key_dtype=spec.key_dtype, slot_mapping=slot_mapping
            )
        )

    def run(
        self,
        plan: SparsePlan,
        q: torch.Tensor,
        weights: torch.Tensor,
        index_cache: torch.Tensor,
        *,
        out: torch.Tensor,
    ) -> None:
        """Top-k positions of every row of ``plan`` into ``out [rows, index_topk]`` (int32, in
        no particular order, ``-1`` pads). ``q``: float, or e4m3 with fp8 keys (DeepSeek-V3.2's
        quantized queries, their per-(row, head) scale folded into ``weights``:
        :func:`mla.providers.formats.quantize_index_queries`)."""
        geo, spec = plan.geometry, self.spec
        rows = geo.num_rows
        check_tensor("index_q", q, shape=(rows, spec.num_heads, spec.head_dim), device=out.device)
        fp8_q = spec.is_fp8 and q.dtype == spec.key_dtype
        if q.dtype not in FLOAT_DTYPES and not fp8_q:
            raise InvalidInputError(
                "index_q",
                f"expected bf16, fp16 or fp32 (or e4m3 with fp8 index keys), got {dtype_name(q.dtype)}",
            )
        check_tensor("index_weights", weights, shape=(rows, spec.num_heads), device=out.device)
        self.check_cache(index_cache, out.device)
        check_tensor("out", out, shape=(rows, geo.topk), dtype=torch.int32, device=q.device)
        self.setup.provider.index_topk(
            IndexTopkCall(
                q=q,
                weights=weights.to(torch.float32),
                index_cache=index_cache,
                key_dtype=spec.key_dtype,
                block_table=plan.block_table,
                row_request=plan.row_request,
                row_keys=plan.row_keys,
                max_keys=geo.max_keys,
                softmax_scale=spec.scale,
                topk=geo.topk,
                indices=out,
            )
        )


class LightningIndexer(IndexerStrategy):
    """DeepSeek-V3.2's lightning indexer on the provider's ``indexer`` kernels: bf16/fp16/fp32
    or fp8 (per-token scale) index keys, ReLU-weighted head sum, top-k per row."""

    NAME: ClassVar[str] = "lightning-indexer"


INDEXER_STRATEGIES: tuple[type[IndexerStrategy], ...] = (LightningIndexer,)
"""The built-in indexer strategies in priority order."""
