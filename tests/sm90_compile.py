"""Run Python in a process of its own without the Triton interpreter; read a kernel's SASS loops.

The CPU tests run Triton in its interpreter (``TRITON_INTERPRET=1``, set by ``conftest.py``),
which cannot compile a kernel; compiling the Gluon kernels for sm_90 needs no GPU, only a process
without that variable. Shared by the tests that compile kernels.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys


def run_without_interpreter(args: list[str], *, timeout: float = 900) -> str:
    """``python args...`` without ``TRITON_INTERPRET``; its stdout, after asserting that it exited
    with 0 (the assertion shows the end of its stderr)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def mma_loop_lengths(sass: str) -> list[int]:
    """Instructions of each loop of ``cuobjdump -sass`` output that issues tensor-core MMAs
    (``HGMMA``, or ``HMMA`` for ``mma.sync``): from a backward branch's target to the branch,
    skipping the spans that cross a warp specialisation's register reallocation or an exit
    (branches between partitions)."""
    ins = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    lengths = []
    for i, (addr, text) in enumerate(ins):
        branch = re.search(r"\bBRA\S*\s+(?:!?U?P\w+,\s*)?(0x[0-9a-f]+)", text)
        if branch is None or int(branch.group(1), 16) >= addr:
            continue
        body = [t for a, t in ins[: i + 1] if a >= int(branch.group(1), 16)]
        if any("HGMMA" in t or "HMMA" in t for t in body) and not any(
            "SETMAXREG" in t or "EXIT" in t for t in body
        ):
            lengths.append(len(body))
    return lengths
