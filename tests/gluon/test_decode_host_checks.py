"""The Gluon decode launcher's own checks (:func:`launch_gluon_decode`), which run on the host
before any kernel is compiled or launched: an ``fp8_ds_mla`` cache read with a query that is not
bf16 (its rope lanes are bf16) and a per-tensor fp8 cache without its scale are refused naming
the argument. CPU tensors; nothing reaches Triton.
"""

from __future__ import annotations

import torch
from rejections import expect_invalid

from mla.core.config import ds_mla_row_bytes
from mla.providers.gluon.decode import launch_gluon_decode
from mla.providers.gluon.planner import launch_config
from mla.providers.triton.decode_launch import DecodeInputs

RANK, ROPE, HEADS, REQUESTS, KEYS = 512, 64, 16, 2, 64
E4M3 = torch.float8_e4m3fn


def _launch(q_dtype: torch.dtype, cache: torch.Tensor, kv_scale: torch.Tensor | None) -> None:
    q = torch.zeros(REQUESTS, HEADS, RANK + ROPE, dtype=q_dtype)
    ds_mla = cache.shape[1] == ds_mla_row_bytes(RANK, ROPE)
    inputs = DecodeInputs(
        q[..., :RANK], q[..., RANK:], cache, torch.arange(0, (REQUESTS + 1) * KEYS, KEYS, dtype=torch.int32),
        torch.zeros(REQUESTS * KEYS, dtype=torch.int32), None, REQUESTS, 1, KEYS, RANK**-0.5, kv_scale,
        torch.zeros(REQUESTS, HEADS, RANK, dtype=torch.bfloat16), None, None,
    )  # fmt: skip
    config = launch_config(
        batch=REQUESTS,
        rows=HEADS,
        max_seqlen_k=KEYS,
        num_sms=132,
        persistent=False,
        kv_fp8=True,
        ds_mla=ds_mla,
    )
    launch_gluon_decode(inputs, config)


def test_fp8_ds_mla_rows_need_a_bf16_query() -> None:
    rows = torch.zeros(REQUESTS * KEYS, ds_mla_row_bytes(RANK, ROPE), dtype=torch.uint8).view(E4M3)
    expect_invalid("q", lambda: _launch(torch.float16, rows, None), "bf16 rope lanes")


def test_a_per_tensor_fp8_cache_needs_its_scale() -> None:
    rows = torch.zeros(REQUESTS * KEYS, RANK + ROPE, dtype=E4M3)
    expect_invalid("kv_scale", lambda: _launch(torch.bfloat16, rows, None), "per-tensor scale")
