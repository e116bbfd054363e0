"""Prefill benchmark: Triton varlen (bf16), fp8 persistent and Gluon prefill vs ``varlen_attn``,
cuDNN SDPA and compiled FlexAttention.

One command on the GPU::

    python -m benchmarks prefill --check            # the issue's shape matrix
    python -m benchmarks prefill --check --sweep    # also time alternative launch configs
    python -m benchmarks prefill --quick            # smoke run on one small shape
    python -m benchmarks prefill --check --plot docs/img/prefill-h200.png   # and the bar chart

Last, the chunked-context step (H16, 4 requests x (2048 new + 16384 cached tokens)) against the
same attention without context (:mod:`benchmarks.prefill_context`).

Shapes: H in {16, 128}, q/k head dim 192, v head dim 128, causal, batches of 4 x 4096 and
16 x 1024 tokens (every request has Sq = Sk). Per shape and implementation it prints the time
(``triton.testing.do_bench``'s median, the median of ``--rounds`` rounds that time every row of
the shape in turn, so that the rows meet the same clocks), TFLOP/s and the ratio to
``torch.nn.attention.varlen.varlen_attn`` (and that ratio over the issue's 1.3x target).

FLOPs (useful work, the same count for every implementation)::

    FLOPs = 2 · H · (Dqk + Dv) · pairs,   pairs = Σ_requests Σ_i (keys row i sees) = S(S+1)/2 causal

``varlen_attn`` needs equal q/k and v head dims, so it runs with v zero-padded to 192 (padding
done once, outside the timing); its extra PV work is not counted. The fp8 row times the kernel
on pre-quantized inputs (per-tensor scales); its check compares with the reference on the
dequantized inputs. ``cudnn-sdpa`` runs on the batch as ``[B, H, S, D]`` (every request has the
same length). ``flex-attention`` is ``flex_attention`` under ``torch.compile`` (compiled once per
shape) on the batch as ``[1, H, T, D]`` with a block mask, causal within each request and closed
across requests (built from the varlen offsets), v at its own head dim 128 (padded to 192, the
output sliced, only where torch refuses that; its ``config`` column says so). A peer torch
cannot run here is left out, with the reason printed once.

``--plot PATH`` draws the TFLOP/s of every row, the chunked-context step's too, as bars grouped
by shape (one colour per implementation).

``--check`` compares every implementation first, on two heads (0 and H-1) of every request,
against fp32 torch math on the GPU; outputs are poisoned with NaN before the checked call.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import inspect
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch

from benchmarks._common import attention_flops, bench_us, gpu_name, interleaved_medians, print_table, tflops
from benchmarks.prefill_context import QUICK_SHAPE as CONTEXT_QUICK_SHAPE
from benchmarks.prefill_context import SHAPE as CONTEXT_SHAPE
from benchmarks.prefill_context import context_rows
from mla.core.platform import detect_platform
from mla.providers.calls import Fp8PrefillCall, Fp8PrefillPlanCall, VarlenPrefillCall
from mla.providers.quant import quantize_per_tensor
from mla.providers.triton.fp8_prefill import choose_fp8_config, fp8_prefill_fwd, plan_fp8_prefill
from mla.providers.triton.prefill import AttentionLaunchConfig, choose_varlen_config, varlen_attention_fwd

QK_DIM, V_DIM = 192, 128
TARGET_VS_VARLEN = 1.3
SHAPES = [(h, b, s) for h in (16, 128) for b, s in ((4, 4096), (16, 1024))]
QUICK_SHAPES = [(16, 2, 1024)]
VARLEN_SWEEP = [
    AttentionLaunchConfig(128, 64, 8, 2),
    AttentionLaunchConfig(128, 64, 8, 3),
    AttentionLaunchConfig(128, 128, 8, 2),
]
FP8_SWEEP = [
    AttentionLaunchConfig(128, 64, 8, 2),
    AttentionLaunchConfig(128, 64, 8, 3),
    AttentionLaunchConfig(128, 128, 8, 2),
    AttentionLaunchConfig(128, 128, 8, 3),
]
OUT_TOL = {"triton-bf16": 1e-2, "triton-fp8": 2e-2, "gluon-fp8": 4e-2, "varlen_attn": 1e-2}
"""Relative output error bounds; ``gluon-fp8`` quantizes P to e4m3 (the Triton fp8 kernel keeps
it in fp16), hence its wider bound."""
PEER_TOL = {"flex-attention": 1e-2}
"""Tolerances of the peers checked only where they run (absent from ``check``'s errors else)."""
GLUON_KERNELS = (("gluon-producer", "PRODUCER"), ("gluon-split", "SPLIT"), ("gluon-persistent", "PERSISTENT"))
"""The Gluon prefill layouts timed where the Gluon kernels run (``PrefillKernel`` names)."""
GLUON_FP8_KERNELS = ("SPLIT", "PERSISTENT")
"""The Gluon fp8 prefill layouts timed: the default launch's row is ``gluon-fp8``, each other
layout's ``gluon-fp8-<layout>``."""
LSE_TOL = 1e-2


class Case:
    """Inputs of one shape: bf16 q/k/v, their fp8 copies and a padded v for varlen_attn."""

    def __init__(self, heads: int, batch: int, seqlen: int, *, seed: int = 0, device: str = "cuda") -> None:
        gen = torch.Generator(device=device).manual_seed(seed)
        tokens = batch * seqlen
        self.heads, self.batch, self.seqlen = heads, batch, seqlen
        self.scale = QK_DIM**-0.5
        self.q = torch.randn(tokens, heads, QK_DIM, device=device, generator=gen).to(torch.bfloat16)
        self.k = torch.randn(tokens, heads, QK_DIM, device=device, generator=gen).to(torch.bfloat16)
        self.v = torch.randn(tokens, heads, V_DIM, device=device, generator=gen).to(torch.bfloat16)
        self.cu = torch.arange(0, tokens + 1, seqlen, dtype=torch.int32, device=device)
        self.out = torch.empty(tokens, heads, V_DIM, dtype=torch.bfloat16, device=device)
        self.lse = torch.empty(tokens, heads, dtype=torch.float32, device=device)
        fp8 = torch.float8_e4m3fn
        (self.q8, self.q_scale), (self.k8, self.k_scale), (self.v8, self.v_scale) = (
            quantize_per_tensor(x, fp8) for x in (self.q, self.k, self.v)
        )
        self.plan = plan_fp8_prefill(
            self.cu.cpu(), self.cu.cpu(), num_heads=heads, causal=True, device=self.q.device
        )
        self.gluon_fp8_plan: object | None = None
        self.flops = attention_flops(
            [seqlen] * batch, [seqlen] * batch, h=heads, d_qk=QK_DIM, d_v=V_DIM, causal=True
        )

    @property
    def name(self) -> str:
        return f"H={self.heads} {self.batch}x{self.seqlen}"

    def run_triton(self, config: AttentionLaunchConfig | None = None) -> None:
        call = VarlenPrefillCall(
            q=self.q, k=self.k, v=self.v, cu_seqlens_q=self.cu, cu_seqlens_k=self.cu, out=self.out,
            lse=self.lse, max_seqlen_q=self.seqlen, max_seqlen_k=self.seqlen, softmax_scale=self.scale,
            causal=True,
        )  # fmt: skip
        varlen_attention_fwd(call, config=config)

    def run_gluon(self, kernel: str) -> None:
        """The Gluon prefill kernel in layout ``kernel`` (a ``PrefillKernel`` name)."""
        from mla.providers.gluon.prefill_launch import (
            PrefillKernel,
            PrefillLaunchConfig,
            launch_gluon_prefill,
        )

        call = VarlenPrefillCall(
            q=self.q, k=self.k, v=self.v, cu_seqlens_q=self.cu, cu_seqlens_k=self.cu, out=self.out,
            lse=self.lse, max_seqlen_q=self.seqlen, max_seqlen_k=self.seqlen, softmax_scale=self.scale,
            causal=True,
        )  # fmt: skip
        launch_gluon_prefill(call, PrefillLaunchConfig(kernel=PrefillKernel[kernel]))

    def run_fp8(self, config: AttentionLaunchConfig | None = None) -> None:
        call = Fp8PrefillCall(
            q=self.q8, k=self.k8, v=self.v8, cu_seqlens_q=self.cu, cu_seqlens_k=self.cu, out=self.out,
            lse=self.lse, schedule=self.plan, softmax_scale=self.scale, q_scale=self.q_scale,
            k_scale=self.k_scale, v_scale=self.v_scale, causal=True,
        )  # fmt: skip
        fp8_prefill_fwd(call, config=config)

    def run_gluon_fp8(self, kernel: str | None = None) -> None:
        """The Gluon fp8 prefill kernel on the pre-quantized inputs: its default launch, or that
        launch in layout ``kernel`` (a ``PrefillKernel`` name)."""
        import attrs

        from mla.providers.gluon.prefill_fp8_launch import (
            fp8_prefill_config,
            launch_gluon_fp8_prefill,
            plan_gluon_fp8_prefill,
        )
        from mla.providers.gluon.prefill_launch import PrefillKernel

        if self.gluon_fp8_plan is None:
            plan_call = Fp8PrefillPlanCall(
                cu_seqlens_q_cpu=self.cu.cpu(), cu_seqlens_k_cpu=self.cu.cpu(), num_heads=self.heads,
                causal=True, platform=detect_platform(self.q.device), device=self.q.device,
            )  # fmt: skip
            self.gluon_fp8_plan = plan_gluon_fp8_prefill(plan_call, self.plan)
        call = Fp8PrefillCall(
            q=self.q8, k=self.k8, v=self.v8, cu_seqlens_q=self.cu, cu_seqlens_k=self.cu, out=self.out,
            lse=self.lse, schedule=self.gluon_fp8_plan, softmax_scale=self.scale, q_scale=self.q_scale,
            k_scale=self.k_scale, v_scale=self.v_scale, causal=True,
        )  # fmt: skip
        config = fp8_prefill_config(QK_DIM, V_DIM)
        if kernel is not None:
            config = attrs.evolve(config, kernel=PrefillKernel[kernel])
        launch_gluon_fp8_prefill(call, config)


def torch_varlen(case: Case) -> tuple[str, Callable[[], Any]]:
    """``varlen_attn`` with v padded to 192 (or per-request SDPA where torch lacks it)."""
    v_pad = torch.nn.functional.pad(case.v, (0, QK_DIM - V_DIM))
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def per_request() -> torch.Tensor:
            outs = []
            for b in range(case.batch):
                rows = slice(b * case.seqlen, (b + 1) * case.seqlen)
                q, k, v = (x[rows].transpose(0, 1) for x in (case.q, case.k, case.v))
                outs.append(sdpa(q, k, v, is_causal=True, scale=case.scale).transpose(0, 1))
            return torch.cat(outs)

        return "sdpa-per-request", per_request
    params = inspect.signature(varlen_attn).parameters
    causal_kw: dict[str, Any] = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}

    def call() -> torch.Tensor:
        out = varlen_attn(
            case.q, case.k, v_pad, case.cu, case.cu, case.seqlen, case.seqlen, scale=case.scale, **causal_kw
        )
        return (out[0] if isinstance(out, tuple) else out)[..., :V_DIM]

    return "varlen_attn", call


def gluon_kernels() -> tuple[tuple[str, str], ...]:
    """The Gluon prefill layouts to time: all of :data:`GLUON_KERNELS` on a Hopper GPU where the
    Gluon kernels import, none elsewhere."""
    from mla.providers.gluon import GluonProvider

    return GLUON_KERNELS if GluonProvider().availability() else ()


def gluon_fp8_rows() -> tuple[tuple[str, str], ...]:
    """``(row name, PrefillKernel name)`` of each Gluon fp8 layout to time (:data:`GLUON_FP8_KERNELS`,
    the default launch's first), none where the Gluon kernels do not run."""
    if not gluon_kernels():
        return ()
    from mla.providers.gluon.prefill_fp8_launch import fp8_prefill_config

    default = fp8_prefill_config(QK_DIM, V_DIM).kernel.name
    others = tuple(
        (f"gluon-fp8-{kernel.lower()}", kernel) for kernel in GLUON_FP8_KERNELS if kernel != default
    )
    return (("gluon-fp8", default), *others)


def cudnn_sdpa(case: Case) -> Callable[[], torch.Tensor] | None:
    """cuDNN's SDPA on the batch as ``[B, H, S, D]`` (every request has the same length, so no
    padding), or ``None`` where torch has no cuDNN attention. Returns ``[T, H, Dv]``."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if not hasattr(SDPBackend, "CUDNN_ATTENTION"):
        return None
    b, s, h = case.batch, case.seqlen, case.heads
    q, k, v = (x.view(b, s, h, -1).transpose(1, 2).contiguous() for x in (case.q, case.k, case.v))

    def call() -> torch.Tensor:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=case.scale)
        return out.transpose(1, 2).reshape(b * s, h, -1)

    try:
        call()
    except RuntimeError:  # no cuDNN kernel for these dims on this GPU
        return None
    return call


@functools.cache
def compiled_flex_attention() -> Callable[..., Any]:
    """``flex_attention`` under ``torch.compile``, made once: each new shape compiles once (static
    shapes), later calls of that shape reuse it."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    scale: float,
    pad_v: bool = False,
    compiled: bool = True,
) -> Callable[[], torch.Tensor]:
    """``flex_attention`` over the varlen batch ``q``/``k`` ``[T, H, Dqk]``, ``v`` ``[T, H, Dv]``
    laid out as ``[1, H, T, D]`` (copied once, here) with a block mask that is causal within each
    request of ``cu_seqlens`` and closed across requests. Every request has as many queries as
    keys, so top-left causal is bottom-right causal. ``pad_v``: v zero-padded to ``Dqk`` and the
    output sliced back (for a torch whose flex_attention wants one head dim). ``compiled``: the
    compiled function (:func:`compiled_flex_attention`), else the eager one (a CPU test). The
    call returns ``[T, H, Dv]`` (a view)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    tokens, d_v = q.shape[0], v.shape[-1]
    lengths = cu_seqlens.diff().long()
    request = torch.repeat_interleave(torch.arange(lengths.numel(), device=q.device), lengths)

    def same_request_causal(b: Any, h: Any, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return (request[q_idx] == request[kv_idx]) & (kv_idx <= q_idx)

    mask = create_block_mask(same_request_causal, None, None, tokens, tokens, device=q.device)
    if pad_v:
        v = torch.nn.functional.pad(v, (0, q.shape[-1] - d_v))
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0).contiguous() for x in (q, k, v))
    attend: Callable[..., Any] = compiled_flex_attention() if compiled else flex_attention

    def call() -> torch.Tensor:
        out: torch.Tensor = attend(qh, kh, vh, block_mask=mask, scale=scale)
        return out[0, :, :, :d_v].transpose(0, 1)

    return call


class FlexPeer:
    """The FlexAttention peer of one case: ``peer()`` returns ``[T, H, Dv]``; ``note`` is its
    row's ``config`` column."""

    def __init__(self, call: Callable[[], torch.Tensor], note: str) -> None:
        self.call, self.note = call, note

    def __call__(self) -> torch.Tensor:
        return self.call()


_SAID: set[str] = set()


def _say_once(text: str) -> None:
    if text not in _SAID:
        _SAID.add(text)
        print(text, flush=True)


def flex_attention_peer(case: Case) -> FlexPeer | None:
    """Compiled FlexAttention on ``case`` (:func:`flex_varlen`), run once here (the compile), or
    ``None`` where torch cannot run it (the reason printed once). v keeps its head dim 128; where
    that fails, v is padded to 192 and the output sliced (the note says so)."""
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:
        _say_once("flex-attention: left out, this torch has no torch.nn.attention.flex_attention")
        return None
    refused = ""
    for pad_v, note in (
        (False, "[1,H,T,D] block mask, v 128"),
        (True, "[1,H,T,D] block mask, v padded to 192, out sliced"),
    ):
        try:
            call = flex_varlen(case.q, case.k, case.v, case.cu, scale=case.scale, pad_v=pad_v)
            call()
        except Exception as exc:  # no kernel for these dims, a compile failure (shared memory)
            text = str(exc).strip()
            reason = f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
            if not pad_v:
                refused = reason
                continue
            _say_once(f"flex-attention: left out, v at 128: {refused}; v padded to 192: {reason}")
            return None
        if pad_v:
            _say_once(f"flex-attention: v head dim 128 refused ({refused}); v padded to 192")
        return FlexPeer(call, note)
    return None


def reference_heads(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, case: Case, heads: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 causal attention on the GPU for ``heads`` of every request: out ``[T, len, Dv]``, lse."""
    outs, lses = [], []
    causal = torch.ones(case.seqlen, case.seqlen, dtype=torch.bool, device=q.device).tril()
    for b in range(case.batch):
        rows = slice(b * case.seqlen, (b + 1) * case.seqlen)
        qh, kh, vh = (x[rows][:, heads].float().transpose(0, 1) for x in (q, k, v))
        scores = (qh @ kh.transpose(1, 2)) * case.scale
        scores = scores.masked_fill(~causal, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        outs.append((torch.exp(scores - lse[..., None]) @ vh).transpose(0, 1))
        lses.append(lse.transpose(0, 1))
    return torch.cat(outs), torch.cat(lses)


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    if not bool(torch.isfinite(out).all()):
        return math.inf
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def check(case: Case) -> dict[str, float]:
    """Relative output error of every implementation (and LSE max abs error) on heads 0, H-1."""
    heads = sorted({0, case.heads - 1})
    errors: dict[str, float] = {}
    ref_bf16 = reference_heads(case.q, case.k, case.v, case, heads)
    deq = [
        x.float() * s for x, s in ((case.q8, case.q_scale), (case.k8, case.k_scale), (case.v8, case.v_scale))
    ]
    ref_fp8 = reference_heads(deq[0], deq[1], deq[2], case, heads)
    del deq
    runners: list[tuple[str, Callable[[], None], tuple[torch.Tensor, torch.Tensor]]] = [
        ("triton-bf16", case.run_triton, ref_bf16),
        ("triton-fp8", case.run_fp8, ref_fp8),
    ]
    runners += [(name, partial(case.run_gluon, kernel), ref_bf16) for name, kernel in gluon_kernels()]
    runners += [(name, partial(case.run_gluon_fp8, kernel), ref_fp8) for name, kernel in gluon_fp8_rows()]
    for name, runner, (ref_out, ref_lse) in runners:
        case.out.fill_(float("nan"))
        case.lse.fill_(float("nan"))
        runner()
        if case.q.is_cuda:
            torch.cuda.synchronize()
        written = bool(torch.isfinite(case.out).all()) and bool(torch.isfinite(case.lse).all())
        errors[name] = rel(case.out[:, heads], ref_out) if written else math.inf
        errors[name + " lse"] = float((case.lse[:, heads] - ref_lse).abs().max())
    _, baseline = torch_varlen(case)
    errors["varlen_attn"] = rel(baseline()[:, heads], ref_bf16[0])
    cudnn = cudnn_sdpa(case)
    if cudnn is not None:
        errors["cudnn-sdpa"] = rel(cudnn()[:, heads], ref_bf16[0])
    flex = flex_attention_peer(case)
    if flex is not None:
        errors["flex-attention"] = rel(flex()[:, heads], ref_bf16[0])
    return errors


def plot(rows: Sequence[dict[str, Any]], path: str, *, device: str | None = None) -> None:
    """TFLOP/s as bars grouped by ``shape`` (one group per shape, one bar per implementation, one
    colour per implementation across groups); rows without a finite TFLOP/s (the up-projection
    alone) are left out. No target lines: the benchmark's target is a ratio to ``varlen_attn``
    (its ``x target`` column), not a TFLOP/s. ``device``: the title's device (default: this
    machine's GPU), for a plot drawn later from a run's ``--out`` rows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawn = [r for r in rows if math.isfinite(r.get("TFLOP/s", math.nan))]
    shapes = list(dict.fromkeys(r["shape"] for r in drawn))
    impls = list(dict.fromkeys(r["impl"] for r in drawn))
    colours = plt.get_cmap("tab10" if len(impls) <= 10 else "tab20")
    groups = [[r for r in drawn if r["shape"] == shape] for shape in shapes]
    width = 0.8 / max([1, *(len(group) for group in groups)])
    fig, ax = plt.subplots(figsize=(max(8.0, 1.9 * len(shapes) + 2.0), 5.0))
    for x, group in enumerate(groups):
        for i, r in enumerate(group):
            colour = colours(impls.index(r["impl"]) % colours.N)
            ax.bar(x + (i - (len(group) - 1) / 2) * width, r["TFLOP/s"], width, color=colour, label=r["impl"])
    handles, names = ax.get_legend_handles_labels()
    unique = dict(zip(names, handles, strict=True))
    ax.legend(unique.values(), unique.keys(), fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_xticks(range(len(shapes)), [s.replace(" ", "\n", 1) for s in shapes], fontsize=7)
    ax.set_ylabel("TFLOP/s (2·H·(Dqk+Dv)·causal pairs), higher is better")
    ax.set_title(
        f"MLA prefill, 192/128 causal, bf16 (triton-fp8: e4m3), on {device or gpu_name()}, "
        f"{datetime.date.today().isoformat()}, torch {torch.__version__}",
        fontsize=9,
    )
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    print(f"plot written to {path}", flush=True)


def config_text(config: AttentionLaunchConfig) -> str:
    return f"{config.block_m}x{config.block_n} w{config.num_warps} s{config.num_stages}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks prefill",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--check", action="store_true", help="check every implementation before timing")
    parser.add_argument("--quick", action="store_true", help="one small shape (smoke run)")
    parser.add_argument("--sweep", action="store_true", help="also time alternative launch configs")
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="time every row once a round, in turn; each row the median (default 3)",
    )
    parser.add_argument("--out", help="write the rows as JSON to this path")
    parser.add_argument("--plot", help="write a bar chart of the TFLOP/s to this PNG")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.plot:
        try:
            import matplotlib  # noqa: F401  (missing: say so now, not after the run)
        except ImportError:
            parser.error("--plot needs matplotlib")
    if not torch.cuda.is_available():
        print("prefill benchmark: needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    shapes = QUICK_SHAPES if args.quick else SHAPES
    rows: list[dict[str, Any]] = []
    sweep_rows: list[dict[str, Any]] = []
    failures: list[str] = []
    for heads, batch, seqlen in shapes:
        case = Case(heads, batch, seqlen)
        errors = check(case) if args.check else {}
        if args.check:
            print(f"{case.name}: " + ", ".join(f"{k} {v:.2e}" for k, v in errors.items()), flush=True)
            bounds = {
                **OUT_TOL, **{name: OUT_TOL["triton-bf16"] for name, _ in gluon_kernels()},
                **{name: OUT_TOL["gluon-fp8"] for name, _ in gluon_fp8_rows()}, **PEER_TOL,
            }  # fmt: skip
            for name, tol in bounds.items():
                if name in errors and not errors[name] <= tol:
                    failures.append(f"{case.name} {name}: rel err {errors[name]:.3g} > {tol}")
            for name in (key.removesuffix(" lse") for key in errors if key.endswith(" lse")):
                if not errors[name + " lse"] <= LSE_TOL:
                    failures.append(f"{case.name} {name}: lse err {errors[name + ' lse']:.3g} > {LSE_TOL}")
        baseline_name, baseline = torch_varlen(case)
        runs: dict[str, tuple[Callable[[], Any], str]] = {
            baseline_name: (baseline, ""),
            "triton-bf16": (
                case.run_triton,
                config_text(choose_varlen_config(case.q.device, torch.bfloat16, QK_DIM, V_DIM, seqlen)),
            ),
            "triton-fp8": (
                case.run_fp8, config_text(choose_fp8_config(case.q.device, QK_DIM, V_DIM, case.plan.tile_q))
            ),
        }  # fmt: skip
        for name, kernel in gluon_kernels():
            runs[name] = (partial(case.run_gluon, kernel), kernel.lower())
        for name, kernel in gluon_fp8_rows():
            runs[name] = (partial(case.run_gluon_fp8, kernel), f"e4m3, {kernel.lower()}")
        cudnn = cudnn_sdpa(case)
        if cudnn is not None:
            runs["cudnn-sdpa"] = (cudnn, "padded batch")
        flex = flex_attention_peer(case)
        if flex is not None:
            runs["flex-attention"] = (flex, flex.note)
        medians = interleaved_medians(
            {name: fn for name, (fn, _) in runs.items()}, timer=bench_us, rounds=args.rounds
        )
        base_us = medians[baseline_name]
        for name, (_, config) in runs.items():
            us = medians[name]
            ratio = base_us / us
            rows.append({
                "shape": case.name, "impl": name, "time_us": us, "TFLOP/s": tflops(case.flops, us),
                "x varlen_attn": ratio, "x target": ratio / TARGET_VS_VARLEN,
                "rel_err": errors.get(name, math.nan), "config": config,
            })  # fmt: skip
        if args.sweep:
            for kind, configs, runner in (
                ("bf16", VARLEN_SWEEP, case.run_triton),
                ("fp8", FP8_SWEEP, case.run_fp8),
            ):
                for cfg in configs:
                    try:
                        us = bench_us(lambda cfg=cfg, runner=runner: runner(cfg))
                    except Exception as exc:  # a config can exceed shared memory on this GPU
                        us, note = math.nan, type(exc).__name__
                    else:
                        note = ""
                    sweep_rows.append({
                        "shape": case.name, "kind": kind, "config": config_text(cfg), "time_us": us,
                        "TFLOP/s": tflops(case.flops, us), "note": note,
                    })  # fmt: skip
        del case
        torch.cuda.empty_cache()
    context_shape = CONTEXT_QUICK_SHAPE if args.quick else CONTEXT_SHAPE
    context, context_error = context_rows(context_shape, timer=bench_us)
    print(f"{context_shape.name}: chunked-context step rel err {context_error:.2e}", flush=True)
    if not context_error <= OUT_TOL["triton-bf16"]:
        failures.append(f"{context_shape.name}: chunked-context rel err {context_error:.3g}")
    if sweep_rows:
        print_table(sweep_rows, title="launch-config sweep")
    stamp = datetime.date.today().isoformat()
    print_table(
        rows,
        title=f"prefill, {gpu_name()}, {stamp}, torch {torch.__version__}, 192/128 causal bf16 "
        f"(fp8: e4m3 per-tensor); FLOPs = 2·H·(Dqk+Dv)·causal pairs",
    )
    print_table(
        context,
        title="chunked-context prefill step (engine path, FlashVarlen) against the same attention "
        "without context; FLOPs = 2·H·(Dqk+Dv)·pairs of both",
    )
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(
                {"rows": rows, "context": context, "sweep": sweep_rows, "failures": failures},
                handle,
                indent=1,
            )
    if args.plot:
        plot(rows + context, args.plot)
    for failure in failures:
        print("CHECK FAILED:", failure)
    return 1 if failures else 0
