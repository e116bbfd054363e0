"""Triton small-head (Gluon-style) decode: every query row is an independent qlen-1 decode.

Contract: :class:`~mla.providers.calls.SmallHeadDecodeCall` (q_nope and q_pe may be strided
views of one ``[T, H, L+R]`` query: only the last dim must be contiguous).

It runs the shared decode kernel of :mod:`.decode` with one request per row (``UNIT_QLEN``):
the H heads of a row fill a 16-row MMA tile, so 8 or 12 heads move the same KV bytes as 16 and
cost the same time; nothing is padded or copied on the host side. KV splitting follows the
non-persistent heuristic of :mod:`.schedule`.
"""

from __future__ import annotations

from functools import partial

from mla.providers.calls import SmallHeadDecodeCall
from mla.providers.triton.decode import launch_kernel
from mla.providers.triton.decode_launch import DecodeInputs, launch_split_decode, num_sms
from mla.providers.triton.schedule import DecodeLaunchConfig, decode_launch_config


def small_head_decode(call: SmallHeadDecodeCall, *, config: DecodeLaunchConfig | None = None) -> None:
    """Small-head decode (the ``small-head-decode`` contract); ``config`` overrides the launch
    heuristic (benchmarks)."""
    inputs = DecodeInputs.small_head(call, provider="triton", block_table=True)
    if config is None:
        config = decode_launch_config(
            batch=inputs.num_requests,
            rows=inputs.rows,
            max_seqlen_k=inputs.max_seqlen_k,
            num_sms=num_sms(call.q_nope.device),
            kv_elem_size=call.kv_cache.element_size(),
            persistent=False,
        )
    launch_split_decode(
        inputs, row_tile=config.block_m, num_splits=config.num_splits, launch=partial(launch_kernel, config)
    )
