"""Run Python in a process of its own without the Triton interpreter.

The CPU tests run Triton in its interpreter (``TRITON_INTERPRET=1``, set by ``conftest.py``),
which cannot compile a kernel; compiling the Gluon kernels for sm_90 needs no GPU, only a process
without that variable. Shared by the tests that compile kernels.
"""

from __future__ import annotations

import os
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
