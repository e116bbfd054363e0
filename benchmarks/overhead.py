"""Host overhead of the front door and of the engine path.

    python -m benchmarks overhead                     # H200: B 1/64/128 x block 1/64, H16, S4096
    python -m benchmarks overhead --device cpu        # smoke run on a CPU (tiny shapes, torch)

Per shape it prints:

* ``kernel``: one decode step's kernels alone (its build's and its decode's): the graph the
  ``out=`` call captured, replayed back to back between two CUDA events (CPU: the plan's run,
  wall clock).
* ``call``: ``mla.mla_decode`` per call after the first one (which plans), as a loop of calls
  ending in one synchronize, so host work overlaps the kernels as in a real loop.
* ``overhead = call - kernel`` (the issue's bound for the ``out=`` replay: 10 us on the H200).
* ``sync call``: the same with a synchronize after every call (host work no longer hidden).
* ``plain call`` / ``plain overhead``: the README's call, ``mla.mla_decode(q, kv_cache,
  block_table, seq_lens, softmax_scale=...)`` with no ``out=`` (a fresh output and LSE every
  call, ``return_lse`` at its default; it replays too, into the graph's own outputs, and
  returns copies), the same loop (the issue's bound: 30 us over the kernels).
* ``build``: ``backend.builder.build(step)`` host time with the engine's host copies passed
  (the issue's bound at B=128: 60 us; the last line says how many of the Triton fill's launches
  took :mod:`mla.providers.triton.launch_cache`'s cached path), and ``d2h``: device-to-host
  copies it made (counted with ``torch.cuda.set_sync_debug_mode("warn")``'s warnings; 0
  expected).
* ``ops``: aten ops dispatched by one build / one repeated call (a ``TorchDispatchMode``; a
  CUDA-graph replay dispatches none), and ``launches`` (GPU only): host-side launch calls
  recorded by the torch profiler (``cudaLaunchKernel``, ``cuLaunchKernel*``,
  ``cudaGraphLaunch``, ``cudaMemcpyAsync``, ``cudaMemsetAsync``) / kernels that ran on the device.
  These counts are taken after every time in the tables (the profiler can leave CUPTI attached,
  slowing the CUDA API calls of whatever runs after it).

Then the prefill doors on one batch (16 x 1024 tokens, 16 heads, 192/128 causal on the GPU):
``mla.mla_prefill`` as the README calls it and the engine's ``impl.forward_prefill`` on a step
built once, each a loop of calls against the provider's varlen kernel alone (graph replay):
``plain overhead`` and ``forward_prefill overhead`` (the issue's bound for both: 30 us).

``mla_decode`` is called with ``out=`` and ``return_lse=False`` on the same tensors every call,
so from the third call on it replays the CUDA graph it captured on the second
(:mod:`mla.engine.functional.decode_graphs`); ``--no-graph`` measures the eager path instead.
The calls run with ``validate="checked"`` (their default: the fill's counts copied to the host
in the graph, read after each launch); ``--validate fast`` measures them without the read back.
"""

from __future__ import annotations

import argparse
import statistics
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import mla
from benchmarks._common import bench_graph_us, gpu_name, print_profile, print_table, wall_us
from mla.engine.functional.decode_graphs import CapturedCall
from mla.testing import PrefillCase, make_prefill_inputs, prefill_case_backend


def _count_syncs(fn: Callable[[], Any]) -> int | str:
    """Synchronizing calls (device-to-host copies, .item(), blocking copies) made by ``fn``: the
    warnings of torch's sync debug mode. The mode is switched on outside the recording, because
    the first switch of a process warns once itself ("Synchronization debug mode is a prototype
    feature ...", which an earlier version of this count took for a copy of the first shape)."""
    if not torch.cuda.is_available():
        return "n/a"
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("called a synchronizing CUDA operation" in str(w.message) for w in caught)


class _OpCount(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += 1
        return func(*args, **(kwargs or {}))


def _count_ops(fn: Callable[[], Any]) -> int:
    """Aten ops one call of ``fn`` dispatches (after a warm-up call)."""
    fn()
    with _OpCount() as counter:
        fn()
    return counter.count


_LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaGraphLaunch", "cudaMemcpyAsync", "cudaMemsetAsync")


def _count_launches(fn: Callable[[], Any]) -> str:
    """``host launch calls / device kernels`` of one call of ``fn`` (GPU only)."""
    if not torch.cuda.is_available():
        return "n/a"
    fn()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        fn()
        torch.cuda.synchronize()
    events = prof.events()
    host = sum(1 for e in events if e.name.startswith(_LAUNCHES))
    device = sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    return f"{host}/{device}"


def replay_us(graph: torch.cuda.CUDAGraph, *, replays: int = 200, rounds: int = 7) -> float:
    """Device time of one replay of ``graph`` (µs): replays back to back between two events
    (a replay's launch costs less host time than its kernels take, so the device stays busy),
    median of rounds."""
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / replays)
    return statistics.median(times)


def run_shape(
    *,
    batch: int,
    block: int,
    heads: int,
    seq_len: int,
    rank: int,
    rope: int,
    device: str,
    provider: str,
    graph: str,
    validate: str = "checked",
    profile_build: bool = False,
) -> tuple[dict[str, Any], Callable[[], None]]:
    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    gpu = dev.type == "cuda"
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    blocks_per_seq = -(-seq_len // block)
    num_blocks = batch * blocks_per_seq
    gen = torch.Generator().manual_seed(batch * 100 + block)
    q = torch.randn(batch, heads, rank + rope, generator=gen).to(dtype).to(dev)
    cache = torch.randn(num_blocks, block, rank + rope, generator=gen).to(dtype).to(dev)
    table = torch.randperm(num_blocks, generator=gen).view(batch, blocks_per_seq).to(torch.int32).to(dev)
    lens_cpu = torch.full((batch,), seq_len, dtype=torch.int32)
    seq_lens = lens_cpu.to(dev)
    scale = (rank + rope) ** -0.5
    args: dict[str, Any] = {
        "softmax_scale": scale,
        "kv_lora_rank": rank,
        "provider": provider,
        "graph": graph,
        "validate": validate,
    }
    out = torch.empty(batch, heads, rank, dtype=dtype, device=dev)

    def call() -> None:
        mla.mla_decode(q, cache, table, seq_lens, out=out, return_lse=False, **args)

    def plain_call() -> None:
        mla.mla_decode(q, cache, table, seq_lens, **args)

    calls, rounds = (200, 7) if gpu else (5, 3)
    call_us = wall_us(call, calls=calls, rounds=rounds, sync=sync)
    plain_call()  # (plans its own step: the README call wants the LSE too)
    plain_us = wall_us(plain_call, calls=calls, rounds=rounds, sync=sync)
    sync_call_us = wall_us(lambda: (call(), sync()), calls=calls, rounds=rounds, sync=sync)
    # The kernels alone. GPU: the step the `out=` call captured (its build's kernels and the
    # decode's), replayed back to back; CPU: the cached plan's run.
    cached = mla.engine.functional.plan_cache.DECODE_PLANS._entries.values()
    plans = [e for e in cached if e.backend.device.type == dev.type]
    if gpu:
        captured = [s for s in plans[-1].graphs._entries.values() if isinstance(s, CapturedCall)]
        kernel_us = replay_us(captured[0].graph)
    else:
        strategy, plan = plans[-1].backend.current_decode()

        def kernels() -> None:
            strategy.run(plan, q, cache, kv_scale=None, out=out, lse=None)

        kernel_us = wall_us(kernels, calls=calls, rounds=rounds, sync=sync)

    engine = mla.MLABackend(
        mla.MLADims(heads, rank, rope, softmax_scale=scale),
        mla.KVCacheSpec(block, dtype, num_blocks=num_blocks),
        mla.EngineLimits(batch, blocks_per_seq * block, batch),
        model_dtype=dtype,
        provider=provider,
        device=dev,
    )
    qsl_cpu = torch.arange(batch + 1, dtype=torch.int32)
    step = mla.StepInputs(
        query_start_loc_cpu=qsl_cpu,
        query_start_loc=qsl_cpu.to(dev),
        seq_lens=seq_lens,
        seq_lens_cpu=lens_cpu,
        block_table=table,
        num_decodes=batch,
        num_decode_tokens=batch,
    )

    def build() -> None:
        engine.builder.build(step)

    build_us = wall_us(build, calls=calls, rounds=rounds, sync=sync)
    if profile_build:
        print_profile(build, f"builder.build, B{batch} block {block}", calls=500, sync=sync)
    row: dict[str, Any] = {
        "B": batch,
        "block": block,
        "H": heads,
        "S": seq_len,
        "kernel us": round(kernel_us, 1),
        "call us": round(call_us, 1),
        "overhead us": round(call_us - kernel_us, 1),
        "plain call us": round(plain_us, 1),
        "plain overhead us": round(plain_us - kernel_us, 1),
        "sync call us": round(sync_call_us, 1),
        "build us": round(build_us, 1),
    }

    def counts() -> None:
        """The count columns (run after every shape's timings: see :func:`main`)."""
        row["build d2h"] = _count_syncs(build)
        row["call d2h"] = _count_syncs(call)
        row["build ops"] = _count_ops(build)
        row["build launches"] = _count_launches(build)
        row["call ops"] = _count_ops(call)
        row["call launches"] = _count_launches(call)

    return row, counts


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks overhead",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--provider", default="auto")
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--no-graph", action="store_true", help="mla_decode(graph='off'): the eager path")
    parser.add_argument(
        "--validate", choices=("checked", "fast", "full"), default="checked", help="mla_decode(validate=...)"
    )
    parser.add_argument(
        "--profile-build", action="store_true", help="print a cProfile of builder.build per shape"
    )
    args = parser.parse_args(argv)
    gpu = args.device.startswith("cuda")
    if gpu:
        shapes = [(b, blk) for b in (1, 64, 128) for blk in (1, 64)]
        dims = {"heads": 16, "rank": 512, "rope": 64, "seq_len": args.seq_len or 4096}
        title = f"mla_decode / builder.build host overhead on {gpu_name()}"
    else:
        shapes = [(b, blk) for b in (1, 4) for blk in (1, 16)]
        dims = {"heads": 4, "rank": 64, "rope": 16, "seq_len": args.seq_len or 64}
        title = "mla_decode / builder.build host overhead (CPU smoke run, tiny shapes)"
    timed = [
        run_shape(
            batch=b,
            block=blk,
            device=args.device,
            provider=args.provider,
            graph="off" if args.no_graph else "auto",
            validate=args.validate,
            profile_build=args.profile_build,
            **dims,
        )
        for b, blk in shapes
    ]
    prefill = prefill_row(device=args.device, provider=args.provider, gpu=gpu)
    # The counts run after every timing: the torch profiler of the launch counts can leave CUPTI
    # attached to the process (Kineto's teardown is off by default with CUDA graphs; pytorch
    # issue 144455), which slows every later CUDA API call. Timed after the first shape's
    # counts, the host-bound B1 block 64 shape measured that as overhead (B1 block 1, timed
    # first, did not).
    for _row, counts in timed:
        counts()
    print_table([row for row, _counts in timed], title=title)
    print_table(
        [prefill],
        title="prefill host overhead: mla_prefill (the README-style call: fresh outputs, LSE returned) "
        "and the engine's impl.forward_prefill (metadata built once)",
    )
    print_launch_cache()


def prefill_row(*, device: str, provider: str, gpu: bool) -> dict[str, Any]:
    """``mla.mla_prefill`` as the README calls it (no ``out=``) against the provider's varlen
    kernel on the same tensors: 16 x 1024 tokens, 16 heads, 192/128 causal on the GPU; a tiny
    float32 case on the CPU."""
    dev = torch.device(device)
    dtype, (batch, seq, heads) = (torch.bfloat16, (16, 1024, 16)) if gpu else (torch.float32, (2, 16, 2))
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    gen = torch.Generator().manual_seed(7)
    tokens = batch * seq
    q = torch.randn(tokens, heads, 192, generator=gen).to(dtype).to(dev)
    k = torch.randn(tokens, heads, 192, generator=gen).to(dtype).to(dev)
    v = torch.randn(tokens, heads, 128, generator=gen).to(dtype).to(dev)
    cu = (torch.arange(batch + 1) * seq).to(torch.int32).to(dev)
    scale = 192**-0.5

    def call() -> None:
        mla.mla_prefill(q, k, v, cu, cu, seq, seq, softmax_scale=scale, causal=True, provider=provider)

    call()
    kernel_provider = mla.providers.resolve_provider(provider, mla.core.platform.detect_platform(dev.type))
    out = torch.empty(tokens, heads, 128, dtype=dtype, device=dev)
    lse = torch.empty(tokens, heads, dtype=torch.float32, device=dev)
    varlen = mla.providers.calls.VarlenPrefillCall(
        q=q, k=k, v=v, cu_seqlens_q=cu, cu_seqlens_k=cu, out=out, lse=lse, max_seqlen_q=seq,
        max_seqlen_k=seq, softmax_scale=scale, causal=True,
    )  # fmt: skip
    calls, rounds = (50, 5) if gpu else (5, 3)
    kernel_us = (
        bench_graph_us(lambda: kernel_provider.varlen_attention(varlen))
        if gpu
        else wall_us(lambda: kernel_provider.varlen_attention(varlen), calls=calls, rounds=rounds, sync=sync)
    )
    call_us = wall_us(call, calls=calls, rounds=rounds, sync=sync)
    forward_us = wall_us(
        _engine_prefill(batch, seq, heads, dtype, dev, provider), calls=calls, rounds=rounds, sync=sync
    )
    return {
        "B x S": f"{batch} x {seq}",
        "H": heads,
        "kernel us": round(kernel_us, 1),
        "plain call us": round(call_us, 1),
        "plain overhead us": round(call_us - kernel_us, 1),
        "forward_prefill us": round(forward_us, 1),
        "forward_prefill overhead us": round(forward_us - kernel_us, 1),
    }


def _engine_prefill(
    batch: int, seq: int, heads: int, dtype: torch.dtype, device: torch.device, provider: str
) -> Callable[[], None]:
    """The engine path on the same batch shape: ``impl.forward_prefill`` of a step built once
    (an engine builds each step's metadata once, before the model's layers run)."""
    case = PrefillCase(heads=heads, q_lens=(seq,) * batch, dtype=dtype, softmax_scale=192**-0.5)
    inputs = make_prefill_inputs(case, device)
    backend = prefill_case_backend(
        case, provider=provider, platform=mla.detect_platform(device.type), device=device
    )
    metadata = backend.builder.build(inputs.step())
    out, lse = inputs.poisoned_outputs()

    def forward() -> None:
        backend.impl.forward_prefill(metadata, inputs.q, inputs.k, inputs.v, out=out, lse=lse)

    forward()
    return forward


def print_launch_cache() -> None:
    """How the Triton fill and planner launches went (cached or through ``kernel[grid]``)."""
    try:
        from mla.providers.triton import schedule, utils
    except ImportError:
        return
    fill, plan = utils.FILL_LAUNCH, schedule.PLAN_LAUNCH
    print(
        f"launch cache (MLA_TRITON_LAUNCH_CACHE=0 turns it off): active={fill.active}; fill "
        f"{fill.fast_launches} cached / {fill.slow_launches} through Triton; planner "
        f"{plan.fast_launches} / {plan.slow_launches}"
    )
