"""Decode context parallelism on two GPUs: one long request, 1 GPU vs 2 GPUs over NCCL.

    python -m benchmarks dcp                       # S = 128k and 512k tokens, H16, bf16 cache
    python -m benchmarks dcp --seqs 131072 --kv fp8 --block 1
    python -m benchmarks dcp --cpu --seqs 4096      # smoke run: gloo on the CPU, eager times only

Two spawned ranks (GPUs 0 and 1) each build the same request (same seed): the whole latent cache
for the single-GPU run and this rank's token shard of it for decode context parallelism. Rank 0
times the single-GPU decode (``MLABackend``, 16 heads over all S tokens) while rank 1 waits;
then both time ``DecodeContextParallel.forward_decode`` in two modes:

* ``replicated``: both GPUs serve the same 16 heads, each over its S/2 tokens; outputs are
  all-reduced. The 1-GPU row is the same model on one GPU.
* ``split``: the GPUs are tensor-parallel ranks with 16 heads each (32 in all); q is all-gathered
  over heads, each GPU decodes 32 heads over its S/2 tokens, outputs are reduce-scattered. The
  1-GPU row is what each TP rank does without DCP (16 heads over all S tokens).

Every DCP result is first checked against the single-GPU decode on the same data (relative
Frobenius error of each rank's head slice). Times are CUDA-graph replays of one whole call
(collectives included; medians over rounds), and the plain eager call for comparison.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import mla
from benchmarks._common import bench_graph_us, gpu_name, print_table, rel_error
from mla.distributed import DecodeContextParallel

FP8_SCALE = 0.05


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def eager_us(fn: Any, device: torch.device, *, collective: bool, iters: int = 50, rounds: int = 5) -> float:
    """Median over rounds of ``iters`` back-to-back eager calls, per call, in microseconds."""
    times = []
    for _ in range(rounds):
        if collective:
            dist.barrier()
        _sync(device)
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e6 / iters)
    return sorted(times)[len(times) // 2]


def graph_us(fn: Any, device: torch.device, *, collective: bool) -> float:
    """CUDA-graph replay time of one call (``nan`` on the CPU)."""
    if device.type != "cuda":
        return float("nan")
    if collective:
        dist.barrier()
    torch.cuda.synchronize(device)
    return bench_graph_us(fn, replays=20, rounds=5)


def run_rank(rank: int, args: argparse.Namespace, init_file: str, results: Any) -> None:
    if args.cpu:
        torch.set_num_threads(1)
        device, backend = torch.device("cpu"), "gloo"
    else:
        torch.cuda.set_device(rank)
        device, backend = torch.device("cuda", rank), "nccl"
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        for seq in args.seqs:
            results.put(("rows", rank, bench_sequence(rank, seq, args, device)))
    except BaseException as exc:  # report and re-raise so the parent sees which rank failed
        results.put(("error", rank, repr(exc)))
        raise
    finally:
        dist.destroy_process_group()


def bench_sequence(
    rank: int, seq: int, args: argparse.Namespace, device: torch.device
) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    heads, bs = args.heads, args.block
    kv = mla.core.config.normalize_dtype(args.kv)
    limits = mla.EngineLimits(max_num_seqs=1, max_model_len=seq, max_num_batched_tokens=64)
    dims = mla.MLADims(num_heads=heads, softmax_scale=192**-0.5)
    blocks = -(-seq // bs)
    platform = mla.detect_platform(device)
    if mla.core.config.is_fp8(kv):
        kv = mla.providers.resolve_provider("auto", platform).capabilities(platform).fp8_dtype
    single = mla.MLABackend(dims, mla.KVCacheSpec(bs, kv, num_blocks=blocks), limits, device=device)
    scale = FP8_SCALE if mla.core.config.is_fp8(kv) else None
    rows = torch.randn(seq, dims.latent_dim, device=device, dtype=torch.bfloat16)
    cache = torch.empty(blocks, bs, dims.latent_dim, device=device, dtype=kv)
    table = torch.randperm(blocks, device=device).to(torch.int32)[None]
    slots = (
        table[0, torch.arange(seq, device=device) // bs].long() * bs + torch.arange(seq, device=device) % bs
    )
    single.impl.write_kv(rows[:, :512], rows[:, 512:], cache, slots, kv_scale=scale)
    qsl = torch.tensor([0, 1], dtype=torch.int32)
    seq_t = torch.tensor([seq], dtype=torch.int32)
    q = torch.randn(1, 2 * heads, dims.latent_dim, device=device, dtype=torch.bfloat16)
    out_rows: list[dict[str, Any]] = []
    tag = f"S={seq // 1024}k" if seq % 1024 == 0 else f"S={seq}"

    def step(block_table: torch.Tensor) -> mla.StepInputs:
        return mla.StepInputs(qsl, qsl.to(device), seq_t.to(device), block_table, 1, 1, seq_t)

    meta = single.builder.build(step(table))
    ref = torch.empty(1, heads, 512, device=device, dtype=torch.bfloat16)
    ref_split = torch.empty(1, 2 * heads, 512, device=device, dtype=torch.bfloat16)
    single_32 = mla.MLABackend(
        mla.MLADims(num_heads=2 * heads, softmax_scale=192**-0.5),
        mla.KVCacheSpec(bs, kv, num_blocks=blocks),
        limits,
        device=device,
    )
    single.impl.forward_decode(meta, q[:, :heads].contiguous(), cache, out=ref, kv_scale=scale)
    single_32.impl.forward_decode(
        single_32.builder.build(step(table)), q, cache, out=ref_split, kv_scale=scale
    )
    if rank == 0:
        q16 = q[:, :heads].contiguous()
        out = torch.empty_like(ref)

        def one_gpu() -> None:
            single.impl.forward_decode(meta, q16, cache, out=out, kv_scale=scale)

        out_rows.append(
            {
                "S": tag,
                "mode": "1 GPU",
                "GPUs": 1,
                "heads/GPU": heads,
                "graph us": graph_us(one_gpu, device, collective=False),
                "eager us": eager_us(one_gpu, device, collective=False),
                "rel err": 0.0,
            }
        )
    dist.barrier()
    for mode in args.modes:
        split = mode == "split"
        dcp = DecodeContextParallel(
            dims,
            mla.KVCacheSpec(bs, kv),
            limits,
            interleave=args.interleave,
            split_heads=split,
            device=device,
        )
        layout = dcp.layout
        positions = torch.arange(seq, device=device)
        mine = positions[layout.owner(positions) == rank]
        local_len = int(layout.local_length(torch.tensor(seq)))
        local_blocks = -(-max(local_len, 1) // bs)
        local_cache = torch.empty(local_blocks, bs, dims.latent_dim, device=device, dtype=kv)
        local_table = torch.randperm(local_blocks, device=device).to(torch.int32)[None]
        local = layout.local_position(mine)
        local_slots = local_table[0, local // bs].long() * bs + local % bs
        dcp.decode_backend.impl.write_kv(
            rows[mine, :512], rows[mine, 512:], local_cache, local_slots, kv_scale=scale
        )
        width = -(-layout.max_local_length(seq) // bs)
        padded = torch.zeros(1, width, dtype=torch.int32, device=device)
        padded[:, : local_table.shape[1]] = local_table
        dcp_meta = dcp.build(step(padded))
        q_rank = q[:, rank * heads : (rank + 1) * heads].contiguous() if split else q[:, :heads].contiguous()
        out = torch.empty(1, heads, 512, device=device, dtype=torch.bfloat16)

        sharded = functools.partial(
            dcp.forward_decode, dcp_meta, q_rank, local_cache, out=out, kv_scale=scale
        )
        sharded()
        want = ref_split[:, rank * heads : (rank + 1) * heads] if split else ref
        error = rel_error(out, want)
        graph = graph_us(sharded, device, collective=True)
        eager = eager_us(sharded, device, collective=True)
        if rank == 0:
            out_rows.append(
                {
                    "S": tag,
                    "mode": f"DCP2 {mode}",
                    "GPUs": 2,
                    "heads/GPU": 2 * heads if split else heads,
                    "graph us": graph,
                    "eager us": eager,
                    "rel err": error,
                }
            )
        elif error > 2e-2:
            raise AssertionError(f"rank 1 {mode} S={seq}: rel err {error:.3e}")
    key = "eager us" if device.type != "cuda" else "graph us"
    for row in out_rows:
        row["speedup"] = out_rows[0][key] / row[key]
    return out_rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks dcp",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--seqs", type=int, nargs="+", default=[128 * 1024, 512 * 1024])
    parser.add_argument("--heads", type=int, default=16, help="heads per GPU")
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--kv", choices=("bf16", "fp8"), default="bf16")
    parser.add_argument("--interleave", type=int, default=1)
    parser.add_argument(
        "--modes", nargs="+", choices=("replicated", "split"), default=["replicated", "split"]
    )
    parser.add_argument("--cpu", action="store_true", help="smoke run on the CPU (gloo, torch provider)")
    args = parser.parse_args(argv)
    if not args.cpu and torch.cuda.device_count() < 2:
        print("python -m benchmarks dcp needs two GPUs (or --cpu for a smoke run)", file=sys.stderr)
        return 2
    name = "cpu" if args.cpu else f"{gpu_name()} x2"
    print(
        f"{name}, torch {torch.__version__}, kv {args.kv}, block {args.block}, interleave {args.interleave}"
    )
    context = mp.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        ranks = [
            context.Process(target=run_rank, args=(rank, args, os.path.join(tmp, "init"), results))
            for rank in range(2)
        ]
        for process in ranks:
            process.start()
        table: list[dict[str, Any]] = []
        pending = 2 * len(args.seqs)
        while pending:
            kind, rank, payload = results.get()
            if kind == "error":
                print(f"rank {rank} failed: {payload}", file=sys.stderr)
                for process in ranks:
                    process.kill()
                return 1
            pending -= 1
            table.extend(payload)
        for process in ranks:
            process.join()
    for row in table:
        row["rel err"] = f"{row['rel err']:.1e}"
    basis = "eager" if args.cpu else "graph"
    print_table(table, title=f"one request, decode qlen 1 (speedup: 1-GPU {basis} time / this row's)")
    return 0
