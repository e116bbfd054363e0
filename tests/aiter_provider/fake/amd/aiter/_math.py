"""Reference attention math of the fake kernels (float32 torch), with aiter's edge behaviour.

Kernels compute normalized partial outputs and natural-log LSEs. Where real aiter leaves a
row undefined (no visible key: graph padding, fully masked causal rows), the fake writes NaN
outputs and ``+inf`` LSEs, the worst a caller may see, so callers must clear those rows.
"""

from __future__ import annotations

import torch

from aiter import _state

UNDEFINED_LSE = float("inf")
"""What aiter's reducer writes for a row with an empty sum (``csrc/kernels/mla/reduce.cu``)."""


def check(condition: bool, message: str) -> None:
    """aiter's ``AITER_CHECK``: a RuntimeError naming the failed condition."""
    if not condition:
        raise RuntimeError(message)


def require_fp8(tensor: torch.Tensor, name: str) -> None:
    """aiter maps every fp8 dtype to one id: a format other than ``dtypes.fp8`` would be read
    with the wrong bias, silently. The fake refuses it."""
    from aiter import dtypes

    check(
        tensor.dtype == dtypes.fp8,
        f"{name} is {tensor.dtype}, but aiter reads fp8 as {dtypes.fp8} on {_state.arch()}",
    )


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``[n, H, D]``, k ``[m, H|1, D]``, v ``[m, H|1, Dv]`` (float32), visible ``[n, m]``.

    Returns the normalized ``o [n, H, Dv]`` and ``lse [n, H]``; rows with no visible key give
    ``o = 0`` and ``lse = -inf`` here (callers decide what the kernel leaves there).
    """
    heads = q.shape[1]
    scores = torch.einsum("nhd,mhd->hnm", q, k.expand(-1, heads, -1)) * scale
    scores = scores.masked_fill(~visible[None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    finite = torch.isfinite(lse)
    probs = torch.exp(scores - torch.where(finite, lse, 0.0)[..., None])
    probs = torch.where(finite[..., None], probs, 0.0)
    out = torch.einsum("hnm,mhv->nhv", probs, v.expand(-1, heads, -1))
    return out, lse.transpose(0, 1)


def merge(o_parts: torch.Tensor, lse_parts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``mla_reduce_v1``'s math over ``P`` partials ``[P, n, H, Dv]``/``[P, n, H]``: NaN output and
    ``+inf`` LSE where the sum is empty."""
    total = torch.logsumexp(lse_parts, dim=0)
    finite = torch.isfinite(total)
    weights = torch.where(finite[None], torch.exp(lse_parts - torch.where(finite, total, 0.0)[None]), 0.0)
    out = (o_parts * weights[..., None]).sum(0)
    out = torch.where(finite[..., None], out, float("nan"))
    return out, torch.where(finite, total, UNDEFINED_LSE)


def undefined_where_empty(o: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What a kernel leaves in rows without a visible key: NaN outputs, ``+inf`` LSEs."""
    empty = torch.isneginf(lse)
    return torch.where(empty[..., None], float("nan"), o), torch.where(empty, UNDEFINED_LSE, lse)


def causal_visible(rows: torch.Tensor, keys: torch.Tensor, offset: int) -> torch.Tensor:
    """``[len(rows), len(keys)]``: key position ``p`` is visible to row ``r`` when
    ``p <= r + offset`` (right/bottom-right aligned: ``offset = kv_len - q_len``)."""
    return keys[None, :] <= rows[:, None] + offset
