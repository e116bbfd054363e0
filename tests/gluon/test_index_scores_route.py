"""The Gluon indexer-scores kernel on a CPU: which calls its route takes (every rejection rule),
that the gluon provider's ``index_topk`` runs the Triton kernels where the route declines (here:
no GPU), and the kernel compiled for sm_90 (Triton's compiler on the CPU, ``cuobjdump``): e4m3
``wgmma``, no stack, the shared memory of its ring."""

from __future__ import annotations

import glob
import json
import pathlib
import textwrap
from typing import Any

import attrs
import pytest
import torch
from sm90_compile import Compiled, compile_cases, resource_usage, sass_of

from mla.providers.calls import IndexTopkCall
from mla.providers.formats import E4M3
from mla.providers.triton.indexer import IndexScoresConfig

gluon = pytest.importorskip("mla.providers.gluon.index_scores")

CONFIG = IndexScoresConfig(num_stages=5, chunk=4096)


def _call(**change: Any) -> IndexTopkCall:
    rows, heads, n, bs = change.pop("rows", 4), change.pop("heads", 64), 8192, change.pop("block_size", 64)
    cache = torch.zeros(rows * n // bs, bs, 132, dtype=torch.uint8)
    call = IndexTopkCall(
        q=torch.zeros(rows, heads, change.pop("dim", 128), dtype=E4M3), weights=torch.zeros(rows, heads),
        index_cache=cache, key_dtype=E4M3, block_table=torch.zeros(rows, n // bs, dtype=torch.int32),
        row_request=torch.arange(rows, dtype=torch.int32), row_keys=torch.full((rows,), n, dtype=torch.int32),
        max_keys=n, softmax_scale=0.088, topk=2048, indices=torch.zeros(rows, 2048, dtype=torch.int32),
    )  # fmt: skip
    return attrs.evolve(call, **change)


def test_route_takes_a_dsa_decode_call() -> None:
    assert gluon.gluon_scores_route(_call(), CONFIG, (9, 0)) == (True, "Gluon scores kernel")
    assert gluon.gluon_scores_route(_call(heads=1, block_size=128), CONFIG, (9, 0))[0]


@pytest.mark.parametrize(
    ("build", "config", "capability", "why"),
    [
        (_call, CONFIG, None, "sm_90 GPU"),
        (_call, CONFIG, (8, 0), "sm_90 GPU"),
        (_call, CONFIG, (10, 0), "sm_90 GPU"),
        (lambda: _call(q=torch.zeros(4, 64, 128, dtype=torch.bfloat16)), CONFIG, (9, 0), "e4m3"),
        (lambda: _call(key_dtype=torch.bfloat16), CONFIG, (9, 0), "e4m3"),
        (lambda: _call(dim=64), CONFIG, (9, 0), "head dim 128"),
        (lambda: _call(heads=129), CONFIG, (9, 0), "index heads"),
        (lambda: _call(rows=gluon.MAX_ROWS + 1), CONFIG, (9, 0), "rows"),
        (lambda: _call(block_size=32), CONFIG, (9, 0), "multiple of 64 keys"),
        (lambda: _call(index_cache=torch.zeros(64, 64, 264, dtype=torch.uint8)[:, :, :132]), CONFIG, (9, 0),
         "contiguous index cache"),
        (lambda: _call(q=torch.zeros(4, 128, 64, dtype=E4M3).transpose(1, 2)), CONFIG, (9, 0),
         "contiguous last dim"),
        (lambda: _call(weights=torch.zeros(64, 4).t()), CONFIG, (9, 0), "contiguous last dim"),
        (_call, attrs.evolve(CONFIG, chunk=None), (9, 0), "chunk"),
        (_call, attrs.evolve(CONFIG, chunk=96), (9, 0), "chunk"),
    ],
    ids=["cpu", "sm80", "sm100", "bf16-q", "bf16-keys", "dim64", "heads129", "rows", "block32",
         "strided-cache", "strided-q", "strided-weights", "no-chunk", "chunk96"],
)  # fmt: skip
def test_route_declines_with_the_reason(
    build: Any, config: IndexScoresConfig, capability: Any, why: str
) -> None:
    taken, reason = gluon.gluon_scores_route(build(), config, capability)
    assert not taken
    assert why in reason, reason


def test_gluon_provider_runs_the_triton_scores_where_the_route_declines() -> None:
    """On a CPU the route declines: the provider's index_topk gives the Triton provider's
    selection (here in the interpreter)."""
    from mla.providers.gluon import GluonProvider
    from mla.providers.triton import TritonProvider

    gen = torch.Generator().manual_seed(0)
    rows, heads, n, bs = 2, 16, 256, 64
    blocks = rows * n // bs
    values = (torch.randn(blocks, bs, 128, generator=gen) * 0.5).to(E4M3)
    cache = torch.empty(blocks, bs * 132, dtype=torch.uint8)
    cache[:, : bs * 128] = values.view(torch.uint8).view(blocks, bs * 128)
    cache[:, bs * 128 :] = torch.ones(blocks, bs).view(torch.uint8)
    call = IndexTopkCall(
        q=(torch.randn(rows, heads, 128, generator=gen) * 0.5).to(E4M3),
        weights=torch.randn(rows, heads, generator=gen), index_cache=cache.view(blocks, bs, 132),
        key_dtype=E4M3,
        block_table=torch.randperm(blocks, generator=gen).to(torch.int32).view(rows, n // bs),
        row_request=torch.arange(rows, dtype=torch.int32),
        row_keys=torch.tensor([n, n - 70], dtype=torch.int32),
        max_keys=n, softmax_scale=0.088, topk=32, indices=torch.full((rows, 32), -7, dtype=torch.int32),
    )  # fmt: skip
    want = call.indices.clone()
    TritonProvider().index_topk(attrs.evolve(call, indices=want))
    GluonProvider().index_topk(call)
    assert torch.equal(torch.sort(call.indices, 1).values, torch.sort(want, 1).values)


def test_config_rejects_ring_depths_outside_2_to_8() -> None:
    for stages in (1, 9):
        with pytest.raises(gluon.InvalidInputError, match="num_stages") as error:
            gluon.GluonScoresConfig(num_stages=stages)
        assert error.value.argument == "config"


SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from mla.providers.calls import IndexTopkCall
    from mla.providers.formats import E4M3
    from mla.providers.gluon import index_scores as G
    from mla.providers.triton.indexer import IndexScoresConfig
    from mla.testing.triton_driver import stand_in_driver

    heads, stages, stats = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "stats"
    rows, n, bs = 8, 8192, 64
    call = IndexTopkCall(
        q=torch.zeros(rows, heads, 128, dtype=E4M3), weights=torch.zeros(rows, heads),
        index_cache=torch.zeros(rows * n // bs, bs, 132, dtype=torch.uint8), key_dtype=E4M3,
        block_table=torch.zeros(rows, n // bs, dtype=torch.int32),
        row_request=torch.arange(rows, dtype=torch.int32), row_keys=torch.full((rows,), n, dtype=torch.int32),
        max_keys=n, softmax_scale=0.088, topk=2048,
        indices=torch.zeros(rows, 2048, dtype=torch.int32))
    G.gluon_scores_route = lambda call, config, capability: (True, "compiling on a CPU")
    with stand_in_driver(compile_kernels=True):
        G.gluon_index_scores(
            call, torch.zeros(rows, n), stats=torch.zeros(2, rows, 2) if stats else None,
            config=IndexScoresConfig(chunk=4096), gluon_config=G.GluonScoresConfig(num_stages=stages))
    """
)
CASES = {
    "h64-s3-stats": ["64", "3", "stats"],
    "h16-s2": ["16", "2", "none"],
    "h128-s8-stats": ["128", "8", "stats"],
}
"""Compiled launches: index heads, ring stages, with or without the score ranges."""


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Compiled]:
    return compile_cases(SCRIPT, CASES, tmp_path_factory.mktemp("scores"))


@pytest.mark.heavy
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_compiles_to_fp8_wgmma_without_stack(
    case: str, compiled: dict[str, Compiled], cuobjdump: str
) -> None:
    compiled[case].stdout()
    heads, stages = int(CASES[case][0]), int(CASES[case][1])
    (cubin,) = glob.glob(f"{compiled[case].cache_dir}/*/index_scores_kernel.cubin")
    stack, usage = resource_usage(cubin, cuobjdump)
    assert stack == 0, usage
    sass = sass_of(cubin, cuobjdump)
    assert f"QGMMA.64x{max(16, heads)}x32.F32.E4M3.E4M3" in sass
    assert "HGMMA" not in sass
    (meta,) = glob.glob(f"{compiled[case].cache_dir}/*/index_scores_kernel.json")
    shared = json.loads(pathlib.Path(meta).read_text())["shared"]
    ring = stages * (64 * 128 + 256) + max(16, heads) * 128 + 8 * stages
    assert ring <= shared <= ring + 1024, (shared, ring)
