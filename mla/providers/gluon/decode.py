"""Launchers of the Gluon MLA decode: paged MQA decode and small-head decode.

Contracts (same as the Triton provider's, see :mod:`mla.providers.base` and
:mod:`mla.providers.triton.decode_launch`, whose skeleton every launch here runs on): q
``[T, H, L+R]`` (or ``q_nope [T, H, L]`` / ``q_pe [T, H, R]`` strided views with a contiguous
last dim), flat cache ``[N_tok, L+R]`` (16-bit, or fp8 with a per-tensor scale given as a
one-element float32 device tensor; rows on 16-byte boundaries, see :func:`_check_cache_rows`),
``kv_indptr``/``kv_indices``/``qo_indptr`` int32 on the device, out ``[T, H, L]``, lse
``[T, H]`` fp32 or ``None`` (not written). Split-KV partials are combined by the Triton
provider's reduce kernel (:func:`mla.providers.triton.merge.launch_merge`), or in the few-rows
kernel itself with ``GluonLaunchConfig(fold=True)`` (:mod:`.fold`). Everything is
graph-capturable: grids come from shapes and Python ints.

The kernel of a launch is ``config.kernel``; what each kernel takes is the planner's
:data:`~mla.providers.gluon.planner.KERNEL_TABLE` and how each is launched is :data:`LAUNCHERS`
(the operands every decode kernel shares come from the skeleton's
:class:`~mla.providers.triton.decode_launch.DecodeLaunch`; a launcher adds its kernel's own).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from mla.core.config import ds_mla_row_bytes
from mla.core.errors import InvalidInputError
from mla.providers.calls import PagedDecodeCall, SmallHeadDecodeCall, SparseAttentionCall
from mla.providers.gluon import ds_mla_heads, ds_mla_rows
from mla.providers.gluon.dual import BOX_COLS, LAT_BOX_LAYOUT, ROPE_BOX_LAYOUT, mla_decode_dual_kernel
from mla.providers.gluon.dual import LOADER_WARPS as DUAL_LOADER_WARPS
from mla.providers.gluon.fold import barrier_words, fold_slice
from mla.providers.gluon.kernels import mla_decode_kernel
from mla.providers.gluon.pingpong import LOADER_WARPS as PINGPONG_LOADER_WARPS
from mla.providers.gluon.pingpong import mla_decode_pingpong_kernel
from mla.providers.gluon.planner import (
    BLOCK_M,
    NUM_WARPS,
    GluonKernel,
    GluonLaunchConfig,
    check_config,
    decode_kernel,
    launch_config,
)
from mla.providers.gluon.sparse import sparse_inputs
from mla.providers.gluon.transposed import mla_decode_rows_kernel
from mla.providers.triton.decode_launch import DecodeInputs, DecodeLaunch, launch_split_decode, num_sms
from mla.providers.triton.launch_cache import LaunchCache
from mla.providers.triton.pdl import pdl_options


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


def kv_ds_mla(inputs: DecodeInputs) -> bool:
    """Whether the cache rows are ``fp8_ds_mla`` (the sparse attention hands them over as an
    fp8 view of the byte rows: ``L`` e4m3 latent values, ``L / 128`` float32 scales, ``R``
    bf16 rope values, wider than a per-tensor fp8 row of ``L + R``)."""
    rank, rope = int(inputs.q_nope.shape[2]), int(inputs.q_pe.shape[2])
    return inputs.kv_fp8 and int(inputs.kv_cache.shape[1]) == ds_mla_row_bytes(rank, rope)


ROWS_LAUNCH = LaunchCache(mla_decode_rows_kernel)
ROW64_LAUNCH = LaunchCache(mla_decode_kernel)
PINGPONG_LAUNCH = LaunchCache(mla_decode_pingpong_kernel)
DUAL_LAUNCH = LaunchCache(mla_decode_dual_kernel)
DS_MLA_LAUNCH = LaunchCache(ds_mla_rows.mla_decode_ds_mla_kernel)
DS_MLA_HEADS_LAUNCH = LaunchCache(ds_mla_heads.mla_decode_ds_mla_heads_kernel)
"""The decode kernels' cached launches (:mod:`mla.providers.triton.launch_cache`), one per kernel."""


def _constexprs(decode: DecodeLaunch, config: GluonLaunchConfig) -> dict[str, int | bool]:
    """The shared constexprs (the key operand's too) plus the KV tile every Gluon kernel takes."""
    return {**decode.constexprs(), **decode.key_constexprs(), "BLOCK_N": config.block_n}


def _launch_rows(decode: DecodeLaunch, config: GluonLaunchConfig) -> bool:
    """The transposed few-rows kernel (16-, 32- or 64-row tiles; 4 warps below 64 rows), with
    the split reduce folded in when ``config.fold`` asks for it (then it reports the reduce done)."""
    out = decode.inputs.out
    words = _fold_barrier(config, grid=decode.grid[0], rank=out.shape[-1], device=out.device)
    folds = words is not None
    ROWS_LAUNCH.launch(
        decode.grid,
        # Without a fold the kernel never reads barrier_ptr: any device pointer will do.
        *decode.tensors(), decode.kv_scale, words if folds else decode.kv_scale, *decode.scalars(),
        *decode.key_operands(), **_constexprs(decode, config), NUM_STAGES=config.num_stages,
        KV_FP8=decode.inputs.kv_fp8, KV_DS_MLA=kv_ds_mla(decode.inputs), NR=config.row_tile,
        FOLD_SPLITS=config.num_splits if folds else 0,
        num_warps=4 if config.row_tile < BLOCK_M else 8, launch_cooperative_grid=folds,
    )  # fmt: skip
    return folds


def _launch_row64(decode: DecodeLaunch, config: GluonLaunchConfig) -> bool:
    """The 64-row kernel (8 warps; 16-bit or fp8 caches; optionally overlapped MMAs)."""
    ROW64_LAUNCH.launch(
        decode.grid,
        *decode.tensors(), decode.kv_scale, *decode.scalars(), *decode.key_operands(),
        **_constexprs(decode, config), NUM_STAGES=config.num_stages, KV_FP8=decode.inputs.kv_fp8,
        KV_DS_MLA=kv_ds_mla(decode.inputs), OVERLAP=config.overlap, num_warps=NUM_WARPS,
    )  # fmt: skip
    return False


def _launch_pingpong(decode: DecodeLaunch, config: GluonLaunchConfig) -> bool:
    """The ping-pong kernel (64 rows of a 16-bit cache; the launch's warps are its loader)."""
    PINGPONG_LAUNCH.launch(
        decode.grid,
        *decode.tensors(), decode.kv_scale, *decode.scalars(), *decode.key_operands(),
        **_constexprs(decode, config), NUM_STAGES=config.num_stages, num_warps=PINGPONG_LOADER_WARPS.value,
    )  # fmt: skip
    return False


def _launch_dual(decode: DecodeLaunch, config: GluonLaunchConfig) -> bool:
    """The dual-chain kernel (16 rows of an fp8 cache): a merge buffer per program, through
    which its second MMA warpgroup hands over its output, row max and row sum, and the TMA
    descriptors of the cache's latent and rope boxes."""
    x = decode.inputs
    rank = x.q_nope.shape[2]
    merge = x.out.new_empty(decode.grid[0], config.row_tile * (rank + 2), dtype=torch.float32)
    boxes = _kv_box_descriptors(x.kv_cache, rank, config.block_n)
    DUAL_LAUNCH.launch(
        decode.grid,
        *decode.tensors(), decode.kv_scale, merge, *boxes, *decode.scalars(), *decode.key_operands(),
        **_constexprs(decode, config), NR=config.row_tile, num_warps=DUAL_LOADER_WARPS.value,
    )  # fmt: skip
    return False


def _launch_ds_mla(decode: DecodeLaunch, config: GluonLaunchConfig) -> bool:
    """The ``fp8_ds_mla`` few-rows kernel (16 or 32 rows): its ring shapes, producer warps and
    MMA registers are :mod:`.ds_mla_rows`'s module settings, read at each launch."""
    rings = ds_mla_rows.RINGS[config.row_tile]
    regs = ds_mla_rows.MMA_REGS if config.row_tile == 16 else ds_mla_rows.MMA_REGS_32
    DS_MLA_LAUNCH.launch(
        decode.grid,
        *decode.tensors(), decode.kv_scale, *decode.scalars(), *decode.key_operands(),
        **_constexprs(decode, config), NR=config.row_tile, CHUNK=rings.chunk, FP8_SLOTS=rings.fp8_slots,
        ROPE_SLOTS=rings.rope_slots, WIDE_SLOTS=rings.wide_slots, MMA_REGS=regs, OVERLAP=config.overlap,
        **pdl_options(decode.inputs.out.device),
        num_warps=ds_mla_rows.PRODUCER_WARPS,
    )  # fmt: skip
    return False


def _launch_ds_mla_heads(decode: DecodeLaunch, config: GluonLaunchConfig) -> bool:
    """The ``fp8_ds_mla`` 64-row kernel (a dequantizing producer, a scores and an output
    warpgroup): its warpgroups' registers are :mod:`.ds_mla_heads`'s module settings, read at each
    launch."""
    DS_MLA_HEADS_LAUNCH.launch(
        decode.grid,
        *decode.tensors(), decode.kv_scale, *decode.scalars(), *decode.key_operands(),
        **_constexprs(decode, config), SCORE_REGS=ds_mla_heads.SCORE_REGS,
        OUTPUT_REGS=ds_mla_heads.OUTPUT_REGS, num_warps=ds_mla_heads.PRODUCER_WARPS.value,
    )  # fmt: skip
    return False


LAUNCHERS: dict[GluonKernel, Callable[[DecodeLaunch, GluonLaunchConfig], bool]] = {
    GluonKernel.ROWS: _launch_rows,
    GluonKernel.ROW64: _launch_row64,
    GluonKernel.PINGPONG: _launch_pingpong,
    GluonKernel.DUAL: _launch_dual,
    GluonKernel.DS_MLA: _launch_ds_mla,
    GluonKernel.DS_MLA_HEADS: _launch_ds_mla_heads,
}
"""How each kernel of :data:`~mla.providers.gluon.planner.KERNEL_TABLE` is launched: its own
operands around the shared ones of the :class:`~mla.providers.triton.decode_launch.DecodeLaunch`
(pointers, then the kernel's extra pointers, then the shared scalars), its constexprs and warps.
Returns whether the kernel reduced its splits itself."""


def launch_gluon_decode(inputs: DecodeInputs, config: GluonLaunchConfig) -> None:
    """Launch ``config.kernel`` (and the reduce when any request is split and the kernel does
    not fold it) through the shared skeleton.

    Raises :class:`InvalidInputError` before any launch for a case the Gluon kernels do not take
    (argument ``q``: :func:`~mla.providers.gluon.planner.decode_kernel` routes it to Triton), a
    ``config`` its kernel cannot run (:func:`~mla.providers.gluon.planner.check_config`), cache
    rows off 16-byte boundaries (``kv_cache``) or an fp8 cache without ``kv_scale``.
    """
    rank, rope = inputs.q_nope.shape[2], inputs.q_pe.shape[2]
    kernel, why = decode_kernel(
        q_dtype=inputs.q_nope.dtype, kv_dtype=inputs.kv_cache.dtype, kv_lora_rank=rank, rope_dim=rope
    )
    if kernel != "gluon":
        raise InvalidInputError("q", f"not a Gluon kernel case ({why}); run it on the Triton provider")
    if inputs.num_requests == 0 or inputs.rows == 0:
        return
    kv_fp8, ds_mla = inputs.kv_fp8, kv_ds_mla(inputs)
    check_config(config, kv_fp8=kv_fp8, ds_mla=ds_mla)
    _check_cache_rows(inputs.kv_cache)
    if ds_mla and inputs.q_nope.dtype != torch.bfloat16:
        raise InvalidInputError("q", "fp8_ds_mla rows carry bf16 rope lanes: the query must be bf16")
    if kv_fp8 and not ds_mla and inputs.kv_scale is None:
        raise InvalidInputError("kv_scale", "an fp8 cache needs its per-tensor scale (float32 [1] tensor)")
    launcher = LAUNCHERS[config.kernel]
    launch_split_decode(
        inputs, row_tile=config.row_tile, num_splits=config.num_splits, launch=lambda d: launcher(d, config)
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


def _auto_config(inputs: DecodeInputs) -> GluonLaunchConfig:
    """The launch heuristic's configuration for ``inputs`` (:func:`.planner.launch_config`)."""
    return launch_config(
        batch=inputs.num_requests,
        rows=inputs.rows,
        max_seqlen_k=inputs.max_seqlen_k,
        num_sms=num_sms(inputs.q_nope.device),
        persistent=inputs.schedule is not None,
        kv_fp8=inputs.kv_fp8,
        ds_mla=kv_ds_mla(inputs),
    )


def paged_decode(call: PagedDecodeCall, *, config: GluonLaunchConfig | None = None) -> None:
    """Paged MQA decode on the Gluon kernels (the ``paged-decode`` contract; ``call.schedule``
    selects the planned split-KV path and must be a :class:`~mla.providers.split_kv.SplitKVSchedule`).
    ``config`` overrides the launch heuristic (benchmarks)."""
    inputs = DecodeInputs.paged(call, provider="gluon", block_table=True)
    launch_gluon_decode(inputs, config if config is not None else _auto_config(inputs))


def sparse_decode(call: SparseAttentionCall, *, config: GluonLaunchConfig | None = None) -> None:
    """Sparse attention on the Gluon kernels: query row ``t`` is a qlen-1 decode over its slot
    list ``slots[t]`` (the kernels' unit-qlen mode; ``-1`` slots and slots past the cache are
    masked keys), so each row's top-k tiles are gathered once for all its heads.
    ``fp8_ds_mla`` byte rows are read through an fp8 view (:func:`kv_ds_mla`); a per-tensor fp8
    cache needs ``kv_scale``. :func:`.sparse.sparse_on_gluon` says which calls this takes."""
    inputs = sparse_inputs(call)
    launch_gluon_decode(inputs, config if config is not None else _auto_config(inputs))


def small_head_decode(call: SmallHeadDecodeCall, *, config: GluonLaunchConfig | None = None) -> None:
    """Small-head decode on the Gluon kernels: row ``t`` of q is an independent qlen-1 decode
    over ``page_table[seq_info[t] : seq_info[t+1]]`` (the paged kernels in unit-qlen mode)."""
    inputs = DecodeInputs.small_head(call, provider="gluon", block_table=True)
    launch_gluon_decode(inputs, config if config is not None else _auto_config(inputs))


__all__ = [
    "LAUNCHERS",
    "kv_ds_mla",
    "launch_gluon_decode",
    "paged_decode",
    "small_head_decode",
    "sparse_decode",
]
