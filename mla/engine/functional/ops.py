"""The functional API's custom ops: what :func:`mla.mla_decode`, :func:`mla.mla_prefill` and
:func:`mla.write_kv` record in a compiled graph.

Under ``torch.compile`` each functional call becomes one opaque op call whose eager body is the
functional call itself (checks, plan cache, run: the functional modules register the bodies), so
a compiled function around them has no graph break and the eager calls cost what they always
did. The traced code allocates the outputs the call would allocate (shapes from the inputs'
shapes) and passes them as mutated arguments.

The options that are not numbers (``provider``, ``strategy``, ``platform``, ``validate``,
``graph``) cross the op as one integer handle: :func:`options_handle` runs once while tracing
(its result is a constant of the graph; dynamo guards on the options it was given) and the op's
body reads them back with :func:`options`. Handles are never reused; the options they name are
held for the life of the process (a handful of tuples).

Op schemas::

    mla::functional_decode(Tensor q, Tensor kv_cache, Tensor block_table, Tensor seq_lens,
        Tensor? query_start_loc, float softmax_scale, int kv_lora_rank, Tensor? kv_scale,
        float? kv_scale_value, Tensor(a!) out, Tensor(b!)? lse, bool return_lse,
        int options) -> ()
    mla::functional_prefill(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q,
        Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, float softmax_scale,
        bool causal, Tensor(a!) out, Tensor(b!) lse, int options) -> ()
    mla::functional_write_kv(Tensor kv_c, Tensor k_pe, Tensor(a!) kv_cache,
        Tensor slot_mapping, Tensor? kv_scale, float? kv_scale_value, int options) -> ()

``kv_scale`` crosses as the tensor the caller gave (``kv_scale``) or the float
(``kv_scale_value``). Like :mod:`mla.engine.backend.ops`, the ops are registered with
``torch.library.Library.define``/``impl`` and ``register_fake``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Any

import torch

from mla.engine.backend.ops import register_void_fakes

UNTRACEABLE = "an argument is not of the kind the op takes; the eager call names it"
"""Why a compiled functional call leaves its arguments to the eager call (a graph break)."""

_OPTIONS: dict[tuple[Hashable, ...], int] = {}
_BY_HANDLE: list[tuple[Hashable, ...]] = []
_OPTIONS_LOCK = threading.Lock()


@torch.compiler.assume_constant_result  # type: ignore[untyped-decorator]
def options_handle(*options: Hashable) -> int:
    """The handle of ``options`` (the same tuple, the same handle); ``-1`` when one of them is
    unhashable (the call then is not traced: the eager call names the bad argument)."""
    try:
        found = _OPTIONS.get(options)
    except TypeError:
        return -1
    if found is None:
        with _OPTIONS_LOCK:
            found = _OPTIONS.setdefault(options, len(_BY_HANDLE))
            if found == len(_BY_HANDLE):
                _BY_HANDLE.append(options)
    return found


def options(handle: int) -> tuple[Any, ...]:
    """The options :func:`options_handle` gave ``handle`` for."""
    return _BY_HANDLE[handle]


def scale_arguments(kv_scale: object) -> tuple[torch.Tensor | None, float | None] | None:
    """``kv_scale`` as the ops take it (a tensor, or a float); ``None`` when it is neither a
    tensor, a real number nor ``None`` (not traced: the eager call names it)."""
    if kv_scale is None:
        return None, None
    if isinstance(kv_scale, torch.Tensor):
        return kv_scale, None
    if is_number(kv_scale):
        assert isinstance(kv_scale, int | float)
        return None, float(kv_scale)
    return None


def is_number(value: object) -> bool:
    """An int or float (not a bool): what a ``float`` argument of the ops takes."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def is_count(value: object) -> bool:
    """An int (not a bool) >= 0: a size the traced code can allocate with."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def is_flag(value: object) -> bool:
    return isinstance(value, bool)


def optional_tensors(*values: object) -> bool:
    return all(value is None or isinstance(value, torch.Tensor) for value in values)


def tensors(*values: object) -> bool:
    return all(isinstance(value, torch.Tensor) for value in values)


_LIB = torch.library.Library("mla", "FRAGMENT")  # type: ignore[no-untyped-call]
_LIB.define(  # type: ignore[no-untyped-call]
    "functional_decode(Tensor q, Tensor kv_cache, Tensor block_table, Tensor seq_lens, "
    "Tensor? query_start_loc, float softmax_scale, int kv_lora_rank, Tensor? kv_scale, "
    "float? kv_scale_value, Tensor(a!) out, Tensor(b!)? lse, bool return_lse, int options) -> ()"
)
_LIB.define(  # type: ignore[no-untyped-call]
    "functional_prefill(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
    "SymInt max_seqlen_q, SymInt max_seqlen_k, float softmax_scale, bool causal, Tensor(a!) out, "
    "Tensor(b!) lse, int options) -> ()"
)
_LIB.define(  # type: ignore[no-untyped-call]
    "functional_write_kv(Tensor kv_c, Tensor k_pe, Tensor(a!) kv_cache, Tensor slot_mapping, "
    "Tensor? kv_scale, float? kv_scale_value, int options) -> ()"
)


def implement(name: str, body: Callable[..., None]) -> None:
    """Register ``body`` (the functional call) as op ``name``'s implementation."""
    _LIB.impl(name, body, "CompositeExplicitAutograd")  # type: ignore[no-untyped-call]


register_void_fakes("functional_decode", "functional_prefill", "functional_write_kv")


decode = torch.ops.mla.functional_decode.default
"""``mla::functional_decode``: :func:`mla.mla_decode` into the given ``out`` (and ``lse``)."""
prefill = torch.ops.mla.functional_prefill.default
"""``mla::functional_prefill``: :func:`mla.mla_prefill` into the given ``out`` and ``lse``."""
write_kv = torch.ops.mla.functional_write_kv.default
"""``mla::functional_write_kv``: :func:`mla.write_kv`."""
