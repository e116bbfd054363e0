"""``benchmarks/wgmma_rate_probe.py`` times one ``wgmma`` shape per case: each case must compile
for sm_90 to exactly the instruction it is named for (the shape, and the A operand in registers
or in shared memory), so a GPU session never times something else."""

from __future__ import annotations

from pathlib import Path

import pytest
from sm90_compile import run_without_interpreter

pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")

PROBE = Path(__file__).resolve().parents[2] / "benchmarks" / "wgmma_rate_probe.py"


def test_every_case_compiles_to_its_wgmma() -> None:
    lines = run_without_interpreter([str(PROBE), "--compile-only"], timeout=600).strip().splitlines()
    expected = [
        f"N={n} A={operand}: 64x{n}x16 A={operand}"
        for n in (16, 64, 256)
        for operand in ("registers", "shared")
    ]
    assert lines == expected
