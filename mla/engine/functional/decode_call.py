"""The parts of :func:`mla.mla_decode` behind its fast path: the checks of a call's signature
(cached), the per-call value checks, the plan entry and the step it runs.

A call's *signature* is everything its shape, dtype and device checks depend on: each tensor's
shape, dtype and device, and the scalar options. The checks run once per signature; a repeated
call then checks only values that may change between calls (a float ``kv_scale``, the host
``query_start_loc``). The :class:`DecodeCall` record caches what the checks derived.
"""

from __future__ import annotations

import itertools
import numbers

import attrs
import torch

from mla.core.config import EngineLimits, KVCacheSpec, MLADims, dtype_name
from mla.core.errors import InvalidInputError
from mla.core.platform import Platform, resolve_platform
from mla.core.validate import (
    ValidateMode,
    check_cache_scale,
    require_bool,
    require_dequant_range,
    require_float,
    require_index,
    require_indptr_of_rows,
    require_int,
    require_paged_cache,
    require_same_device,
    require_scale,
    require_softmax_scale,
    require_tensor,
    require_validate_mode,
)
from mla.engine.backend import MLABackend, ops
from mla.engine.backend.checks import check_paged_step
from mla.engine.backend.step import StepInputs
from mla.engine.decision.registry import AnyStrategy
from mla.engine.decision.resolver import Resolver
from mla.engine.functional.decode_graphs import require_graph_replay
from mla.engine.functional.plan_cache import PLAN_CACHE_SIZE, DecodeEntry, PlanCache, available_provider
from mla.providers.base import KernelProvider
from mla.strategy import Phase

_FLOAT_SCALE = "float"


def _described(tensor: torch.Tensor | None) -> tuple[object, ...] | None:
    return None if tensor is None else (tensor.shape, tensor.dtype, tensor.device)


def decode_signature(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor | None,
    softmax_scale: float,
    kv_lora_rank: int,
    kv_scale: object,
    provider: str | KernelProvider,
    strategy: str | AnyStrategy | None,
    platform: Platform | str | None,
    out: torch.Tensor | None,
    lse: torch.Tensor | None,
    return_lse: bool,
    validate: ValidateMode,
    graph: str,
) -> tuple[object, ...]:
    """What the call's checks depend on (hashable). Raises ``AttributeError``/``TypeError``
    for arguments of the wrong kind: the caller then runs the checks, which name them."""
    scale: object = _FLOAT_SCALE
    if kv_scale is None or isinstance(kv_scale, torch.Tensor):
        scale = _described(kv_scale)
    elif isinstance(kv_scale, bool) or not isinstance(kv_scale, numbers.Real):
        raise TypeError("kv_scale")
    return (
        q.shape, q.dtype, q.device, kv_cache.shape, kv_cache.stride(), kv_cache.dtype, kv_cache.device,
        block_table.shape, block_table.dtype, block_table.device,
        seq_lens.shape, seq_lens.dtype, seq_lens.device,
        _described(query_start_loc), _described(out), _described(lse), scale,
        type(softmax_scale), softmax_scale, type(kv_lora_rank), kv_lora_rank,
        provider, strategy, platform, type(return_lse), return_lse, validate, graph,
    )  # fmt: skip


@attrs.frozen(eq=False)
class DecodeCall:
    """What the checks of one signature derived (identity-hashed: a graph key holds it)."""

    num_tokens: int
    num_heads: int
    num_requests: int
    kv_lora_rank: int
    block_size: int
    num_blocks: int
    mode: ValidateMode
    base_key: tuple[object, ...]
    """The plan key without the decode qlen bound (which depends on ``query_start_loc``)."""
    host_qsl: bool
    """``query_start_loc`` is given on the host."""
    replay: bool
    """Static conditions of the CUDA-graph replay hold (see :mod:`mla.engine.functional.decode_graphs`)."""
    scale_on_host: bool
    """``kv_scale`` is a float or a host tensor: its value is checked per call."""


DECODE_CALLS: PlanCache[tuple[object, ...], DecodeCall] = PlanCache(4 * PLAN_CACHE_SIZE)
"""Checked signatures (least recently used evicted first)."""


def check_decode_call(
    q: object,
    kv_cache: object,
    block_table: object,
    seq_lens: object,
    query_start_loc: object,
    softmax_scale: object,
    kv_lora_rank: object,
    kv_scale: object,
    provider: str | KernelProvider,
    strategy: str | AnyStrategy | None,
    platform: Platform | str | None,
    out: object,
    lse: object,
    return_lse: object,
    validate: object,
    graph: object,
) -> DecodeCall:
    """Every check of :func:`mla.mla_decode` that depends on the signature alone (the value
    checks of a float ``kv_scale`` included); :class:`InvalidInputError` naming the argument."""
    mode = require_validate_mode(validate)
    replay = require_graph_replay(graph)
    q = require_tensor("q", q, ndim=3)
    kv_cache = require_tensor("kv_cache", kv_cache, ndim=3)
    block_table = require_index("block_table", block_table, ndim=2)
    seq_lens = require_index("seq_lens", seq_lens, ndim=1)
    require_float("q", q)
    require_float("kv_cache", kv_cache, allow_fp8=True)
    require_paged_cache("kv_cache", kv_cache)
    tensors = [("kv_cache", kv_cache), ("block_table", block_table), ("seq_lens", seq_lens)]
    qsl = None
    if query_start_loc is not None:
        qsl = require_index("query_start_loc", query_start_loc, ndim=1)
        if qsl.device.type != "cpu":
            tensors.append(("query_start_loc", qsl))
    require_same_device(("q", q), *tensors)
    scale = require_softmax_scale(softmax_scale)
    rank = require_int("kv_lora_rank", kv_lora_rank, minimum=1)
    require_bool("return_lse", return_lse)
    num_tokens, num_heads, width = q.shape
    cache_width = kv_cache.shape[-1]
    if cache_width <= rank:
        raise InvalidInputError(
            "kv_cache",
            f"last dim {cache_width} must be kv_lora_rank ({rank}) + rope dim (> 0); pass "
            "the latent cache [num_blocks, block_size, kv_lora_rank + rope] (or the model's kv_lora_rank)",
        )
    if width != cache_width:
        raise InvalidInputError(
            "q",
            f"last dim {width} must equal kv_cache's last dim {cache_width} (kv_lora_rank "
            f"{rank} + rope {cache_width - rank}): pass the absorbed query "
            "[q_nope @ W_UK^T | q_pe]",
        )
    check_cache_scale(kv_scale, kv_cache.dtype, device=q.device)
    if out is not None:
        require_output("out", out, (num_tokens, num_heads, rank), q.dtype, q.device)
    if lse is not None:
        require_output("lse", lse, (num_tokens, num_heads), torch.float32, q.device)
    num_requests = seq_lens.numel()
    if qsl is not None and qsl.numel() != num_requests + 1:
        raise InvalidInputError(
            "query_start_loc",
            f"expected {num_requests + 1} entries for {num_requests} requests, got {qsl.numel()}",
        )
    if qsl is None and num_tokens != num_requests:
        raise InvalidInputError(
            "q",
            f"has {num_tokens} rows for {num_requests} single-token requests (query_start_loc=None); "
            "pass query_start_loc for multi-token requests, or one row per request",
        )
    base_key = (
        tuple(q.shape), q.dtype, q.device, tuple(kv_cache.shape), kv_cache.dtype,
        tuple(block_table.shape), scale, rank, provider, strategy, platform, mode,
    )  # fmt: skip
    return DecodeCall(
        num_tokens=num_tokens,
        num_heads=num_heads,
        num_requests=num_requests,
        kv_lora_rank=rank,
        block_size=kv_cache.shape[1],
        num_blocks=kv_cache.shape[0],
        mode=mode,
        base_key=base_key,
        host_qsl=qsl is not None and qsl.device.type == "cpu",
        replay=replay == "auto"
        and mode == "fast"
        and out is not None
        and (lse is not None or not return_lse),
        scale_on_host=kv_scale is not None
        and (not isinstance(kv_scale, torch.Tensor) or kv_scale.device.type == "cpu"),
    )


def check_scale_value(kv_scale: float | torch.Tensor, kv_dtype: torch.dtype) -> None:
    """A repeated call's ``kv_scale`` held on the host: finite, > 0 and keeping the dequantized
    ``kv_dtype`` cache finite (its kind and dtype were checked with the signature)."""
    if isinstance(kv_scale, torch.Tensor):
        require_dequant_range(require_scale("kv_scale", float(kv_scale.detach().reshape(()))), kv_dtype)
    else:
        require_dequant_range(require_scale("kv_scale", kv_scale), kv_dtype)


def query_start_values(call: DecodeCall, query_start_loc: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """The host copy of ``query_start_loc`` (one device-to-host copy for a device tensor) and
    its values, checked: an indptr whose last entry is q's row count."""
    host = query_start_loc if call.host_qsl else query_start_loc.cpu()
    values: list[int] = host.tolist()
    require_indptr_of_rows("query_start_loc", values, call.num_tokens, "q")
    return host, values


def new_entry(
    call: DecodeCall,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    softmax_scale: float,
    max_decode_qlen: int,
    provider: str | KernelProvider,
    strategy: str | AnyStrategy | None,
    platform: Platform | str | None,
) -> DecodeEntry:
    """A plan for the call's shapes: a backend sized for exactly this batch (no
    preallocation: the first build resolves and allocates), and the unit indptr."""
    try:
        return _new_entry(
            call, q, kv_cache, block_table, softmax_scale, max_decode_qlen, provider, strategy, platform
        )
    except InvalidInputError as error:
        # The backend's records name their own fields; the caller called mla_decode.
        own = _DECODE_ARGUMENT.get(error.argument)
        if own is None:
            raise
        name, what = own
        message = str(error).split(": ", 1)[-1]
        raise InvalidInputError(name, f"{what} {message}") from error


_DECODE_ARGUMENT: dict[str, tuple[str, str]] = {
    "num_heads": ("q", "q's head count (dim 1)"),
    "num_blocks": ("kv_cache", "kv_cache's block count (dim 0)"),
    "block_size": ("kv_cache", "kv_cache's block size (dim 1)"),
    "qk_rope_head_dim": ("kv_cache", "kv_cache's rope width (last dim - kv_lora_rank)"),
    "max_model_len": ("block_table", "block_table's capacity (columns x block size)"),
    "max_num_seqs": ("seq_lens", "the request count (seq_lens' length)"),
    "max_num_batched_tokens": ("q", "q's row count"),
    "model_dtype": ("q", "q's dtype"),
    "device": ("q", "q's device"),
}
"""The backend records' fields a functional decode derives from its own arguments: the
argument an error names instead, and what the field is of it."""


def _new_entry(
    call: DecodeCall,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    softmax_scale: float,
    max_decode_qlen: int,
    provider: str | KernelProvider,
    strategy: str | AnyStrategy | None,
    platform: Platform | str | None,
) -> DecodeEntry:
    plat = resolve_platform(platform, q.device)
    forced = None if strategy is None else Resolver().forced_strategy(strategy, Phase.DECODE)
    width = q.shape[-1]
    dims = MLADims(
        num_heads=call.num_heads,
        kv_lora_rank=call.kv_lora_rank,
        qk_rope_head_dim=width - call.kv_lora_rank,
        softmax_scale=softmax_scale,
    )
    limits = EngineLimits(
        max_num_seqs=call.num_requests,
        max_model_len=max(1, block_table.shape[1] * call.block_size),
        max_num_batched_tokens=max(1, call.num_tokens),
        max_decode_qlen=max_decode_qlen,
    )
    backend = MLABackend(
        dims,
        # An empty cache (every request of length 0) has no count to record.
        KVCacheSpec(call.block_size, kv_cache.dtype, num_blocks=call.num_blocks or None),
        limits,
        model_dtype=q.dtype,
        provider=available_provider(provider, plat),
        platform=plat,
        device=q.device,
        decode_strategy=forced,
        preallocate=False,
        validate=call.mode,
    )
    unit = torch.arange(call.num_requests + 1, dtype=torch.int64)
    return DecodeEntry(backend, unit, unit.to(device=q.device, dtype=torch.int32))


def run_step(
    call: DecodeCall,
    backend: MLABackend,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    qsl_cpu: torch.Tensor,
    qsl: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    kv_scale: torch.Tensor | None,
) -> None:
    """Build the step and run it (device work only under ``validate="fast"``: what a CUDA
    graph captures). ``validate="full"`` reads ``seq_lens`` and ``block_table`` on the host
    and raises on any bad length or block id first."""
    seq_cpu = None
    if call.mode == "full":
        seq_cpu = seq_lens.cpu()
        qsl_values = qsl_cpu.tolist()
        check_paged_step(
            query_lens=[b - a for a, b in itertools.pairwise(qsl_values)],
            seq_lens=seq_cpu.tolist(),
            block_table=block_table,
            block_size=call.block_size,
            num_blocks=call.num_blocks,
            block_ids=True,
        )
    backend.builder.build(
        StepInputs(
            query_start_loc_cpu=qsl_cpu,
            query_start_loc=qsl,
            seq_lens=seq_lens if seq_lens.dtype == torch.int32 else seq_lens.to(torch.int32),
            seq_lens_cpu=seq_cpu,
            block_table=block_table if block_table.dtype == torch.int32 else block_table.to(torch.int32),
            num_decodes=call.num_requests,
            num_decode_tokens=call.num_tokens,
        )
    )
    ops.decode_body(q, kv_cache, out, lse, kv_scale, backend.op_id)


def require_output(
    name: str, tensor: object, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> None:
    """An ``out=``/``lse=`` argument: a tensor of exactly ``shape``, ``dtype`` and ``device``."""
    value = require_tensor(name, tensor, ndim=len(shape))
    if tuple(value.shape) != shape:
        raise InvalidInputError(name, f"expected shape {shape}, got {tuple(value.shape)}")
    if value.dtype != dtype:
        raise InvalidInputError(name, f"expected dtype {dtype_name(dtype)}, got {dtype_name(value.dtype)}")
    if value.device != device:
        raise InvalidInputError(name, f"is on {value.device} but q is on {device}; move it to {device}")
