"""Shared test configuration: the ``gpu`` marker (deselected without a device) and the Triton
interpreter on CPU machines."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest
import torch

# Triton kernels run in the CPU interpreter when there is no GPU. It must be set before triton
# is first imported, which is why it lives at conftest import time.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (``make test``: ``-n auto``, one worker per core) each worker's torch would
# start a thread per core: the workers' threads would then outnumber the cores and wait on each
# other. Each worker gets its share of the cores instead.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, torch.get_num_threads() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


def pytest_report_header(config: pytest.Config) -> str | None:
    if torch.cuda.is_available():
        return None
    # (a serial run's summary counts them, "N deselected"; under pytest-xdist the workers
    # deselect them and the summary leaves them out, so this line is where a run says so)
    return "gpu-marked tests: deselected, not skipped (no CUDA/ROCm device)"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Without a CUDA/ROCm device the ``gpu``-marked tests are deselected, not skipped: no skip
    line each (a serial run's summary counts them in one number, "N deselected"). With a device
    (and without ``TRITON_INTERPRET=1``) the ``interpret``-marked tests are deselected instead:
    they hand the Triton kernels CPU tensors, which only the interpreter runs (the GPU tests
    cover the kernels on the device)."""
    if torch.cuda.is_available():
        if os.environ.get("TRITON_INTERPRET") != "1":
            cpu_only = [item for item in items if "interpret" in item.keywords]
            if cpu_only:
                config.hook.pytest_deselected(items=cpu_only)
                items[:] = [item for item in items if "interpret" not in item.keywords]
        return
    gpu = [item for item in items if "gpu" in item.keywords]
    if gpu:
        config.hook.pytest_deselected(items=gpu)
        items[:] = [item for item in items if "gpu" not in item.keywords]
    if os.environ.get("PYTEST_XDIST_WORKER"):
        heavy_first(items)


def heavy_first(items: list[pytest.Item]) -> None:
    """Under pytest-xdist: the files that hold a ``heavy`` test first, each file's tests (and
    the rest) in their order. ``--dist loadfile`` hands out whole files in this order, so the
    long tests start early and the short ones fill in around them; started last, a minute of
    compiles would run alone on one worker while the others sit idle. (Every worker collects,
    and sorts, the same.)"""
    heavy = {item.path for item in items if item.get_closest_marker("heavy")}
    items.sort(key=lambda item: item.path not in heavy)


# -- CUDA-graph replay on the CPU (tests/test_overhead.py, tests/test_checked_values.py) ------------


class StepGraph:
    """A stand-in for a captured CUDA graph: ``replay()`` runs the captured step again."""

    def __init__(self, step: Callable[[], None]) -> None:
        self.step = step
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        self.step()


@pytest.fixture
def replay_on_cpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[StepGraph]]:
    """Replay allowed on the CPU; every capture recorded (in order) as a :class:`StepGraph`."""
    # (imported here: mla may import triton, which must not come before TRITON_INTERPRET above)
    from mla.engine.functional import decode_graphs, replay_memo
    from mla.engine.functional.plan_cache import DECODE_PLANS

    captured: list[StepGraph] = []

    def capture(step: Callable[[], None], device: torch.device) -> StepGraph:
        captured.append(StepGraph(step))
        return captured[-1]

    monkeypatch.setattr(decode_graphs, "device_allows_replay", lambda q: True)
    monkeypatch.setattr(decode_graphs, "capture", capture)
    DECODE_PLANS.clear()
    replay_memo.RECORDS.clear()
    yield captured
    DECODE_PLANS.clear()
    replay_memo.RECORDS.clear()


@pytest.fixture
def cuobjdump() -> str:
    """The path of the ``cuobjdump`` that Triton's NVIDIA backend ships (register, stack and SASS
    readings of kernels compiled for sm_90 on a CPU); skips without one."""
    import triton  # (after TRITON_INTERPRET above)

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(path):
        pytest.skip("this Triton build ships no cuobjdump")
    return path
