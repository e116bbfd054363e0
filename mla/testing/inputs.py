"""Input builders: random q, paged caches over a random block permutation, block tables and
cumulative lengths for a case, with the reference math and NaN-poisoned outputs beside them."""

from __future__ import annotations

import abc
import math
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from mla.core.config import is_fp8
from mla.engine.backend import StepInputs
from mla.prefill.base import ContextExpander
from mla.testing.cases import DecodeCase, PrefillCase, _PagedBatch
from mla.tools.reference import reference_decode, reference_prefill


def _paged_table(
    seq_lens: Sequence[int], block_size: int, gen: torch.Generator, *, spare_blocks: int = 2
) -> tuple[torch.Tensor, int]:
    """A block table over a random permutation of blocks (never contiguous by construction);
    columns past a request's last block hold stale (valid but unrelated) ids."""
    needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(needed) + spare_blocks
    width = max(needed) + 1
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.randint(0, num_blocks, (len(seq_lens), width), generator=gen, dtype=torch.int64)
    cursor = 0
    for b, n in enumerate(needed):
        table[b, :n] = perm[cursor : cursor + n]
        cursor += n
    return table.to(torch.int32), num_blocks


def _random_cache(
    num_blocks: int,
    block_size: int,
    width: int,
    dtype: torch.dtype,
    kv_scale: float,
    gen: torch.Generator,
) -> torch.Tensor:
    return _cache_values(torch.randn(num_blocks, block_size, width, generator=gen), dtype, kv_scale)


def _cache_values(values: torch.Tensor, dtype: torch.dtype, kv_scale: float | None) -> torch.Tensor:
    """float ``values`` stored in a float cache ``dtype`` as they are, in a per-tensor fp8 one
    as ``value / kv_scale`` (default 1) clamped to its finite range."""
    if is_fp8(dtype):
        finfo = torch.finfo(dtype)
        return torch.clamp(values / (1.0 if kv_scale is None else kv_scale), finfo.min, finfo.max).to(dtype)
    return values.to(dtype)


def indptr(lengths: Sequence[int]) -> torch.Tensor:
    """int32 ``[n + 1]`` on the CPU: ``0`` then the running sums of ``lengths`` (the layout of
    ``cu_seqlens`` and ``query_start_loc``)."""
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    out[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0).to(torch.int32)
    return out


class _PagedInputs(abc.ABC):
    """What the inputs of a decode-shaped case share (:class:`DecodeInputs`,
    :class:`~mla.testing.SparseInputs`): the paged cache and lengths, the reference call over
    them, the engine step and the NaN-poisoned caller outputs."""

    __slots__ = ()
    case: _PagedBatch
    q: torch.Tensor
    kv_cache: torch.Tensor
    kv_scale: float | None
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor

    @abc.abstractmethod
    def reference(self) -> tuple[torch.Tensor, torch.Tensor]:
        """float64 ``(out, lse)`` of the reference math over these inputs (each kind defines it)."""

    def _reference_with(
        self, reference: Callable[..., tuple[torch.Tensor, torch.Tensor]], *selection: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``reference`` (:func:`~mla.tools.reference.reference_decode` or ``reference_sparse``)
        over these inputs (and the ``selection``, if any): float64 ``(out, lse)``."""
        return reference(
            self.q,
            self.kv_cache,
            self.block_table,
            self.seq_lens,
            self.query_start_loc,
            *selection,
            softmax_scale=self.case.scale,
            kv_lora_rank=self.case.kv_lora_rank,
            kv_scale=self.kv_scale,
        )

    def _step(self, *, decode: bool) -> StepInputs:
        """The batch as a decode-only (``decode``) or a prefill-only engine step."""
        qsl, case = self.query_start_loc, self.case
        return StepInputs(
            query_start_loc_cpu=qsl.cpu(),
            query_start_loc=qsl,
            seq_lens=self.seq_lens,
            seq_lens_cpu=self.seq_lens.cpu(),
            block_table=self.block_table,
            num_decodes=case.num_requests if decode else 0,
            num_decode_tokens=case.num_tokens if decode else 0,
        )

    def poisoned_outputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """NaN-filled ``out [T, H, L]`` (q dtype) and ``lse [T, H]`` (float32)."""
        case, dev = self.case, self.q.device
        out = torch.full(
            (case.num_tokens, case.heads, case.kv_lora_rank), math.nan, dtype=case.q_dtype, device=dev
        )
        lse = torch.full((case.num_tokens, case.heads), math.nan, dtype=torch.float32, device=dev)
        return out, lse


def _paged_fields(
    case: _PagedBatch,
    device: torch.device | str,
    *,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
) -> dict[str, Any]:
    """The :class:`_PagedInputs` fields of ``case`` on ``device`` (built on the CPU)."""
    dev = torch.device(device)
    return {
        "case": case,
        "q": q.to(dev),
        "kv_cache": kv_cache.to(dev),
        "kv_scale": case.kv_scale_or_none,
        "block_table": block_table.to(dev),
        "seq_lens": torch.tensor(case.seq_lens, dtype=torch.int32, device=dev),
        "query_start_loc": query_start_loc.to(dev),
    }


@attrs.frozen(eq=False)
class DecodeInputs(_PagedInputs):
    """Random inputs of one :class:`DecodeCase` on one device (see :func:`make_decode_inputs`)."""

    case: DecodeCase
    q: torch.Tensor
    """``[T, H, L+R]`` in ``case.q_dtype`` (padding rows random too)."""
    kv_cache: torch.Tensor
    """``[num_blocks, block_size, L+R]`` in ``case.kv_dtype`` (fp8: ``value / kv_scale``)."""
    kv_scale: float | None
    """``case.kv_scale`` for an fp8 cache, else ``None``."""
    block_table: torch.Tensor
    """int32 ``[B, max_blocks]``."""
    seq_lens: torch.Tensor
    """int32 ``[B]``."""
    query_start_loc: torch.Tensor
    """int32 ``[B+1]``."""

    def reference(self) -> tuple[torch.Tensor, torch.Tensor]:
        """float64 ``(out [T, H, L], lse [T, H])`` on the CPU."""
        return self._reference_with(reference_decode)

    def step(self) -> StepInputs:
        """The batch as a decode-only engine step."""
        return self._step(decode=True)

    def call_args(self) -> dict[str, Any]:
        """The batch as :func:`mla.mla_decode`'s keyword arguments (tensors, the case's
        ``softmax_scale`` and ``kv_lora_rank``; add ``kv_scale`` for an fp8 cache)."""
        return {
            "q": self.q, "kv_cache": self.kv_cache, "block_table": self.block_table,
            "seq_lens": self.seq_lens, "query_start_loc": self.query_start_loc,
            "softmax_scale": self.case.scale, "kv_lora_rank": self.case.kv_lora_rank,
        }  # fmt: skip


def make_decode_inputs(case: DecodeCase, device: torch.device | str = "cpu") -> DecodeInputs:
    """Random q, a paged cache over a random block permutation (fp8 caches quantized with
    ``case.kv_scale``), int32 block table, seq lens and query_start_loc. Deterministic per
    ``case.seed``; values are ``N(0, 1)``, never zeros."""
    gen = torch.Generator().manual_seed(case.seed)
    table, num_blocks = _paged_table(case.seq_lens, case.block_size, gen)
    cache = _random_cache(num_blocks, case.block_size, case.latent_dim, case.kv_dtype, case.kv_scale, gen)
    q = torch.randn(case.num_tokens, case.heads, case.latent_dim, generator=gen).to(case.q_dtype)
    return DecodeInputs(
        **_paged_fields(
            case, device, q=q, kv_cache=cache, block_table=table, query_start_loc=indptr(case.qlens)
        )
    )


@attrs.define
class RandomUpProjection:
    """A random ``kv_b_proj`` stand-in: latent rows ``[n, L+R]`` -> ``k [n, H, nope+R]``,
    ``v [n, H, Dv]`` (``k_nope``/``v`` from the first ``L`` lanes, the rope lanes shared by every
    head). Outputs in the input dtype; math in float32.

    ``nope_only``: ``k_nope [n, H, nope]`` instead of ``k``, and it and ``v`` strided views of
    one ``[n, H, nope + Dv]`` output (the ``expand_context`` form whose rope lanes the framework
    reads from the latent)."""

    w_k: torch.Tensor
    """float32 ``[L, H, nope]``."""
    w_v: torch.Tensor
    """float32 ``[L, H, Dv]``."""
    kv_lora_rank: int
    nope_only: bool = False

    @classmethod
    def random(cls, case: PrefillCase, gen: torch.Generator, device: torch.device) -> RandomUpProjection:
        rank, heads = case.kv_lora_rank, case.heads
        w_k = torch.randn(rank, heads, case.qk_nope_dim, generator=gen) / math.sqrt(rank)
        w_v = torch.randn(rank, heads, case.v_dim, generator=gen) / math.sqrt(rank)
        return cls(w_k.to(device), w_v.to(device), rank, case.context_nope_keys)

    def __call__(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        nope = latent[:, : self.kv_lora_rank].to(torch.float32)
        rope = latent[:, self.kv_lora_rank :].to(torch.float32)
        heads, nope_dim = self.w_k.shape[1], self.w_k.shape[2]
        if self.nope_only:
            kv = torch.einsum("nl,lhd->nhd", nope, torch.cat([self.w_k, self.w_v], dim=-1))
            kv = kv.to(latent.dtype)
            return kv[..., :nope_dim], kv[..., nope_dim:]
        k_nope = torch.einsum("nl,lhd->nhd", nope, self.w_k)
        k = torch.cat([k_nope, rope[:, None, :].expand(-1, heads, -1)], dim=-1)
        v = torch.einsum("nl,lhd->nhd", nope, self.w_v)
        return k.to(latent.dtype), v.to(latent.dtype)


@attrs.frozen(eq=False)
class CachedContext:
    """The cached-context half of a backend prefill step."""

    kv_cache: torch.Tensor
    """``[num_blocks, block_size, L+R]`` (random permutation of blocks)."""
    kv_scale: float | None
    block_table: torch.Tensor
    """int32 ``[P, max_blocks]`` covering context + new tokens."""
    seq_lens: torch.Tensor
    """int32 ``[P]``: context + new tokens."""
    expand: RandomUpProjection


@attrs.frozen(eq=False)
class PrefillInputs:
    """Random inputs of one :class:`PrefillCase` (see :func:`make_prefill_inputs`)."""

    case: PrefillCase
    q: torch.Tensor
    """``[T, H, nope+R]``."""
    k: torch.Tensor
    """``[Tk, H, nope+R]`` (new tokens' keys)."""
    v: torch.Tensor
    """``[Tk, H, Dv]``."""
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    context: CachedContext

    def call_args(self) -> dict[str, Any]:
        """The new tokens as :func:`mla.mla_prefill`'s keyword arguments (tensors, lengths and
        the case's ``softmax_scale``)."""
        return {
            "q": self.q, "k": self.k, "v": self.v, "cu_seqlens_q": self.cu_seqlens_q,
            "cu_seqlens_k": self.cu_seqlens_k, "max_seqlen_q": self.max_seqlen_q,
            "max_seqlen_k": self.max_seqlen_k, "softmax_scale": self.case.scale,
        }  # fmt: skip

    def context_latents(self) -> list[torch.Tensor]:
        """Per request, its cached latent rows ``[context, L+R]`` in position order, as a
        strategy gathers them: through the block table, dequantized (fp8), in the model dtype."""
        case, ctx = self.case, self.context
        flat = ctx.kv_cache.view(-1, ctx.kv_cache.shape[-1])
        table = ctx.block_table.cpu().to(torch.int64)
        parts = []
        for b, count in enumerate(case.contexts):
            pos = torch.arange(count)
            slots = (table[b, pos // case.block_size] * case.block_size + pos % case.block_size).to(
                flat.device
            )
            latent = flat[slots].to(torch.float32)
            if ctx.kv_scale is not None:
                latent = latent * ctx.kv_scale
            parts.append(latent.to(case.dtype))
        return parts

    def context_kv(self, expand: ContextExpander | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per request, the expanded ``(k, v)`` of its cached context, computed as a strategy
        must: :meth:`context_latents` up-projected by ``expand`` (default: the case's
        :class:`RandomUpProjection`); keys returned as ``k_nope`` alone get the latent's rope
        lanes appended (whole keys ``[n, H, nope + R]``)."""
        up = self.context.expand if expand is None else expand
        rope = self.case.rope_dim
        pairs = []
        for latent in self.context_latents():
            k, v = up(latent)
            if k.shape[-1] == self.case.qk_nope_dim:
                k_pe = latent[:, latent.shape[1] - rope :]
                k = torch.cat([k, k_pe[:, None, :].expand(-1, k.shape[1], -1)], dim=-1)
            pairs.append((k, v))
        return pairs

    def reference(
        self,
        q: torch.Tensor | None = None,
        k: torch.Tensor | None = None,
        v: torch.Tensor | None = None,
        *,
        with_context: bool | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """float64 ``(out, lse)`` over ``[context | new keys]`` per request (bottom-right causal).

        ``q``/``k``/``v`` replace the inputs (e.g. by a strategy's dequantized fp8 inputs).
        ``with_context`` defaults to whether the case has context.
        """
        q = self.q if q is None else q
        k = self.k if k is None else k
        v = self.v if v is None else v
        use_context = self.case.has_context if with_context is None else with_context
        if not use_context:
            return reference_prefill(
                q,
                k,
                v,
                self.cu_seqlens_q,
                self.cu_seqlens_k,
                softmax_scale=self.case.scale,
                causal=self.case.causal,
            )
        cu_k = self.cu_seqlens_k.cpu().to(torch.int64)
        keys, values, lengths = [], [], []
        for b, (k_ctx, v_ctx) in enumerate(self.context_kv()):
            k0, k1 = int(cu_k[b]), int(cu_k[b + 1])
            keys.append(torch.cat([k_ctx.cpu(), k[k0:k1].cpu()]))
            values.append(torch.cat([v_ctx.cpu(), v[k0:k1].cpu()]))
            lengths.append(keys[-1].shape[0])
        return reference_prefill(
            q,
            torch.cat(keys),
            torch.cat(values),
            self.cu_seqlens_q,
            indptr(lengths),
            softmax_scale=self.case.scale,
            causal=self.case.causal,
        )

    def step(self) -> StepInputs:
        """The batch as a prefill-only engine step (new tokens are their own keys)."""
        cu = self.cu_seqlens_q
        return StepInputs(
            query_start_loc_cpu=cu.cpu(),
            query_start_loc=cu,
            seq_lens=self.context.seq_lens,
            seq_lens_cpu=self.context.seq_lens.cpu(),
            block_table=self.context.block_table,
            num_decodes=0,
            num_decode_tokens=0,
        )

    def poisoned_outputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        case, dev = self.case, self.q.device
        tokens = self.q.shape[0]
        out = torch.full((tokens, case.heads, case.v_dim), math.nan, dtype=case.dtype, device=dev)
        lse = torch.full((tokens, case.heads), math.nan, dtype=torch.float32, device=dev)
        return out, lse


def make_prefill_inputs(case: PrefillCase, device: torch.device | str = "cpu") -> PrefillInputs:
    """Random q/k/v (``N(0, 1)``), cu_seqlens, and the cached context: a paged latent cache over
    a random block permutation, its block table (covering context + new tokens) and a random
    up-projection. Deterministic per ``case.seed``."""
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(case.seed)
    tokens, kv_tokens = sum(case.q_lens), sum(case.keys)
    q = torch.randn(tokens, case.heads, case.qk_dim, generator=gen).to(case.dtype)
    k = torch.randn(kv_tokens, case.heads, case.qk_dim, generator=gen).to(case.dtype)
    v = torch.randn(kv_tokens, case.heads, case.v_dim, generator=gen).to(case.dtype)
    seq_lens = [c + n for c, n in zip(case.contexts, case.q_lens, strict=True)]
    table, num_blocks = _paged_table(seq_lens, case.block_size, gen)
    cache = _random_cache(
        num_blocks, case.block_size, case.kv_lora_rank + case.rope_dim, case.cache_dtype, case.kv_scale, gen
    )
    context = CachedContext(
        kv_cache=cache.to(dev),
        kv_scale=case.kv_scale if is_fp8(case.cache_dtype) else None,
        block_table=table.to(dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        expand=RandomUpProjection.random(case, gen, dev),
    )
    return PrefillInputs(
        case=case,
        q=q.to(dev),
        k=k.to(dev),
        v=v.to(dev),
        cu_seqlens_q=indptr(case.q_lens).to(dev),
        cu_seqlens_k=indptr(case.keys).to(dev),
        max_seqlen_q=max(case.q_lens),
        max_seqlen_k=max(case.keys),
        context=context,
    )
