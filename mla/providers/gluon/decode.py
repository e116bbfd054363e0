"""Launchers of the Gluon MLA decode: paged MQA decode and small-head decode.

Contracts (same as the Triton provider's, see :mod:`mla.providers.base`): q ``[T, H, L+R]`` (or
``q_nope [T, H, L]`` / ``q_pe [T, H, R]`` strided views with a contiguous last dim), flat cache
``[N_tok, L+R]`` (16-bit, or fp8 with a per-tensor scale given as a one-element float32 device
tensor; rows on 16-byte boundaries, see :func:`_check_cache_rows`),
``kv_indptr``/``kv_indices``/``qo_indptr`` int32 on the device, out ``[T, H, L]``, lse
``[T, H]`` fp32 or ``None`` (not written). Split-KV partials are combined by the Triton
provider's reduce kernel (:func:`mla.providers.triton.merge.launch_merge`), or in the few-rows
kernel itself with ``GluonLaunchConfig(fold=True)`` (:mod:`.fold`). Everything is
graph-capturable: grids come from shapes and Python ints.
"""

from __future__ import annotations

import torch
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from mla.core.errors import InvalidInputError, PlanMismatchError
from mla.providers.calls import PagedDecodeCall, SmallHeadDecodeCall
from mla.providers.gluon.dual import BOX_COLS, LAT_BOX_LAYOUT, ROPE_BOX_LAYOUT, mla_decode_dual_kernel
from mla.providers.gluon.dual import LOADER_WARPS as DUAL_LOADER_WARPS
from mla.providers.gluon.fold import barrier_words, fold_slice
from mla.providers.gluon.kernels import MODE_SCHEDULED, MODE_SPLIT, mla_decode_kernel
from mla.providers.gluon.pingpong import LOADER_WARPS as PINGPONG_LOADER_WARPS
from mla.providers.gluon.pingpong import mla_decode_pingpong_kernel
from mla.providers.gluon.planner import (
    BLOCK_M,
    NUM_WARPS,
    GluonLaunchConfig,
    check_config,
    decode_kernel,
    launch_config,
)
from mla.providers.gluon.transposed import mla_decode_rows_kernel
from mla.providers.split_kv import SplitKVSchedule
from mla.providers.triton.decode import num_sms
from mla.providers.triton.merge import launch_merge, split_work

LOG2E = 1.4426950408889634


def _is_fp8(kv_cache: torch.Tensor) -> bool:
    """Whether the cache is one of the fp8 formats the kernels widen (one byte per element)."""
    return kv_cache.element_size() == 1


def _check_cache_rows(kv_cache: torch.Tensor) -> None:
    """The Gluon kernels copy cache rows in 16-byte pieces (``cp.async``, TMA): rows must start
    on 16-byte boundaries, with a contiguous last dimension."""
    if kv_cache.stride(1) != 1 or kv_cache.stride(0) % 16 or kv_cache.data_ptr() % 16:
        raise InvalidInputError(
            "kv_cache",
            f"the Gluon kernels copy cache rows in 16-byte pieces; this cache (strides "
            f"{tuple(kv_cache.stride())}, base {kv_cache.data_ptr() % 16} bytes past a 16-byte "
            "boundary) needs a contiguous last dim, a row stride that is a multiple of 16 elements "
            "and a 16-byte aligned base (allocate it contiguous), or provider='triton'",
        )


def _kv_box_descriptors(
    kv_cache: torch.Tensor, rank: int, block_n: int
) -> tuple[TensorDescriptor, TensorDescriptor]:
    """TMA descriptors of the dual-chain kernel's ``[block_n, BOX_COLS]`` latent and
    ``[block_n, rope]`` boxes over the flat cache ``[N_tok, rank + rope]`` (rows checked by
    :func:`_check_cache_rows`)."""
    shape, strides = list(kv_cache.shape), [kv_cache.stride(0), 1]
    lat = TensorDescriptor(kv_cache, shape, strides, [block_n, BOX_COLS.value], LAT_BOX_LAYOUT)
    rope = TensorDescriptor(kv_cache, shape, strides, [block_n, shape[1] - rank], ROPE_BOX_LAYOUT)
    return lat, rope


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def launch_gluon_decode(
    *,
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    qo_indptr: torch.Tensor | None,
    num_requests: int,
    max_qlen: int,
    softmax_scale: float,
    kv_scale: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    config: GluonLaunchConfig,
    schedule: SplitKVSchedule | None,
) -> None:
    """Launch the decode kernel (and the reduce when any request is split).

    ``qo_indptr is None``: row ``b`` of q is request ``b`` with qlen 1 (small-head mode).
    Non-persistent when ``schedule is None`` (``config.num_splits`` splits per request).
    ``kv_scale`` is required for an fp8 cache (``None`` otherwise).
    """
    heads, rank = q_nope.shape[1], q_nope.shape[2]
    rope = q_pe.shape[2]
    kernel, why = decode_kernel(
        q_dtype=q_nope.dtype, kv_dtype=kv_cache.dtype, kv_lora_rank=rank, rope_dim=rope
    )
    if kernel != "gluon":
        raise InvalidInputError("q", f"not a Gluon kernel case ({why}); run it on the Triton provider")
    rows = heads * max_qlen
    if num_requests == 0 or rows == 0:
        return
    row_blocks = config.row_blocks(rows)
    kv_fp8 = _is_fp8(kv_cache)
    check_config(config, kv_fp8=kv_fp8)
    _check_cache_rows(kv_cache)
    if kv_fp8 and kv_scale is None:
        raise InvalidInputError("kv_scale", "an fp8 cache needs its per-tensor scale (float32 [1] tensor)")
    scale_arg = kv_scale if kv_scale is not None else out.new_empty(1, dtype=torch.float32)
    write_lse = lse is not None
    lse_arg = lse if lse is not None else out.new_empty(1, 1, dtype=torch.float32)
    unit_qlen = qo_indptr is None
    qo = kv_indptr if qo_indptr is None else qo_indptr
    mode, num_splits = (MODE_SPLIT, config.num_splits) if schedule is None else (MODE_SCHEDULED, 1)
    num_work, part_o, part_lse, work_info, split_indptr = split_work(
        schedule=schedule, num_splits=num_splits, num_requests=num_requests, max_qlen=max_qlen,
        heads=heads, rank=rank, kv_indptr=kv_indptr, out=out,
    )  # fmt: skip
    common = (
        q_nope,
        q_pe,
        kv_cache,
        kv_indptr,
        kv_indices,
        qo,
        work_info,
        split_indptr,
        out,
        lse_arg,
        part_o,
        part_lse,
    )
    strides = (
        num_splits,
        kv_cache.shape[0],  # num_kv_rows: ids outside [0, rows) are masked, never read
        q_nope.stride(0),
        q_nope.stride(1),
        q_pe.stride(0),
        q_pe.stride(1),
        kv_cache.stride(0),
        out.stride(0),
        out.stride(1),
        lse_arg.stride(0),
        lse_arg.stride(1),
        part_o.stride(0),
        part_o.stride(1),
        part_o.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        softmax_scale * LOG2E,
    )
    constexprs = {
        "H": heads, "L": rank, "R": rope, "BLOCK_N": config.block_n, "NUM_STAGES": config.num_stages,
        "ROW_BLOCKS": row_blocks, "MODE": mode, "UNIT_QLEN": unit_qlen, "WRITE_LSE": write_lse,
        "KV_FP8": kv_fp8,
    }  # fmt: skip
    grid = (num_work * row_blocks,)
    if config.dual:
        del constexprs["KV_FP8"], constexprs["NUM_STAGES"]
        # Each program's second MMA warpgroup hands its output, row max and row sum over here.
        merge = out.new_empty(grid[0], config.row_tile * (rank + 2), dtype=torch.float32)
        boxes = _kv_box_descriptors(kv_cache, rank, config.block_n)
        mla_decode_dual_kernel[grid](
            *common, scale_arg, merge, *boxes, *strides, **constexprs, NR=config.row_tile,
            num_warps=DUAL_LOADER_WARPS.value,
        )  # fmt: skip
    elif config.transposed:
        words = _fold_barrier(config, grid=grid[0], rank=rank, device=out.device)
        folds = words is not None
        mla_decode_rows_kernel[grid](
            # Without a fold the kernel never reads barrier_ptr: any device pointer will do.
            *common, scale_arg, words if folds else scale_arg, *strides, **constexprs, NR=config.row_tile,
            FOLD_SPLITS=config.num_splits if folds else 0,
            num_warps=4 if config.row_tile < BLOCK_M else 8, launch_cooperative_grid=folds,
        )  # fmt: skip
        if folds:
            return
    elif config.pingpong:
        del constexprs["KV_FP8"]
        mla_decode_pingpong_kernel[grid](
            *common, scale_arg, *strides, **constexprs, num_warps=PINGPONG_LOADER_WARPS.value
        )
    else:
        mla_decode_kernel[grid](
            *common, scale_arg, *strides, **constexprs, OVERLAP=config.overlap, num_warps=NUM_WARPS
        )
    if mode == MODE_SPLIT and num_splits == 1:
        return
    launch_merge(
        part_o=part_o,
        part_lse=part_lse,
        out=out,
        lse=lse,
        qo_indptr=qo_indptr,
        split_indptr=split_indptr,
        num_requests=num_requests,
        max_qlen=max_qlen,
        num_splits=num_splits if mode == MODE_SPLIT else None,
        num_sms=num_sms(out.device),
    )


def _fold_barrier(
    config: GluonLaunchConfig, *, grid: int, rank: int, device: torch.device
) -> torch.Tensor | None:
    """The barrier words of a launch that folds the split reduce into the few-rows kernel, or
    ``None`` to launch the separate reduce (``config.fold`` unset, or a graph capture before the
    device has barrier words). :class:`InvalidInputError` when ``config.fold`` asks for a launch
    that cannot fold (more programs than SMs, or splits that :func:`.fold.fold_slice` rejects)."""
    if not config.fold:
        return None
    sms = num_sms(device)
    rows = config.row_tile
    if fold_slice(num_splits=config.num_splits, rows=rows, rank=rank) == 0 or grid > sms:
        raise InvalidInputError(
            "config",
            f"fold=True needs every program resident at once and splits that cut a row block's "
            f"{rows} x {rank} output into equal power-of-two runs within a row (got {grid} "
            f"programs on {sms} SMs, num_splits={config.num_splits}); set fold=False",
        )
    return barrier_words(device)


def paged_decode(call: PagedDecodeCall, *, config: GluonLaunchConfig | None = None) -> None:
    """Paged MQA decode on the Gluon kernels (the ``paged-decode`` contract; ``call.schedule``
    selects the planned split-KV path and must be a :class:`~mla.providers.split_kv.SplitKVSchedule`).
    ``config`` overrides the launch heuristic (benchmarks)."""
    schedule = call.schedule
    if schedule is not None and not isinstance(schedule, SplitKVSchedule):
        raise PlanMismatchError(f"the gluon provider takes a SplitKVSchedule, got {type(schedule).__name__}")
    q, out = call.q, call.out
    num_requests = call.qo_indptr.numel() - 1
    rank = out.shape[-1]
    if config is None:
        config = launch_config(
            batch=num_requests,
            rows=q.shape[1] * call.max_qlen,
            max_seqlen_k=call.max_seqlen_k,
            num_sms=num_sms(q.device),
            persistent=schedule is not None,
            kv_fp8=_is_fp8(call.kv_cache),
        )
    launch_gluon_decode(
        q_nope=q[..., :rank],
        q_pe=q[..., rank:],
        kv_cache=call.kv_cache,
        kv_indptr=call.kv_indptr,
        kv_indices=call.kv_indices,
        qo_indptr=call.qo_indptr,
        num_requests=num_requests,
        max_qlen=call.max_qlen,
        softmax_scale=call.softmax_scale,
        kv_scale=call.kv_scale,
        out=out,
        lse=call.lse,
        config=config,
        schedule=schedule,
    )


def small_head_decode(call: SmallHeadDecodeCall, *, config: GluonLaunchConfig | None = None) -> None:
    """Small-head decode on the Gluon kernels: row ``t`` of q is an independent qlen-1 decode
    over ``page_table[seq_info[t] : seq_info[t+1]]`` (the paged kernels in unit-qlen mode)."""
    rows = call.q_nope.shape[0]
    if config is None:
        config = launch_config(
            batch=rows,
            rows=call.q_nope.shape[1],
            max_seqlen_k=call.max_seqlen_k,
            num_sms=num_sms(call.q_nope.device),
            persistent=False,
            kv_fp8=_is_fp8(call.kv_cache),
        )
    launch_gluon_decode(
        q_nope=_last_dim_contiguous(call.q_nope),
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


__all__ = ["launch_gluon_decode", "paged_decode", "small_head_decode"]
