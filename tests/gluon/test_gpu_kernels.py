"""The Gluon decode kernels on an H100/H200, every launch variant against the torch reference.

The provider routes some cases to the Triton kernel (see ``decode_kernel``); these tests drive
the Gluon launchers directly so every variant stays verified: the 64-row kernel (bf16 and fp8,
one or several splits, the planned schedule, the software-pipelined loop), the transposed
few-rows kernel (16 and 32 rows), and the unit-qlen small-head path. Outputs are NaN-poisoned.

The variant and small-head runs put token ids outside the cache into their index lists (masked:
never read, no key). Run: ``pytest -m gpu tests/gluon/test_gpu_kernels.py`` (skipped without a
Hopper GPU).
"""

from __future__ import annotations

import math

import attrs
import pytest
import torch

from mla.providers import get_provider
from mla.providers.calls import PagedDecodeCall, SmallHeadDecodeCall
from mla.providers.torch_ref import TorchProvider
from mla.testing import assert_matches_reference

pytestmark = pytest.mark.gpu

RANK, ROPE, SCALE = 512, 64, 0.0721
FP8 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2


@pytest.fixture(scope="module", autouse=True)
def _hopper() -> None:
    support = get_provider("gluon").availability()
    if not support:
        pytest.skip(f"the gluon provider is unavailable here: {support}")


def _case(
    heads: int,
    qlens: list[int],
    lens: list[int],
    block: int,
    kv_dtype: torch.dtype,
    seed: int,
    *,
    outside: bool = False,
):
    """Inputs of one decode; ``outside``: three token ids of each request of 100+ keys point
    outside the cache (``-1``, the row just past it, a row far past it), which every kernel must
    mask (never read, no key) as the torch reference does."""
    gen = torch.Generator().manual_seed(seed)
    pages = [-(-max(n, 1) // block) for n in lens]
    nblocks = sum(pages) + 2
    scale = 0.05 if kv_dtype.itemsize == 1 else None
    cache = (torch.randn(nblocks, block, RANK + ROPE, generator=gen) / (scale or 1.0)).clamp(-448, 448)
    cache = cache.to(kv_dtype).cuda().view(-1, RANK + ROPE)
    perm = torch.randperm(nblocks, generator=gen)
    ids, pos = [], 0
    for n, p in zip(lens, pages, strict=True):
        rows = (perm[pos : pos + p, None] * block + torch.arange(block)[None, :]).reshape(-1)[:n]
        if outside and n >= 100:
            rows[5], rows[n // 2], rows[n - 1] = -1, nblocks * block, nblocks * block + 4099
        ids.append(rows)
        pos += p
    kv_indices = torch.cat(ids).to(torch.int32).cuda()
    kv_indptr = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32).cuda()
    qo_indptr = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32).cuda()
    q = torch.randn(sum(qlens), heads, RANK + ROPE, generator=gen).to(torch.bfloat16).cuda()
    scale_t = None if scale is None else torch.full((1,), scale, dtype=torch.float32, device="cuda")
    return q, cache, kv_indptr, kv_indices, qo_indptr, scale_t, block


def _call(case, qlens, lens, out, lse, schedule=None) -> PagedDecodeCall:
    q, cache, kv_indptr, kv_indices, qo_indptr, scale_t, block = case
    return PagedDecodeCall(
        q=q, kv_cache=cache, kv_indptr=kv_indptr, kv_indices=kv_indices, qo_indptr=qo_indptr, out=out,
        lse=lse, max_qlen=max(qlens), max_seqlen_k=max(lens), page_size=block, softmax_scale=SCALE,
        kv_scale=scale_t, schedule=schedule,
    )  # fmt: skip


def _reference(case, qlens, lens):
    q = case[0]
    out = torch.empty(q.shape[0], q.shape[1], RANK, dtype=torch.float32, device="cuda")
    lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device="cuda")
    TorchProvider().paged_mqa_decode(_call(case, qlens, lens, out, lse))
    return out, lse


CASES = [
    (16, [1] * 5, [4096, 33, 0, 700, 64], 64),
    (8, [1, 1, 1], [300, 1, 1500], 1),
    (16, [2, 2, 1], [900, 2, 300], 16),
    (12, [3, 3, 3], [300, 3, 1500], 16),
    (128, [1, 2, 1], [800, 300, 2], 64),
    (5, [8, 1], [2000, 9], 16),
]
# 16 heads, qlen 1 on 16-token pages: the dual-chain kernel's tiles span four shuffled pages, so
# it gathers them (its TMA takes only tiles of 64 consecutive cache rows).
DUAL_BS16 = (16, [1, 1, 1], [1000, 64, 129], 16)
# Every case on the launch heuristic's own choice; the other launch variants on the cases that
# reach them (16 rows: few-rows kernel; 32 rows; 36 rows: 64-row tiles, the ping-pong kernel on
# 16-bit caches; row64: the 64-row kernel; t64: the transposed kernel on two warpgroups; dual:
# the dual-chain kernel, 16 rows of an fp8 cache, which auto picks there; rows16: the few-rows
# kernel on those).
RUNS = (
    [(case, "auto") for case in CASES]
    + [(CASES[0], v) for v in ("splits3", "schedule", "row64", "overlap", "no_lse")]
    + [(CASES[2], v) for v in ("splits3", "schedule", "no_lse")]
    + [(CASES[3], v) for v in ("schedule", "no_lse", "t64", "row64", "pingpong")]
    + [(CASES[4], v) for v in ("t64", "row64", "pingpong")]
    + [(CASES[5], "pingpong"), (CASES[0], "pingpong")]
    + [(CASES[0], v) for v in ("dual", "dual-splits3", "dual-schedule")]
    + [(CASES[1], "dual"), (DUAL_BS16, "auto")]
    + [(CASES[0], v) for v in ("rows16", "rows16-splits3")]
    + [(CASES[1], "rows16")]
    + [(CASES[i], "fold") for i in (0, 1, 2)]
)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, FP8, E5M2], ids=["bf16", "fp8", "e5m2"])
@pytest.mark.parametrize(
    ("case", "variant"), RUNS, ids=[f"h{c[0]}-q{max(c[1])}-bs{c[3]}-{v}" for c, v in RUNS]
)
def test_paged_decode_variants(
    case: tuple[int, list[int], list[int], int], variant: str, kv_dtype: torch.dtype
) -> None:
    heads, qlens, lens, block = case
    from mla.providers.gluon.decode import paged_decode
    from mla.providers.gluon.planner import BLOCK_M, GluonKernel, launch_config, schedule_units
    from mla.providers.split_kv import SplitKVSchedule
    from mla.providers.triton.decode import num_sms
    from mla.providers.triton.schedule import plan_split_kv

    data = _case(heads, qlens, lens, block, kv_dtype, seed=heads + len(variant), outside=True)
    q = data[0]
    ref_out, ref_lse = _reference(data, qlens, lens)
    out = torch.full((q.shape[0], heads, RANK), math.nan, dtype=torch.bfloat16, device="cuda")
    lse = None if variant == "no_lse" else torch.full((q.shape[0], heads), math.nan, device="cuda")
    rows = heads * max(qlens)
    auto = launch_config(
        batch=len(lens), rows=rows, max_seqlen_k=max(lens), num_sms=num_sms(q.device),
        persistent=False, kv_fp8=kv_dtype.itemsize == 1,
    )  # fmt: skip
    schedule, config = None, None
    if variant.endswith("schedule"):
        schedule = SplitKVSchedule.allocate(
            max_batch=len(lens), max_kernel_qlen=max(qlens), kernel_heads=heads, kv_lora_rank=RANK,
            num_units=schedule_units(num_sms=num_sms(q.device), rows=rows),
            device=q.device, min_chunk=256,
        )  # fmt: skip
        plan_split_kv(schedule, data[2], len(lens))
    if variant == "splits3":
        config = attrs.evolve(auto, num_splits=3)
    elif variant == "rows16-splits3":
        if kv_dtype.itemsize != 1:
            pytest.skip("16 rows of a 16-bit cache run on the few-rows kernel anyway (splits3)")
        config = attrs.evolve(auto, kernel=GluonKernel.ROWS, num_splits=3)
    elif variant == "row64":
        config = attrs.evolve(auto, row_tile=BLOCK_M, kernel=GluonKernel.ROW64, num_splits=2, num_stages=2)
    elif variant == "t64":
        if kv_dtype.itemsize == 1:
            pytest.skip("the 64-row transposed kernel takes 16-bit caches (check_config)")
        config = attrs.evolve(auto, row_tile=BLOCK_M, kernel=GluonKernel.ROWS, num_stages=2)
    elif variant == "pingpong":
        if kv_dtype.itemsize == 1:
            pytest.skip("the ping-pong kernel takes 16-bit caches (check_config)")
        config = attrs.evolve(auto, row_tile=BLOCK_M, kernel=GluonKernel.PINGPONG, num_stages=2)
    elif variant == "rows16":
        if kv_dtype.itemsize != 1:
            pytest.skip("16 rows of a 16-bit cache run on the few-rows kernel anyway (auto)")
        config = attrs.evolve(auto, kernel=GluonKernel.ROWS)
    elif variant.startswith("dual"):
        if kv_dtype.itemsize != 1:
            pytest.skip("the dual-chain kernel takes fp8 caches (check_config)")
        splits = {"dual-splits3": 3, "dual-schedule": 1}.get(variant, auto.num_splits)
        config = attrs.evolve(auto, kernel=GluonKernel.DUAL, num_splits=splits)
    elif variant == "fold":
        splits = _fold_splits(len(lens), q.device, rows=auto.row_tile)
        config = attrs.evolve(auto, kernel=GluonKernel.ROWS, num_splits=splits, fold=True)
    elif variant == "overlap":
        config = attrs.evolve(
            auto, row_tile=BLOCK_M, kernel=GluonKernel.ROW64, block_n=32, num_stages=4, overlap=True
        )
    paged_decode(_call(data, qlens, lens, out, lse, schedule), config=config)
    torch.cuda.synchronize()
    if lse is None:
        assert_matches_reference(out, ref_lse, ref_out, ref_lse, context=f"gluon {variant}")
    else:
        assert_matches_reference(out, lse, ref_out, ref_lse, context=f"gluon {variant}")


def _fold_splits(requests: int, device: torch.device, rows: int = 16) -> int:
    """The most splits (at most 64) that fold with ``rows``-row tiles and fit one wave."""
    from mla.providers.gluon.fold import foldable_splits
    from mla.providers.triton.decode import num_sms

    return foldable_splits(min(64, num_sms(device) // requests), rows=rows, rank=RANK)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
def test_folded_reduce_under_graph_replay(kv_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """The folded reduce's barrier words come back as they started, so replays of a captured
    graph (and eager calls between them) keep matching; a launch captured before the words
    exist launches the separate reduce instead."""
    from mla.providers.gluon import fold
    from mla.providers.gluon.decode import paged_decode
    from mla.providers.gluon.planner import GluonLaunchConfig

    heads, qlens, lens, block = 16, [1, 1, 1], [5000, 64, 900], 64
    data = _case(heads, qlens, lens, block, kv_dtype, seed=11)
    q = data[0]
    ref_out, ref_lse = _reference(data, qlens, lens)
    out = torch.full((q.shape[0], heads, RANK), math.nan, dtype=torch.bfloat16, device="cuda")
    lse = torch.full((q.shape[0], heads), math.nan, device="cuda")
    config = GluonLaunchConfig(row_tile=16, num_splits=_fold_splits(len(lens), q.device), fold=True)

    def step() -> None:
        paged_decode(_call(data, qlens, lens, out, lse), config=config)

    for words in (None, {}):
        if words is not None:
            monkeypatch.setattr(fold, "_BARRIERS", words)  # the first launch is the captured one
        else:
            step()
            torch.cuda.synchronize()
            assert_matches_reference(out, lse, ref_out, ref_lse, context="gluon fold eager")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            step()
        for _ in range(3):
            out.fill_(math.nan)
            lse.fill_(math.nan)
            graph.replay()
            torch.cuda.synchronize()
            assert_matches_reference(out, lse, ref_out, ref_lse, context=f"gluon fold replay {words}")
        if words is not None:
            assert words == {}, "a capture made the barrier words"
        else:
            assert fold._BARRIERS[q.device].tolist()[0] == 0


# (request, token position, head, factor): the key at that position made ``factor`` times the
# head's query, so its score exceeds every earlier one of the row by far more than the online
# softmax's slack (about 60·factor in log2 units here), in tiles of both warpgroups and splits.
SPIKES = [(0, 1000, 0, 0.15), (0, 2900, 3, 0.3), (0, 2950, 0, 0.3), (1, 500, 7, 0.3), (1, 650, 7, 0.5)]


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, FP8, E5M2], ids=["bf16", "fp8", "e5m2"])
@pytest.mark.parametrize("splits", [1, 3], ids=["splits1", "splits3"])
def test_late_score_spikes(kv_dtype: torch.dtype, splits: int) -> None:
    """Keys whose scores jump far above everything before them, late in a request: the kernels
    must move their running (or reference) row max, not overflow ``P``."""
    from mla.providers.gluon.decode import paged_decode
    from mla.providers.gluon.planner import launch_config
    from mla.providers.triton.decode import num_sms

    heads, qlens, lens, block = 16, [1, 1], [3000, 700], 64
    data = _case(heads, qlens, lens, block, kv_dtype, seed=7)
    q, cache, kv_indptr, kv_indices, _qo, scale_t, _bs = data
    kv_scale = 1.0 if scale_t is None else float(scale_t)
    for req, pos, head, factor in SPIKES:
        row = int(kv_indices[int(kv_indptr[req]) + pos])
        cache[row] = (factor * q[req, head].float() / kv_scale).to(cache.dtype)
    ref_out, ref_lse = _reference(data, qlens, lens)
    out = torch.full((q.shape[0], heads, RANK), math.nan, dtype=torch.bfloat16, device="cuda")
    lse = torch.full((q.shape[0], heads), math.nan, device="cuda")
    auto = launch_config(
        batch=len(lens), rows=heads, max_seqlen_k=max(lens), num_sms=num_sms(q.device),
        persistent=False, kv_fp8=kv_dtype.itemsize == 1,
    )  # fmt: skip
    paged_decode(_call(data, qlens, lens, out, lse), config=attrs.evolve(auto, num_splits=splits))
    torch.cuda.synchronize()
    assert_matches_reference(out, lse, ref_out, ref_lse, context=f"gluon spikes {auto}")


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("heads", [1, 8, 16, 24, 64])
def test_small_head_decode(heads: int, kv_dtype: torch.dtype) -> None:
    from mla.providers.gluon.decode import small_head_decode

    lens = [1200, 1, 0, 333, 64]
    case = _case(heads, [1] * len(lens), lens, 16, kv_dtype, seed=heads, outside=True)
    q, cache, kv_indptr, kv_indices, _qo, scale_t, block = case
    ref_out, ref_lse = _reference(case, [1] * len(lens), lens)
    out = torch.full((q.shape[0], heads, RANK), math.nan, dtype=torch.bfloat16, device="cuda")
    lse = torch.full((q.shape[0], heads), math.nan, device="cuda")
    small_head_decode(
        SmallHeadDecodeCall(
            q_nope=q[..., :RANK],
            q_pe=q[..., RANK:],
            kv_cache=cache,
            page_table=kv_indices,
            seq_info=kv_indptr,
            out=out,
            lse=lse,
            max_seqlen_k=max(lens),
            page_size=block,
            softmax_scale=SCALE,
            kv_scale=scale_t,
        )
    )
    torch.cuda.synchronize()
    assert_matches_reference(out, lse, ref_out, ref_lse, context="gluon small-head")


# Block-table launches (what the engine runs on this provider): 64-token pages on the
# non-persistent launches put every tile inside one page (its block id read and checked once
# by the few-rows, dual-chain and 64-row kernels; the ping-pong kernel's loader checks it and
# hands its MMA warpgroups one word a tile: h128-q2-bs64-auto on bf16); pages of 16 and the
# planned schedule take the per-key ids.
TABLE_RUNS = [
    (CASES[0], "auto"),
    (CASES[0], "splits3"),
    (CASES[0], "schedule"),
    ((16, [2, 2, 1], [900, 2, 300], 64), "auto"),
    (CASES[2], "auto"),
    (CASES[4], "auto"),
    (CASES[4], "row64"),
    (DUAL_BS16, "auto"),
]


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize(
    ("case", "variant"), TABLE_RUNS, ids=[f"h{c[0]}-q{max(c[1])}-bs{c[3]}-{v}" for c, v in TABLE_RUNS]
)
def test_paged_decode_over_the_block_table(
    case: tuple[int, list[int], list[int], int], variant: str, kv_dtype: torch.dtype
) -> None:
    """The Gluon kernels over the block table, with a negative block, the block just past the
    cache and one far past it in each request of 3+ pages (masked: never read, no key), against
    the torch reference over the same table."""
    from mla.providers.gluon.decode import paged_decode
    from mla.providers.gluon.planner import BLOCK_M, GluonKernel, launch_config, schedule_units
    from mla.providers.split_kv import SplitKVSchedule
    from mla.providers.triton.decode import num_sms
    from mla.providers.triton.schedule import plan_split_kv

    heads, qlens, lens, block = case
    data = _case(heads, qlens, lens, block, kv_dtype, seed=heads)
    q, cache, kv_indptr, _ids, qo_indptr, scale_t, _bs = data
    nblocks = cache.shape[0] // block
    pages = [-(-max(n, 1) // block) for n in lens]
    perm = torch.randperm(nblocks, generator=torch.Generator().manual_seed(heads + 1)).to(torch.int32)
    table, pos = torch.zeros(len(lens), max(pages), dtype=torch.int32), 0
    for b, p in enumerate(pages):
        table[b, :p] = perm[pos : pos + p]
        pos += p
        if p >= 3:
            table[b, 1], table[b, p // 2], table[b, p - 1] = -1, nblocks, nblocks + 1000
    table = table.cuda()

    def call(
        out: torch.Tensor, lse: torch.Tensor, schedule: SplitKVSchedule | None = None
    ) -> PagedDecodeCall:
        return PagedDecodeCall(
            q=q, kv_cache=cache, kv_indptr=kv_indptr, kv_indices=None, block_table=table, qo_indptr=qo_indptr,
            out=out, lse=lse, max_qlen=max(qlens), max_seqlen_k=max(lens), page_size=block,
            softmax_scale=SCALE, kv_scale=scale_t, schedule=schedule,
        )  # fmt: skip

    ref_out = torch.empty(q.shape[0], heads, RANK, dtype=torch.float32, device="cuda")
    ref_lse = torch.empty(q.shape[0], heads, dtype=torch.float32, device="cuda")
    TorchProvider().paged_mqa_decode(call(ref_out, ref_lse))
    out = torch.full((q.shape[0], heads, RANK), math.nan, dtype=torch.bfloat16, device="cuda")
    lse = torch.full((q.shape[0], heads), math.nan, device="cuda")
    rows = heads * max(qlens)
    auto = launch_config(
        batch=len(lens), rows=rows, max_seqlen_k=max(lens), num_sms=num_sms(q.device),
        persistent=variant == "schedule", kv_fp8=kv_dtype.itemsize == 1,
    )  # fmt: skip
    schedule, config = None, auto
    if variant == "schedule":
        schedule = SplitKVSchedule.allocate(
            max_batch=len(lens), max_kernel_qlen=max(qlens), kernel_heads=heads, kv_lora_rank=RANK,
            num_units=schedule_units(num_sms=num_sms(q.device), rows=rows), device=q.device, min_chunk=256,
        )  # fmt: skip
        plan_split_kv(schedule, kv_indptr, len(lens))
    elif variant == "splits3":
        config = attrs.evolve(auto, num_splits=3)
    elif variant == "row64":
        config = attrs.evolve(auto, row_tile=BLOCK_M, kernel=GluonKernel.ROW64, num_splits=2, num_stages=2)
    paged_decode(call(out, lse, schedule), config=config)
    torch.cuda.synchronize()
    assert_matches_reference(out, lse, ref_out, ref_lse, context=f"gluon table {variant} {config}")


def test_pingpong_over_a_cache_smaller_than_one_page() -> None:
    """A cache of fewer rows than one page holds no whole block, so every block id is outside it:
    on the ping-pong kernel (H128 bf16, 64-token pages: its loader's one-word tile check, which
    runs no tile then) every row sees no key: ``o = 0``, ``lse = -inf``, nothing read."""
    from mla.providers.gluon.decode import paged_decode
    from mla.providers.gluon.planner import GluonKernel, launch_config
    from mla.providers.triton.decode import num_sms

    heads, block, lens = 128, 64, [40, 10]
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(len(lens), heads, RANK + ROPE, generator=gen).to(torch.bfloat16).cuda()
    cache = torch.randn(block // 2, RANK + ROPE, generator=gen).to(torch.bfloat16).cuda()
    out = torch.full((len(lens), heads, RANK), math.nan, dtype=torch.bfloat16, device="cuda")
    lse = torch.full((len(lens), heads), math.nan, device="cuda")
    call = PagedDecodeCall(
        q=q, kv_cache=cache, kv_indptr=torch.tensor([0, 40, 50], dtype=torch.int32, device="cuda"),
        kv_indices=None, block_table=torch.zeros(len(lens), 1, dtype=torch.int32, device="cuda"),
        qo_indptr=torch.arange(len(lens) + 1, dtype=torch.int32, device="cuda"), out=out, lse=lse, max_qlen=1,
        max_seqlen_k=max(lens), page_size=block, softmax_scale=SCALE, kv_scale=None, schedule=None,
    )  # fmt: skip
    config = launch_config(
        batch=len(lens), rows=heads, max_seqlen_k=max(lens), num_sms=num_sms(q.device), persistent=False,
        kv_fp8=False,
    )  # fmt: skip
    assert config.kernel == GluonKernel.PINGPONG, config
    paged_decode(call, config=config)
    torch.cuda.synchronize()
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.isneginf(lse).all()
