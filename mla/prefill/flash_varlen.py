"""FlashVarlen: varlen prefill with chunked cached context (aiter flash-attn on ROCm; Triton/torch
elsewhere)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar

import attrs
import torch

from mla.core.capabilities import Contract
from mla.core.context import PrefillContext
from mla.core.errors import InvalidInputError
from mla.core.records import fast_constructor
from mla.core.support import ReasonCollector
from mla.prefill.base import ContextChunk, ContextExpander, PrefillPlan, PrefillStrategy
from mla.providers.base import KernelProvider
from mla.providers.calls import AppendedKeys, GatherContextCall, MergeStatesCall, VarlenPrefillCall
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
    (vLLM's chunked-context prefill). On a provider whose varlen kernel takes the
    chunked-context operands (:attr:`~mla.core.capabilities.ProviderCapabilities.varlen_context_operands`)
    the first chunk and the new tokens are one call (the new tokens' keys appended to each
    request's chunk keys, causal over them) straight into ``out``/``lse``, and each later
    chunk's pass merges into them in its epilogue, the chunk's keys read as the callback's
    (strided) ``k_nope`` plus the latent's rope lanes: no key assembly, no merge pass, no
    partial buffers. Elsewhere the keys
    are assembled and the partial states merged by the ``merge-states`` kernel. The fallback
    prefill: any head count and KV dtype.
    """

    NAME: ClassVar[str] = "flash-varlen"
    KIND: ClassVar[StrategyKind] = StrategyKind.FLASH
    REQUIRES: ClassVar[frozenset[Contract]] = frozenset({Contract.VARLEN_PREFILL})

    @classmethod
    def check(cls, ctx: PrefillContext, reasons: ReasonCollector) -> None:
        caps = ctx.capabilities
        require_dtype(reasons, "q-dtype", "query", ctx.q_dtype, caps.varlen_q_dtypes, "varlen kernel")
        if ctx.has_chunked_context and not caps.varlen_context_operands:
            reasons.require(
                caps.has(Contract.MERGE_STATES),
                "missing-kernel",
                f"chunked context needs the {Contract.MERGE_STATES.value} kernel (the varlen kernel "
                f"does not merge a prior state), which {caps.provider!r} does not ship",
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
            # (with context chunks the merged form runs it into partial outputs, tensors the door
            # did not see; both forms then run unchecked chunk passes)
            checked=plan.launch_checked and not plan.context_chunks,
            k_pe=None,
            prior_out=None,
            prior_lse=None,
            appended=None,
        )
        if not plan.context_chunks:
            provider.varlen_attention(new_tokens)
            return
        assert kv_cache is not None
        assert expand_context is not None
        split_keys = self.setup.capabilities.varlen_context_operands
        flat = kv_cache.view(-1, kv_cache.shape[-1])
        chunk_calls = (
            self._chunk_keys(chunk, flat, kv_scale, expand_context, new_tokens, split_keys=split_keys)
            for chunk in plan.context_chunks
        )
        if split_keys:
            self._fused_context(new_tokens, chunk_calls)
        else:
            self._merged_context(new_tokens, chunk_calls)

    def _chunk_keys(
        self,
        chunk: ContextChunk,
        flat: torch.Tensor,
        kv_scale: torch.Tensor | None,
        expand_context: ContextExpander,
        new_tokens: VarlenPrefillCall,
        *,
        split_keys: bool,
    ) -> VarlenPrefillCall:
        """The non-causal call of the new queries over ``chunk``'s keys (into the new tokens'
        ``out``/``lse``; the caller picks the outputs): the chunk gathered, expanded by the
        callback, its keys whole or (``split_keys``) as ``k_nope`` plus the latent's rope lanes."""
        q, v = new_tokens.q, new_tokens.v
        latent, cu_seqlens_k = gather_context(self.setup.provider, chunk, flat, kv_scale, q.dtype)
        rope = self.setup.dims.qk_rope_head_dim
        k_ctx, v_ctx = check_expanded(expand_context(latent), latent.shape[0], q, v, rope)
        k_pe: torch.Tensor | None = None
        if k_ctx.shape[-1] != q.shape[-1]:  # the k_nope form: the rope lanes are the latent's
            k_pe = latent[:, latent.shape[1] - rope :]
            if not split_keys:
                k_ctx = torch.cat([k_ctx, k_pe[:, None, :].expand(-1, k_ctx.shape[1], -1)], dim=-1)
                k_pe = None
        return attrs.evolve(
            new_tokens,
            k=k_ctx,
            v=v_ctx,
            k_pe=k_pe,
            cu_seqlens_k=cu_seqlens_k,
            max_seqlen_k=chunk.max_seqlen_k,
            causal=False,
            checked=False,
        )

    def _fused_context(self, new_tokens: VarlenPrefillCall, chunk_calls: Iterator[VarlenPrefillCall]) -> None:
        """The first chunk's call (``chunk_calls``: split keys, built lazily) with the new tokens'
        keys appended (:class:`~mla.providers.calls.AppendedKeys`, causal over them as
        ``new_tokens`` is) straight into ``out``/``lse``, then each later chunk's call merged
        into them by the varlen kernel's epilogue (in place: each row is read before it is
        written). The first chunk is gathered, expanded and its callback output checked before
        the first launch, so a bad callback leaves ``out`` and ``lse`` unwritten."""
        provider = self.setup.provider
        out, lse = new_tokens.out, new_tokens.lse
        first = next(chunk_calls)
        new_keys = AppendedKeys(
            k=new_tokens.k, v=new_tokens.v, cu_seqlens_k=new_tokens.cu_seqlens_k,
            max_seqlen_k=new_tokens.max_seqlen_k,
        )  # fmt: skip
        provider.varlen_attention(attrs.evolve(first, appended=new_keys, causal=new_tokens.causal))
        for call in chunk_calls:
            provider.varlen_attention(attrs.evolve(call, prior_out=out, prior_lse=lse))

    def _merged_context(
        self, new_tokens: VarlenPrefillCall, chunk_calls: Iterator[VarlenPrefillCall]
    ) -> None:
        """Whole keys and separate merges (a varlen kernel without the chunked-context
        operands): the chunks' calls into a float32 running state, the new tokens into a
        partial, each merged by the ``merge-states`` kernel."""
        provider = self.setup.provider
        out, lse = new_tokens.out, new_tokens.lse
        acc = torch.empty(out.shape, dtype=torch.float32, device=out.device)
        acc_lse = torch.empty_like(lse)
        part = torch.empty_like(out)
        part_lse = torch.empty_like(lse)
        for index, call in enumerate(chunk_calls):
            target = (acc, acc_lse) if index == 0 else (part, part_lse)
            provider.varlen_attention(attrs.evolve(call, out=target[0], lse=target[1]))
            if index:
                merge = MergeStatesCall(
                    o_a=acc, lse_a=acc_lse, o_b=part, lse_b=part_lse, out=acc, lse_out=acc_lse
                )
                provider.merge_states(merge)
        provider.varlen_attention(attrs.evolve(new_tokens, out=part, lse=part_lse))
        provider.merge_states(
            MergeStatesCall(o_a=acc, lse_a=acc_lse, o_b=part, lse_b=part_lse, out=out, lse_out=lse)
        )


def gather_context(
    provider: KernelProvider,
    chunk: ContextChunk,
    flat: torch.Tensor,
    kv_scale: torch.Tensor | None,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunk's latent rows ``[n, L+R]`` in ``dtype`` and its ``cu_seqlens_k``, gathered by
    ``provider`` (:class:`~mla.providers.calls.GatherContextCall`: each request's tokens inside
    the cache first, the rest zeroed past the last request's)."""
    n = chunk.num_tokens
    latent = torch.empty(n, flat.shape[1], dtype=dtype, device=flat.device)
    cu_seqlens_k = torch.empty_like(chunk.cu_seqlens_k)
    provider.gather_context(
        GatherContextCall(
            cache=flat, token_ids=chunk.token_indices[:n], cu_seqlens_k=chunk.cu_seqlens_k,
            kv_scale=kv_scale, out=latent, cu_seqlens_out=cu_seqlens_k,
        )
    )  # fmt: skip
    return latent, cu_seqlens_k


def check_expanded(
    result: object, rows: int, q: torch.Tensor, v: torch.Tensor, rope_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``expand_context`` callback's output: ``(k, v [rows, H, Dv])`` with ``k`` either whole,
    ``[rows, H, Dqk]``, or its nope lanes alone, ``[rows, H, Dqk - rope_dim]`` (the rope lanes
    are then the latent's), in q's dtype on q's device, each with a contiguous last dim (any
    token and head strides: views of one up-projection output need no copy);
    :class:`InvalidInputError` naming ``expand_context`` otherwise (before any kernel reads it)."""
    heads, qk_dim, v_dim = q.shape[1], q.shape[2], v.shape[2]
    if not isinstance(result, tuple | list) or len(result) != 2:
        raise InvalidInputError(
            "expand_context", f"must return a (k, v) pair of tensors, got {type(result).__name__}"
        )
    k_ctx, v_ctx = result
    for name, tensor, dims in (("k", k_ctx, (qk_dim, qk_dim - rope_dim)), ("v", v_ctx, (v_dim,))):
        if not isinstance(tensor, torch.Tensor):
            raise InvalidInputError(
                "expand_context", f"returned {type(tensor).__name__} as {name}; expected a torch.Tensor"
            )
        if tensor.dim() != 3 or tuple(tensor.shape[:2]) != (rows, heads) or tensor.shape[2] not in dims:
            expected = " or ".join(f"[{rows}, {heads}, {d}]" for d in dims)
            what = (
                " (whole keys, or the nope lanes alone: the rope lanes are then the latent's)"
                if name == "k"
                else ""
            )
            raise InvalidInputError(
                "expand_context",
                f"returned {name} of shape {tuple(tensor.shape)} for {rows} latent rows; expected "
                f"{expected}{what}: one row per latent row, the step's heads",
            )
        if tensor.dtype != q.dtype:
            raise InvalidInputError(
                "expand_context", f"returned {name} in {tensor.dtype}; expected q's dtype {q.dtype}"
            )
        if tensor.device != q.device:
            raise InvalidInputError(
                "expand_context", f"returned {name} on {tensor.device}; expected q's device {q.device}"
            )
        if tensor.shape[2] > 1 and tensor.stride(2) != 1:
            raise InvalidInputError(
                "expand_context",
                f"returned {name} with strides {tuple(tensor.stride())}; its last dim must be "
                "contiguous (stride 1; token and head strides may be anything)",
            )
    return k_ctx, v_ctx
