"""Triton small-head (Gluon-style) decode: every query row is an independent qlen-1 decode.

Contract (``KernelProvider.small_head_decode``): q_nope ``[T, H, L]`` and q_pe ``[T, H, R]``
(strided views of one ``[T, H, L+R]`` query are fine: only the last dim must be contiguous),
flat cache ``[N_tok, L+R]``, ``page_table`` flat token ids and ``seq_info [T+1]`` indptr into it
per row; out ``[T, H, L]``, lse ``[T, H]`` fp32 or ``None`` (not written).

It runs the shared decode kernel of :mod:`.decode` with one request per row (``UNIT_QLEN``):
the H heads of a row fill a 16-row MMA tile, so 8 or 12 heads move the same KV bytes as 16 and
cost the same time; nothing is padded or copied on the host side. KV splitting follows the
non-persistent heuristic of :mod:`.schedule`.
"""

from __future__ import annotations

import torch

from mla.providers.triton.decode import launch_decode, num_sms
from mla.providers.triton.schedule import DecodeLaunchConfig, decode_launch_config


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def small_head_decode(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_info: torch.Tensor,
    *,
    max_seqlen_k: int,
    softmax_scale: float,
    kv_scale: float | None,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    config: DecodeLaunchConfig | None = None,
) -> None:
    """Small-head decode; ``config`` overrides the launch heuristic (benchmarks)."""
    rows = q_nope.shape[0]
    if config is None:
        config = decode_launch_config(
            batch=rows,
            rows=q_nope.shape[1],
            max_seqlen_k=max_seqlen_k,
            num_sms=num_sms(q_nope.device),
            kv_elem_size=kv_cache.element_size(),
            persistent=False,
        )
    launch_decode(
        q_nope=_last_dim_contiguous(q_nope),
        q_pe=_last_dim_contiguous(q_pe),
        kv_cache=kv_cache,
        kv_indptr=seq_info,
        kv_indices=page_table,
        qo_indptr=None,
        num_requests=rows,
        max_qlen=1,
        softmax_scale=softmax_scale,
        kv_scale=kv_scale,
        out=out,
        lse=lse,
        config=config,
        schedule=None,
    )
