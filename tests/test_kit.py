"""The conformance kit itself: pairwise selection covers every pair, decode checks exercise
``lse=None`` and catch a strategy that mishandles it, and the docs' example strategy passes."""

from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mla
from mla.testing import (
    DecodeCase,
    check_decode_strategy,
    decode_cases,
    emulated_provider,
    pairwise,
    scratch_registry,
    simulated_decode_context,
)

DOCS = Path(__file__).resolve().parent.parent / "docs"


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 6), min_size=2, max_size=5))
def test_pairwise_covers_every_pair(sizes: list[int]) -> None:
    rows = pairwise(sizes)
    assert rows == pairwise(sizes), "the selection must be deterministic"
    assert all(
        len(row) == len(sizes) and all(0 <= v < n for v, n in zip(row, sizes, strict=True)) for row in rows
    )
    for i, j in itertools.combinations(range(len(sizes)), 2):
        covered = {(row[i], row[j]) for row in rows}
        assert covered == set(itertools.product(range(sizes[i]), range(sizes[j]))), (i, j)


def test_pairwise_edge_sizes() -> None:
    assert pairwise([]) == [()]
    assert pairwise([3]) == [(0,), (1,), (2,)]
    assert pairwise([2, 0, 3]) == []


def test_exhaustive_cases_are_the_full_product() -> None:
    kw: dict[str, Any] = {"heads": (1, 2), "qlen_patterns": ((1,), (2, 2)), "block_sizes": (1, 16)}
    full = list(decode_cases(exhaustive=True, **kw))
    assert len(full) == 2 * 2 * 2 * 3 * 4
    assert len(list(decode_cases(**kw))) < len(full)


CASE = DecodeCase(heads=4, qlens=(2, 1), seq_lens=(9, 30), extra_rows=1, kv_lora_rank=64, rope_dim=16)


def test_decode_check_runs_without_lse() -> None:
    result = check_decode_strategy(mla.AsmNonPersistent, CASE, provider="torch", platform="cpu")
    assert result.ok, result
    assert result.comparison is not None
    assert result.comparison.with_lse
    assert result.without_lse is not None
    assert not result.without_lse.with_lse
    assert "lse=None" in str(result)


def test_a_strategy_that_needs_an_lse_fails_the_kit() -> None:
    """Writing the LSE unconditionally works with a tensor and crashes on the default ``None``."""

    class AlwaysWritesLse(mla.AsmNonPersistent):
        NAME = "test-always-writes-lse"

        def launch(self, plan, q, kv_flat, *, kv_scale, out, lse):  # type: ignore[no-untyped-def]
            super().launch(plan, q, kv_flat, kv_scale=kv_scale, out=out, lse=lse)
            lse[plan.geometry.num_owned_tokens :].fill_(float("-inf"))

    with pytest.raises(AssertionError, match=r"lse=None \(the production default\) raised"):
        check_decode_strategy(AlwaysWritesLse, CASE, provider="torch", platform="cpu")


def test_a_row_left_unwritten_without_lse_fails_the_kit() -> None:
    class SkipsLastRowWithoutLse(mla.AsmNonPersistent):
        NAME = "test-skips-last-row-without-lse"

        def launch(self, plan, q, kv_flat, *, kv_scale, out, lse):  # type: ignore[no-untyped-def]
            saved = out[-1].clone()
            super().launch(plan, q, kv_flat, kv_scale=kv_scale, out=out, lse=lse)
            if lse is None:
                out[-1].copy_(saved)

    result = check_decode_strategy(SkipsLastRowWithoutLse, CASE, provider="torch", platform="cpu")
    assert result.comparison is not None
    assert result.comparison.ok
    assert result.without_lse is not None
    assert result.without_lse.unwritten_rows == 1
    assert not result.ok
    with pytest.raises(AssertionError, match=r"lse=None\): .* 1 unwritten rows"):
        result.assert_passed()


def _docs_example_strategy() -> type[mla.DecodeStrategy]:
    """The first Python block of docs/adding-a-strategy.md, executed as written."""
    text = (DOCS / "adding-a-strategy.md").read_text()
    block = re.search(r"```python\n(.*?)```", text, re.DOTALL)
    assert block is not None
    namespace: dict[str, Any] = {"__name__": "docs_example"}
    exec(compile(block.group(1), "adding-a-strategy.md", "exec"), namespace)
    strategy: type[mla.DecodeStrategy] = namespace["UnpaddedPagedDecode"]
    return strategy


@pytest.mark.parametrize(
    "case",
    list(decode_cases(heads=(1, 8, 12, 128), qlen_patterns=((1,), (1, 1, 1)), block_sizes=(1, 16))),
    ids=lambda c: c.id,
)
def test_docs_example_passes_the_kit(case: DecodeCase) -> None:
    strategy = _docs_example_strategy()
    result = check_decode_strategy(strategy, case, provider="torch", platform="cpu")
    assert result.supported, result.reasons
    result.assert_passed()


def test_docs_example_declines_aiter_head_padding() -> None:
    strategy = _docs_example_strategy()
    case = DecodeCase(heads=12, qlens=(1, 1), seq_lens=(40, 7), kv_lora_rank=64, rope_dim=16)
    result = check_decode_strategy(
        strategy, case, provider=emulated_provider("aiter", "gfx950"), platform="gfx950"
    )
    assert not result.supported
    assert "heads" in result.support.codes


def test_docs_example_is_listed_by_explain() -> None:
    strategy = _docs_example_strategy()
    ctx = simulated_decode_context("cpu", heads=8)
    explanation = mla.Resolver(scratch_registry([(strategy, 25)])).explain(ctx)
    assert explanation.candidate(strategy.NAME).supported
    assert strategy.NAME not in [c.name for c in mla.Resolver().explain(ctx).candidates]
