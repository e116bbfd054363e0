"""Functional entry points: one call, one decision, reference-checked semantics.

:func:`mla_decode` and :func:`mla_prefill` validate their inputs, resolve the strategy (or check
the forced one) and run it. The plan (a backend or strategy with its persistent buffers) is
cached per (shapes, dtypes, device, scale, provider, strategy, platform, validate) in a small
LRU (:data:`~mla.engine.plan_cache.PLAN_CACHE_SIZE` entries per function), so a repeated call
costs the kernels plus a small constant: no re-resolution, no buffer allocation, and for decode
no device-to-host copy.
:func:`write_kv` writes new latent rows into the paged cache. Engines use
:class:`~mla.engine.backend.MLABackend` instead, which sizes buffers from the engine limits.
"""

from __future__ import annotations

from typing import Literal, overload

import torch

from mla.core.config import EngineLimits, KVCacheSpec, MLADims, dtype_name
from mla.core.errors import InvalidInputError
from mla.core.platform import Platform, resolve_platform
from mla.core.validate import (
    ValidateMode,
    check_cache_scale,
    check_indptr,
    require_bool,
    require_float,
    require_index,
    require_int,
    require_same_device,
    require_softmax_scale,
    require_tensor,
    require_validate_mode,
)
from mla.engine import ops
from mla.engine.backend import MLABackend
from mla.engine.checks import check_kv_write, check_paged_step
from mla.engine.plan_cache import DECODE_PLANS, PREFILL_PLANS, DecodeEntry, available_provider, prefill_entry
from mla.engine.registry import AnyStrategy
from mla.engine.resolver import Resolver
from mla.engine.step import StepInputs
from mla.prefill.base import PrefillBatch
from mla.providers.base import KernelProvider
from mla.strategy import Phase

__all__ = ["mla_decode", "mla_prefill", "write_kv"]


@overload
def mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    query_start_loc: torch.Tensor | None = ...,
    softmax_scale: float,
    kv_lora_rank: int = ...,
    kv_scale: float | torch.Tensor | None = ...,
    provider: str | KernelProvider = ...,
    strategy: str | AnyStrategy | None = ...,
    platform: Platform | str | None = ...,
    out: torch.Tensor | None = ...,
    lse: torch.Tensor | None = ...,
    return_lse: Literal[True] = ...,
    validate: ValidateMode = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...


@overload
def mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    query_start_loc: torch.Tensor | None = ...,
    softmax_scale: float,
    kv_lora_rank: int = ...,
    kv_scale: float | torch.Tensor | None = ...,
    provider: str | KernelProvider = ...,
    strategy: str | AnyStrategy | None = ...,
    platform: Platform | str | None = ...,
    out: torch.Tensor | None = ...,
    lse: None = ...,
    return_lse: Literal[False],
    validate: ValidateMode = ...,
) -> torch.Tensor: ...


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
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    return_lse: bool = True,
    validate: ValidateMode = "fast",
) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
    """Absorbed MLA decode over a paged latent cache.

    Query row ``i`` of request ``b`` (``q_b`` rows, ``s_b`` keys) attends keys
    ``0 .. s_b - q_b + i`` of its block-table rows; values are the first ``kv_lora_rank``
    lanes of each cache row.

    Args:
        q: ``[T, H, kv_lora_rank + rope]`` bf16/fp16/fp32; ``T`` is the requests' rows
            (``query_start_loc[-1]``, or ``B`` without it): no row without a request.
        kv_cache: ``[num_blocks, block_size, kv_lora_rank + rope]``; bf16/fp16/fp32, or fp8
            with ``kv_scale`` (value = stored * kv_scale).
        block_table: int32/int64 ``[B, max_blocks]``.
        seq_lens: int ``[B]``: KV length of each request including its new tokens (0 marks a
            graph-padding request).
        query_start_loc: int ``[B+1]`` on q's device or on the host; default one token per
            request. A device tensor costs one device-to-host copy (pass the host copy, or
            ``None`` for single-token decode, to avoid it).
        softmax_scale: the model's scale, required: a finite float > 0 (there is no default:
            DeepSeek-V3's YaRN scale differs from ``192**-0.5``; never ``1/sqrt(576)``).
        kv_scale: the fp8 cache's dequant scale: a finite float > 0, or a 0-d/one-element float
            tensor on q's device (read on the device, no host sync); ``None`` for a float cache.
        provider: ``"auto"``, ``"torch"``, ``"triton"``, ``"aiter"`` or a provider object.
        strategy: force a decode strategy (class, ``NAME`` or class name); checked like
            automatic selection.
        platform: a :class:`Platform`, or an arch name such as ``"gfx950"`` to simulate.
        out: optional ``[T, H, kv_lora_rank]`` output in q's dtype (written in place).
        lse: optional ``[T, H]`` float32 LSE output (written in place).
        return_lse: ``False`` returns ``out`` alone and skips computing the LSE (unless ``lse``
            is given).
        validate: ``"fast"`` (default) checks shapes, dtypes and devices and never copies
            ``block_table`` or ``seq_lens`` to the host: lengths past the block table and
            out-of-range block ids are clamped on the device (memory-safe, not an error).
            ``"full"`` (debug) copies them and raises on any bad length or block id.

    Returns:
        ``(out [T, H, kv_lora_rank] in q's dtype, lse [T, H] float32 natural log)``, or ``out``
        when ``return_lse=False``.

    Raises:
        InvalidInputError: bad shapes, dtypes, devices (or, with ``validate="full"``, values).
        UnsupportedError: no strategy (or not the forced one) supports the case.
    """
    mode = require_validate_mode(validate)
    require_tensor("q", q, ndim=3)
    require_tensor("kv_cache", kv_cache, ndim=3)
    require_index("block_table", block_table, ndim=2)
    require_index("seq_lens", seq_lens, ndim=1)
    require_float("q", q)
    require_float("kv_cache", kv_cache, allow_fp8=True)
    tensors = [("kv_cache", kv_cache), ("block_table", block_table), ("seq_lens", seq_lens)]
    if query_start_loc is not None:
        require_index("query_start_loc", query_start_loc, ndim=1)
        if query_start_loc.device.type != "cpu":
            tensors.append(("query_start_loc", query_start_loc))
    require_same_device(("q", q), *tensors)
    softmax_scale = require_softmax_scale(softmax_scale)
    kv_lora_rank = require_int("kv_lora_rank", kv_lora_rank, minimum=1)
    require_bool("return_lse", return_lse)
    num_tokens, num_heads, width = q.shape
    cache_width = kv_cache.shape[-1]
    if cache_width <= kv_lora_rank:
        raise InvalidInputError(
            "kv_cache",
            f"last dim {cache_width} must be kv_lora_rank ({kv_lora_rank}) + rope dim (> 0); pass "
            "the latent cache [num_blocks, block_size, kv_lora_rank + rope] (or the model's kv_lora_rank)",
        )
    if width != cache_width:
        raise InvalidInputError(
            "q",
            f"last dim {width} must equal kv_cache's last dim {cache_width} (kv_lora_rank "
            f"{kv_lora_rank} + rope {cache_width - kv_lora_rank}): pass the absorbed query "
            "[q_nope @ W_UK^T | q_pe]",
        )
    check_cache_scale(kv_scale, kv_cache.dtype, device=q.device)
    if out is not None:
        _require_output("out", out, (num_tokens, num_heads, kv_lora_rank), q.dtype, q.device)
    if lse is not None:
        _require_output("lse", lse, (num_tokens, num_heads), torch.float32, q.device)
    num_requests = seq_lens.numel()
    qsl_cpu = None
    if query_start_loc is not None:
        if query_start_loc.numel() != num_requests + 1:
            raise InvalidInputError(
                "query_start_loc",
                f"expected {num_requests + 1} entries for {num_requests} requests, "
                f"got {query_start_loc.numel()}",
            )
        qsl_cpu = query_start_loc.cpu().to(torch.int64)
        _require_indptr_of_rows("query_start_loc", qsl_cpu, num_tokens, "q")
        qlens = qsl_cpu[1:] - qsl_cpu[:-1]
        max_qlen = max(1, int(qlens.max()) if qlens.numel() else 1)
    else:
        if num_tokens != num_requests:
            raise InvalidInputError(
                "q",
                f"has {num_tokens} rows for {num_requests} single-token requests (query_start_loc=None); "
                "pass query_start_loc for multi-token requests, or one row per request",
            )
        max_qlen = 1
    if out is None:
        out = torch.empty(num_tokens, num_heads, kv_lora_rank, dtype=q.dtype, device=q.device)
    if lse is None and return_lse:
        lse = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=q.device)
    if num_requests == 0:
        out.zero_()
        if lse is not None:
            lse.fill_(float("-inf"))
        return (out, lse) if return_lse and lse is not None else out
    num_blocks, block_size = kv_cache.shape[0], kv_cache.shape[1]
    max_decode_qlen = max(max_qlen, -(-num_tokens // num_requests))
    key = (
        tuple(q.shape), q.dtype, q.device, tuple(kv_cache.shape), kv_cache.dtype,
        tuple(block_table.shape), max_decode_qlen, softmax_scale, kv_lora_rank,
        provider, strategy, platform, mode,
    )  # fmt: skip
    entry = DECODE_PLANS.get(key)
    if entry is None:
        plat = resolve_platform(platform, q.device)
        forced = None if strategy is None else Resolver().forced_strategy(strategy, Phase.DECODE)
        dims = MLADims(
            num_heads=num_heads,
            kv_lora_rank=kv_lora_rank,
            qk_rope_head_dim=width - kv_lora_rank,
            softmax_scale=softmax_scale,
        )
        limits = EngineLimits(
            max_num_seqs=num_requests,
            max_model_len=max(1, block_table.shape[1] * block_size),
            max_num_batched_tokens=max(1, num_tokens),
            max_decode_qlen=max_decode_qlen,
        )
        backend = MLABackend(
            dims,
            KVCacheSpec(block_size, kv_cache.dtype, num_blocks=num_blocks),
            limits,
            model_dtype=q.dtype,
            provider=available_provider(provider, plat),
            platform=plat,
            device=q.device,
            decode_strategy=forced,
            preallocate=False,
            validate=mode,
        )
        unit = torch.arange(num_requests + 1, dtype=torch.int64)
        entry = DecodeEntry(backend, unit, unit.to(device=q.device, dtype=torch.int32))
        DECODE_PLANS.put(key, entry)
    backend = entry.backend
    if qsl_cpu is None:
        qsl_cpu, qsl = entry.unit_qsl_cpu, entry.unit_qsl
    elif query_start_loc is not None and query_start_loc.device == q.device:
        qsl = query_start_loc.to(torch.int32)
    else:
        qsl = qsl_cpu.to(device=q.device, dtype=torch.int32, non_blocking=True)
    seq_cpu = None
    if mode == "full":
        seq_cpu = seq_lens.cpu().to(torch.int64)
        check_paged_step(
            query_start_loc_cpu=qsl_cpu,
            seq_lens_cpu=seq_cpu,
            block_table=block_table,
            block_size=block_size,
            num_blocks=num_blocks,
            block_ids=True,
        )
    step = StepInputs(
        query_start_loc_cpu=qsl_cpu,
        query_start_loc=qsl,
        seq_lens=seq_lens.to(torch.int32),
        seq_lens_cpu=seq_cpu,
        block_table=block_table.to(torch.int32),
        num_decodes=num_requests,
        num_decode_tokens=num_tokens,
    )
    backend.builder.build(step)
    backend.run_decode(q, kv_cache, out, lse, backend.kv_scale_tensor(kv_scale))
    return (out, lse) if return_lse and lse is not None else out


def _require_indptr_of_rows(name: str, indptr_cpu: torch.Tensor, rows: int, rows_of: str) -> None:
    """``indptr_cpu`` (int64 on the host) is a valid indptr ending at ``rows``: every row of
    ``rows_of`` belongs to a request."""
    check_indptr(name, indptr_cpu, total=rows)
    if int(indptr_cpu[-1]) != rows:
        raise InvalidInputError(
            name,
            f"ends at {int(indptr_cpu[-1])} but {rows_of} has {rows} rows; every row of {rows_of} must "
            f"belong to a request (add the missing requests to {name}, or slice {rows_of})",
        )


def _require_output(
    name: str, tensor: object, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> None:
    value = require_tensor(name, tensor, ndim=len(shape))
    if tuple(value.shape) != shape:
        raise InvalidInputError(name, f"expected shape {shape}, got {tuple(value.shape)}")
    if value.dtype != dtype:
        raise InvalidInputError(name, f"expected dtype {dtype_name(dtype)}, got {dtype_name(value.dtype)}")
    if value.device != device:
        raise InvalidInputError(name, f"is on {value.device} but q is on {device}; move it to {device}")


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
    class name) fits.
    """
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        require_tensor(name, tensor, ndim=3)
        require_float(name, tensor)
    require_index("cu_seqlens_q", cu_seqlens_q, ndim=1)
    require_index("cu_seqlens_k", cu_seqlens_k, ndim=1)
    require_same_device(
        ("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)
    )
    softmax_scale = require_softmax_scale(softmax_scale)
    max_seqlen_q = require_int("max_seqlen_q", max_seqlen_q, minimum=0)
    max_seqlen_k = require_int("max_seqlen_k", max_seqlen_k, minimum=0)
    causal = require_bool("causal", causal)
    require_bool("return_lse", return_lse)
    num_tokens, num_heads, qk_dim = q.shape
    if k.shape[1:] != (num_heads, qk_dim):
        raise InvalidInputError("k", f"expected [Tk, {num_heads}, {qk_dim}] to match q, got {tuple(k.shape)}")
    if v.shape[0] != k.shape[0] or v.shape[1] != num_heads:
        raise InvalidInputError(
            "v", f"expected [{k.shape[0]}, {num_heads}, Dv] to match k, got {tuple(v.shape)}"
        )
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise InvalidInputError("k", f"q, k and v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if out is not None:
        _require_output("out", out, (num_tokens, num_heads, v.shape[-1]), q.dtype, q.device)
    if lse is not None:
        _require_output("lse", lse, (num_tokens, num_heads), torch.float32, q.device)
    cu_q_cpu = cu_seqlens_q.cpu().to(torch.int64)
    cu_k_cpu = cu_seqlens_k.cpu().to(torch.int64)
    _require_indptr_of_rows("cu_seqlens_q", cu_q_cpu, num_tokens, "q")
    _require_indptr_of_rows("cu_seqlens_k", cu_k_cpu, k.shape[0], "k")
    if cu_q_cpu.numel() != cu_k_cpu.numel():
        raise InvalidInputError(
            "cu_seqlens_k", f"has {cu_k_cpu.numel()} entries, cu_seqlens_q {cu_q_cpu.numel()}"
        )
    lens_q, lens_k = cu_q_cpu[1:] - cu_q_cpu[:-1], cu_k_cpu[1:] - cu_k_cpu[:-1]
    if lens_q.numel() and int(lens_q.max()) > max_seqlen_q:
        raise InvalidInputError("max_seqlen_q", f"{max_seqlen_q} < longest query {int(lens_q.max())}")
    if lens_k.numel() and int(lens_k.max()) > max_seqlen_k:
        raise InvalidInputError("max_seqlen_k", f"{max_seqlen_k} < longest key range {int(lens_k.max())}")
    key = (
        tuple(q.shape), tuple(k.shape), tuple(v.shape), q.dtype, q.device, lens_q.numel(),
        softmax_scale, provider, strategy, platform,
    )  # fmt: skip
    entry = PREFILL_PLANS.get(key)
    if entry is None:
        entry = prefill_entry(q, v, lens_q.numel(), softmax_scale, provider, strategy, platform)
        PREFILL_PLANS.put(key, entry)
    batch = PrefillBatch(
        context=entry.context,
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
    plan = entry.runner.build_metadata(batch)
    if out is None:
        out = torch.empty(num_tokens, num_heads, v.shape[-1], dtype=q.dtype, device=q.device)
    if lse is None:
        lse = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=q.device)
    entry.runner.run(plan, q, k, v, out=out, lse=lse)
    return (out, lse) if return_lse else out


def write_kv(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    kv_scale: float | torch.Tensor | None = None,
    provider: str | KernelProvider = "auto",
    platform: Platform | str | None = None,
    validate: ValidateMode = "fast",
) -> None:
    """Write new latent rows into the paged cache, in vLLM's ``concat_and_cache_mla`` order.

    kv_c ``[N, kv_lora_rank]`` and k_pe ``[N, rope]`` (float), kv_cache
    ``[num_blocks, block_size, kv_lora_rank + rope]`` (float, or fp8 with ``kv_scale``: the
    cache stores ``value / kv_scale``), slot_mapping int ``[N]`` flat slots
    ``block * block_size + offset`` (negative: skipped). ``kv_scale`` is a finite float > 0 or
    a 0-d / one-element float tensor on the cache's device, and ``None`` for a float cache.
    Slots outside the cache are skipped by every provider (memory-safe); ``validate="full"``
    reads ``slot_mapping`` on the host and rejects them, and any slot two tokens share. Runs
    ``mla::write_kv``. Raises :class:`InvalidInputError` naming the bad argument.
    """
    mode = require_validate_mode(validate)
    check_kv_write(kv_c, k_pe, kv_cache, slot_mapping, kv_scale, mode)
    prov = available_provider(provider, resolve_platform(platform, kv_cache.device))
    scale: torch.Tensor | None
    if isinstance(kv_scale, torch.Tensor):
        scale = kv_scale.reshape(1).to(torch.float32)
    elif kv_scale is not None:
        scale = torch.full((1,), kv_scale, dtype=torch.float32, device=kv_cache.device)
    else:
        scale = None
    ops.write_kv(kv_c, k_pe, kv_cache, slot_mapping, scale, ops.provider_handle(prov))
