"""The functional prefill, :func:`mla_prefill`: one call, one step through a cached engine pair,
by the route of :func:`~mla.engine.functional.decode.mla_decode`: the door (the call's
arguments and its ``cu_seqlens`` values checked once), the plan cache (a backend sized for the
call's shapes), the builder (``plan_varlen``) and the strategy's ``run``. Under
``torch.compile`` the call is one op of :mod:`mla.engine.functional.ops` (no graph break).
"""

from __future__ import annotations

from typing import Literal, overload

import attrs
import torch

from mla.core.errors import InvalidInputError
from mla.core.platform import Platform
from mla.core.step_rules import require_indptr_of_rows
from mla.core.validate import (
    CallValidateMode,
    require_bool,
    require_call_validate_mode,
    require_float,
    require_index,
    require_int,
    require_no_overlap,
    require_same_device,
    require_softmax_scale,
    require_tensor,
)
from mla.engine.backend.step import VarlenStep
from mla.engine.decision.registry import AnyStrategy
from mla.engine.functional import ops as functional_ops
from mla.engine.functional.args import PrefillArgs
from mla.engine.functional.decode_call import require_output
from mla.engine.functional.plan_cache import PREFILL_PLANS, prefill_backend
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
    """The eager call: the door, the plan, the step. The ``cu_seqlens`` values are read in one
    device-to-host copy: before the launch, or, where the provider's kernels clamp each
    request's rows into the tensors and the plan does not read them
    (``ProviderCapabilities.varlen_clamps_indptrs``), after it on a CUDA device
    (``validate="checked"``: the copy's wait for the previous kernels overlaps this call's
    queued kernel; bad values raise either way) or not at all (``validate="fast"``)."""
    shape = check_prefill_arguments(args)
    q, k, v = args.q, args.k, args.v
    key = (
        tuple(q.shape), tuple(k.shape), tuple(v.shape), q.dtype, q.device, shape.num_requests,
        shape.softmax_scale, args.provider, args.strategy, args.platform,
    )  # fmt: skip
    backend = PREFILL_PLANS.get(key)
    if backend is None:
        backend = prefill_backend(
            q, v, shape.num_requests, shape.softmax_scale, args.provider, args.strategy, args.platform
        )
        PREFILL_PLANS.put(key, backend)
    out, lse = args.out, args.lse
    if out is None:
        out = torch.empty(q.shape[0], q.shape[1], v.shape[-1], dtype=q.dtype, device=q.device)
    if lse is None:
        lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device)
    cu_q, cu_k = args.cu_seqlens_q, args.cu_seqlens_k
    with backend.in_use:  # one call at a time per cached plan
        clamps = (
            shape.validate != "full"
            and backend.capabilities.varlen_clamps_indptrs
            and not backend.builder.varlen_strategy().PLAN_READS_HOST_INDPTRS
        )
        deferred = clamps and (shape.validate == "fast" or q.device.type == "cuda")
        copy = None if clamps and shape.validate == "fast" else _IndptrCopy(cu_q, cu_k)
        host_q = host_k = None
        if not deferred:
            assert copy is not None
            host_q, host_k = copy.values()
            check_indptr_values(args, host_q, host_k)
            host_q, host_k = host_q.to(torch.int32), host_k.to(torch.int32)  # (the step's dtype)
        step = VarlenStep(
            cu_seqlens_q_cpu=host_q,
            cu_seqlens_k_cpu=host_k,
            cu_seqlens_q=cu_q if cu_q.dtype == torch.int32 else cu_q.to(torch.int32),
            cu_seqlens_k=cu_k if cu_k.dtype == torch.int32 else cu_k.to(torch.int32),
            max_seqlen_q=shape.max_seqlen_q,
            max_seqlen_k=shape.max_seqlen_k,
            causal=shape.causal,
            num_tokens=q.shape[0],
            num_kv_tokens=k.shape[0],
        )
        backend.builder.plan_varlen(step)
        strategy, plan = backend.current_prefill()
        strategy.run(plan, q, k, v, out=out, lse=lse)
        if deferred and copy is not None:
            check_indptr_values(args, *copy.values())
    return (out, lse) if args.return_lse else out


@attrs.frozen
class PrefillShape:
    """What :func:`check_prefill_arguments` derived from the arguments."""

    num_requests: int
    softmax_scale: float
    max_seqlen_q: int
    max_seqlen_k: int
    causal: bool
    validate: CallValidateMode


def check_prefill_arguments(args: PrefillArgs) -> PrefillShape:
    """Every check of :func:`mla.mla_prefill`'s arguments that reads no device value
    (:class:`InvalidInputError` naming the argument); the ``cu_seqlens`` values are
    :func:`check_indptr_values`'s."""
    for name in ("q", "k", "v"):
        tensor = require_tensor(name, getattr(args, name), ndim=3)
        require_float(name, tensor)
    q, k, v = args.q, args.k, args.v
    cu_seqlens_q = require_index("cu_seqlens_q", args.cu_seqlens_q, ndim=1)
    cu_seqlens_k = require_index("cu_seqlens_k", args.cu_seqlens_k, ndim=1)
    require_same_device(
        ("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)
    )
    softmax_scale = require_softmax_scale(args.softmax_scale)
    max_seqlen_q = require_int("max_seqlen_q", args.max_seqlen_q, minimum=0)
    max_seqlen_k = require_int("max_seqlen_k", args.max_seqlen_k, minimum=0)
    causal = require_bool("causal", args.causal)
    require_bool("return_lse", args.return_lse)
    validate = require_call_validate_mode(args.validate)
    num_tokens, num_heads, qk_dim = q.shape
    if k.shape[1:] != (num_heads, qk_dim):
        raise InvalidInputError("k", f"expected [Tk, {num_heads}, {qk_dim}] to match q, got {tuple(k.shape)}")
    if v.shape[0] != k.shape[0] or v.shape[1] != num_heads:
        raise InvalidInputError(
            "v", f"expected [{k.shape[0]}, {num_heads}, Dv] to match k, got {tuple(v.shape)}"
        )
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise InvalidInputError("k", f"q, k and v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if cu_seqlens_q.numel() == 0:
        raise InvalidInputError("cu_seqlens_q", "is empty: an indptr has B+1 entries, starting with 0")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise InvalidInputError(
            "cu_seqlens_k", f"has {cu_seqlens_k.numel()} entries, cu_seqlens_q {cu_seqlens_q.numel()}"
        )
    out, lse = args.out, args.lse
    if out is not None:
        require_output("out", out, (num_tokens, num_heads, v.shape[-1]), q.dtype, q.device)
    if lse is not None:
        require_output("lse", lse, (num_tokens, num_heads), torch.float32, q.device)
    inputs = (("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k))
    require_no_overlap("out", out, *inputs, ("lse", lse))
    require_no_overlap("lse", lse, *inputs)
    return PrefillShape(
        num_requests=cu_seqlens_q.numel() - 1,
        softmax_scale=softmax_scale,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        causal=causal,
        validate=validate,
    )


def check_indptr_values(args: PrefillArgs, cu_q_cpu: torch.Tensor, cu_k_cpu: torch.Tensor) -> None:
    """The ``cu_seqlens`` values (host copies): indptrs over q's and k's rows, their longest
    request within ``max_seqlen_q``/``max_seqlen_k``."""
    lens_q = require_indptr_of_rows("cu_seqlens_q", cu_q_cpu.tolist(), args.q.shape[0], "q")
    lens_k = require_indptr_of_rows("cu_seqlens_k", cu_k_cpu.tolist(), args.k.shape[0], "k")
    if lens_q and max(lens_q) > args.max_seqlen_q:
        raise InvalidInputError("max_seqlen_q", f"{args.max_seqlen_q} < longest query {max(lens_q)}")
    if lens_k and max(lens_k) > args.max_seqlen_k:
        raise InvalidInputError("max_seqlen_k", f"{args.max_seqlen_k} < longest key range {max(lens_k)}")


class _IndptrCopy:
    """Both indptrs on the host, started when made: on a CUDA device an asynchronous copy into
    pinned memory on the current stream (so it can be started before the launch and waited for
    after it); elsewhere a plain copy (none for host tensors). A tensor passed as both indptrs
    is copied once. :meth:`values` waits for the copy."""

    def __init__(self, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor) -> None:
        self.done: torch.cuda.Event | None = None
        if cu_seqlens_q.device.type != "cuda":
            self.host_q = cu_seqlens_q.cpu()
            self.host_k = self.host_q if cu_seqlens_k is cu_seqlens_q else cu_seqlens_k.cpu()
            return
        self.host_q = self._start(cu_seqlens_q)
        self.host_k = self.host_q if cu_seqlens_k is cu_seqlens_q else self._start(cu_seqlens_k)
        self.done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        self.done.record()

    @staticmethod
    def _start(indptr: torch.Tensor) -> torch.Tensor:
        host = torch.empty(indptr.shape, dtype=indptr.dtype, pin_memory=True)
        host.copy_(indptr, non_blocking=True)
        return host

    def values(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.done is not None:
            self.done.synchronize()
        return self.host_q, self.host_k


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
