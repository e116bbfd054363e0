"""The conformance kit for DeepSeek Sparse Attention: sparse strategies and indexer strategies.

A sparse check builds an :class:`~mla.engine.backend.MLABackend` for a sparse model
(``MLADims.index_topk``) sized for a :class:`SparseCase`, forces the strategy, builds the
step, poisons the caller outputs with NaN, runs ``impl.forward_sparse_decode`` (or
``forward_sparse_prefill``) over the case's hand-made selection with an LSE tensor and again
with ``lse=None``, and compares both with :func:`mla.tools.reference.reference_sparse`
(float64). The selection is request-local positions inside each row's causal window, in random
columns with ``-1`` between and after them; some rows select nothing; graph-padding rows and
``seq_len == 0`` requests select only ``-1``. Every cache row no row of its request selects
(owned or not, the null rows and stale block-table columns included) is NaN (``fp8_ds_mla``:
NaN tile scales), so a kernel that reads one (a ``-1`` taken for position 0, a clamped index)
fails. A valid selection must not be counted as invalid (``backend.invalid_index_count()``).
The strategies' runs hand the kernel each row's length (``1 +`` its last valid column), so the
case's ``-1`` tails exercise :attr:`~mla.providers.calls.SparseAttentionCall.lengths` too.

A lengths check (:func:`check_sparse_lengths`) calls a provider's sparse kernels directly: its
``sparse_slots`` must write every row's length, and its ``sparse_attention`` must read nothing at
or past a length that cuts a row through its selected slots (the cache rows only those columns
select are NaN).

An indexer check (:func:`check_indexer_strategy`) writes the index keys of every owned position
through ``impl.write_index_keys`` into a NaN-poisoned index-key cache, runs ``impl.index_topk``
into a poisoned output and checks the selection against
:func:`mla.tools.reference.reference_index_scores` without depending on how ties break (every
position kept outscores every visible position left out, up to the tolerance), and that rows
that see nothing (graph padding) hold only ``-1``.

Both report unsupported (``supported == False``, with reasons) when the provider's record lacks
the contract or its class does not implement it, so a test can ``pytest.skip`` while a
provider's sparse kernels are not in yet. The cases and their inputs are in
:mod:`mla.testing.sparse_cases` (re-exported here).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial
from typing import Any

import attrs
import torch

from mla.core.capabilities import Contract
from mla.core.config import (
    EngineLimits,
    KVCacheSpec,
    dtype_name,
)
from mla.core.errors import UnsupportedError
from mla.core.platform import Platform
from mla.core.support import Reason, Support
from mla.engine.backend import MLABackend
from mla.engine.decision.registry import Registry
from mla.providers import resolve_provider
from mla.providers.base import CONTRACT_METHODS, KernelProvider
from mla.providers.calls import SparseAttentionCall, SparseSlotsCall
from mla.providers.sparse_slots import slot_lengths
from mla.providers.sparse_slots import sparse_slots as default_sparse_slots
from mla.sparse.base import SparseStrategy
from mla.sparse.indexer import IndexerStrategy
from mla.strategy import Phase
from mla.testing.check import CheckResult, _unsupported, _Verdict, _with_and_without_lse
from mla.testing.compare import Comparison, tolerance_for
from mla.testing.contexts import _case_backend, _decode_limits, as_platform, device_for
from mla.testing.sparse_cases import (
    DEFAULT_SPARSE_DTYPES,
    SELECTION_POISON,
    SparseCase,
    SparseInputs,
    SparsePhase,
    encode_latent_cache,
    make_sparse_inputs,
    poisoned_index_cache,
    random_selection,
    sparse_cases,
)
from mla.tools.demo_sparse import SELECTION_TOLERANCE, selection_gap
from mla.tools.reference import reference_index_scores

# -- backends and support -----------------------------------------------------------------------


def sparse_case_backend(
    case: SparseCase,
    *,
    provider: str | KernelProvider,
    platform: Platform | str,
    strategy: str | type[SparseStrategy[Any]] | None = None,
    indexer_strategy: type[IndexerStrategy] | None = None,
    registry: Registry | None = None,
    device: torch.device | str | None = None,
    num_blocks: int | None = None,
    preallocate: bool = False,
) -> MLABackend:
    """A sparse model's backend sized for ``case`` (its phase's limits, ``index_topk`` its
    ``topk``, its indexer spec): ``strategy`` forces the phase's strategy (through the
    resolver's checks), ``indexer_strategy`` the indexer; the other arguments as
    :func:`~mla.testing.decode_case_backend`."""
    if case.phase == "decode":
        limits = _decode_limits(case)
    else:
        limits = EngineLimits(
            max_num_seqs=case.num_requests,
            max_model_len=max(case.seq_lens),
            max_num_batched_tokens=case.num_tokens,
        )
    forced = {"decode_strategy" if case.phase == "decode" else "prefill_strategy": strategy}
    return _case_backend(
        case.dims,
        KVCacheSpec(case.block_size, case.kv_dtype, num_blocks=num_blocks),
        limits,
        model_dtype=case.q_dtype,
        provider=provider,
        platform=platform,
        device=device,
        registry=registry,
        preallocate=preallocate,
        indexer=case.indexer,
        indexer_strategy=indexer_strategy,
        **forced,
    )


def provider_kernels(provider: KernelProvider, platform: Platform, contracts: Sequence[Contract]) -> Support:
    """Whether ``provider`` runs ``contracts`` on ``platform``: its record lists each and its
    class overrides each contract's methods (a provider whose record claims a contract before
    its kernels are in reports ``missing-kernel`` here instead of raising mid-run)."""
    caps = provider.capabilities(platform)
    reasons: list[Reason] = []
    for contract in contracts:
        methods = CONTRACT_METHODS[contract]
        missing = [m for m in methods if getattr(type(provider), m) is getattr(KernelProvider, m)]
        if not caps.has(contract) or missing:
            reasons.append(
                Reason(
                    "missing-kernel",
                    f"provider {provider.name!r} does not ship the {contract.value} kernel on "
                    f"{platform.arch}" + (f" ({', '.join(missing)} not implemented)" if missing else ""),
                )
            )
    return Support(tuple(reasons))


def _phase_of(strategy_cls: type[SparseStrategy[Any]]) -> SparsePhase:
    return "decode" if strategy_cls.PHASE is Phase.DECODE else "prefill"


# -- checks -------------------------------------------------------------------------------------


def check_sparse_strategy(
    strategy_cls: type[SparseStrategy[Any]],
    case: SparseCase,
    *,
    provider: str | KernelProvider,
    platform: Platform | str,
    registry: Registry | None = None,
    device: torch.device | str | None = None,
) -> CheckResult:
    """Run ``case`` through an :class:`~mla.MLABackend` with the sparse ``strategy_cls`` forced
    and compare with :func:`~mla.tools.reference.reference_sparse`.

    The case's phase must be the strategy's. One plan is built and run twice over the case's
    selection: with an LSE tensor (output and LSE compared) and with ``lse=None`` (output
    compared); caller outputs are NaN-poisoned. The result's ``invalid_indices`` is the
    backend's count of masked entries after both runs (the kit's selections are valid: it must
    be 0). Unsupported cases (the provider lacks the kernels, or the resolver refuses) return a
    result with ``supported == False`` and the reasons.
    """
    phase = _phase_of(strategy_cls)
    if case.phase != phase:
        raise ValueError(f"{strategy_cls.NAME} is a {phase} strategy; case {case.id} is a {case.phase} step")
    plat = as_platform(platform)
    dev = device_for(plat, device)
    prov = resolve_provider(provider, plat)
    kernels = provider_kernels(prov, plat, (Contract.SPARSE_ATTENTION,))
    if not kernels:
        return CheckResult(strategy_cls.NAME, case.id, kernels)
    inputs = make_sparse_inputs(case, dev)
    try:
        backend = sparse_case_backend(
            case,
            provider=prov,
            platform=plat,
            strategy=strategy_cls,
            registry=registry,
            device=dev,
            num_blocks=inputs.num_blocks,
        )
        metadata = backend.builder.build(inputs.step())
    except UnsupportedError as exc:
        return _unsupported(strategy_cls, case.id, exc)
    plan = metadata.sparse_decode if phase == "decode" else metadata.sparse_prefill
    assert plan is not None
    forward = backend.impl.forward_sparse_decode if phase == "decode" else backend.impl.forward_sparse_prefill
    run = partial(forward, metadata, inputs.q, inputs.kv_cache, inputs.topk_indices, kv_scale=inputs.kv_scale)
    with_lse, without_lse = _with_and_without_lse(f"{strategy_cls.NAME} on {case.id}", inputs, run)
    return CheckResult(
        strategy_cls.NAME,
        case.id,
        Support.yes(),
        ran=plan.strategy,
        comparison=with_lse,
        without_lse=without_lse,
        invalid_indices=backend.invalid_index_count(),
    )


@attrs.frozen
class LengthsCheckResult(_Verdict):
    """The outcome of :func:`check_sparse_lengths`: one provider's sparse kernels on one case."""

    strategy: str
    """What was checked: ``"<provider> sparse lengths"``."""
    case: str
    support: Support
    comparison: Comparison | None = None
    """The attention with an LSE tensor over the cut rows, against the reference."""
    without_lse: Comparison | None = None
    """The same with ``lse=None``."""
    wrong_lengths: int = 0
    """Rows whose ``sparse_slots`` length is not ``1 +`` their last valid column."""

    @property
    def ok(self) -> bool:
        return (
            self.supported
            and self.comparison is not None
            and self.comparison.ok
            and self.without_lse is not None
            and self.without_lse.ok
            and self.wrong_lengths == 0
        )

    def __str__(self) -> str:
        head = f"{self.strategy} on {self.case}"
        if not self.supported:
            return f"{head}: not supported: {self.reasons}"
        if self.wrong_lengths:
            head += f": sparse_slots wrote a wrong length for {self.wrong_lengths} rows"
        return f"{head}: {self.comparison}; {self.without_lse}"


def _row_map(case: SparseCase, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 ``(row_request, row_keys)`` of the case's rows: each row's request and its causal
    window (graph-padding rows: request 0, no keys), as the engine's row map holds them."""
    requests: list[int] = []
    keys: list[int] = []
    for b, qlen in enumerate(case.qlens):
        requests += [b] * qlen
        keys += [case.window(b, i) for i in range(qlen)]
    requests += [0] * case.extra_rows
    keys += [0] * case.extra_rows
    as_tensor = partial(torch.tensor, dtype=torch.int32, device=device)
    return as_tensor(requests), as_tensor(keys)


def check_sparse_lengths(
    case: SparseCase,
    *,
    provider: str | KernelProvider,
    platform: Platform | str,
    device: torch.device | str | None = None,
) -> LengthsCheckResult:
    """Check a provider's :attr:`~mla.providers.calls.SparseSlotsCall.lengths` output and
    :attr:`~mla.providers.calls.SparseAttentionCall.lengths` input on ``case`` (its phase only
    shapes the rows), calling the kernels directly.

    ``provider.sparse_slots`` converts the case's selection with a poisoned lengths output: each
    row's length must be ``1 +`` its last valid column (counted in ``wrong_lengths``). Each
    length is then cut to half (rounded down: a row of one slot attends none), the cache rows
    that only the columns past the cut select are set to NaN, and ``provider.sparse_attention``
    runs with the cut lengths into NaN-poisoned outputs, with an LSE tensor and with
    ``lse=None``; both are compared with :func:`~mla.tools.reference.reference_sparse` over the
    selection with those columns ``-1``. A provider whose record or class lacks the
    ``sparse-attention`` kernel, or whose record does not list the case's cache dtype, reports
    unsupported.
    """
    plat = as_platform(platform)
    dev = torch.device(device_for(plat, device))
    prov = resolve_provider(provider, plat)
    name = f"{prov.name} sparse lengths"
    kernels = provider_kernels(prov, plat, (Contract.SPARSE_ATTENTION,))
    if not kernels:
        return LengthsCheckResult(name, case.id, kernels)
    caps = prov.capabilities(plat)
    if case.kv_dtype not in caps.sparse_kv_dtypes:
        message = (
            f"provider {prov.name!r}'s sparse attention does not read {dtype_name(case.kv_dtype)} caches"
        )
        reason = Reason("kv-dtype", message)
        return LengthsCheckResult(name, case.id, Support((reason,)))
    inputs = make_sparse_inputs(case, dev)
    row_request, row_keys = _row_map(case, dev)
    rows, width = inputs.topk_indices.shape
    slots = torch.full((rows, width), -1, dtype=torch.int32, device=dev)
    lengths = torch.full((rows,), SELECTION_POISON, dtype=torch.int32, device=dev)
    slots_call = SparseSlotsCall(
        indices=inputs.topk_indices,
        block_table=inputs.block_table,
        row_request=row_request,
        row_keys=row_keys,
        block_size=case.block_size,
        num_blocks=inputs.num_blocks,
        slots=slots,
        invalid_count=torch.zeros(1, dtype=torch.int32, device=dev),
        lengths=lengths,
    )
    prov.sparse_slots(slots_call)
    want_slots = torch.full((rows, width), -1, dtype=torch.int32, device=dev)
    default_sparse_slots(attrs.evolve(slots_call, slots=want_slots, lengths=None))
    want = slot_lengths(want_slots)
    wrong = int((lengths != want).sum())
    # Cut every row through its selected slots; only the rows the kept columns select keep values.
    cut = want // 2
    kept = torch.arange(width, device=dev)[None, :] < cut[:, None]
    flat = inputs.kv_cache.clone().view(inputs.num_blocks * case.block_size, -1)
    dropped = torch.zeros(flat.shape[0], dtype=torch.bool, device=dev)
    dropped[want_slots[~kept & (want_slots >= 0)].long()] = True
    dropped[want_slots[kept & (want_slots >= 0)].long()] = False
    nan_rows = encode_latent_cache(
        torch.full((int(dropped.sum()), case.latent_dim), math.nan),
        case.kv_dtype,
        kv_lora_rank=case.kv_lora_rank,
        kv_scale=case.kv_scale_or_none,
    )
    flat.view(torch.uint8)[dropped] = nan_rows.view(torch.uint8).to(dev)  # bytes: any format
    cut_inputs = attrs.evolve(
        inputs,
        kv_cache=flat.view(inputs.kv_cache.shape),
        topk_indices=torch.where(kept, inputs.topk_indices, -1),
    )
    scale = None if inputs.kv_scale is None else torch.tensor([inputs.kv_scale], device=dev)

    def run(*, out: torch.Tensor, lse: torch.Tensor | None) -> None:
        prov.sparse_attention(
            SparseAttentionCall(
                q=inputs.q,
                kv_cache=flat,
                slots=slots,
                out=out,
                lse=lse,
                kv_lora_rank=case.kv_lora_rank,
                rope_dim=case.rope_dim,
                softmax_scale=case.scale,
                kv_scale=scale,
                lengths=cut,
            )
        )

    with_lse, without_lse = _with_and_without_lse(f"{name} on {case.id}", cut_inputs, run)
    return LengthsCheckResult(
        name, case.id, Support.yes(), comparison=with_lse, without_lse=without_lse, wrong_lengths=wrong
    )


@attrs.frozen
class IndexerCheckResult(_Verdict):
    """The outcome of running one indexer strategy on one case."""

    strategy: str
    case: str
    support: Support
    ran: str | None = None
    """``NAME`` of the indexer the backend made (must equal ``strategy``)."""
    gap: float = math.nan
    """:func:`~mla.tools.demo_sparse.selection_gap` of the selection against the float64
    scores (0: a top-k; ``inf``: a position outside a row's window, a repeat, too few kept)."""
    tolerance: float = SELECTION_TOLERANCE
    padding_rows_ok: bool = True
    """Whether every row past the requests' rows holds only ``-1``."""

    @property
    def ok(self) -> bool:
        return (
            self.supported
            and self.ran == self.strategy
            and self.gap <= self.tolerance
            and self.padding_rows_ok
        )

    def __str__(self) -> str:
        early = self._head(self.ran, "made indexer")
        if early is not None:
            return early
        head = f"{self.strategy} on {self.case}"
        verdict = "ok" if self.ok else "MISMATCH"
        padding = "" if self.padding_rows_ok else ", padding rows not all -1"
        return f"{head}: {verdict}: selection gap {self.gap:.3g} (tolerance {self.tolerance:g}){padding}"


def selection_tolerance(q_dtype: torch.dtype) -> float:
    """Largest accepted selection gap for index queries of ``q_dtype``: the demo's
    :data:`~mla.tools.demo_sparse.SELECTION_TOLERANCE`, or the dtype's output tolerance when
    larger (a kernel may take the dot in a 16-bit dtype)."""
    return max(SELECTION_TOLERANCE, tolerance_for(q_dtype))


def check_indexer_strategy(
    indexer_cls: type[IndexerStrategy],
    case: SparseCase,
    *,
    provider: str | KernelProvider,
    platform: Platform | str,
    device: torch.device | str | None = None,
) -> IndexerCheckResult:
    """Run the indexer ``indexer_cls`` over every row of ``case`` through a backend's
    ``impl.write_index_keys`` and ``impl.index_topk`` and check its selection (see the module
    docstring); index queries and keys are ``N(0, 1)`` in ``case.q_dtype``, the per-head weights
    ``N(0, 1) * Hi ** -0.5``."""
    plat = as_platform(platform)
    dev = device_for(plat, device)
    prov = resolve_provider(provider, plat)
    name = indexer_cls.NAME
    kernels = provider_kernels(prov, plat, (Contract.INDEXER, Contract.SPARSE_ATTENTION))
    if not kernels:
        return IndexerCheckResult(name, case.id, kernels)
    inputs = make_sparse_inputs(case, dev)
    spec = case.indexer
    try:
        backend = sparse_case_backend(
            case, provider=prov, platform=plat, indexer_strategy=indexer_cls, device=dev,
            num_blocks=inputs.num_blocks,
        )  # fmt: skip
        metadata = backend.builder.build(inputs.step())
    except UnsupportedError as exc:
        return IndexerCheckResult(name, case.id, Support((Reason("unsupported", str(exc)),)))
    gen = torch.Generator().manual_seed(case.seed + 11)
    index_cache = poisoned_index_cache(spec, inputs.num_blocks, case.block_size, dev)
    slots = [s for request in inputs.slots() for s in request]
    keys = torch.randn(len(slots), spec.head_dim, generator=gen).to(case.q_dtype)
    backend.impl.write_index_keys(
        keys.to(dev), index_cache, torch.tensor(slots, dtype=torch.int64, device=dev)
    )
    rows = case.num_tokens
    index_q = torch.randn(rows, spec.num_heads, spec.head_dim, generator=gen).to(case.q_dtype).to(dev)
    weights = (torch.randn(rows, spec.num_heads, generator=gen) * spec.num_heads**-0.5).to(dev)
    selected = torch.full((rows, case.topk), SELECTION_POISON, dtype=torch.int32, device=dev)
    backend.impl.index_topk(metadata, index_q, weights, index_cache, out=selected)
    scores = reference_index_scores(
        index_q,
        weights,
        index_cache,
        inputs.block_table,
        inputs.seq_lens,
        inputs.query_start_loc,
        key_dtype=spec.key_dtype,
        softmax_scale=spec.scale,
    )
    chosen = selected.cpu()
    owned = sum(case.qlens)
    assert backend.indexer is not None
    return IndexerCheckResult(
        name,
        case.id,
        Support.yes(),
        ran=backend.indexer.NAME,
        gap=selection_gap(scores, chosen, case.topk),
        tolerance=selection_tolerance(case.q_dtype),
        padding_rows_ok=bool((chosen[owned:] == -1).all()),
    )


__all__ = [
    "DEFAULT_SPARSE_DTYPES",
    "IndexerCheckResult",
    "LengthsCheckResult",
    "SparseCase",
    "SparseInputs",
    "check_indexer_strategy",
    "check_sparse_lengths",
    "check_sparse_strategy",
    "encode_latent_cache",
    "make_sparse_inputs",
    "poisoned_index_cache",
    "provider_kernels",
    "random_selection",
    "selection_tolerance",
    "sparse_case_backend",
    "sparse_cases",
]
