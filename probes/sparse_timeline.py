"""Where a key tile's time goes in the ``fp8_ds_mla`` sparse decode kernels: SM clock stamps per key
tile and partition, read back and summed up.

    python -m probes.tree_ab make abtrees heads-stamps=probes/timeline/sparse-heads-stamps.patch \\
        rows-stamps=probes/timeline/sparse-rows-stamps.patch                    # CPU
    python -m probes.sparse_timeline run abtrees/heads-stamps 128 128 2 [--out OUT]   # GPU
    python -m probes.sparse_timeline run abtrees/rows-stamps 16 128 2 [--out OUT]

``probes/timeline/sparse-heads-stamps.patch`` has every partition of the 64-row kernel
(:mod:`mla.providers.gluon.ds_mla_heads`) read the SM clock at its steps of each key tile;
``sparse-rows-stamps.patch`` does the same for the 16/32-row kernel (:mod:`.ds_mla_rows`, its serial
MMA loop, the planner's pick). Every thread of a partition stores the same word,
``[program, tile, stamp]`` (the first 64 tiles of a program; the stamp numbers are
:data:`HEADS_STAGES` and :data:`ROWS_STAGES`' ends). ``run`` imports ``mla`` from the stamped tree
(its own process, as :mod:`probes.tree_ab` does), checks the output against the torch provider,
times the call (CUDA-graph replays), stamps one call and prints each stage's median, 10th and
90th percentile in clocks over every tile of every program (the first tile of each left out).
The stamps cost about 4–5%. What it found is in ``probes/timeline/README.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks._common import print_table
from probes import tree_ab

HEADS_STAGES: dict[str, tuple[int, int, int]] = {
    "scores: wait for the tile's first chunk pair": (0, 1, 0),
    "scores: wait for the second pair": (1, 2, 0),
    "scores: QKᵀ after the second pair": (2, 3, 0),
    "scores: softmax and P published": (3, 4, 0),
    "scores: its P·V": (4, 5, 0),
    "scores: release to the next tile": (5, 0, 1),
    "scores: period": (0, 0, 1),
    "output: P published to seen": (4, 6, 0),
    "output: its P·V": (6, 7, 0),
    "producer: next tile's copies issued to its first pair landed": (14, 9, 1),
    "producer: first pair dequantized": (9, 10, 0),
    "producer: second pair landed and dequantized": (10, 12, 0),
    "producer: next tile's copies issued": (12, 14, 0),
    "producer: period": (12, 12, 1),
    "scores at the tile to the tile announced": (0, 12, 0),
}
"""The 64-row kernel's stages: name → (from stamp, to stamp, tiles later). Stamps: the scores
warpgroup at a tile's top (0), after its wait for each chunk pair (1, 2), after its ``QKᵀ`` wait
(3), before its ``P·V`` issue (4), after its wait (5); the output warpgroup after its wait for
``P`` (6) and for its ``P·V`` (7); the producer after its wait for the tile's first pair of copies
(9), after announcing each pair (10, 12), after issuing the next tile's copies (14)."""

ROWS_STAGES: dict[str, tuple[int, int, int]] = {
    "mma: wait for the tile": (0, 1, 0),
    "mma: QKᵀ": (1, 2, 0),
    "mma: softmax and Pᵀ published": (2, 3, 0),
    "mma: P·V": (3, 4, 0),
    "mma: key ids to the next tile": (4, 0, 1),
    "mma: period": (0, 0, 1),
    "producer: tile announced to the next tile's first chunk landed": (11, 8, 1),
    "producer: wait for the bf16 tile and first chunk widened": (8, 9, 0),
    "producer: second chunk landed": (9, 10, 0),
    "producer: second chunk widened": (10, 11, 0),
    "producer: period": (11, 11, 1),
    "mma at the tile to the tile announced": (0, 11, 0),
}
"""The 16/32-row kernel's stages. Stamps: the MMA warpgroup at a tile's top (0), after its wait for
the bf16 tile (1), after its ``QKᵀ`` wait (2), before its ``P·V`` issue (3), after its wait (4);
the producer after each 32-row chunk's ``wait_group`` (8, 10) and after widening it (9, 11)."""

CHILD = r"""
import json, sys
from pathlib import Path
import numpy as np
import torch
import mla
from benchmarks._common import bench_graph_us, rel_error, tflops
from mla.providers.gluon import ds_mla_heads, ds_mla_rows
from mla.providers.gluon.decode import sparse_decode
from probes.sparse_case import ds_mla_case
from probes.sparse_timeline import summarize
print(json.dumps({"mla": mla.__file__}), flush=True)
heads, batch, qlen = map(int, sys.argv[1:4])
out = Path(sys.argv[4])
call, ref, config, flops = ds_mla_case(heads, batch, qlen)
sparse_decode(call, config=config)
err = rel_error(call.out.float(), ref.float())
us = bench_graph_us(lambda: sparse_decode(call, config=config))
module = ds_mla_heads if heads >= 64 else ds_mla_rows
module.TRACE_BUF.zero_()
sparse_decode(call, config=config)
torch.cuda.synchronize()
stamps = module.TRACE_BUF.view(-1, module.TRACE_TILES.value, 16).cpu().numpy().astype(np.int64) & 0xFFFFFFFF
np.save(out / f"stamps_H{heads}_B{batch}_q{qlen}.npy", stamps)
kernel = "heads" if module is ds_mla_heads else "rows"
print("ROW " + json.dumps({"kernel": config.kernel.value, "err": err, "ok": err < 2e-2, "us": us,
                           "TFLOP/s": tflops(flops, us), "stages": summarize(stamps, kernel)}), flush=True)
"""


def summarize(stamps: object, kernel: str) -> dict[str, list[float]]:
    """``[median, 10th, 90th percentile]`` clocks of each stage of ``kernel``'s table (``"heads"``:
    :data:`HEADS_STAGES`, ``"rows"``: :data:`ROWS_STAGES`) over every tile but the first of every
    program of ``stamps`` (``[programs, tiles, 16]`` int64 clock reads, a program's tiles past its
    last 0; programs of fewer than 3 tiles left out). A stage's clocks are signed (a stage whose
    end came first is negative), taken modulo ``2**32`` as the clock register wraps."""
    import numpy as np

    st = np.asarray(stamps, dtype=np.int64)
    stages = HEADS_STAGES if kernel == "heads" else ROWS_STAGES
    tiles = (st[:, :, 0] != 0).sum(axis=1)
    out: dict[str, list[float]] = {}
    for name, (first, last, later) in stages.items():
        spans = []
        for program, count in enumerate(tiles):
            if count < 3:
                continue
            start = st[program, : count - later, first]
            end = st[program, later:count, last]
            spans.append((((end - start + 2**31) % 2**32) - 2**31)[1:])
        if not spans:
            raise ValueError("no program stamped 3 tiles or more")
        clocks = np.concatenate(spans)
        out[name] = [float(np.median(clocks)), *(float(np.percentile(clocks, q)) for q in (10, 90))]
    return out


def run(tree: Path, heads: int, batch: int, qlen: int, out: Path, timeout: float) -> int:
    """The stamped ``tree``'s call at ``heads``/``batch``/``qlen`` (top-k 2048 of 32768): its check,
    time and stage table; the stamps saved to ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    done = tree_ab.run_in_tree(tree, CHILD, [str(heads), str(batch), str(qlen), str(out.resolve())], timeout)
    if done is None:
        return 1
    rows = [line for line in done.stdout.splitlines() if line.startswith("ROW ")]
    if done.returncode != 0 or not rows:
        print(done.stderr[-3000:])
        return 1
    row = json.loads(rows[0][4:])
    print(f"{row['kernel']}: {row['us']:.1f} µs, {row['TFLOP/s']:.1f} TFLOP/s, rel err {row['err']:.1e}")
    print_table(
        [
            {"stage": name, "median": f"{m:.0f}", "p10": f"{lo:.0f}", "p90": f"{hi:.0f}"}
            for name, (m, lo, hi) in row["stages"].items()
        ]
    )
    return 0 if row["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_run = sub.add_parser("run", help="the stage table of a stamped tree (GPU)")
    p_run.add_argument("tree", type=Path)
    p_run.add_argument("heads", type=int)
    p_run.add_argument("batch", type=int)
    p_run.add_argument("qlen", type=int)
    p_run.add_argument("--out", type=Path, default=Path("/tmp/sparse-timeline"))
    p_run.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args(argv)
    return run(args.tree, args.heads, args.batch, args.qlen, args.out, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
