"""``benchmarks/wgmma_rate_probe.py`` times one ``wgmma`` shape per case: each case must compile
for sm_90 to exactly the instruction it is named for (the shape, and the A operand in registers
or in shared memory), so a GPU session never times something else."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")

PROBE = Path(__file__).resolve().parents[2] / "benchmarks" / "wgmma_rate_probe.py"


def test_every_case_compiles_to_its_wgmma() -> None:
    # Compiling needs no GPU, but not the interpreter the CPU tests run Triton in.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    command = [sys.executable, str(PROBE), "--compile-only"]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-4000:]
    lines = result.stdout.strip().splitlines()
    expected = [
        f"N={n} A={operand}: 64x{n}x16 A={operand}"
        for n in (16, 64, 256)
        for operand in ("registers", "shared")
    ]
    assert lines == expected
