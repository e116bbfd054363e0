"""The folded split reduce's host side on the CPU: output slices, merge steps, launch checks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mla.core.errors import InvalidInputError
from mla.providers.gluon.planner import GluonLaunchConfig

fold = pytest.importorskip("mla.providers.gluon.fold")
decode = pytest.importorskip("mla.providers.gluon.decode")


@pytest.mark.parametrize(
    ("num_splits", "rows", "rank", "values", "most_foldable"),
    [
        (128, 16, 512, 64, 128),
        (64, 16, 512, 128, 64),
        (2, 16, 512, 4096, 2),
        (2, 64, 512, 16384, 2),
        (256, 16, 512, 32, 256),
        (200, 16, 512, 0, 128),
        (66, 16, 512, 0, 64),
        (33, 16, 512, 0, 32),
        (3, 16, 512, 0, 2),
        (1, 16, 512, 0, 0),
        (96, 16, 384, 64, 96),
        (100, 16, 384, 0, 96),
        (2, 16, 384, 0, 0),
    ],
)
def test_fold_slice_and_foldable_splits(
    num_splits: int, rows: int, rank: int, values: int, most_foldable: int
) -> None:
    # Splits cut a row block's rows x rank output into equal slices, merged in power-of-two passes
    # inside one row (384 columns: a 3,072-value slice takes 512-value passes that cross rows);
    # foldable_splits is the most splits at most num_splits that fold (B2's 66 folds as 64).
    assert fold.fold_slice(num_splits=num_splits, rows=rows, rank=rank) == values
    assert fold.foldable_splits(num_splits, rows=rows, rank=rank) == most_foldable


@pytest.mark.parametrize(
    ("num_splits", "values", "block"),
    [(128, 64, 128), (2, 512, 2), (16, 512, 16), (32, 512, 16), (6, 64, 2), (64, 128, 64), (128, 128, 64)],
)
def test_fold_block_splits_golden(num_splits: int, values: int, block: int) -> None:
    assert fold.fold_block_splits(num_splits=num_splits, values=values) == block


@given(st.integers(2, 256), st.sampled_from([32, 64, 128, 256, 512]))
def test_fold_block_splits_is_the_largest_dividing_power_of_two(num_splits: int, values: int) -> None:
    block = fold.fold_block_splits(num_splits=num_splits, values=values)
    assert block & (block - 1) == 0
    assert num_splits % block == 0
    assert block * values <= fold.MERGE_VALUES
    bigger = 2 * block
    assert bigger > num_splits or num_splits % bigger or bigger * values > fold.MERGE_VALUES


@given(st.integers(1, 256), st.sampled_from([16, 32, 64]), st.sampled_from([256, 384, 512]))
def test_fold_slice_passes_stay_in_one_row(num_splits: int, rows: int, rank: int) -> None:
    values = fold.fold_slice(num_splits=num_splits, rows=rows, rank=rank)
    if values == 0:
        return
    step = fold.merge_step(values)
    assert values * num_splits == rows * rank
    assert step & (step - 1) == 0
    assert values % step == 0
    assert rank % step == 0  # a pass starting at a multiple of step never crosses a row


def test_fold_plan_off_without_the_flag() -> None:
    config = GluonLaunchConfig(row_tile=16, num_splits=4)
    assert decode._fold_barrier(config, grid=8, rank=512, device=torch.device("cpu")) is None


def test_fold_plan_of_a_one_wave_launch() -> None:
    # The CPU reports 8 SMs: 8 programs fit one wave.
    config = GluonLaunchConfig(row_tile=16, num_splits=4, fold=True)
    words = decode._fold_barrier(config, grid=8, rank=512, device=torch.device("cpu"))
    # 4 splits of a 16 x 512 block: 2,048 values each, 512 a pass, all 4 splits a step.
    assert fold.fold_slice(num_splits=4, rows=16, rank=512) == 2048
    assert fold.fold_block_splits(num_splits=4, values=512) == 4
    assert words is not None
    assert words.dtype == torch.int32
    assert words.tolist() == [0, 0]


@pytest.mark.parametrize(
    ("num_splits", "grid", "rank", "why"),
    [
        (4, 9, 512, "9 programs on 8 SMs"),
        (3, 6, 512, "num_splits=3"),
        (1, 2, 512, "num_splits=1"),
        (2, 4, 384, "16 x 384 output"),
    ],
    ids=["more-programs-than-sms", "splits-not-dividing", "one-split", "passes-crossing-rows"],
)
def test_fold_plan_rejects_launches_that_cannot_fold(num_splits: int, grid: int, rank: int, why: str) -> None:
    config = GluonLaunchConfig(row_tile=16, num_splits=num_splits, fold=True)
    with pytest.raises(InvalidInputError, match="config") as info:
        decode._fold_barrier(config, grid=grid, rank=rank, device=torch.device("cpu"))
    assert why in str(info.value)
    assert "fold=False" in str(info.value)
