"""The resolver: one decision per phase per step, explainable, with forced selection."""

from __future__ import annotations

import attrs

from mla.core.config import dtype_name
from mla.core.context import DecodeContext, PrefillContext
from mla.core.errors import UnsupportedError
from mla.core.explain import Candidate, ContextValue, Explanation
from mla.core.support import Support
from mla.engine.decision.preference import decode_order, prefill_order
from mla.engine.decision.registry import DEFAULT_REGISTRY, AnyStrategy, Registry
from mla.strategy import Phase, Strategy, serves_model

Context = DecodeContext | PrefillContext


@attrs.frozen
class Decision:
    """The strategy chosen for one context, with the explanation that chose it."""

    phase: Phase
    strategy: AnyStrategy
    explanation: Explanation
    forced: bool = False

    @property
    def name(self) -> str:
        return self.strategy.NAME


def describe_context(ctx: Context) -> tuple[tuple[str, ContextValue], ...]:
    """Readable ``(field, value)`` pairs for explanations and errors (numbers and flags keep
    their type)."""
    pairs: list[tuple[str, ContextValue]] = [
        ("provider", ctx.capabilities.provider),
        ("arch", ctx.platform.arch),
        ("heads", ctx.num_heads),
        ("q_dtype", dtype_name(ctx.q_dtype)),
        ("kv_dtype", dtype_name(ctx.kv_dtype)),
    ]
    topk = ctx.dims.index_topk
    if topk is not None:
        pairs.append(("index_topk", topk))
    if isinstance(ctx, DecodeContext):
        pairs += [
            ("max_qlen", ctx.max_qlen),
            ("uniform_qlen", ctx.uniform_qlen),
            ("max_decode_qlen", ctx.max_decode_qlen),
            ("graph_mode", ctx.graph_mode.value),
            ("small_head_mode", ctx.platform.knobs.small_head_mode),
        ]
    else:
        pairs += [
            ("chunked_context", ctx.has_chunked_context),
            ("fp8_prefill", ctx.platform.knobs.fp8_prefill),
        ]
    return tuple(pairs)


class Resolver:
    """Walks a registry's priority order for a context. Results are cached per context."""

    def __init__(self, registry: Registry = DEFAULT_REGISTRY) -> None:
        self.registry = registry
        self._cache: dict[tuple[object, ...], Decision | UnsupportedError] = {}

    @staticmethod
    def phase_of(ctx: Context) -> Phase:
        return Phase.DECODE if isinstance(ctx, DecodeContext) else Phase.PREFILL

    def _ordered(self, ctx: Context) -> list[tuple[AnyStrategy, str | None]]:
        phase = self.phase_of(ctx)
        # A sparse model is served by sparse strategies only, a dense one by the others: the
        # other family is not a candidate (forcing one still reports why it cannot run).
        regs = tuple(r for r in self.registry.entries(phase) if serves_model(r.strategy.KIND, ctx.dims))
        # Rank by position: ``entries`` is in priority order, or in an override's given order.
        entries = [(r.name, rank, r.strategy.KIND, r.strategy.PERSISTENT) for rank, r in enumerate(regs)]
        by_name = {r.name: r.strategy for r in regs}
        if isinstance(ctx, DecodeContext):
            order = decode_order(ctx, entries, explicit_order=self.registry.overridden(phase))
        else:
            order = prefill_order(ctx, entries)
        return [(by_name[name], note) for name, note in order]

    def explain(self, ctx: Context, *, force: str | AnyStrategy | None = None) -> Explanation:
        """Every candidate with its reasons, in preference order, and the winner."""
        forced = self._forced_class(ctx, force)
        candidates: list[Candidate] = []
        chosen: str | None = None
        ordered = self._ordered(ctx)
        if forced is not None and forced.NAME not in {s.NAME for s, _ in ordered}:
            ordered.append((forced, None))
        for strategy, note in ordered:
            support: Support = strategy.supports(ctx)  # type: ignore[arg-type]
            candidates.append(Candidate(strategy.NAME, support.reasons, note is None, note))
            if chosen is None and support:
                if forced is not None:
                    if strategy is forced:
                        chosen = strategy.NAME
                elif note is None:
                    chosen = strategy.NAME
        if_available = None
        if chosen is None and ctx.provider_availability.reasons:
            hypothetical = attrs.evolve(ctx, provider_availability=Support.yes())
            if_available = self.explain(hypothetical, force=force).chosen
        return Explanation(
            phase=self.phase_of(ctx).value,
            context=describe_context(ctx),
            candidates=tuple(candidates),
            chosen=chosen,
            forced=forced.NAME if forced is not None else None,
            if_available=if_available,
            unavailable=ctx.provider_availability.reasons,
        )

    def _forced_class(self, ctx: Context, force: str | AnyStrategy | None) -> AnyStrategy | None:
        if force is None:
            return None
        return self.forced_strategy(force, self.phase_of(ctx))

    def forced_strategy(
        self, force: str | AnyStrategy, phase: Phase, *, argument: str = "strategy"
    ) -> AnyStrategy:
        """The strategy class ``force`` names (``NAME``, class name or the class itself) for
        ``phase``; :class:`UnsupportedError` naming ``argument`` when it is unknown, not a
        strategy, or of the other phase."""
        if isinstance(force, str):
            cls = self.registry.get(force, argument=argument)
        elif isinstance(force, type) and issubclass(force, Strategy) and hasattr(force, "NAME"):
            cls = force
        else:
            raise UnsupportedError(
                f"{argument}: expected a strategy NAME, class name or class, got "
                f"{type(force).__name__} {force!r}"
            )
        if cls.PHASE is not phase:
            raise UnsupportedError(
                f"{argument}: {cls.NAME!r} is a {cls.PHASE.value} strategy, not a {phase.value} one"
            )
        return cls

    def resolve(self, ctx: Context, *, force: str | AnyStrategy | None = None) -> Decision:
        """The one decision for ``ctx``; raises :class:`UnsupportedError` with the explanation."""
        forced = self._forced_class(ctx, force)
        key = (ctx, forced, self.registry.version)
        hit = self._cache.get(key)
        if hit is None:
            hit = self._resolve(ctx, forced)
            self._cache[key] = hit
        if isinstance(hit, UnsupportedError):
            raise hit
        return hit

    def _resolve(self, ctx: Context, force: str | AnyStrategy | None) -> Decision | UnsupportedError:
        explanation = self.explain(ctx, force=force)
        phase = self.phase_of(ctx)
        if explanation.chosen is None:
            if explanation.forced:
                message = f"forced {phase.value} strategy {explanation.forced!r} does not support this case"
            else:
                message = f"no {phase.value} strategy supports this case"
            return UnsupportedError(message, explanation)
        # A forced class need not be registered: it passed the same checks in explain().
        forced = self._forced_class(ctx, force)
        strategy = forced if forced is not None else self.registry.get(explanation.chosen)
        return Decision(phase, strategy, explanation, forced=explanation.forced is not None)
