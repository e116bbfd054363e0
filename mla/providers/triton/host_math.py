"""Plain-Python launch arithmetic of the Triton providers' host code.

Triton 3.6's ``triton.next_power_of_2`` and ``triton.cdiv`` are ``constexpr_function`` objects
that cost about 5 µs of host time per call; the launchers' per-call sizes use these instead
(the same values for the non-negative sizes they see).
"""

from __future__ import annotations


def next_power_of_2(n: int) -> int:
    """The smallest power of two ``>= n`` for ``n >= 1`` (0 for 0), as ``triton.next_power_of_2``."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def cdiv(x: int, y: int) -> int:
    """``ceil(x / y)`` of ints, as ``triton.cdiv``."""
    return (x + y - 1) // y


def round_up(value: int, multiple: int) -> int:
    """``value`` rounded up to a multiple of ``multiple`` (ints, ``multiple > 0``)."""
    return cdiv(value, multiple) * multiple


__all__ = ["cdiv", "next_power_of_2", "round_up"]
