"""The Gluon decode launch path on a CPU: every kernel variant compiled for sm_90, every launch
recorded.

Gluon kernels have no interpreter, so the GPU tests are the only ones that run them; this test
runs everything up to the driver call on a machine without a GPU: ``launch_gluon_decode``
(arguments, constexprs, grid), Triton's compiler for sm_90 (a variant that does not compile,
or that needs more shared memory than an H100/H200 has, fails here), and the split reduce's
launch. The stand-in driver of :mod:`mla.testing.triton_driver` records the launches instead of
making them. It runs in a subprocess because the test session interprets Triton
(``TRITON_INTERPRET=1``), which cannot compile.
"""

from __future__ import annotations

import json
import textwrap

import pytest
from sm90_compile import run_without_interpreter

pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")

pytestmark = pytest.mark.heavy  # (its fixture compiles every variant for sm_90 in a process of its own)

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    from mla.providers.calls import SparseAttentionCall
    from mla.providers.gluon.decode import launch_gluon_decode
    from mla.providers.gluon.provider import GluonProvider
    from mla.providers.gluon.planner import GluonKernel, GluonLaunchConfig
    from mla.providers.split_kv import SplitKVSchedule
    from mla.providers.triton.decode_launch import BlockTableKeys, DecodeInputs
    from mla.testing.triton_driver import stand_in_driver

    RANK, ROPE = 512, 64

    def launch(heads, qlens, lens, fp8, config, scheduled=False, table=False):
        tokens = sum(qlens)
        q = torch.zeros(tokens, heads, RANK + ROPE, dtype=torch.bfloat16)
        # fp8 == "ds_mla": fp8_ds_mla byte rows (656 bytes) as the kernels see them, an e4m3 view.
        width = 656 if fp8 == "ds_mla" else RANK + ROPE
        cache = torch.zeros(sum(lens) + 64, width, dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16)
        fp8 = fp8 is True
        schedule = None
        if scheduled:
            schedule = SplitKVSchedule.allocate(
                max_batch=len(lens), max_kernel_qlen=max(qlens), kernel_heads=heads,
                kv_lora_rank=RANK, num_units=8, device=torch.device("cpu"))
        # table: the keys through a [B, max_blocks] block table of 64-token pages.
        keys = (torch.zeros(len(lens), -(-max(lens) // 64), dtype=torch.int32) if table
                else torch.zeros(sum(lens), dtype=torch.int32))
        inputs = DecodeInputs(
            q[..., :RANK], q[..., RANK:], cache,
            torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32),
            keys,
            torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32),
            len(lens), max(qlens), max(lens), 0.07, torch.ones(1) if fp8 else None,
            torch.zeros(tokens, heads, RANK, dtype=torch.bfloat16), torch.zeros(tokens, heads), schedule,
            BlockTableKeys(64, None) if table else None)
        launch_gluon_decode(inputs, config)

    cases = {
        "few16-bf16-split2": (16, [1, 1], [300, 70], False, GluonLaunchConfig(row_tile=16, num_splits=2)),
        "few32-fp8-direct": (16, [2, 2], [300, 70], True, GluonLaunchConfig(row_tile=32)),
        "few16-fp8-split3": (8, [1, 1, 1], [900, 5, 64], True, GluonLaunchConfig(row_tile=16, num_splits=3)),
        "row64-bf16-direct": (16, [4, 4], [300, 70], False, GluonLaunchConfig()),
        "row64-fp8-split2": (128, [1, 1], [300, 70], True, GluonLaunchConfig(num_splits=2)),
        "t64-bf16-direct": (16, [4], [300], False, GluonLaunchConfig(row_tile=64, kernel=GluonKernel.ROWS)),
        "few16-bf16-scheduled": (16, [1, 1], [300, 70], False, GluonLaunchConfig(row_tile=16), True),
        "few16-bf16-fold4": (
            16, [1, 1], [300, 70], False, GluonLaunchConfig(row_tile=16, num_splits=4, fold=True)
        ),
        "few32-fp8-fold2": (
            16, [2, 2], [300, 70], True, GluonLaunchConfig(row_tile=32, num_splits=2, fold=True)
        ),
        "pingpong-bf16-split2": (
            16, [4, 4], [300, 70], False, GluonLaunchConfig(kernel=GluonKernel.PINGPONG, num_splits=2)
        ),
        "dual-fp8-direct": (
            16, [1, 1], [300, 70], True, GluonLaunchConfig(row_tile=16, kernel=GluonKernel.DUAL)
        ),
        "dual-fp8-split3": (
            8, [1, 1, 1], [900, 5, 64], True,
            GluonLaunchConfig(row_tile=16, kernel=GluonKernel.DUAL, num_splits=3)
        ),
        "dual-fp8-scheduled": (
            16, [1, 1], [300, 70], True, GluonLaunchConfig(row_tile=16, kernel=GluonKernel.DUAL), True
        ),
        # Keys through the block table (the engine's paged decode on the gluon provider).
        "table-few16-bf16-split2": (
            16, [1, 1], [300, 70], False, GluonLaunchConfig(row_tile=16, num_splits=2), False, True
        ),
        "table-row64-fp8-direct": (128, [1, 1], [300, 70], True, GluonLaunchConfig(), False, True),
        "table-pingpong-bf16": (
            16, [4, 4], [300, 70], False, GluonLaunchConfig(kernel=GluonKernel.PINGPONG), False, True
        ),
        "table-dual-fp8-split3": (
            8, [1, 1, 1], [900, 5, 64], True,
            GluonLaunchConfig(row_tile=16, kernel=GluonKernel.DUAL, num_splits=3), False, True
        ),
        # fp8_ds_mla rows on their own kernel (16 and 32 rows, serial or overlapped MMAs) and on
        # the few-rows kernel (the old path, named explicitly).
        "dsmla16-direct": (
            16, [1, 1], [2048, 70], "ds_mla", GluonLaunchConfig(row_tile=16, kernel=GluonKernel.DS_MLA)
        ),
        "dsmla16-overlap-split3": (
            8, [1, 1, 1], [900, 5, 64], "ds_mla",
            GluonLaunchConfig(row_tile=16, kernel=GluonKernel.DS_MLA, num_splits=3, overlap=True)
        ),
        "dsmla16-scheduled": (
            16, [1, 1], [300, 70], "ds_mla", GluonLaunchConfig(row_tile=16, kernel=GluonKernel.DS_MLA), True
        ),
        "dsmla32-split2": (
            32, [1, 1], [300, 70], "ds_mla",
            GluonLaunchConfig(row_tile=32, kernel=GluonKernel.DS_MLA, num_splits=2)
        ),
        "dsmla32-overlap": (
            16, [2, 2], [300, 70], "ds_mla",
            GluonLaunchConfig(row_tile=32, kernel=GluonKernel.DS_MLA, overlap=True)
        ),
        "rows16-dsmla-split2": (
            16, [1, 1], [300, 70], "ds_mla",
            GluonLaunchConfig(row_tile=16, kernel=GluonKernel.ROWS, num_stages=3, num_splits=2)
        ),
        # 64-row tiles of fp8_ds_mla rows: their own kernel (split, scheduled, over a block
        # table), and the 64-row kernel when a launch names it.
        "dsmla64-split2": (
            128, [1, 1], [300, 70], "ds_mla",
            GluonLaunchConfig(row_tile=64, kernel=GluonKernel.DS_MLA_HEADS, num_splits=2)
        ),
        "dsmla64-scheduled": (
            64, [1, 1], [300, 70], "ds_mla", GluonLaunchConfig(row_tile=64, kernel=GluonKernel.DS_MLA_HEADS),
            True,
        ),
        "dsmla64-table": (
            32, [2, 2], [300, 70], "ds_mla", GluonLaunchConfig(row_tile=64, kernel=GluonKernel.DS_MLA_HEADS),
            False, True,
        ),
        "row64-dsmla-direct": (
            128, [1, 1], [300, 70], "ds_mla", GluonLaunchConfig(row_tile=64, kernel=GluonKernel.ROW64)
        ),
    }
    def sparse(heads, rows, kv_format):
        q = torch.zeros(rows, heads, RANK + ROPE, dtype=torch.bfloat16)
        width, dtype = {"ds_mla": (656, torch.uint8), "fp8": (576, torch.float8_e4m3fn),
                        "bf16": (576, torch.bfloat16)}[kv_format]
        call = SparseAttentionCall(
            q=q, kv_cache=torch.zeros(4096, width, dtype=dtype),
            slots=torch.zeros(rows, 2048, dtype=torch.int32),
            out=torch.zeros(rows, heads, RANK, dtype=torch.bfloat16), lse=torch.zeros(rows, heads),
            kv_lora_rank=RANK, rope_dim=ROPE, softmax_scale=0.07,
            kv_scale=torch.ones(1) if kv_format == "fp8" else None)
        GluonProvider().sparse_attention(call)

    sparse_cases = {
        "sparse-dsmla-h8": (8, 4, "ds_mla"),
        "sparse-dsmla-h16": (16, 4, "ds_mla"),
        "sparse-dsmla-h32": (32, 4, "ds_mla"),
        "sparse-dsmla-h128": (128, 16, "ds_mla"),
        "sparse-bf16-h16": (16, 4, "bf16"),
        "sparse-fp8-h64": (64, 16, "fp8"),
    }
    out = {}
    with stand_in_driver(compile_kernels=True) as driver:
        for name, args in cases.items():
            driver.launches.clear()
            launch(*args)
            out[name] = [[l.function[1], list(l.grid)] for l in driver.launches]
        for name, args in sparse_cases.items():
            driver.launches.clear()
            sparse(*args)
            out[name] = [[l.function[1], list(l.grid)] for l in driver.launches]
    json.dump(out, sys.stdout)
    """
)


@pytest.fixture(scope="module")
def launches() -> dict[str, list[list[object]]]:
    stdout = run_without_interpreter(["-c", SCRIPT])
    result: dict[str, list[list[object]]] = json.loads(stdout.strip().splitlines()[-1])
    return result


DECODE_ROWS, DECODE_64, MERGE = "mla_decode_rows_kernel", "mla_decode_kernel", "_merge_splits_kernel"
DUAL = "mla_decode_dual_kernel"
DS_MLA = "mla_decode_ds_mla_kernel"
DS_MLA_HEADS = "mla_decode_ds_mla_heads_kernel"


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        # 2 requests x 2 splits, one 16-row block; the reduce runs (split launches).
        ("few16-bf16-split2", [DECODE_ROWS, MERGE]),
        # 2 requests x 32 rows (16 heads x qlen 2), one split: written directly, no reduce.
        ("few32-fp8-direct", [DECODE_ROWS]),
        ("few16-fp8-split3", [DECODE_ROWS, MERGE]),
        ("row64-bf16-direct", [DECODE_64]),
        ("row64-fp8-split2", [DECODE_64, MERGE]),
        ("t64-bf16-direct", [DECODE_ROWS]),
        # The planned schedule always launches the reduce (it skips requests with one item).
        ("few16-bf16-scheduled", [DECODE_ROWS, MERGE]),
        # The reduce folded into the kernel: one launch (2 requests x 4 splits = 8 programs, on
        # the 8 SMs the CPU reports).
        ("few16-bf16-fold4", [DECODE_ROWS]),
        ("few32-fp8-fold2", [DECODE_ROWS]),
        ("pingpong-bf16-split2", ["mla_decode_pingpong_kernel", MERGE]),
        ("dual-fp8-direct", [DUAL]),
        ("dual-fp8-split3", [DUAL, MERGE]),
        ("dual-fp8-scheduled", [DUAL, MERGE]),
        ("table-few16-bf16-split2", [DECODE_ROWS, MERGE]),
        ("table-row64-fp8-direct", [DECODE_64]),
        ("table-pingpong-bf16", ["mla_decode_pingpong_kernel"]),
        ("table-dual-fp8-split3", [DUAL, MERGE]),
        ("dsmla16-direct", [DS_MLA]),
        ("dsmla16-overlap-split3", [DS_MLA, MERGE]),
        ("dsmla16-scheduled", [DS_MLA, MERGE]),
        ("dsmla32-split2", [DS_MLA, MERGE]),
        ("dsmla32-overlap", [DS_MLA]),
        ("rows16-dsmla-split2", [DECODE_ROWS, MERGE]),
        ("dsmla64-split2", [DS_MLA_HEADS, MERGE]),
        ("dsmla64-scheduled", [DS_MLA_HEADS, MERGE]),
        ("dsmla64-table", [DS_MLA_HEADS]),
        ("row64-dsmla-direct", [DECODE_64]),
        # Sparse attention: each query row a qlen-1 request over its 2048 slots; fp8_ds_mla rows
        # dequantized by their tile scales in the fp8_ds_mla kernel (16 rows), the few-rows
        # kernel (32) or the fp8_ds_mla 64-row kernel. 4 rows on the 8 SMs the CPU reports split
        # their slot lists in two.
        ("sparse-dsmla-h8", [DS_MLA, MERGE]),
        ("sparse-dsmla-h16", [DS_MLA, MERGE]),
        ("sparse-dsmla-h32", [DECODE_ROWS, MERGE]),
        ("sparse-dsmla-h128", [DS_MLA_HEADS]),
        ("sparse-bf16-h16", [DECODE_ROWS, MERGE]),
        ("sparse-fp8-h64", [DECODE_64]),
    ],
)
def test_every_gluon_variant_compiles_and_launches(
    launches: dict[str, list[list[object]]], case: str, expected: list[str]
) -> None:
    assert [name for name, _grid in launches[case]] == expected


def test_decode_grids_are_work_items_times_row_blocks(launches: dict[str, list[list[object]]]) -> None:
    # One program per (work item, row block): requests x splits for the split launches.
    assert launches["few16-bf16-split2"][0][1] == [2 * 2 * 1, 1, 1]
    assert launches["few32-fp8-direct"][0][1] == [2, 1, 1]
    assert launches["few16-fp8-split3"][0][1] == [3 * 3, 1, 1]
    assert launches["row64-bf16-direct"][0][1] == [2, 1, 1]
    # 128 heads are two 64-row blocks per work item.
    assert launches["row64-fp8-split2"][0][1] == [2 * 2 * 2, 1, 1]
    assert launches["dual-fp8-split3"][0][1] == [3 * 3, 1, 1]
    assert launches["few16-bf16-fold4"][0][1] == [2 * 4, 1, 1]
    assert launches["dsmla16-direct"][0][1] == [2, 1, 1]
    assert launches["dsmla16-overlap-split3"][0][1] == [3 * 3, 1, 1]
    # 32 heads x qlen 1 in one 32-row block; 16 heads x qlen 2 too.
    assert launches["dsmla32-split2"][0][1] == [2 * 2, 1, 1]
    assert launches["dsmla32-overlap"][0][1] == [2, 1, 1]
    assert launches["sparse-dsmla-h16"][0][1] == [4 * 2, 1, 1]


def test_tma_boxes_cover_the_cache_rows() -> None:
    import torch

    from mla.providers.gluon.decode import _kv_box_descriptors

    lat, rope = _kv_box_descriptors(torch.zeros(256, 576, dtype=torch.float8_e4m3fn), 512, 64)
    assert (lat.block_shape, rope.block_shape) == ([64, 128], [64, 64])
    assert lat.shape == rope.shape == [256, 576]
    assert lat.strides == rope.strides == [576, 1]
