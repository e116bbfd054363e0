"""The Gluon decode's launch heuristic and kernel choice, on the CPU (no GPU, no compilation)."""

from __future__ import annotations

import math

import attrs
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mla.core.errors import InvalidInputError
from mla.providers.gluon.planner import (
    BLOCK_M,
    DS_MLA_STAGES,
    KERNEL_TABLE,
    MAX_SPLITS,
    MIN_SPLIT_TOKENS,
    RULES,
    GluonKernel,
    GluonLaunchConfig,
    check_config,
    decode_kernel,
    few_rows_tile,
    launch_config,
    pick_kernel,
    schedule_units,
    wave_splits,
)
from mla.providers.split_kv import SPLIT_MIN_GAIN


def _waves_per_unit(programs: int, k: int, slots: int) -> float:
    return math.ceil(programs * k / slots) / k


@given(st.integers(1, 600), st.integers(1, 264), st.integers(1, 200))
def test_wave_splits_is_the_smallest_best_split(programs: int, slots: int, cap: int) -> None:
    k = wave_splits(programs, slots=slots, cap=cap)
    assert 1 <= k <= cap
    costs = [_waves_per_unit(programs, j, slots) for j in range(1, cap + 1)]
    if min(costs) <= (1 - SPLIT_MIN_GAIN) * costs[0]:
        assert _waves_per_unit(programs, k, slots) == min(costs)
        assert costs.index(min(costs)) + 1 == k
    else:  # no split saves enough to pay for its reduce
        assert k == 1


def test_wave_splits_leaves_many_programs_unsplit() -> None:
    # The sparse prefill's 65,536 programs: 2 splits save 0.1% of the waves, not worth a reduce.
    assert wave_splits(65536, slots=132, cap=8) == 1
    # 64 programs on 132 SMs: 2 splits halve the waves.
    assert wave_splits(64, slots=132, cap=8) == 2


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
    assert big.kernel is GluonKernel.PINGPONG
    assert _cfg(batch=64, rows=128, max_seqlen_k=4096, kv_fp8=True).kernel is GluonKernel.ROW64
    assert _cfg(batch=64, rows=16, max_seqlen_k=4096).kernel is GluonKernel.ROWS
    # 16-row tiles of an fp8 cache run on the dual-chain kernel; 32-row ones on the few-rows kernel.
    assert _cfg(batch=64, rows=16, max_seqlen_k=4096, kv_fp8=True).kernel is GluonKernel.DUAL
    assert _cfg(batch=64, rows=32, max_seqlen_k=4096, kv_fp8=True).kernel is GluonKernel.ROWS
    # Persistent launches take their splits from the schedule.
    assert _cfg(batch=1, rows=16, max_seqlen_k=65536, persistent=True) == GluonLaunchConfig(row_tile=16)
    # fp8_ds_mla rows: never the dual-chain kernel; 16-row tiles on the fp8_ds_mla kernel (the
    # sparse attention's H16: one query row's 16 heads a program, its own rings), 32 on the
    # few-rows kernel, 64 on the fp8_ds_mla 64-row kernel.
    ds16 = _cfg(batch=64, rows=16, max_seqlen_k=2048, kv_fp8=True, ds_mla=True)
    assert ds16 == GluonLaunchConfig(row_tile=16, kernel=GluonKernel.DS_MLA, num_splits=2)
    ds32 = _cfg(batch=64, rows=32, max_seqlen_k=2048, kv_fp8=True, ds_mla=True)
    assert (ds32.kernel, ds32.num_stages) == (GluonKernel.ROWS, 2)
    ds64 = _cfg(batch=64, rows=128, max_seqlen_k=2048, kv_fp8=True, ds_mla=True)
    assert (ds64.kernel, ds64.num_splits) == (GluonKernel.DS_MLA_HEADS, 1)
    # ... split launches too
    split64 = _cfg(batch=16, rows=128, max_seqlen_k=2048, kv_fp8=True, ds_mla=True)
    assert (split64.kernel, split64.num_splits) == (GluonKernel.DS_MLA_HEADS, 4)
    assert _cfg(batch=16, rows=128, max_seqlen_k=2048, persistent=True, kv_fp8=True, ds_mla=True).kernel is (
        GluonKernel.DS_MLA_HEADS
    )
    # The sparse benchmark's H16 B128 q2 (256 rows of 2048 slots): one split, written directly.
    assert _cfg(batch=256, rows=16, max_seqlen_k=2048, kv_fp8=True, ds_mla=True).num_splits == 1


@given(st.integers(1, 512), st.integers(1, 256), st.integers(1, 1 << 15), st.integers(1, 264), st.booleans())
def test_ds_mla_launches_are_taken_by_their_kernels(
    batch: int, rows: int, max_seqlen_k: int, sms: int, persistent: bool
) -> None:
    config = launch_config(
        batch=batch, rows=rows, max_seqlen_k=max_seqlen_k, num_sms=sms, persistent=persistent,
        kv_fp8=True, ds_mla=True,
    )  # fmt: skip
    check_config(config, kv_fp8=True, ds_mla=True)
    assert RULES[config.kernel].ds_mla
    assert (config.kernel is GluonKernel.DS_MLA) == (config.row_tile == 16)
    # Tiles and splits are those of a per-tensor fp8 cache: only the kernel differs.
    plain = launch_config(
        batch=batch, rows=rows, max_seqlen_k=max_seqlen_k, num_sms=sms, persistent=persistent, kv_fp8=True
    )
    assert attrs.evolve(plain, kernel=config.kernel) == config


def test_the_old_ds_mla_path_stays_selectable() -> None:
    """The few-rows kernel still takes 16-row fp8_ds_mla tiles when a launch names it (the
    benchmarks compare it with the fp8_ds_mla kernel), at the ring depth it measured best."""
    old = GluonLaunchConfig(row_tile=16, kernel=GluonKernel.ROWS, num_stages=DS_MLA_STAGES)
    check_config(old, kv_fp8=True, ds_mla=True)
    for tile in (16, 32):
        for overlap in (False, True):
            config = GluonLaunchConfig(
                row_tile=tile, kernel=GluonKernel.DS_MLA, overlap=overlap, num_splits=3
            )
            check_config(config, kv_fp8=True, ds_mla=True)


REFUSALS = [
    (tile, wrong_tile, kernel, fp8, why)
    for kernel, tile, wrong_tile in ((GluonKernel.DS_MLA, 16, 64), (GluonKernel.DS_MLA_HEADS, 64, 32))
    for fp8, why in (
        (False, "16-bit rows"), (True, "per-tensor fp8 rows"), (True, "row_tile"), (True, "block_n=32"),
        (True, "fold=True"),
    )
]  # fmt: skip
"""``(row tile, a tile it refuses, kernel, fp8 cache, what the refusal names)`` for the
``fp8_ds_mla`` kernels."""


@pytest.mark.parametrize(
    ("tile", "wrong_tile", "kernel", "fp8", "why"), REFUSALS, ids=[f"{r[2].value}-{r[4]}" for r in REFUSALS]
)
def test_check_config_refuses_what_the_ds_mla_kernels_cannot_run(
    tile: int, wrong_tile: int, kernel: GluonKernel, fp8: bool, why: str
) -> None:
    config = GluonLaunchConfig(row_tile=tile, kernel=kernel)
    if why == "row_tile":
        config, why = attrs.evolve(config, row_tile=wrong_tile), f"row_tile={wrong_tile}"
    elif why == "block_n=32":
        config = attrs.evolve(config, block_n=32)
    elif why == "fold=True":
        config = attrs.evolve(config, num_splits=2, fold=True)
    ds_mla = fp8 and why != "per-tensor fp8 rows"
    with pytest.raises(InvalidInputError, match="config") as caught:
        check_config(config, kv_fp8=fp8, ds_mla=ds_mla)
    assert why in str(caught.value)
    assert f"kernel={kernel.value})" in str(caught.value)


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
    fp8_kernel = {16: GluonKernel.DUAL, 32: GluonKernel.ROWS, BLOCK_M: GluonKernel.ROW64}[cfg.row_tile]
    assert attrs.evolve(cfg, kernel=fp8_kernel) == configs[True]
    assert cfg.kernel is (GluonKernel.PINGPONG if cfg.row_tile == BLOCK_M else GluonKernel.ROWS)
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
        (GluonLaunchConfig(row_tile=16, kernel=GluonKernel.ROW64), False),  # the 64-row kernel takes 64 only
        (GluonLaunchConfig(row_tile=64, kernel=GluonKernel.ROWS), True),  # fp8 ring + 64 rows: no room
        (GluonLaunchConfig(row_tile=48), False),
        (GluonLaunchConfig(row_tile=16, block_n=32), False),
        (GluonLaunchConfig(row_tile=32, num_stages=3, overlap=True), False),
        (GluonLaunchConfig(kernel=GluonKernel.PINGPONG), True),
        (GluonLaunchConfig(row_tile=32, kernel=GluonKernel.PINGPONG), False),
        (GluonLaunchConfig(kernel=GluonKernel.PINGPONG, num_stages=3), False),
        (GluonLaunchConfig(kernel=GluonKernel.PINGPONG, block_n=32), False),
        (GluonLaunchConfig(row_tile=16, kernel=GluonKernel.DUAL), False),
        (GluonLaunchConfig(row_tile=32, kernel=GluonKernel.DUAL), True),
        (GluonLaunchConfig(kernel=GluonKernel.DUAL), True),
        (GluonLaunchConfig(row_tile=16, kernel=GluonKernel.DUAL, block_n=32), True),
        (GluonLaunchConfig(row_tile=16, kernel=GluonKernel.DUAL, fold=True), True),
        (GluonLaunchConfig(kernel=GluonKernel.PINGPONG, fold=True), False),
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
        "dual-block32",
        "dual-fold",
        "pingpong-fold",
        "64-row-kernel-fold",
    ],
)
def test_check_config_rejects_launches_the_kernels_cannot_run(config: GluonLaunchConfig, fp8: bool) -> None:
    with pytest.raises(InvalidInputError, match="config") as caught:
        check_config(config, kv_fp8=fp8)
    # The message names the kernel and the kernels that would take the row tile.
    assert f"kernel={config.kernel.value}" in str(caught.value)
    assert f"kernels taking {config.row_tile}-row tiles" in str(caught.value)


def test_check_config_accepts_the_kernels_tiles() -> None:
    for config, fp8 in [
        (GluonLaunchConfig(), False),
        (GluonLaunchConfig(), True),
        (GluonLaunchConfig(row_tile=16), True),
        (GluonLaunchConfig(row_tile=32, num_stages=3), True),
        (GluonLaunchConfig(row_tile=64, kernel=GluonKernel.ROWS), False),
        (GluonLaunchConfig(kernel=GluonKernel.PINGPONG), False),
        (GluonLaunchConfig(row_tile=16, kernel=GluonKernel.DUAL), True),
        (GluonLaunchConfig(num_stages=3, overlap=True), False),
        (GluonLaunchConfig(row_tile=16, num_splits=8, fold=True), False),
        (GluonLaunchConfig(row_tile=32, num_splits=8, fold=True), True),
    ]:
        check_config(config, kv_fp8=fp8)
    assert GluonLaunchConfig(row_tile=32).kernel is GluonKernel.ROWS
    assert GluonLaunchConfig().kernel is GluonKernel.ROW64


def test_the_kernel_table_has_one_row_and_one_pick_per_case() -> None:
    """Every kernel has one row; every (row tile, cache) the heuristic can give has exactly one
    kernel picked for it, and that kernel takes it (so :func:`launch_config` never builds a
    launch :func:`check_config` refuses); a kernel is picked only where it takes the tile."""
    assert [rule.kernel for rule in KERNEL_TABLE] == list(GluonKernel)
    assert set(RULES) == set(GluonKernel)
    tiles = sorted({few_rows_tile(rows) for rows in range(1, 200)})
    assert tiles == [16, 32, BLOCK_M]
    for fp8 in (False, True):
        for tile in tiles:
            pickers = [rule.kernel for rule in KERNEL_TABLE if (tile, fp8) in rule.picked_for]
            assert len(pickers) == 1, (tile, fp8, pickers)
            assert pick_kernel(tile, kv_fp8=fp8) is pickers[0]
            check_config(GluonLaunchConfig(row_tile=tile, kernel=pickers[0]), kv_fp8=fp8)
    for rule in KERNEL_TABLE:
        for tile, fp8 in rule.picked_for:
            assert tile in rule.tiles_for(fp8), rule
    with pytest.raises(InvalidInputError, match="row_tile"):
        pick_kernel(48, kv_fp8=False)
    for tile in tiles:
        # fp8_ds_mla rows: one kernel picked for every tile, one that reads them with that tile.
        pickers = [rule.kernel for rule in KERNEL_TABLE if tile in rule.ds_mla_picked_for]
        assert len(pickers) == 1, (tile, pickers)
        kernel = pick_kernel(tile, kv_fp8=True, ds_mla=True)
        assert kernel is pickers[0]
        assert RULES[kernel].ds_mla
        check_config(GluonLaunchConfig(row_tile=tile, kernel=kernel), kv_fp8=True, ds_mla=True)
    for rule in KERNEL_TABLE:
        assert not rule.ds_mla_picked_for or rule.ds_mla, rule
        assert set(rule.ds_mla_picked_for) <= set(rule.fp8_tiles), rule
        # A kernel that reads fp8_ds_mla rows only is never picked for other rows.
        assert not (rule.ds_mla_only and (rule.tiles or rule.picked_for)), rule


@pytest.mark.parametrize("kernel", [k for k in GluonKernel if not RULES[k].ds_mla], ids=lambda k: k.value)
def test_check_config_rejects_ds_mla_on_kernels_without_it(kernel: GluonKernel) -> None:
    tile = RULES[kernel].fp8_tiles[0] if RULES[kernel].fp8_tiles else RULES[kernel].tiles[0]
    with pytest.raises(InvalidInputError, match="fp8_ds_mla rows") as info:
        check_config(GluonLaunchConfig(row_tile=tile, kernel=kernel), kv_fp8=True, ds_mla=True)
    assert info.value.argument == "config"


def test_every_kernel_has_a_launcher() -> None:
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    from mla.providers.gluon.decode import LAUNCHERS

    assert set(LAUNCHERS) == set(GluonKernel)
