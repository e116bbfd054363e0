"""The mbarrier protocol of the ``fp8_ds_mla`` 64-row kernel
(:mod:`mla.providers.gluon.ds_mla_heads`) as a model run under random interleavings on the CPU: no
partition waits forever, and no wait is served by a phase other than the one it waits for (an
mbarrier wait names only a phase's parity, so a barrier two phases ahead of a waiter would block
it, three ahead would let it through early).

Each partition (producer, scores and output warpgroups) is the sequence of its waits and
arrivals, transcribed from the kernel. A change to the kernel's waits or arrivals belongs here
too.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from mbarrier_model import Barrier, Op, run

# -- ds_mla_heads ------------------------------------------------------------------------------


def heads_producer(n: int) -> Iterator[Op]:
    """Tile ``t + 1``'s halves are copied into the slot of tile ``t - 1`` after this tile's chunk
    1 and chunk 3 (each half once its warpgroup freed it); the rope lanes travel in chunk 3's
    commit group, which the producer waits for itself before its arrival."""
    if n > 0:
        yield ("wait", "empty0.0", 0)
        yield ("wait", "empty0.1", 0)
    for t in range(n):
        s, u, i = t % 2, (t + 1) % 2, (t + 1) // 2
        yield ("arrive", f"ready{s}.0", 0)
        yield ("arrive", f"ready{s}.1", 0)
        if t + 1 < n:
            yield ("wait", f"empty{u}.0", i)
        yield ("arrive", f"ready{s}.2", 0)
        yield ("arrive", f"ready{s}.3", 0)
        if t + 1 < n:
            yield ("wait", f"empty{u}.1", i)


def heads_scores(n: int) -> Iterator[Op]:
    for t in range(n):
        for c in range(4):
            yield ("wait", f"ready{t % 2}.{c}", t // 2)
        yield ("wait", "p_free", t)
        yield ("arrive", "p_ready", 0)
        yield ("arrive", f"empty{t % 2}.0", 0)
    yield ("arrive", "done", 0)


def heads_output(n: int) -> Iterator[Op]:
    for t in range(n):
        yield ("wait", "p_ready", t)
        yield ("arrive", "p_free", 0)
        yield ("arrive", f"empty{t % 2}.1", 0)
    yield ("wait", "done", 0)


def heads_barriers() -> dict[str, Barrier]:
    bars = {f"ready{s}.{c}": Barrier() for s in range(2) for c in range(4)}
    bars |= {f"empty{s}.{h}": Barrier() for s in range(2) for h in range(2)}
    bars |= {"p_ready": Barrier(), "p_free": Barrier(), "done": Barrier()}
    for name in [*(f"empty{s}.{h}" for s in range(2) for h in range(2)), "p_free"]:
        bars[name].arrive()  # free at the start: the kernel's pre-arrivals complete phase 0
    return bars


@pytest.mark.parametrize("tiles", [0, 1, 2, 3, 5, 8])
def test_ds_mla_heads_protocol_completes(tiles: int) -> None:
    for seed in range(200):
        partitions = {
            "producer": heads_producer(tiles),
            "scores": heads_scores(tiles),
            "output": heads_output(tiles),
        }
        run(partitions, heads_barriers(), seed)


def test_the_model_finds_an_overrun_and_a_missing_free() -> None:
    """The model's own check: a producer that fills a slot before its readers freed it (no wait
    for ``empty``) is caught, and so is a scores warpgroup that never frees ``P``."""

    def eager_producer(n: int) -> Iterator[Op]:
        for op in heads_producer(n):
            if op[0] != "wait":
                yield op

    def output_without_free(n: int) -> Iterator[Op]:
        for op in heads_output(n):
            if op[1] != "p_free":
                yield op

    # (the eager producer overruns the ring: in the interleavings where it runs ahead a wait finds
    # its barrier two or three phases on: blocked for good, or served by a later phase)
    caught = []
    for seed in range(20):
        try:
            run({"producer": eager_producer(5), "scores": heads_scores(5),
                 "output": heads_output(5)}, heads_barriers(), seed)  # fmt: skip
        except AssertionError as error:
            caught.append(str(error))
    assert caught
    with pytest.raises(AssertionError, match="deadlock"):
        run({"producer": heads_producer(3), "scores": heads_scores(3),
             "output": output_without_free(3)}, heads_barriers(), 0)  # fmt: skip
