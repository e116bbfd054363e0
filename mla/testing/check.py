"""Check runners: run one strategy, forced through the resolver's checks, on one case and compare
it with the reference; a decode strategy runs with and without an LSE tensor."""

from __future__ import annotations

import abc
from collections.abc import Callable
from functools import partial
from typing import Literal

import attrs
import torch

from mla.core.config import EngineLimits, KVCacheSpec
from mla.core.context import prefill_context
from mla.core.errors import UnsupportedError
from mla.core.explain import Explanation
from mla.core.platform import Platform
from mla.core.support import Reason, Support
from mla.decode.base import DecodeStrategy
from mla.engine.backend import MLABackend, StepInputs
from mla.engine.decision.registry import DEFAULT_REGISTRY, AnyStrategy, Registry
from mla.engine.decision.resolver import Resolver
from mla.engine.functional import mla_prefill
from mla.prefill.base import PrefillStrategy
from mla.providers import resolve_provider
from mla.providers.base import KernelProvider
from mla.providers.quant import dequantize
from mla.strategy import StrategySetup
from mla.testing.cases import DecodeCase, PrefillCase
from mla.testing.compare import TOLERANCES, Comparison, compare_to_reference, poisoned_empty, tolerance_for
from mla.testing.contexts import as_platform, decode_case_backend, device_for, prefill_case_backend
from mla.testing.inputs import _PagedInputs, make_decode_inputs, make_prefill_inputs


class _Verdict(abc.ABC):
    """What a check's result shares (:class:`CheckResult`,
    :class:`~mla.testing.IndexerCheckResult`): whether the strategy could run, why not, and the
    assertion that it ran and passed (``ok`` and ``__str__`` are the result's own)."""

    __slots__ = ()
    strategy: str
    case: str
    support: Support

    @property
    def supported(self) -> bool:
        return bool(self.support)

    @property
    def reasons(self) -> str:
        """Every reason, readable (``"[heads] 130 heads: ..."``); for ``pytest.skip``."""
        return str(self.support)

    @property
    @abc.abstractmethod
    def ok(self) -> bool:
        """The strategy ran and its output matched the reference."""

    def assert_passed(self) -> None:
        """Raise ``AssertionError`` with the details unless the strategy ran and matched."""
        if not self.ok:
            raise AssertionError(str(self))

    def _head(self, ran: str | None, made: str) -> str | None:
        """``"<strategy> on <case>"``, or the whole message when it did not run or the backend
        ``made`` (ran) another one (``None``: go on with the verdict)."""
        head = f"{self.strategy} on {self.case}"
        if not self.supported:
            return f"{head}: not supported: {self.reasons}"
        if ran != self.strategy:
            return f"{head}: the backend {made} {ran!r} instead"
        return None


@attrs.frozen
class CheckResult(_Verdict):
    """The outcome of running one strategy on one case."""

    strategy: str
    case: str
    """The case id."""
    support: Support
    """Why the strategy cannot run the case (empty: it ran)."""
    ran: str | None = None
    """The strategy the backend recorded in the step's metadata (must equal ``strategy``)."""
    comparison: Comparison | None = None
    """The run with an LSE tensor against the reference's output and LSE."""
    without_lse: Comparison | None = None
    """Decode only: the run with ``lse=None`` (the production default) against the reference's
    output, on the same plan; ``None`` for prefill checks."""
    invalid_indices: int = 0
    """Sparse checks only: top-k entries the backend masked and counted as invalid
    (``backend.invalid_index_count()``); the kit's selections are valid, so it must be 0."""

    @property
    def ok(self) -> bool:
        return (
            self.supported
            and self.ran == self.strategy
            and self.comparison is not None
            and self.comparison.ok
            and (self.without_lse is None or self.without_lse.ok)
            and self.invalid_indices == 0
        )

    def __str__(self) -> str:
        early = self._head(self.ran, "ran")
        if early is not None:
            return early
        head = f"{self.strategy} on {self.case}"
        if self.invalid_indices:
            head += f": {self.invalid_indices} valid top-k entries were masked as invalid"
        if self.without_lse is None:
            return f"{head}: {self.comparison}"
        return f"{head}: {self.comparison}; {self.without_lse}"


def _unsupported(strategy: AnyStrategy, case_id: str, exc: UnsupportedError) -> CheckResult:
    explanation: Explanation | None = exc.explanation
    reasons: tuple[Reason, ...]
    try:
        reasons = explanation.candidate(strategy.NAME).reasons if explanation is not None else ()
    except KeyError:
        reasons = ()
    if not reasons:
        reasons = (Reason("unsupported", str(exc)),)
    return CheckResult(strategy.NAME, case_id, Support(reasons))


def _with_and_without_lse(
    label: str,
    inputs: _PagedInputs,
    run: Callable[..., object],
) -> tuple[Comparison, Comparison]:
    """Run ``run(out=..., lse=...)`` on NaN-poisoned outputs with an LSE tensor, then with
    ``lse=None`` (the production default), and compare both with ``inputs.reference()``; a run
    with ``lse=None`` that raises raises ``AssertionError`` naming ``label``."""
    ref_out, ref_lse = inputs.reference()
    out, lse = inputs.poisoned_outputs()
    run(out=out, lse=lse)
    with_lse = compare_to_reference(out, lse, ref_out, ref_lse)
    out, _ = inputs.poisoned_outputs()
    try:
        run(out=out, lse=None)
    except Exception as exc:
        raise AssertionError(
            f"{label}: the run with lse=None (the production default) raised {type(exc).__name__}: {exc}"
        ) from exc
    return with_lse, compare_to_reference(out, None, ref_out, ref_lse)


def _build_support(backend: MLABackend, step: StepInputs, strategy: AnyStrategy, case_id: str) -> Support:
    """Whether ``backend`` builds ``step``'s metadata with ``strategy`` forced: empty when it
    does, else every reason."""
    try:
        backend.builder.build(step)
    except UnsupportedError as exc:
        return _unsupported(strategy, case_id, exc).support
    return Support.yes()


def decode_support(
    strategy_cls: type[DecodeStrategy],
    case: DecodeCase,
    *,
    provider: str | KernelProvider,
    platform: Platform | str,
    registry: Registry | None = None,
) -> Support:
    """Whether the backend would run ``case`` with ``strategy_cls`` forced (builds the step's
    metadata on the CPU, runs no kernel): empty when supported, else every reason."""
    inputs = make_decode_inputs(case, "cpu")
    backend = decode_case_backend(
        case,
        provider=provider,
        platform=platform,
        strategy=strategy_cls,
        registry=registry,
        device="cpu",
        num_blocks=inputs.kv_cache.shape[0],
    )
    return _build_support(backend, inputs.step(), strategy_cls, case.id)


def check_decode_strategy(
    strategy_cls: type[DecodeStrategy],
    case: DecodeCase,
    *,
    provider: str | KernelProvider,
    platform: Platform | str,
    registry: Registry | None = None,
    device: torch.device | str | None = None,
) -> CheckResult:
    """Run ``case`` through an :class:`~mla.MLABackend` with ``strategy_cls`` forced and compare.

    The backend is sized for the case (:func:`~mla.testing.decode_case_backend`). One plan is
    built, then run twice: with an LSE tensor (output and LSE compared) and with ``lse=None``,
    the production default (output compared). Outputs are caller-provided and NaN-poisoned, so
    unwritten rows fail. An unsupported case returns a result with ``supported == False`` and
    every reason from the resolver's explanation. A run that raises with ``lse=None`` raises
    ``AssertionError`` naming it.

    ``provider`` is a name or a provider object (see :func:`~mla.testing.emulated_provider`);
    ``platform`` a :class:`~mla.Platform` or an arch name to simulate; ``registry`` the registry
    the backend's resolver reads (default: the default one; a forced class need not be
    registered).
    """
    plat = as_platform(platform)
    dev = device_for(plat, device)
    inputs = make_decode_inputs(case, dev)
    backend = decode_case_backend(
        case,
        provider=resolve_provider(provider, plat),
        platform=plat,
        strategy=strategy_cls,
        registry=registry,
        device=dev,
        num_blocks=inputs.kv_cache.shape[0],
    )
    try:
        metadata = backend.builder.build(inputs.step())
    except UnsupportedError as exc:
        return _unsupported(strategy_cls, case.id, exc)
    assert metadata.decode is not None
    run = partial(backend.impl.forward_decode, metadata, inputs.q, inputs.kv_cache, kv_scale=inputs.kv_scale)
    with_lse, without_lse = _with_and_without_lse(f"{strategy_cls.NAME} on {case.id}", inputs, run)
    return CheckResult(
        strategy_cls.NAME,
        case.id,
        Support.yes(),
        ran=metadata.decode.strategy,
        comparison=with_lse,
        without_lse=without_lse,
    )


PrefillPath = Literal["auto", "api", "backend"]


def prefill_support(
    strategy_cls: type[PrefillStrategy],
    case: PrefillCase,
    *,
    provider: str | KernelProvider,
    platform: Platform | str,
    registry: Registry | None = None,
    path: PrefillPath = "auto",
) -> Support:
    """Whether :func:`check_prefill_strategy` would run ``case`` with ``strategy_cls`` forced on
    ``path`` (runs no kernel): empty when supported, else every reason.

    The backend path builds the step's metadata on the CPU, as the check does. The API path asks
    the resolver about the step :func:`mla.mla_prefill` sees (the case's dims and dtype, no
    cached context), as the call does before it runs anything."""
    plat = as_platform(platform)
    prov = resolve_provider(provider, plat)
    chosen = ("backend" if case.has_context else "api") if path == "auto" else path
    if chosen == "backend":
        inputs = make_prefill_inputs(case, "cpu")
        backend = prefill_case_backend(
            case,
            provider=prov,
            platform=plat,
            strategy=strategy_cls,
            registry=registry,
            device="cpu",
            num_blocks=inputs.context.kv_cache.shape[0],
        )
        return _build_support(backend, inputs.step(), strategy_cls, case.id)
    ctx = prefill_context(
        dims=case.dims,
        cache=KVCacheSpec(1, case.dtype),
        q_dtype=case.dtype,
        platform=plat,
        capabilities=prov.capabilities(plat),
        availability=prov.availability(),
        has_chunked_context=False,
    )
    try:
        Resolver(registry or DEFAULT_REGISTRY).resolve(ctx, force=strategy_cls)
    except UnsupportedError as exc:
        return _unsupported(strategy_cls, case.id, exc).support
    return Support.yes()


def rounded_inputs(
    instance: PrefillStrategy, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The (dequantized) inputs a prefill strategy really computes with when it rounds them to
    fp8 (it has ``quantize(q, k, v)``); ``None`` when it takes them as they are. Compare such a
    strategy with the reference on these, so the tolerance stays tight."""
    quantize: Callable[..., tuple[tuple[torch.Tensor, torch.Tensor], ...]] | None = getattr(
        instance, "quantize", None
    )
    if quantize is None:
        return None
    (q8, qs), (k8, ks), (v8, vs) = quantize(q, k, v)
    return dequantize(q8, qs), dequantize(k8, ks), dequantize(v8, vs)


def check_prefill_strategy(
    strategy_cls: type[PrefillStrategy],
    case: PrefillCase,
    *,
    provider: str | KernelProvider,
    platform: Platform | str,
    registry: Registry | None = None,
    path: PrefillPath = "auto",
    device: torch.device | str | None = None,
) -> CheckResult:
    """Run ``case`` with ``strategy_cls`` forced and compare to the reference.

    ``path="api"`` calls :func:`mla.mla_prefill` (its own outputs, poisoned through
    :func:`poisoned_empty`); ``path="backend"`` builds an :class:`MLABackend` step (cached
    context read from the paged cache, expanded by the case's random up-projection, merged by
    LSE; caller outputs NaN-poisoned). ``"auto"``: the backend when the case has context, else
    the API. ``registry`` applies to the backend path (the API resolves with the default
    registry; a forced class need not be registered in either).
    """
    plat = as_platform(platform)
    dev = device_for(plat, device)
    prov = resolve_provider(provider, plat)
    inputs = make_prefill_inputs(case, dev)
    chosen = ("backend" if case.has_context else "api") if path == "auto" else path
    if chosen == "api" and case.has_context:
        raise ValueError(f"case {case.id} has cached context, which only the backend path runs")
    if chosen == "backend" and (case.keys != case.q_lens or not case.causal):
        raise ValueError(
            f"case {case.id}: the backend path runs causal steps whose new tokens are their own "
            "keys (kv_lens == q_lens); use the API path"
        )
    if chosen == "api":
        try:
            with poisoned_empty():
                out, lse = mla_prefill(
                    inputs.q,
                    inputs.k,
                    inputs.v,
                    inputs.cu_seqlens_q,
                    inputs.cu_seqlens_k,
                    inputs.max_seqlen_q,
                    inputs.max_seqlen_k,
                    softmax_scale=case.scale,
                    causal=case.causal,
                    provider=prov,
                    strategy=strategy_cls,
                    platform=plat,
                )
        except UnsupportedError as exc:
            return _unsupported(strategy_cls, case.id, exc)
        instance = strategy_cls(
            StrategySetup(
                dims=case.dims,
                cache=KVCacheSpec(case.block_size, case.dtype),
                limits=EngineLimits(len(case.q_lens), max(1, *case.keys), sum(case.q_lens)),
                q_dtype=case.dtype,
                platform=plat,
                provider=prov,
                capabilities=prov.capabilities(plat),
                device=dev,
            )
        )
        ran: str | None = strategy_cls.NAME
    else:
        backend = prefill_case_backend(
            case,
            provider=prov,
            platform=plat,
            strategy=strategy_cls,
            registry=registry,
            device=dev,
            num_blocks=inputs.context.kv_cache.shape[0],
        )
        try:
            metadata = backend.builder.build(inputs.step())
        except UnsupportedError as exc:
            return _unsupported(strategy_cls, case.id, exc)
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
        ran = metadata.prefill.strategy
        instance = backend.prefill_strategy(ran)
    rounded = rounded_inputs(instance, inputs.q, inputs.k, inputs.v)
    ref_out, ref_lse = inputs.reference(*rounded) if rounded is not None else inputs.reference()
    tolerance = tolerance_for(out.dtype)
    if rounded is not None:
        # The reference sees the same fp8-rounded inputs; fp8 kernels may still keep their
        # intermediates (the probabilities P) in 16 bits, so no tighter than float16.
        tolerance = max(tolerance, TOLERANCES[torch.float16])
    return CheckResult(
        strategy_cls.NAME,
        case.id,
        Support.yes(),
        ran=ran,
        comparison=compare_to_reference(out, lse, ref_out, ref_lse, tolerance=tolerance),
    )
