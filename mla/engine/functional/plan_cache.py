"""The functional API's plan caches: a small LRU per entry point, keyed by the call's shapes,
dtypes, device, scale, provider, strategy, platform and validate mode, of backends sized for the
call (the engine pair the call runs through)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

import attrs
import torch

from mla.core.config import EngineLimits, KVCacheSpec, MLADims
from mla.core.platform import Platform, resolve_platform
from mla.engine.backend import MLABackend
from mla.engine.decision.registry import AnyStrategy
from mla.engine.decision.resolver import Resolver
from mla.engine.functional.decode_graphs import GRAPHS_PER_PLAN, GraphState
from mla.engine.functional.read_back import StepCounts
from mla.providers import require_available, resolve_provider
from mla.providers.base import KernelProvider
from mla.strategy import Phase

PLAN_CACHE_SIZE = 16
"""Cached plans per functional entry point (least recently used evicted first)."""

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class PlanCache(Generic[K, V]):
    """A bounded least-recently-used map from plan keys to plans."""

    def __init__(self, maxsize: int) -> None:
        self.maxsize = maxsize
        self._entries: OrderedDict[K, V] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: K) -> V | None:
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def put(self, key: K, value: V) -> None:
        self._entries[key] = value
        self._entries.move_to_end(key)
        while len(self._entries) > self.maxsize:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        self._entries.clear()


@attrs.frozen(eq=False)
class DecodeEntry:
    """A cached decode plan: a backend sized for the call's shapes and the CUDA graphs of its
    repeated calls (:mod:`mla.engine.functional.decode_graphs`)."""

    backend: MLABackend
    graphs: PlanCache[Hashable, GraphState] = attrs.field(factory=lambda: PlanCache(GRAPHS_PER_PLAN))
    """Per call key (tensors' data pointers and strides, host ``query_start_loc`` values,
    ``kv_scale`` tensor): seen once, captured, or eager-only; at most
    :data:`~mla.engine.functional.decode_graphs.GRAPHS_PER_PLAN`."""
    counts: StepCounts | None = None
    """``validate="checked"``: the fill's counts of each call, read after its launch (shared by
    the eager calls and the graphs of the plan)."""


DECODE_PLANS: PlanCache[tuple[object, ...], DecodeEntry] = PlanCache(PLAN_CACHE_SIZE)
"""Per decode plan key: the cached plan."""

PREFILL_PLANS: PlanCache[tuple[object, ...], MLABackend] = PlanCache(PLAN_CACHE_SIZE)
"""Per prefill plan key: a backend sized for the call's shapes."""


def available_provider(provider: str | KernelProvider, platform: Platform) -> KernelProvider:
    """The provider object for ``provider``; :class:`ProviderUnavailableError` (an
    :class:`UnsupportedError`) with its reasons when it cannot run here."""
    prov = resolve_provider(provider, platform)
    require_available(prov)
    return prov


def prefill_backend(
    q: torch.Tensor,
    v: torch.Tensor,
    num_requests: int,
    softmax_scale: float,
    provider: str | KernelProvider,
    strategy: str | AnyStrategy | None,
    platform: Platform | str | None,
) -> MLABackend:
    """A backend for a prefill of ``q``/``v``'s shapes (no preallocation: the first plan
    resolves, or checks the forced ``strategy``, and allocates); the latent dims it records are
    placeholders (a varlen prefill reads no cache), the head dims are q's and v's."""
    num_tokens, num_heads, qk_dim = q.shape
    plat = resolve_platform(platform, q.device)
    rope = min(64, qk_dim - 1) if qk_dim > 1 else 0
    forced = None if strategy is None else Resolver().forced_strategy(strategy, Phase.PREFILL)
    return MLABackend(
        MLADims(
            num_heads=num_heads,
            qk_nope_head_dim=max(1, qk_dim - rope),
            qk_rope_head_dim=max(1, rope),
            v_head_dim=v.shape[-1],
            softmax_scale=softmax_scale,
        ),
        KVCacheSpec(1, q.dtype),
        EngineLimits(max(1, num_requests), max(1, v.shape[0]), max(1, num_tokens)),
        model_dtype=q.dtype,
        provider=available_provider(provider, plat),
        platform=plat,
        device=q.device,
        prefill_strategy=forced,
        preallocate=False,
    )
