"""The engine boundary: torch custom ops ``mla::decode``, ``mla::prefill``, ``mla::write_kv`` and the
sparse ops ``mla::sparse_attention``, ``mla::index_topk`` and ``mla::write_index_keys``.

An engine compiles its model with ``torch.compile(fullgraph=True)``; attention is one opaque op
per call in the graph, as vLLM's ``unified_mla_attention_with_output`` is, so the engine can split
piecewise CUDA graphs there or capture the whole compiled step.

Plans never cross the op boundary. Each :class:`~mla.engine.backend.MLABackend` registers itself here
under an integer handle; ``MetadataBuilder.build`` records the step's metadata as the backend's
*current* metadata, and the ops take ``backend_id`` and run the current plan (the pattern of
vLLM's forward context). So the compiled graph holds only tensors and ints: it is the same graph
for every step (no guards on metadata objects, no recompiles), and a CUDA graph of the compiled
step replays with whatever plan was rebuilt in place since.

``kv_scale`` crosses as a float32 one-element tensor (or ``None``), read by the kernels on the
device, so a replayed graph uses the current scale.

Op schemas::

    mla::decode(Tensor q, Tensor kv_cache, Tensor(a!) out, Tensor(b!)? lse, Tensor? kv_scale,
                int backend_id) -> ()
    mla::prefill(Tensor q, Tensor k, Tensor v, Tensor(a!) out, Tensor(b!) lse, Tensor? kv_cache,
                 Tensor? kv_scale, int backend_id, int expander_id) -> ()
    mla::write_kv(Tensor kv_c, Tensor k_pe, Tensor(a!) kv_cache, Tensor slot_mapping,
                  Tensor? kv_scale, int provider_id) -> ()
    mla::sparse_attention(Tensor q, Tensor kv_cache, Tensor topk_indices, Tensor(a!) out,
                          Tensor(b!)? lse, Tensor? kv_scale, int backend_id, bool prefill) -> ()
    mla::index_topk(Tensor q, Tensor weights, Tensor index_cache, Tensor(a!) out,
                    int backend_id) -> ()
    mla::write_index_keys(Tensor keys, Tensor(a!) index_cache, Tensor slot_mapping,
                          int backend_id) -> ()

The ops are registered with ``torch.library.Library.define``/``impl`` and
``torch.library.register_fake`` rather than ``torch.library.custom_op``: the latter's Python
dispatch wrapper costs about 20 µs per call more (measured on this project's CI host), which is
the whole overhead budget of a decode step. vLLM registers its attention ops the same way for
the same reason (``direct_register_custom_op``).
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

import attrs
import torch

from mla.core.errors import InvalidInputError
from mla.decode.base import DecodePlan, DecodeStrategy
from mla.prefill.base import ContextExpander, PrefillPlan, PrefillStrategy
from mla.providers.base import KernelProvider
from mla.providers.calls import WriteKVCall
from mla.sparse.base import SparsePlan, SparseStrategy


class OpRunner(Protocol):
    """What the ops call: an owner of the current plan (an ``MLABackend``). Each ``checked_*``
    returns the current plan of its phase and the strategy that runs it, with the op's inputs
    checked against the plan; the op's body then calls the strategy's ``run``."""

    def checked_decode(
        self, q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None
    ) -> tuple[DecodeStrategy, DecodePlan]: ...

    def checked_prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        kv_cache: torch.Tensor | None,
        has_kv_scale: bool,
        expand_context: ContextExpander | None,
    ) -> tuple[PrefillStrategy, PrefillPlan]: ...

    def checked_sparse(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        topk_indices: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor | None,
        prefill: bool,
    ) -> tuple[SparseStrategy[Any], SparsePlan]: ...

    def run_index_topk(
        self, q: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor, out: torch.Tensor
    ) -> None: ...

    def run_write_index_keys(
        self, keys: torch.Tensor, index_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None: ...


T = TypeVar("T")


class _Handles(Generic[T]):
    """Integer handles for live objects (weakly held: a handle dies with its object)."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._objects: weakref.WeakValueDictionary[int, T] = weakref.WeakValueDictionary()
        self._ids: weakref.WeakKeyDictionary[T, int] = weakref.WeakKeyDictionary()
        self._next = itertools.count(1)

    def handle(self, obj: T) -> int:
        found = self._ids.get(obj)
        if found is None:
            found = next(self._next)
            self._ids[obj] = found
            self._objects[found] = obj
        return found

    def get(self, handle: int) -> T:
        obj = self._objects.get(handle)
        if obj is None:
            raise InvalidInputError(
                f"{self.what}_id",
                f"no live {self.what} has handle {handle}; it was garbage-collected or never "
                "registered (keep the object alive while compiled code uses it)",
            )
        return obj


_RUNNERS: _Handles[OpRunner] = _Handles("backend")
_PROVIDERS: _Handles[KernelProvider] = _Handles("provider")


def register_runner(runner: OpRunner) -> int:
    """The handle the ops use for ``runner`` (an ``MLABackend``; one per backend, weakly held)."""
    return _RUNNERS.handle(runner)


def provider_handle(provider: KernelProvider) -> int:
    """The handle ``mla::write_kv`` uses for ``provider`` (weakly held)."""
    return _PROVIDERS.handle(provider)


# -- context expanders ---------------------------------------------------------------------------

_EXPANDERS: dict[int, Callable[[], ContextExpander | None]] = {}
_EXPANDER_IDS = itertools.count(1)


@attrs.frozen
class ContextExpanderHandle:
    """A registered ``expand_context`` callback, passable through ``mla::prefill`` as an int.

    Register once (e.g. at layer init) with :func:`register_context_expander` and pass the
    handle as ``expand_context`` where the layer is compiled: a Python callable cannot be an op
    argument. Eager calls may pass the callable itself. Calling the handle calls the callback.
    """

    id: int

    def __call__(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return lookup_expander(self.id)(latent)

    def release(self) -> None:
        """Forget the callback (later calls through this handle raise)."""
        _EXPANDERS.pop(self.id, None)


def register_context_expander(fn: ContextExpander) -> ContextExpanderHandle:
    """Register ``fn`` for ``mla::prefill``. A bound method is held weakly (it dies with its
    object, e.g. the layer that owns it); any other callable is held until ``release()``."""
    bound = hasattr(fn, "__self__") and hasattr(fn, "__func__")
    ref: Callable[[], ContextExpander | None] = weakref.WeakMethod(fn) if bound else _StrongRef(fn)
    handle = next(_EXPANDER_IDS)
    _EXPANDERS[handle] = ref
    return ContextExpanderHandle(handle)


@attrs.frozen
class _StrongRef:
    fn: ContextExpander

    def __call__(self) -> ContextExpander:
        return self.fn


def lookup_expander(handle: int) -> ContextExpander:
    ref = _EXPANDERS.get(handle)
    fn = None if ref is None else ref()
    if fn is None:
        raise InvalidInputError(
            "expand_context",
            f"context expander {handle} is not registered (released, or its object was "
            "garbage-collected); register it with mla.register_context_expander",
        )
    return fn


# -- the ops ------------------------------------------------------------------------------------

_LIB = torch.library.Library("mla", "DEF")  # type: ignore[no-untyped-call]
_LIB.define(  # type: ignore[no-untyped-call]
    "decode(Tensor q, Tensor kv_cache, Tensor(a!) out, Tensor(b!)? lse, Tensor? kv_scale, "
    "int backend_id) -> ()"
)
_LIB.define(  # type: ignore[no-untyped-call]
    "prefill(Tensor q, Tensor k, Tensor v, Tensor(a!) out, Tensor(b!) lse, Tensor? kv_cache, "
    "Tensor? kv_scale, int backend_id, int expander_id) -> ()"
)
_LIB.define(  # type: ignore[no-untyped-call]
    "write_kv(Tensor kv_c, Tensor k_pe, Tensor(a!) kv_cache, Tensor slot_mapping, Tensor? kv_scale, "
    "int provider_id) -> ()"
)


def decode_body(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    kv_scale: torch.Tensor | None,
    backend_id: int,
) -> None:
    """The body of ``mla::decode`` (the functional API calls it directly): the backend's
    current decode plan, its inputs checked against the plan once, run by its strategy."""
    strategy, plan = _RUNNERS.get(backend_id).checked_decode(q, kv_cache, out, lse)
    strategy.run(plan, q, kv_cache, kv_scale=kv_scale, out=out, lse=lse)


def prefill_body(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    kv_cache: torch.Tensor | None,
    kv_scale: torch.Tensor | None,
    backend_id: int,
    expander_id: int,
) -> None:
    """The body of ``mla::prefill`` (the functional API calls it directly): the backend's
    current prefill plan, its inputs checked against the plan once, run by its strategy."""
    expander = lookup_expander(expander_id) if expander_id else None
    runner = _RUNNERS.get(backend_id)
    strategy, plan = runner.checked_prefill(q, k, v, out, lse, kv_cache, kv_scale is not None, expander)
    strategy.run(
        plan, q, k, v, out=out, lse=lse, kv_cache=kv_cache, kv_scale=kv_scale, expand_context=expander
    )


def _write_kv_impl(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: torch.Tensor | None,
    provider_id: int,
) -> None:
    if slot_mapping.numel() == 0:  # no new token: nothing to write (valid, not an error)
        return
    call = WriteKVCall(kv_c=kv_c, k_pe=k_pe, kv_cache=kv_cache, slot_mapping=slot_mapping, kv_scale=kv_scale)
    _PROVIDERS.get(provider_id).write_kv(call)


_LIB.define(  # type: ignore[no-untyped-call]
    "sparse_attention(Tensor q, Tensor kv_cache, Tensor topk_indices, Tensor(a!) out, Tensor(b!)? lse, "
    "Tensor? kv_scale, int backend_id, bool prefill) -> ()"
)
_LIB.define(  # type: ignore[no-untyped-call]
    "index_topk(Tensor q, Tensor weights, Tensor index_cache, Tensor(a!) out, int backend_id) -> ()"
)
_LIB.define(  # type: ignore[no-untyped-call]
    "write_index_keys(Tensor keys, Tensor(a!) index_cache, Tensor slot_mapping, int backend_id) -> ()"
)


def _sparse_attention_impl(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    topk_indices: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    kv_scale: torch.Tensor | None,
    backend_id: int,
    prefill: bool,
) -> None:
    strategy, plan = _RUNNERS.get(backend_id).checked_sparse(q, kv_cache, topk_indices, out, lse, prefill)
    strategy.run(plan, q, kv_cache, topk_indices, kv_scale=kv_scale, out=out, lse=lse)


def _index_topk_impl(
    q: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor, out: torch.Tensor, backend_id: int
) -> None:
    _RUNNERS.get(backend_id).run_index_topk(q, weights, index_cache, out)


def _write_index_keys_impl(
    keys: torch.Tensor, index_cache: torch.Tensor, slot_mapping: torch.Tensor, backend_id: int
) -> None:
    _RUNNERS.get(backend_id).run_write_index_keys(keys, index_cache, slot_mapping)


_LIB.impl("decode", decode_body, "CompositeExplicitAutograd")  # type: ignore[no-untyped-call]
_LIB.impl("prefill", prefill_body, "CompositeExplicitAutograd")  # type: ignore[no-untyped-call]
_LIB.impl("write_kv", _write_kv_impl, "CompositeExplicitAutograd")  # type: ignore[no-untyped-call]
for _name, _impl in (
    ("sparse_attention", _sparse_attention_impl),
    ("index_topk", _index_topk_impl),
    ("write_index_keys", _write_index_keys_impl),
):
    _LIB.impl(_name, _impl, "CompositeExplicitAutograd")  # type: ignore[no-untyped-call]


def register_void_fakes(*names: str) -> None:
    """Register the fake (meta) implementation of ops ``mla::<name>`` that return nothing and only
    write their mutable ``Tensor(a!)`` arguments, as every op of this package does: under
    ``torch.compile`` there is nothing to compute or allocate for them."""

    def fake(*_args: object, **_kwargs: object) -> None:
        return None

    for name in names:
        torch.library.register_fake(f"mla::{name}")(fake)


register_void_fakes("decode", "prefill", "write_kv", "sparse_attention", "index_topk", "write_index_keys")


decode = torch.ops.mla.decode.default
"""``mla::decode``: run the backend's current decode plan, writing ``out`` (and ``lse``)."""
prefill = torch.ops.mla.prefill.default
"""``mla::prefill``: run the backend's current prefill plan, writing ``out`` and ``lse``."""
write_kv = torch.ops.mla.write_kv.default
"""``mla::write_kv``: write ``[kv_c | k_pe]`` rows into the paged cache with the provider."""
sparse_attention = torch.ops.mla.sparse_attention.default
"""``mla::sparse_attention``: run the current sparse decode (``prefill=False``) or prefill plan
over a layer's top-k positions."""
index_topk = torch.ops.mla.index_topk.default
"""``mla::index_topk``: the backend's indexer over the current step's rows, into ``out``."""
write_index_keys = torch.ops.mla.write_index_keys.default
"""``mla::write_index_keys``: write (and for fp8, quantize) index keys into the index-key cache."""
