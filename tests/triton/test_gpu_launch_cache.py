"""The cached Triton launches (:mod:`mla.providers.triton.launch_cache`) on a GPU: the fill and
the split-KV planner write the same values through the cached path as through Triton's own
``kernel[grid](...)``, for changing batch sizes, bounds, dtypes and tensor alignments (each of
which may select another compiled kernel), and as the torch reference.

Timing (not asserted here): ``python3 -m benchmarks overhead`` prints ``build us``;
``MLA_TRITON_LAUNCH_CACHE=0 python3 -m benchmarks overhead`` times it without the cache.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

triton = pytest.importorskip("triton")

from mla.providers import transforms  # noqa: E402
from mla.providers.calls import FillPagesCall  # noqa: E402
from mla.providers.split_kv import SplitKVSchedule  # noqa: E402
from mla.providers.triton import launch_cache, schedule, utils  # noqa: E402

pytestmark = pytest.mark.gpu

DEVICE = "cuda"


@pytest.fixture
def cache_on() -> None:
    """Skip where the cache is off (every launch goes through Triton: nothing to compare)."""
    if not (utils.FILL_LAUNCH.active and schedule.PLAN_LAUNCH.active):
        pytest.skip(f"the launch cache is off on Triton {triton.__version__}")


def through_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the fill and the planner launch through ``kernel[grid](...)`` (a disabled cache)."""
    monkeypatch.setattr(launch_cache, "ENABLED", False)
    monkeypatch.setattr(utils, "FILL_LAUNCH", launch_cache.LaunchCache(utils._fill_page_indices_kernel))
    monkeypatch.setattr(schedule, "PLAN_LAUNCH", launch_cache.LaunchCache(schedule._plan_split_kv_kernel))


class FillCase:
    """One fill's inputs; ``offset`` elements shift every tensor off 16-byte alignment."""

    def __init__(
        self,
        batch: int,
        *,
        seed: int,
        block_size: int = 16,
        max_len: int = 300,
        offset: int = 0,
        lens_dtype: torch.dtype = torch.int32,
        num_blocks: int | None = 64,
        copy_qo: bool = True,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        width = -(-max_len // block_size)
        blocks = num_blocks or batch * width
        lens = torch.randint(0, max_len + 1, (batch,), generator=gen)
        lens[0] = max_len
        if batch > 2:
            lens[1] = 0  # a graph-padding request
            lens[2] = max_len + 7  # longer than the bound: clamped
        table = torch.randint(0, blocks, (batch, width), generator=gen, dtype=torch.int32)
        if num_blocks is not None:
            table[0, 0] = num_blocks + 3  # outside the cache: marked -1
        self.seq_lens = self._device(lens.to(lens_dtype), offset)
        self.table = self._device(table.view(-1), offset).view(batch, width)
        self.qsl = self._device(torch.arange(batch + 1, dtype=torch.int32) * 2, offset)
        self.block_size, self.max_len, self.num_blocks = block_size, max_len, num_blocks
        self.copy_qo = copy_qo
        self.batch = batch

    @staticmethod
    def _device(host: torch.Tensor, offset: int) -> torch.Tensor:
        buffer = torch.zeros(host.numel() + offset, dtype=host.dtype, device=DEVICE)
        view = buffer[offset:]
        view.copy_(host)
        return view

    def call(self) -> FillPagesCall:
        """A call writing into fresh (NaN-free, -1 filled) outputs."""
        batch = self.batch
        return FillPagesCall(
            seq_lens=self.seq_lens,
            block_table=self.table,
            kv_indptr=torch.full((batch + 1,), -1, dtype=torch.int32, device=DEVICE),
            kv_indices=torch.full((batch * self.max_len + 1,), -1, dtype=torch.int32, device=DEVICE),
            block_size=self.block_size,
            max_len=self.max_len,
            num_blocks=self.num_blocks,
            query_start_loc=self.qsl if self.copy_qo else None,
            qo_indptr=torch.full((batch + 1,), -1, dtype=torch.int32, device=DEVICE)
            if self.copy_qo
            else None,
        )


def written(call: FillPagesCall) -> tuple[torch.Tensor, ...]:
    total = int(call.kv_indptr[-1])
    qo = call.qo_indptr if call.qo_indptr is not None else torch.zeros(0)
    return call.kv_indptr.cpu(), call.kv_indices[:total].cpu(), qo.cpu()


CASES: list[dict[str, Any]] = [
    {"batch": 128, "block_size": 64, "max_len": 4096},
    {"batch": 1},
    {"batch": 3, "offset": 1},
    {"batch": 17, "block_size": 1, "max_len": 33},
    {"batch": 16, "max_len": 16},
    {"batch": 5, "lens_dtype": torch.int64},
    {"batch": 5, "lens_dtype": torch.int64, "offset": 1},
    {"batch": 9, "num_blocks": None},
    {"batch": 64, "copy_qo": False, "max_len": 2048},
    {"batch": 128, "block_size": 64, "max_len": 4096, "offset": 2},
]


def test_cached_fill_writes_what_the_triton_launch_writes(
    cache_on: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    fast_before = utils.FILL_LAUNCH.fast_launches
    cached: list[tuple[torch.Tensor, ...]] = []
    for seed, case in enumerate(CASES * 2):  # the second round runs every key cached
        fill = FillCase(**case, seed=seed)
        call = fill.call()
        utils.fill_page_indices(call)
        cached.append(written(call))
        reference = fill.call()
        transforms.fill_page_indices(reference)
        for got, want, name in zip(
            cached[-1], written(reference), ("kv_indptr", "kv_indices", "qo"), strict=True
        ):
            assert torch.equal(got, want), f"{name} differs from the torch reference for {case}"
    torch.cuda.synchronize()
    assert utils.FILL_LAUNCH.fast_launches - fast_before >= len(CASES)
    through_triton(monkeypatch)
    for seed, case in enumerate(CASES * 2):
        call = FillCase(**case, seed=seed).call()
        utils.fill_page_indices(call)
        for got, want in zip(cached[seed], written(call), strict=True):
            assert torch.equal(got, want), f"the cached launch differs from Triton's for {case}"


def test_cached_planner_writes_what_the_triton_launch_writes(
    cache_on: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    def plans() -> list[tuple[torch.Tensor, ...]]:
        out = []
        for batch in (1, 64, 17, 128, 1, 64):
            gen = torch.Generator().manual_seed(batch)
            lens = torch.randint(0, 5000, (batch,), generator=gen)
            indptr = torch.zeros(batch + 1, dtype=torch.int32)
            indptr[1:] = torch.cumsum(lens, 0)
            got = SplitKVSchedule.allocate(
                max_batch=128, max_kernel_qlen=1, kernel_heads=16, kv_lora_rank=512, num_units=128,
                device=torch.device(DEVICE),
            )  # fmt: skip
            want = SplitKVSchedule.allocate(
                max_batch=128, max_kernel_qlen=1, kernel_heads=16, kv_lora_rank=512, num_units=128,
                device=torch.device(DEVICE),
            )  # fmt: skip
            schedule.plan_split_kv(got, indptr.to(DEVICE), batch)
            want.plan(indptr.to(DEVICE), batch)
            for name in ("work_info", "split_indptr", "chunk"):
                assert torch.equal(getattr(got, name), getattr(want, name)), f"{name} at B={batch}"
            out.append((got.work_info.cpu(), got.split_indptr.cpu(), got.chunk.cpu()))
        return out

    fast_before = schedule.PLAN_LAUNCH.fast_launches
    cached = plans()
    assert schedule.PLAN_LAUNCH.fast_launches > fast_before
    through_triton(monkeypatch)
    for got, want in zip(cached, plans(), strict=True):
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
