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

import random
from collections.abc import Iterator

import pytest

Op = tuple[str, str, int]
"""``("wait", barrier, i)``: wait for the barrier's ``i``-th completed phase (0-based);
``("arrive", barrier, 0)``; ``("inc", barrier, i)``: a ``cp.async`` arrival counted on the
barrier's phase ``i`` (it adds to that phase's expected arrivals and completes later: it needs
the barrier to be in phase ``i`` when issued)."""


class Barrier:
    """An mbarrier: ``count`` arrivals complete a phase."""

    def __init__(self, count: int = 1) -> None:
        self.count, self.pending, self.completed = count, 0, 0

    def arrive(self) -> None:
        self.pending += 1
        if self.pending == self.count:
            self.pending, self.completed = 0, self.completed + 1

    def passes(self, phase: int) -> bool:
        """Whether a wait for phase ``phase`` (its parity) returns now."""
        return self.completed % 2 != phase % 2


def run(partitions: dict[str, Iterator[Op]], barriers: dict[str, Barrier], seed: int) -> None:
    """Run the partitions in a random interleaving until all finish; fail on a deadlock or a wait
    served by the wrong phase."""
    rng = random.Random(seed)
    current: dict[str, Op | None] = {name: next(ops, None) for name, ops in partitions.items()}
    while any(op is not None for op in current.values()):
        runnable = [
            name for name, op in current.items()
            if op is not None and (op[0] != "wait" or barriers[op[1]].passes(op[2]))
        ]  # fmt: skip
        assert runnable, f"deadlock: {current} {[(n, b.completed) for n, b in barriers.items()]}"
        name = rng.choice(runnable)
        kind, bar, phase = current[name]  # type: ignore[misc]
        if kind == "wait":
            assert barriers[bar].completed == phase + 1, f"{name}: {bar} phase {phase} served by a later one"
        elif kind == "inc":
            assert barriers[bar].completed == phase, f"{name}: {bar} counted on a later phase"
        else:
            barriers[bar].arrive()
        current[name] = next(partitions[name], None)


# -- ds_mla_heads ------------------------------------------------------------------------------


def heads_producer(n: int) -> Iterator[Op]:
    for t in range(n):
        s, i = t % 2, t // 2
        yield ("wait", f"empty{s}.0", i)
        yield ("arrive", f"ready{s}.0", 0)
        yield ("arrive", f"ready{s}.1", 0)
        yield ("wait", f"empty{s}.1", i)
        yield ("inc", f"ready{s}.3", i)  # the rope copies
        yield ("arrive", f"ready{s}.2", 0)
        yield ("arrive", f"ready{s}.3", 0)


def heads_staged_producer(n: int) -> Iterator[Op]:
    """The staged producer (``STAGED``): tile ``t + 1``'s halves are copied into the slot of tile
    ``t - 1`` after this tile's chunk 1 and chunk 3 (the rope lanes in chunk 3's commit group,
    which the producer waits for itself: no ``cp.async`` arrival)."""
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


PRODUCERS = {"registers": heads_producer, "staged": heads_staged_producer}


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


@pytest.mark.parametrize("producer", PRODUCERS)
@pytest.mark.parametrize("tiles", [0, 1, 2, 3, 5, 8])
def test_ds_mla_heads_protocol_completes(tiles: int, producer: str) -> None:
    for seed in range(200):
        partitions = {
            "producer": PRODUCERS[producer](tiles),
            "scores": heads_scores(tiles),
            "output": heads_output(tiles),
        }
        run(partitions, heads_barriers(), seed)


@pytest.mark.parametrize("producer", PRODUCERS)
def test_the_model_finds_an_overrun_and_a_missing_free(producer: str) -> None:
    """The model's own check: a producer that fills a slot before its readers freed it (no wait
    for ``empty``) is caught, and so is a scores warpgroup that never frees ``P``."""

    def eager_producer(n: int) -> Iterator[Op]:
        for op in PRODUCERS[producer](n):
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
        run({"producer": PRODUCERS[producer](3), "scores": heads_scores(3),
             "output": output_without_free(3)}, heads_barriers(), 0)  # fmt: skip


# -- ds_mla_rows, staged producer ---------------------------------------------------------------


def rows_staged_producer(n: int, *, issue_mid_tile: bool) -> Iterator[Op]:
    """The staged producer of :mod:`mla.providers.gluon.ds_mla_rows` (``STAGED``): tile ``t + 1``
    into the tiles of ``t - 1`` once the MMA freed both, after tile ``t``'s first two chunks
    (``issue_mid_tile``, without ``OVERLAP``) or after tile ``t``'s announcement (``OVERLAP``)."""
    if n > 0:
        yield ("wait", "wide_free0", 0)
        yield ("wait", "rope_free0", 0)

    def issue_next(t: int) -> Iterator[Op]:
        if t + 1 < n:
            u, i = (t + 1) % 2, (t + 1) // 2
            yield ("wait", f"wide_free{u}", i)
            yield ("wait", f"rope_free{u}", i)

    for t in range(n):
        if issue_mid_tile:
            yield from issue_next(t)
        yield ("arrive", f"wide_ready{t % 2}", 0)
        if not issue_mid_tile:
            yield from issue_next(t)


def rows_mma(n: int, *, overlap: bool) -> Iterator[Op]:
    """The MMA warpgroup of :mod:`mla.providers.gluon.ds_mla_rows` with two bf16 and two rope
    tiles: serial, or with ``OVERLAP`` (tile ``t``'s bf16 tile freed once tile ``t + 1``'s
    ``QKᵀ`` is in flight)."""
    if not overlap:
        for t in range(n):
            yield ("wait", f"wide_ready{t % 2}", t // 2)
            yield ("arrive", f"rope_free{t % 2}", 0)
            yield ("arrive", f"wide_free{t % 2}", 0)
        return
    if n > 0:
        yield ("wait", "wide_ready0", 0)
        yield ("arrive", "rope_free0", 0)
        for t in range(n - 1):
            yield ("wait", f"wide_ready{(t + 1) % 2}", (t + 1) // 2)
            yield ("arrive", f"wide_free{t % 2}", 0)
            yield ("arrive", f"rope_free{(t + 1) % 2}", 0)
        yield ("arrive", f"wide_free{(n - 1) % 2}", 0)


def rows_barriers() -> dict[str, Barrier]:
    bars = {f"{name}{w}": Barrier() for name in ("wide_ready", "wide_free", "rope_free") for w in range(2)}
    for w in range(2):
        bars[f"wide_free{w}"].arrive()
        bars[f"rope_free{w}"].arrive()
    return bars


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("tiles", [0, 1, 2, 3, 5, 8])
def test_ds_mla_rows_staged_protocol_completes(tiles: int, overlap: bool) -> None:
    """The kernel's pairing: mid-tile issue without ``OVERLAP``, issue after the announcement
    with it."""
    for seed in range(200):
        partitions = {
            "producer": rows_staged_producer(tiles, issue_mid_tile=not overlap),
            "mma": rows_mma(tiles, overlap=overlap),
        }
        run(partitions, rows_barriers(), seed)


def test_a_mid_tile_issue_deadlocks_the_overlapped_mma() -> None:
    """Why the staged producer issues the next tile only after announcing this one under
    ``OVERLAP``: the overlapped MMA frees tile ``t - 1`` only once tile ``t`` is announced."""
    with pytest.raises(AssertionError, match="deadlock"):
        run({"producer": rows_staged_producer(3, issue_mid_tile=True), "mma": rows_mma(3, overlap=True)},
            rows_barriers(), 0)  # fmt: skip
