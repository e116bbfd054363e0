"""Time whole copies of the ``mla`` package against each other on the GPU, each in its own process.

    python -m probes.tree_ab make trees main vt=vt.patch deq=deq.patch   # CPU: build the trees
    python -m probes.tree_ab run sparse-heads trees/main trees/vt        # GPU: one table
    python -m probes.tree_ab run fp8-prefill trees/main trees/vt
    python -m probes.tree_ab cases                                        # what each case times

``make DIR NAME[=PATCH[+PATCH...]] ...`` copies this checkout's ``mla/`` to ``DIR/NAME/mla`` and
applies each ``PATCH`` in turn (a ``git diff`` from the repository root, or from the tree the
patch before it left; its files outside ``mla/`` are left out) to the copy with ``patch``. A
change that spans several modules, or one whose edits :mod:`probes.whatif`
cannot express, is timed this way; put the trees under an untracked directory of the checkout
so the device tool copies them along.

``run CASE TREE ...`` runs ``CASE`` once per tree, in a process whose ``mla`` is the tree's
(its own interpreter: the kernels compile from the tree's source, the launch caches start
empty), and prints one row per shape and one column per tree. Every case checks its outputs
against a reference before it times them: a tree whose output is wrong shows ``wrong`` and no
time (``--unchecked`` times it anyway, marked ``(wrong)``: a tree with a piece of work taken
out bounds what that work costs). The ``mla`` each process imported is printed first, so a
tree that silently imported the checkout's package shows.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from benchmarks._common import print_table

ROOT = Path(__file__).resolve().parent.parent

CASES: dict[str, str] = {
    "sparse-heads": "fp8_ds_mla sparse decode at 64 and 128 heads (the 64-row kernel's shapes)",
    "sparse-rows": "fp8_ds_mla sparse decode at 16 and 32 heads (the few-rows kernels' shapes)",
    "fp8-prefill": "the Gluon fp8 prefill, 192/128 causal, H16/H128 x 4x4096/16x1024",
    "bf16-prefill": "the Gluon bf16 prefill's split and persistent layouts, the same shapes",
}
"""What each case times (``run``'s first argument)."""

CHILD = r"""
import json, math, os, sys
import torch
import mla
case = sys.argv[1]
UNCHECKED = os.environ.get("TREE_AB_UNCHECKED") == "1"  # (time wrong outputs too: --unchecked)
rows = []
print(json.dumps({"mla": mla.__file__}), flush=True)
if case.startswith("sparse"):
    from benchmarks._common import bench_graph_us, rel_error, tflops
    from mla.providers.gluon.decode import sparse_decode
    from probes.sparse_case import ds_mla_case
    shapes = ([(128, 128, 2), (64, 128, 2), (128, 64, 1), (128, 16, 1)] if case == "sparse-heads"
              else [(16, 128, 2), (16, 64, 1), (32, 64, 1)])
    for heads, batch, qlen in shapes:
        call, ref, config, flops = ds_mla_case(heads, batch, qlen)
        sparse_decode(call, config=config)
        err = rel_error(call.out.float(), ref.float())
        ok = err < 2e-2
        us = bench_graph_us(lambda: sparse_decode(call, config=config)) if ok or UNCHECKED else math.nan
        rows.append({"shape": f"H{heads} B{batch} q{qlen}", "kernel": config.kernel.value, "us": us,
                     "TFLOP/s": tflops(flops, us), "err": err, "ok": ok})
        print(json.dumps(rows[-1]), flush=True)
elif case == "fp8-prefill":
    from benchmarks._common import bench_us, tflops
    from benchmarks.prefill import Case, reference_heads, rel
    for heads, batch, seqlen in [(16, 4, 4096), (128, 4, 4096), (16, 16, 1024), (128, 16, 1024)]:
        c = Case(heads, batch, seqlen)
        picked = [0, heads - 1]
        deq = [x.float() * s for x, s in ((c.q8, c.q_scale), (c.k8, c.k_scale), (c.v8, c.v_scale))]
        ref, _ = reference_heads(deq[0], deq[1], deq[2], c, picked)
        del deq
        c.out.fill_(math.nan)
        c.run_gluon_fp8()
        torch.cuda.synchronize()
        err = rel(c.out[:, picked], ref)
        ok = err < 4e-2
        us = sorted(bench_us(c.run_gluon_fp8) for _ in range(3))[1] if ok or UNCHECKED else math.nan
        rows.append({"shape": c.name, "kernel": "gluon-fp8", "us": us, "TFLOP/s": tflops(c.flops, us),
                     "err": err, "ok": ok})
        print(json.dumps(rows[-1]), flush=True)
elif case == "bf16-prefill":
    from benchmarks._common import bench_us, tflops
    from benchmarks.prefill import Case, reference_heads, rel
    for heads, batch, seqlen in [(16, 4, 4096), (128, 4, 4096), (16, 16, 1024), (128, 16, 1024)]:
        c = Case(heads, batch, seqlen)
        picked = [0, heads - 1]
        ref, _ = reference_heads(c.q, c.k, c.v, c, picked)
        for kernel in ("SPLIT", "PERSISTENT"):
            c.out.fill_(math.nan)
            c.run_gluon(kernel)
            torch.cuda.synchronize()
            err = rel(c.out[:, picked], ref)
            run = lambda kernel=kernel: c.run_gluon(kernel)
            ok = err < 1e-2
            us = sorted(bench_us(run) for _ in range(3))[1] if ok or UNCHECKED else math.nan
            rows.append({"shape": f"{c.name} {kernel.lower()}", "kernel": kernel, "us": us,
                         "TFLOP/s": tflops(c.flops, us), "err": err, "ok": ok})
            print(json.dumps(rows[-1]), flush=True)
else:
    raise SystemExit(f"unknown case {case!r}")
print("ROWS " + json.dumps(rows))
"""


def _mla_sections(patch: str) -> str:
    """The file sections of a ``git diff`` that change files under ``mla/``."""
    sections = patch.split("diff --git ")
    return "".join("diff --git " + part for part in sections[1:] if part.startswith("a/mla/"))


def make(directory: Path, specs: list[str]) -> None:
    """Build one tree a spec: ``NAME`` (this checkout's ``mla/``) or ``NAME=PATCH[+PATCH...]`` (the
    patches' hunks under ``mla/`` applied in turn with ``patch``, each on the tree the one before
    left; a patch that changes nothing there is refused)."""
    for spec in specs:
        name, _, patches = spec.partition("=")
        tree = directory / name
        if tree.exists():
            shutil.rmtree(tree)
        shutil.copytree(ROOT / "mla", tree / "mla", ignore=shutil.ignore_patterns("__pycache__"))
        for patch in patches.split("+") if patches else []:
            text = _mla_sections(Path(patch).read_text())
            if not text:
                raise SystemExit(f"{patch}: no change under mla/")
            subprocess.run(
                ["patch", "-p1", "--batch", "--forward", "-s", "-d", str(tree)],
                input=text,
                text=True,
                check=True,
            )
        print(f"{tree}: mla/{' + ' + patches if patches else ''}")


def run(case: str, trees: list[Path], timeout: float, rounds: int = 1, *, unchecked: bool = False) -> int:
    """``case`` in one process per tree and round (the trees in turn, ``rounds`` times: the spread
    between a tree's rounds is the noise to judge a difference by); one table, a column a tree
    and round (``NAME`` or ``NAME rK``). ``unchecked``: a wrong output is timed too (a tree
    with work taken out, to bound what that work costs), its cell marked ``(wrong)``."""
    names = [tree.name for tree in trees]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise SystemExit(f"two trees named {twice[0]!r}: give each its own name (or pass --rounds)")
    results: dict[str, dict[str, dict[str, float | str]]] = {}
    for round_ in range(1, rounds + 1):
        for tree in trees:
            column = tree.name if rounds == 1 else f"{tree.name} r{round_}"
            rows = _run_tree(case, tree, timeout, unchecked)
            if rows is not None:
                results[column] = rows
    if not results:
        return 1
    print_table(_table(results))
    return 0


def run_in_tree(
    tree: Path, code: str, args: list[str], timeout: float, **env: str
) -> subprocess.CompletedProcess[str] | None:
    """``python -c code args...`` in a process whose ``mla`` is ``tree``'s (the checkout's root
    after it on the path, for ``benchmarks`` and ``probes``), ``env`` added to its environment;
    ``code`` prints ``{"mla": mla.__file__}`` as its first line, which is echoed so a tree that
    imported the checkout's package shows. None (and a line saying so) past ``timeout``."""
    full_env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree.resolve()), str(ROOT)]), **env)
    try:
        done = subprocess.run(
            [sys.executable, "-c", code, *args],
            check=False,
            cwd=tree,
            env=full_env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        print(f"{tree}: timed out after {timeout:.0f} s", flush=True)
        return None
    lines = done.stdout.splitlines()
    print(f"{tree}: {json.loads(lines[0])['mla'] if lines else 'no output'}", flush=True)
    return done


def _run_tree(
    case: str, tree: Path, timeout: float, unchecked: bool = False
) -> dict[str, dict[str, float | str]] | None:
    """The rows ``case`` printed in a process whose ``mla`` is ``tree``'s, by shape; None (and its
    stderr's end printed) when it failed."""
    done = run_in_tree(tree, CHILD, [case], timeout, TREE_AB_UNCHECKED="1" if unchecked else "0")
    if done is None:
        return None
    final = [line for line in done.stdout.splitlines() if line.startswith("ROWS ")]
    if done.returncode != 0 or not final:
        print(done.stderr[-3000:])
        return None
    rows = {row["shape"]: row for row in json.loads(final[0][5:])}
    # (each tree's numbers as they come, should the run be cut off before the table)
    print("  " + "; ".join(f"{shape} {row['us']:.1f} µs" for shape, row in rows.items()), flush=True)
    return rows


def _table(results: dict[str, dict[str, dict[str, float | str]]]) -> list[dict[str, object]]:
    """A row a shape (the first column's shapes, in order), a column a tree and round: ``µs
    TFLOP/s``; ``wrong`` where the output failed its check and was not timed, ``µs TFLOP/s
    (wrong)`` where it was timed anyway (``--unchecked``)."""
    table = []
    for shape in next(iter(results.values())):
        row: dict[str, object] = {"shape": shape}
        for column, rows in results.items():
            r = rows.get(shape)
            ok = r is not None and r["us"] == r["us"]
            cell = f"{r['us']:.1f} µs {r['TFLOP/s']:.1f}" if ok and r else "wrong"
            row[column] = cell if not ok or not r or r.get("ok", True) else f"{cell} (wrong)"
        table.append(row)
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_make = sub.add_parser("make", help="copy mla/ into DIR/NAME, a patch applied to each copy")
    p_make.add_argument("directory", type=Path)
    p_make.add_argument("specs", nargs="+", help="NAME or NAME=PATCH")
    p_run = sub.add_parser("run", help="time a case in each tree (GPU)")
    p_run.add_argument("case", choices=sorted(CASES))
    p_run.add_argument("trees", nargs="+", type=Path)
    p_run.add_argument("--timeout", type=float, default=300.0, help="seconds a tree (default 300)")
    p_run.add_argument("--rounds", type=int, default=1, help="times each tree runs, in turn (default 1)")
    p_run.add_argument(
        "--unchecked", action="store_true", help="time wrong outputs too (trees with work taken out)"
    )
    sub.add_parser("cases", help="what each case times")
    args = parser.parse_args(argv)
    if args.command == "make":
        make(args.directory, args.specs)
        return 0
    if args.command == "run":
        return run(args.case, args.trees, args.timeout, args.rounds, unchecked=args.unchecked)
    for name, what in CASES.items():
        print(f"{name:14} {what}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
