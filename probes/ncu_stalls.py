"""Where a warp-specialised Gluon kernel's warps stall, per partition, from an Nsight Compute
per-instruction export.

    ncu --kernel-name regex:mla_decode_dual --launch-skip 1 --launch-count 1 \\
        --section SourceCounters --page source --print-source sass --csv \\
        python3 -m probes.gluon_dev --once fp8 > dual_sass.csv
    python -m probes.ncu_stalls dual_sass.csv

The SASS of a ``gl.warp_specialize`` kernel holds each partition's code in one stretch, which
starts where the partition sets its register budget (``USETMAXREG``): each stretch is named by
that budget and by whether it issues ``wgmma`` (``HGMMA`` for 16-bit operands, ``QGMMA`` for
8-bit ones). A kernel without ``setmaxnreg`` is split around its clusters of ``wgmma``
instructions instead, what follows the last one being the default partition. Prints each
partition's share of the stall samples and of the executed instructions, and the instructions
with the most samples (with the dominant reason).
"""

from __future__ import annotations

import csv
import itertools
import re
import sys
from collections.abc import Sequence

from benchmarks._common import print_table

GAP = 400
"""SASS instructions between two ``wgmma`` clusters that start a new partition."""
WGMMA = re.compile(r"\b[HQI]GMMA\.")
"""A ``wgmma`` instruction of any operand type."""
MAXREG = re.compile(r"USETMAXREG\.(?:TRY_ALLOC|DEALLOC)\.CTAPOOL (?:\w+, )?(0x[0-9a-f]+)")
"""A partition setting its register budget (the budget, hex)."""


def _num(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def load(path: str) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the per-instruction table (ncu's log lines before it skipped)."""
    with open(path) as f:
        lines = f.read().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('"Address"'))
    rows = list(csv.reader(lines[start:]))
    return rows[0], rows[1:]


def partitions(source: Sequence[str]) -> list[tuple[str, int, int]]:
    """``(name, first, end)`` instruction ranges: one per register budget a partition sets
    (``USETMAXREG``), or, without any, one per ``wgmma`` cluster, then the rest."""
    starts = [i for i, s in enumerate(source) if MAXREG.search(s)]
    if starts:
        bounds = [0, *starts, len(source)]
        out = []
        for a, b in itertools.pairwise(bounds):
            budget = MAXREG.search(source[a])
            regs = f"{int(budget.group(1), 16)} registers" if budget else "entry"
            kind = "MMA" if any(WGMMA.search(s) for s in source[a:b]) else "other"
            out.append((f"{kind}, {regs}", a, b))
        return out
    mma = [i for i, s in enumerate(source) if WGMMA.search(s)]
    clusters: list[list[int]] = []
    for i in mma:
        if clusters and i - clusters[-1][-1] < GAP:
            clusters[-1].append(i)
        else:
            clusters.append([i])
    bounds = [0] + [(a[-1] + b[0]) // 2 for a, b in itertools.pairwise(clusters)]
    bounds.append(min(clusters[-1][-1] + GAP // 2, len(source)) if clusters else 0)
    out = [(f"MMA partition {k}", bounds[k], bounds[k + 1]) for k in range(len(clusters))]
    return [*out, ("default partition", bounds[-1], len(source))]


def main() -> None:
    header, rows = load(sys.argv[1])
    src, samples = header.index("Source"), header.index("Warp Stall Sampling (All Samples)")
    executed = header.index("Instructions Executed")
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    total = sum(_num(r[samples]) for r in rows) or 1.0
    total_exec = sum(_num(r[executed]) for r in rows) or 1.0
    table = []
    for name, a, b in partitions([r[src] for r in rows]):
        part = rows[a:b]
        table.append(
            {"partition": name, "SASS lines": f"{a}-{b}",
             "stall samples": f"{sum(_num(r[samples]) for r in part) / total:.0%}",
             "instructions": f"{sum(_num(r[executed]) for r in part) / total_exec:.0%}"}
        )  # fmt: skip
    print_table(table, title="stall samples and executed instructions per partition")
    hot = []
    for i in sorted(range(len(rows)), key=lambda i: -_num(rows[i][samples]))[:15]:
        r = rows[i]
        reason = max(reasons, key=lambda h: _num(r[header.index(h)]))
        hot.append(
            {"SASS line": i, "samples": f"{_num(r[samples]) / total:.1%}",
             "main reason": reason.removeprefix("stall_"), "instruction": r[src].strip()[:70]}
        )  # fmt: skip
    print_table(hot, title="the instructions with the most stall samples")


if __name__ == "__main__":
    main()
