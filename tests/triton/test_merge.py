"""The split-KV reduce (:mod:`mla.providers.triton.merge`) against a float64 LSE merge.

Runs in the Triton interpreter on the CPU (``TRITON_INTERPRET=1`` from tests/conftest.py) and
compiled on a GPU. Partials are random with some splits empty (``lse = -inf``, ``o = 0``), the
output is NaN-poisoned, and split counts cross the kernel's per-step block of splits.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from mla.core.errors import PlanMismatchError
from mla.providers.split_kv import SplitKVSchedule
from mla.providers.triton.merge import (
    MAX_BLOCK_S_SCHEDULED,
    MERGE_TILE,
    launch_merge,
    merge_tiles,
    split_work,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def reference_merge(
    part_o: torch.Tensor, part_lse: torch.Tensor, owners: list[range]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 merge of items ``owners[b]`` into row ``b`` (qlen 1): ``[B, H, L]``, ``[B, H]``."""
    part_o, part_lse = part_o.cpu(), part_lse.cpu()
    outs, lses = [], []
    for items in owners:
        lse = part_lse[list(items), 0].double()  # [S, H]
        top = lse.max(0).values
        top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
        weight = torch.exp(lse - top)
        denom = weight.sum(0)
        merged = (part_o[list(items), 0].double() * weight[..., None]).sum(0)
        safe = torch.where(denom == 0, torch.ones_like(denom), denom)
        outs.append(merged / safe[..., None])
        lses.append(torch.where(denom == 0, torch.full_like(denom, -math.inf), top + safe.log()))
    return torch.stack(outs), torch.stack(lses)


def partials(
    work: int, heads: int, rank: int, *, empty_every: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    part_o = torch.randn(work, 1, heads, rank, generator=gen)
    part_lse = torch.randn(work, 1, heads, generator=gen) * 3
    part_o[::empty_every] = 0.0
    part_lse[::empty_every] = -math.inf
    return part_o.to(DEVICE), part_lse.to(DEVICE)


@pytest.mark.parametrize(("batch", "splits"), [(3, 1), (4, 2), (2, 5), (1, 70)], ids=str)
def test_non_persistent_merge_matches_float64(batch: int, splits: int) -> None:
    heads, rank = 3, 48
    part_o, part_lse = partials(batch * splits, heads, rank, empty_every=3, seed=splits)
    out = torch.full((batch, heads, rank), math.nan, device=DEVICE)
    lse = torch.full((batch, heads), math.nan, device=DEVICE)
    indptr = torch.arange(batch + 1, dtype=torch.int32, device=DEVICE)
    launch_merge(
        part_o=part_o, part_lse=part_lse, out=out, lse=lse, qo_indptr=indptr, split_indptr=indptr,
        num_requests=batch, max_qlen=1, num_splits=splits, num_sms=2,
    )  # fmt: skip
    owners = [range(b * splits, (b + 1) * splits) for b in range(batch)]
    ref_o, ref_lse = reference_merge(part_o, part_lse, owners)
    torch.testing.assert_close(out.cpu().double(), ref_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.cpu().double(), ref_lse, atol=1e-5, rtol=1e-5)


def test_scheduled_merge_skips_direct_requests_and_crosses_steps() -> None:
    """A planned schedule: request 0 has one item (written directly: left alone), request 1 has
    more items than one step of the kernel, request 2 only empty items (o = 0, lse = -inf)."""
    heads, rank = 2, 32
    counts = [1, MAX_BLOCK_S_SCHEDULED + 3, 2]
    split_indptr = torch.tensor([0, 1, 1 + counts[1], sum(counts)], dtype=torch.int32, device=DEVICE)
    part_o, part_lse = partials(sum(counts), heads, rank, empty_every=5, seed=7)
    part_o[-2:] = 0.0
    part_lse[-2:] = -math.inf
    out = torch.full((3, heads, rank), math.nan, device=DEVICE)
    lse = torch.full((3, heads), math.nan, device=DEVICE)
    launch_merge(
        part_o=part_o, part_lse=part_lse, out=out, lse=lse, qo_indptr=None, split_indptr=split_indptr,
        num_requests=3, max_qlen=1, num_splits=None, num_sms=2,
    )  # fmt: skip
    assert out[0].isnan().all(), "a one-item request is the decode kernel's to write"
    assert lse[0].isnan().all()
    owners = [range(1, 1 + counts[1]), range(1 + counts[1], sum(counts))]
    ref_o, ref_lse = reference_merge(part_o, part_lse, owners)
    torch.testing.assert_close(out[1:].cpu().double(), ref_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse[1:].cpu().double(), ref_lse, atol=1e-5, rtol=1e-5)
    assert (out[2] == 0).all()
    assert (lse[2] == -math.inf).all()


def test_a_nan_partial_shows_in_its_row_only() -> None:
    heads, rank, splits = 2, 16, 3
    part_o, part_lse = partials(2 * splits, heads, rank, empty_every=10, seed=3)
    part_lse[1, 0, 1] = math.nan  # (on the device)  # request 0, head 1: a key its rows see is NaN
    out = torch.full((2, heads, rank), math.nan, device=DEVICE)
    indptr = torch.arange(3, dtype=torch.int32, device=DEVICE)
    launch_merge(
        part_o=part_o, part_lse=part_lse, out=out, lse=None, qo_indptr=indptr, split_indptr=indptr,
        num_requests=2, max_qlen=1, num_splits=splits, num_sms=2,
    )  # fmt: skip
    assert out[0, 1].isnan().all()
    assert out[0, 0].isfinite().all()
    assert out[1].isfinite().all()


# (requests, qlen, heads, rank, splits, SMs) -> (BLOCK_S, BLOCK_D)
MERGE_TILES = {
    (64, 1, 16, 512, 2, 132): (2, 512),  # H16 B64 2-way: 1024 programs of the whole latent row
    (1, 1, 16, 512, 128, 132): (128, 32),  # B1 128-way: 16 x 16 programs, 32 lanes each
    (16, 1, 16, 512, 8, 132): (8, 256),
    (64, 4, 16, 512, 2, 132): (2, 512),
    (64, 1, 128, 512, None, 132): (8, 512),  # a planned schedule: ~2 x 132 / 64 splits a step
    (1, 1, 16, 512, None, 132): (64, 32),  # one request: the most splits a step
    (2, 1, 3, 48, 70, 2): (128, 64),
}


@pytest.mark.parametrize(("args", "expected"), MERGE_TILES.items(), ids=str)
def test_merge_tiles_golden(
    args: tuple[int, int, int, int, int | None, int], expected: tuple[int, int]
) -> None:
    requests, qlen, heads, rank, splits, sms = args
    block_s, block_d = merge_tiles(
        num_requests=requests, max_qlen=qlen, heads=heads, rank=rank, num_splits=splits, num_sms=sms
    )
    assert (block_s, block_d) == expected
    assert block_s * block_d <= MERGE_TILE


def test_split_work_sizes_the_non_persistent_partials_and_rejects_a_schedule_of_another_geometry() -> None:
    """Non-persistent: ``requests × splits`` items with fp32 partials in the reduce's layout (one-
    element stand-ins at one split); a planned schedule lends its buffers only to the geometry
    it was allocated for."""
    out = torch.empty(6, 4, 32)
    indptr = torch.zeros(4, dtype=torch.int32)
    common = {"num_requests": 3, "max_qlen": 2, "heads": 4, "rank": 32, "kv_indptr": indptr, "out": out}
    num_work, part_o, part_lse, work_info, split_indptr = split_work(schedule=None, num_splits=5, **common)
    assert num_work == 15
    assert part_o.shape == (15, 2, 4, 32)
    assert part_lse.shape == (15, 2, 4)
    assert part_o.dtype == part_lse.dtype == torch.float32
    assert work_info is indptr
    assert split_indptr is indptr
    _, part_o, part_lse, _, _ = split_work(schedule=None, num_splits=1, **common)
    assert part_o.numel() == part_lse.numel() == 1
    schedule = SplitKVSchedule.allocate(
        max_batch=3, max_kernel_qlen=2, kernel_heads=4, kv_lora_rank=32, num_units=8, device=out.device
    )
    num_work, part_o, _, work_info, split_indptr = split_work(schedule=schedule, num_splits=1, **common)
    assert (num_work, part_o, work_info) == (schedule.max_work, schedule.partial_o, schedule.work_info)
    assert split_indptr is schedule.split_indptr
    with pytest.raises(PlanMismatchError, match="another geometry"):
        split_work(schedule=schedule, num_splits=1, **{**common, "max_qlen": 3})
