"""Explanations: every candidate of a resolution with its reasons, and the winner."""

from __future__ import annotations

from typing import Any

import attrs

from mla.core.support import Reason

ContextValue = str | int | bool
"""A context field's value: numbers and flags keep their type (JSON numbers and booleans)."""


@attrs.frozen
class Candidate:
    """One strategy as the resolver saw it."""

    name: str
    reasons: tuple[Reason, ...]
    """Why it cannot run the case (empty: it can)."""
    preferred: bool = True
    """``False`` when a preference rule keeps it out of automatic selection."""
    note: str | None = None
    """The preference rule that excluded it, when ``preferred`` is false."""

    @property
    def supported(self) -> bool:
        return not self.reasons


@attrs.frozen
class Explanation:
    """The resolver's view of one context: candidates in priority order and the winner."""

    phase: str
    context: tuple[tuple[str, ContextValue], ...]
    """``(field, value)`` pairs describing the case."""
    candidates: tuple[Candidate, ...]
    chosen: str | None
    forced: str | None = None
    if_available: str | None = None
    """When the provider is unavailable: what it would choose if it were."""
    unavailable: tuple[Reason, ...] = ()
    """Why the provider cannot run here (empty when it can). Every candidate's ``reasons``
    include these; the text form says them once."""

    def candidate(self, name: str) -> Candidate:
        for cand in self.candidates:
            if cand.name == name:
                return cand
        raise KeyError(name)

    def to_json(self) -> dict[str, Any]:
        """``{"phase", "chosen", "candidates": [{"name", "supported", "reasons"}], ...}``."""
        return {
            "phase": self.phase,
            "chosen": self.chosen,
            "forced": self.forced,
            "if_available": self.if_available,
            "unavailable": [{"code": r.code, "message": r.message} for r in self.unavailable],
            "context": dict(self.context),
            "candidates": [
                {
                    "name": c.name,
                    "supported": c.supported,
                    "preferred": c.preferred,
                    "note": c.note,
                    "reasons": [{"code": r.code, "message": r.message} for r in c.reasons],
                }
                for c in self.candidates
            ],
        }

    def __str__(self) -> str:
        lines = [f"{self.phase} strategy resolution:"]
        lines += [f"    {key} = {value}" for key, value in self.context]
        if self.unavailable:
            lines.append("  the provider cannot run here (this applies to every candidate):")
            lines += [f"        - {reason}" for reason in self.unavailable]
        for cand in self.candidates:
            mark = "->" if cand.name == self.chosen else "  "
            own = [reason for reason in cand.reasons if reason not in self.unavailable]
            if cand.supported:
                status = "supported"
            elif own:
                status = "not supported"
            else:
                status = "supported where the provider is available"
            if not cand.preferred:
                status += f" (not preferred: {cand.note})"
            lines.append(f"  {mark} {cand.name}: {status}")
            lines += [f"        - {reason}" for reason in own]
        if self.chosen is None:
            lines.append("  => no strategy fits" + (f" (forced: {self.forced})" if self.forced else ""))
            if self.if_available:
                lines.append(f"  => if the provider were available: {self.if_available}")
        else:
            lines.append(f"  => {self.chosen}" + (" (forced)" if self.forced else ""))
        return "\n".join(lines)
