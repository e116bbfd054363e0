"""The functional prefill, :func:`mla_prefill`: one call, one step through a cached engine pair,
by the route of :func:`~mla.engine.functional.decode.mla_decode`: the door (the call's
arguments and its ``cu_seqlens`` values checked once), the plan cache (a backend sized for the
call's shapes), the builder (``plan_varlen``) and the strategy's ``run``. Under
``torch.compile`` the call is one op of :mod:`mla.engine.functional.ops` (no graph break).
"""

from __future__ import annotations

from typing import Literal, overload

import torch

from mla.core.platform import Platform
from mla.core.records import fast_constructor
from mla.core.validate import CallValidateMode
from mla.engine.backend.step import VarlenStep
from mla.engine.decision.registry import AnyStrategy
from mla.engine.functional import ops as functional_ops
from mla.engine.functional.args import PrefillArgs
from mla.engine.functional.plan_cache import PREFILL_PLANS, PrefillEntry, checked_signature, prefill_backend
from mla.engine.functional.prefill_call import (
    PREFILL_CALLS,
    IndptrCopy,
    check_indptr_values,
    check_outputs_apart,
    check_prefill_call,
    max_seqlens,
    prefill_signature,
)
from mla.providers.base import KernelProvider

__all__ = ["mla_prefill"]


@overload
def mla_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    softmax_scale: float,
    causal: bool = ...,
    provider: str | KernelProvider = ...,
    strategy: str | AnyStrategy | None = ...,
    platform: Platform | str | None = ...,
    out: torch.Tensor | None = ...,
    lse: torch.Tensor | None = ...,
    return_lse: Literal[True] = ...,
    validate: CallValidateMode = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...


@overload
def mla_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    softmax_scale: float,
    causal: bool = ...,
    provider: str | KernelProvider = ...,
    strategy: str | AnyStrategy | None = ...,
    platform: Platform | str | None = ...,
    out: torch.Tensor | None = ...,
    lse: torch.Tensor | None = ...,
    return_lse: Literal[False],
    validate: CallValidateMode = ...,
) -> torch.Tensor: ...


def mla_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    softmax_scale: float,
    causal: bool = True,
    provider: str | KernelProvider = "auto",
    strategy: str | AnyStrategy | None = None,
    platform: Platform | str | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    return_lse: bool = True,
    validate: CallValidateMode = "checked",
) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
    """Varlen MHA prefill (bottom-right causal), MLA-shaped: q/k ``[T, H, Dqk]``, v ``[Tk, H, Dv]``.

    ``cu_seqlens_q``/``cu_seqlens_k`` are int ``[B+1]`` indptrs ending at ``T`` and ``Tk``
    (every row belongs to a request); ``softmax_scale`` is required (a finite float > 0).
    Returns ``(out [T, H, Dv] in q's dtype, lse [T, H] float32 natural log)``, or ``out`` alone
    with ``return_lse=False``; ``out``/``lse`` may be given to be written in place.

    ``validate``: ``"checked"`` (default) copies the ``cu_seqlens`` to the host once per call
    (one small read, checked there and, for the fp8 prefill, tiled there); on the Triton and
    Gluon providers, whose kernels clamp each request's rows into the tensors, the copy is read
    after the launch, so it does not hold the kernel back (bad values still raise; the outputs
    of a call that raised are unspecified). ``"fast"`` trusts the values where the kernels clamp
    (no copy, no read: a bad indptr gives unspecified outputs, never a read or write outside
    the tensors); elsewhere it reads them before the launch as ``"checked"`` does (the kernels
    or the plan need them valid). ``"full"`` (debug) reads them before any kernel runs on every
    provider. Raises :class:`InvalidInputError` for bad input and :class:`UnsupportedError`
    when no strategy (or not the forced one: a class, ``NAME`` or class name) fits. Under
    ``torch.compile`` the call is one ``mla::functional_prefill`` op (no graph break): the
    outputs are allocated in the compiled code and the op runs this function.
    """
    args = PrefillArgs(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, provider,
        strategy, platform, out, lse, return_lse, validate,
    )  # fmt: skip
    if torch.compiler.is_compiling():
        return _traced_prefill(args)
    return _prefill(args)


def _prefill(args: PrefillArgs) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
    """The eager call: the door (:mod:`~mla.engine.functional.prefill_call`: the checks of the
    call's signature once, its values per call), the plan, the step. The ``cu_seqlens`` values
    are read in one device-to-host copy: before the launch, or, where the provider's kernels
    clamp each request's rows into the tensors and the plan does not read them
    (``ProviderCapabilities.varlen_clamps_indptrs``), after it on a CUDA device
    (``validate="checked"``: the copy's wait for the previous kernels overlaps this call's
    queued kernel; bad values raise either way) or not at all (``validate="fast"``)."""
    call, cached = checked_signature(PREFILL_CALLS, prefill_signature, check_prefill_call, args)
    max_seqlen_q, max_seqlen_k = max_seqlens(args)  # (checked before the outputs, as on a miss)
    if cached:
        check_outputs_apart(args)
    entry = PREFILL_PLANS.get(call.plan_key)
    if entry is None:
        q, v = args.q, args.v
        backend = prefill_backend(
            q, v, call.num_requests, call.softmax_scale, args.provider, args.strategy, args.platform
        )
        entry = PrefillEntry(backend)
        PREFILL_PLANS.put(call.plan_key, entry)
    q, k, v, out, lse = args.q, args.k, args.v, args.out, args.lse
    if out is None:
        out = torch.empty(call.out_shape, dtype=q.dtype, device=q.device)
    if lse is None:
        lse = torch.empty(call.lse_shape, dtype=torch.float32, device=q.device)
    cu_q, cu_k = args.cu_seqlens_q, args.cu_seqlens_k
    backend = entry.backend
    with backend.in_use:  # one call at a time per cached plan (and its pinned indptr buffers)
        clamps = (
            call.validate != "full"
            and backend.capabilities.varlen_clamps_indptrs
            and not backend.builder.varlen_strategy().PLAN_READS_HOST_INDPTRS
        )
        deferred = clamps and (call.validate == "fast" or q.device.type == "cuda")
        copy = None if clamps and call.validate == "fast" else IndptrCopy(cu_q, cu_k, entry.host_indptrs)
        host_q = host_k = None
        if not deferred:
            assert copy is not None
            check_indptr_values(args, *copy.values())
            host_q, host_k = copy.step_values()
        provider = backend.provider
        backend.builder.plan_varlen(
            _VARLEN_STEP(
                cu_seqlens_q_cpu=host_q,
                cu_seqlens_k_cpu=host_k,
                cu_seqlens_q=cu_q if cu_q.dtype == torch.int32 else cu_q.to(torch.int32),
                cu_seqlens_k=cu_k if cu_k.dtype == torch.int32 else cu_k.to(torch.int32),
                max_seqlen_q=max_seqlen_q,
                max_seqlen_k=max_seqlen_k,
                causal=call.causal,
                num_tokens=q.shape[0],
                num_kv_tokens=k.shape[0],
                launch_checked=call.checked_by is provider,
            )
        )
        strategy, plan = backend.current_prefill()
        strategy.run(plan, q, k, v, out=out, lse=lse)
        call.checked_by = provider  # (this signature's launch passed the provider's checks)
        if deferred and copy is not None:
            check_indptr_values(args, *copy.values())
    return (out, lse) if args.return_lse else out


_VARLEN_STEP = fast_constructor(VarlenStep)
"""The call's step record (:mod:`mla.core.records`: the door checked every value)."""


# -- under torch.compile: one op per call (see mla.engine.functional.decode) -----------------------

_eager_prefill = torch.compiler.disable(_prefill, reason=functional_ops.UNTRACEABLE)  # type: ignore[no-untyped-call]


def _traced_prefill(args: PrefillArgs) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
    """What a compiled :func:`mla_prefill` records: its outputs and ``mla::functional_prefill``."""
    q, v, out, lse = args.q, args.v, args.out, args.lse
    handle = -1
    if (
        functional_ops.tensors(q, args.k, v, args.cu_seqlens_q, args.cu_seqlens_k)
        and functional_ops.optional_tensors(out, lse)
        and functional_ops.is_count(args.max_seqlen_q)
        and functional_ops.is_count(args.max_seqlen_k)
        and functional_ops.is_number(args.softmax_scale)
        and functional_ops.is_flag(args.causal)
        and functional_ops.is_flag(args.return_lse)
        and q.dim() == 3
        and v.dim() == 3
    ):
        handle = functional_ops.options_handle(args.provider, args.strategy, args.platform, args.validate)
    if handle < 0:
        return _eager_prefill(args)  # type: ignore[no-any-return]
    num_tokens, num_heads = q.shape[0], q.shape[1]
    if out is None:
        out = torch.empty(num_tokens, num_heads, v.shape[-1], dtype=q.dtype, device=q.device)
    if lse is None:
        lse = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=q.device)
    functional_ops.prefill(
        q, args.k, v, args.cu_seqlens_q, args.cu_seqlens_k, args.max_seqlen_q, args.max_seqlen_k,
        float(args.softmax_scale), args.causal, out, lse, handle,
    )  # fmt: skip
    return (out, lse) if args.return_lse else out


def _prefill_body(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    out: torch.Tensor,
    lse: torch.Tensor,
    options: int,
) -> None:
    """The body of ``mla::functional_prefill`` (its schema's arguments): the eager call."""
    provider, strategy, platform, validate = functional_ops.options(options)
    _prefill(
        PrefillArgs(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
            provider, strategy, platform, out, lse, True, validate,
        )
    )  # fmt: skip


functional_ops.implement("functional_prefill", _prefill_body)
