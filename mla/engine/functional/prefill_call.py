"""The door of :func:`mla.mla_prefill`: the checks of a call's signature (cached), the checks of
its values, and the host copy of its indptrs.

A call's *signature* is everything the checks of its own arguments depend on: each tensor's
shape, strides, dtype and device, and the scalar options (as for
:mod:`~mla.engine.functional.decode_call`, through
:func:`~mla.engine.functional.plan_cache.checked_signature`). Those checks run once per
signature; the :class:`PrefillCall` record caches what they derived (the plan key, the output
shapes). A repeated call checks only what may change between calls: ``max_seqlen_q`` and
``max_seqlen_k``, given outputs against the inputs' memory, and the ``cu_seqlens`` values.

The strides are in the signature for the provider's checks as well: they depend on the
signature alone (shapes, last-dim strides, dtypes, devices, the scale), so once a launch of a
signature passed them on a plan, the later calls of that signature tell the provider to skip
them (:attr:`PrefillCall.checked_by`, :attr:`~mla.providers.calls.VarlenPrefillCall.checked`).
"""

from __future__ import annotations

import attrs
import torch

from mla.core.errors import InvalidInputError
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
from mla.engine.functional.args import PrefillArgs
from mla.engine.functional.decode_call import require_output
from mla.engine.functional.plan_cache import PLAN_CACHE_SIZE, HostIndptrs, PlanCache
from mla.providers.base import KernelProvider


def _laid_out(tensor: torch.Tensor | None) -> tuple[object, ...] | None:
    return None if tensor is None else (tensor.shape, tensor.stride(), tensor.dtype, tensor.device)


def _described(tensor: torch.Tensor | None) -> tuple[object, ...] | None:
    return None if tensor is None else (tensor.shape, tensor.dtype, tensor.device)


def prefill_signature(args: PrefillArgs) -> tuple[object, ...]:
    """What the call's checks (and the provider's) depend on (hashable). Raises
    ``AttributeError``/``TypeError`` for arguments of the wrong kind: the caller then runs the
    checks, which name them."""
    q, k, v, cu_q, cu_k = args.q, args.k, args.v, args.cu_seqlens_q, args.cu_seqlens_k
    scale, causal, return_lse = args.softmax_scale, args.causal, args.return_lse
    return (
        q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(), k.dtype, k.device,
        v.shape, v.stride(), v.dtype, v.device, cu_q.shape, cu_q.dtype, cu_q.device,
        cu_k.shape, cu_k.dtype, cu_k.device, _laid_out(args.out), _described(args.lse),
        type(scale), scale, type(causal), causal, type(return_lse), return_lse,
        args.provider, args.strategy, args.platform, args.validate,
    )  # fmt: skip


@attrs.define(eq=False)
class PrefillCall:
    """What the checks of one signature derived (identity-hashed)."""

    num_requests: int
    softmax_scale: float
    causal: bool
    plan_key: tuple[object, ...]
    """The key of the call's plan in :data:`~mla.engine.functional.plan_cache.PREFILL_PLANS`."""
    out_shape: tuple[int, int, int]
    lse_shape: tuple[int, int]
    validate: CallValidateMode
    checked_by: KernelProvider | None = None
    """The provider whose launch of this signature passed its argument checks (set after a
    call's launch returned): later calls on a plan with this provider launch with
    ``checked=True``. The only field that changes."""


PREFILL_CALLS: PlanCache[tuple[object, ...], PrefillCall] = PlanCache(4 * PLAN_CACHE_SIZE)
"""Checked signatures (least recently used evicted first)."""


def check_prefill_call(args: PrefillArgs) -> PrefillCall:
    """Every check of :func:`mla.mla_prefill`'s arguments that reads no device value
    (:class:`InvalidInputError` naming the argument), and what they derived; the ``cu_seqlens``
    values are :func:`check_indptr_values`'s."""
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
    require_int("max_seqlen_q", args.max_seqlen_q, minimum=0)
    require_int("max_seqlen_k", args.max_seqlen_k, minimum=0)
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
    out_shape, lse_shape = (num_tokens, num_heads, v.shape[-1]), (num_tokens, num_heads)
    if args.out is not None:
        require_output("out", args.out, out_shape, q.dtype, q.device)
    if args.lse is not None:
        require_output("lse", args.lse, lse_shape, torch.float32, q.device)
    check_outputs_apart(args)
    num_requests = cu_seqlens_q.numel() - 1
    plan_key = (
        tuple(q.shape), tuple(k.shape), tuple(v.shape), q.dtype, q.device, num_requests, softmax_scale,
        args.provider, args.strategy, args.platform,
    )  # fmt: skip
    return PrefillCall(num_requests, softmax_scale, causal, plan_key, out_shape, lse_shape, validate)


def check_outputs_apart(args: PrefillArgs) -> None:
    """The caller's ``out``/``lse`` share no memory with the inputs (or each other)."""
    out, lse = args.out, args.lse
    if out is None and lse is None:
        return
    inputs = (
        ("q", args.q),
        ("k", args.k),
        ("v", args.v),
        ("cu_seqlens_q", args.cu_seqlens_q),
        ("cu_seqlens_k", args.cu_seqlens_k),
    )
    require_no_overlap("out", out, *inputs, ("lse", lse))
    require_no_overlap("lse", lse, *inputs)


def max_seqlens(args: PrefillArgs) -> tuple[int, int]:
    """``max_seqlen_q`` and ``max_seqlen_k`` as ints ``>= 0`` (a repeated call's check: the
    values are not in the signature)."""
    max_q, max_k = args.max_seqlen_q, args.max_seqlen_k
    if type(max_q) is not int or max_q < 0:
        max_q = require_int("max_seqlen_q", max_q, minimum=0)
    if type(max_k) is not int or max_k < 0:
        max_k = require_int("max_seqlen_k", max_k, minimum=0)
    return max_q, max_k


def check_indptr_values(args: PrefillArgs, cu_q_cpu: torch.Tensor, cu_k_cpu: torch.Tensor) -> None:
    """The ``cu_seqlens`` values (host copies): indptrs over q's and k's rows, their longest
    request within ``max_seqlen_q``/``max_seqlen_k``. One tensor passed as both (the same host
    copy) over as many k rows as q rows is checked once."""
    rows_q, rows_k = args.q.shape[0], args.k.shape[0]
    lens_q = require_indptr_of_rows("cu_seqlens_q", cu_q_cpu.tolist(), rows_q, "q")
    if cu_k_cpu is cu_q_cpu and rows_k == rows_q:
        lens_k = lens_q
    else:
        lens_k = require_indptr_of_rows("cu_seqlens_k", cu_k_cpu.tolist(), rows_k, "k")
    if lens_q and max(lens_q) > args.max_seqlen_q:
        raise InvalidInputError("max_seqlen_q", f"{args.max_seqlen_q} < longest query {max(lens_q)}")
    if lens_k and max(lens_k) > args.max_seqlen_k:
        raise InvalidInputError("max_seqlen_k", f"{args.max_seqlen_k} < longest key range {max(lens_k)}")


class IndptrCopy:
    """Both indptrs on the host, started when made: on a CUDA device an asynchronous copy on
    the current stream into the plan's pinned buffers (:class:`~mla.engine.functional.plan_cache.HostIndptrs`,
    so it can be started before the launch and waited for after it); elsewhere a plain copy
    (none for host tensors). A tensor passed as both indptrs is copied once. :meth:`values`
    waits for the copy; the values stay valid until the plan's next call starts its copy."""

    def __init__(self, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, buffers: HostIndptrs) -> None:
        self.buffers: HostIndptrs | None = None
        if cu_seqlens_q.device.type != "cuda":
            self.host_q = cu_seqlens_q.cpu()
            self.host_k = self.host_q if cu_seqlens_k is cu_seqlens_q else cu_seqlens_k.cpu()
            return
        entries = cu_seqlens_q.shape[0]
        self.host_q = buffers.rows(cu_seqlens_q.dtype, entries)[0]
        self.host_q.copy_(cu_seqlens_q, non_blocking=True)
        if cu_seqlens_k is cu_seqlens_q:
            self.host_k = self.host_q
        else:
            self.host_k = buffers.rows(cu_seqlens_k.dtype, entries)[1]
            self.host_k.copy_(cu_seqlens_k, non_blocking=True)
        buffers.record()
        self.buffers = buffers

    def values(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.buffers is not None:
            self.buffers.wait()
        return self.host_q, self.host_k

    def step_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`values` as int32 tensors a plan may keep (never the plan's pinned buffers,
        which the next call overwrites)."""
        host_q, host_k = self.values()
        if self.buffers is None and host_q.dtype == torch.int32 and host_k.dtype == torch.int32:
            return host_q, host_k  # (host tensors: no conversion, nothing to copy)
        return host_q.to(torch.int32, copy=True), host_k.to(torch.int32, copy=True)
