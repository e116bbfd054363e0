"""The Triton sparse attention's host checks (:func:`mla.providers.triton.sparse.sparse_attention`),
which run before any kernel: ``fp8_ds_mla`` rows of a rank that is not whole 128-wide tiles, of
the wrong byte count or off 4-byte boundaries, a per-tensor fp8 cache without its scale and
operands with a strided last dim are refused naming the argument. CPU tensors.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from layouts import strided_last_dim
from rejections import expect_invalid

from mla.core.config import DS_MLA_DTYPE, ds_mla_row_bytes
from mla.providers.calls import SparseAttentionCall
from mla.providers.triton.sparse import sparse_attention

RANK, ROPE, HEADS, ROWS, TOPK, SLOTS = 128, 64, 4, 3, 8, 32


def _call(**changes: Any) -> SparseAttentionCall:
    """A valid ``fp8_ds_mla`` call, changed."""
    values: dict[str, Any] = {
        "q": torch.zeros(ROWS, HEADS, RANK + ROPE, dtype=torch.bfloat16),
        "kv_cache": torch.zeros(SLOTS, ds_mla_row_bytes(RANK, ROPE), dtype=DS_MLA_DTYPE),
        "slots": torch.zeros(ROWS, TOPK, dtype=torch.int32),
        "out": torch.full((ROWS, HEADS, RANK), math.nan, dtype=torch.bfloat16),
        "lse": None,
        "kv_lora_rank": RANK,
        "rope_dim": ROPE,
        "softmax_scale": (RANK + ROPE) ** -0.5,
        "kv_scale": None,
    }
    values.update(changes)
    return SparseAttentionCall(**values)


def _misaligned_rows() -> torch.Tensor:
    """``fp8_ds_mla`` rows of the right width whose row stride is not a multiple of 4 bytes."""
    width = ds_mla_row_bytes(RANK, ROPE)
    return torch.zeros(SLOTS, width + 1, dtype=torch.uint8)[:, :width].view(DS_MLA_DTYPE)


BAD_CALLS: dict[str, tuple[str, Any, str]] = {
    "rank-not-whole-tiles": (
        "kv_lora_rank",
        lambda: _call(
            q=torch.zeros(ROWS, HEADS, 96 + ROPE, dtype=torch.bfloat16),
            kv_cache=torch.zeros(SLOTS, 96 + 4 + 2 * ROPE, dtype=DS_MLA_DTYPE),
            out=torch.full((ROWS, HEADS, 96), math.nan, dtype=torch.bfloat16),
            kv_lora_rank=96,
        ),
        "multiple of 128",
    ),
    "row-bytes": (
        "kv_cache",
        lambda: _call(kv_cache=torch.zeros(SLOTS, ds_mla_row_bytes(RANK, ROPE) - 16, dtype=DS_MLA_DTYPE)),
        "bytes",
    ),
    "rows-misaligned": ("kv_cache", lambda: _call(kv_cache=_misaligned_rows()), "4-byte aligned"),
    "fp8-without-scale": (
        "kv_scale",
        lambda: _call(kv_cache=torch.zeros(SLOTS, RANK + ROPE, dtype=torch.float8_e4m3fn)),
        "needs its kv_scale",
    ),
    "q-strided": (
        "q",
        lambda: _call(q=strided_last_dim(torch.zeros(ROWS, HEADS, RANK + ROPE, dtype=torch.bfloat16))),
        "last dim must be contiguous",
    ),
    "slots-strided": (
        "slots",
        lambda: _call(slots=torch.zeros(TOPK, ROWS, dtype=torch.int32).t()),
        "last dim must be contiguous",
    ),
}
"""name -> (the argument named, a call with one bad argument, a fragment of the message)."""


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_a_bad_sparse_call_is_named_before_any_launch(case: str) -> None:
    argument, make, match = BAD_CALLS[case]
    call = make()
    expect_invalid(argument, lambda: sparse_attention(call), match)
    assert torch.isnan(call.out).all()
