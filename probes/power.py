"""Which decode cases run into the GPU's power cap: each case timed after idle and sustained.

    python -m probes.power                       # the decode matrix, ~1-2 min on an H200
    python -m probes.power --only fp8 compute    # some cases (the names of decode.py's --only)
    python -m probes.power --idle 4 --sustain 3 --json OUT.json

The H200 is capped at 700 W. A kernel that draws near the cap makes the GPU lower its SM clock
(nvidia-smi's throttle reason 0x4, software power cap) after about a second, so the same kernel
times slower in a long benchmark run than from a cool start. For each case of
``benchmarks/decode.py``'s matrix, on the Gluon provider's non-persistent path
(``paged_mqa_decode`` without a schedule), this checks the output against the torch reference
(no timing when the error exceeds 1e-2: a FAIL note), waits ``--idle`` seconds, times once
(``bench_graph_us`` over 5 ms: "after idle"), then times back to back for ``--sustain`` seconds
while sampling the GPU (``sample_gpu_state``): "sustained" is the median of those timings,
``slowdown`` sustained over after idle, ``MHz`` and ``W`` the mean SM clock and board power while
sustained, ``capped`` the fraction (0.0 to 1.0) of the samples with the power-cap bit set (NaN
where nothing could be sampled).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from typing import Any

import torch

from benchmarks._common import (
    GpuState,
    bench_graph_us,
    gpu_name,
    gpu_state_columns,
    nvml_index,
    print_table,
    sample_gpu_state,
)
from benchmarks.decode import MATRIX, Problem, Shape, check_before_timing, label, select_cases
from mla.providers import get_provider


def run_case(shape: Shape, *, idle_s: float, sustain_s: float) -> dict[str, Any]:
    """One row: the case's check, its after-idle and sustained times and the GPU state."""
    prob = Problem(shape, torch.device("cuda"))
    fn = prob.provider_fn(get_provider("gluon"), persistent=False)
    row: dict[str, Any] = {"shape": label(shape), "check": check_before_timing(prob, fn, label(shape))}
    after = sustained = math.nan
    times: list[float] = []
    state: GpuState | None = None
    source = "none"
    if row["check"] == "ok":
        torch.cuda.synchronize()
        time.sleep(idle_s)
        after = bench_graph_us(fn, rep_ms=5)
        with sample_gpu_state(nvml_index(), period_s=0.02) as gpu:
            start = time.perf_counter()
            times.append(bench_graph_us(fn))  # at least one timing, whatever --sustain is
            while time.perf_counter() - start < sustain_s:
                times.append(bench_graph_us(fn))
        state, source = gpu.summary(), gpu.source
        sustained = statistics.median(times)
    row.update(
        {
            "after idle µs": after,
            "sustained µs": sustained,
            "slowdown": sustained / after,
            **gpu_state_columns(state),
            "rounds": len(times),
            "sampler": source,
        }
    )
    print(row, flush=True)
    del prob, fn
    torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--only", nargs="+", metavar="CASE", help="only these cases of the matrix (mem, long, fp8, ...)"
    )
    parser.add_argument("--idle", type=float, default=4.0, help="seconds idle before each case (default 4)")
    parser.add_argument(
        "--sustain", type=float, default=3.0, help="seconds of back-to-back timing per case (default 3)"
    )
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args()
    shapes = select_cases(MATRIX, args.only, parser)
    if not torch.cuda.is_available():
        raise SystemExit("probes/power.py needs a CUDA GPU")
    if not (support := get_provider("gluon").availability()):
        raise SystemExit(f"probes/power.py times the Gluon provider, which is unavailable: {support}")
    print(f"# GPU: {gpu_name()}, torch {torch.__version__}", flush=True)
    rows = [run_case(s, idle_s=args.idle, sustain_s=args.sustain) for s in shapes]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": gpu_name(), "idle_s": args.idle, "sustain_s": args.sustain, "rows": rows}, f,
                      indent=1, default=str)  # fmt: skip
    sources = sorted({r["sampler"] for r in rows})
    print(f"# GPU state sampled through: {', '.join(sources)}", flush=True)
    columns = ("shape", "check", "after idle µs", "sustained µs", "slowdown", "MHz", "W", "capped")
    print_table(
        [{k: r[k] for k in columns} for r in rows],
        title=f"Gluon decode (np) on {gpu_name()}: {args.idle:g} s idle then one 5 ms timing, against "
        f"the median of {args.sustain:g} s of timings (MHz, W: means; capped: fraction of samples)",
    )


if __name__ == "__main__":
    main()
