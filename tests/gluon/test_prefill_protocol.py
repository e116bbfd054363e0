"""The barrier protocol of the persistent Gluon prefill kernel
(:mod:`mla.providers.gluon.prefill_persistent`) as a model run under random interleavings on the
CPU.

The producer and the two consumer warpgroups are generators that yield what they wait for;
barriers follow mbarrier semantics (arrival counts, transaction bytes, ``try_wait.parity``: a
wait for parity ``P`` passes once the phase of that parity has completed), TMA copies land at
random later steps, and a random scheduler interleaves everything. Over random query-tile
sequences (0-6 key tiles each, masked tails) it checks: no deadlock, every consumer read sees
the tile it expects (query buffer and ring slots), and no copy overwrites a buffer a consumer
still reads. Each consumer frees the query buffer right after its last ``QKᵀ`` of the tile
(:func:`mla.providers.gluon.prefill_parts._release_scores`), before that tile's ``P·V`` and the
epilogue. A change to the kernel's waits or arrivals belongs here too.
"""

from __future__ import annotations

import random

import pytest


class Bar:
    """An mbarrier: ``count`` arrivals and the expected transaction bytes complete a phase."""

    def __init__(self, count: int) -> None:
        self.count, self.pending, self.tx, self.phase = count, count, 0, 0

    def arrive(self, n: int = 1) -> None:
        self.pending -= n
        assert self.pending >= 0, "too many arrivals"
        self._maybe_flip()

    def expect(self, nbytes: int) -> None:
        self.tx += nbytes
        self.arrive(1)

    def land(self, nbytes: int) -> None:
        self.tx -= nbytes
        self._maybe_flip()

    def _maybe_flip(self) -> None:
        if self.pending == 0 and self.tx == 0:
            self.phase += 1
            self.pending = self.count

    def done(self, parity: int) -> bool:
        """``try_wait.parity``: whether the phase of this parity has completed."""
        return (self.phase & 1) != parity


def run(tiles_per_program: list[tuple[int, int]], NS: int, seed: int, early: int = 0) -> int:
    """One program's query tiles (``(n_tiles, n_full)`` each) through a ring of ``NS`` slots
    under the scheduler of ``seed``; the steps it took. ``early``: the consumers free the query
    buffer that many key tiles before their last ``QKᵀ`` (0: as the kernel does)."""
    rng = random.Random(seed)
    q_bar, q_empty, v_landed = Bar(1), Bar(2), Bar(1)
    k_ready = [Bar(1) for _ in range(NS)]
    v_ready = [Bar(1) for _ in range(NS)]
    k_empty = [Bar(2) for _ in range(NS)]
    v_empty = [Bar(2) for _ in range(NS)]
    q_empty.arrive(2)
    for i in range(NS):
        k_empty[i].arrive(2)
        v_empty[i].arrive(2)
    mem: dict[object, object] = {"q": None}
    for i in range(NS):
        mem[("k", i)] = None
        mem[("v", i)] = None
    inflight = []  # (bar, nbytes, buffer key, value)
    in_use = {}  # buffer key -> set of consumers using it

    def tma(bar, key, value):
        assert not in_use.get(key), f"TMA overwrites {key} while in use by {in_use.get(key)}"
        bar.expect(1)
        inflight.append((bar, key, value))

    def producer():
        g = done = cleaned = 0
        for tile, (n_tiles, n_full) in enumerate(tiles_per_program):
            yield lambda d=done: q_empty.done(d & 1)
            tma(q_bar, "q", tile)
            for t in range(n_tiles):
                s, ph = (g + t) % NS, ((g + t) // NS) & 1
                yield lambda s=s, ph=ph: k_empty[s].done(ph)
                tma(k_ready[s], ("k", s), (tile, t))
                yield lambda s=s, ph=ph: v_empty[s].done(ph)
                if t >= n_full:
                    tma(v_landed, ("v", s), (tile, t))
                    yield lambda c=cleaned: v_landed.done(c & 1)
                    v_ready[s].arrive()
                    cleaned += 1
                else:
                    tma(v_ready[s], ("v", s), (tile, t))
            g += n_tiles
            done += 1  # noqa: SIM113 (the kernel's counter)

    def consumer(w):
        g = done = 0
        for tile, (n_tiles, n_full) in enumerate(tiles_per_program):
            yield lambda d=done: q_bar.done(d & 1)
            assert mem["q"] == tile, (w, "q", mem["q"], tile)
            in_use.setdefault("q", set()).add(w)
            for t in range(n_tiles):
                s, ph = (g + t) % NS, ((g + t) // NS) & 1
                yield lambda s=s, ph=ph: k_ready[s].done(ph)
                assert mem[("k", s)] == (tile, t), (w, "k", mem[("k", s)], tile, t)
                in_use.setdefault(("k", s), set()).add(w)
                yield None  # the MMA runs
                if t >= n_full:
                    yield lambda s=s, ph=ph: v_ready[s].done(ph)
                assert mem["q"] == tile
                in_use[("k", s)].discard(w)
                k_empty[s].arrive()
                if t == n_tiles - 1 - early:  # the tile's last QKᵀ: the query buffer is free
                    in_use["q"].discard(w)
                    q_empty.arrive()
                yield lambda s=s, ph=ph: v_ready[s].done(ph)
                assert mem[("v", s)] == (tile, t), (w, "v", mem[("v", s)], tile, t)
                in_use.setdefault(("v", s), set()).add(w)
                yield None
                in_use[("v", s)].discard(w)
                v_empty[s].arrive()
            if n_tiles <= early:
                in_use["q"].discard(w)
                q_empty.arrive()
            yield None  # epilogue
            g += n_tiles
            done += 1  # noqa: SIM113 (the kernel's counter)

    agents = {"P": producer(), "C0": consumer(0), "C1": consumer(1)}
    waiting = dict.fromkeys(agents)
    steps = 0
    while agents or inflight:
        runnable = [n for n in agents if waiting[n] is None or waiting[n]()]
        choices = runnable + (["tma"] if inflight else [])
        if not choices:
            raise RuntimeError(f"deadlock: {list(agents)}")
        pick = rng.choice(choices)
        if pick == "tma":
            bar, key, value = inflight.pop(rng.randrange(len(inflight)))
            mem[key] = value
            bar.land(1)
            continue
        try:
            waiting[pick] = next(agents[pick])
        except StopIteration:
            del agents[pick]
        steps += 1
    return steps


def _tiles(seed: int) -> tuple[list[tuple[int, int]], int]:
    rng = random.Random(seed)
    tiles = []
    for _ in range(rng.randint(1, 5)):
        n = rng.randint(0, 6)
        tiles.append((n, rng.randint(0, n)))
    return tiles, rng.choice([2, 3])


@pytest.mark.parametrize("block", range(6))
def test_the_persistent_prefill_protocol_never_deadlocks_or_reads_stale_tiles(block: int) -> None:
    for seed in range(500 * block, 500 * (block + 1)):
        tiles, stages = _tiles(seed)
        run(tiles, stages, seed)


def test_freeing_the_query_buffer_before_the_last_qk_is_caught() -> None:
    """The model is not blind to a release one tile too early: the producer's next query tile
    then overwrites the buffer while a consumer's last ``QKᵀ`` still reads it."""
    caught = 0
    for seed in range(500):
        tiles, stages = _tiles(seed)
        try:
            run([(max(n, 2), f) for n, f in tiles], stages, seed, early=1)
        except AssertionError:
            caught += 1
    assert caught > 0
