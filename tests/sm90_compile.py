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


def run_without_interpreter(
    args: list[str], *, timeout: float = 900, cache_dir: pathlib.Path | None = None
) -> str:
    """``python args...`` without ``TRITON_INTERPRET`` (and with ``cache_dir`` as Triton's cache
    when given, to read the cubins after); its stdout, after asserting that it exited with 0
    (the assertion shows the end of its stderr)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if cache_dir is not None:
        env["TRITON_CACHE_DIR"] = str(cache_dir)
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


def _sass_instructions(sass: str) -> list[tuple[int, str]]:
    """``(address, instruction)`` of each line of a ``cuobjdump -sass`` listing."""
    return [
        (int(m.group(1), 16), m.group(2).strip())
        for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)
    ]


def _unpredicated(text: str) -> str:
    """A SASS instruction without its ``@P``/``@!P`` guard."""
    return re.sub(r"^@!?U?P\w+\s+", "", text)


def mma_loops(sass: str, mma: tuple[str, ...] = ("HGMMA", "HMMA")) -> list[list[str]]:
    """The instructions of each loop of ``cuobjdump -sass`` output that issues tensor-core MMAs
    (an instruction naming one of ``mma``: by default 16-bit ``wgmma``, ``HGMMA``, and
    ``mma.sync``, ``HMMA``; ``"GMMA"`` takes the 8-bit ``QGMMA`` too): from a backward branch's
    target to the branch, skipping the spans that cross a warp specialisation's register
    reallocation or an exit (branches between partitions)."""
    ins = _sass_instructions(sass)
    loops = []
    for i, (addr, text) in enumerate(ins):
        branch = re.search(r"\bBRA\S*\s+(?:!?U?P\w+,\s*)?(0x[0-9a-f]+)", text)
        if branch is None or int(branch.group(1), 16) >= addr:
            continue
        body = [t for a, t in ins[: i + 1] if a >= int(branch.group(1), 16)]
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


def resource_usage(cubin: str, cuobjdump: str) -> tuple[int, str]:
    """``(stack bytes, the whole ``cuobjdump -res-usage`` report)`` of a compiled kernel's cubin
    (the report for assertion messages, and its other fields)."""
    usage = subprocess.run(
        [cuobjdump, "-res-usage", cubin], capture_output=True, text=True, check=True
    ).stdout
    stack = re.search(r"STACK:(\d+)", usage)
    assert stack is not None, usage
    return int(stack.group(1)), usage


def stack_and_mma_loops(cubin: str, cuobjdump: str) -> tuple[int, list[int]]:
    """``(stack bytes, MMA loop lengths)`` of a compiled kernel's cubin, read with ``cuobjdump``."""
    return resource_usage(cubin, cuobjdump)[0], mma_loop_lengths(sass_of(cubin, cuobjdump))


_GMMA = re.compile(r"^[HQI]GMMA\.\d+x(\d+)x\d+\.(\S+)\s+R(\d+),\s*(R(\d+)|gdesc)")
"""A ``wgmma`` in SASS (without its guard, :func:`_unpredicated`): its N, types, first accumulator
register and register-A operand (if any)."""
_NO_REGISTER_DESTINATION = (
    "ST", "LDGSTS", "LDGDEPBAR", "RED", "ATOM", "BRA", "BAR", "WARPGROUP", "BSYNC", "BSSY", "SYNCS",
    "EXIT", "RET", "CALL", "NOP", "DEPBAR", "MEMBAR", "FENCE", "UTMA", "WARPSYNC", "CCTL", "ERRBAR",
    "YIELD", "ISETP", "FSETP", "PLOP3", "R2UR",
)  # fmt: skip
"""Opcodes whose first operand is not a destination register (stores, branches, barriers,
predicate and uniform-register writers)."""


def _registers(text: str) -> set[int]:
    return {int(r) for r in re.findall(r"\bR(\d+)\b", text)}


def _written_and_read(text: str) -> tuple[set[int], set[int]]:
    """The general registers an instruction writes and reads (vector widths from ``.64``/``.128``)."""
    op, _, rest = _unpredicated(text).partition(" ")
    operands = [o.strip() for o in rest.split(",")] if rest else []
    if not operands or op.startswith(_NO_REGISTER_DESTINATION):
        return set(), set().union(*map(_registers, operands)) if operands else set()
    first = _registers(operands[0])
    width = 4 if ".128" in op else 2 if ".64" in op else 1
    written = set(range(min(first), min(first) + width)) if first else set()
    return written, set().union(*map(_registers, operands[1:])) if len(operands) > 1 else set()


def wgmma_register_hazards(sass: str) -> list[str]:
    """Every instruction that touches an asynchronous ``wgmma``'s registers before the wait that
    retires it: for each commit group (the ``wgmma`` instructions up to one marked ``gsb0``), the
    control flow is followed from the group's end until a ``WARPGROUP.DEPBAR.LE gsb0, N`` with
    ``N`` below the groups issued since; a non-``wgmma`` instruction on the way that reads or
    writes one of the group's accumulator registers, or writes one of its register-A operands,
    is a hazard (the PTX ISA, "wgmma.wait_group": such an access is undefined behaviour; a
    compiler that reuses those registers early corrupts the product). One line per hazard."""
    code = _sass_instructions(sass)
    index = {addr: i for i, (addr, _) in enumerate(code)}

    def successors(i: int) -> list[int]:
        text = code[i][1]
        body = _unpredicated(text)
        nxt = [i + 1] if i + 1 < len(code) else []
        if body.startswith("BRA"):
            target = re.search(r"0x([0-9a-f]+)", body)
            jump = [index[int(target.group(1), 16)]] if target and int(target.group(1), 16) in index else []
            return jump + nxt if text.startswith("@") else jump
        if body.startswith(("EXIT", "RET")) and not text.startswith("@"):
            return []
        return nxt

    groups, acc, reg_a = [], set(), set()
    for i, (_, text) in enumerate(code):
        m = _GMMA.match(_unpredicated(text))
        if m is None:
            continue
        n, types, first = int(m.group(1)), m.group(2), int(m.group(3))
        acc |= set(range(first, first + (n // 2 if types.startswith(("F32", "S32")) else n // 4)))
        if m.group(5) is not None:
            reg_a |= set(range(int(m.group(5)), int(m.group(5)) + 4))
        if "gsb0" in text:
            groups.append((i, acc, reg_a))
            acc, reg_a = set(), set()
    hazards = []
    for end, acc, reg_a in groups:
        pending, seen = [(end + 1, 0)], set()
        while pending:
            i, later = pending.pop()
            if i >= len(code) or (i, later) in seen:
                continue
            seen.add((i, later))
            addr, text = code[i]
            wait = re.search(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x([0-9a-f]+)", text)
            if wait and int(wait.group(1), 16) <= later:
                continue
            if _GMMA.match(_unpredicated(text)):
                later = min(later + ("gsb0" in text), 8)  # (bounded: a loop's path revisits its states)
            else:
                written, read = _written_and_read(text)
                touched = (written & (acc | reg_a)) | (read & acc)
                if touched:
                    hazards.append(
                        f"{code[end][0]:05x} {code[end][1]} -> {addr:05x} {text} (R{min(touched)})"
                    )
                    continue
            pending.extend((j, later) for j in successors(i))
    return hazards
