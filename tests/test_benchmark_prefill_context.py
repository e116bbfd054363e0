"""The chunked-context prefill benchmark's rows on the CPU (tiny shape, torch provider, wall clock)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from benchmarks.prefill_context import ContextShape, context_rows


def _wall_us(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e6


def test_context_rows_check_the_step_and_time_it_with_its_parts_and_the_peer() -> None:
    shape = ContextShape(heads=2, batch=2, new_tokens=5, cached_tokens=70)
    timed: list[Callable[[], Any]] = []

    def timer(fn: Callable[[], Any]) -> float:
        timed.append(fn)
        return _wall_us(fn)

    rows, error = context_rows(shape, timer=timer, device="cpu", provider="torch", rounds=2)
    # the four timed in turn, round after round (each row the median of its rounds)
    assert len(timed) == 8
    assert timed[:4] == timed[4:]
    assert error < 1e-5
    assert [row["impl"] for row in rows] == [
        "chunked-context step",
        "latent gather alone",
        "up-projection alone",
        "attention without context",
    ]
    assert all(row["time_us"] > 0 for row in rows)
    assert rows[0]["x without context"] > 0
    assert math.isnan(rows[1]["TFLOP/s"])
    assert math.isnan(rows[2]["TFLOP/s"])
    assert rows[3]["TFLOP/s"] > 0
