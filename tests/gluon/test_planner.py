"""The Gluon decode's launch heuristic and kernel choice, on the CPU (no GPU, no compilation)."""

from __future__ import annotations

import math

import attrs
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mla.providers.gluon.planner import (
    BLOCK_M,
    MAX_SPLITS,
    MIN_SPLIT_TOKENS,
    GluonLaunchConfig,
    check_config,
    decode_kernel,
    launch_config,
    schedule_units,
    wave_splits,
)


def _waves_per_unit(programs: int, k: int, slots: int) -> float:
    return math.ceil(programs * k / slots) / k


@given(st.integers(1, 600), st.integers(1, 264), st.integers(1, 200))
def test_wave_splits_is_the_smallest_best_split(programs: int, slots: int, cap: int) -> None:
    k = wave_splits(programs, slots=slots, cap=cap)
    assert 1 <= k <= cap
    costs = [_waves_per_unit(programs, j, slots) for j in range(1, cap + 1)]
    assert _waves_per_unit(programs, k, slots) == min(costs)
    assert costs.index(min(costs)) + 1 == k


def _cfg(**kw: object) -> GluonLaunchConfig:
    return launch_config(**{"num_sms": 132, "persistent": False, "kv_fp8": False, **kw})  # type: ignore[arg-type]


def test_launch_config_examples() -> None:
    # 64 requests of 16 rows on 132 SMs: the 16-row kernel, two splits fill one wave.
    assert _cfg(batch=64, rows=16, max_seqlen_k=4096) == GluonLaunchConfig(num_splits=2, row_tile=16)
    # 24 and 32 rows take the 32-row tile, 33 rows the 64-row kernel.
    assert _cfg(batch=8, rows=24, max_seqlen_k=512).row_tile == 32
    assert _cfg(batch=8, rows=33, max_seqlen_k=512).row_tile == BLOCK_M
    # One long request is cut into MAX_SPLITS pieces.
    assert _cfg(batch=1, rows=16, max_seqlen_k=65536).num_splits == MAX_SPLITS
    # 128 heads are two 64-row blocks: 128 programs already fill the wave.
    big = _cfg(batch=64, rows=128, max_seqlen_k=4096)
    assert big.row_blocks(128) == 2
    assert big.num_splits == 1
    # 64-row tiles run on the ping-pong kernel for 16-bit caches, on the 64-row kernel for fp8.
    assert big.pingpong
    assert not _cfg(batch=64, rows=128, max_seqlen_k=4096, kv_fp8=True).pingpong
    assert not _cfg(batch=64, rows=16, max_seqlen_k=4096).pingpong
    # 16-row tiles of an fp8 cache run on the dual-chain kernel; 32-row ones on the few-rows kernel.
    assert _cfg(batch=64, rows=16, max_seqlen_k=4096, kv_fp8=True).dual
    assert not _cfg(batch=64, rows=32, max_seqlen_k=4096, kv_fp8=True).dual
    # Persistent launches take their splits from the schedule.
    assert _cfg(batch=1, rows=16, max_seqlen_k=65536, persistent=True) == GluonLaunchConfig(row_tile=16)


@given(st.integers(1, 512), st.integers(1, 1024), st.integers(1, 1 << 17), st.integers(1, 264))
def test_split_count_respects_its_caps(batch: int, rows: int, max_seqlen_k: int, sms: int) -> None:
    configs = {
        fp8: launch_config(
            batch=batch, rows=rows, max_seqlen_k=max_seqlen_k, num_sms=sms, persistent=False, kv_fp8=fp8
        )
        for fp8 in (False, True)
    }
    for fp8, config in configs.items():
        check_config(config, kv_fp8=fp8)  # the heuristic picks only launches the kernels take
    # The cache dtype picks the kernel (64 rows: ping-pong or 64-row kernel; 16 rows: few-rows or
    # dual-chain kernel), never the tiles or the splits.
    cfg = configs[False]
    assert attrs.evolve(cfg, pingpong=False, dual=cfg.row_tile == 16) == configs[True]
    assert cfg.pingpong == (cfg.row_tile == BLOCK_M)
    assert not cfg.dual
    assert 1 <= cfg.num_splits <= MAX_SPLITS
    assert cfg.num_splits <= max(1, -(-max_seqlen_k // MIN_SPLIT_TOKENS))
    assert cfg.row_tile == (16 if rows <= 16 else 32 if rows <= 32 else BLOCK_M)
    assert cfg.row_blocks(rows) == -(-rows // cfg.row_tile)


@pytest.mark.parametrize(
    ("sms", "rows", "units"),
    [(132, 16, 128), (132, 48, 128), (132, 64, 128), (132, 128, 64), (132, 256, 32), (8, 16, 8), (1, 512, 1)],
)
def test_schedule_units_is_a_power_of_two_per_wave(sms: int, rows: int, units: int) -> None:
    assert schedule_units(num_sms=sms, rows=rows) == units
    assert schedule_units(num_sms=sms, rows=rows) <= units


def test_kernel_choice_and_reasons() -> None:
    bf16, fp16, fp8 = torch.bfloat16, torch.float16, torch.float8_e4m3fn
    assert decode_kernel(q_dtype=bf16, kv_dtype=bf16, kv_lora_rank=512, rope_dim=64)[0] == "gluon"
    assert decode_kernel(q_dtype=fp16, kv_dtype=fp16, kv_lora_rank=512, rope_dim=64)[0] == "gluon"
    kernel, why = decode_kernel(q_dtype=bf16, kv_dtype=bf16, kv_lora_rank=256, rope_dim=64)
    assert kernel == "triton"
    assert "512+64" in why
    kernel, why = decode_kernel(q_dtype=torch.float32, kv_dtype=torch.float32, kv_lora_rank=512, rope_dim=64)
    assert kernel == "triton"
    assert "query dtype" in why
    kernel, why = decode_kernel(q_dtype=bf16, kv_dtype=fp16, kv_lora_rank=512, rope_dim=64)
    assert kernel == "triton"
    assert "differs" in why
    for cache in (fp8, torch.float8_e5m2):
        kernel, why = decode_kernel(q_dtype=bf16, kv_dtype=cache, kv_lora_rank=512, rope_dim=64)
        assert kernel == "gluon"
        assert "fp8" in why
    kernel, why = decode_kernel(q_dtype=bf16, kv_dtype=fp8, kv_lora_rank=576, rope_dim=64)
    assert kernel == "triton"
    assert "512+64" in why


@pytest.mark.parametrize(
    ("config", "fp8"),
    [
        (GluonLaunchConfig(row_tile=16, transposed=False), False),  # the 64-row kernel takes 64 only
        (GluonLaunchConfig(row_tile=64, transposed=True), True),  # fp8 ring + 64 rows: no room
        (GluonLaunchConfig(row_tile=48), False),
        (GluonLaunchConfig(row_tile=16, block_n=32), False),
        (GluonLaunchConfig(row_tile=32, num_stages=3, overlap=True), False),
        (GluonLaunchConfig(pingpong=True), True),
        (GluonLaunchConfig(row_tile=32, pingpong=True), False),
        (GluonLaunchConfig(pingpong=True, num_stages=3), False),
        (GluonLaunchConfig(pingpong=True, block_n=32), False),
        (GluonLaunchConfig(row_tile=16, dual=True), False),
        (GluonLaunchConfig(row_tile=32, dual=True), True),
        (GluonLaunchConfig(dual=True), True),
        (GluonLaunchConfig(row_tile=16, dual=True, pingpong=True), True),
        (GluonLaunchConfig(row_tile=16, dual=True, fold=True), True),
        (GluonLaunchConfig(pingpong=True, fold=True), False),
        (GluonLaunchConfig(fold=True), False),
    ],
    ids=[
        "64-row-kernel-16-rows",
        "transposed-64-fp8",
        "48-rows",
        "transposed-block32",
        "transposed-overlap",
        "pingpong-fp8",
        "pingpong-32-rows",
        "pingpong-3-stages",
        "pingpong-block32",
        "dual-bf16",
        "dual-32-rows",
        "dual-64-rows",
        "dual-and-pingpong",
        "dual-fold",
        "pingpong-fold",
        "64-row-kernel-fold",
    ],
)
def test_check_config_rejects_launches_the_kernels_cannot_run(config: GluonLaunchConfig, fp8: bool) -> None:
    from mla.core.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match="config"):
        check_config(config, kv_fp8=fp8)


def test_check_config_accepts_the_kernels_tiles() -> None:
    for config, fp8 in [
        (GluonLaunchConfig(), False),
        (GluonLaunchConfig(), True),
        (GluonLaunchConfig(row_tile=16), True),
        (GluonLaunchConfig(row_tile=32, num_stages=3), True),
        (GluonLaunchConfig(row_tile=64, transposed=True), False),
        (GluonLaunchConfig(pingpong=True), False),
        (GluonLaunchConfig(row_tile=16, dual=True), True),
        (GluonLaunchConfig(row_tile=16, num_splits=8, fold=True), False),
        (GluonLaunchConfig(row_tile=32, num_splits=8, fold=True), True),
    ]:
        check_config(config, kv_fp8=fp8)
    assert GluonLaunchConfig(row_tile=32).transposed
    assert not GluonLaunchConfig().transposed
