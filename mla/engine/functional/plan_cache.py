"""The functional API's plan caches: a small LRU per entry point, keyed by the call's shapes,
dtypes, device, scale, provider, strategy, platform and validate mode, of backends sized for the
call (the engine pair the call runs through), and :func:`checked_signature`, the doors' cache of
the checks of a call's signature (the same LRU)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
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
A = TypeVar("A")


class PlanCache(Generic[K, V]):
    """A bounded least-recently-used map from plan keys to plans."""

    def __init__(self, maxsize: int) -> None:
        self.maxsize = maxsize
        self._entries: OrderedDict[K, V] = OrderedDict()
        self.changes = 0
        """Counts every change of the map or of its order (a hit, a put, an eviction, a clear): a
        holder of a key and its value that finds the same count as when it last looked knows
        both are still there, in the order it left them (:meth:`touch`)."""

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: K) -> V | None:
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            self.changes += 1
        return entry

    def put(self, key: K, value: V) -> None:
        self._entries[key] = value
        self._entries.move_to_end(key)
        self.changes += 1
        while len(self._entries) > self.maxsize:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        self._entries.clear()
        self.changes += 1

    def holds(self, key: K, value: V) -> bool:
        """``key`` maps to ``value`` itself (the order is left as it is)."""
        return self._entries.get(key) is value

    def touch(self, key: K, value: V) -> bool:
        """Whether ``key`` still maps to ``value`` itself; if so, ``key`` becomes the most
        recently used, as a :meth:`get` would make it (no change counted when it already was)."""
        entries = self._entries
        if entries.get(key) is not value:
            return False
        if next(reversed(entries)) != key:
            entries.move_to_end(key)
            self.changes += 1
        return True


def checked_signature(
    calls: PlanCache[tuple[object, ...], V],
    signature: Callable[[A], tuple[object, ...]],
    check: Callable[[A], V],
    args: A,
) -> tuple[V, bool]:
    """``(record, cached)``: what ``check(args)`` derived from the checks of the call's
    signature, run once per signature (``signature(args)``: everything those checks depend on)
    and kept in ``calls``; ``cached`` says whether the checks were skipped (the caller then
    checks the values that may change between calls). A signature that cannot be made
    (``AttributeError``/``TypeError``: arguments of the wrong kind, unhashable options) runs
    the checks, which name the bad argument, and caches nothing; checks that raise cache
    nothing either."""
    try:
        key = signature(args)
        record = calls.get(key)
    except (AttributeError, TypeError):
        return check(args), False
    if record is not None:
        return record, True
    record = check(args)
    calls.put(key, record)
    return record, False


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


def pinned_buffer(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A pinned host tensor (what :class:`HostIndptrs` allocates; a test replaces it)."""
    return torch.empty(shape, dtype=dtype, pin_memory=True)


def new_event() -> torch.cuda.Event:
    """A CUDA event (what :class:`HostIndptrs` records; a test replaces it)."""
    return torch.cuda.Event()  # type: ignore[no-untyped-call]


class HostIndptrs:
    """The pinned host buffers one cached prefill plan copies its calls' ``cu_seqlens`` into
    (per indptr dtype, ``[2, B+1]``: row 0 ``cu_seqlens_q``, row 1 ``cu_seqlens_k``), and the
    event that marks the end of the last copy; made on a CUDA call's first copy.

    One set per plan is enough, and saves two pinned allocations and an event per call: the
    plan's calls run one at a time (each holds ``backend.in_use`` from the copy to its return),
    a call reads the copied values before it returns (its checks, and the plan's host tiling,
    which gets copies of its own: :class:`~mla.engine.functional.prefill_call.IndptrCopy`), and
    nothing on the device reads the buffers. A copy is on the current stream, after the
    previous call's copy when both are on one stream; so that a copy a call started and never
    waited for (the call raised in between) cannot land after the next call's copy from
    another stream, :meth:`rows` waits for such a copy first."""

    def __init__(self) -> None:
        self._pinned: dict[torch.dtype, torch.Tensor] = {}
        self._event: torch.cuda.Event | None = None
        self.pending = False
        """A copy was started and not waited for (:meth:`wait`)."""

    def rows(self, dtype: torch.dtype, entries: int) -> torch.Tensor:
        """The pinned ``[2, entries]`` buffer of ``dtype`` (allocated on first use), after any
        copy into the buffers that was started and not waited for."""
        if self.pending:
            self.wait()
        buffer = self._pinned.get(dtype)
        if buffer is None or buffer.shape[1] != entries:
            buffer = self._pinned[dtype] = pinned_buffer((2, entries), dtype)
        return buffer

    def record(self) -> None:
        """Mark the end of the copies just started on the current stream."""
        if self._event is None:
            self._event = new_event()
        self._event.record()
        self.pending = True

    def wait(self) -> None:
        """Wait for the last recorded copy."""
        if self._event is not None:
            self._event.synchronize()
        self.pending = False


@attrs.frozen(eq=False)
class PrefillEntry:
    """A cached prefill plan: a backend sized for the call's shapes and the pinned buffers of
    its calls' indptr copies."""

    backend: MLABackend
    host_indptrs: HostIndptrs = attrs.field(factory=HostIndptrs)


PREFILL_PLANS: PlanCache[tuple[object, ...], PrefillEntry] = PlanCache(PLAN_CACHE_SIZE)
"""Per prefill plan key: the cached plan."""


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
