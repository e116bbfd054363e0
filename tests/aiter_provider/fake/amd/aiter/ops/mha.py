"""Fake ``aiter/ops/mha.py``: ``flash_attn_varlen_func`` (different q/v head dims, bottom-right
causal, LSE ``[H, total_q]``; fully masked rows give zeros and a ``+inf`` LSE like FA2)."""

from __future__ import annotations

from typing import Any

import torch

from aiter import _state
from aiter._math import attend, causal_visible, check


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    min_seqlen_q: int = 0,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    logits_soft_cap: float = 0.0,
    causal: bool = False,
    window_size: tuple[int, ...] = (-1, -1, 0),
    bias: Any = None,
    alibi_slopes: Any = None,
    deterministic: bool = False,
    return_lse: bool = False,
    return_attn_probs: bool = False,
    how_v3_bf16_cvt: int = 1,
    block_table: Any = None,
    out: torch.Tensor | None = None,
    cu_seqlens_q_padded: torch.Tensor | None = None,
    cu_seqlens_k_padded: torch.Tensor | None = None,
    sink_ptr: Any = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    check(softmax_scale is not None, "fake aiter: pass softmax_scale explicitly")
    assert softmax_scale is not None
    check(q.dim() == k.dim() == v.dim() == 3, "q, k, v must be [tokens, heads, dim]")
    check(
        q.dtype == k.dtype == v.dtype and q.dtype in (torch.bfloat16, torch.float16),
        "q/k/v must share bf16/fp16",
    )
    check(
        q.shape[-1] == k.shape[-1] and k.shape[:2] == v.shape[:2],
        "k must match q's head dim and v's tokens/heads",
    )
    check(q.shape[1] % k.shape[1] == 0, "q heads must be a multiple of k heads")
    for name, tensor in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        check(tensor.dtype == torch.int32 and tensor.dim() == 1, f"{name} must be 1-D int32")
    check(cu_seqlens_q.numel() == cu_seqlens_k.numel(), "cu_seqlens_q / cu_seqlens_k sizes differ")
    check(
        dropout_p == 0.0 and logits_soft_cap == 0.0 and bias is None and alibi_slopes is None,
        "plain attention",
    )
    check(block_table is None and out is None, "the fake covers the contiguous varlen path")
    cu_q = [int(x) for x in cu_seqlens_q.tolist()]
    cu_k = [int(x) for x in cu_seqlens_k.tolist()]
    check(cu_q[-1] <= q.shape[0] and cu_k[-1] <= k.shape[0], "cu_seqlens beyond the tensors")
    batch = len(cu_q) - 1
    check(
        max_seqlen_q >= max((cu_q[b + 1] - cu_q[b] for b in range(batch)), default=0),
        "max_seqlen_q too small",
    )
    check(
        max_seqlen_k >= max((cu_k[b + 1] - cu_k[b] for b in range(batch)), default=0),
        "max_seqlen_k too small",
    )
    _state.record(
        "flash_attn_varlen_func",
        causal=causal,
        softmax_scale=softmax_scale,
        return_lse=return_lse,
        qk_dim=q.shape[-1],
        v_dim=v.shape[-1],
    )
    output = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=q.dtype)
    lse = torch.full((q.shape[1], q.shape[0]), float("nan"))
    group = q.shape[1] // k.shape[1]
    qf, kf, vf = q.float(), k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
    for b in range(batch):
        q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        if q1 == q0:
            continue
        rows, keys = torch.arange(q1 - q0), torch.arange(k1 - k0)
        visible = (
            causal_visible(rows, keys, (k1 - k0) - (q1 - q0))
            if causal
            else torch.ones(q1 - q0, k1 - k0, dtype=torch.bool)
        )
        o, row_lse = attend(qf[q0:q1], kf[k0:k1], vf[k0:k1], visible, softmax_scale)
        output[q0:q1] = o.to(q.dtype)
        lse[:, q0:q1] = torch.where(torch.isneginf(row_lse), float("inf"), row_lse).transpose(0, 1)
    return (output, lse) if return_lse else output
