"""MLA decode benchmark: the Gluon and Triton providers and vLLM's Triton MLA decode side by side.

    python -m benchmarks decode --vllm-decode PATH --plot docs/img/decode-h200.png --json OUT.json
    python -m benchmarks decode --quick    # a smoke run: two small shapes
    python -m benchmarks decode --sweep    # also time alternative Triton launch configs
    python -m benchmarks decode --only long verify --no-torch   # some cases of the matrix

Every implementation is first checked against the torch reference provider on a slice of its
requests (relative Frobenius error of o, max |Δlse|), then timed as CUDA-graph replays of one
decode call on the same inputs (median of rounds; a persistent schedule is planned once outside
the graph, as an engine plans once per step for all layers). ``do_bench`` (median, L2 flushed) is
printed beside it. Rows: ``<provider> np|pers|small`` are the provider's ``paged_mqa_decode``
(non-persistent / planned schedule) and ``small_head_decode``; ``gluon-kernel`` is the Gluon
kernel called directly where the provider routes the case to the Triton kernel (fp8);
``gluon-64row`` is the provider's launch with the 64-row kernel in place of the ping-pong
kernel it picks for 64-row tiles of 16-bit caches (``kernel=GluonKernel.ROW64``);
``gluon-rows`` is the provider's launch with the few-rows kernel in place of the dual-chain
kernel it picks for 16-row tiles of fp8 caches (``kernel=GluonKernel.ROWS``); ``vllm`` is
vLLM's ``decode_attention_fwd`` (qlen 1, 16-bit caches; skipped with a note without
``--vllm-decode``). Metrics follow FlashMLA: bytes = KV read once + q read + o written; FLOPs =
2·s_q·Σs_k·h·(576+512). ``copy%`` is the bandwidth over the measured 4.25 TB/s device copy.
``MHz``, ``W`` and ``capped`` are the GPU's state while the row was timed (``sample_gpu_state``:
the mean SM clock and board power, and the fraction 0.0 to 1.0 of the samples with the software
power-cap throttle bit set; NaN where nothing could be sampled). The H200 is capped at 700 W; a
case that draws near the cap runs at a lower SM clock (1650 to 1770 MHz against 1980), so the same
kernel can time some 10% slower in a long run than from a cool start: compare rows with their
clocks in view (``benchmarks/power.py`` times cases after idle and sustained).
``--plot`` draws achieved TB/s per case and implementation against that ceiling (matplotlib).
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch
import triton

from benchmarks import _vllm
from benchmarks._common import (
    H200_COPY_TBPS,
    GpuState,
    bench_graph_us,
    bench_us,
    decode_bytes,
    decode_flops,
    gpu_name,
    gpu_state_columns,
    nvml_index,
    print_table,
    rel_error,
    sample_gpu_state,
    tbps,
    tflops,
)
from mla.core.platform import detect_platform
from mla.providers import get_provider
from mla.providers.base import KernelProvider
from mla.providers.calls import (
    DecodeScheduleBuffersCall,
    ExpandPagesCall,
    PagedDecodeCall,
    PlanDecodeScheduleCall,
    SmallHeadDecodeCall,
)
from mla.providers.gluon.planner import GluonKernel
from mla.providers.split_kv import SplitKVSchedule
from mla.providers.torch_ref import TorchProvider
from mla.providers.triton import TritonProvider
from mla.providers.triton.decode import num_sms, paged_decode
from mla.providers.triton.schedule import DecodeLaunchConfig, allocate_schedule, plan_split_kv
from mla.providers.triton.small_head import small_head_decode

RANK, ROPE = 512, 64
SCALE = 1.0 / math.sqrt(192)
FP8_SCALE = 0.05


@attrs.frozen
class Shape:
    name: str
    heads: int
    qlen: int
    batch: int
    seq: int
    block: int = 64
    kv: str = "bf16"
    target: str = ""


MATRIX = [
    Shape("mem", 16, 1, 64, 4096, target="tbps>=3.6"),
    Shape("mem", 16, 1, 64, 8192, target="tbps>=3.6"),
    Shape("mem", 16, 1, 128, 4096, target="tbps>=3.6"),
    Shape("mem", 16, 1, 128, 8192, target="tbps>=3.6"),
    Shape("long", 16, 1, 1, 65536, target="tbps>=3.0"),
    Shape("page1", 16, 1, 16, 4096, block=1, target="tbps>=2.5"),
    Shape("fp8", 16, 1, 128, 8192, kv="fp8", target="speedup>=1.7 vs mem B128 S8192"),
    Shape("verify", 16, 2, 64, 4096, target="time<=1.15x q1 B64 S4096"),
    Shape("verify", 16, 4, 64, 4096, target="time<=1.15x q1 B64 S4096"),
    Shape("compute", 128, 1, 64, 4096, target="tflops>=450"),
    Shape("heads", 8, 1, 128, 4096, target="time<=1.0x H16 B128 S4096"),
    Shape("heads", 12, 1, 128, 4096, target="time<=1.0x H16 B128 S4096"),
]
PROVIDERS = ("gluon", "triton")
QUICK = [Shape("mem", 16, 1, 32, 2048), Shape("verify", 16, 2, 8, 1024, block=1)]


class Problem:
    """Random inputs of one shape on the GPU (cache blocks randomly permuted)."""

    def __init__(self, shape: Shape, device: torch.device) -> None:
        self.shape = shape
        gen = torch.Generator(device=device).manual_seed(shape.heads * 1000 + shape.qlen)
        blocks_per_req = -(-shape.seq // shape.block)
        num_blocks = shape.batch * blocks_per_req + 1
        cache = torch.randn(num_blocks, shape.block, RANK + ROPE, device=device, generator=gen)
        if shape.kv == "fp8":
            self.kv_scale: torch.Tensor | None = torch.tensor([FP8_SCALE], device=device)
            self.cache = (cache / FP8_SCALE).clamp(-448, 448).to(torch.float8_e4m3fn)
        else:
            self.kv_scale = None
            self.cache = cache.to(torch.bfloat16)
        del cache
        perm = torch.randperm(num_blocks, device=device, generator=gen)[: shape.batch * blocks_per_req]
        self.block_table = perm.view(shape.batch, blocks_per_req).to(torch.int32)
        self.kv_indptr = (torch.arange(shape.batch + 1, device=device) * shape.seq).to(torch.int32)
        self.qo_indptr = (torch.arange(shape.batch + 1, device=device) * shape.qlen).to(torch.int32)
        total = shape.batch * shape.seq
        self.kv_indices = torch.empty(total, dtype=torch.int32, device=device)
        TritonProvider().expand_page_indices(
            ExpandPagesCall(
                block_table=self.block_table,
                kv_indptr=self.kv_indptr,
                out=self.kv_indices,
                block_size=shape.block,
                num_tokens=total,
            )
        )
        tokens = shape.batch * shape.qlen
        self.q = torch.randn(tokens, shape.heads, RANK + ROPE, device=device, generator=gen).to(
            torch.bfloat16
        )
        self.out = torch.empty(tokens, shape.heads, RANK, dtype=torch.bfloat16, device=device)
        self.lse = torch.empty(tokens, shape.heads, dtype=torch.float32, device=device)
        self.flat = self.cache.view(-1, RANK + ROPE)

    def schedule(self, *, units: int | None = None, min_chunk: int | None = None) -> SplitKVSchedule:
        s = self.shape
        sched = allocate_schedule(
            max_batch=s.batch,
            max_kernel_qlen=s.qlen,
            kernel_heads=s.heads,
            kv_lora_rank=RANK,
            num_sms=num_sms(self.q.device),
            device=self.q.device,
        )
        if units is not None:
            sched = SplitKVSchedule.allocate(
                max_batch=s.batch,
                max_kernel_qlen=s.qlen,
                kernel_heads=s.heads,
                kv_lora_rank=RANK,
                num_units=units,
                device=self.q.device,
                min_chunk=min_chunk or sched.min_chunk,
            )
        plan_split_kv(sched, self.kv_indptr, s.batch)
        return sched

    def paged_call(
        self,
        *,
        requests: int | None = None,
        schedule: SplitKVSchedule | None = None,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
        block_table: bool = False,
    ) -> PagedDecodeCall:
        """The paged decode of the first ``requests`` requests (default: all), over the flat
        per-token ids or (``block_table``) the block table itself."""
        s = self.shape
        k = s.batch if requests is None else requests
        return PagedDecodeCall(
            q=self.q[: k * s.qlen],
            kv_cache=self.flat,
            kv_indptr=self.kv_indptr[: k + 1],
            kv_indices=None if block_table else self.kv_indices,
            block_table=self.block_table[:k] if block_table else None,
            qo_indptr=self.qo_indptr[: k + 1],
            out=self.out if out is None else out,
            lse=self.lse if lse is None else lse,
            max_qlen=s.qlen,
            max_seqlen_k=s.seq,
            page_size=s.block,
            softmax_scale=SCALE,
            kv_scale=self.kv_scale,
            schedule=schedule,
        )

    def decode_fn(
        self,
        *,
        schedule: SplitKVSchedule | None,
        config: DecodeLaunchConfig | None = None,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
    ) -> Callable[[], None]:
        call = self.paged_call(schedule=schedule, out=out, lse=lse)

        def run() -> None:
            paged_decode(call, config=config)

        return run

    def provider_fn(
        self, provider: KernelProvider, *, persistent: bool, block_table: bool = False
    ) -> Callable[[], None]:
        """``provider.paged_mqa_decode`` on these inputs (with its own schedule, planned here;
        ``block_table``: the kernel reads the block table instead of flat ids)."""
        s = self.shape
        schedule = None
        if persistent:
            schedule = provider.decode_schedule_buffers(
                DecodeScheduleBuffersCall(
                    max_batch=s.batch,
                    max_kernel_qlen=s.qlen,
                    kernel_heads=s.heads,
                    kv_lora_rank=RANK,
                    q_dtype=self.q.dtype,
                    kv_dtype=self.cache.dtype,
                    platform=detect_platform("cuda"),
                    device=self.q.device,
                )
            )
            provider.plan_decode_schedule(
                PlanDecodeScheduleCall(
                    schedule=schedule,
                    qo_indptr=self.qo_indptr,
                    kv_indptr=self.kv_indptr,
                    batch_size=s.batch,
                    kernel_qlen=s.qlen,
                    uniform_qlen=True,
                )
            )
        call = self.paged_call(schedule=schedule, block_table=block_table)

        def run() -> None:
            provider.paged_mqa_decode(call)

        return run

    def provider_small_fn(self, provider: KernelProvider) -> Callable[[], None]:
        call = self.small_head_call()

        def run() -> None:
            provider.small_head_decode(call)

        return run

    def gluon_kernel_fn(self) -> Callable[[], None]:
        """The Gluon kernel itself, also where the provider routes the case elsewhere."""
        from mla.providers.gluon.decode import paged_decode as gluon_decode

        call = self.paged_call()

        def run() -> None:
            gluon_decode(call)

        return run

    def gluon_variant_fn(self, **overrides: object) -> Callable[[], None]:
        """The Gluon provider's own launch configuration with ``overrides`` applied: e.g.
        ``kernel=GluonKernel.ROW64`` (the 64-row kernel instead of the ping-pong kernel) or
        ``kernel=GluonKernel.ROWS`` (the few-rows kernel instead of the dual-chain kernel for 16
        rows of an fp8 cache)."""
        from mla.providers.gluon.decode import paged_decode as gluon_decode
        from mla.providers.gluon.planner import launch_config

        call = self.paged_call()
        config = launch_config(
            batch=call.qo_indptr.numel() - 1, rows=call.q.shape[1] * call.max_qlen,
            max_seqlen_k=call.max_seqlen_k, num_sms=num_sms(self.q.device), persistent=False,
            kv_fp8=self.shape.kv == "fp8",
        )  # fmt: skip
        config = attrs.evolve(config, **overrides)

        def run() -> None:
            gluon_decode(call, config=config)

        return run

    def vllm_fn(self, module: Any) -> Callable[[], None]:
        return _vllm.decode_fn(
            module,
            q=self.q,
            cache=self.cache,
            block_table=self.block_table,
            seq_lens=self.kv_indptr[1:] - self.kv_indptr[:-1],
            softmax_scale=SCALE,
            out=self.out,
        )

    def small_head_call(self) -> SmallHeadDecodeCall:
        return SmallHeadDecodeCall(
            q_nope=self.q[..., :RANK],
            q_pe=self.q[..., RANK:],
            kv_cache=self.flat,
            page_table=self.kv_indices,
            seq_info=self.kv_indptr,
            out=self.out,
            lse=self.lse,
            max_seqlen_k=self.shape.seq,
            page_size=self.shape.block,
            softmax_scale=SCALE,
            kv_scale=self.kv_scale,
        )

    def small_head_fn(self) -> Callable[[], None]:
        call = self.small_head_call()

        def run() -> None:
            small_head_decode(call)

        return run

    def check(self, run: Callable[[], None], *, requests: int = 4, lse: bool = True) -> tuple[float, float]:
        """(o relative error, max |Δlse|) of the first ``requests`` requests against torch
        (``lse=False``: the implementation writes no LSE here; its error reads 0)."""
        self.out.fill_(math.nan)
        self.lse.fill_(math.nan if lse else 0.0)
        run()
        s = self.shape
        k = min(requests, s.batch)
        rows = k * s.qlen
        ref_o = torch.empty(rows, s.heads, RANK, dtype=torch.float32, device=self.q.device)
        ref_l = torch.empty(rows, s.heads, dtype=torch.float32, device=self.q.device)
        TorchProvider().paged_mqa_decode(self.paged_call(requests=k, out=ref_o, lse=ref_l))
        if torch.isnan(self.out).any() or torch.isnan(self.lse).any():
            return math.inf, math.inf
        err_l = float((self.lse[:rows] - ref_l).abs().max()) if lse else 0.0
        return rel_error(self.out[:rows], ref_o), err_l

    def metrics(self, us: float) -> tuple[float, float]:
        s = self.shape
        total = s.batch * s.seq
        nbytes = decode_bytes(
            total_seqlens=total, b=s.batch, s_q=s.qlen, h_q=s.heads, kv_elem=self.cache.element_size()
        )
        return tbps(nbytes, us), tflops(decode_flops(total_seqlens=total, s_q=s.qlen, h_q=s.heads), us)


def time_fn(fn: Callable[[], None]) -> tuple[float, float]:
    """(graph-replay median µs, do_bench median µs)."""
    return bench_graph_us(fn), bench_us(fn, warmup_ms=10, rep_ms=50)


def label(s: Shape) -> str:
    return f"{s.name} H{s.heads} q{s.qlen} B{s.batch} S{s.seq} bs{s.block} {s.kv}"


def implementations(prob: Problem, vllm: Any) -> tuple[list[tuple[str, Callable[[], None], bool]], list[str]]:
    """(name, run, writes LSE) per implementation of ``prob``'s shape, and notes on skipped ones."""
    shape = prob.shape
    impls: list[tuple[str, Callable[[], None], bool]] = []
    notes: list[str] = []
    for name in PROVIDERS:
        provider = get_provider(name)
        support = provider.availability()
        if not support:
            notes.append(f"{label(shape)}: {name} skipped: {support}")
            continue
        impls.append((f"{name} np", prob.provider_fn(provider, persistent=False), True))
        impls.append((f"{name} pers", prob.provider_fn(provider, persistent=True), True))
        if provider.capabilities(detect_platform("cuda")).decode_reads_block_table:
            # What the engine runs on this provider: the kernel reads the block table.
            impls.append(
                (f"{name} table np", prob.provider_fn(provider, persistent=False, block_table=True), True)
            )
        if shape.name == "heads":
            impls.append((f"{name} small", prob.provider_small_fn(provider), True))
        if name == "gluon" and shape.kv == "fp8":
            impls.append(("gluon-kernel np", prob.gluon_kernel_fn(), True))
        if name == "gluon" and shape.kv == "bf16" and shape.heads * shape.qlen > 32:
            impls.append(("gluon-64row np", prob.gluon_variant_fn(kernel=GluonKernel.ROW64), True))
        if name == "gluon" and shape.kv == "fp8" and shape.heads * shape.qlen <= 16:
            impls.append(("gluon-rows np", prob.gluon_variant_fn(kernel=GluonKernel.ROWS), True))
    if vllm is None:
        notes.append(f"{label(shape)}: vllm skipped (no --vllm-decode file)")
    elif shape.qlen != 1 or shape.kv != "bf16":
        notes.append(f"{label(shape)}: vllm skipped (its MLA decode takes qlen 1 and 16-bit caches)")
    else:
        impls.append(("vllm", prob.vllm_fn(vllm), False))
    return impls, notes


def check_before_timing(prob: Problem, fn: Callable[[], None], name: str, *, lse: bool = True) -> str:
    """``"ok"`` when ``fn`` matches the torch reference on ``prob`` (relative o error and max
    |Δlse| both ≤ 1e-2), else a ``FAIL`` note with the errors; an implementation that raises on
    the shape is reported under ``name`` and fails, so one broken row does not end the run."""
    try:
        err_o, err_l = prob.check(fn, lse=lse)
    except Exception as exc:
        err_o, err_l = math.inf, math.inf
        print(f"{name}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    return "ok" if err_o <= 1e-2 and err_l <= 1e-2 else f"FAIL o={err_o:.2g} lse={err_l:.2g}"


def select_cases(shapes: list[Shape], only: list[str] | None, parser: argparse.ArgumentParser) -> list[Shape]:
    """The shapes whose case name (``mem``, ``long``, ``fp8``, ...) is in ``only`` (all without
    it); an unknown name is a usage error that lists the cases."""
    if not only:
        return shapes
    names = {s.name for s in shapes}
    if unknown := set(only) - names:
        parser.error(f"--only: no case named {sorted(unknown)} (cases: {sorted(names)})")
    return [s for s in shapes if s.name in only]


def run_matrix(
    shapes: list[Shape], *, with_torch: bool, vllm: Any = None
) -> tuple[list[dict[str, Any]], list[str]]:
    device = torch.device("cuda")
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    for shape in shapes:
        prob = Problem(shape, device)
        impls, skipped = implementations(prob, vllm)
        notes.extend(skipped)
        torch_us = math.nan
        if with_torch:
            ref_out = torch.empty_like(prob.out)
            ref_lse = torch.empty_like(prob.lse)

            def torch_run(p: Problem = prob, o: torch.Tensor = ref_out, lse: torch.Tensor = ref_lse) -> None:
                TorchProvider().paged_mqa_decode(p.paged_call(out=o, lse=lse))

            torch_us = bench_us(torch_run, warmup_ms=1, rep_ms=20)
        for impl, fn, writes_lse in impls:
            check = check_before_timing(prob, fn, f"{label(shape)} {impl}", lse=writes_lse)
            graph_us, bench = math.nan, math.nan
            state: GpuState | None = None
            if check == "ok":
                with sample_gpu_state(nvml_index(), period_s=0.01) as gpu:  # a timing takes ~0.1 s
                    graph_us, bench = time_fn(fn)
                state = gpu.summary()
            bw, fl = prob.metrics(graph_us)
            rows.append(
                {
                    "shape": label(shape),
                    "impl": impl,
                    "check": check,
                    "us": graph_us,
                    "us_dobench": bench,
                    "TB/s": bw,
                    "copy%": 100 * bw / H200_COPY_TBPS,
                    "TFLOP/s": fl,
                    **gpu_state_columns(state),
                    "x_torch": torch_us / graph_us,
                    "target": shape.target,
                }
            )
            print(rows[-1], flush=True)
        del prob, impls
        torch.cuda.empty_cache()
    annotate_targets(rows)
    return rows, notes


def annotate_targets(rows: list[dict[str, Any]]) -> None:
    """Ratio to target per row (>= 1 meets it); relative targets compare with the same
    implementation family's best time on the reference shape."""

    def best(prefix: str, impl: str) -> float:
        family = impl.split(" ", maxsplit=1)[0].split("-", maxsplit=1)[0]
        times = [
            r["us"] for r in rows
            if r["shape"].startswith(prefix) and r["impl"].split(" ")[0].split("-")[0] == family
        ]  # fmt: skip
        return min(times) if times else math.nan

    for r in rows:
        target = r["target"]
        if target.startswith("tbps>="):
            r["vs_target"] = r["TB/s"] / float(target.split(">=")[1])
        elif target.startswith("tflops>="):
            r["vs_target"] = r["TFLOP/s"] / float(target.split(">=")[1])
        elif target.startswith("speedup"):
            r["vs_target"] = best("mem H16 q1 B128 S8192", r["impl"]) / r["us"] / 1.7
        elif target.startswith("time<=1.15x"):
            r["vs_target"] = 1.15 * best("mem H16 q1 B64 S4096", r["impl"]) / r["us"]
        elif target.startswith("time<=1.0x"):
            r["vs_target"] = best("mem H16 q1 B128 S4096", r["impl"]) / r["us"]
        else:
            r["vs_target"] = math.nan


def plot(rows: list[dict[str, Any]], path: str) -> None:
    """Grouped bars: best achieved TB/s per case for each implementation family, with the
    measured copy ceiling as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys(r["shape"] for r in rows))
    families = list(dict.fromkeys(r["impl"].split(" ")[0] for r in rows))
    best: dict[tuple[str, str], float] = {}
    for r in rows:
        key = (r["shape"], r["impl"].split(" ")[0])
        if r["check"] == "ok" and not math.isnan(r["TB/s"]):
            best[key] = max(best.get(key, 0.0), r["TB/s"])
    width = 0.8 / max(1, len(families))
    fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(cases)), 4.8))
    for i, fam in enumerate(families):
        xs = [c + (i - (len(families) - 1) / 2) * width for c in range(len(cases))]
        ax.bar(xs, [best.get((case, fam), 0.0) for case in cases], width, label=fam)
    ax.axhline(H200_COPY_TBPS, color="black", linestyle="--", linewidth=1, label="device copy")
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels([c.replace(" bs", "\nbs").replace(" S", "\nS") for c in cases], fontsize=7)
    ax.set_ylabel("achieved TB/s (KV read once + q + o)")
    ax.set_title(f"MLA decode on {gpu_name()} (CUDA-graph replay)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=130)
    print(f"plot written to {path}", flush=True)


def sweep_configs() -> list[tuple[Shape, str, DecodeLaunchConfig | None, int | None, int | None]]:
    """(shape, mode, tile config, schedule units, min chunk) alternatives for the key rows."""
    mem = Shape("mem", 16, 1, 128, 4096)
    long = Shape("long", 16, 1, 1, 65536)
    fp8 = Shape("fp8", 16, 1, 128, 8192, kv="fp8")
    v4 = Shape("verify", 16, 4, 64, 4096)
    big = Shape("compute", 128, 1, 64, 4096)

    def cfg(m: int, n: int, w: int, st: int, rp: bool = False) -> DecodeLaunchConfig:
        return DecodeLaunchConfig(block_m=m, block_n=n, num_warps=w, num_stages=st, reg_pipeline=rp)

    out: list[tuple[Shape, str, DecodeLaunchConfig | None, int | None, int | None]] = []
    for units, chunk in [(128, 256), (264, 256)]:
        out.append((mem, "pers", None, units, chunk))
        out.append((long, "pers", None, units, chunk))
    for c in [cfg(16, 32, 4, 2), cfg(16, 64, 8, 1, True)]:
        out.append((fp8, "pers", c, None, None))
    out.append((mem, "pers", cfg(16, 32, 4, 3), None, None))
    out.append((v4, "pers", cfg(16, 64, 4, 2), None, None))
    out.append((big, "pers", cfg(64, 64, 8, 2), None, None))
    return out


def run_sweep() -> list[dict[str, Any]]:
    device = torch.device("cuda")
    rows: list[dict[str, Any]] = []
    cache: dict[Shape, Problem] = {}
    for shape, _mode, config, units, chunk in sweep_configs():
        if shape not in cache:
            cache.clear()
            torch.cuda.empty_cache()
            cache[shape] = Problem(shape, device)
        prob = cache[shape]
        fn = prob.decode_fn(schedule=prob.schedule(units=units, min_chunk=chunk), config=config)
        desc = (
            "default"
            if config is None
            else f"m{config.block_m} n{config.block_n} w{config.num_warps} s{config.num_stages}"
        )
        if units is not None:
            desc += f" units{units} chunk{chunk}"
        try:
            err_o, err_l = prob.check(fn)
        except Exception as exc:  # a config that fails to compile (shared memory) is reported
            rows.append({"shape": label(shape), "config": desc, "check": f"ERROR {type(exc).__name__}"})
            print(rows[-1], str(exc)[:300], flush=True)
            continue
        ok = err_o <= 1e-2 and err_l <= 1e-2
        us = bench_graph_us(fn) if ok else math.nan
        bw, fl = prob.metrics(us)
        rows.append({"shape": label(shape), "config": desc, "check": "ok" if ok else f"FAIL {err_o:.2g}",
                     "us": us, "TB/s": bw, "TFLOP/s": fl})  # fmt: skip
        print(rows[-1], flush=True)
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks decode",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="two small shapes only")
    parser.add_argument(
        "--only", nargs="+", metavar="CASE", help="only these cases of the matrix (mem, long, fp8, ...)"
    )
    parser.add_argument("--sweep", action="store_true", help="also time alternative Triton launch configs")
    parser.add_argument("--no-torch", action="store_true", help="skip timing the torch reference")
    parser.add_argument("--json", help="write all rows to this file")
    parser.add_argument("--vllm-decode", help="path of vLLM's triton_decode_attention.py (a vllm column)")
    parser.add_argument("--plot", help="write the TB/s plot here (PNG, needs matplotlib)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("python -m benchmarks decode needs a CUDA/ROCm GPU")
    print(
        f"# GPU: {gpu_name()}, SMs: {num_sms(torch.device('cuda'))}, torch {torch.__version__}, "
        f"triton {triton.__version__}",
        flush=True,
    )
    vllm = None
    if args.vllm_decode:
        if os.path.exists(args.vllm_decode):
            vllm = _vllm.load(args.vllm_decode)
        else:
            print(f"# note: {args.vllm_decode} does not exist: the vllm column is skipped", flush=True)
    shapes = select_cases(QUICK if args.quick else MATRIX, args.only, parser)
    rows, notes = run_matrix(shapes, with_torch=not args.no_torch, vllm=vllm)
    sweep = run_sweep() if args.sweep else []
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"gpu": gpu_name(), "matrix": rows, "notes": notes, "sweep": sweep}, f, indent=1, default=str
            )
    if args.plot:
        try:
            plot(rows, args.plot)
        except ImportError as exc:
            print(f"# note: no plot ({exc})", flush=True)
    if sweep:
        print_table(sweep, title="launch-config sweep (graph-replay µs)")
    for note in dict.fromkeys(n.split(": ", 1)[1] for n in notes):
        print(f"# note: {note}")
    print_table(
        [{k: r[k] for k in ("shape", "impl", "check", "us", "us_dobench", "TB/s", "copy%", "TFLOP/s",
                            "MHz", "W", "capped", "x_torch", "vs_target")} for r in rows],
        title=f"MLA decode on {gpu_name()} (µs = CUDA-graph replay median; MHz, W: means while timed; "
        "capped: fraction of samples power-capped)",
    )  # fmt: skip
