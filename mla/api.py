"""Functional entry points: one call, one decision, reference-checked semantics.

:func:`mla_decode` and :func:`mla_prefill` validate their inputs, build a one-shot backend (or
strategy) sized from the call, resolve the strategy (or check the forced one), and run it.
Engines use :class:`~mla.backend.MLABackend` instead, which sizes buffers once.
"""

from __future__ import annotations

import torch

from mla.backend import MLABackend, StepInputs
from mla.config import EngineLimits, KVCacheSpec, MLADims, is_fp8
from mla.context import prefill_context
from mla.errors import InvalidInputError
from mla.platform import Platform, detect_platform, simulated_platform
from mla.prefill.base import PrefillBatch, PrefillStrategy
from mla.providers import resolve_provider
from mla.providers.base import KernelProvider
from mla.registry import AnyStrategy
from mla.resolver import Resolver
from mla.strategy import StrategySetup
from mla.validate import (
    check_indptr,
    check_paged_requests,
    require_float,
    require_index,
    require_same_device,
    require_tensor,
)


def _platform(platform: Platform | str | None, device: torch.device) -> Platform:
    if isinstance(platform, Platform):
        return platform
    if isinstance(platform, str):
        return simulated_platform(platform)
    return detect_platform(device)


def mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    query_start_loc: torch.Tensor | None = None,
    softmax_scale: float,
    kv_lora_rank: int = 512,
    kv_scale: float | torch.Tensor | None = None,
    provider: str | KernelProvider = "auto",
    strategy: str | AnyStrategy | None = None,
    platform: Platform | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA decode over a paged latent cache (DESIGN §5).

    Args:
        q: ``[T, H, kv_lora_rank + rope]`` bf16/fp16/fp32.
        kv_cache: ``[num_blocks, block_size, kv_lora_rank + rope]``; bf16/fp16/fp32, or fp8
            with ``kv_scale`` (value = stored * kv_scale).
        block_table: int32/int64 ``[B, max_blocks]``.
        seq_lens: int ``[B]``: KV length of each request including its new tokens (0 marks a
            graph-padding request).
        query_start_loc: int ``[B+1]``; default one token per request.
        softmax_scale: the model's scale (never defaulted to ``1/sqrt(576)``).
        provider: ``"auto"``, ``"torch"``, ``"triton"``, ``"aiter"`` or a provider object.
        strategy: force a decode strategy (class or ``NAME``); checked like automatic selection.
        platform: a :class:`Platform`, or an arch name such as ``"gfx950"`` to simulate.

    Returns:
        ``(out [T, H, kv_lora_rank] in q's dtype, lse [T, H] float32 natural log)``.

    Raises:
        InvalidInputError: bad shapes, dtypes, devices or index values.
        UnsupportedError: no strategy (or not the forced one) supports the case.
    """
    require_tensor("q", q, ndim=3)
    require_tensor("kv_cache", kv_cache, ndim=3)
    require_index("block_table", block_table, ndim=2)
    require_index("seq_lens", seq_lens, ndim=1)
    require_float("q", q)
    require_float("kv_cache", kv_cache, allow_fp8=True)
    tensors = [("kv_cache", kv_cache), ("block_table", block_table), ("seq_lens", seq_lens)]
    if query_start_loc is not None:
        require_index("query_start_loc", query_start_loc, ndim=1)
        tensors.append(("query_start_loc", query_start_loc))
    require_same_device(("q", q), *tensors)
    num_tokens, num_heads, width = q.shape
    if width <= kv_lora_rank:
        raise InvalidInputError(
            "q", f"last dim {width} must be kv_lora_rank ({kv_lora_rank}) + rope dim (> 0)"
        )
    if kv_cache.shape[-1] != width:
        raise InvalidInputError("kv_cache", f"last dim {kv_cache.shape[-1]} must equal q's last dim {width}")
    if is_fp8(kv_cache.dtype) and kv_scale is None:
        raise InvalidInputError("kv_scale", f"an fp8 kv_cache ({kv_cache.dtype}) needs kv_scale")
    num_requests = seq_lens.numel()
    qsl_cpu = (
        torch.arange(num_requests + 1, dtype=torch.int64)
        if query_start_loc is None
        else query_start_loc.cpu().to(torch.int64)
    )
    if qsl_cpu.numel() != num_requests + 1:
        raise InvalidInputError(
            "query_start_loc",
            f"expected {num_requests + 1} entries for {num_requests} requests, got {qsl_cpu.numel()}",
        )
    check_indptr("query_start_loc", qsl_cpu, total=num_tokens)
    seq_cpu = seq_lens.cpu().to(torch.int64)
    num_blocks, block_size = kv_cache.shape[0], kv_cache.shape[1]
    check_paged_requests(
        query_start_loc_cpu=qsl_cpu,
        seq_lens_cpu=seq_cpu,
        block_table_cpu=block_table.cpu(),
        block_size=block_size,
        num_blocks=num_blocks,
    )
    qlens = qsl_cpu[1:] - qsl_cpu[:-1]
    max_qlen = max(1, int(qlens.max()) if qlens.numel() else 1)
    dims = MLADims(
        num_heads=num_heads,
        kv_lora_rank=kv_lora_rank,
        qk_rope_head_dim=width - kv_lora_rank,
        softmax_scale=softmax_scale,
    )
    limits = EngineLimits(
        max_num_seqs=max(1, num_requests),
        max_model_len=max(1, int(seq_cpu.max()) if seq_cpu.numel() else 1),
        max_num_batched_tokens=max(1, num_tokens),
        max_decode_qlen=max(max_qlen, -(-num_tokens // max(1, num_requests))),
    )
    backend = MLABackend(
        dims,
        KVCacheSpec(block_size, kv_cache.dtype, num_blocks=num_blocks),
        limits,
        model_dtype=q.dtype,
        provider=provider,
        platform=_platform(platform, q.device),
        device=q.device,
        decode_strategy=strategy,
        preallocate=False,
    )
    step = StepInputs(
        query_start_loc_cpu=qsl_cpu,
        query_start_loc=qsl_cpu.to(device=q.device, dtype=torch.int32),
        seq_lens=seq_lens.to(torch.int32),
        seq_lens_cpu=seq_cpu,
        block_table=block_table.to(torch.int32),
        num_decodes=num_requests,
        num_decode_tokens=num_tokens,
    )
    out = torch.empty(num_tokens, num_heads, kv_lora_rank, dtype=q.dtype, device=q.device)
    lse = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=q.device)
    if num_requests == 0:
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse
    metadata = backend.builder.build(step)
    backend.impl.forward_decode(metadata, q, kv_cache, out=out, lse=lse, kv_scale=kv_scale)
    return out, lse


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Varlen MHA prefill (bottom-right causal), MLA-shaped: q/k ``[T, H, Dqk]``, v ``[Tk, H, Dv]``.

    Returns ``(out [T, H, Dv] in q's dtype, lse [T, H] float32 natural log)``. Raises
    :class:`InvalidInputError` for bad input and :class:`UnsupportedError` when no strategy (or
    not the forced one) fits.
    """
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        require_tensor(name, tensor, ndim=3)
        require_float(name, tensor)
    require_index("cu_seqlens_q", cu_seqlens_q, ndim=1)
    require_index("cu_seqlens_k", cu_seqlens_k, ndim=1)
    require_same_device(
        ("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)
    )
    num_tokens, num_heads, qk_dim = q.shape
    if k.shape[1:] != (num_heads, qk_dim):
        raise InvalidInputError("k", f"expected [Tk, {num_heads}, {qk_dim}] to match q, got {tuple(k.shape)}")
    if v.shape[0] != k.shape[0] or v.shape[1] != num_heads:
        raise InvalidInputError(
            "v", f"expected [{k.shape[0]}, {num_heads}, Dv] to match k, got {tuple(v.shape)}"
        )
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise InvalidInputError("k", f"q, k and v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    cu_q_cpu = cu_seqlens_q.cpu().to(torch.int64)
    cu_k_cpu = cu_seqlens_k.cpu().to(torch.int64)
    check_indptr("cu_seqlens_q", cu_q_cpu, total=num_tokens)
    check_indptr("cu_seqlens_k", cu_k_cpu, total=k.shape[0])
    if cu_q_cpu.numel() != cu_k_cpu.numel():
        raise InvalidInputError(
            "cu_seqlens_k", f"has {cu_k_cpu.numel()} entries, cu_seqlens_q {cu_q_cpu.numel()}"
        )
    lens_q, lens_k = cu_q_cpu[1:] - cu_q_cpu[:-1], cu_k_cpu[1:] - cu_k_cpu[:-1]
    if lens_q.numel() and int(lens_q.max()) > max_seqlen_q:
        raise InvalidInputError("max_seqlen_q", f"{max_seqlen_q} < longest query {int(lens_q.max())}")
    if lens_k.numel() and int(lens_k.max()) > max_seqlen_k:
        raise InvalidInputError("max_seqlen_k", f"{max_seqlen_k} < longest key range {int(lens_k.max())}")
    plat = _platform(platform, q.device)
    prov = resolve_provider(provider, plat)
    caps = prov.capabilities(plat)
    rope = min(64, qk_dim - 1) if qk_dim > 1 else 0
    dims = MLADims(
        num_heads=num_heads,
        qk_nope_head_dim=max(1, qk_dim - rope),
        qk_rope_head_dim=max(1, rope),
        v_head_dim=v.shape[-1],
        softmax_scale=softmax_scale,
    )
    ctx = prefill_context(
        dims=dims,
        cache=KVCacheSpec(1, q.dtype),
        q_dtype=q.dtype,
        platform=plat,
        capabilities=caps,
        availability=prov.availability(),
        has_chunked_context=False,
    )
    decision = Resolver().resolve(ctx, force=strategy)
    cls = decision.strategy
    assert issubclass(cls, PrefillStrategy)
    setup = StrategySetup(
        dims=dims,
        cache=KVCacheSpec(1, q.dtype),
        limits=EngineLimits(max(1, lens_q.numel()), max(1, max_seqlen_k), max(1, num_tokens)),
        q_dtype=q.dtype,
        platform=plat,
        provider=prov,
        capabilities=caps,
        device=q.device,
    )
    runner = cls(setup)
    batch = PrefillBatch(
        context=ctx,
        cu_seqlens_q_cpu=cu_q_cpu.to(torch.int32),
        cu_seqlens_k_cpu=cu_k_cpu.to(torch.int32),
        cu_seqlens_q=cu_seqlens_q.to(torch.int32),
        cu_seqlens_k=cu_seqlens_k.to(torch.int32),
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        num_tokens=num_tokens,
        num_kv_tokens=k.shape[0],
        causal=causal,
    )
    plan = runner.build_metadata(batch)
    out = torch.empty(num_tokens, num_heads, v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=q.device)
    runner.run(plan, q, k, v, out=out, lse=lse)
    return out, lse
