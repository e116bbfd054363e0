"""Both prefill strategies match the reference, through ``mla_prefill`` and through the backend.

The backend path includes chunked cached context: latent rows gathered from a paged cache (bf16
or fp8), up-projected by a random ``expand_context`` callback, attended chunk by chunk and merged
by LSE, compared with a reference over ``[context | new tokens]``. Fp8PersistentPrefill is
compared with the reference on its own dequantized fp8 inputs, so the tolerance stays tight.
"""

from __future__ import annotations

import pytest
import torch

import mla
from mla.prefill.base import PrefillStrategy
from mla.testing import (
    PrefillCase,
    check_prefill_strategy,
    context_prefill_cases,
    emulated_provider,
    make_prefill_inputs,
    prefill_cases,
)

BF16, F32, FP8 = torch.bfloat16, torch.float32, torch.float8_e4m3fn
PROVIDERS = (("torch", "cpu"), ("aiter", "gfx942"), ("aiter", "gfx950"))

API_CASES = [
    *prefill_cases(),
    PrefillCase(heads=16, q_lens=(7, 20), kv_lens=(7, 31), seed=21),
    PrefillCase(heads=16, q_lens=(12,), dtype=F32, causal=False, seed=22),
]
"""Pairwise small-dim cases plus DeepSeek's 128+64 / 128 at 16 heads."""
BACKEND_CASES = [c for c in API_CASES if c.causal and c.keys == c.q_lens]
CONTEXT_CASES = [
    *context_prefill_cases(),
    PrefillCase(heads=16, q_lens=(3, 9), context_lens=(40, 17), kv_lora_rank=512, seed=23),
]


def _params(cases: list[PrefillCase]) -> list[object]:
    return [
        pytest.param(provider, arch, case, id=f"{provider}-{arch}-{case.id}")
        for provider, arch in PROVIDERS
        for case in cases
    ]


def _check(strategy: type[PrefillStrategy], provider: str, arch: str, case: PrefillCase, path: str) -> None:
    result = check_prefill_strategy(
        strategy,
        case,
        provider=emulated_provider(provider, arch),
        platform=arch,
        path=path,  # type: ignore[arg-type]
    )
    if not result.supported:
        pytest.skip(f"{strategy.NAME}: {result.reasons}")
    result.assert_passed()


@pytest.mark.parametrize("strategy", mla.PREFILL_STRATEGIES, ids=lambda s: s.NAME)
@pytest.mark.parametrize(("provider", "arch", "case"), _params(API_CASES))
def test_api_matches_reference(
    strategy: type[PrefillStrategy], provider: str, arch: str, case: PrefillCase
) -> None:
    _check(strategy, provider, arch, case, "api")


@pytest.mark.parametrize("strategy", mla.PREFILL_STRATEGIES, ids=lambda s: s.NAME)
@pytest.mark.parametrize(("provider", "arch", "case"), _params(BACKEND_CASES))
def test_backend_matches_reference(
    strategy: type[PrefillStrategy], provider: str, arch: str, case: PrefillCase
) -> None:
    _check(strategy, provider, arch, case, "backend")


@pytest.mark.parametrize("strategy", mla.PREFILL_STRATEGIES, ids=lambda s: s.NAME)
@pytest.mark.parametrize(("provider", "arch", "case"), _params(CONTEXT_CASES))
def test_chunked_context_matches_reference(
    strategy: type[PrefillStrategy], provider: str, arch: str, case: PrefillCase
) -> None:
    _check(strategy, provider, arch, case, "backend")


def test_fp8_prefill_refuses_chunked_context() -> None:
    result = check_prefill_strategy(
        mla.Fp8PersistentPrefill, CONTEXT_CASES[0], provider="torch", platform="cpu"
    )
    assert not result.supported
    assert result.support.codes == ("chunked-context",)


def test_context_is_split_into_several_chunks() -> None:
    """The small workspaces of the context cases really produce several chunks per request."""
    case = next(c for c in CONTEXT_CASES if c.context_chunk_tokens == 16)
    inputs = make_prefill_inputs(case)
    backend = mla.MLABackend(
        case.dims,
        mla.KVCacheSpec(case.block_size, case.cache_dtype),
        mla.EngineLimits(
            len(case.q_lens), max(c + q for c, q in zip(case.contexts, case.q_lens, strict=True)), 64
        ),
        model_dtype=case.dtype,
        provider="torch",
        platform="cpu",
        context_chunk_tokens=case.context_chunk_tokens,
    )
    metadata = backend.builder.build(inputs.step())
    assert metadata.prefill is not None
    chunks = metadata.prefill.context_chunks
    assert len(chunks) == -(-max(case.contexts) // case.context_chunk_tokens)
    assert sum(chunk.num_tokens for chunk in chunks) == sum(case.contexts)


def test_fp8_reference_uses_dequantized_inputs() -> None:
    """Against the unrounded reference the fp8 prefill misses the f32 tolerance; against its own
    dequantized inputs it meets it (so the kit's comparison is the tight one)."""
    case = PrefillCase(heads=16, q_lens=(9, 4), dtype=F32, qk_nope_dim=32, rope_dim=16, v_dim=24)
    result = check_prefill_strategy(mla.Fp8PersistentPrefill, case, provider="torch", platform="cpu")
    result.assert_passed()
    inputs = make_prefill_inputs(case)
    out, _ = mla.mla_prefill(
        inputs.q,
        inputs.k,
        inputs.v,
        inputs.cu_seqlens_q,
        inputs.cu_seqlens_k,
        inputs.max_seqlen_q,
        inputs.max_seqlen_k,
        softmax_scale=case.scale,
        provider="torch",
        strategy=mla.Fp8PersistentPrefill,
        platform="cpu",
    )
    ref_out, _ = inputs.reference()
    error = float((out.double() - ref_out).norm() / ref_out.norm())
    assert error > 1e-3
