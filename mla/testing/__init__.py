"""The conformance kit: run any strategy on generated cases and compare it to the reference math.

Users run it on their own strategy subclass; the project's own strategy tests use it too::

    from mla.testing import check_decode_strategy, decode_cases, emulated_provider

    for case in decode_cases(heads=(8, 16)):
        result = check_decode_strategy(MyDecode, case, provider="torch", platform="cpu")
        if not result.supported:
            print(f"{MyDecode.NAME}: {result.reasons}")   # pytest.skip(...) in a test
            continue
        result.assert_passed()

A decode check builds an :class:`~mla.engine.backend.MLABackend` sized for the case, forces the
strategy (the resolver runs the same ``supports`` checks as automatic selection), builds the
step's metadata, poisons the caller outputs with NaN, runs ``impl.forward_decode`` with an LSE
tensor and again with ``lse=None`` (the production default) and compares both to
:func:`mla.tools.reference.reference_decode` (float64). Inputs are random, never zeros; cache blocks
are a random permutation, so a strategy that assumes contiguous blocks fails. Prefill checks run
through :func:`mla.mla_prefill` or the backend (optionally with cached context expanded by a
random up-projection and merged by LSE).

Tolerances are relative Frobenius errors per output dtype (:data:`TOLERANCES`). An fp8 KV cache
uses the q/out dtype's tolerance, because the reference dequantizes the very same cache. A
strategy that rounds its inputs to fp8 (it exposes ``quantize(q, k, v)``, like
:class:`~mla.prefill.fp8_persistent.Fp8PersistentPrefill`) is compared with the reference computed
on its dequantized inputs, so the tolerance stays tight.

Sparse models (DeepSeek Sparse Attention, ``MLADims.index_topk``) have their own cases and
checks in :mod:`~mla.testing.sparse`::

    from mla.testing import check_sparse_strategy, sparse_cases

    for case in sparse_cases(phase="decode"):
        check_sparse_strategy(mla.SparseDecode, case, provider="torch", platform="cpu").assert_passed()

Each row attends a hand-made selection (``-1`` padding between and after its positions, rows
that select nothing, graph padding) over a cache that is NaN in every row the selection does not
name; :func:`~mla.testing.check_indexer_strategy` checks an indexer's top-k against the float64
scores without depending on how ties break; :func:`~mla.testing.check_sparse_lengths` checks that
a provider's sparse kernels write and honour per-row ``lengths`` (nothing read past a length).

Modules: :mod:`~mla.testing.compare` (tolerances, comparison, NaN poisoning),
:mod:`~mla.testing.cases` (case records and generators), :mod:`~mla.testing.inputs` (input
builders), :mod:`~mla.testing.sparse_cases` (sparse cases and inputs),
:mod:`~mla.testing.sparse` (sparse checks),
:mod:`~mla.testing.contexts` (context, backend and registry factories),
:mod:`~mla.testing.check` (check runners), :mod:`~mla.testing.triton_driver` (a stand-in
Triton driver: Triton's launch path on a machine without a GPU, launches recorded; imported on
its own, it needs Triton).
"""

from mla.providers import emulated_provider
from mla.testing.cases import (
    DEFAULT_FP8_KV_SCALE,
    DecodeCase,
    PaddingKind,
    PrefillCase,
    context_prefill_cases,
    decode_cases,
    pairwise,
    prefill_cases,
)
from mla.testing.check import (
    CheckResult,
    PrefillPath,
    check_decode_strategy,
    check_prefill_strategy,
    decode_support,
    prefill_support,
    rounded_inputs,
)
from mla.testing.compare import (
    TOLERANCES,
    Comparison,
    assert_matches_reference,
    compare_to_reference,
    poisoned_empty,
    tolerance_for,
)
from mla.testing.contexts import (
    as_platform,
    decode_case_backend,
    device_for,
    prefill_case_backend,
    reference_provider_with,
    scratch_registry,
    simulated_capabilities,
    simulated_decode_context,
    simulated_prefill_context,
)
from mla.testing.inputs import (
    CachedContext,
    DecodeInputs,
    PrefillInputs,
    RandomUpProjection,
    indptr,
    make_decode_inputs,
    make_prefill_inputs,
)
from mla.testing.sparse import (
    IndexerCheckResult,
    LengthsCheckResult,
    SparseCase,
    SparseInputs,
    check_indexer_strategy,
    check_sparse_lengths,
    check_sparse_strategy,
    encode_latent_cache,
    make_sparse_inputs,
    poisoned_index_cache,
    provider_kernels,
    sparse_case_backend,
    sparse_cases,
)

__all__ = [
    "DEFAULT_FP8_KV_SCALE",
    "TOLERANCES",
    "CachedContext",
    "CheckResult",
    "Comparison",
    "DecodeCase",
    "DecodeInputs",
    "IndexerCheckResult",
    "LengthsCheckResult",
    "PaddingKind",
    "PrefillCase",
    "PrefillInputs",
    "PrefillPath",
    "RandomUpProjection",
    "SparseCase",
    "SparseInputs",
    "as_platform",
    "assert_matches_reference",
    "check_decode_strategy",
    "check_indexer_strategy",
    "check_prefill_strategy",
    "check_sparse_lengths",
    "check_sparse_strategy",
    "compare_to_reference",
    "context_prefill_cases",
    "decode_case_backend",
    "decode_cases",
    "decode_support",
    "device_for",
    "emulated_provider",
    "encode_latent_cache",
    "indptr",
    "make_decode_inputs",
    "make_prefill_inputs",
    "make_sparse_inputs",
    "pairwise",
    "poisoned_empty",
    "poisoned_index_cache",
    "prefill_case_backend",
    "prefill_cases",
    "prefill_support",
    "provider_kernels",
    "reference_provider_with",
    "rounded_inputs",
    "scratch_registry",
    "simulated_capabilities",
    "simulated_decode_context",
    "simulated_prefill_context",
    "sparse_case_backend",
    "sparse_cases",
    "tolerance_for",
]
