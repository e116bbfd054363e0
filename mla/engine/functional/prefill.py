"""The functional prefill, :func:`mla_prefill`: one call, one step through a cached engine pair,
by the route of :func:`~mla.engine.functional.decode.mla_decode`: the door (the call's
arguments and its ``cu_seqlens`` values checked once), the plan cache (a backend sized for the
call's shapes), the builder (``plan_varlen``) and the strategy's ``run``. Under
``torch.compile`` the call is one op of :mod:`mla.engine.functional.ops` (no graph break).
"""

from __future__ import annotations

from typing import Literal, overload

import torch

from mla.core.errors import InvalidInputError
from mla.core.platform import Platform
from mla.core.step_rules import require_indptr_of_rows
from mla.core.validate import (
    require_bool,
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
) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
    """Varlen MHA prefill (bottom-right causal), MLA-shaped: q/k ``[T, H, Dqk]``, v ``[Tk, H, Dv]``.

    ``cu_seqlens_q``/``cu_seqlens_k`` are int ``[B+1]`` indptrs ending at ``T`` and ``Tk``
    (every row belongs to a request); ``softmax_scale`` is required (a finite float > 0).
    Returns ``(out [T, H, Dv] in q's dtype, lse [T, H] float32 natural log)``, or ``out`` alone
    with ``return_lse=False``; ``out``/``lse`` may be given to be written in place. The
    ``cu_seqlens`` are copied to the host once per call (checked there and, for the fp8
    prefill, tiled there). Raises :class:`InvalidInputError` for bad input and
    :class:`UnsupportedError` when no strategy (or not the forced one: a class, ``NAME`` or
    class name) fits. Under ``torch.compile`` the call is one ``mla::functional_prefill`` op
    (no graph break): the outputs are allocated in the compiled code and the op runs this
    function.
    """
    args = PrefillArgs(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, provider,
        strategy, platform, out, lse, return_lse,
    )  # fmt: skip
    if torch.compiler.is_compiling():
        return _traced_prefill(args)
    return _prefill(args)


def _prefill(args: PrefillArgs) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
    """The eager call: the door, the plan, the step."""
    step, softmax_scale = check_prefill_call(args)
    q, v = args.q, args.v
    num_tokens, num_heads = q.shape[0], q.shape[1]
    num_requests = step.cu_seqlens_q_cpu.numel() - 1
    key = (
        tuple(q.shape), tuple(args.k.shape), tuple(v.shape), q.dtype, q.device, num_requests,
        softmax_scale, args.provider, args.strategy, args.platform,
    )  # fmt: skip
    backend = PREFILL_PLANS.get(key)
    if backend is None:
        backend = prefill_backend(
            q, v, num_requests, softmax_scale, args.provider, args.strategy, args.platform
        )
        PREFILL_PLANS.put(key, backend)
    out, lse = args.out, args.lse
    if out is None:
        out = torch.empty(num_tokens, num_heads, v.shape[-1], dtype=q.dtype, device=q.device)
    if lse is None:
        lse = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=q.device)
    with backend.in_use:  # one call at a time per cached plan
        backend.builder.plan_varlen(step)
        strategy, plan = backend.current_prefill()
        strategy.run(plan, q, args.k, v, out=out, lse=lse)
    return (out, lse) if args.return_lse else out


def check_prefill_call(args: PrefillArgs) -> tuple[VarlenStep, float]:
    """Every check of :func:`mla.mla_prefill`'s arguments (:class:`InvalidInputError` naming the
    argument), the ``cu_seqlens`` values on the host (one copy of each per call); returns the
    checked step and the softmax scale."""
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
    num_tokens, num_heads, qk_dim = q.shape
    if k.shape[1:] != (num_heads, qk_dim):
        raise InvalidInputError("k", f"expected [Tk, {num_heads}, {qk_dim}] to match q, got {tuple(k.shape)}")
    if v.shape[0] != k.shape[0] or v.shape[1] != num_heads:
        raise InvalidInputError(
            "v", f"expected [{k.shape[0]}, {num_heads}, Dv] to match k, got {tuple(v.shape)}"
        )
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise InvalidInputError("k", f"q, k and v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    out, lse = args.out, args.lse
    if out is not None:
        require_output("out", out, (num_tokens, num_heads, v.shape[-1]), q.dtype, q.device)
    if lse is not None:
        require_output("lse", lse, (num_tokens, num_heads), torch.float32, q.device)
    inputs = (("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k))
    require_no_overlap("out", out, *inputs, ("lse", lse))
    require_no_overlap("lse", lse, *inputs)
    cu_q_cpu, cu_k_cpu = _host_indptrs(cu_seqlens_q, cu_seqlens_k)
    lens_q = require_indptr_of_rows("cu_seqlens_q", cu_q_cpu.tolist(), num_tokens, "q")
    lens_k = require_indptr_of_rows("cu_seqlens_k", cu_k_cpu.tolist(), k.shape[0], "k")
    if cu_q_cpu.numel() != cu_k_cpu.numel():
        raise InvalidInputError(
            "cu_seqlens_k", f"has {cu_k_cpu.numel()} entries, cu_seqlens_q {cu_q_cpu.numel()}"
        )
    if lens_q and max(lens_q) > max_seqlen_q:
        raise InvalidInputError("max_seqlen_q", f"{max_seqlen_q} < longest query {max(lens_q)}")
    if lens_k and max(lens_k) > max_seqlen_k:
        raise InvalidInputError("max_seqlen_k", f"{max_seqlen_k} < longest key range {max(lens_k)}")
    step = VarlenStep(
        cu_seqlens_q_cpu=cu_q_cpu.to(torch.int32),
        cu_seqlens_k_cpu=cu_k_cpu.to(torch.int32),
        cu_seqlens_q=cu_seqlens_q.to(torch.int32),
        cu_seqlens_k=cu_seqlens_k.to(torch.int32),
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        causal=causal,
    )
    return step, softmax_scale


def _host_indptrs(
    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both indptrs on the host as int64, in one device-to-host copy (none when they are on
    the host; one tensor passed twice is copied once)."""
    if cu_seqlens_k is cu_seqlens_q:
        both = cu_seqlens_q.cpu().to(torch.int64)
        return both, both
    if cu_seqlens_q.device.type == "cpu" or cu_seqlens_q.numel() != cu_seqlens_k.numel():
        return cu_seqlens_q.cpu().to(torch.int64), cu_seqlens_k.cpu().to(torch.int64)
    stacked = torch.stack((cu_seqlens_q.to(torch.int64), cu_seqlens_k.to(torch.int64))).cpu()
    return stacked[0], stacked[1]


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
        handle = functional_ops.options_handle(args.provider, args.strategy, args.platform)
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
    provider, strategy, platform = functional_ops.options(options)
    _prefill(
        PrefillArgs(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
            provider, strategy, platform, out, lse, True,
        )
    )  # fmt: skip


functional_ops.implement("functional_prefill", _prefill_body)
