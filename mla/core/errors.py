"""Typed errors raised by mla.

Every error names the argument or decision that failed and, where a resolver was involved,
carries its :class:`~mla.core.explain.Explanation` so the caller sees every candidate's reasons.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    from mla.core.explain import Explanation


class MLAError(Exception):
    """Base class of every error mla raises on purpose."""


class UnsupportedError(MLAError, NotImplementedError):
    """No strategy fits the case, or a forced strategy does not support it.

    ``explanation`` holds every candidate with its reasons (``None`` only when the error did not
    come from a resolver, e.g. an unknown strategy name).
    """

    def __init__(self, message: str, explanation: Explanation | None = None) -> None:
        if explanation is not None:
            message = f"{message}\n{explanation}"
        super().__init__(message)
        self.explanation = explanation


class InvalidInputError(MLAError, ValueError):
    """An argument has the wrong shape, dtype, device or values.

    ``argument`` names the offending argument; ``reason`` (the message after ``"<argument>: "``)
    says what was expected.
    """

    def __init__(self, argument: str, message: str) -> None:
        super().__init__(f"{argument}: {message}")
        self.argument = argument
        self.reason = message


AttrsValidator = Callable[[Any, "attrs.Attribute[Any]", Any], None]
"""An attrs field validator: ``(instance, attribute, value) -> None``, raising on a bad value."""


def input_validator(check: AttrsValidator, expected: str) -> AttrsValidator:
    """Wrap an attrs validator (``attrs.validators.gt(0)`` ...) so that a rejected value raises
    :class:`InvalidInputError` naming the field: ``"<field>: must be <expected>, got <value>"``."""

    def validate(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        try:
            check(instance, attribute, value)
        except (TypeError, ValueError) as exc:
            raise InvalidInputError(attribute.name, f"must be {expected}, got {value!r}") from exc

    return validate


class PlanMismatchError(MLAError, RuntimeError):
    """``run`` was handed a plan built for another strategy or geometry than its inputs."""


class ConcurrentUseError(MLAError, RuntimeError):
    """A second thread called a backend's ``builder.build`` or ``impl`` while another thread's
    call on the same backend was in progress. A backend serves one step at a time: its builds
    write the persistent buffers its runs read. Serialize the calls (one thread per backend, or
    a lock around each step's build and run), or give each thread its own backend."""


class ProviderUnavailableError(UnsupportedError):
    """A kernel provider was requested but cannot run here (unknown name, library or device
    missing). An :class:`UnsupportedError` (and a ``RuntimeError``) with no explanation."""
