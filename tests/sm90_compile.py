"""Run Python in a process of its own without the Triton interpreter; read a kernel's SASS loops.

The CPU tests run Triton in its interpreter (``TRITON_INTERPRET=1``, set by ``conftest.py``),
which cannot compile a kernel; compiling the Gluon kernels for sm_90 needs no GPU, only a process
without that variable. Shared by the tests that compile kernels.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap

RUNNER = textwrap.dedent(
    """
    import contextlib, io, json, os, sys, traceback

    script, cases = sys.argv[1], json.loads(sys.argv[2])
    code = compile(script, "<compile script>", "exec")
    results = {}
    for name, (cache_dir, args) in cases.items():
        os.environ["TRITON_CACHE_DIR"] = cache_dir  # (Triton reads it at each compile)
        sys.argv = ["-c", *args]
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed):
                exec(code, {"__name__": "__main__"})
        except BaseException:
            results[name] = [printed.getvalue(), traceback.format_exc()]
        else:
            results[name] = [printed.getvalue(), None]
    print(json.dumps(results))
    """
)
"""Runs one script once per case in one process: each case with its own ``sys.argv`` and Triton
cache directory; prints ``{case: [stdout, traceback or None]}``."""


def run_without_interpreter(args: list[str], *, timeout: float = 900) -> str:
    """``python args...`` without ``TRITON_INTERPRET``; its stdout, after asserting that it exited
    with 0 (the assertion shows the end of its stderr)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


class Compiled:
    """One case of :func:`compile_cases`: the Triton cache directory its kernels compiled into
    and what its script printed."""

    def __init__(self, cache_dir: pathlib.Path, printed: str, error: str | None) -> None:
        self.cache_dir = cache_dir
        self._printed = printed
        self._error = error

    def stdout(self) -> str:
        """What the case's script printed, after asserting that it raised nothing (the
        assertion shows its traceback)."""
        assert self._error is None, self._error[-4000:]
        return self._printed


def compile_cases(script: str, cases: dict[str, list[str]], root: pathlib.Path) -> dict[str, Compiled]:
    """Run ``script`` once per case (``sys.argv[1:]``: the case's arguments) in one process
    without the interpreter, each case compiling into its own cache directory under ``root``.

    One process for all the cases of a test file: each process spends seconds importing torch,
    Triton and ``mla`` before its first compile. A case that raises fails only its own test
    (:meth:`Compiled.stdout`)."""
    dirs = {name: root / name for name in cases}
    for path in dirs.values():
        path.mkdir()
    plan = {name: [str(dirs[name]), args] for name, args in cases.items()}
    printed = run_without_interpreter(["-c", RUNNER, script, json.dumps(plan)])
    results = json.loads(printed.strip().splitlines()[-1])
    return {name: Compiled(dirs[name], *results[name]) for name in cases}


def mma_loops(sass: str, mma: tuple[str, ...] = ("HGMMA", "HMMA")) -> list[list[str]]:
    """The instructions of each loop of ``cuobjdump -sass`` output that issues tensor-core MMAs
    (an instruction naming one of ``mma``: by default 16-bit ``wgmma``, ``HGMMA``, and
    ``mma.sync``, ``HMMA``; ``"GMMA"`` takes the 8-bit ``QGMMA`` too): from a backward branch's
    target to the branch, skipping the spans that cross a warp specialisation's register
    reallocation or an exit (branches between partitions)."""
    ins = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    loops = []
    for i, (addr, text) in enumerate(ins):
        branch = re.search(r"\bBRA\S*\s+(?:!?U?P\w+,\s*)?(0x[0-9a-f]+)", text)
        if branch is None or int(branch.group(1), 16) >= addr:
            continue
        body = [t.strip() for a, t in ins[: i + 1] if a >= int(branch.group(1), 16)]
        if any(name in t for t in body for name in mma) and not any(
            "SETMAXREG" in t or "EXIT" in t for t in body
        ):
            loops.append(body)
    return loops


def mma_loop_lengths(sass: str) -> list[int]:
    """Instructions of each loop of :func:`mma_loops`."""
    return [len(body) for body in mma_loops(sass)]


def sass_of(cubin: str, cuobjdump: str) -> str:
    """The ``cuobjdump -sass`` listing of a compiled kernel's cubin."""
    return subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True, check=True).stdout


def stack_and_mma_loops(cubin: str, cuobjdump: str) -> tuple[int, list[int]]:
    """``(stack bytes, MMA loop lengths)`` of a compiled kernel's cubin, read with ``cuobjdump``."""
    usage = subprocess.run([cuobjdump, "-res-usage", cubin], capture_output=True, text=True, check=True)
    stack = re.search(r"STACK:(\d+)", usage.stdout)
    assert stack is not None, usage.stdout
    sass = sass_of(cubin, cuobjdump)
    return int(stack.group(1)), mma_loop_lengths(sass)
