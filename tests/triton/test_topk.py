"""The Triton threshold top-k (:func:`mla.providers.triton.topk.radix_topk`) against ``torch.topk``.

Interpreter tests (``interpret``; on a GPU the same tests run compiled): rows split across
programs (small tiles and splits, so that rows cross tile and split boundaries), the candidate
path and the full-row fallback of the finish pass (a tiny candidate buffer), ties (which
positions win, deterministically), ``-inf`` rows and rows with fewer selectable scores than
``k``, visible lengths, ``+inf`` and outliers that squeeze the bins, and DeepSeek's ``k = 2048``
over 8192 positions. Each row's selection is compared as a set with ``torch.topk``'s (exactly
when the row has no ties, by its sorted scores otherwise).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from mla.core.errors import InvalidInputError
from mla.providers.triton.topk import TopkConfig, radix_topk, row_range, topk_config

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SMALL = TopkConfig(split=256, block=128)
"""Rows of a few hundred positions cross tiles and splits."""


def run_topk(
    scores: torch.Tensor,
    k: int,
    *,
    width: int | None = None,
    lengths: torch.Tensor | None = None,
    config: TopkConfig = SMALL,
) -> torch.Tensor:
    out = torch.full((scores.shape[0], width or k), 12345, dtype=torch.int32, device=DEVICE)
    radix_topk(
        scores.to(DEVICE),
        out,
        k=k,
        lengths=None if lengths is None else lengths.to(DEVICE),
        config=config,
    )
    return out.cpu()


def assert_topk(out: torch.Tensor, scores: torch.Tensor, k: int, lengths: torch.Tensor | None = None) -> None:
    """Per row: ``min(k, selectable)`` distinct positions of the top scores, then ``-1``; the same
    set as ``torch.topk`` when the row's scores are distinct."""
    for t in range(scores.shape[0]):
        visible = scores.shape[1] if lengths is None else min(int(lengths[t]), scores.shape[1])
        row = scores[t, :visible]
        selectable = row > float("-inf")
        count = min(k, int(selectable.sum()))
        got = out[t]
        assert bool((got[count:] == -1).all()), f"row {t}: -1 padding after {count} positions"
        chosen = got[:count].long()
        assert bool(((chosen >= 0) & (chosen < visible)).all()), f"row {t}: {chosen.tolist()}"
        assert chosen.unique().numel() == count, f"row {t}: repeated positions"
        want = torch.topk(torch.where(selectable, row, float("-inf")), count)
        if row.unique().numel() == row.numel():
            assert set(chosen.tolist()) == set(want.indices.tolist()), f"row {t}"
        else:
            assert torch.equal(row[chosen].sort(descending=True).values, want.values), f"row {t}"


FINISH_PATHS = {
    "in-registers": {"cand_cap": 4096},
    "in-registers-1-bit": {"cand_cap": 4096, "finish_bits": 1},
    "in-registers-8-bits": {"cand_cap": 4096, "finish_bits": 8},
    "candidate-passes": {"cand_cap": 4096, "finish_tile": 16},
    "full-row-fallback": {"cand_cap": 3},
}
"""The finish pass's three sources: candidates held in registers (selected 4, 1 or 8 key bits a
pass), candidates re-read a pass (more than ``finish_tile``), the row itself (more than
``cand_cap``)."""


@pytest.mark.interpret
@pytest.mark.parametrize("bins", [2, 64, 256], ids=lambda b: f"{b}-bins")
@pytest.mark.parametrize("finish", list(FINISH_PATHS))
def test_distinct_scores_match_torch_topk(finish: str, bins: int) -> None:
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(3, 700, generator=gen)
    scores[1] = scores[1] * 1e-3 + 100.0  # a narrow range far from zero
    scores[2, 5] = 1e30  # an outlier squeezes the other scores into one bin
    config = TopkConfig(split=256, block=128, bins=bins, **FINISH_PATHS[finish])
    for k in (1, 50, 699):
        assert_topk(run_topk(scores, k, config=config), scores, k)


@pytest.mark.interpret
@pytest.mark.parametrize("finish", list(FINISH_PATHS))
def test_ties_take_the_lowest_positions(finish: str) -> None:
    """Integer scores tie in large groups; the tied positions taken are the lowest ones, so
    two runs agree."""
    gen = torch.Generator().manual_seed(1)
    scores = torch.randint(0, 5, (3, 600), generator=gen).float()
    scores[2] = 1.0  # one big tie
    config = TopkConfig(split=256, block=128, **FINISH_PATHS[finish])
    out = run_topk(scores, 100, config=config)
    assert_topk(out, scores, 100)
    assert torch.equal(out, run_topk(scores, 100, config=config))
    for t in range(3):
        row = scores[t]
        chosen = out[t].long()
        threshold = row[chosen].min()
        ties = (row == threshold).nonzero().flatten()
        taken = chosen[row[chosen] == threshold].sort().values
        assert torch.equal(taken, ties[: taken.numel()]), f"row {t}"
    assert torch.equal(out[2].sort().values, torch.arange(100, dtype=torch.int32))


@pytest.mark.interpret
def test_invisible_positions_become_minus_one() -> None:
    """``-inf`` scores are never chosen; a row with fewer selectable scores than ``k`` pads with
    ``-1`` (so does the width past ``k``); ``+inf`` is chosen first."""
    gen = torch.Generator().manual_seed(2)
    scores = torch.randn(5, 600, generator=gen)
    scores[1] = float("-inf")
    scores[2, 10:] = float("-inf")
    scores[3, ::2] = float("-inf")
    scores[4, 7] = float("inf")
    out = run_topk(scores, 100, width=120)
    assert_topk(out, scores, 100)
    assert bool((out[1] == -1).all())
    assert sorted(out[2, :10].tolist()) == list(range(10))
    assert 7 in out[4].tolist()


@pytest.mark.interpret
def test_lengths_limit_the_columns() -> None:
    """Only columns below ``lengths[t]`` count, whatever the others hold (a causal prefill)."""
    gen = torch.Generator().manual_seed(3)
    scores = torch.randn(4, 600, generator=gen)
    lengths = torch.tensor([0, 5, 300, 900], dtype=torch.int32)
    out = run_topk(scores, 64, lengths=lengths)
    assert_topk(out, scores, 64, lengths)
    assert bool((out[0] == -1).all())


@pytest.mark.interpret
def test_deepseek_topk_2048_of_8192() -> None:
    """``k = 2048`` over 8192 positions with the default tiles (1024 scores), two splits a row."""
    gen = torch.Generator().manual_seed(4)
    scores = torch.randn(2, 8192, generator=gen)
    out = run_topk(scores, 2048, config=TopkConfig(split=4096, block=1024))
    assert_topk(out, scores, 2048)


@pytest.mark.interpret
def test_given_ranges_match_computed_ones() -> None:
    """The per-split (min, max) the range pass writes are what the indexer's scores kernel
    hands over instead; a coarser set of parts gives the same selection."""
    gen = torch.Generator().manual_seed(5)
    scores = torch.randn(2, 512, generator=gen).to(DEVICE)
    stats = row_range(scores, lengths=None, config=SMALL)
    assert tuple(stats.shape) == (2, 2, 2)
    torch.testing.assert_close(stats[0].min(dim=1).values.cpu(), scores.min(dim=1).values.cpu())
    torch.testing.assert_close(stats[1].max(dim=1).values.cpu(), scores.max(dim=1).values.cpu())
    whole = torch.stack([stats[0].min(dim=1, keepdim=True).values, stats[1].max(dim=1, keepdim=True).values])
    out = torch.empty(2, 40, dtype=torch.int32, device=DEVICE)
    radix_topk(scores, out, k=40, stats=whole, config=SMALL)
    assert_topk(out.cpu(), scores.cpu(), 40)


def test_topk_config_splits_only_few_rows() -> None:
    assert topk_config(rows=8192, max_keys=8192, num_sms=132).split == 8192
    decode = topk_config(rows=64, max_keys=32768, num_sms=132)
    assert decode.split == 4096  # 8 splits: 512 programs
    assert decode.finish_warps == 8
    assert decode.finish_bits == 6
    assert topk_config(rows=8192, max_keys=8192, num_sms=132).finish_bits == 4
    assert topk_config(rows=1, max_keys=100, num_sms=132).split == 1024  # never below one tile


def test_radix_topk_rejects_bad_arguments() -> None:
    scores = torch.zeros(2, 10)
    with pytest.raises(InvalidInputError, match="out"):
        radix_topk(scores, torch.empty(2, 4, dtype=torch.int32), k=5)
    with pytest.raises(InvalidInputError, match="config"):
        radix_topk(scores, torch.empty(2, 4, dtype=torch.int32), k=4, config=TopkConfig(split=100, block=64))
    out = torch.empty(2, 4, dtype=torch.int32)
    for bins in (1, 48, 512):
        with pytest.raises(InvalidInputError, match="bins"):
            radix_topk(scores, out, k=4, config=TopkConfig(split=1024, bins=bins))
    with pytest.raises(InvalidInputError, match="finish_tile"):
        radix_topk(scores, out, k=4, config=TopkConfig(split=1024, finish_tile=24))
    for bits in (0, 9):
        with pytest.raises(InvalidInputError, match="finish_bits"):
            radix_topk(scores, out, k=4, config=TopkConfig(split=1024, finish_bits=bits))
