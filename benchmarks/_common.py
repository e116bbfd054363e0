"""Shared helpers for the GPU benchmarks: median timing, FlashMLA's metric formulas, a table printer.

Timing: ``bench_us`` runs ``triton.testing.do_bench`` (CUDA events, L2 flushed between calls) and
returns the median in microseconds; ``bench_graph_us`` runs ``triton.testing.do_bench_cudagraph``
(the callable captured in a CUDA graph and replayed), which removes launch gaps for multi-kernel
steps.

Metrics follow FlashMLA's ``tests/test_flash_mla.py`` so numbers compare 1:1
with the published anchors:

    FLOPS = s_q · total_seqlens · h_q · (d + dv) · 2
    bytes = total_seqlens · h_kv · d · kv_elem + b · s_q · h_q · (d + dv) · q_elem

FlashMLA writes the byte count with element size 2 for everything; ``decode_bytes`` takes the
cache and query element sizes apart so an fp8 cache counts 1 byte per KV element.
``attention_flops`` is the prefill counterpart (causal halves the square).
"""

from __future__ import annotations

import cProfile
import math
import pstats
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

# Measured device-to-device copy bandwidth on an H200; the yardstick for TB/s.
H200_COPY_TBPS = 4.25


def bench_us(fn: Callable[[], Any], *, warmup_ms: float = 25.0, rep_ms: float = 100.0) -> float:
    """Median time of ``fn()`` in microseconds, measured with ``triton.testing.do_bench``."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")) * 1e3


def bench_graph_us(fn: Callable[[], Any], *, rep_ms: float = 20.0) -> float:
    """Median time of one ``fn()`` in microseconds, timed as replays of a captured CUDA graph
    (``triton.testing.do_bench_cudagraph``: the calls of about ``rep_ms`` unrolled in one graph).

    ``fn`` must be capturable (no host syncs, no allocation of data-dependent size). Use this for
    steps made of several small launches: it removes the launch gaps.
    """
    from triton.testing import do_bench_cudagraph

    return float(do_bench_cudagraph(fn, rep=rep_ms, return_mode="median")) * 1e3


def decode_flops(*, total_seqlens: int, s_q: int, h_q: int, d: int = 576, dv: int = 512) -> float:
    """FlashMLA decode FLOPs: ``s_q · total_seqlens · h_q · (d + dv) · 2``."""
    return 2.0 * s_q * total_seqlens * h_q * (d + dv)


def decode_bytes(
    *,
    total_seqlens: int,
    b: int,
    s_q: int,
    h_q: int,
    d: int = 576,
    dv: int = 512,
    h_kv: int = 1,
    kv_elem: int = 2,
    q_elem: int = 2,
) -> float:
    """FlashMLA decode bytes: KV rows read once, q read and o written once.

    ``kv_elem`` is the cache element size (2 for bf16/fp16, 1 for fp8); ``q_elem`` the query
    and output element size. With both 2 this is FlashMLA's formula exactly.
    """
    return float(total_seqlens * h_kv * d * kv_elem + b * s_q * h_q * (d + dv) * q_elem)


def attention_flops(
    seqlens_q: Sequence[int], seqlens_k: Sequence[int], *, h: int, d_qk: int, d_v: int, causal: bool
) -> float:
    """Attention forward FLOPs over a varlen batch: ``2 · h · (d_qk + d_v) · (attended pairs)``.

    Causal masking is bottom-right aligned: query row i of a request with lengths (q, k) sees
    ``k - q + i + 1`` keys (clamped to [0, k]), so the pair count is exact, not ``q·k/2``.
    """
    pairs = 0
    for q, k in zip(seqlens_q, seqlens_k, strict=True):
        if not causal:
            pairs += q * k
            continue
        for_offset = k - q
        # sum over i in [0, q) of clamp(for_offset + i + 1, 0, k)
        pairs += sum(min(max(for_offset + i + 1, 0), k) for i in range(q))
    return 2.0 * h * (d_qk + d_v) * pairs


def tbps(nbytes: float, us: float) -> float:
    """Bytes over microseconds, in TB/s (10^12 bytes per second)."""
    return nbytes / (us * 1e-6) / 1e12


def tflops(flops: float, us: float) -> float:
    """FLOPs over microseconds, in TFLOP/s."""
    return flops / (us * 1e-6) / 1e12


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``‖out − ref‖ / ‖ref‖`` in float64 over finite reference entries; NaN anywhere in out → inf."""
    out64 = out.detach().double()
    ref64 = ref.detach().double()
    if torch.isnan(out64).any():
        return math.inf
    finite = torch.isfinite(ref64)
    if not bool(finite.all()):
        # Entries that are ±inf in the reference (lse of empty rows) must match exactly.
        if not torch.equal(out64[~finite], ref64[~finite]):
            return math.inf
        out64, ref64 = out64[finite], ref64[finite]
    denom = float(ref64.norm())
    return float((out64 - ref64).norm()) / max(denom, 1e-30)


def print_table(rows: Sequence[dict[str, Any]], *, title: str | None = None) -> str:
    """Print ``rows`` (dicts with the same keys) as an aligned Markdown table; return the text.

    Floats are printed with 3 significant decimals (``%.3g`` for small, fixed for large).
    """
    if not rows:
        return ""
    columns = list(rows[0].keys())

    def fmt(value: Any) -> str:
        if isinstance(value, float):
            if math.isnan(value) or math.isinf(value):
                return str(value)
            return f"{value:.1f}" if abs(value) >= 100 else f"{value:.3g}"
        return str(value)

    cells = [[fmt(row.get(col, "")) for col in columns] for row in rows]
    widths = [max(len(col), *(len(r[i]) for r in cells)) for i, col in enumerate(columns)]
    lines = []
    if title:
        lines.append(f"### {title}")
    lines.append("| " + " | ".join(col.ljust(w) for col, w in zip(columns, widths, strict=True)) + " |")
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    lines.extend("| " + " | ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in cells)
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def gpu_name() -> str:
    """The CUDA device name, or ``"cpu"``."""
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def print_profile(
    fn: Callable[[], Any],
    label: str,
    *,
    calls: int,
    top: int = 20,
    sync: Callable[[], None] = lambda: None,
) -> None:
    """cProfile of ``calls`` calls of ``fn`` (after one warm-up call): the ``top`` functions
    with the most own time, printed under ``label``."""
    profiler = cProfile.Profile()
    fn()
    sync()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    sync()
    print(f"-- {label} ({calls} calls; times are totals)")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(top)


def wall_us(
    fn: Callable[[], Any], *, calls: int, rounds: int, sync: Callable[[], None] = lambda: None
) -> float:
    """Median over ``rounds`` of the per-call wall time (µs) of ``calls`` back-to-back calls of
    ``fn`` ending in one ``sync()`` (after one warm-up call)."""
    fn()
    sync()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        times.append((time.perf_counter() - start) * 1e6 / calls)
    return statistics.median(times)
