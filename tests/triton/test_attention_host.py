"""The host checks of the GPU prefill launchers (:func:`check_attention_args`, shared by the Triton
and Gluon varlen and fp8 prefill): each bad argument is refused with an :class:`InvalidInputError`
naming it, before any kernel is compiled or launched. Pure host code: CPU tensors (and ``meta``
tensors for a device mismatch) stand in for the GPU's.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from layouts import strided_last_dim
from rejections import expect_invalid

from mla.providers.triton.attention_host import check_attention_args

TQ, TK, H, DQK, DV, ROPE = 8, 12, 4, 48, 24, 16


def _args() -> dict[str, Any]:
    """A valid call: two requests of 3 and 5 queries over 3 and 9 keys."""
    return {
        "q": torch.zeros(TQ, H, DQK, dtype=torch.bfloat16),
        "k": torch.zeros(TK, H, DQK, dtype=torch.bfloat16),
        "v": torch.zeros(TK, H, DV, dtype=torch.bfloat16),
        "cu_seqlens_q": torch.tensor([0, 3, 8], dtype=torch.int32),
        "cu_seqlens_k": torch.tensor([0, 3, 12], dtype=torch.int32),
        "out": torch.zeros(TQ, H, DV, dtype=torch.bfloat16),
        "lse": torch.zeros(TQ, H),
        "softmax_scale": 0.125,
    }


def _with_context(**changes: Any) -> dict[str, Any]:
    """A chunked-context call (``k`` of the nope lanes, ``k_pe`` beside it, a prior state), changed."""
    args = _args()
    args.update(
        k=torch.zeros(TK, H, DQK - ROPE, dtype=torch.bfloat16),
        k_pe=torch.zeros(TK, ROPE, dtype=torch.bfloat16),
        prior_out=torch.zeros(TQ, H, DV, dtype=torch.bfloat16),
        prior_lse=torch.zeros(TQ, H),
    )
    args.update(changes)
    return args


def _changed(**changes: Any) -> dict[str, Any]:
    args = _args()
    args.update(changes)
    return args


BAD_CALLS: dict[str, tuple[str, dict[str, Any], str]] = {
    "q-2d": ("q", _changed(q=torch.zeros(TQ, H * DQK)), "expected 3 dims"),
    "k-strided": ("k", _changed(k=strided_last_dim(torch.zeros(TK, H, DQK))), "last dim must be contiguous"),
    "lse-3d": ("lse", _changed(lse=torch.zeros(TQ, H, 1)), "expected 2 dims"),
    "k-heads": (
        "k",
        _changed(k=torch.zeros(TK, H - 1, DQK, dtype=torch.bfloat16)),
        f"expected [Tk, {H}, {DQK}]",
    ),
    "v-rows": ("v", _changed(v=torch.zeros(TK - 1, H, DV, dtype=torch.bfloat16)), "Dv]"),
    "out-shape": (
        "out",
        _changed(out=torch.zeros(TQ, H, DQK, dtype=torch.bfloat16)),
        f"expected {(TQ, H, DV)}",
    ),
    "lse-dtype": ("lse", _changed(lse=torch.zeros(TQ, H, dtype=torch.float16)), "expected float32"),
    "cu-q-int64": ("cu_seqlens_q", _changed(cu_seqlens_q=torch.tensor([0, 3, 8])), "1-D int32"),
    "cu-k-entries": (
        "cu_seqlens_k",
        _changed(cu_seqlens_k=torch.tensor([0, 12], dtype=torch.int32)),
        "2 entries",
    ),
    "devices": (
        "q",
        _changed(cu_seqlens_k=torch.empty(3, dtype=torch.int32, device="meta")),
        "one device",
    ),
    "out-int": ("out", _changed(out=torch.zeros(TQ, H, DV, dtype=torch.int32)), "is not one of"),
    "scale-zero": ("softmax_scale", _changed(softmax_scale=0.0), "positive finite"),
    "scale-nan": ("softmax_scale", _changed(softmax_scale=float("nan")), "positive finite"),
    "k_pe-rows": ("k_pe", _with_context(k_pe=torch.zeros(TK - 1, ROPE, dtype=torch.bfloat16)), "k's rows"),
    "k_pe-wide": ("k_pe", _with_context(k_pe=torch.zeros(TK, DQK, dtype=torch.bfloat16)), f"0 < R < {DQK}"),
    "k_pe-dtype": ("k_pe", _with_context(k_pe=torch.zeros(TK, ROPE)), "expected q's"),
    "k-whole-beside-k_pe": (
        "k",
        _with_context(k=torch.zeros(TK, H, DQK, dtype=torch.bfloat16)),
        "less k_pe's",
    ),
    "prior-alone": ("prior_out", _with_context(prior_lse=None), "come together"),
    "prior_out-shape": (
        "prior_out",
        _with_context(prior_out=torch.zeros(TQ - 1, H, DV, dtype=torch.bfloat16)),
        "out's shape",
    ),
    "prior_out-int": (
        "prior_out",
        _with_context(prior_out=torch.zeros(TQ, H, DV, dtype=torch.int32)),
        "expected a float",
    ),
    "prior_lse-dtype": (
        "prior_lse",
        _with_context(prior_lse=torch.zeros(TQ, H, dtype=torch.bfloat16)),
        "expected float32",
    ),
}
"""name -> (the argument named, a call with one bad argument, a fragment of the message)."""


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_a_bad_prefill_argument_is_named(case: str) -> None:
    argument, args, match = BAD_CALLS[case]
    expect_invalid(argument, lambda: check_attention_args(**args), re.escape(match))


@pytest.mark.parametrize("make", [_args, _with_context], ids=["plain", "chunked-context"])
def test_a_good_prefill_call_passes(make: Any) -> None:
    check_attention_args(**make())
