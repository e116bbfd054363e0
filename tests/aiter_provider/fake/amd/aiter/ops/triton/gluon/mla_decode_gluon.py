"""Fake legacy ``aiter.ops.triton.gluon.mla_decode_gluon`` (16 heads at most)."""

from __future__ import annotations

from typing import Any

import torch

from aiter.ops.triton.gluon._gluon import run


def mla_decode_gluon(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_c: torch.Tensor,
    o: torch.Tensor,
    page_table: torch.Tensor,
    seq_info: torch.Tensor,
    sm_scale: float,
    k_pe: Any = None,
    kv_pe_offset: int = 512,
    use_2d_view: bool = True,
    kv_scale: Any = 1.0,
    min_kv_seq_len: int = 1,
    return_lse: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    return run(
        "mla_decode_gluon",
        16,
        q_nope,
        q_pe,
        kv_c,
        o,
        page_table,
        seq_info,
        sm_scale,
        k_pe,
        kv_pe_offset,
        use_2d_view,
        kv_scale,
        min_kv_seq_len,
        return_lse,
    )
