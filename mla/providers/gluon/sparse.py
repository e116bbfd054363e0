"""Sparse attention as a Gluon decode (host side, pure Python).

Each query row of a sparse attention call attends its own slot list, and all its heads attend
the same list: that is exactly the decode kernels' unit-qlen mode (row ``t`` a qlen-1 request
over ``kv_indices[kv_indptr[t] : kv_indptr[t+1]]``). :func:`sparse_inputs` hands the kernels the
slot matrix as that index list (``kv_indptr[t] = t · topk``), so the kernels' gather, their
masking of ids outside the cache (a ``-1`` pad is such an id) and their split-KV paths serve the
sparse attention unchanged; a call's ``lengths`` become the launch's per-request key counts
(``DecodeInputs.lengths``), so a row's ``-1`` tail costs no tile. ``fp8_ds_mla`` byte rows
travel as an fp8 view of the same memory; the kernels read each row's tile scales and bf16
rope lanes from it.

:func:`sparse_on_gluon` says which calls the Gluon kernels take: 512 + 64 latent/rope dims, a
bf16/fp16 query with a cache of its dtype, a per-tensor fp8 cache, or ``fp8_ds_mla`` rows with
a bf16 query. The provider runs every other call on the Triton sparse kernel.
"""

from __future__ import annotations

import threading

import torch

from mla.core.config import ds_mla_row_bytes, is_ds_mla
from mla.providers.calls import SparseAttentionCall
from mla.providers.gluon.planner import FP8_KV_DTYPES, decode_kernel
from mla.providers.sparse_calls import check_lengths
from mla.providers.triton.decode_launch import DecodeInputs


def sparse_on_gluon(call: SparseAttentionCall) -> tuple[bool, str]:
    """Whether the Gluon kernels take ``call``, and why (or why not)."""
    rank, rope = call.kv_lora_rank, call.rope_dim
    q_dtype, kv = call.q.dtype, call.kv_cache
    if is_ds_mla(kv.dtype):
        if q_dtype != torch.bfloat16:
            return False, f"fp8_ds_mla rows need a bf16 query (got {q_dtype})"
        if kv.shape[1] != ds_mla_row_bytes(rank, rope):
            return False, f"fp8_ds_mla rows of {kv.shape[1]} bytes, not {ds_mla_row_bytes(rank, rope)}"
        kv_dtype = torch.float8_e4m3fn
    else:
        kv_dtype = kv.dtype
    if kv_dtype in FP8_KV_DTYPES and not is_ds_mla(kv.dtype) and call.kv_scale is None:
        return False, "a per-tensor fp8 cache without kv_scale"
    kernel, why = decode_kernel(q_dtype=q_dtype, kv_dtype=kv_dtype, kv_lora_rank=rank, rope_dim=rope)
    return kernel == "gluon", why


ROW_INDPTR_CACHE = 32
"""Row offset tensors :func:`row_indptr` keeps (one per (device, rows, topk) seen)."""
_row_indptrs: dict[tuple[torch.device, int, int], torch.Tensor] = {}
_row_indptrs_lock = threading.Lock()


def row_indptr(rows: int, topk: int, device: torch.device) -> torch.Tensor:
    """int32 ``[rows + 1]`` offsets ``t · topk`` of each row's slot list, made once per (device,
    rows, topk) and kept (a decode step's graph then launches no kernel for them). One made
    while a CUDA graph captures is not kept: its memory belongs to that graph's pool."""
    key = (device, rows, topk)
    cached = _row_indptrs.get(key)
    if cached is not None:
        return cached
    offsets = torch.arange(0, (rows + 1) * topk, topk, dtype=torch.int32, device=device)
    if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
        with _row_indptrs_lock:  # engines run layers from several threads
            if len(_row_indptrs) >= ROW_INDPTR_CACHE:
                _row_indptrs.pop(next(iter(_row_indptrs)))
            _row_indptrs[key] = offsets
    return offsets


def sparse_inputs(call: SparseAttentionCall) -> DecodeInputs:
    """The decode launch operands of ``call``: one qlen-1 request per query row over its slots
    (over its first ``lengths[t]`` slots when the call carries lengths: the kernels then skip
    the tiles past them). :class:`~mla.core.errors.InvalidInputError` for ``lengths`` that are not int32
    ``[T]`` on the query's device."""
    q, rank = call.q, call.kv_lora_rank
    slots = call.slots if call.slots.is_contiguous() else call.slots.contiguous()
    rows, topk = int(slots.shape[0]), int(slots.shape[1])
    check_lengths(call.lengths, rows, q.device)
    kv = call.kv_cache.view(torch.float8_e4m3fn) if is_ds_mla(call.kv_cache.dtype) else call.kv_cache
    kv_indptr = row_indptr(rows, topk, q.device)
    return DecodeInputs(
        q[..., :rank], q[..., rank:], kv, kv_indptr, slots.view(-1), None, rows, 1, topk,
        call.softmax_scale, None if is_ds_mla(call.kv_cache.dtype) else call.kv_scale, call.out,
        call.lse, None, None, call.lengths,
    )  # fmt: skip


__all__ = ["ROW_INDPTR_CACHE", "row_indptr", "sparse_inputs", "sparse_on_gluon"]
