"""FlashVarlen: varlen prefill with chunked cached context (aiter flash-attn on ROCm; Triton/torch
elsewhere)."""

from __future__ import annotations

from typing import ClassVar

import attrs
import torch

from mla.core.capabilities import Contract
from mla.core.config import is_fp8
from mla.core.context import PrefillContext
from mla.core.errors import InvalidInputError
from mla.core.records import fast_constructor
from mla.core.support import ReasonCollector
from mla.prefill.base import ContextChunk, ContextExpander, PrefillPlan, PrefillStrategy
from mla.providers.calls import MergeStatesCall, VarlenPrefillCall
from mla.strategy import StrategyKind, require_dtype

_VARLEN_CALL = fast_constructor(VarlenPrefillCall)
"""The launch's record (:mod:`mla.core.records`: values of a checked plan and run)."""


class FlashVarlen(PrefillStrategy):
    """Causal varlen attention of the new tokens (q/k ``qk_head_dim``, v ``v_head_dim``) with
    LSE, plus the cached context chunk by chunk.

    Where it runs: aiter's ``flash_attn_varlen_func`` on ROCm; the Triton varlen kernel on other
    GPUs (the ``gluon`` provider's too); the torch reference on the CPU.

    With cached context, each chunk is gathered from the cache, expanded to k/v by the engine's
    callback, attended non-causally, and merged with the new tokens' result by LSE
    (vLLM's chunked-context prefill). The fallback prefill: any head count and KV dtype.
    """

    NAME: ClassVar[str] = "flash-varlen"
    KIND: ClassVar[StrategyKind] = StrategyKind.FLASH
    REQUIRES: ClassVar[frozenset[Contract]] = frozenset({Contract.VARLEN_PREFILL})

    @classmethod
    def check(cls, ctx: PrefillContext, reasons: ReasonCollector) -> None:
        caps = ctx.capabilities
        require_dtype(reasons, "q-dtype", "query", ctx.q_dtype, caps.varlen_q_dtypes, "varlen kernel")
        if ctx.has_chunked_context:
            reasons.require(
                caps.has(Contract.MERGE_STATES),
                "missing-kernel",
                f"chunked context needs the {Contract.MERGE_STATES.value} kernel, which "
                f"{caps.provider!r} does not ship",
            )

    def launch(
        self,
        plan: PrefillPlan,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        out: torch.Tensor,
        lse: torch.Tensor,
        kv_cache: torch.Tensor | None,
        kv_scale: torch.Tensor | None,
        expand_context: ContextExpander | None,
    ) -> None:
        provider, geo = self.setup.provider, plan.geometry
        new_tokens = _VARLEN_CALL(
            q=q,
            k=k,
            v=v,
            cu_seqlens_q=plan.cu_seqlens_q,
            cu_seqlens_k=plan.cu_seqlens_k,
            out=out,
            lse=lse,
            max_seqlen_q=geo.max_seqlen_q,
            max_seqlen_k=geo.max_seqlen_k,
            softmax_scale=self.setup.dims.scale,
            causal=geo.causal,
            # (with context chunks it runs into partial outputs: tensors the door did not see)
            checked=plan.launch_checked and not plan.context_chunks,
        )
        if not plan.context_chunks:
            provider.varlen_attention(new_tokens)
            return
        assert kv_cache is not None
        assert expand_context is not None
        acc = torch.empty(out.shape, dtype=torch.float32, device=out.device)
        acc_lse = torch.empty_like(lse)
        part = torch.empty_like(out)
        part_lse = torch.empty_like(lse)
        flat = kv_cache.view(-1, kv_cache.shape[-1])
        for index, chunk in enumerate(plan.context_chunks):
            rows, inside, cu_seqlens_k = context_rows_inside(chunk, flat.shape[0])
            latent = torch.where(inside[:, None], flat[rows].to(torch.float32), 0.0)
            if is_fp8(kv_cache.dtype) and kv_scale is not None:
                latent = latent * kv_scale
            k_ctx, v_ctx = check_expanded(expand_context(latent.to(q.dtype)), latent.shape[0], q, v)
            target = (acc, acc_lse) if index == 0 else (part, part_lse)
            provider.varlen_attention(
                attrs.evolve(
                    new_tokens,
                    k=k_ctx,
                    v=v_ctx,
                    cu_seqlens_k=cu_seqlens_k,
                    max_seqlen_k=chunk.max_seqlen_k,
                    causal=False,
                    out=target[0],
                    lse=target[1],
                )
            )
            if index:
                merge = MergeStatesCall(
                    o_a=acc, lse_a=acc_lse, o_b=part, lse_b=part_lse, out=acc, lse_out=acc_lse
                )
                provider.merge_states(merge)
        provider.varlen_attention(attrs.evolve(new_tokens, out=part, lse=part_lse))
        provider.merge_states(
            MergeStatesCall(o_a=acc, lse_a=acc_lse, o_b=part, lse_b=part_lse, out=out, lse_out=lse)
        )


def context_rows_inside(
    chunk: ContextChunk, cache_rows: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The chunk's cache rows with those outside the cache masked, on the device (no sync).

    A token id outside the ``cache_rows`` rows of the cache the run was handed (a block id past
    it, negative, or the fill's -1 mark) is never read and counts as no key: the tokens inside
    the cache move to the front of their request (stable order) and ``cu_seqlens_k`` counts
    only them; the rest sort last, past ``cu_seqlens_k[-1]``, where no request attends them.
    Returns ``(row ids clamped into the cache, inside mask, cu_seqlens_k)`` in that order.
    """
    ids = chunk.token_indices[: chunk.num_tokens].to(torch.int64)
    cu = chunk.cu_seqlens_k.to(torch.int64)
    num_requests = cu.numel() - 1
    inside = (ids >= 0) & (ids < cache_rows)
    position = torch.arange(ids.numel(), device=ids.device)
    request = torch.searchsorted(cu[1:].contiguous(), position, right=True)
    key = torch.where(inside, request, torch.full_like(request, num_requests))
    order = torch.sort(key, stable=True).indices
    counts = torch.zeros(num_requests + 1, dtype=torch.int64, device=ids.device)
    counts.index_add_(0, key, torch.ones_like(key))
    cu_inside = torch.zeros(num_requests + 1, dtype=torch.int32, device=ids.device)
    cu_inside[1:] = torch.cumsum(counts[:num_requests], 0)
    ids, inside = ids[order], inside[order]
    return torch.clamp(ids, 0, max(cache_rows - 1, 0)), inside, cu_inside


def check_expanded(
    result: object, rows: int, q: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``expand_context`` callback's output: ``(k [rows, H, Dqk], v [rows, H, Dv])`` in q's
    dtype on q's device, the shapes of the step's own k and v; :class:`InvalidInputError`
    naming ``expand_context`` otherwise (before any kernel reads it)."""
    heads, qk_dim, v_dim = q.shape[1], q.shape[2], v.shape[2]
    if not isinstance(result, tuple | list) or len(result) != 2:
        raise InvalidInputError(
            "expand_context", f"must return a (k, v) pair of tensors, got {type(result).__name__}"
        )
    k_ctx, v_ctx = result
    for name, tensor, dim in (("k", k_ctx, qk_dim), ("v", v_ctx, v_dim)):
        if not isinstance(tensor, torch.Tensor):
            raise InvalidInputError(
                "expand_context", f"returned {type(tensor).__name__} as {name}; expected a torch.Tensor"
            )
        if tuple(tensor.shape) != (rows, heads, dim):
            raise InvalidInputError(
                "expand_context",
                f"returned {name} of shape {tuple(tensor.shape)} for {rows} latent rows; expected "
                f"[{rows}, {heads}, {dim}] (one row per latent row, the step's heads and {name} head dim)",
            )
        if tensor.dtype != q.dtype:
            raise InvalidInputError(
                "expand_context", f"returned {name} in {tensor.dtype}; expected q's dtype {q.dtype}"
            )
        if tensor.device != q.device:
            raise InvalidInputError(
                "expand_context", f"returned {name} on {tensor.device}; expected q's device {q.device}"
            )
    return k_ctx, v_ctx
