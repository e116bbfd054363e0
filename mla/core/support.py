"""The answer of ``supports(ctx)``: empty means yes, otherwise every reason."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import attrs


@attrs.frozen
class Reason:
    """One reason a strategy cannot run a case.

    ``code`` is a stable kebab-case identifier (tests and tools match on it); ``message`` names
    the observed value and what would be needed.
    """

    code: str = attrs.field(validator=attrs.validators.min_len(1))
    message: str = attrs.field(validator=attrs.validators.min_len(1))

    def __str__(self) -> str:
        return f"[{self.code}] {self.message}"


@attrs.frozen
class Support:
    """All reasons a strategy cannot run a case; truthy when there are none."""

    reasons: tuple[Reason, ...] = ()

    @classmethod
    def yes(cls) -> Support:
        return cls(())

    @classmethod
    def no(cls, code: str, message: str) -> Support:
        return cls((Reason(code, message),))

    def __bool__(self) -> bool:
        return not self.reasons

    def __iter__(self) -> Iterator[Reason]:
        return iter(self.reasons)

    def __add__(self, other: Support) -> Support:
        return Support(self.reasons + other.reasons)

    @property
    def codes(self) -> tuple[str, ...]:
        return tuple(r.code for r in self.reasons)

    def __str__(self) -> str:
        return "supported" if self else "; ".join(str(r) for r in self.reasons)


class ReasonCollector:
    """Accumulates reasons without short-circuiting, so every failed check is reported."""

    def __init__(self) -> None:
        self._reasons: list[Reason] = []

    def require(self, condition: bool, code: str, message: str) -> None:
        """Record ``Reason(code, message)`` unless ``condition`` holds."""
        if not condition:
            self._reasons.append(Reason(code, message))

    def extend(self, reasons: Iterable[Reason]) -> None:
        self._reasons.extend(reasons)

    def support(self) -> Support:
        return Support(tuple(self._reasons))
