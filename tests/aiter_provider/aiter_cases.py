"""Helpers of the aiter provider tests: build a backend on the (fake) aiter provider, run a step,
and compare it to the float64 reference (mla.tools.reference via mla.testing)."""

from __future__ import annotations

import attrs
import torch

from mla import Knobs, MLABackend, simulated_platform
from mla.core.capabilities import ProviderCapabilities
from mla.core.config import is_fp8
from mla.decode.base import DecodeStrategy
from mla.prefill.base import PrefillStrategy
from mla.providers.aiter import AiterProvider
from mla.providers.aiter.capabilities import ARCH_FP8
from mla.providers.quant import dequantize, quantize_per_tensor
from mla.testing import (
    Comparison,
    DecodeCase,
    PrefillCase,
    compare_to_reference,
    decode_case_backend,
    make_decode_inputs,
    make_prefill_inputs,
    prefill_case_backend,
    rounded_inputs,
)
from mla.tools.reference import reference_decode

LATENT = {"kv_lora_rank": 512, "rope_dim": 64}
"""aiter's decode kernels take 576-wide rows (512 + 64); the fake enforces it."""
PREFILL_DIMS = {"qk_nope_dim": 128, "rope_dim": 64, "v_dim": 128, "kv_lora_rank": 512}
"""DeepSeek's MHA-form prefill dims (the fp8 prefill kernel is built for 192/128)."""


def fake_provider(**overrides: bool | None) -> AiterProvider:
    """The aiter provider running on CPU tensors against the fake (no ROCm device check)."""
    return AiterProvider(require_rocm_device=False, **overrides)


def fp8_for(arch: str) -> torch.dtype:
    return ARCH_FP8[arch]


def platform(arch: str, *, small_head_mode: str = "auto", fp8_prefill: str = "auto"):  # type: ignore[no-untyped-def]
    return simulated_platform(arch, knobs=Knobs(small_head_mode=small_head_mode, fp8_prefill=fp8_prefill))  # type: ignore[arg-type]


def decode_case(heads: int, qlens: tuple[int, ...], seq_lens: tuple[int, ...], **kw: object) -> DecodeCase:
    return DecodeCase(heads=heads, qlens=qlens, seq_lens=seq_lens, **LATENT, **kw)  # type: ignore[arg-type]


def decode_backend(
    provider: AiterProvider,
    arch: str,
    case: DecodeCase,
    *,
    num_blocks: int,
    force: str | type[DecodeStrategy] | None = None,
    small_head_mode: str = "auto",
    preallocate: bool = True,
) -> MLABackend:
    return decode_case_backend(
        case,
        provider=provider,
        platform=platform(arch, small_head_mode=small_head_mode),
        strategy=force,
        device="cpu",
        num_blocks=num_blocks,
        preallocate=preallocate,
    )


@attrs.frozen
class DecodeRun:
    strategy: str
    comparison: Comparison
    capabilities: ProviderCapabilities


def run_decode(
    provider: AiterProvider,
    arch: str,
    case: DecodeCase,
    *,
    force: str | type[DecodeStrategy] | None = None,
    small_head_mode: str = "auto",
    preallocate: bool = True,
) -> DecodeRun:
    """Build, run (outputs NaN-poisoned) and compare one decode step.

    With an fp8 cache the reference uses the query exactly as the asm kernels see it (rounded to
    fp8 per tensor) on paged strategies; small-head ones keep the bf16 query.
    """
    inputs = make_decode_inputs(case)
    backend = decode_backend(
        provider,
        arch,
        case,
        num_blocks=inputs.kv_cache.shape[0],
        force=force,
        small_head_mode=small_head_mode,
        preallocate=preallocate,
    )
    metadata = backend.builder.build(inputs.step())
    assert metadata.decode is not None
    out, lse = inputs.poisoned_outputs()
    backend.impl.forward_decode(
        metadata, inputs.q, inputs.kv_cache, out=out, lse=lse, kv_scale=inputs.kv_scale
    )
    q_ref = inputs.q
    if is_fp8(case.kv_dtype) and "gluon" not in metadata.decode.strategy:
        # The asm kernels see the query rounded to fp8 with one scale over the rows they get
        # (a qlen-padded step gathers only the rows requests own).
        owned = int(inputs.query_start_loc[-1])
        source = inputs.q[:owned] if getattr(metadata.decode, "qlen_padded", False) else inputs.q
        _, scale = quantize_per_tensor(source, case.kv_dtype)
        finfo = torch.finfo(case.kv_dtype)
        rounded = torch.clamp(inputs.q.float() / scale, finfo.min, finfo.max).to(case.kv_dtype)
        q_ref = dequantize(rounded, scale).to(torch.float64)
    ref_out, ref_lse = reference_decode(
        q_ref,
        inputs.kv_cache,
        inputs.block_table,
        inputs.seq_lens,
        inputs.query_start_loc,
        softmax_scale=case.scale,
        kv_lora_rank=case.kv_lora_rank,
        kv_scale=inputs.kv_scale,
    )
    return DecodeRun(
        metadata.decode.strategy, compare_to_reference(out, lse, ref_out, ref_lse), backend.capabilities
    )


def prefill_case(heads: int, q_lens: tuple[int, ...], **kw: object) -> PrefillCase:
    return PrefillCase(heads=heads, q_lens=q_lens, **PREFILL_DIMS, **kw)  # type: ignore[arg-type]


def run_prefill(
    provider: AiterProvider,
    arch: str,
    case: PrefillCase,
    *,
    fp8_prefill: str = "auto",
    force: str | type[PrefillStrategy] | None = None,
) -> tuple[str, Comparison]:
    """One backend prefill step (cached context read, expanded and merged when the case has
    it); compared to the reference on the inputs the chosen strategy really computes with."""
    inputs = make_prefill_inputs(case)
    backend = prefill_case_backend(
        case,
        provider=provider,
        platform=platform(arch, fp8_prefill=fp8_prefill),
        strategy=force,
        device="cpu",
        num_blocks=inputs.context.kv_cache.shape[0],
        preallocate=True,
    )
    metadata = backend.builder.build(inputs.step())
    assert metadata.prefill is not None
    out, lse = inputs.poisoned_outputs()
    backend.impl.forward_prefill(
        metadata,
        inputs.q,
        inputs.k,
        inputs.v,
        out=out,
        lse=lse,
        kv_cache=inputs.context.kv_cache,
        kv_scale=inputs.context.kv_scale,
        expand_context=inputs.context.expand,
    )
    strategy = backend.prefill_strategy(metadata.prefill.strategy)
    rounded = rounded_inputs(strategy, inputs.q, inputs.k, inputs.v)
    ref_out, ref_lse = inputs.reference(*rounded) if rounded is not None else inputs.reference()
    return metadata.prefill.strategy, compare_to_reference(out, lse, ref_out, ref_lse)
