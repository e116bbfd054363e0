"""Development harness of the Gluon decode: check every variant on small shapes, then time.

    python -m probes.gluon_dev [--sweep] [--out DIR]

Checks (against the torch reference provider, NaN-poisoned outputs): bf16 and fp8 caches,
page sizes 1/16/64 via random token permutations, heads 1..128, qlen 1..8 uniform and mixed,
empty and short requests, each on the non-persistent path (auto, 1 and 3 splits), the planned
schedule and the small-head path. ``--sweep`` then times alternative tile shapes on the key
cases (CUDA-graph replay); ``benchmarks/decode.py`` times the providers side by side.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import traceback
from typing import Any

import attrs
import torch

from benchmarks._common import bench_graph_us, print_table, rel_error
from benchmarks.decode import SCALE, Problem, label
from mla.providers.calls import PagedDecodeCall, SmallHeadDecodeCall
from mla.providers.gluon import decode as gd
from mla.providers.gluon.planner import GluonKernel, GluonLaunchConfig, launch_config, schedule_units
from mla.providers.split_kv import SplitKVSchedule
from mla.providers.torch_ref import TorchProvider
from mla.providers.triton import TritonProvider
from mla.providers.triton.decode import num_sms
from mla.providers.triton.schedule import plan_split_kv

RANK, ROPE = 512, 64
FP8 = torch.float8_e4m3fn


def make_case(
    heads: int, qlens: list[int], lens: list[int], block: int, fp8: bool, seed: int
) -> dict[str, Any]:
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(seed)
    blocks_per = [-(-max(n, 1) // block) for n in lens]
    nblocks = sum(blocks_per) + 3
    vals = torch.randn(nblocks, block, RANK + ROPE, device=dev, generator=g)
    scale = 0.05 if fp8 else None
    cache = (vals / scale).clamp(-448, 448).to(FP8) if fp8 else vals.to(torch.bfloat16)
    perm = torch.randperm(nblocks, device=dev, generator=g)
    idx = []
    pos = 0
    for n, nb in zip(lens, blocks_per, strict=True):
        pages = perm[pos : pos + nb]
        pos += nb
        toks = (pages[:, None] * block + torch.arange(block, device=dev)[None, :]).reshape(-1)[:n]
        idx.append(toks)
    kv_indices = torch.cat(idx).to(torch.int32) if idx else torch.zeros(0, dtype=torch.int32, device=dev)
    kv_indptr = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    qo_indptr = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    tokens = sum(qlens)
    q = torch.randn(tokens, heads, RANK + ROPE, device=dev, generator=g).to(torch.bfloat16)
    return {
        "heads": heads, "qlens": qlens, "lens": lens, "block": block, "fp8": fp8,
        "cache": cache.view(-1, RANK + ROPE), "kv_indices": kv_indices, "kv_indptr": kv_indptr,
        "qo_indptr": qo_indptr, "q": q, "scale": scale,
        "scale_t": torch.tensor([scale or 1.0], dtype=torch.float32, device=dev),
    }  # fmt: skip


def reference(c: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    o = torch.empty(c["q"].shape[0], c["heads"], RANK, dtype=torch.float32, device="cuda")
    lse = torch.empty(c["q"].shape[0], c["heads"], dtype=torch.float32, device="cuda")
    TorchProvider().paged_mqa_decode(
        PagedDecodeCall(
            q=c["q"],
            kv_cache=c["cache"],
            kv_indptr=c["kv_indptr"],
            kv_indices=c["kv_indices"],
            qo_indptr=c["qo_indptr"],
            out=o,
            lse=lse,
            max_qlen=max(c["qlens"]),
            max_seqlen_k=max(c["lens"]),
            page_size=c["block"],
            softmax_scale=SCALE,
            kv_scale=c["scale_t"] if c["fp8"] else None,
        )
    )
    return o, lse


def run_variant(c: dict[str, Any], variant: str, with_lse: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    tokens, heads = c["q"].shape[0], c["heads"]
    out = torch.full((tokens, heads, RANK), math.nan, dtype=torch.bfloat16, device="cuda")
    lse = torch.full((tokens, heads), math.nan, dtype=torch.float32, device="cuda") if with_lse else None
    max_qlen, max_len = max(c["qlens"]), max(c["lens"])
    scale_t = c["scale_t"] if c["fp8"] else None
    if variant == "small":
        assert max_qlen == 1
        gd.small_head_decode(
            SmallHeadDecodeCall(
                q_nope=c["q"][..., :RANK],
                q_pe=c["q"][..., RANK:],
                kv_cache=c["cache"],
                page_table=c["kv_indices"],
                seq_info=c["kv_indptr"],
                out=out,
                lse=lse,
                max_seqlen_k=max_len,
                page_size=c["block"],
                softmax_scale=SCALE,
                kv_scale=scale_t,
            )
        )
        return out, lse
    sched = None
    config = None
    auto = launch_config(
        batch=len(c["lens"]), rows=heads * max_qlen, max_seqlen_k=max_len,
        num_sms=num_sms(c["q"].device), persistent=False, kv_fp8=c["cache"].element_size() == 1,
    )  # fmt: skip
    if variant == "sched":
        batch = len(c["lens"])
        sched = SplitKVSchedule.allocate(
            max_batch=batch, max_kernel_qlen=max_qlen, kernel_heads=heads, kv_lora_rank=RANK,
            num_units=schedule_units(num_sms=num_sms(c["q"].device), rows=heads * max_qlen),
            device=c["q"].device, min_chunk=256,
        )  # fmt: skip
        plan_split_kv(sched, c["kv_indptr"], batch)
    elif variant == "np64":
        config = GluonLaunchConfig(num_splits=2)
    elif variant.startswith("rows"):
        config = attrs.evolve(auto, kernel=GluonKernel.ROWS, num_splits=int(variant[4:] or auto.num_splits))
    elif variant.startswith("np") and variant[2:]:
        config = attrs.evolve(auto, num_splits=int(variant[2:]))
    gd.paged_decode(
        PagedDecodeCall(
            q=c["q"],
            kv_cache=c["cache"],
            kv_indptr=c["kv_indptr"],
            kv_indices=c["kv_indices"],
            qo_indptr=c["qo_indptr"],
            out=out,
            lse=lse,
            max_qlen=max_qlen,
            max_seqlen_k=max_len,
            page_size=c["block"],
            softmax_scale=SCALE,
            kv_scale=scale_t,
            schedule=sched,
        ),
        config=config,
    )
    return out, lse


CHECKS: list[tuple[int, list[int], list[int], int]] = [
    (16, [1] * 6, [4096, 33, 1000, 0, 64, 5], 64),
    (16, [1] * 4, [700, 1, 129, 2049], 1),
    (8, [1] * 3, [300, 64, 1500], 16),
    (1, [1, 1], [200, 77], 16),
    (12, [3, 3, 3], [300, 3, 1500], 16),
    (16, [4, 4, 4], [1200, 4, 0], 1),
    (16, [2, 1, 8], [520, 40, 900], 64),
    (128, [1, 2, 1], [800, 300, 2], 64),
    (64, [1, 1], [3000, 65], 1),
    (5, [8, 1], [2000, 9], 16),
    (16, [2, 2, 2], [700, 2, 1500], 16),
    (12, [2, 1], [900, 33], 1),
    (3, [7, 7], [130, 4000], 64),
]


def checks(log: list[dict[str, Any]]) -> bool:
    ok_all = True
    for i, (heads, qlens, lens, block) in enumerate(CHECKS):
        for fp8 in (False, True):
            c = make_case(heads, qlens, lens, block, fp8, seed=100 + i)
            ref_o, ref_l = reference(c)
            variants = ["np", "np1", "np3", "sched"] + (["small"] if max(qlens) == 1 else [])
            if heads * max(qlens) <= 32:
                variants.append("np64")
            if fp8 and heads * max(qlens) <= 16:
                variants += ["rows", "rows1", "rows3"]  # the few-rows kernel, not the dual-chain one
            for v in variants:
                for with_lse in (True, False) if v == "np" else (True,):
                    kv = "fp8" if fp8 else "bf16"
                    name = f"H{heads} q{qlens} S{lens} bs{block} {kv} {v}{'' if with_lse else ' nolse'}"
                    try:
                        out, lse = run_variant(c, v, with_lse)
                        torch.cuda.synchronize()
                        eo = rel_error(out.float(), ref_o)
                        el = 0.0 if lse is None else rel_error(lse, ref_l)
                        ok = eo <= 1e-2 and el <= 1e-3
                        row = {"case": name, "o_err": eo, "lse_err": el, "ok": ok}
                    except Exception as exc:  # report, keep checking the others
                        row = {"case": name, "o_err": math.inf, "lse_err": math.inf, "ok": False,
                               "error": f"{type(exc).__name__}: {str(exc)[-800:]}"}  # fmt: skip
                        traceback.print_exc()
                    ok_all &= bool(row["ok"])
                    log.append(row)
                    if not row["ok"]:
                        print("FAIL", row, flush=True)
    print(f"checks: {sum(r['ok'] for r in log)}/{len(log)} passed", flush=True)
    return ok_all


def sweep(rows: list[dict[str, Any]]) -> None:
    """The 64-row kernel against the transposed few-rows kernel on the few-row cases."""
    from benchmarks.decode import Shape

    dev = torch.device("cuda")
    shapes = [
        Shape("mem", 16, 1, 64, 4096), Shape("mem", 16, 1, 64, 8192), Shape("mem", 16, 1, 128, 4096),
        Shape("mem", 16, 1, 128, 8192), Shape("long", 16, 1, 1, 65536),
        Shape("page1", 16, 1, 16, 4096, block=1), Shape("verify", 16, 2, 64, 4096),
        Shape("heads", 8, 1, 128, 4096), Shape("heads", 12, 1, 128, 4096),
    ]  # fmt: skip
    for shape in shapes:
        prob = Problem(shape, dev)
        auto = launch_config(
            batch=shape.batch, rows=shape.heads * shape.qlen, max_seqlen_k=shape.seq,
            num_sms=num_sms(dev), persistent=False, kv_fp8=shape.kv == "fp8",
        )  # fmt: skip
        sched = SplitKVSchedule.allocate(
            max_batch=shape.batch, max_kernel_qlen=shape.qlen, kernel_heads=shape.heads, kv_lora_rank=RANK,
            num_units=schedule_units(num_sms=num_sms(dev), rows=shape.heads * shape.qlen), device=dev,
            min_chunk=256,
        )  # fmt: skip
        plan_split_kv(sched, prob.kv_indptr, shape.batch)
        for name, cfg, sc in [
            ("64-row np", attrs.evolve(auto, row_tile=64, kernel=GluonKernel.ROW64), None),
            (f"{auto.row_tile}-row np", auto, None),
            (f"{auto.row_tile}-row pers", None, sched),
        ]:

            def run(p: Problem = prob, cfg: Any = cfg, sc: Any = sc) -> None:
                gd.paged_decode(p.paged_call(schedule=sc), config=cfg)

            try:
                eo, _ = prob.check(run)
                us = bench_graph_us(run) if eo <= 1e-2 else math.nan
            except Exception as exc:
                eo, us = math.inf, math.nan
                print("sweep error", name, type(exc).__name__, str(exc)[-300:], flush=True)
            bw, fl = prob.metrics(us)
            rows.append(
                {"shape": label(shape), "kernel": name, "o_err": eo, "us": us, "TB/s": bw, "TFLOP/s": fl}
            )
            print(rows[-1], flush=True)
        del prob
        torch.cuda.empty_cache()


def kernel_times(fn: Any, reps: int = 20) -> dict[str, float]:
    """Device time per call of each kernel ``fn`` launches (µs, from the torch profiler over
    ``reps`` replays of a CUDA graph of ``fn``)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    sums: dict[str, float] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            name = event.name.split("(")[0][:28]
            sums[name] = sums.get(name, 0.0) + event.device_time / reps
    return sums


def breakdown(rows: list[dict[str, Any]], only: list[str]) -> None:
    """Per shape and launch variant: graph-replay time and each kernel's device time."""
    from benchmarks.decode import Shape

    dev = torch.device("cuda")
    shapes = [
        Shape("mem", 16, 1, 64, 4096), Shape("mem", 16, 1, 128, 4096), Shape("long", 16, 1, 1, 65536),
        Shape("page1", 16, 1, 16, 4096, block=1), Shape("verify", 16, 2, 64, 4096),
        Shape("verify", 16, 4, 64, 4096), Shape("compute", 128, 1, 64, 4096),
        Shape("verify", 16, 8, 64, 4096), Shape("mem", 16, 1, 128, 8192),
        Shape("fp8", 16, 1, 128, 8192, kv="fp8"),
        Shape("fp8", 16, 2, 64, 4096, kv="fp8"), Shape("fp8", 16, 1, 1, 65536, kv="fp8"),
    ]  # fmt: skip
    if only:
        shapes = [s for s in shapes if s.name in only]
    for shape in shapes:
        prob = Problem(shape, dev)
        auto = launch_config(
            batch=shape.batch, rows=shape.heads * shape.qlen, max_seqlen_k=shape.seq,
            num_sms=num_sms(dev), persistent=False, kv_fp8=shape.kv == "fp8",
        )  # fmt: skip
        sched = SplitKVSchedule.allocate(
            max_batch=shape.batch, max_kernel_qlen=shape.qlen, kernel_heads=shape.heads, kv_lora_rank=RANK,
            num_units=schedule_units(
                num_sms=num_sms(dev), rows=shape.heads * shape.qlen
            ),
            device=dev, min_chunk=256,
        )  # fmt: skip
        plan_split_kv(sched, prob.kv_indptr, shape.batch)
        variants: list[tuple[str, Any, Any]] = [
            (f"np auto k{auto.num_splits} t{auto.row_tile}", auto, None),
            ("pers", None, sched),
        ]
        extra = {1: (32, 64, 256), 16: (4, 8, 16), 64: (1, 4)}.get(shape.batch, (1,))
        variants += [(f"np k{k}", attrs.evolve(auto, num_splits=k), None) for k in extra]
        if shape.kv == "fp8":
            variants += [
                ("np stages 3", attrs.evolve(auto, num_stages=3), None),
                ("triton provider", None, "triton"),
            ]
            if shape.heads * shape.qlen <= 16:
                variants += [("rows np", attrs.evolve(auto, kernel=GluonKernel.ROWS), None)]
        if shape.heads * shape.qlen > 32 and shape.kv == "bf16":
            variants += [("64-row np", attrs.evolve(auto, kernel=GluonKernel.ROW64), None)]
            # 32-row tiles on the few-rows kernel: two row blocks per request read the same KV
            # (the second read from L2), so one split can fill the SMs without a reduce.
            t32 = attrs.evolve(auto, row_tile=32, kernel=GluonKernel.ROWS, num_stages=2)
            variants += [(f"t32 np k{k}", attrs.evolve(t32, num_splits=k), None) for k in (1, 2)]
            t64 = attrs.evolve(auto, row_tile=64, kernel=GluonKernel.ROWS, num_stages=2)
            variants += [("t64 np", t64, None)]
            variants += [(f"t64 np k{k}", attrs.evolve(t64, num_splits=k), None) for k in (1, 2, 4)]
        for name, cfg, sc in variants:

            def run(p: Problem = prob, cfg: Any = cfg, sc: Any = sc) -> None:
                if sc == "triton":
                    TritonProvider().paged_mqa_decode(p.paged_call())
                else:
                    gd.paged_decode(p.paged_call(schedule=sc), config=cfg)

            try:
                eo, _ = prob.check(run)
                us = bench_graph_us(run) if eo <= 1e-2 else math.nan
                kernels = kernel_times(run)
            except Exception as exc:
                eo, us, kernels = math.inf, math.nan, {}
                print("breakdown error", name, type(exc).__name__, str(exc)[-300:], flush=True)
            bw, fl = prob.metrics(us)
            parts = " ".join(f"{k}={v:.1f}" for k, v in sorted(kernels.items(), key=lambda kv: -kv[1]))
            rows.append(
                {"shape": label(shape), "variant": name, "o_err": eo, "us": us, "TB/s": bw,
                 "TFLOP/s": fl, "kernels us": parts}
            )  # fmt: skip
            print(rows[-1], flush=True)
        del prob
        torch.cuda.empty_cache()


def run_once(kv: str) -> None:
    """H16 q1 B128 S8192 on the provider's own launch, twice (the first compiles): a target for
    a profiler, e.g. ``ncu --kernel-name regex:mla_decode --launch-skip 1 --launch-count 1``."""
    from benchmarks.decode import Shape

    prob = Problem(Shape("fp8" if kv == "fp8" else "mem", 16, 1, 128, 8192, kv=kv), torch.device("cuda"))
    for _ in range(2):
        gd.paged_decode(prob.paged_call())
    torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="checks, then the launch-config sweep only")
    ap.add_argument("--breakdown", action="store_true", help="only the per-kernel time breakdown")
    ap.add_argument("--only", nargs="*", default=[], help="breakdown: only these shape names (mem, fp8, ...)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--once", choices=["bf16", "fp8"], help="one shape, launched twice, for a profiler")
    args = ap.parse_args()
    if args.once:
        run_once(args.once)
        return
    if args.breakdown:
        rows: list[dict[str, Any]] = []
        breakdown(rows, args.only)
        print_table(rows, title="per-kernel breakdown (graph replay)")
        return
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    log: list[dict[str, Any]] = []
    ok = checks(log)
    sweep_rows: list[dict[str, Any]] = []
    if args.sweep:
        sweep(sweep_rows)
    with open(os.path.join(args.out, "gluon_dev.json"), "w") as f:
        json.dump({"checks": log, "sweep": sweep_rows}, f, indent=1, default=str)
    fails = [r for r in log if not r["ok"]]
    if fails:
        print_table(
            [{"case": r["case"], "o_err": r["o_err"], "lse_err": r["lse_err"]} for r in fails[:40]],
            title="FAILED checks",
        )
    if sweep_rows:
        print_table(sweep_rows, title="config sweep (graph replay)")
    print("ALL CHECKS OK" if ok else f"{len(fails)} CHECKS FAILED")


if __name__ == "__main__":
    main()
