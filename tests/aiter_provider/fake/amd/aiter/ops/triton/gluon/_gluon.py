"""The fake Gluon small-head MLA kernel shared by ``mla_gluon`` and the legacy ``mla_decode_gluon``."""

from __future__ import annotations

from typing import Any

import torch

from aiter import _state
from aiter._math import attend, check, undefined_where_empty


def run(
    name: str,
    max_heads: int,
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_c: torch.Tensor,
    o: torch.Tensor,
    page_table: torch.Tensor,
    seq_info: torch.Tensor,
    sm_scale: float,
    k_pe: Any,
    kv_pe_offset: int,
    use_2d_view: bool,
    kv_scale: Any,
    min_kv_seq_len: int,
    return_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    assert _state.arch() == "gfx950", f"mla_gluon requires gfx950 (CDNA4), got {_state.arch()}"
    check(q_nope.dim() == 3, "the fake covers the 3-D (one row per query) form")
    batch, nhead, ckv = q_nope.shape
    assert ckv == 512, f"mla_gluon requires head_dim_ckv=512, got {ckv}"
    assert q_pe.shape[-1] == 64, f"mla_gluon requires head_dim_kpe=64, got {q_pe.shape[-1]}"
    assert 1 <= nhead <= max_heads, f"{name} requires nhead <= {max_heads}, got {nhead}"
    bf16 = q_nope.dtype == torch.bfloat16 and q_pe.dtype == torch.bfloat16
    assert bf16, f"q_nope/q_pe must be bf16, got {q_nope.dtype}/{q_pe.dtype}"
    assert kv_c.dtype in (torch.bfloat16, torch.float8_e4m3fn), (
        f"kv_c must be bf16 or fp8 e4m3fn, got {kv_c.dtype}"
    )
    check(
        k_pe is None and kv_pe_offset == 512 and kv_c.dim() == 2 and kv_c.shape[1] == 576,
        "shared layout: kv_c [N, 576], k_pe None, kv_pe_offset 512",
    )
    check(
        not use_2d_view and page_table.dim() == 1 and seq_info.dim() == 1,
        "use_2d_view=False: flat page table",
    )
    check(
        page_table.dtype == torch.int32 and seq_info.dtype == torch.int32, "page_table/seq_info must be int32"
    )
    check(seq_info.numel() >= batch + 1, f"seq_info needs {batch + 1} entries, has {seq_info.numel()}")
    check(
        isinstance(kv_scale, float),
        f"kv_scale must be a Python float (a tensor is read as a pointer): {kv_scale!r}",
    )
    check(
        isinstance(sm_scale, float) and isinstance(min_kv_seq_len, int), "sm_scale float, min_kv_seq_len int"
    )
    check(
        o.shape == q_nope.shape and o.dtype == torch.bfloat16 and o.is_contiguous(),
        "o: contiguous bf16 like q_nope",
    )
    _state.record(name, heads=nhead, rows=batch, kv_scale=kv_scale, sm_scale=sm_scale, return_lse=return_lse)
    q = torch.cat([q_nope, q_pe], dim=-1).float()
    cache = kv_c.float() * kv_scale
    indptr = [int(x) for x in seq_info[: batch + 1].tolist()]
    lse = torch.full((batch, 1, nhead), float("nan"))
    for row in range(batch):
        keys = cache[page_table[indptr[row] : indptr[row + 1]].long()]
        visible = torch.ones(1, keys.shape[0], dtype=torch.bool)
        out, row_lse = attend(q[row : row + 1], keys[:, None, :], keys[:, None, :512], visible, sm_scale)
        out, row_lse = undefined_where_empty(out, row_lse)
        o[row] = out[0].to(o.dtype)
        lse[row, 0] = row_lse[0]
    return o, (lse if return_lse else None)
