"""The split reduce folded into the few-rows decode kernel, against the separate reduce launch.

    python -m probes.fold                 # every case, three alternating rounds (~1-2 min on an H200)
    python -m probes.fold --rounds 5 --json OUT.json

For each case (16 or 32 rows, non-persistent splits that fit one wave, so the launch can fold)
it runs the Gluon decode with the launch heuristic's configuration twice, ``fold=False`` (decode
kernel, then the split reduce) and ``fold=True`` (one cooperative launch: grid barrier, then
in-kernel merge; ``mla.providers.gluon.fold``), and for each:

* checks the output and LSE against the torch reference (no timing when either error exceeds
  1e-2);
* captures a CUDA graph and replays it three times onto NaN-poisoned outputs: each replay must
  equal the eager result bit for bit (the barrier words must come back as they started);
* times graph replays (``bench_graph_us``), the variants alternating over ``--rounds`` rounds,
  and lists the kernels' own times (profiler).
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

import attrs
import torch

from benchmarks._common import bench_graph_us, gpu_name, print_table
from benchmarks.decode import RANK, Problem, Shape, check_before_timing, label
from mla.providers import get_provider
from mla.providers.gluon.decode import paged_decode
from mla.providers.gluon.fold import fold_slice, foldable_splits
from mla.providers.gluon.planner import GluonKernel, GluonLaunchConfig, launch_config
from mla.providers.triton.decode import num_sms
from probes.gluon_dev import kernel_times

CASES = [
    Shape("long", 16, 1, 1, 65536),
    Shape("long", 16, 1, 2, 32768),
    Shape("long", 16, 1, 4, 16384),
    Shape("long", 16, 2, 1, 65536),
    Shape("long", 16, 1, 8, 8192),
    Shape("mem", 16, 1, 64, 4096),
    Shape("short", 16, 1, 1, 4096),
    Shape("long", 32, 1, 1, 65536, kv="fp8"),
]


def configs(shape: Shape, sms: int) -> dict[str, GluonLaunchConfig]:
    """The heuristic's configuration (on the few-rows kernel) without and with the fold (there with
    the most splits that fold: 64 rather than 66 at B2, so one program per SM fewer)."""
    auto = launch_config(
        batch=shape.batch, rows=shape.heads * shape.qlen, max_seqlen_k=shape.seq, num_sms=sms,
        persistent=False, kv_fp8=shape.kv == "fp8",
    )  # fmt: skip
    base = attrs.evolve(auto, kernel=GluonKernel.ROWS)
    splits = foldable_splits(base.num_splits, rows=base.row_tile, rank=RANK)
    return {"separate": base, "fold": attrs.evolve(base, num_splits=splits, fold=True)}


def graph_replays_equal_eager(prob: Problem, fn: Any) -> bool:
    """Three replays of a captured ``fn`` onto NaN-poisoned outputs, each equal to the eager run."""
    fn()
    torch.cuda.synchronize()
    ref_o, ref_l = prob.out.clone(), prob.lse.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        fn()
    same = True
    for _ in range(3):
        prob.out.fill_(math.nan)
        prob.lse.fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize()
        same &= bool(torch.equal(prob.out, ref_o) and torch.equal(prob.lse, ref_l))
    return same


def run_case(shape: Shape, rounds: int) -> list[dict[str, Any]]:
    device = torch.device("cuda")
    prob = Problem(shape, device)
    variants = configs(shape, num_sms(device))
    rows, fns = [], {}
    for name, config in variants.items():
        fn = lambda config=config: paged_decode(prob.paged_call(), config=config)  # noqa: E731
        grid = shape.batch * config.num_splits * config.row_blocks(shape.heads * shape.qlen)
        row: dict[str, Any] = {
            "shape": label(shape),
            "variant": name,
            "splits": config.num_splits,
            "slice": fold_slice(num_splits=config.num_splits, rows=config.row_tile, rank=RANK),
            "programs": grid,
        }
        try:
            row["check"] = check_before_timing(prob, fn, f"{label(shape)} {name}")
            row["graph == eager"] = graph_replays_equal_eager(prob, fn) if row["check"] == "ok" else False
        except Exception as exc:  # a launch that cannot fold is reported, not fatal
            row["check"] = f"FAIL {type(exc).__name__}: {str(exc)[:120]}"
            row["graph == eager"] = False
        if row["check"] == "ok":
            fns[name] = fn
        row["us"] = []
        rows.append(row)
    for _ in range(rounds):
        for row in rows:
            if row["variant"] in fns:
                row["us"].append(bench_graph_us(fns[row["variant"]]))
    for row in rows:
        times = row.pop("us")
        row["graph µs"] = min(times) if times else math.nan
        row["rounds µs"] = " ".join(f"{t:.1f}" for t in times)
        tbps = prob.metrics(row["graph µs"])[0] if times else math.nan
        row["TB/s"] = tbps
        if row["variant"] in fns:
            row["kernels µs"] = " ".join(
                f"{k[:16]}={v:.1f}" for k, v in kernel_times(fns[row["variant"]]).items()
            )
        print(row, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3, help="alternating timing rounds (default 3)")
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("probes/fold.py needs a CUDA GPU")
    if not (support := get_provider("gluon").availability()):
        raise SystemExit(f"probes/fold.py times the Gluon provider, which is unavailable: {support}")
    print(f"# GPU: {gpu_name()}, torch {torch.__version__}", flush=True)
    rows = []
    for shape in CASES:
        rows += run_case(shape, args.rounds)
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": gpu_name(), "rows": rows}, f, indent=1, default=str)
    print_table(
        rows,
        title=f"Gluon few-rows decode on {gpu_name()}: split reduce as a separate launch or folded "
        f"into the kernel (graph replay, best of {args.rounds} alternating rounds)",
    )


if __name__ == "__main__":
    main()
