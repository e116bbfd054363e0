"""Sparse MLA (DeepSeek Sparse Attention) under decode context parallelism on gloo processes.

Each rank selects over its own shard and the LSE combine merges the shards, so the result is
sparse attention over the union of the per-rank selections (``dcp_sparse_harness``).
"""

from __future__ import annotations

from pathlib import Path

import dcp_sparse_harness as harness
import pytest
import torch

from mla.distributed import DCPLayout

Case = harness.Case

TWO_RANKS = [
    Case("float32", 4, 1, 1, split_heads=True),
    Case("bf16", 4, 2, 2, split_heads=False),
    Case("fp8_ds_mla", 8, 1, 3, split_heads=True),
    Case("float32", 1, 2, 3, split_heads=False),
    Case("bf16", 8, 1, 1, split_heads=True),
    Case("fp8_ds_mla", 4, 2, 2, split_heads=False),
]
"""Between the two 2-rank groups: every cache format with interleave 1 and 2, qlen 1 to 3, both
head modes."""

FOUR_RANKS = [
    Case("float32", 4, 2, 2, split_heads=True),
    Case("fp8_ds_mla", 4, 1, 1, split_heads=False),
    Case("bf16", 1, 1, 3, split_heads=True),
]


def test_global_position_inverts_local_position() -> None:
    positions = torch.arange(200)
    for world, interleave in ((1, 1), (2, 1), (3, 2), (4, 16)):
        for rank in range(world):
            layout = DCPLayout(world, rank, interleave)
            mine = positions[layout.owner(positions) == rank]
            assert torch.equal(layout.global_position(layout.local_position(mine)), mine)


@pytest.mark.heavy
def test_sparse_dcp_matches_the_union_reference_on_gloo(tmp_path: Path) -> None:
    """Four gloo processes, as two 2-rank groups then one 4-rank group: every rank checks its
    indexer's selection over its shard, the combined sparse decode (decode and verify rows,
    graph padding, requests shorter than the group) against the float64 sparse reference over
    the union of the ranks' selections, and a step through MLAAttention against the
    single-process layer given that union; a step with a prefill is refused."""
    harness.spawn(4, [(2, TWO_RANKS), (4, FOUR_RANKS)], str(tmp_path))
