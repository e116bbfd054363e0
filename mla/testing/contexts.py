"""Context and backend factories for tests, the CLI and the docs: a decode or prefill context on a
simulated platform under a provider's capability record, a backend sized for a case, and a
private registry.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from mla.core.capabilities import REFERENCE_CAPABILITIES, ProviderCapabilities
from mla.core.config import EngineLimits, KVCacheSpec, MLADims
from mla.core.context import DecodeContext, PrefillContext, decode_context, prefill_context
from mla.core.platform import Knobs, Platform, simulated_platform
from mla.core.support import Support
from mla.decode.base import DecodeStrategy
from mla.engine.backend import MLABackend
from mla.engine.decision.registry import DEFAULT_REGISTRY, AnyStrategy, Registry
from mla.engine.decision.resolver import Resolver
from mla.prefill.base import PrefillStrategy
from mla.providers import emulated_provider, resolve_provider
from mla.providers.base import KernelProvider
from mla.providers.torch_ref import TorchProvider
from mla.strategy import Phase
from mla.testing.cases import DecodeCase, PrefillCase, _PagedBatch

DECISION_SCALE = 192**-0.5
"""The softmax scale of the simulated contexts (DeepSeek-V3's, without YaRN): no rule reads it."""


def scratch_registry(
    extra: tuple[tuple[AnyStrategy, int], ...] | list[tuple[AnyStrategy, int]] = (),
    *,
    base: Registry = DEFAULT_REGISTRY,
) -> Registry:
    """A fresh registry holding ``base``'s registrations (as narrowed by an active override) plus
    ``extra`` ``(strategy, priority)`` pairs, so a test can register a strategy without touching
    the default registry."""
    registry = Registry()
    for phase in Phase:
        for reg in base.entries(phase):
            registry.register(reg.strategy, priority=reg.priority)
    for strategy, priority in extra:
        registry.register(strategy, priority=priority)
    return registry


def reference_provider_with(**changes: Any) -> TorchProvider:
    """The torch reference provider under its capability record with ``changes`` (fields of
    :class:`~mla.core.capabilities.ProviderCapabilities`), e.g. ``decode_reads_block_table=False``
    for the flat per-token path aiter's kernels take: the paths another provider's record
    selects, run on the CPU with the reference math."""
    return TorchProvider(capabilities=attrs.evolve(REFERENCE_CAPABILITIES, **changes))


def as_platform(platform: Platform | str, *, knobs: Knobs | None = None) -> Platform:
    """``platform`` itself, or the simulated platform of an arch name (``"cpu"``, ``"sm90"``,
    ``"gfx950"`` ...) with ``knobs`` (default: the defaults, not the environment's)."""
    if isinstance(platform, Platform):
        return platform
    return simulated_platform(platform, knobs=knobs)


def device_for(platform: Platform, device: torch.device | str | None = None) -> torch.device:
    """``device``, or CUDA for a GPU platform and the CPU otherwise."""
    if device is not None:
        return torch.device(device)
    return torch.device("cuda" if platform.is_gpu else "cpu")


def _default_provider(platform: Platform) -> str:
    return "aiter" if platform.arch.startswith("gfx") else "torch"


def simulated_capabilities(
    platform: Platform | str, provider: str | None = None, *, native_h24: bool = False
) -> ProviderCapabilities:
    """The capability record of ``provider`` (default: aiter on a gfx arch, else torch) on
    ``platform``; aiter's is its static record, needing no ROCm."""
    plat = as_platform(platform)
    name = provider or _default_provider(plat)
    return emulated_provider(name, plat, native_h24=native_h24).capabilities(plat)


def simulated_decode_context(
    platform: Platform | str = "cpu",
    *,
    heads: int = 8,
    qlen: int = 1,
    max_decode_qlen: int | None = None,
    kv_dtype: torch.dtype | str = "bf16",
    q_dtype: torch.dtype = torch.bfloat16,
    block_size: int = 16,
    uniform_qlen: bool = True,
    knobs: Knobs | None = None,
    provider: str | None = None,
    native_h24: bool = False,
    capabilities: ProviderCapabilities | None = None,
    availability: Support | None = None,
    limits: EngineLimits | None = None,
) -> DecodeContext:
    """One decode step's context as the backend would build it, with no tensors.

    ``platform`` is a :class:`Platform` or an arch to simulate (with ``knobs``);
    ``capabilities`` default to :func:`simulated_capabilities` of ``provider`` (aiter on a gfx
    arch, else torch; ``native_h24`` as :func:`~mla.testing.emulated_provider`) and
    ``availability`` to available. ``limits`` default to 64 sequences of
    up to 4096 tokens, 8192 batched, ``max_decode_qlen`` (default: ``qlen``).
    """
    plat = as_platform(platform, knobs=knobs)
    caps = (
        capabilities
        if capabilities is not None
        else simulated_capabilities(plat, provider, native_h24=native_h24)
    )
    return decode_context(
        dims=MLADims(heads, softmax_scale=DECISION_SCALE),
        cache=KVCacheSpec(block_size, kv_dtype),
        q_dtype=q_dtype,
        platform=plat,
        capabilities=caps,
        availability=Support.yes() if availability is None else availability,
        limits=limits
        if limits is not None
        else EngineLimits(64, 4096, 8192, max_decode_qlen=max_decode_qlen or qlen),
        max_qlen=qlen,
        uniform_qlen=uniform_qlen,
    )


def simulated_prefill_context(
    platform: Platform | str = "cpu",
    *,
    heads: int = 16,
    kv_dtype: torch.dtype | str = "bf16",
    q_dtype: torch.dtype = torch.bfloat16,
    block_size: int = 16,
    chunked_context: bool = False,
    knobs: Knobs | None = None,
    provider: str | None = None,
    capabilities: ProviderCapabilities | None = None,
    availability: Support | None = None,
) -> PrefillContext:
    """One prefill step's context as the backend would build it (defaults as
    :func:`simulated_decode_context`)."""
    plat = as_platform(platform, knobs=knobs)
    caps = capabilities if capabilities is not None else simulated_capabilities(plat, provider)
    return prefill_context(
        dims=MLADims(heads, softmax_scale=DECISION_SCALE),
        cache=KVCacheSpec(block_size, kv_dtype),
        q_dtype=q_dtype,
        platform=plat,
        capabilities=caps,
        availability=Support.yes() if availability is None else availability,
        has_chunked_context=chunked_context,
    )


def _decode_limits(case: _PagedBatch) -> EngineLimits:
    """The limits of a decode step of ``case``: ``max_num_seqs`` its requests (or more, to hold
    its rows), ``max_model_len`` its longest sequence, ``max_decode_qlen``
    ``case.max_decode_qlen`` or its max qlen."""
    max_decode_qlen = case.max_decode_qlen or case.max_qlen
    return EngineLimits(
        max_num_seqs=max(case.num_requests, -(-case.num_tokens // max_decode_qlen)),
        max_model_len=max(1, *case.seq_lens),
        max_num_batched_tokens=case.num_tokens,
        max_decode_qlen=max_decode_qlen,
    )


def _case_backend(
    dims: MLADims,
    cache: KVCacheSpec,
    limits: EngineLimits,
    *,
    model_dtype: torch.dtype,
    provider: str | KernelProvider,
    platform: Platform | str,
    registry: Registry | None,
    device: torch.device | str | None,
    preallocate: bool,
    **options: Any,
) -> MLABackend:
    """An :class:`~mla.engine.backend.MLABackend` of a case's records on ``platform`` (a
    platform or an arch to simulate) with ``provider`` and a resolver over ``registry``
    (default: the default registry); ``options`` (the forced strategies, the context
    workspace, the indexer) go to the backend as they are."""
    plat = as_platform(platform)
    return MLABackend(
        dims,
        cache,
        limits,
        model_dtype=model_dtype,
        provider=resolve_provider(provider, plat),
        platform=plat,
        device=device_for(plat, device),
        resolver=Resolver(registry or DEFAULT_REGISTRY),
        preallocate=preallocate,
        **options,
    )


def decode_case_backend(
    case: DecodeCase,
    *,
    provider: str | KernelProvider,
    platform: Platform | str,
    strategy: str | type[DecodeStrategy] | None = None,
    registry: Registry | None = None,
    device: torch.device | str | None = None,
    num_blocks: int | None = None,
    preallocate: bool = False,
) -> MLABackend:
    """A backend sized for ``case``: ``max_num_seqs`` its requests (or more, to hold its rows),
    ``max_model_len`` its longest sequence, ``max_decode_qlen`` ``case.max_decode_qlen`` or its
    max qlen. ``strategy`` forces one (through the resolver's checks); ``registry`` is what the
    resolver reads (default: the default registry); ``num_blocks`` enables block-id checks."""
    return _case_backend(
        case._dims(),
        KVCacheSpec(case.block_size, case.kv_dtype, num_blocks=num_blocks),
        _decode_limits(case),
        model_dtype=case.q_dtype,
        provider=provider,
        platform=platform,
        registry=registry,
        device=device,
        preallocate=preallocate,
        decode_strategy=strategy,
    )


def prefill_case_backend(
    case: PrefillCase,
    *,
    provider: str | KernelProvider,
    platform: Platform | str,
    strategy: str | type[PrefillStrategy] | None = None,
    registry: Registry | None = None,
    device: torch.device | str | None = None,
    num_blocks: int | None = None,
    preallocate: bool = False,
) -> MLABackend:
    """A backend sized for ``case``'s prefill step (context + new tokens per request), with its
    context workspace (``case.context_chunk_tokens``); the other arguments as
    :func:`decode_case_backend`."""
    seq_lens = [c + n for c, n in zip(case.contexts, case.q_lens, strict=True)]
    return _case_backend(
        case.dims,
        KVCacheSpec(case.block_size, case.cache_dtype, num_blocks=num_blocks),
        EngineLimits(
            max_num_seqs=len(case.q_lens),
            max_model_len=max(seq_lens),
            max_num_batched_tokens=sum(case.q_lens),
        ),
        model_dtype=case.dtype,
        provider=provider,
        platform=platform,
        registry=registry,
        device=device,
        preallocate=preallocate,
        prefill_strategy=strategy,
        context_chunk_tokens=case.context_chunk_tokens,
    )
