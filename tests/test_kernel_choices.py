"""The decode kernel choices, pinned: a golden table over (cache dtype, heads, qlen).

The choices were measured on the H200 (the Gluon kernel table of
:mod:`mla.providers.gluon.planner`, the Triton tile table of :mod:`mla.providers.triton.schedule`);
a change to either shows here as a diff of this table, which the change must then explain.
Pure host logic: no GPU, no compilation.
"""

from __future__ import annotations

import pytest
import torch

from mla.providers.gluon.planner import GluonLaunchConfig, decode_kernel, launch_config
from mla.providers.gluon.planner import schedule_units as gluon_units
from mla.providers.triton.schedule import decode_launch_config
from mla.providers.triton.schedule import schedule_units as triton_units

BATCH, SEQ, SMS = 64, 4096, 132
"""The non-persistent splits are for 64 requests of 4096 tokens on the H200's 132 SMs; ``u`` is
the persistent planner's unit count for the same rows."""
HEADS = (1, 8, 12, 16, 24, 32, 64, 128)
QLENS = (1, 2, 3, 4, 8)

GOLDEN = """
    bf16 H1   q1  gluon rows     16 x2  u128  triton 16 64 w4 s2 -   x4  u256
    bf16 H1   q2  gluon rows     16 x2  u128  triton 16 64 w4 s2 -   x4  u256
    bf16 H1   q3  gluon rows     16 x2  u128  triton 16 64 w4 s2 -   x4  u256
    bf16 H1   q4  gluon rows     16 x2  u128  triton 16 64 w4 s2 -   x4  u256
    bf16 H1   q8  gluon rows     16 x2  u128  triton 16 64 w4 s2 -   x4  u256
    bf16 H8   q1  gluon rows     16 x2  u128  triton 16 64 w4 s2 -   x4  u256
    bf16 H8   q2  gluon rows     16 x2  u128  triton 16 64 w4 s2 -   x4  u256
    bf16 H8   q3  gluon rows     32 x2  u128  triton 32 64 w8 s2 -   x2  u128
    bf16 H8   q4  gluon rows     32 x2  u128  triton 32 64 w8 s2 -   x2  u128
    bf16 H8   q8  gluon pingpong 64 x2  u128  triton 64 64 w8 s2 -   x2  u128
    bf16 H12  q1  gluon rows     16 x2  u128  triton 16 64 w4 s2 -   x4  u256
    bf16 H12  q2  gluon rows     32 x2  u128  triton 32 64 w8 s2 -   x2  u128
    bf16 H12  q3  gluon pingpong 64 x2  u128  triton 64 64 w8 s2 -   x2  u128
    bf16 H12  q4  gluon pingpong 64 x2  u128  triton 64 64 w8 s2 -   x2  u128
    bf16 H12  q8  gluon pingpong 64 x1  u64   triton 64 64 w8 s2 -   x1  u64
    bf16 H16  q1  gluon rows     16 x2  u128  triton 16 64 w4 s2 -   x4  u256
    bf16 H16  q2  gluon rows     32 x2  u128  triton 32 64 w8 s2 -   x2  u128
    bf16 H16  q3  gluon pingpong 64 x2  u128  triton 64 64 w8 s2 -   x2  u128
    bf16 H16  q4  gluon pingpong 64 x2  u128  triton 64 64 w8 s2 -   x2  u128
    bf16 H16  q8  gluon pingpong 64 x1  u64   triton 64 64 w8 s2 -   x1  u64
    bf16 H24  q1  gluon rows     32 x2  u128  triton 32 64 w8 s2 -   x2  u128
    bf16 H24  q2  gluon pingpong 64 x2  u128  triton 64 64 w8 s2 -   x2  u128
    bf16 H24  q3  gluon pingpong 64 x1  u64   triton 64 64 w8 s2 -   x1  u64
    bf16 H24  q4  gluon pingpong 64 x1  u64   triton 64 64 w8 s2 -   x1  u64
    bf16 H24  q8  gluon pingpong 64 x11 u32   triton 64 64 w8 s2 -   x11 u32
    bf16 H32  q1  gluon rows     32 x2  u128  triton 32 64 w8 s2 -   x2  u128
    bf16 H32  q2  gluon pingpong 64 x2  u128  triton 64 64 w8 s2 -   x2  u128
    bf16 H32  q3  gluon pingpong 64 x1  u64   triton 64 64 w8 s2 -   x1  u64
    bf16 H32  q4  gluon pingpong 64 x1  u64   triton 64 64 w8 s2 -   x1  u64
    bf16 H32  q8  gluon pingpong 64 x1  u32   triton 64 64 w8 s2 -   x1  u32
    bf16 H64  q1  gluon pingpong 64 x2  u128  triton 64 64 w8 s2 -   x2  u128
    bf16 H64  q2  gluon pingpong 64 x1  u64   triton 64 64 w8 s2 -   x1  u64
    bf16 H64  q3  gluon pingpong 64 x11 u32   triton 64 64 w8 s2 -   x11 u32
    bf16 H64  q4  gluon pingpong 64 x1  u32   triton 64 64 w8 s2 -   x1  u32
    bf16 H64  q8  gluon pingpong 64 x1  u16   triton 64 64 w8 s2 -   x1  u16
    bf16 H128 q1  gluon pingpong 64 x1  u64   triton 64 64 w8 s2 -   x1  u64
    bf16 H128 q2  gluon pingpong 64 x1  u32   triton 64 64 w8 s2 -   x1  u32
    bf16 H128 q3  gluon pingpong 64 x1  u16   triton 64 64 w8 s2 -   x1  u16
    bf16 H128 q4  gluon pingpong 64 x1  u16   triton 64 64 w8 s2 -   x1  u16
    bf16 H128 q8  gluon pingpong 64 x1  u8    triton 64 64 w8 s2 -   x1  u8
    fp8  H1   q1  gluon dual     16 x2  u128  triton 16 64 w8 s1 reg x2  u256
    fp8  H1   q2  gluon dual     16 x2  u128  triton 16 64 w8 s1 reg x2  u256
    fp8  H1   q3  gluon dual     16 x2  u128  triton 16 64 w8 s1 reg x2  u256
    fp8  H1   q4  gluon dual     16 x2  u128  triton 16 64 w8 s1 reg x2  u256
    fp8  H1   q8  gluon dual     16 x2  u128  triton 16 64 w8 s1 reg x2  u256
    fp8  H8   q1  gluon dual     16 x2  u128  triton 16 64 w8 s1 reg x2  u256
    fp8  H8   q2  gluon dual     16 x2  u128  triton 16 64 w8 s1 reg x2  u256
    fp8  H8   q3  gluon rows     32 x2  u128  triton 32 32 w8 s1 reg x2  u128
    fp8  H8   q4  gluon rows     32 x2  u128  triton 32 32 w8 s1 reg x2  u128
    fp8  H8   q8  gluon row64    64 x2  u128  triton 64 32 w8 s1 reg x2  u128
    fp8  H12  q1  gluon dual     16 x2  u128  triton 16 64 w8 s1 reg x2  u256
    fp8  H12  q2  gluon rows     32 x2  u128  triton 32 32 w8 s1 reg x2  u128
    fp8  H12  q3  gluon row64    64 x2  u128  triton 64 32 w8 s1 reg x2  u128
    fp8  H12  q4  gluon row64    64 x2  u128  triton 64 32 w8 s1 reg x2  u128
    fp8  H12  q8  gluon row64    64 x1  u64   triton 64 32 w8 s1 reg x1  u64
    fp8  H16  q1  gluon dual     16 x2  u128  triton 16 64 w8 s1 reg x2  u256
    fp8  H16  q2  gluon rows     32 x2  u128  triton 32 32 w8 s1 reg x2  u128
    fp8  H16  q3  gluon row64    64 x2  u128  triton 64 32 w8 s1 reg x2  u128
    fp8  H16  q4  gluon row64    64 x2  u128  triton 64 32 w8 s1 reg x2  u128
    fp8  H16  q8  gluon row64    64 x1  u64   triton 64 32 w8 s1 reg x1  u64
    fp8  H24  q1  gluon rows     32 x2  u128  triton 32 32 w8 s1 reg x2  u128
    fp8  H24  q2  gluon row64    64 x2  u128  triton 64 32 w8 s1 reg x2  u128
    fp8  H24  q3  gluon row64    64 x1  u64   triton 64 32 w8 s1 reg x1  u64
    fp8  H24  q4  gluon row64    64 x1  u64   triton 64 32 w8 s1 reg x1  u64
    fp8  H24  q8  gluon row64    64 x11 u32   triton 64 32 w8 s1 reg x11 u32
    fp8  H32  q1  gluon rows     32 x2  u128  triton 32 32 w8 s1 reg x2  u128
    fp8  H32  q2  gluon row64    64 x2  u128  triton 64 32 w8 s1 reg x2  u128
    fp8  H32  q3  gluon row64    64 x1  u64   triton 64 32 w8 s1 reg x1  u64
    fp8  H32  q4  gluon row64    64 x1  u64   triton 64 32 w8 s1 reg x1  u64
    fp8  H32  q8  gluon row64    64 x1  u32   triton 64 32 w8 s1 reg x1  u32
    fp8  H64  q1  gluon row64    64 x2  u128  triton 64 32 w8 s1 reg x2  u128
    fp8  H64  q2  gluon row64    64 x1  u64   triton 64 32 w8 s1 reg x1  u64
    fp8  H64  q3  gluon row64    64 x11 u32   triton 64 32 w8 s1 reg x11 u32
    fp8  H64  q4  gluon row64    64 x1  u32   triton 64 32 w8 s1 reg x1  u32
    fp8  H64  q8  gluon row64    64 x1  u16   triton 64 32 w8 s1 reg x1  u16
    fp8  H128 q1  gluon row64    64 x1  u64   triton 64 32 w8 s1 reg x1  u64
    fp8  H128 q2  gluon row64    64 x1  u32   triton 64 32 w8 s1 reg x1  u32
    fp8  H128 q3  gluon row64    64 x1  u16   triton 64 32 w8 s1 reg x1  u16
    fp8  H128 q4  gluon row64    64 x1  u16   triton 64 32 w8 s1 reg x1  u16
    fp8  H128 q8  gluon row64    64 x1  u8    triton 64 32 w8 s1 reg x1  u8
"""
"""``cache H q  gluon <kernel> <row tile> x<splits> u<units>  triton <block_m> <block_n> w<warps>
s<stages> <reg pipeline> x<splits> u<units>``."""

ROUTES = {
    (torch.bfloat16, torch.bfloat16): "gluon",
    (torch.float16, torch.float16): "gluon",
    (torch.bfloat16, torch.float8_e4m3fn): "gluon",
    (torch.float16, torch.float8_e5m2): "gluon",
    (torch.bfloat16, torch.float16): "triton",
    (torch.float32, torch.float32): "triton",
}
"""(query dtype, cache dtype) -> the kernel family the gluon provider routes a 512+64 decode to."""


def _kernel(config: GluonLaunchConfig) -> str:
    return config.kernel.value


def choices() -> str:
    lines = []
    for kv in ("bf16", "fp8"):
        fp8 = kv == "fp8"
        for heads in HEADS:
            for qlen in QLENS:
                rows = heads * qlen
                g = launch_config(
                    batch=BATCH, rows=rows, max_seqlen_k=SEQ, num_sms=SMS, persistent=False, kv_fp8=fp8
                )
                t = decode_launch_config(
                    batch=BATCH, rows=rows, max_seqlen_k=SEQ, num_sms=SMS, kv_elem_size=1 if fp8 else 2,
                    persistent=False,
                )  # fmt: skip
                reg = "reg" if t.reg_pipeline else "-  "
                g_units, t_units = gluon_units(num_sms=SMS, rows=rows), triton_units(num_sms=SMS, rows=rows)
                line = (
                    f"    {kv:4} H{heads:<3} q{qlen}  gluon {_kernel(g):8} {g.row_tile:2} x{g.num_splits:<2} "
                    f"u{g_units:<3}  triton {t.block_m:2} {t.block_n} w{t.num_warps} "
                    f"s{t.num_stages} {reg} x{t.num_splits:<2} u{t_units}"
                )
                lines.append(line.rstrip())
    return "\n".join(lines)


def test_the_kernel_choices_are_the_golden_table() -> None:
    assert choices() == GOLDEN.strip("\n")


SPARSE_HEADS = (8, 16, 32, 64, 128)
SPARSE_ROWS = (1, 16, 64, 256)
TOPK = 2048

SPARSE_GOLDEN = """
    H8   R1    ds_mla       16 x8
    H8   R16   ds_mla       16 x8
    H8   R64   ds_mla       16 x2
    H8   R256  ds_mla       16 x1
    H16  R1    ds_mla       16 x8
    H16  R16   ds_mla       16 x8
    H16  R64   ds_mla       16 x2
    H16  R256  ds_mla       16 x1
    H32  R1    rows         32 x8
    H32  R16   rows         32 x8
    H32  R64   rows         32 x2
    H32  R256  rows         32 x1
    H64  R1    ds_mla_heads 64 x8
    H64  R16   ds_mla_heads 64 x8
    H64  R64   ds_mla_heads 64 x2
    H64  R256  ds_mla_heads 64 x1
    H128 R1    ds_mla_heads 64 x8
    H128 R16   ds_mla_heads 64 x4
    H128 R64   ds_mla_heads 64 x1
    H128 R256  ds_mla_heads 64 x1
"""
"""The Gluon sparse decode over ``fp8_ds_mla`` rows: ``H<heads> R<query rows>  <kernel> <row tile>
x<splits>`` (each query row a qlen-1 request over its ``TOPK`` slots, as the sparse attention
launches it)."""


def sparse_choices() -> str:
    lines = []
    for heads in SPARSE_HEADS:
        for rows in SPARSE_ROWS:
            g = launch_config(
                batch=rows, rows=heads, max_seqlen_k=TOPK, num_sms=SMS, persistent=False, kv_fp8=True,
                ds_mla=True,
            )  # fmt: skip
            lines.append(f"    H{heads:<3} R{rows:<3}  {_kernel(g):12} {g.row_tile:2} x{g.num_splits}")
    return "\n".join(lines)


def test_the_sparse_kernel_choices_are_the_golden_table() -> None:
    assert sparse_choices() == SPARSE_GOLDEN.strip("\n")


@pytest.mark.parametrize(("dtypes", "route"), ROUTES.items(), ids=[f"{q}-{kv}" for q, kv in ROUTES])
def test_the_gluon_provider_routes_by_dtype(dtypes: tuple[torch.dtype, torch.dtype], route: str) -> None:
    q_dtype, kv_dtype = dtypes
    assert decode_kernel(q_dtype=q_dtype, kv_dtype=kv_dtype, kv_lora_rank=512, rope_dim=64)[0] == route


def test_persistent_launches_keep_the_tile_and_take_no_splits() -> None:
    for fp8 in (False, True):
        for rows in (1, 16, 17, 32, 33, 64, 512):
            auto = launch_config(
                batch=BATCH, rows=rows, max_seqlen_k=SEQ, num_sms=SMS, persistent=False, kv_fp8=fp8
            )
            persistent = launch_config(
                batch=BATCH, rows=rows, max_seqlen_k=SEQ, num_sms=SMS, persistent=True, kv_fp8=fp8
            )
            assert persistent.num_splits == 1
            assert (persistent.row_tile, _kernel(persistent)) == (auto.row_tile, _kernel(auto))
