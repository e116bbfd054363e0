"""The value records reject bad fields with InvalidInputError naming the field and what it must be."""

from __future__ import annotations

from collections.abc import Callable

import attrs
import pytest
import torch

import mla
from mla.core.context import DecodeContext
from mla.testing import simulated_decode_context

REJECTIONS: list[tuple[str, Callable[[], object], str]] = [
    ("num_heads", lambda: mla.MLADims(0), "must be > 0, got 0"),
    ("kv_lora_rank", lambda: mla.MLADims(8, kv_lora_rank=-1), "must be > 0, got -1"),
    ("qk_rope_head_dim", lambda: mla.MLADims(8, qk_rope_head_dim=0), "> 0"),
    ("qk_nope_head_dim", lambda: mla.MLADims(8, qk_nope_head_dim=0), "> 0"),
    ("v_head_dim", lambda: mla.MLADims(8, v_head_dim=0), "> 0"),
    ("block_size", lambda: mla.KVCacheSpec(0), "must be > 0, got 0"),
    ("kv_cache_dtype", lambda: mla.KVCacheSpec(16, "int8"), "unknown dtype 'int8'"),
    ("max_num_seqs", lambda: mla.EngineLimits(0, 64, 64), "> 0"),
    ("max_model_len", lambda: mla.EngineLimits(4, None, 64), "must be > 0, got None"),  # type: ignore[arg-type]
    ("max_num_batched_tokens", lambda: mla.EngineLimits(4, 64, -3), "> 0"),
    ("max_decode_qlen", lambda: mla.EngineLimits(4, 64, 64, max_decode_qlen=0), "> 0"),
    ("small_head_mode", lambda: mla.Knobs(small_head_mode="fast"), "one of auto/gluon/asm, got 'fast'"),  # type: ignore[arg-type]
    ("fp8_prefill", lambda: mla.Knobs(fp8_prefill="yes"), "one of auto/on/off"),  # type: ignore[arg-type]
    ("num_compute_units", lambda: mla.Platform("cpu", "cpu", 0), "must be > 0, got 0"),
]


@pytest.mark.parametrize(("field", "build", "message"), REJECTIONS, ids=[r[0] for r in REJECTIONS])
def test_record_rejects_bad_field(field: str, build: Callable[[], object], message: str) -> None:
    with pytest.raises(mla.InvalidInputError, match=f"^{field}: .*") as info:
        build()
    assert info.value.argument == field
    assert message in str(info.value)


@pytest.mark.parametrize("field", ["max_qlen", "max_decode_qlen"])
def test_decode_context_rejects_counts_below_one(field: str) -> None:
    ctx = simulated_decode_context("cpu", q_dtype=torch.bfloat16)
    assert isinstance(ctx, DecodeContext)
    with pytest.raises(mla.InvalidInputError, match=f"^{field}: must be >= 1, got 0"):
        attrs.evolve(ctx, **{field: 0})
