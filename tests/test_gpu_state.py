"""``benchmarks/_common.py``'s GPU-state sampler: the nvidia-smi line parser, the summary of
samples, and a sampler that yields nothing (and raises nothing) where no NVIDIA GPU is."""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from benchmarks import _common


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("1980, 549.12, 0x0000000000000000", (1980.0, 549.12, False)),
        ("1686, 661.0, 0x0000000000000004\n", (1686.0, 661.0, True)),
        ("1770, 642.5, 0x0000000000000005", (1770.0, 642.5, True)),  # idle bit too
        ("1743, 669.0, 0x0000000000000001", (1743.0, 669.0, False)),
    ],
)
def test_parse_smi_line(line: str, expected: tuple[float, float, bool]) -> None:
    assert _common.parse_smi_line(line) == _common.GpuSample(*expected)


@pytest.mark.parametrize(
    "line",
    ["[N/A], [N/A], [N/A]", "", "\n", "1980, 549.12", "No devices were found", "1980, [N/A], 0x0"],
)
def test_parse_smi_line_rejects(line: str) -> None:
    assert _common.parse_smi_line(line) is None


def test_summary_of_samples() -> None:
    samples = [
        _common.GpuSample(1980.0, 500.0, False),
        _common.GpuSample(1700.0, 690.0, True),
        _common.GpuSample(1680.0, 700.0, True),
        _common.GpuSample(1720.0, 650.0, False),
    ]
    state = _common.summarize_gpu_samples(samples)
    assert state == _common.GpuState(sm_mhz=1770.0, watts=635.0, power_capped=0.5)
    assert _common.summarize_gpu_samples([]) is None
    assert _common.gpu_state_columns(state) == {"MHz": 1770, "W": 635, "capped": 0.5}
    assert all(math.isnan(v) for v in _common.gpu_state_columns(None).values())


def test_sampler_records_what_it_is_given() -> None:
    sampler = _common.GpuSampler()
    assert sampler.summary() is None
    sampler.add(_common.GpuSample(1980.0, 549.0, False))
    assert sampler.summary() == _common.GpuState(1980.0, 549.0, 0.0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without an NVIDIA GPU")
def test_sampler_without_a_gpu_yields_nothing() -> None:
    with _common.sample_gpu_state(0, period_s=0.01) as sampler:
        pass
    assert sampler.summary() is None
    assert sampler.source == "none"


def test_sampler_passes_the_blocks_exception_through() -> None:
    with pytest.raises(KeyError), _common.sample_gpu_state(0, period_s=0.01):
        raise KeyError("the block's")


def test_nvml_index_follows_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    assert _common.nvml_index(0) == 3
    assert _common.nvml_index(1) == 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-0a1b")
    assert _common.nvml_index(0) == 0
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert _common.nvml_index(2) == 2


def test_sampler_reads_nvidia_smi_lines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fallback: a stand-in ``nvidia-smi`` streams two lines, then runs until terminated."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text(
        "#!/bin/sh\necho '[N/A], [N/A], [N/A]'\necho '1700, 690.0, 0x0000000000000004'\n"
        "echo '1980, 550.0, 0x0000000000000000'\nexec sleep 30\n"
    )
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(_common, "_nvml_sampler", lambda *args: None)
    with _common.sample_gpu_state(0, period_s=0.01) as sampler:
        deadline = time.monotonic() + 1.5
        while len(sampler.samples) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert sampler.source == "nvidia-smi"
    assert sampler.summary() == _common.GpuState(sm_mhz=1840.0, watts=620.0, power_capped=0.5)


def _fake_pynvml(calls: list[str], **extra: object) -> SimpleNamespace:
    """A stand-in pynvml with the newer (clocks-event) names, reading 1686 MHz, 661 W averaged
    and the power-cap bit."""
    return SimpleNamespace(
        NVML_CLOCK_SM=1,
        nvmlClocksEventReasonSwPowerCap=0x4,
        nvmlInit=lambda: calls.append("init"),
        nvmlShutdown=lambda: calls.append("shutdown"),
        nvmlDeviceGetHandleByIndex=lambda index: f"gpu{index}",
        nvmlDeviceGetClockInfo=lambda handle, clock: 1686,
        nvmlDeviceGetPowerUsage=lambda handle: 661000,
        nvmlDeviceGetCurrentClocksEventReasons=lambda handle: 0x4,
        **extra,
    )


def test_sampler_reads_pynvml(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pynvml path without the instantaneous power field: NVML's averaged power."""
    calls: list[str] = []
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(calls))
    with _common.sample_gpu_state(0, period_s=0.01) as sampler:
        time.sleep(0.05)
    assert sampler.source == "pynvml"
    assert sampler.summary() == _common.GpuState(sm_mhz=1686.0, watts=661.0, power_capped=1.0)
    assert calls == ["init", "shutdown"]


@pytest.mark.parametrize(("status", "watts"), [(0, 702.5), (3, 661.0)], ids=["instant", "not-supported"])
def test_sampler_prefers_the_instantaneous_power(
    monkeypatch: pytest.MonkeyPatch, status: int, watts: float
) -> None:
    """Where the driver reads the instantaneous power field it is taken; a field the driver does
    not support (a non-zero status) falls back to the averaged power."""
    field = SimpleNamespace(nvmlReturn=status, value=SimpleNamespace(uiVal=702500))
    fake = _fake_pynvml(
        [], NVML_FI_DEV_POWER_INSTANT=186, nvmlDeviceGetFieldValues=lambda handle, ids: [field]
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    with _common.sample_gpu_state(0, period_s=0.01) as sampler:
        time.sleep(0.05)
    assert sampler.summary() == _common.GpuState(sm_mhz=1686.0, watts=watts, power_capped=1.0)
