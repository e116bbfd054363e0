"""FlashVarlen: varlen prefill with chunked cached context (aiter flash-attn on ROCm; Triton/torch
elsewhere)."""

from __future__ import annotations

from typing import ClassVar

import attrs
import torch

from mla.core.capabilities import Contract
from mla.core.config import is_fp8
from mla.core.context import PrefillContext
from mla.core.support import ReasonCollector
from mla.prefill.base import ContextExpander, PrefillPlan, PrefillStrategy
from mla.providers.calls import MergeStatesCall, VarlenPrefillCall
from mla.strategy import StrategyKind, require_dtype


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
        new_tokens = VarlenPrefillCall(
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
            latent = flat[chunk.token_indices].to(torch.float32)
            if is_fp8(kv_cache.dtype) and kv_scale is not None:
                latent = latent * kv_scale
            k_ctx, v_ctx = expand_context(latent.to(q.dtype))
            target = (acc, acc_lse) if index == 0 else (part, part_lse)
            provider.varlen_attention(
                attrs.evolve(
                    new_tokens,
                    k=k_ctx,
                    v=v_ctx,
                    cu_seqlens_k=chunk.cu_seqlens_k,
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
