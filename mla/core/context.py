"""Contexts: everything ``supports()`` may read for one phase of one step.

Frozen, hashable and tensor-free, so a resolution can be cached per context. Built by
:func:`decode_context` / :func:`prefill_context` (the one place a step's facts are normalized).
"""

from __future__ import annotations

import attrs
import torch

from mla.core.capabilities import ProviderCapabilities
from mla.core.config import EngineLimits, GraphMode, KVCacheSpec, MLADims, is_fp8
from mla.core.errors import input_validator
from mla.core.platform import Platform
from mla.core.support import Support

_AT_LEAST_ONE = input_validator(attrs.validators.ge(1), ">= 1")


@attrs.frozen
class DecodeContext:
    """One decode step (or the worst case of the engine limits) as seen by the resolver."""

    dims: MLADims
    q_dtype: torch.dtype
    """The model dtype of the decode query (bf16/fp16/fp32)."""
    kv_dtype: torch.dtype
    platform: Platform
    capabilities: ProviderCapabilities
    provider_availability: Support
    """Empty when the provider's library and device are usable here."""
    max_qlen: int = attrs.field(validator=_AT_LEAST_ONE)
    """The batch's largest decode query length ``q``."""
    uniform_qlen: bool
    """Every real request has qlen ``max_qlen`` (graph-padded requests excepted)."""
    max_decode_qlen: int = attrs.field(validator=_AT_LEAST_ONE)
    """The engine's largest decode qlen ``T`` (speculative tokens + 1); persistent buffers are
    sized for it."""
    graph_mode: GraphMode = GraphMode.NONE
    """How the engine captures decode steps; ``FULL`` rules out strategies that cannot be captured."""

    @property
    def num_heads(self) -> int:
        return self.dims.num_heads

    @property
    def kv_is_fp8(self) -> bool:
        return is_fp8(self.kv_dtype)

    @property
    def kernel_qlen(self) -> int:
        return self.capabilities.kernel_qlen(self.max_qlen, uniform=self.uniform_qlen)


@attrs.frozen
class PrefillContext:
    """One prefill step as seen by the resolver."""

    dims: MLADims
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    """The KV-cache dtype (decides the fp8-prefill preference in auto mode)."""
    platform: Platform
    capabilities: ProviderCapabilities
    provider_availability: Support
    has_chunked_context: bool
    """Some prefill request has cached context that is processed in chunks and merged."""

    @property
    def num_heads(self) -> int:
        return self.dims.num_heads

    @property
    def kv_is_fp8(self) -> bool:
        return is_fp8(self.kv_dtype)


def decode_context(
    *,
    dims: MLADims,
    cache: KVCacheSpec,
    q_dtype: torch.dtype,
    platform: Platform,
    capabilities: ProviderCapabilities,
    availability: Support,
    limits: EngineLimits,
    max_qlen: int,
    uniform_qlen: bool,
) -> DecodeContext:
    """Normalize one decode step's facts into a :class:`DecodeContext`."""
    return DecodeContext(
        dims=dims,
        q_dtype=q_dtype,
        kv_dtype=cache.dtype,
        platform=platform,
        capabilities=capabilities,
        provider_availability=availability,
        max_qlen=max_qlen,
        uniform_qlen=uniform_qlen or max_qlen == 1,
        max_decode_qlen=limits.max_decode_qlen,
        graph_mode=limits.graph_mode,
    )


def prefill_context(
    *,
    dims: MLADims,
    cache: KVCacheSpec,
    q_dtype: torch.dtype,
    platform: Platform,
    capabilities: ProviderCapabilities,
    availability: Support,
    has_chunked_context: bool,
) -> PrefillContext:
    """Normalize one prefill step's facts into a :class:`PrefillContext`."""
    return PrefillContext(
        dims=dims,
        q_dtype=q_dtype,
        kv_dtype=cache.dtype,
        platform=platform,
        capabilities=capabilities,
        provider_availability=availability,
        has_chunked_context=has_chunked_context,
    )
