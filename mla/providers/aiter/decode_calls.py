"""aiter's decode kernel calls: ``mla_decode_fwd`` (paged, persistent or not), the persistent
metadata buffers (``get_mla_metadata_info_v1`` / ``get_mla_metadata_v1``) and the Gluon small-head
kernel, each with the arguments and order vLLM's ROCM_AITER_MLA backend uses."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mla.core.config import dtype_name, is_fp8
from mla.core.errors import InvalidInputError, PlanMismatchError, ProviderUnavailableError
from mla.providers.aiter.lse import (
    clear_empty_rows,
    empty_decode_rows,
    empty_indptr_rows,
    kernel_returns_decode_lse,
    reference_decode_lse,
    reference_small_head_lse,
)
from mla.providers.aiter.probes import AiterProbes
from mla.providers.aiter.schedule import DECODE_KV_GRANULARITY, AiterDecodeSchedule
from mla.providers.calls import (
    DecodeScheduleBuffersCall,
    PagedDecodeCall,
    PlanDecodeScheduleCall,
    SmallHeadDecodeCall,
)
from mla.providers.quant import dequantize, quantize_per_tensor
from mla.providers.transforms import HeadPadding


def fp8_kernel_heads(heads: int) -> int:
    """Heads aiter runs for an fp8 cache: ``mla_decode_fwd`` has no 24-head fp8 path (it
    asserts), so a native-24 record runs as 32 here; every other count is unchanged."""
    return 32 if heads == 24 else heads


def decode_schedule(schedule: object) -> AiterDecodeSchedule:
    """``schedule`` as this provider's own, or :class:`PlanMismatchError`."""
    if not isinstance(schedule, AiterDecodeSchedule):
        raise PlanMismatchError(
            f"the aiter provider needs its own decode schedule, got {type(schedule).__name__}"
        )
    return schedule


def check_fp8_cache(kv_cache: torch.Tensor, kv_scale: torch.Tensor | None, probes: AiterProbes) -> None:
    """An fp8 cache needs ``kv_scale`` and aiter's fp8 dtype for this arch (:class:`InvalidInputError`)."""
    if kv_scale is None:
        raise InvalidInputError("kv_scale", f"an fp8 kv_cache ({dtype_name(kv_cache.dtype)}) needs kv_scale")
    if kv_cache.dtype != probes.fp8_dtype:
        raise InvalidInputError(
            "kv_cache",
            f"aiter on {probes.arch} reads fp8 as {dtype_name(probes.fp8_dtype)}, the cache is "
            f"{dtype_name(kv_cache.dtype)}; allocate the cache in aiter.dtypes.fp8",
        )


def kernel_query(
    q: torch.Tensor, kernel_heads: int, fp8_dtype: torch.dtype | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The contiguous query aiter sees: heads padded (tile-and-slice) to ``kernel_heads``;
    with an fp8 cache quantized per tensor to ``fp8_dtype`` (device ops, no sync)."""
    if kernel_heads != q.shape[1]:
        padded = torch.empty(q.shape[0], kernel_heads, q.shape[2], dtype=q.dtype, device=q.device)
        q = HeadPadding(q.shape[1], kernel_heads).pad(q, padded)
    if fp8_dtype is None:
        return q.contiguous(), None
    q8, scale = quantize_per_tensor(q, fp8_dtype)
    return q8.contiguous(), scale.reshape(1)


_FLAT_IDS = (
    "aiter's decode kernels read flat per-token ids (page size 1), not a block table: its "
    "capability record says decode_reads_block_table=False, so the builder expands the table"
)


def paged_decode(
    aiter: Any,
    probes: AiterProbes,
    call: PagedDecodeCall,
    page_lens_ones: Callable[[int, torch.device], torch.Tensor],
) -> None:
    """``mla_decode_fwd`` over the flat cache for ``call`` (the :meth:`KernelProvider.paged_mqa_decode`
    contract); ``page_lens_ones(batch, device)`` gives int32 ones when no schedule is passed."""
    if call.kv_indices is None:
        raise PlanMismatchError(_FLAT_IDS)
    q, kv_cache, out, lse, kv_scale = call.q, call.kv_cache, call.out, call.lse, call.kv_scale
    qo_indptr, kv_indptr, max_qlen = call.qo_indptr, call.kv_indptr, call.max_qlen
    rows, heads, width = q.shape
    fp8 = is_fp8(kv_cache.dtype)
    if fp8:
        check_fp8_cache(kv_cache, kv_scale, probes)
    kernel_heads = fp8_kernel_heads(heads) if fp8 else heads
    q_kernel, q_scale = kernel_query(q, kernel_heads, probes.fp8_dtype if fp8 else None)
    if fp8 != is_fp8(q_kernel.dtype):
        raise PlanMismatchError("aiter decode: an fp8 cache needs an fp8 query (no a16w8 kernel)")
    batch = qo_indptr.numel() - 1
    persistent = call.schedule is not None
    kwargs: dict[str, Any] = {"sm_scale": float(call.softmax_scale)}
    if "page_size" in probes.decode_params:
        kwargs["page_size"] = 1
    if "nhead_kv" in probes.decode_params:
        kwargs["nhead_kv"] = 1
    if fp8:
        assert kv_scale is not None
        assert q_scale is not None
        kwargs["q_scale"] = q_scale
        kwargs["kv_scale"] = kv_scale.reshape(1)
    if persistent:
        plan = decode_schedule(call.schedule)
        plan.check(
            batch=batch,
            qlen=max_qlen,
            heads=kernel_heads,
            q_dtype=q_kernel.dtype,
            kv_dtype=kv_cache.dtype,
        )
        plan.check_planned(batch=batch, qlen=max_qlen)
        kwargs.update(plan.decode_kwargs(max_qlen))
        page_lens = plan.kv_last_page_lens[:batch]
    else:
        page_lens = page_lens_ones(batch, q.device)
    kernel_lse = (
        lse is not None
        and probes.decode_returns_lse
        and kernel_returns_decode_lse(
            probes.arch, persistent=persistent, fp8=fp8, heads=kernel_heads, qlen=max_qlen
        )
    )
    if kernel_lse:
        kwargs["return_lse"] = True
    target = out
    if kernel_heads != heads or not out.is_contiguous():
        target = torch.empty(rows, kernel_heads, out.shape[-1], dtype=out.dtype, device=out.device)
    # aiter may rebind the storage of the tensor it is handed (folded heads at qlen > 1:
    # ``o.set_(...)``), so it gets a fresh view and the result is copied back if moved.
    o_arg = target.view(target.shape)
    result = aiter.mla.mla_decode_fwd(
        q_kernel,
        kv_cache.view(-1, 1, 1, width),
        o_arg,
        qo_indptr,
        kv_indptr,
        call.kv_indices,
        page_lens,
        max_qlen,
        **kwargs,
    )
    if o_arg.data_ptr() != target.data_ptr():
        target.copy_(o_arg)
    if target is not out:
        out.copy_(target[:, :heads])
    if lse is not None and kernel_lse:
        lse.copy_(result[1].reshape(rows, kernel_heads)[:, :heads])
    elif lse is not None:
        reference_decode_lse(call, q if q_scale is None else dequantize(q_kernel[:, :heads], q_scale), lse)
    clear_empty_rows(out, lse, empty_decode_rows(qo_indptr, kv_indptr, rows))


def schedule_buffers(aiter: Any, probes: AiterProbes, call: DecodeScheduleBuffersCall) -> AiterDecodeSchedule:
    """The persistent buffers sized by ``get_mla_metadata_info_v1`` for ``call``."""
    max_batch, kv_dtype = call.max_batch, call.kv_dtype
    fp8 = is_fp8(kv_dtype)
    heads = fp8_kernel_heads(call.kernel_heads) if fp8 else call.kernel_heads
    kernel_q = probes.fp8_dtype if fp8 else call.q_dtype

    def info(qlen: int) -> Any:
        return aiter.get_mla_metadata_info_v1(
            max_batch, qlen, heads, kernel_q, kv_dtype, False, fast_mode=True
        )

    return AiterDecodeSchedule.allocate(
        info,
        max_batch=max_batch,
        max_kernel_qlen=call.max_kernel_qlen,
        kernel_heads=heads,
        q_dtype=kernel_q,
        kv_dtype=kv_dtype,
        device=call.device,
    )


def plan_schedule(aiter: Any, call: PlanDecodeScheduleCall) -> None:
    """Re-plan ``call.schedule`` in place with ``get_mla_metadata_v1`` for this step."""
    batch_size, kernel_qlen = call.batch_size, call.kernel_qlen
    plan = decode_schedule(call.schedule)
    plan.check(
        batch=batch_size,
        qlen=kernel_qlen,
        heads=plan.kernel_heads,
        q_dtype=plan.q_dtype,
        kv_dtype=plan.kv_dtype,
    )
    aiter.get_mla_metadata_v1(
        call.qo_indptr[: batch_size + 1],
        call.kv_indptr[: batch_size + 1],
        plan.kv_last_page_lens[:batch_size],
        plan.kernel_heads,
        1,
        True,
        *plan.buffers(kernel_qlen),
        page_size=1,
        kv_granularity=DECODE_KV_GRANULARITY,
        max_seqlen_qo=kernel_qlen,
        uni_seqlen_qo=kernel_qlen if call.uniform_qlen else -1,
        fast_mode=True,
        dtype_q=plan.q_dtype,
        dtype_kv=plan.kv_dtype,
    )
    plan.planned_qlen, plan.planned_batch = kernel_qlen, batch_size


def small_head_decode(probes: AiterProbes, call: SmallHeadDecodeCall) -> None:
    """The Gluon small-head kernel (``mla_gluon`` or ``mla_decode_gluon``) for ``call``."""
    if call.page_table is None:
        raise PlanMismatchError(_FLAT_IDS)
    q_nope, q_pe, out, lse, kv_scale = call.q_nope, call.q_pe, call.out, call.lse, call.kv_scale
    gluon = probes.gluon_fn
    if gluon is None:
        raise ProviderUnavailableError(f"provider 'aiter' has no Gluon small-head kernel: {probes.gluon}")
    rows, heads, rank = q_nope.shape
    if kv_scale is not None:
        # mla_gluon takes kv_scale as a Python float (a tensor would be read as a pointer):
        # scale the query and the output by the device tensor instead (no host sync).
        q_nope, q_pe = q_nope * kv_scale.to(q_nope.dtype), q_pe * kv_scale.to(q_pe.dtype)
    target = out if out.is_contiguous() else torch.empty(out.shape, dtype=out.dtype, device=out.device)
    kernel_lse = lse is not None and "return_lse" in probes.gluon_params
    extra: dict[str, Any] = {"return_lse": True} if kernel_lse else {}
    result = gluon(
        q_nope=q_nope,
        q_pe=q_pe,
        kv_c=call.kv_cache,
        o=target,
        page_table=call.page_table,
        seq_info=call.seq_info,
        sm_scale=float(call.softmax_scale),
        k_pe=None,
        kv_pe_offset=rank,
        use_2d_view=False,
        kv_scale=1.0,
        min_kv_seq_len=1,
        **extra,
    )
    if kv_scale is not None:
        target.mul_(kv_scale.to(target.dtype))
    if target is not out:
        out.copy_(target)
    if lse is not None and kernel_lse:
        lse.copy_(result[1].reshape(rows, heads))
    elif lse is not None:
        reference_small_head_lse(call, lse)
    clear_empty_rows(out, lse, empty_indptr_rows(call.seq_info, rows))
