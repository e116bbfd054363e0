"""The host-overhead benchmark runs on a CPU (its smoke mode): every row it prints is there and
timed, the README-style calls included (the GPU numbers are the performance page's)."""

from __future__ import annotations

from benchmarks.overhead import prefill_row, run_shape


def test_overhead_rows_run_on_the_cpu() -> None:
    row, counts = run_shape(
        batch=1, block=16, heads=2, seq_len=32, rank=64, rope=16, device="cpu", provider="torch", graph="off"
    )
    counts()  # (after the timings: the benchmark runs every shape's counts last)
    assert row["call ops"] > 0
    for key in ("kernel us", "call us", "plain call us", "plain overhead us", "build us"):
        assert row[key] > 0 or key.endswith("overhead us"), (key, row)
    prefill = prefill_row(device="cpu", provider="torch", gpu=False)
    assert prefill["kernel us"] > 0
    assert prefill["plain call us"] > 0
    assert prefill["forward_prefill us"] > 0
