"""aiter's prefill kernel calls: ``flash_attn_varlen_func`` and the fp8 persistent prefill
(``get_ps_metadata_info_v1`` / ``get_ps_metadata_v1`` plan, ``mla_prefill_ps_asm_fwd`` +
``mla_reduce_v1`` run), with the arguments and order vLLM's ROCM_AITER_MLA backend uses."""

from __future__ import annotations

from typing import Any

import torch

from mla.core.errors import InvalidInputError, PlanMismatchError
from mla.providers.aiter.lse import clear_empty_rows, empty_varlen_rows, prefill_lse
from mla.providers.aiter.probes import AiterProbes
from mla.providers.aiter.schedule import (
    FP8_PREFILL_KV_GRANULARITY,
    FP8_PREFILL_TILE_Q,
    AiterPrefillSchedule,
    allocate,
)
from mla.providers.calls import Fp8PrefillCall, Fp8PrefillPlanCall, VarlenPrefillCall
from mla.providers.quant import dequantize


def varlen_attention(aiter: Any, call: VarlenPrefillCall) -> None:
    """``flash_attn_varlen_func`` for ``call``, its LSE transposed to ``[T, H]``."""
    q, k, v, out, lse, causal = call.q, call.k, call.v, call.out, call.lse, call.causal
    for name, given in (("k_pe", call.k_pe), ("prior_out", call.prior_out), ("appended", call.appended)):
        if given is not None:
            raise InvalidInputError(
                name, "aiter's flash_attn_varlen_func takes whole keys and no prior state (the aiter "
                "record has varlen_context_operands=False): assemble k and merge with merge_states",
            )  # fmt: skip
    cu_seqlens_q, cu_seqlens_k = call.cu_seqlens_q, call.cu_seqlens_k
    rows = q.shape[0]
    if rows == 0:
        return
    if k.shape[0] == 0 or call.max_seqlen_k == 0:
        out.zero_()
        lse.fill_(float("-inf"))
        return
    result = aiter.flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        call.max_seqlen_q,
        call.max_seqlen_k,
        softmax_scale=float(call.softmax_scale),
        causal=causal,
        return_lse=True,
    )
    out.copy_(result[0])
    lse.copy_(result[1].transpose(0, 1))  # aiter's softmax_lse is [H, T]
    clear_empty_rows(out, lse, empty_varlen_rows(cu_seqlens_q, cu_seqlens_k, rows, causal=causal))


def plan_fp8_prefill(aiter: Any, call: Fp8PrefillPlanCall) -> AiterPrefillSchedule:
    """The persistent prefill plan from ``get_ps_metadata_v1`` over the host indptrs."""
    num_heads, causal, device = call.num_heads, call.causal, call.device
    cu_q = call.cu_seqlens_q_cpu.to(device="cpu", dtype=torch.int32)
    cu_k = call.cu_seqlens_k_cpu.to(device="cpu", dtype=torch.int32)
    batch = cu_q.numel() - 1
    max_q = int((cu_q[1:] - cu_q[:-1]).max()) if batch else 0
    specs = aiter.get_ps_metadata_info_v1(
        max(batch, 1), num_heads, max(max_q, 1), qlen_granularity=FP8_PREFILL_TILE_Q
    )
    meta, work_indptr, work_info, reduce_indptr, final_map, partial_map = allocate(specs, device)
    aiter.get_ps_metadata_v1(
        cu_q,
        cu_k,
        (cu_k[1:] - cu_k[:-1]).to(torch.int32),
        1,
        num_heads,
        meta,
        work_indptr,
        work_info,
        reduce_indptr,
        final_map,
        partial_map,
        qhead_granularity=1,
        qlen_granularity=FP8_PREFILL_TILE_Q,
        kvlen_granularity=FP8_PREFILL_KV_GRANULARITY,
        block_size=1,
        is_causal=causal,
    )
    return AiterPrefillSchedule(
        work_metadata=meta,
        work_indptr=work_indptr,
        work_info=work_info,
        reduce_indptr=reduce_indptr,
        reduce_final_map=final_map,
        reduce_partial_map=partial_map,
        kv_indices=torch.arange(int(cu_k[-1]), dtype=torch.int32, device=device),
        num_partial_tiles=int(reduce_indptr[-1]),  # a build-time sync, never in the run
        max_seqlen_q=max_q,
        cu_seqlens_q=tuple(int(x) for x in cu_q.tolist()),
        cu_seqlens_k=tuple(int(x) for x in cu_k.tolist()),
        num_heads=num_heads,
        causal=causal,
    )


def fp8_prefill(aiter: Any, probes: AiterProbes, call: Fp8PrefillCall) -> None:
    """``mla_prefill_ps_asm_fwd`` + ``mla_reduce_v1`` for ``call`` (fp32 partials sized from the
    plan), the LSE from a reference pass."""
    q, k, v, out, lse, causal = call.q, call.k, call.v, call.out, call.lse, call.causal
    cu_seqlens_q, cu_seqlens_k, schedule = call.cu_seqlens_q, call.cu_seqlens_k, call.schedule
    q_scale, k_scale, softmax_scale = call.q_scale, call.k_scale, call.softmax_scale
    if not isinstance(schedule, AiterPrefillSchedule):
        raise PlanMismatchError(f"the aiter fp8 prefill needs its own plan, got {type(schedule).__name__}")
    rows, heads = q.shape[0], q.shape[1]
    planned = (schedule.cu_seqlens_q[-1], schedule.num_heads, schedule.causal)
    if planned != (rows, heads, causal):
        raise PlanMismatchError(
            f"aiter fp8 prefill plan is for (tokens, heads, causal) {planned}, the run has "
            f"{(rows, heads, causal)}"
        )
    value_dim = v.shape[-1]
    partial_rows = max(schedule.num_partial_tiles, 1) * FP8_PREFILL_TILE_Q
    split_out = torch.empty(partial_rows, heads, value_dim, dtype=torch.float32, device=q.device)
    split_lse = torch.empty(partial_rows, heads, dtype=torch.float32, device=q.device)
    target = out
    if out.dtype != torch.bfloat16 or not out.is_contiguous():
        target = torch.empty(rows, heads, value_dim, dtype=torch.bfloat16, device=q.device)
    aiter.mla_prefill_ps_asm_fwd(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        schedule.kv_indices,
        schedule.work_indptr,
        schedule.work_info,
        schedule.max_seqlen_q,
        float(softmax_scale),
        causal,
        split_out,
        split_lse,
        target,
        q_scale,
        k_scale,
        call.v_scale,
    )
    splits: tuple[int, ...] = (0,) if probes.reduce_takes_num_kv_splits else ()
    aiter.mla_reduce_v1(
        split_out,
        split_lse,
        schedule.reduce_indptr,
        schedule.reduce_final_map,
        schedule.reduce_partial_map,
        FP8_PREFILL_TILE_Q,
        *splits,
        target,
        None,
    )
    if target is not out:
        out.copy_(target)
    prefill_lse(
        dequantize(q, q_scale),
        dequantize(k, k_scale),
        list(schedule.cu_seqlens_q),
        list(schedule.cu_seqlens_k),
        scale=softmax_scale,
        causal=causal,
        out=lse,
    )
    clear_empty_rows(out, lse, empty_varlen_rows(cu_seqlens_q, cu_seqlens_k, rows, causal=causal))
