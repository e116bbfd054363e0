"""Both prefill strategies match the reference, through ``mla_prefill`` and through the backend.

The backend path includes chunked cached context: latent rows gathered from a paged cache (bf16
or fp8), up-projected by a random ``expand_context`` callback, attended chunk by chunk and merged
by LSE, compared with a reference over ``[context | new tokens]``. Fp8PersistentPrefill is
compared with the reference on its own dequantized fp8 inputs, so the tolerance stays tight.
Only the supported strategy × case pairs are collected (``strategy_matrix``);
``test_every_strategy_is_exercised`` guards their number.
"""

from __future__ import annotations

import pytest
import torch
from strategy_matrix import Matrix, supported_matrix

import mla
from mla.prefill.base import PrefillStrategy
from mla.providers.gluon.provider import GluonProvider
from mla.testing import (
    PrefillCase,
    PrefillPath,
    check_prefill_strategy,
    context_prefill_cases,
    emulated_provider,
    make_prefill_inputs,
    prefill_cases,
    prefill_support,
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
    # expand_context's k_nope form (strided views; the rope lanes read from the latent): several
    # chunks with one-token and context-free requests, an fp8 cache, DeepSeek's dims
    PrefillCase(
        heads=2, q_lens=(1, 6, 3), context_lens=(40, 0, 19), dtype=F32, block_size=4,
        context_chunk_tokens=16, qk_nope_dim=32, rope_dim=16, v_dim=24, kv_lora_rank=64,
        context_nope_keys=True, seed=24,
    ),
    PrefillCase(
        heads=16, q_lens=(5, 1), context_lens=(70, 33), kv_dtype=FP8, block_size=16,
        context_chunk_tokens=32, qk_nope_dim=32, rope_dim=16, v_dim=24, kv_lora_rank=64,
        context_nope_keys=True, seed=25,
    ),
    PrefillCase(
        heads=16, q_lens=(3, 9), context_lens=(40, 17), kv_lora_rank=512, context_nope_keys=True, seed=26
    ),
]  # fmt: skip


def _matrix(cases: list[PrefillCase], path: PrefillPath) -> Matrix:
    """The supported strategy × case pairs of ``cases`` on ``path``, asked at collection time."""
    return supported_matrix(
        mla.PREFILL_STRATEGIES,
        PROVIDERS,
        lambda _provider: cases,
        lambda strategy, case, prov, arch: prefill_support(
            strategy, case, provider=prov, platform=arch, path=path
        ),
        lambda case: case.id,
    )


API = _matrix(API_CASES, "api")
BACKEND = _matrix(BACKEND_CASES, "backend")
CONTEXT = _matrix(CONTEXT_CASES, "backend")


def _check(
    strategy: type[PrefillStrategy], provider: str, arch: str, case: PrefillCase, path: PrefillPath
) -> None:
    result = check_prefill_strategy(
        strategy, case, provider=emulated_provider(provider, arch), platform=arch, path=path
    )
    assert result.supported, f"collected as supported, then declined: {result.reasons}"
    result.assert_passed()


@pytest.mark.parametrize(("strategy", "provider", "arch", "case"), API.params)
def test_api_matches_reference(
    strategy: type[PrefillStrategy], provider: str, arch: str, case: PrefillCase
) -> None:
    _check(strategy, provider, arch, case, "api")


@pytest.mark.parametrize(("strategy", "provider", "arch", "case"), BACKEND.params)
def test_backend_matches_reference(
    strategy: type[PrefillStrategy], provider: str, arch: str, case: PrefillCase
) -> None:
    _check(strategy, provider, arch, case, "backend")


@pytest.mark.parametrize(("strategy", "provider", "arch", "case"), CONTEXT.params)
def test_chunked_context_matches_reference(
    strategy: type[PrefillStrategy], provider: str, arch: str, case: PrefillCase
) -> None:
    _check(strategy, provider, arch, case, "backend")


# Expected coverage (the supported counts of the selections above, exact as of writing), so a
# regression in ``supports`` cannot silently shrink the matrix.
MIN_SUPPORTED: dict[str, dict[tuple[str, str, str], int]] = {
    "api": {
        ("torch", "cpu", "flash-varlen"): 27,
        ("torch", "cpu", "fp8-persistent-prefill"): len(API_CASES),
        ("aiter", "gfx942", "flash-varlen"): 7,
        ("aiter", "gfx950", "flash-varlen"): 7,
        ("aiter", "gfx950", "fp8-persistent-prefill"): 12,
    },
    "backend": {
        ("torch", "cpu", "flash-varlen"): 8,
        ("torch", "cpu", "fp8-persistent-prefill"): len(BACKEND_CASES),
        ("aiter", "gfx942", "flash-varlen"): 2,
        ("aiter", "gfx950", "flash-varlen"): 2,
        ("aiter", "gfx950", "fp8-persistent-prefill"): 3,
    },
    "context": {
        ("torch", "cpu", "flash-varlen"): 11,
        ("aiter", "gfx942", "flash-varlen"): 7,
        ("aiter", "gfx950", "flash-varlen"): 7,
    },
}


@pytest.mark.parametrize(("name", "matrix"), [("api", API), ("backend", BACKEND), ("context", CONTEXT)])
def test_every_strategy_is_exercised(name: str, matrix: Matrix) -> None:
    """Each strategy keeps its collected cases per provider (at least the counts above), every
    strategy that may run a path is collected on it, and the collected pairs are exactly the
    supported ones."""
    for key, expected in MIN_SUPPORTED[name].items():
        assert matrix.counts[key] >= expected, (name, key, matrix.counts[key])
    for strategy in mla.PREFILL_STRATEGIES:
        collected = sum(n for (_, _, s), n in matrix.counts.items() if s == strategy.NAME)
        if name == "context" and strategy is mla.Fp8PersistentPrefill:
            assert collected == 0  # no context-merge path: test_fp8_prefill_refuses_chunked_context
        else:
            assert collected >= 1, (name, strategy.NAME)
    assert len(matrix.params) == sum(matrix.counts.values())


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


GPU_CONTEXT_CASES = [
    PrefillCase(
        heads=16, q_lens=(1, 200, 77, 1), context_lens=(300, 0, 1000, 64), block_size=64,
        context_chunk_tokens=512, context_nope_keys=nope, seed=27,
    )
    for nope in (False, True)
]  # fmt: skip
"""bf16 at DeepSeek's 128+64/128 with a 512-dim latent, several chunks (a 512-token workspace),
one-token and context-free requests, both ``expand_context`` forms."""


@pytest.mark.gpu
@pytest.mark.parametrize("provider", ["triton", "gluon", "gluon-triton-prefill"])
@pytest.mark.parametrize("case", GPU_CONTEXT_CASES, ids=lambda case: case.id)
def test_chunked_context_on_the_gpu(provider: str, case: PrefillCase) -> None:
    """The chunked-context step on the GPU providers' kernels (the split keys and the epilogue
    merge of the varlen kernel; ``gluon`` runs the new tokens' pass on the Gluon prefill kernel,
    ``gluon-triton-prefill`` on the Triton kernel), NaN-poisoned outputs, against the float64
    reference."""
    chosen = (
        GluonProvider(prefill="triton") if provider == "gluon-triton-prefill" else mla.get_provider(provider)
    )
    available = chosen.availability()
    if not available:
        pytest.skip(f"{provider}: {available}")
    platform = mla.detect_platform("cuda")
    assert chosen.capabilities(platform).varlen_context_operands
    result = check_prefill_strategy(mla.FlashVarlen, case, provider=chosen, platform=platform, device="cuda")
    assert result.supported, result.reasons
    result.assert_passed()
