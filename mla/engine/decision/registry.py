"""Strategy registry: priority-ordered strategies per phase, registration and overrides."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import attrs

from mla.core.errors import InvalidInputError, UnsupportedError
from mla.decode.asm_non_persistent import AsmNonPersistent
from mla.decode.asm_padded_persistent import PaddedAsmPersistent
from mla.decode.base import DecodeStrategy
from mla.decode.gluon import GluonDecode
from mla.decode.gluon_verify_flatten import GluonVerifyFlatten
from mla.prefill.base import PrefillStrategy
from mla.prefill.flash_varlen import FlashVarlen
from mla.prefill.fp8_persistent import Fp8PersistentPrefill
from mla.sparse.base import SparseStrategy
from mla.sparse.decode import SparseDecode
from mla.sparse.prefill import SparsePrefill
from mla.strategy import Phase, Strategy

AnyStrategy = type[DecodeStrategy] | type[PrefillStrategy] | type[SparseStrategy[Any]]
S = TypeVar("S", bound=type[Strategy])  # type: ignore[type-arg]


@attrs.frozen
class Registration:
    """A strategy and its base priority (lower runs first)."""

    strategy: AnyStrategy
    priority: int

    @property
    def name(self) -> str:
        return self.strategy.NAME


class Registry:
    """Mutable set of registrations; ``version`` changes on every edit (keys resolver caches)."""

    def __init__(self) -> None:
        self._entries: dict[Phase, dict[str, Registration]] = {p: {} for p in Phase}
        self._only: dict[Phase, tuple[str, ...] | None] = dict.fromkeys(Phase)
        self.version = 0

    def register(self, strategy: AnyStrategy, *, priority: int) -> None:
        for phase, entries in self._entries.items():
            if strategy.NAME in entries and phase is not strategy.PHASE:
                raise InvalidInputError(
                    "strategy",
                    f"{strategy.__name__}.NAME {strategy.NAME!r} is already the name of a {phase.value} "
                    f"strategy ({entries[strategy.NAME].strategy.__name__}); give it a NAME of its own",
                )
        self._entries[strategy.PHASE][strategy.NAME] = Registration(strategy, priority)
        self.version += 1

    def unregister(self, name: str) -> None:
        for entries in self._entries.values():
            entries.pop(name, None)
        self.version += 1

    def entries(self, phase: Phase) -> tuple[Registration, ...]:
        """Registrations of ``phase`` by priority, narrowed by an active :meth:`override`."""
        regs = sorted(self._entries[phase].values(), key=lambda r: (r.priority, r.name))
        only = self._only[phase]
        if only is not None:
            by_name = {r.name: r for r in regs}
            regs = [by_name[name] for name in only if name in by_name]
        return tuple(regs)

    def overridden(self, phase: Phase) -> bool:
        """Whether an :meth:`override` fixes the order of ``phase``'s candidates right now."""
        return self._only[phase] is not None

    def get(self, name: str, *, argument: str = "strategy") -> AnyStrategy:
        """The registered strategy called ``name``: its ``NAME`` (``"gluon-decode"``) or its class
        name (``"GluonDecode"``). Raises :class:`UnsupportedError` naming ``argument`` otherwise."""
        if not isinstance(name, str):
            raise UnsupportedError(
                f"{argument}: expected a strategy name or class, got {type(name).__name__} {name!r}"
            )
        for entries in self._entries.values():
            if name in entries:
                return entries[name].strategy
            for registration in entries.values():
                if registration.strategy.__name__ == name:
                    return registration.strategy
        known = sorted(
            f"{r.name} ({r.strategy.__name__})"
            for entries in self._entries.values()
            for r in entries.values()
        )
        raise UnsupportedError(
            f"{argument}: unknown strategy {name!r}; known (NAME or class name): {', '.join(known)}"
        )

    def names(self, phase: Phase) -> tuple[str, ...]:
        return tuple(r.name for r in self.entries(phase))

    @contextlib.contextmanager
    def override(
        self,
        *,
        decode: Sequence[str | AnyStrategy] | None = None,
        prefill: Sequence[str | AnyStrategy] | None = None,
    ) -> Iterator[None]:
        """Restrict automatic selection to the given strategies (in that order) for the block.

        Like ``torch.nn.attention.sdpa_kernel``: the previous state is restored on exit.
        """
        saved = dict(self._only)
        for phase, chosen in ((Phase.DECODE, decode), (Phase.PREFILL, prefill)):
            if chosen is not None:
                names = tuple(self.get(c).NAME if isinstance(c, str) else c.NAME for c in chosen)
                self._only[phase] = names
        self.version += 1
        try:
            yield
        finally:
            self._only = saved
            self.version += 1


DEFAULT_REGISTRY = Registry()
for _strategy, _priority in (
    (GluonDecode, 10),
    (GluonVerifyFlatten, 20),
    (PaddedAsmPersistent, 30),
    (AsmNonPersistent, 40),
    (Fp8PersistentPrefill, 10),
    (FlashVarlen, 20),
    (SparseDecode, 50),
    (SparsePrefill, 50),
):
    DEFAULT_REGISTRY.register(_strategy, priority=_priority)


def register(
    strategy: S | None = None, *, priority: int, registry: Registry = DEFAULT_REGISTRY
) -> S | Callable[[S], S]:
    """Register a strategy class (usable as ``@register(priority=5)``)."""

    def apply(cls: S) -> S:
        registry.register(cls, priority=priority)  # type: ignore[arg-type]
        return cls

    return apply if strategy is None else apply(strategy)


def override(
    *,
    decode: Sequence[str | AnyStrategy] | None = None,
    prefill: Sequence[str | AnyStrategy] | None = None,
) -> contextlib.AbstractContextManager[None]:
    """:meth:`Registry.override` on the default registry."""
    return DEFAULT_REGISTRY.override(decode=decode, prefill=prefill)
