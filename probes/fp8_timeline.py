"""Where a key tile's time goes in the Gluon fp8 prefill's consumer warpgroups (persistent layout): SM clock
stamps per key tile and warpgroup, read back and summed up.

    python -m probes.fp8_timeline make DIR [NAME=PATCH ...]   # CPU: DIR/stamps, DIR/NAME (PATCH + stamps)
    python -m probes.fp8_timeline run DIR/stamps [--out OUT]  # GPU: the table; each shape's stamps, OUT/*.npy
    python -m probes.fp8_timeline plot OUT/H128_4x4096.npy timeline.png [--sm 0 --first 100 --tiles 12]

``probes/timeline/fp8-prefill-stamps.patch`` (applied by ``make``, on top of ``PATCH`` for a candidate; a
candidate touching the same lines needs a hand merge) has each consumer warpgroup of
:mod:`mla.providers.gluon.prefill_fp8_persistent` read the SM clock four times a key tile: before the
``QKᵀ`` issue (its wait for the K tile included), after the ``QKᵀ`` wait, before the ``P·V`` issue, after the
``P·V`` wait; every thread of the warpgroup stores the same word, ``[program, warpgroup, ring tile, stamp]``
(the first 8192 ring tiles of a program). So per tile: ``qk`` (stamps 0→1), ``softmax`` (1→2: the K slot's
release, the online softmax, the wait for V^T, P packed to e4m3), ``pv`` (2→3), ``gap`` (3→next 0: the V^T
release, the query tile's epilogue at its last tile) and ``period`` (0→next 0), in clocks, with the share
of warpgroup 0's softmax time that warpgroup 1 also spends in its softmax (``both``). The stamps cost about
1–3% (the ``us`` column against ``tree_ab run fp8-prefill``).

``run`` imports ``mla`` from the tree (its own process, as :mod:`probes.tree_ab` does) and checks each shape's
output against the float32 reference on two heads first. What it found is in ``probes/timeline/README.md``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks._common import print_table
from probes import tree_ab

ROOT = Path(__file__).resolve().parent.parent
STAMPS = ROOT / "probes" / "timeline" / "fp8-prefill-stamps.patch"
SHAPES = [(128, 4, 4096), (16, 4, 4096), (128, 16, 1024)]
"""(heads, requests, tokens a request), 192/128 causal: the fp8 rows of ``python -m benchmarks prefill``."""
STAGES = ("qk", "softmax", "pv", "gap", "period")

CHILD = r"""
import json, sys
from pathlib import Path
import numpy as np
import torch
import mla
from benchmarks._common import bench_us, tflops
from benchmarks.prefill import Case, reference_heads, rel
from mla.providers.gluon import prefill_fp8_persistent as stamped
from mla.providers.gluon.prefill_fp8_split import TRACE_MAXG
from probes.fp8_timeline import SHAPES, summarize
tiles = TRACE_MAXG.value
out = Path(sys.argv[1])
print(json.dumps({"mla": mla.__file__}), flush=True)
for heads, batch, seqlen in SHAPES:
    c = Case(heads, batch, seqlen)
    picked = [0, heads - 1]
    deq = [x.float() * s for x, s in ((c.q8, c.q_scale), (c.k8, c.k_scale), (c.v8, c.v_scale))]
    ref, _ = reference_heads(deq[0], deq[1], deq[2], c, picked)
    del deq
    c.out.fill_(float("nan"))
    c.run_gluon_fp8()
    torch.cuda.synchronize()
    err = rel(c.out[:, picked], ref)
    us = sorted(bench_us(c.run_gluon_fp8) for _ in range(3))[1]
    stamped.TRACE_BUF.zero_()
    c.run_gluon_fp8()
    torch.cuda.synchronize()
    programs = stamped.TRACE_BUF.numel() // (2 * tiles * 4)
    stamps = stamped.TRACE_BUF.view(programs, 2, tiles, 4).cpu().numpy().astype(np.int64) & 0xFFFFFFFF
    name = f"H{heads}_{batch}x{seqlen}"
    np.save(out / f"{name}.npy", stamps)
    row = {"shape": name, "err": err, "us": us, "TFLOP/s": tflops(c.flops, us), **summarize(stamps)}
    print("ROW " + json.dumps(row), flush=True)
"""


def summarize(stamps: object) -> dict[str, float]:
    """Medians (clocks) of each stage over every live tile of every program and warpgroup of ``stamps``
    (``[programs, 2, tiles, 4]`` int64, unwritten tiles 0), and ``both``: the share of warpgroup 0's
    softmax time during which warpgroup 1 is in its softmax too."""
    import numpy as np

    s = np.asarray(stamps)
    stages: dict[str, list[np.ndarray]] = {name: [] for name in STAGES}
    overlap = total = 0
    for program in s:
        spans = []
        for warpgroup in program:
            t = warpgroup[(warpgroup != 0).all(-1)]
            spans.append(t[:, 1:3])
            if len(t) < 2:
                continue
            for k, name in enumerate(STAGES[:3]):
                stages[name].append(t[:, k + 1] - t[:, k])
            stages["gap"].append(t[1:, 0] - t[:-1, 3])
            stages["period"].append(t[1:, 0] - t[:-1, 0])
        a, b = spans
        i = j = 0
        while i < len(a) and j < len(b):
            overlap += max(0, min(a[i, 1], b[j, 1]) - max(a[i, 0], b[j, 0]))
            if a[i, 1] < b[j, 1]:
                i += 1
            else:
                j += 1
        total += int((a[:, 1] - a[:, 0]).sum())
    row = {name: float(np.median(np.concatenate(xs))) if xs else float("nan") for name, xs in stages.items()}
    row["both"] = float(overlap / total) if total else float("nan")
    return row


def run(tree: Path, out: Path, timeout: float) -> int:
    """The shapes in a process whose ``mla`` is ``tree``'s; the table, the stamps under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    done = tree_ab.run_in_tree(tree, CHILD, [str(out.resolve())], timeout)
    if done is None:
        return 1
    rows = [json.loads(line[4:]) for line in done.stdout.splitlines() if line.startswith("ROW ")]
    if done.returncode != 0 or not rows:
        print(done.stderr[-3000:])
        return 1
    table = [
        {"shape": r["shape"], "err": f"{r['err']:.1e}", "µs": f"{r['us']:.1f}",
         "TFLOP/s": f"{r['TFLOP/s']:.1f}", **{name: f"{r[name]:.0f}" for name in STAGES},
         "both": f"{r['both']:.2f}"}
        for r in rows
    ]  # fmt: skip
    print_table(table)
    (out / "summary.json").write_text(json.dumps(rows, indent=1))
    return 0


def plot(stamps_file: Path, png: Path, sm: int, first: int, tiles: int) -> None:
    """Both warpgroups of program ``sm``: ``tiles`` key tiles from its ``first``-th, a bar a stage."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    s = np.load(stamps_file)[sm]
    fig, ax = plt.subplots(figsize=(14, 2.4))
    start = None
    for w in range(2):
        t = s[w][(s[w] != 0).all(-1)][first : first + tiles]
        start = t[0, 0] if start is None else start
        for row in t:
            for k, colour in enumerate(("tab:blue", "tab:orange", "tab:green")):
                ax.barh(
                    w, row[k + 1] - row[k], left=row[k] - start, color=colour, edgecolor="k", linewidth=0.3
                )
    ax.set_yticks([0, 1], ["warpgroup 0", "warpgroup 1"])
    ax.set_xlabel("SM clocks: QKᵀ issue and wait (blue), softmax (orange), P·V issue and wait (green)")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_make = sub.add_parser("make", help="DIR/stamps, and DIR/NAME for each NAME=PATCH (CPU)")
    p_make.add_argument("directory", type=Path)
    p_make.add_argument("specs", nargs="*", help="NAME=PATCH: a candidate with the stamps on top")
    p_run = sub.add_parser("run", help="the table and the stamps of a stamped tree (GPU)")
    p_run.add_argument("tree", type=Path)
    p_run.add_argument("--out", type=Path, default=Path("timeline"))
    p_run.add_argument("--timeout", type=float, default=300.0)
    p_plot = sub.add_parser("plot", help="one program's timeline from a run's .npy")
    p_plot.add_argument("stamps", type=Path)
    p_plot.add_argument("png", type=Path)
    p_plot.add_argument("--sm", type=int, default=0)
    p_plot.add_argument("--first", type=int, default=100)
    p_plot.add_argument("--tiles", type=int, default=12)
    args = parser.parse_args(argv)
    if args.command == "make":
        specs = [f"stamps={STAMPS}"]
        for spec in args.specs:
            name, _, patch = spec.partition("=")
            specs.append(f"{name}={patch}+{STAMPS}")
        tree_ab.make(args.directory, specs)
        return 0
    if args.command == "run":
        return run(args.tree, args.out, args.timeout)
    plot(args.stamps, args.png, args.sm, args.first, args.tiles)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
