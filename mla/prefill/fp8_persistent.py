"""Fp8PersistentPrefill: fp8 prefill on a persistent tile schedule (aiter asm on gfx950;
Triton/torch elsewhere)."""

from __future__ import annotations

from typing import ClassVar

import torch

from mla.core.capabilities import Contract
from mla.core.context import PrefillContext
from mla.core.support import ReasonCollector
from mla.prefill.base import ContextExpander, PrefillBatch, PrefillPlan, PrefillStrategy
from mla.providers.calls import Fp8PrefillCall, Fp8PrefillPlanCall
from mla.providers.quant import quantize_per_tensor
from mla.strategy import StrategyKind


class Fp8PersistentPrefill(PrefillStrategy):
    """The causal varlen prefill of the new tokens with q, k and v rounded to fp8 (dynamic
    per-tensor scales), on a tile schedule whose fp32 partials a reduce merges.

    Where it runs: aiter's ``mla_prefill_ps_asm_fwd`` + ``mla_reduce_v1`` on ROCm gfx950
    (256-row q tiles; gfx942 ships none); the Triton fp8 prefill kernel on other GPUs (the
    ``gluon`` provider's too), the torch reference on the CPU, with the same tiling.

    The tile schedule is planned on the host in ``build_metadata``. No chunked-context path
    (aiter's non-causal LSE was wrong before ROCm/aiter#3606), so steps with cached context go
    to FlashVarlen.
    """

    NAME: ClassVar[str] = "fp8-persistent-prefill"
    KIND: ClassVar[StrategyKind] = StrategyKind.FP8_PREFILL
    REQUIRES: ClassVar[frozenset[Contract]] = frozenset({Contract.FP8_PREFILL})
    PLAN_READS_HOST_INDPTRS: ClassVar[bool] = True

    @classmethod
    def check(cls, ctx: PrefillContext, reasons: ReasonCollector) -> None:
        caps = ctx.capabilities
        multiple, counts = caps.fp8_prefill_head_multiple, caps.fp8_prefill_heads
        reasons.require(
            ctx.num_heads % multiple == 0 and (counts is None or ctx.num_heads in counts),
            "heads",
            f"{ctx.num_heads} heads: the fp8 prefill kernel needs a multiple of {multiple}"
            + (f" in {sorted(counts)}" if counts is not None else ""),
        )
        head_dims = (ctx.dims.qk_head_dim, ctx.dims.v_head_dim)
        reasons.require(
            caps.fp8_prefill_dims is None or head_dims in caps.fp8_prefill_dims,
            "dims",
            f"qk/v head dims {head_dims[0]}/{head_dims[1]}: the fp8 prefill kernel is built for "
            f"{sorted(caps.fp8_prefill_dims or ())}",
        )
        reasons.require(
            not ctx.has_chunked_context,
            "chunked-context",
            "this step has chunked cached context; the fp8 prefill has no context-merge path",
        )

    def plan_schedule(self, batch: PrefillBatch) -> object:
        assert batch.cu_seqlens_q_cpu is not None
        assert batch.cu_seqlens_k_cpu is not None
        return self.setup.provider.plan_fp8_prefill(
            Fp8PrefillPlanCall(
                cu_seqlens_q_cpu=batch.cu_seqlens_q_cpu,
                cu_seqlens_k_cpu=batch.cu_seqlens_k_cpu,
                num_heads=batch.context.num_heads,
                causal=batch.causal,
                platform=self.setup.platform,
                device=self.setup.device,
            )
        )

    def quantize(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        """The fp8 inputs the kernel sees: ``((q8, q_scale), (k8, k_scale), (v8, v_scale))``."""
        dtype = self.setup.capabilities.fp8_dtype
        return tuple(quantize_per_tensor(x, dtype) for x in (q, k, v))

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
        (q8, q_scale), (k8, k_scale), (v8, v_scale) = self.quantize(q, k, v)
        self.setup.provider.fp8_prefill(
            Fp8PrefillCall(
                q=q8,
                k=k8,
                v=v8,
                cu_seqlens_q=plan.cu_seqlens_q,
                cu_seqlens_k=plan.cu_seqlens_k,
                out=out,
                lse=lse,
                schedule=plan.schedule,
                softmax_scale=self.setup.dims.scale,
                q_scale=q_scale,
                k_scale=k_scale,
                v_scale=v_scale,
                causal=plan.geometry.causal,
            )
        )
