"""The Gluon indexer-scores kernel (:mod:`mla.providers.gluon.index_scores`) on an H100/H200
against the Triton scores kernel: the same scores (``-inf`` in the same places, finite ones to
fp32 rounding of the same fp8 products), the same per-chunk score ranges, and the gluon
provider's ``index_topk`` selecting the same positions as the Triton provider's.

The batches mix what the kernel must mask: rows that see no position, rows whose last position
is inside a tile, several rows of one request (MTP), block ids outside the cache (``-1`` and past
the last block: never read, scored ``-inf``), index head counts that pad the ``wgmma`` N (1, 16,
40, 64, 128), 64- and 128-key cache blocks, and outputs NaN before each call.

Run: ``pytest -m gpu tests/gluon/test_gpu_index_scores.py`` (skipped without a Hopper GPU).
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import pytest
import torch

from mla.providers import get_provider
from mla.providers.calls import IndexTopkCall
from mla.providers.formats import E4M3, quantize_index_keys, quantize_index_queries
from mla.providers.triton.decode import num_sms
from mla.providers.triton.indexer import index_scores, index_scores_config, score_chunk

pytestmark = pytest.mark.gpu

DIM = 128


@pytest.fixture(scope="module", autouse=True)
def _hopper() -> None:
    support = get_provider("gluon").availability()
    if not support:
        pytest.skip(f"the gluon provider is unavailable here: {support}")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon scores kernel runs on sm_90")


def _call(
    rows: int, keys: int, heads: int, block_size: int = 64, requests: int | None = None, seed: int = 0
) -> IndexTopkCall:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    requests = requests or rows
    columns = -(-keys // block_size)
    blocks = requests * columns
    values, scale = quantize_index_keys(torch.randn(blocks * block_size, DIM, generator=gen, device="cuda"))
    cache = torch.empty(blocks, block_size * (DIM + 4), dtype=torch.uint8, device="cuda")
    cache[:, : block_size * DIM] = values.view(torch.uint8).view(blocks, -1)
    cache[:, block_size * DIM :] = scale.view(torch.uint8).view(blocks, -1)
    table = torch.randperm(blocks, generator=gen, device="cuda").to(torch.int32).view(requests, columns)
    table[0, min(1, columns - 1)] = -1
    table[-1, 0] = blocks + 3
    q = torch.randn(rows, heads, DIM, generator=gen, device="cuda")
    w = torch.randn(rows, heads, generator=gen, device="cuda") * heads**-0.5
    q8, w8 = quantize_index_queries(q, w)
    row_keys = torch.randint(1, keys + 1, (rows,), generator=gen, device="cuda").to(torch.int32)
    row_keys[0] = 0
    row_keys[-1] = keys
    return IndexTopkCall(
        q=q8, weights=w8, index_cache=cache.view(blocks, block_size, DIM + 4), key_dtype=E4M3,
        block_table=table,
        row_request=(torch.arange(rows, device="cuda") % requests).to(torch.int32), row_keys=row_keys,
        max_keys=keys, softmax_scale=DIM**-0.5, topk=min(256, keys),
        indices=torch.empty(rows, min(256, keys), dtype=torch.int32, device="cuda"),
    )  # fmt: skip


CASES: dict[str, dict[str, Any]] = {
    "decode-b16-h64": {"rows": 16, "keys": 8192, "heads": 64},
    "mtp-b6-h64-3req": {"rows": 6, "keys": 5000, "heads": 64, "requests": 3},
    "h1": {"rows": 3, "keys": 700, "heads": 1},
    "h16": {"rows": 4, "keys": 1000, "heads": 16},
    "h40-block128": {"rows": 5, "keys": 4100, "heads": 40, "block_size": 128},
    "h128": {"rows": 3, "keys": 3000, "heads": 128},
    "one-row-long": {"rows": 1, "keys": 40000, "heads": 64},
}


@pytest.mark.parametrize("stages", [2, 3, 8])
@pytest.mark.parametrize("case", list(CASES))
def test_gluon_scores_match_the_triton_kernel(case: str, stages: int) -> None:
    from mla.providers.gluon.index_scores import GluonScoresConfig, gluon_index_scores, gluon_scores_route

    call = _call(**CASES[case])
    rows = call.q.shape[0]
    config = index_scores_config(rows=rows, fp8_dot=True)
    config = attrs.evolve(config, chunk=score_chunk(call, config, num_sms(call.q.device)))
    assert gluon_scores_route(call, config, (9, 0))[0]
    chunks = -(-call.max_keys // int(config.chunk or 0))
    want = torch.full((rows, call.max_keys), math.nan, device="cuda")
    got = torch.full_like(want, math.nan)
    want_stats = torch.full((2, rows, chunks), math.nan, device="cuda")
    got_stats = torch.full_like(want_stats, math.nan)
    index_scores(call, want, stats=want_stats, config=config)
    launch = GluonScoresConfig(num_stages=stages)
    gluon_index_scores(call, got, stats=got_stats, config=config, gluon_config=launch)
    assert not got.isnan().any()
    assert not got_stats.isnan().any()
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))
    finite = torch.isfinite(want)
    assert finite.any()
    bound = 1e-5 * float(want[finite].abs().max())
    torch.testing.assert_close(got[finite], want[finite], rtol=0, atol=bound)
    assert torch.equal(torch.isinf(got_stats), torch.isinf(want_stats))
    torch.testing.assert_close(got_stats, want_stats, rtol=0, atol=bound)


@pytest.mark.parametrize("case", ["decode-b16-h64", "mtp-b6-h64-3req", "one-row-long"])
def test_gluon_provider_selects_the_triton_providers_positions(case: str) -> None:
    call = _call(**CASES[case])
    want = call.indices.clone()
    get_provider("triton").index_topk(attrs.evolve(call, indices=want))
    call.indices.fill_(-7)
    get_provider("gluon").index_topk(call)
    assert torch.equal(torch.sort(call.indices, 1).values, torch.sort(want, 1).values)
