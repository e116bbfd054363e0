"""Strategy × case matrices collected from support: a test is collected only for the pairs a
strategy supports, so the summary carries no "strategy declines this case" skips.

Support is what the kit reports with no kernel run (:func:`mla.testing.decode_support`,
:func:`mla.testing.prefill_support`), asked once per pair at collection time. The counts per
``(provider, arch, strategy)`` come with the parameters, for the tests that guard the coverage:
a regression in ``supports`` would otherwise shrink the matrix silently instead of failing.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import attrs
import pytest

from mla.core.support import Support
from mla.providers.base import KernelProvider
from mla.testing import emulated_provider

CaseT = TypeVar("CaseT")
Setting = tuple[str, str]
"""A provider name and the arch it is emulated on: ``("aiter", "gfx950")``."""


@attrs.frozen
class Matrix:
    """The supported pairs of a strategy × case product, as pytest parameters."""

    params: list[Any]
    """``pytest.param(strategy, provider, arch, case)`` per supported pair, with the id
    ``provider-arch-case-strategy``."""
    counts: Counter[tuple[str, str, str]]
    """Supported pairs per ``(provider, arch, strategy NAME)``."""
    total: int
    """Pairs asked about, supported or not."""


def supported_matrix(
    strategies: Sequence[type[Any]],
    settings: Sequence[Setting],
    cases_of: Callable[[str], Sequence[CaseT]],
    support: Callable[[type[Any], CaseT, KernelProvider, str], Support],
    case_id: Callable[[CaseT], str],
) -> Matrix:
    """Every ``(strategy, setting, case)`` for which ``support(strategy, case, provider, arch)``
    is empty of reasons, in a stable order (so every pytest-xdist worker collects the same)."""
    params: list[Any] = []
    counts: Counter[tuple[str, str, str]] = Counter()
    total = 0
    for provider, arch in settings:
        prov = emulated_provider(provider, arch)
        for case in cases_of(provider):
            for strategy in strategies:
                total += 1
                if support(strategy, case, prov, arch):
                    counts[(provider, arch, strategy.NAME)] += 1
                    params.append(
                        pytest.param(
                            strategy,
                            provider,
                            arch,
                            case,
                            id=f"{provider}-{arch}-{case_id(case)}-{strategy.NAME}",
                        )
                    )
    return Matrix(params, counts, total)
