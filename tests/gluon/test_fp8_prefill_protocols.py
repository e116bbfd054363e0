"""The mbarrier protocol of the Gluon fp8 prefill's persistent layout
(:mod:`mla.providers.gluon.prefill_fp8_persistent`) as a model (:mod:`mbarrier_model`) run under
random interleavings on the CPU, over a program's sequence of query tiles, some without key
tiles (rows that see no key: a request without keys, causal rows before the first key).

The producer issues key tile ``t``'s K and V (ring tile ``g + t``), transposes V of key tile
``t - 1`` and, after the first key tile's loads, loads the query tile once both consumer
warpgroups released the previous one (``q_empty``); each query tile's last V is transposed
before the next query tile starts (``split._produce_key_tiles``). Each consumer warpgroup waits
for the query tile (``q_bar``), per key tile for K, releases it (and, at the query tile's last,
the query buffer), waits for V^T and releases it; a query tile without key tiles releases the
buffer at once. The split layout is the one-query-tile case. A change to the kernels' waits or
arrivals belongs here too.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
from mbarrier_model import Barrier, Op, run

V_LANDING = 2


def producer(tiles: list[int], stages: int, *, carry_last_transpose: bool = False) -> Iterator[Op]:
    """The producer partition over query tiles of ``tiles[i]`` key tiles each.
    ``carry_last_transpose``: a query tile's last V transposed only after the next key tile's
    loads (the first form of the layout, which could deadlock)."""
    g = 0
    transposed = -1  # the last ring tile whose V was transposed

    def transpose(u: int) -> Iterator[Op]:
        nonlocal transposed
        assert u == transposed + 1, "V tiles transposed out of order"
        yield ("wait", f"v_landed{u % V_LANDING}", u // V_LANDING)
        yield ("wait", f"vt_empty{u % stages}", u // stages)
        yield ("arrive", f"vt_ready{u % stages}", 0)
        transposed = u

    for done, n in enumerate(tiles):
        # the fixed form: steps 0..n, transposing key tile t - 1 at step t; the carried form:
        # steps 0..n-1, transposing ring tile g + t - 1 (at t = 0 the previous query tile's last)
        for t in range(n if carry_last_transpose else n + 1):
            if t < n:
                j = g + t
                # (V's landing slot was last read by the transpose of ring tile j - V_LANDING)
                assert transposed >= j - V_LANDING, "a V landing slot reused before its transpose"
                yield ("wait", f"k_empty{j % stages}", j // stages)
                yield ("arrive", f"k_ready{j % stages}", 0)
                yield ("arrive", f"v_landed{j % V_LANDING}", 0)
            if (carry_last_transpose and g + t > 0) or t > 0:
                yield from transpose(g + t - 1)
            if t == 0:
                yield ("wait", "q_empty", done)
                yield ("arrive", "q_bar", 0)
        if carry_last_transpose and n == 0:
            yield ("wait", "q_empty", done)
            yield ("arrive", "q_bar", 0)
        g += n
    if transposed < g - 1:
        yield from transpose(g - 1)


def consumer(tiles: list[int], stages: int) -> Iterator[Op]:
    """A consumer warpgroup over the same query tiles."""
    g = 0
    for done, n in enumerate(tiles):
        yield ("wait", "q_bar", done)
        for t in range(n):
            j = g + t
            yield ("wait", f"k_ready{j % stages}", j // stages)
            yield ("arrive", f"k_empty{j % stages}", 0)
            if t == n - 1:
                yield ("arrive", "q_empty", 0)
            yield ("wait", f"vt_ready{j % stages}", j // stages)
            yield ("arrive", f"vt_empty{j % stages}", 0)
        if n == 0:
            yield ("arrive", "q_empty", 0)
        g += n


def barriers(stages: int) -> dict[str, Barrier]:
    bars = {"q_bar": Barrier(), "q_empty": Barrier(2)}
    bars |= {f"v_landed{i}": Barrier() for i in range(V_LANDING)}
    for s in range(stages):
        bars |= {f"k_ready{s}": Barrier(), f"vt_ready{s}": Barrier()}
        bars |= {f"k_empty{s}": Barrier(2), f"vt_empty{s}": Barrier(2)}
    # free at the start: the kernel's pre-arrivals complete phase 0
    for name in ["q_empty", *(f"{kind}{s}" for kind in ("k_empty", "vt_empty") for s in range(stages))]:
        bars[name].arrive()
        bars[name].arrive()
    return bars


def partitions(tiles: list[int], stages: int, **producer_options: bool) -> dict[str, Iterator[Op]]:
    return {
        "producer": producer(tiles, stages, **producer_options),
        "consumer0": consumer(tiles, stages),
        "consumer1": consumer(tiles, stages),
    }


TILE_SEQUENCES = {
    "one": [5],
    "split-layout-empty": [0],
    "two": [3, 1],
    "empty-between": [3, 0, 2],
    "empties-in-a-row": [3, 0, 0, 2],
    "empties-at-the-end": [2, 0, 0],
    "empties-first": [0, 0, 4],
    "short-ones": [1, 1, 1, 1, 1],
}


@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("sequence", sorted(TILE_SEQUENCES))
def test_fp8_persistent_protocol_completes(sequence: str, stages: int) -> None:
    for seed in range(100):
        run(partitions(TILE_SEQUENCES[sequence], stages), barriers(stages), seed)


def test_random_query_tile_sequences_complete() -> None:
    rng = random.Random(0)
    for seed in range(300):
        tiles = [rng.choice([0, 0, 1, 2, 3, 6]) for _ in range(rng.randint(1, 7))]
        stages = rng.choice([2, 3, 4])
        run(partitions(tiles, stages), barriers(stages), seed)


def test_a_last_transpose_carried_to_the_next_query_tile_deadlocks() -> None:
    """The layout's first form transposed a query tile's last V only after the next key tile's
    loads: the consumers wait for that V while the producer, at a second query tile in a row
    without key tiles, waits for their release of the query buffer (GPU tests hung on it)."""
    with pytest.raises(AssertionError, match="deadlock"):
        run(partitions([3, 0, 0, 2], 4, carry_last_transpose=True), barriers(4), 0)
    # (with key tiles in every query tile it completes)
    for seed in range(50):
        run(partitions([3, 2, 4], 4, carry_last_transpose=True), barriers(4), seed)
