"""Triton small-head (Gluon-style) decode: every query row is an independent qlen-1 decode.

Contract: :class:`~mla.providers.calls.SmallHeadDecodeCall` (q_nope and q_pe may be strided
views of one ``[T, H, L+R]`` query: only the last dim must be contiguous).

It runs the shared decode kernel of :mod:`.decode` with one request per row (``UNIT_QLEN``):
the H heads of a row fill a 16-row MMA tile, so 8 or 12 heads move the same KV bytes as 16 and
cost the same time; nothing is padded or copied on the host side. KV splitting follows the
non-persistent heuristic of :mod:`.schedule`.
"""

from __future__ import annotations

import torch

from mla.providers.calls import SmallHeadDecodeCall
from mla.providers.triton.decode import launch_decode, num_sms
from mla.providers.triton.schedule import DecodeLaunchConfig, decode_launch_config


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def small_head_decode(call: SmallHeadDecodeCall, *, config: DecodeLaunchConfig | None = None) -> None:
    """Small-head decode (the ``small-head-decode`` contract); ``config`` overrides the launch
    heuristic (benchmarks)."""
    q_nope = call.q_nope
    rows = q_nope.shape[0]
    if config is None:
        config = decode_launch_config(
            batch=rows,
            rows=q_nope.shape[1],
            max_seqlen_k=call.max_seqlen_k,
            num_sms=num_sms(q_nope.device),
            kv_elem_size=call.kv_cache.element_size(),
            persistent=False,
        )
    launch_decode(
        q_nope=_last_dim_contiguous(q_nope),
        q_pe=_last_dim_contiguous(call.q_pe),
        kv_cache=call.kv_cache,
        kv_indptr=call.seq_info,
        kv_indices=call.page_table,
        qo_indptr=None,
        num_requests=rows,
        max_qlen=1,
        softmax_scale=call.softmax_scale,
        kv_scale=call.kv_scale,
        out=call.out,
        lse=call.lse,
        config=config,
        schedule=None,
    )
