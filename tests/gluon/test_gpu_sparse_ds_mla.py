"""The ``fp8_ds_mla`` sparse attention on the Gluon kernels, on an H100/H200, against the torch
reference: the warp-specialised kernels of :mod:`mla.providers.gluon.ds_mla_rows` (16 and 32 rows)
and :mod:`mla.providers.gluon.ds_mla_heads` (64 rows) in every launch variant, and the kernels
they replaced (the few-rows kernel for 16-row tiles, the 64-row kernel; still selectable).

Each query row attends its own top-k list of cache rows (top-k 2048, DeepSeek-V3.2's), as a
qlen-1 decode over it. The lists mix every case the kernels must mask: full lists, lists with
fewer valid ids than the top-k (``-1`` pads scattered between them), ids outside the cache (past
its last row: masked like a pad, never read), and lists with no valid id (``o = 0``, ``lse =
-inf``). Cache rows no list selects are NaN (NaN tile scales and rope), the outputs NaN before
each call; the latent tiles of a row have different scales (magnitudes ``2^-3 .. 2^3``). Batches
of 1 and 128 requests, qlen 1 and 2 (rows = requests × qlen), 8 to 128 heads; the launch
heuristic's split count (one split at 256 rows: the outputs written directly; many at one row),
three splits, one split, overlapped MMAs, the planned schedule.

Run: ``pytest -m gpu tests/gluon/test_gpu_sparse_ds_mla.py`` (skipped without a Hopper GPU).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import attrs
import pytest
import torch

from mla.core.config import DS_MLA_DTYPE
from mla.providers import get_provider
from mla.providers.calls import SparseAttentionCall
from mla.testing import assert_matches_reference, encode_latent_cache

if TYPE_CHECKING:
    from mla.providers.gluon.planner import GluonLaunchConfig

pytestmark = pytest.mark.gpu

RANK, ROPE, TOPK = 512, 64, 2048
SCALE = (RANK + ROPE) ** -0.5
ROW_TOLERANCE = 3e-2
"""Largest relative error of one row's output (the whole output: :func:`assert_matches_reference`)."""
KINDS = ("full", "short", "outside", "empty")
"""What a row's list holds (:func:`_selection`)."""


@pytest.fixture(scope="module", autouse=True)
def _hopper() -> None:
    support = get_provider("gluon").availability()
    if not support:
        pytest.skip(f"the gluon provider is unavailable here: {support}")


def _selection(rows: int, cache_rows: int, gen: torch.Generator) -> torch.Tensor:
    """int32 ``[rows, TOPK]``: row ``t`` of kind ``KINDS[t % 4]`` (one row alone: ``outside``):
    ``full`` holds TOPK distinct ids; ``short`` between 1 and TOPK - 1 ids scattered over the
    columns, ``-1`` elsewhere; ``outside`` as ``short`` with some ids past the cache's last row;
    ``empty`` only ``-1``."""
    out = torch.full((rows, TOPK), -1, dtype=torch.int32)
    for t in range(rows):
        kind = "outside" if rows == 1 else KINDS[t % len(KINDS)]
        if kind == "empty":
            continue
        count = TOPK if kind == "full" else int(torch.randint(1, TOPK, (1,), generator=gen))
        ids = torch.randperm(cache_rows, generator=gen)[:count].to(torch.int32)
        if kind == "outside":
            far = torch.randint(0, 5000, (max(1, count // 8),), generator=gen, dtype=torch.int32)
            ids[: far.numel()] = cache_rows + far
        out[t, torch.randperm(TOPK, generator=gen)[:count]] = ids
    return out


def _call(batch: int, qlen: int, heads: int, seed: int) -> SparseAttentionCall:
    """A sparse attention call of ``batch × qlen`` rows on an ``fp8_ds_mla`` cache (NaN rows where
    no list selects), NaN-poisoned outputs."""
    gen = torch.Generator().manual_seed(seed)
    rows = batch * qlen
    cache_rows = 3 * TOPK
    values = torch.randn(cache_rows, RANK + ROPE, generator=gen)
    magnitude = 2.0 ** torch.randint(-3, 4, (cache_rows, RANK // 128), generator=gen).float()
    values[:, :RANK] *= magnitude.repeat_interleave(128, dim=1)
    slots = _selection(rows, cache_rows, gen)
    used = torch.zeros(cache_rows, dtype=torch.bool)
    picked = slots[(slots >= 0) & (slots < cache_rows)].long()
    used[picked] = True
    values[~used] = math.nan
    cache = encode_latent_cache(values, DS_MLA_DTYPE, kv_lora_rank=RANK).cuda()
    q = (0.5 * torch.randn(rows, heads, RANK + ROPE, generator=gen)).to(torch.bfloat16).cuda()
    return SparseAttentionCall(
        q=q, kv_cache=cache, slots=slots.cuda(),
        out=torch.full((rows, heads, RANK), math.nan, dtype=torch.bfloat16, device="cuda"),
        lse=torch.full((rows, heads), math.nan, device="cuda"),
        kv_lora_rank=RANK, rope_dim=ROPE, softmax_scale=SCALE, kv_scale=None,
    )  # fmt: skip


def _reference(call: SparseAttentionCall) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.empty(call.out.shape, dtype=torch.float32, device="cuda")
    lse = torch.empty(call.lse.shape if call.lse is not None else call.out.shape[:2], device="cuda")
    get_provider("torch").sparse_attention(attrs.evolve(call, out=out, lse=lse))
    return out, lse


def _check(call: SparseAttentionCall, context: str) -> None:
    assert call.lse is not None
    ref_out, ref_lse = _reference(call)
    assert_matches_reference(call.out, call.lse, ref_out, ref_lse, context=context)
    # Row by row too, so that one wrong row (a short list, the last tile) cannot hide in the norm.
    got, want = call.out.float(), ref_out
    err = (got - want).flatten(1).norm(dim=1) / want.flatten(1).norm(dim=1).clamp_min(1e-6)
    worst = int(err.argmax())
    assert float(err[worst]) <= ROW_TOLERANCE, f"{context}: row {worst} rel. error {float(err[worst]):.3g}"


def _variant(config: GluonLaunchConfig, variant: str) -> GluonLaunchConfig:
    """``config`` with a test variant's splits (``direct``: 1, ``…splits3``: 3) and overlap."""
    if variant.endswith("splits3"):
        config = attrs.evolve(config, num_splits=3)
    elif variant == "direct":
        config = attrs.evolve(config, num_splits=1)
    return attrs.evolve(config, overlap=True) if "overlap" in variant else config


CASES = [(1, 1, 16), (1, 2, 16), (128, 1, 16), (128, 2, 16), (4, 2, 8), (3, 1, 32)]
"""``(batch, qlen, heads)``: rows = batch × qlen, each a qlen-1 decode of ``heads`` rows."""
VARIANTS = ["auto", "direct", "splits3", "overlap", "overlap-splits3"]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(("batch", "qlen", "heads"), CASES, ids=[f"b{b}-q{q}-h{h}" for b, q, h in CASES])
def test_ds_mla_kernel_matches_the_reference(batch: int, qlen: int, heads: int, variant: str) -> None:
    from mla.providers.gluon.decode import sparse_decode
    from mla.providers.gluon.planner import GluonKernel, launch_config
    from mla.providers.triton.decode import num_sms

    call = _call(batch, qlen, heads, seed=batch * 31 + qlen * 7 + heads + len(variant))
    rows = batch * qlen
    auto = launch_config(
        batch=rows, rows=heads, max_seqlen_k=TOPK, num_sms=num_sms(call.q.device), persistent=False,
        kv_fp8=True, ds_mla=True,
    )  # fmt: skip
    if heads <= 16:
        assert auto.kernel is GluonKernel.DS_MLA, auto
    config = _variant(attrs.evolve(auto, kernel=GluonKernel.DS_MLA), variant)
    sparse_decode(call, config=config)
    torch.cuda.synchronize()
    _check(call, f"ds_mla {variant} {config}")


@pytest.mark.parametrize(("batch", "qlen"), [(1, 1), (128, 2)], ids=["b1-q1", "b128-q2"])
def test_few_rows_kernel_still_takes_ds_mla_rows(batch: int, qlen: int) -> None:
    """The kernel the fp8_ds_mla kernel replaced for 16-row tiles, named explicitly (as the
    benchmarks do), at the ring depth it measured best."""
    from mla.providers.gluon.decode import sparse_decode
    from mla.providers.gluon.planner import DS_MLA_STAGES, GluonKernel, GluonLaunchConfig

    call = _call(batch, qlen, 16, seed=batch + qlen)
    for splits in (1, 3):
        call.out.fill_(math.nan)
        assert call.lse is not None
        call.lse.fill_(math.nan)
        config = GluonLaunchConfig(
            row_tile=16, kernel=GluonKernel.ROWS, num_stages=DS_MLA_STAGES, num_splits=splits
        )
        sparse_decode(call, config=config)
        torch.cuda.synchronize()
        _check(call, f"rows {config}")


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize(("block_n", "stages"), [(32, 3), (32, 4)])
@pytest.mark.parametrize("heads", [64, 128])
def test_row64_kernel_overlapped_on_ds_mla_rows(heads: int, block_n: int, stages: int, splits: int) -> None:
    """The 64-row kernel (named explicitly: the ``fp8_ds_mla`` 64-row kernel took its tiles)
    with its overlapped loop: the next tile widened while this tile's ``P·V`` runs (the fits at
    64 rows: 32-token tiles)."""
    from mla.providers.gluon.decode import sparse_decode
    from mla.providers.gluon.planner import GluonKernel, launch_config
    from mla.providers.triton.decode import num_sms

    call = _call(3, 2, heads, seed=heads + block_n + stages + splits)
    auto = launch_config(
        batch=call.q.shape[0], rows=heads, max_seqlen_k=TOPK, num_sms=num_sms(call.q.device),
        persistent=False, kv_fp8=True, ds_mla=True,
    )  # fmt: skip
    config = attrs.evolve(
        auto, kernel=GluonKernel.ROW64, overlap=True, block_n=block_n, num_stages=stages, num_splits=splits
    )
    sparse_decode(call, config=config)
    torch.cuda.synchronize()
    _check(call, f"row64 overlap {config}")


HEADS_CASES = [(1, 1, 128), (3, 2, 64), (128, 2, 128), (5, 1, 64), (2, 1, 48)]
"""``(batch, qlen, heads)`` of the ``fp8_ds_mla`` 64-row kernel: one and many tiles a program, 64
and 128 heads (one and two row blocks), and 48 heads (a row block's last rows unused)."""


@pytest.mark.parametrize("variant", ["auto", "direct", "splits3"])
@pytest.mark.parametrize(
    ("batch", "qlen", "heads"), HEADS_CASES, ids=[f"b{b}-q{q}-h{h}" for b, q, h in HEADS_CASES]
)
def test_ds_mla_heads_kernel_matches_the_reference(batch: int, qlen: int, heads: int, variant: str) -> None:
    """The kernel of :mod:`mla.providers.gluon.ds_mla_heads` (a producer dequantizing each tile
    where its fp8 bytes landed, a scores and an output warpgroup) with the launch heuristic's
    splits, one and three (direct outputs; fp32 partials and the reduce)."""
    from mla.providers.gluon.decode import sparse_decode
    from mla.providers.gluon.planner import GluonKernel, launch_config
    from mla.providers.triton.decode import num_sms

    call = _call(batch, qlen, heads, seed=batch * 13 + qlen + heads + len(variant))
    auto = launch_config(
        batch=batch * qlen, rows=heads, max_seqlen_k=TOPK, num_sms=num_sms(call.q.device), persistent=False,
        kv_fp8=True, ds_mla=True,
    )  # fmt: skip
    config = _variant(attrs.evolve(auto, kernel=GluonKernel.DS_MLA_HEADS), variant)
    sparse_decode(call, config=config)
    torch.cuda.synchronize()
    _check(call, f"ds_mla_heads {config}")


@pytest.mark.parametrize("heads", [16, 32, 64])
def test_ds_mla_kernel_on_the_planned_schedule(heads: int) -> None:
    """The persistent path: work items from a :class:`~mla.providers.split_kv.SplitKVSchedule`
    (each row's list cut into chunks, partials merged by the reduce)."""
    from mla.providers.gluon.decode import launch_gluon_decode
    from mla.providers.gluon.planner import GluonKernel, GluonLaunchConfig, schedule_units
    from mla.providers.gluon.sparse import sparse_inputs
    from mla.providers.split_kv import SplitKVSchedule
    from mla.providers.triton.decode import num_sms
    from mla.providers.triton.schedule import plan_split_kv

    call = _call(5, 1, heads, seed=heads)
    rows = call.q.shape[0]
    schedule = SplitKVSchedule.allocate(
        max_batch=rows, max_kernel_qlen=1, kernel_heads=heads, kv_lora_rank=RANK,
        num_units=schedule_units(num_sms=num_sms(call.q.device), rows=heads), device=call.q.device,
        min_chunk=256,
    )  # fmt: skip
    inputs = sparse_inputs(call)._replace(schedule=schedule)
    plan_split_kv(schedule, inputs.kv_indptr, rows)
    kernel = GluonKernel.DS_MLA_HEADS if heads == 64 else GluonKernel.DS_MLA
    launch_gluon_decode(inputs, GluonLaunchConfig(row_tile=heads, kernel=kernel))
    torch.cuda.synchronize()
    _check(call, f"{kernel.value} schedule h{heads}")


def _every_byte_cache(rows: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``fp8_ds_mla`` byte rows whose latent holds every finite e4m3 value (each row its own
    shuffle of the 254 non-NaN bytes, zeros and subnormals included), power-of-two tile scales
    from ``2^-40`` to ``2^7`` and random bf16 rope; and each row's latent dequantized as the format
    defines it, ``(value · scale).to(bf16)``."""
    finite = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    latent = finite[torch.randint(0, finite.numel(), (rows, RANK), generator=gen)]
    for row in latent:
        row[: finite.numel()] = finite[torch.randperm(finite.numel(), generator=gen)]
    exponents = torch.randint(-40, 8, (rows, RANK // 128), generator=gen)
    scales = torch.ldexp(torch.ones(rows, RANK // 128), exponents)
    rope = torch.randn(rows, ROPE, generator=gen).to(torch.bfloat16)
    cache = torch.cat(
        [latent, scales.view(torch.uint8).view(rows, -1), rope.view(torch.uint8).view(rows, -1)], dim=1
    )
    values = latent.view(torch.float8_e4m3fn).float().view(rows, -1, 128) * scales[..., None]
    return cache, values.view(rows, RANK).to(torch.bfloat16)


@pytest.mark.parametrize("heads", [16, 128])
def test_ds_mla_dequantizes_every_e4m3_value_exactly(heads: int) -> None:
    """A row whose list selects one cache row gets that row's dequantized latent as its output
    (softmax weight 1, the latent as V): exactly ``(value · scale).to(bf16)`` for every finite e4m3
    value and power-of-two scales from ``2^-40`` to ``2^7``, on the kernel the launch heuristic
    picks (the 16-row ``fp8_ds_mla`` kernel at 16 heads, the 64-row one at 128)."""
    gen = torch.Generator().manual_seed(heads)
    rows = 64
    cache, expected = _every_byte_cache(rows, gen)
    slots = torch.full((rows, TOPK), -1, dtype=torch.int32)
    column = torch.randint(0, TOPK, (rows,), generator=gen)
    slots[torch.arange(rows), column] = torch.arange(rows, dtype=torch.int32)
    call = SparseAttentionCall(
        q=torch.randn(rows, heads, RANK + ROPE, generator=gen).to(torch.bfloat16).cuda(),
        kv_cache=cache.cuda(), slots=slots.cuda(),
        out=torch.full((rows, heads, RANK), math.nan, dtype=torch.bfloat16, device="cuda"),
        lse=None, kv_lora_rank=RANK, rope_dim=ROPE, softmax_scale=SCALE, kv_scale=None,
    )  # fmt: skip
    get_provider("gluon").sparse_attention(call)
    got = call.out.cpu()
    want = expected[:, None, :].expand(rows, heads, RANK)
    wrong = (got.float() != want.float()).nonzero()  # (a -0 value comes out as +0: P·V starts from 0)
    assert wrong.numel() == 0, (
        f"{wrong.shape[0]} values differ; first at (row, head, column) {wrong[0].tolist()}: "
        f"{float(got[tuple(wrong[0])])} instead of {float(want[tuple(wrong[0])])}"
    )
