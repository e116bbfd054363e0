"""Combining partial decode states across ranks by LSE (vLLM's ``cp_lse_ag_out_rs``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def all_gather_into(output: torch.Tensor, tensor: torch.Tensor, group: Any) -> None:
    # torch >= 2.12 names these *_single; older releases only have the *_tensor spelling.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, tensor, group=group)


def reduce_scatter_into(output: torch.Tensor, tensor: torch.Tensor, group: Any) -> None:
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(output, tensor, group=group)


def lse_weights(partial_lse: torch.Tensor, all_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The merge weights of one rank's partial states.

    ``partial_lse`` ``[T, H]`` is this rank's, ``all_lse`` ``[W, T, H]`` every rank's (float32).
    Returns ``(weight [T, H], lse [T, H])`` with ``lse = logsumexp`` over ranks and
    ``weight = exp(partial_lse - lse)``; rows where every rank has ``-inf`` get weight 0 and
    ``lse = -inf``, so the combined output is 0 there.
    """
    lse = torch.logsumexp(all_lse, dim=0)
    finite = torch.isfinite(lse)
    weight = torch.where(finite, torch.exp(partial_lse - torch.where(finite, lse, 0.0)), 0.0)
    return weight, lse


def combine_decode_states(
    part: torch.Tensor,
    part_lse: torch.Tensor,
    *,
    group: Any,
    rank: int,
    world_size: int,
    split_heads: bool,
    out: torch.Tensor,
    lse: torch.Tensor | None = None,
) -> None:
    """Merge every rank's partial decode of the same rows into ``out``; collective over ``group``.

    ``part`` ``[T, Hp, D]`` and ``part_lse`` ``[T, Hp]`` (float32) are this rank's states over its
    keys. The LSEs are all-gathered and each rank's output scaled by :func:`lse_weights`; then
    with ``split_heads`` the ``Hp = W * H`` heads are reduce-scattered so rank ``r`` receives heads
    ``r*H .. r*H+H-1`` in ``out`` ``[T, H, D]``, otherwise they are all-reduced into ``out``
    ``[T, Hp, D]``. ``lse`` (optional) receives the merged LSE of ``out``'s heads. Device work
    only (no host sync). The scaled partials are summed in float32 and rounded to ``out``'s
    dtype once (vLLM sums them in the model dtype: its error grows with the number of ranks).
    """
    rows, part_heads = part_lse.shape
    all_lse = torch.empty((world_size * rows, part_heads), dtype=torch.float32, device=part.device)
    all_gather_into(all_lse, part_lse.contiguous(), group)
    weight, merged_lse = lse_weights(part_lse, all_lse.view(world_size, rows, part_heads))
    corrected = part.to(torch.float32) * weight[..., None]
    if split_heads and world_size > 1:
        heads = part_heads // world_size
        send = (
            corrected.view(rows, world_size, heads, -1).transpose(0, 1).reshape(world_size * rows, heads, -1)
        )
        target = (
            out
            if out.is_contiguous() and out.dtype == torch.float32
            else torch.empty(out.shape, dtype=torch.float32, device=out.device)
        )
        reduce_scatter_into(target, send, group)
        if target is not out:
            out.copy_(target)
        own = merged_lse.view(rows, world_size, heads)[:, rank]
    else:
        dist.all_reduce(corrected, group=group)
        out.copy_(corrected)
        own = merged_lse
    if lse is not None:
        lse.copy_(own)
