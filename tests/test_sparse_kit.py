"""The conformance kit on the sparse strategies: every sparse strategy (and the indexer) on every
provider available, and the kit catching strategies that get the contract wrong.

Providers: torch always; Triton in its CPU interpreter (``TRITON_INTERPRET=1``, set by
tests/conftest.py without a GPU; compiled on a GPU) at tiny shapes with fp16/fp32 queries (the
interpreter computes ``tl.dot`` on bf16 wrongly); Gluon where it runs (it serves the sparse
contracts with the Triton kernels). A provider whose record or class lacks the sparse kernels
skips with the kit's reason.
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import torch

import mla
from mla.core.capabilities import Contract
from mla.core.platform import Platform
from mla.providers import TorchProvider
from mla.providers.base import KernelProvider
from mla.providers.calls import SparseAttentionCall, SparseSlotsCall
from mla.testing import (
    SparseCase,
    check_indexer_strategy,
    check_sparse_lengths,
    check_sparse_strategy,
    provider_kernels,
    sparse_cases,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
F16, F32, BF16, E4M3 = torch.float16, torch.float32, torch.bfloat16, torch.float8_e4m3fn
PROVIDERS = ("torch", "triton", "gluon")


@pytest.fixture(autouse=True)
def _one_thread() -> Any:
    """Tiny tensors: one intra-op thread (parallel kernels only add wake-ups on a busy host)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _provider(name: str) -> tuple[KernelProvider, Platform]:
    """The provider and the platform its checks run on; skips when it cannot run here."""
    if name == "torch":
        platform = mla.simulated_platform("cpu") if DEVICE.type == "cpu" else mla.detect_platform()
        return mla.get_provider("torch"), platform
    try:
        provider = mla.get_provider(name)
    except mla.ProviderUnavailableError as exc:
        pytest.skip(str(exc))
    available = provider.availability()
    if not available:
        pytest.skip(f"{name}: {available}")
    # The interpreter: Hopper's record (e4m3 converts, so fp8_ds_mla and fp8 keys are in it).
    platform = mla.simulated_platform("sm90") if DEVICE.type == "cpu" else mla.detect_platform()
    return provider, platform


def _torch_cases(phase: str) -> list[SparseCase]:
    return list(sparse_cases(phase=phase))  # type: ignore[arg-type]


def _interpreter_cases(phase: str) -> list[SparseCase]:
    """Tiny shapes (one head block, one 64-slot tile) and fp16/fp32 queries."""
    return list(
        sparse_cases(
            phase=phase,  # type: ignore[arg-type]
            heads=(3,),
            decode_patterns=((1, 3),),
            prefill_patterns=(((3, 2), (5, 0)),),
            block_sizes=(4,),
            dtypes=((F16, F16), (F32, F32), (F16, E4M3), (F32, "fp8_ds_mla")),
            topks=(8,),
            padding=("both",),
            rope_dim=16,
            max_seq_len=24,
            index_key_dtype=F16,
        )
    )


def _cases(provider: str, phase: str) -> list[SparseCase]:
    return _torch_cases(phase) if provider == "torch" else _interpreter_cases(phase)


STRATEGY_PARAMS = [
    pytest.param(strategy, provider, id=f"{strategy.NAME}-{provider}")
    for strategy in mla.SPARSE_STRATEGIES
    for provider in PROVIDERS
]


@pytest.mark.parametrize(("strategy", "provider"), STRATEGY_PARAMS)
def test_sparse_strategy_passes_the_kit(strategy: type[mla.SparseStrategy[Any]], provider: str) -> None:
    prov, platform = _provider(provider)
    kernels = provider_kernels(prov, platform, (Contract.SPARSE_ATTENTION,))
    if not kernels:
        pytest.skip(f"{provider}: {kernels}")
    phase = "decode" if strategy.PHASE is mla.Phase.DECODE else "prefill"
    cases = _cases(provider, phase)
    failures = []
    for case in cases:
        result = check_sparse_strategy(strategy, case, provider=prov, platform=platform, device=DEVICE)
        if not result.ok:  # unsupported counts too: every case is one the provider claims
            failures.append(str(result))
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_sparse_kernels_write_and_honour_lengths(provider: str) -> None:
    prov, platform = _provider(provider)
    kernels = provider_kernels(prov, platform, (Contract.SPARSE_ATTENTION,))
    if not kernels:
        pytest.skip(f"{provider}: {kernels}")
    failures = []
    for phase in ("decode", "prefill"):
        for case in _cases(provider, phase):
            result = check_sparse_lengths(case, provider=prov, platform=platform, device=DEVICE)
            if not result.ok:  # unsupported counts too: every case is one the provider claims
                failures.append(str(result))
    assert not failures, "\n".join(failures)


INDEXER_PARAMS = [
    pytest.param(indexer, provider, id=f"{indexer.NAME}-{provider}")
    for indexer in (mla.LightningIndexer,)
    for provider in PROVIDERS
]


@pytest.mark.parametrize(("indexer", "provider"), INDEXER_PARAMS)
def test_indexer_passes_the_kit(indexer: type[mla.IndexerStrategy], provider: str) -> None:
    prov, platform = _provider(provider)
    kernels = provider_kernels(prov, platform, (Contract.INDEXER, Contract.SPARSE_ATTENTION))
    if not kernels:
        pytest.skip(f"{provider}: {kernels}")
    key_dtypes = (F32, BF16, E4M3) if provider == "torch" else (F16, E4M3)
    failures = []
    for phase in ("decode", "prefill"):
        for index, base in enumerate(_cases(provider, phase)[:4]):
            case = attrs.evolve(base, index_key_dtype=key_dtypes[index % len(key_dtypes)])
            result = check_indexer_strategy(indexer, case, provider=prov, platform=platform, device=DEVICE)
            if not result.ok:
                failures.append(str(result))
    assert not failures, "\n".join(failures)


# -- the kit catches what it should ---------------------------------------------------------------

CASE = SparseCase(heads=3, qlens=(1, 3), seq_lens=(30, 21), topk=8, extra_rows=1, q_dtype=F32, kv_dtype=F32)


class ClampsPadding(mla.SparseDecode):
    """Takes ``-1`` for position 0 (reads a row no one selected)."""

    NAME = "test-clamps-padding"

    def run(self, plan, q, kv_cache, topk_indices, **kwargs):  # type: ignore[no-untyped-def]
        super().run(plan, q, kv_cache, topk_indices.clamp(min=0), **kwargs)


class PadsWithFarPositions(mla.SparseDecode):
    """Pads with a position past every window: masked (the output is right), but counted."""

    NAME = "test-pads-with-far-positions"

    def run(self, plan, q, kv_cache, topk_indices, **kwargs):  # type: ignore[no-untyped-def]
        far = torch.where(topk_indices < 0, 10_000, topk_indices)
        super().run(plan, q, kv_cache, far, **kwargs)


class FirstPositions(mla.LightningIndexer):
    """Keeps the first positions of each window instead of the best ones."""

    NAME = "test-first-positions"

    def run(self, plan, q, weights, index_cache, *, out):  # type: ignore[no-untyped-def]
        super().run(plan, q, weights, index_cache, out=out)
        columns = torch.arange(out.shape[1], dtype=torch.int32)[None, :]
        out.copy_(torch.where(columns < plan.row_keys[:, None], columns, -1))


class IgnoresLengths(TorchProvider):
    """Attends every column (reads the rows past each length)."""

    def sparse_attention(self, call: SparseAttentionCall) -> None:
        super().sparse_attention(attrs.evolve(call, lengths=None))


class WritesNoLengths(TorchProvider):
    """Converts the slots but leaves the lengths output as it was."""

    def sparse_slots(self, call: SparseSlotsCall) -> None:
        super().sparse_slots(attrs.evolve(call, lengths=None))


def test_lengths_check_passes_torch_and_catches_both_halves() -> None:
    check_sparse_lengths(CASE, provider="torch", platform="cpu").assert_passed()
    reads = check_sparse_lengths(CASE, provider=IgnoresLengths(), platform="cpu")
    assert reads.supported
    assert reads.wrong_lengths == 0
    with pytest.raises(AssertionError, match="MISMATCH"):
        reads.assert_passed()
    unwritten = check_sparse_lengths(CASE, provider=WritesNoLengths(), platform="cpu")
    assert unwritten.comparison is not None
    assert unwritten.comparison.ok  # the attention got the right cut lengths
    assert unwritten.wrong_lengths == CASE.num_tokens
    with pytest.raises(AssertionError, match="wrote a wrong length"):
        unwritten.assert_passed()


def test_lengths_check_reports_a_provider_without_the_kernels() -> None:
    aiter = mla.testing.emulated_provider("aiter", "gfx950")
    result = check_sparse_lengths(CASE, provider=aiter, platform="gfx950")
    assert not result.supported
    assert "missing-kernel" in result.reasons
    assert "not supported" in str(result)


def test_reading_an_unselected_row_fails_the_kit() -> None:
    result = check_sparse_strategy(ClampsPadding, CASE, provider="torch", platform="cpu")
    assert result.supported
    assert result.ran == ClampsPadding.NAME
    assert not result.ok
    with pytest.raises(AssertionError, match="MISMATCH"):
        result.assert_passed()
    check_sparse_strategy(mla.SparseDecode, CASE, provider="torch", platform="cpu").assert_passed()


def test_masked_entries_in_a_valid_selection_fail_the_kit() -> None:
    result = check_sparse_strategy(PadsWithFarPositions, CASE, provider="torch", platform="cpu")
    assert result.comparison is not None
    assert result.comparison.ok  # masked: never read
    assert result.invalid_indices > 0
    with pytest.raises(AssertionError, match="masked as invalid"):
        result.assert_passed()


def test_an_indexer_that_is_not_a_top_k_fails_the_kit() -> None:
    case = SparseCase(heads=2, qlens=(1, 2), seq_lens=(40, 25), topk=8, extra_rows=2, q_dtype=F32)
    good = check_indexer_strategy(mla.LightningIndexer, case, provider="torch", platform="cpu")
    good.assert_passed()
    bad = check_indexer_strategy(FirstPositions, case, provider="torch", platform="cpu")
    assert bad.ran == FirstPositions.NAME
    assert bad.gap > bad.tolerance
    with pytest.raises(AssertionError, match="selection gap"):
        bad.assert_passed()


def test_a_provider_without_the_sparse_kernels_is_reported_unsupported() -> None:
    aiter = mla.testing.emulated_provider("aiter", "gfx950")
    result = check_sparse_strategy(mla.SparseDecode, CASE, provider=aiter, platform="gfx950")
    assert not result.supported
    assert "missing-kernel" in result.reasons
    assert "sparse-attention" in result.reasons


def test_a_phase_mismatch_is_a_usage_error() -> None:
    with pytest.raises(ValueError, match="decode step"):
        check_sparse_strategy(mla.SparsePrefill, CASE, provider="torch", platform="cpu")


def test_case_ids_name_phase_format_and_padding() -> None:
    cases = list(sparse_cases(phase="decode"))
    assert len({c.id for c in cases}) == len(cases)
    assert any("ds_mla" in c.id for c in cases)
    assert any("-x" in c.id for c in cases)
    assert all(c.id.startswith("decode-") for c in cases)
    assert all(c.phase == "prefill" for c in sparse_cases(phase="prefill"))
