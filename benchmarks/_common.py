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

GPU state: ``sample_gpu_state`` samples the SM clock, the power draw and the power-cap throttle
bit while a block of timing runs (see its docstring). An H200 capped at 700 W lowers its SM clock
in kernels that draw near the cap, so the same kernel can time some 10% slower after a second of
sustained running than from a cool start; a timing is read with the clock it ran at.
"""

from __future__ import annotations

import contextlib
import cProfile
import importlib
import math
import os
import pstats
import shutil
import statistics
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
import torch

# Measured device-to-device copy bandwidth on an H200; the yardstick for TB/s.
H200_COPY_TBPS = 4.25


def bench_us(fn: Callable[[], Any], *, warmup_ms: float = 25.0, rep_ms: float = 100.0) -> float:
    """Median time of ``fn()`` in microseconds, measured with ``triton.testing.do_bench``."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")) * 1e3


def interleaved_medians(
    fns: dict[str, Callable[[], Any]], *, timer: Callable[[Callable[[], Any]], float], rounds: int
) -> dict[str, float]:
    """Each of ``fns`` timed by ``timer`` once a round, in turn, for ``rounds`` rounds; per name
    the median of its rounds. Rows timed in turn meet the same clocks (a GPU at its power cap
    lowers them over a run), where rows timed one after another do not."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            samples[name].append(timer(fn))
    return {name: statistics.median(times) for name, times in samples.items()}


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


SW_POWER_CAP = 0x4
"""The clocks-event (throttle) reason bit of NVML and nvidia-smi for the software power cap."""


@attrs.frozen
class GpuSample:
    """One reading of the GPU: SM clock (MHz), board power (W), whether the power cap throttles."""

    sm_mhz: float
    watts: float
    power_capped: bool


@attrs.frozen
class GpuState:
    """Means over the samples of a block: SM clock (MHz), power (W), and ``power_capped``, the
    fraction (0.0 to 1.0) of the samples with the software power-cap bit (0x4) set."""

    sm_mhz: float
    watts: float
    power_capped: float


def parse_smi_line(line: str) -> GpuSample | None:
    """One line of ``nvidia-smi --query-gpu=clocks.sm,power.draw,clocks_throttle_reasons.active
    --format=csv,noheader,nounits``, e.g. ``"1686, 661.0, 0x0000000000000004"``, as a sample;
    None for a line that is not one (``[N/A]`` fields, an error message, an empty line)."""
    fields = [f.strip() for f in line.split(",")]
    if len(fields) != 3:
        return None
    try:
        return GpuSample(float(fields[0]), float(fields[1]), bool(int(fields[2], 16) & SW_POWER_CAP))
    except ValueError:
        return None


def summarize_gpu_samples(samples: Sequence[GpuSample]) -> GpuState | None:
    """The means of ``samples`` as a ``GpuState``; None when there are none."""
    if not samples:
        return None
    return GpuState(
        sm_mhz=statistics.fmean(s.sm_mhz for s in samples),
        watts=statistics.fmean(s.watts for s in samples),
        power_capped=sum(s.power_capped for s in samples) / len(samples),
    )


class GpuSampler:
    """The samples taken by ``sample_gpu_state`` (appended by its background thread)."""

    def __init__(self) -> None:
        self.source = "none"
        """Where the samples come from: ``"pynvml"``, ``"nvidia-smi"`` or ``"none"``."""
        self._samples: list[GpuSample] = []
        self._lock = threading.Lock()

    def add(self, sample: GpuSample) -> None:
        with self._lock:
            self._samples.append(sample)

    @property
    def samples(self) -> list[GpuSample]:
        with self._lock:
            return list(self._samples)

    def summary(self) -> GpuState | None:
        """Means over the samples so far (read after the block); None when nothing was sampled."""
        return summarize_gpu_samples(self.samples)


def _nvml_sampler(sampler: GpuSampler, device_index: int, period_s: float) -> Callable[[], None] | None:
    """Start sampling through pynvml (package ``nvidia-ml-py``) in a thread; return its stop
    function, or None when pynvml is missing or finds no such NVIDIA device."""
    try:
        nvml: Any = importlib.import_module("pynvml")
        nvml.nvmlInit()
    except Exception:
        return None
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(device_index)
        reasons = (
            getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
            or nvml.nvmlDeviceGetCurrentClocksThrottleReasons
        )
        cap_bit: int = getattr(
            nvml,
            "nvmlClocksEventReasonSwPowerCap",
            getattr(nvml, "nvmlClocksThrottleReasonSwPowerCap", SW_POWER_CAP),
        )

        instant = getattr(nvml, "NVML_FI_DEV_POWER_INSTANT", None)

        def milliwatts() -> float:
            # The instantaneous power field where the driver has it (Hopper: yes), else NVML's
            # power usage, which is averaged over about a second.
            if instant is not None:
                field = nvml.nvmlDeviceGetFieldValues(handle, [instant])[0]
                if field.nvmlReturn == 0:
                    return float(field.value.uiVal)
            return float(nvml.nvmlDeviceGetPowerUsage(handle))

        def read() -> GpuSample:
            return GpuSample(
                sm_mhz=float(nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM)),
                watts=milliwatts() / 1000.0,
                power_capped=bool(int(reasons(handle)) & cap_bit),
            )

        read()  # fail here, not in the thread, where the device cannot be read
    except Exception:
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()
        return None
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            try:
                sampler.add(read())
            except Exception:
                return
            stop.wait(period_s)

    thread = threading.Thread(target=loop, name="gpu-state-nvml", daemon=True)
    thread.start()

    def finish() -> None:
        stop.set()
        thread.join()
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()

    return finish


def _smi_sampler(sampler: GpuSampler, device_index: int, period_s: float) -> Callable[[], None] | None:
    """Start ``nvidia-smi ... -lms`` and a thread parsing its lines; return its stop function,
    or None when there is no nvidia-smi."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    query = "clocks.sm,power.draw,clocks_throttle_reasons.active"
    cmd = [exe, f"--query-gpu={query}", "--format=csv,noheader,nounits",
           "-lms", str(max(1, round(period_s * 1000))), "-i", str(device_index)]  # fmt: skip
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    except OSError:
        return None
    stdout = proc.stdout
    assert stdout is not None

    def loop() -> None:
        for line in stdout:
            if (sample := parse_smi_line(line)) is not None:
                sampler.add(sample)

    thread = threading.Thread(target=loop, name="gpu-state-smi", daemon=True)
    thread.start()

    def finish() -> None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        thread.join(timeout=5)
        stdout.close()

    return finish


@contextlib.contextmanager
def sample_gpu_state(device_index: int = 0, period_s: float = 0.1) -> Iterator[GpuSampler]:
    """Sample the SM clock, power draw and power-cap throttling of NVIDIA GPU ``device_index``
    every ``period_s`` seconds while the ``with`` block runs; read ``.summary()`` after it.

    ``device_index`` is NVML's (nvidia-smi's) index, which ignores ``CUDA_VISIBLE_DEVICES``.
    Samples come from pynvml (``nvidia-ml-py``) when it imports and sees the device, else from an
    ``nvidia-smi -lms`` subprocess. Without either (no NVIDIA GPU: a CPU, a ROCm device) nothing
    is sampled and ``summary()`` is None. The sampler never raises; an exception of the block
    passes through unchanged. Through pynvml the power is the instantaneous reading where the
    driver has it (else NVML's average over about a second, as nvidia-smi's); the nvidia-smi path
    starts up in some 0.1 s, so a block shorter than that may get no sample from it.
    """
    sampler = GpuSampler()
    finish = None
    for source, start in (("pynvml", _nvml_sampler), ("nvidia-smi", _smi_sampler)):
        try:
            finish = start(sampler, device_index, period_s)
        except Exception:
            finish = None
        if finish is not None:
            sampler.source = source
            break
    try:
        yield sampler
    finally:
        if finish is not None:
            with contextlib.suppress(Exception):
                finish()


def nvml_index(cuda_index: int | None = None) -> int:
    """The NVML (nvidia-smi) index of CUDA device ``cuda_index`` (default: the current one),
    through ``CUDA_VISIBLE_DEVICES`` when that lists indices; the CUDA index otherwise."""
    if cuda_index is None:
        cuda_index = torch.cuda.current_device() if torch.cuda.is_available() else 0
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if cuda_index < len(visible) and all(v.isdigit() for v in visible):
        return int(visible[cuda_index])
    return cuda_index


def gpu_state_columns(state: GpuState | None) -> dict[str, float]:
    """A table's ``MHz``, ``W`` (rounded means) and ``capped`` (fraction of samples power-capped,
    0.0 to 1.0) columns for ``state``; NaN where nothing was sampled."""
    if state is None:
        return {"MHz": math.nan, "W": math.nan, "capped": math.nan}
    return {"MHz": round(state.sm_mhz), "W": round(state.watts), "capped": round(state.power_capped, 2)}
