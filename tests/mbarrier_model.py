"""A model of mbarrier protocols run under random interleavings on the CPU, for the tests of the
Gluon kernels' partitions: no partition waits forever, and no wait is served by a phase other
than the one it waits for (an mbarrier wait names only a phase's parity, so a barrier two phases
ahead of a waiter would block it, three ahead would let it through early).

Each partition is the sequence of its waits and arrivals (:data:`Op`), transcribed from a
kernel; a TMA or ``cp.async`` completion is an arrival of the partition that issued it.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

Op = tuple[str, str, int]
"""``("wait", barrier, i)``: wait for the barrier's ``i``-th completed phase (0-based);
``("arrive", barrier, 0)``."""


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
        else:
            barriers[bar].arrive()
        current[name] = next(partitions[name], None)
