"""The folded split reduce's host side on the CPU: column chunks, merge steps, launch checks."""

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
    ("num_splits", "rank", "chunk"),
    [(128, 512, 4), (64, 512, 8), (2, 512, 256), (256, 512, 0), (3, 512, 0), (1, 512, 0), (96, 384, 4)],
)
def test_fold_chunk(num_splits: int, rank: int, chunk: int) -> None:
    # Splits must cut the latent width into equal chunks of at least 4 fp32 columns (16 bytes).
    assert fold.fold_chunk(num_splits=num_splits, rank=rank) == chunk


@pytest.mark.parametrize(
    ("num_splits", "rows", "chunk", "block"),
    [(128, 16, 4, 64), (2, 16, 256, 2), (16, 32, 32, 8), (4, 64, 128, 4), (6, 16, 4, 2), (64, 16, 8, 32)],
)
def test_fold_block_splits_golden(num_splits: int, rows: int, chunk: int, block: int) -> None:
    assert fold.fold_block_splits(num_splits=num_splits, rows=rows, chunk=chunk) == block


@given(st.integers(2, 256), st.sampled_from([16, 32, 64]), st.sampled_from([4, 8, 16, 32, 64, 128, 256]))
def test_fold_block_splits_is_the_largest_dividing_power_of_two(
    num_splits: int, rows: int, chunk: int
) -> None:
    block = fold.fold_block_splits(num_splits=num_splits, rows=rows, chunk=chunk)
    values = fold.merge_step(rows * chunk)
    assert values == min(rows * chunk, fold.MERGE_STEP)
    assert block & (block - 1) == 0
    assert num_splits % block == 0
    assert block * values <= fold.MERGE_VALUES
    bigger = 2 * block
    assert bigger > num_splits or num_splits % bigger or bigger * values > fold.MERGE_VALUES


def test_fold_plan_off_without_the_flag() -> None:
    config = GluonLaunchConfig(row_tile=16, num_splits=4)
    assert decode._fold_barrier(config, grid=8, rank=512, device=torch.device("cpu")) is None


def test_fold_plan_of_a_one_wave_launch() -> None:
    # The CPU reports 8 SMs: 8 programs fit one wave.
    config = GluonLaunchConfig(row_tile=16, num_splits=4, fold=True)
    words = decode._fold_barrier(config, grid=8, rank=512, device=torch.device("cpu"))
    # 4 splits of 16 rows x 128 columns: 512 values a pass, all 4 splits a step.
    assert fold.fold_block_splits(num_splits=4, rows=16, chunk=128) == 4
    assert words is not None
    assert words.dtype == torch.int32
    assert words.tolist() == [0, 0]


@pytest.mark.parametrize(
    ("num_splits", "grid", "why"),
    [
        (4, 9, "9 programs on 8 SMs"),
        (3, 6, "num_splits=3"),
        (1, 2, "num_splits=1"),
        (256, 8, "num_splits=256"),
    ],
    ids=["more-programs-than-sms", "splits-not-dividing", "one-split", "chunks-under-4-columns"],
)
def test_fold_plan_rejects_launches_that_cannot_fold(num_splits: int, grid: int, why: str) -> None:
    config = GluonLaunchConfig(row_tile=16, num_splits=num_splits, fold=True)
    with pytest.raises(InvalidInputError, match="config") as info:
        decode._fold_barrier(config, grid=grid, rank=512, device=torch.device("cpu"))
    assert why in str(info.value)
    assert "fold=False" in str(info.value)


SPILL_SCRIPT = """
import json, sys
sys.path.insert(0, "benchmarks")
from gluon_compile import compile_variant, instruction_counts, sass_of

out = {}
for rows, fp8, splits in [(16, False, 2), (16, False, 128), (32, False, 2), (32, True, 128), (64, False, 2)]:
    kernel = compile_variant(fp8=fp8, block_n=64, stages=2, rows=rows, fold=splits)
    name = f"rows{rows}-{'fp8' if fp8 else 'bf16'}-fold{splits}"
    out[name] = instruction_counts(sass_of(kernel), ["LDL", "STL"])
json.dump(out, sys.stdout)
"""


def test_folded_kernels_compile_without_spills() -> None:
    """The merge after the main loop must not push the few-rows kernel into local memory (a
    whole ``rows × chunk`` piece in registers at once did: up to 2,950 spill loads at 32 rows
    and two splits). Compiled for sm_90 in a process without the interpreter."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    import json

    from sm90_compile import run_without_interpreter

    counts = json.loads(run_without_interpreter(["-c", SPILL_SCRIPT]).strip().splitlines()[-1])
    assert counts == {name: {"LDL": 0, "STL": 0} for name in counts}
    assert len(counts) == 5
