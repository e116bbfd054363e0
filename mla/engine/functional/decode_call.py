"""The door of :func:`mla.mla_decode`: the checks of a call's signature (cached), its step (one
:class:`~mla.engine.backend.step_check.StepChecker` per signature), the plan entry and the step
it runs.

A call's *signature* is everything the checks of its own arguments depend on: each tensor's
shape, dtype and device, and the scalar options. Those checks run once per signature; the
:class:`DecodeCall` record caches what they derived, with the checker of the call's step (the
engine's step rules, for a backend sized by the call's shapes). A repeated call then checks only
values that may change between calls: a float ``kv_scale``, and its step's values.
"""

from __future__ import annotations

import numbers

import attrs
import torch

from mla.core.config import EngineLimits, KVCacheSpec, MLADims, dtype_name
from mla.core.errors import InvalidInputError
from mla.core.platform import resolve_platform
from mla.core.validate import (
    check_cache_scale,
    require_bool,
    require_call_validate_mode,
    require_dequant_range,
    require_float,
    require_index,
    require_int,
    require_paged_cache,
    require_same_device,
    require_scale,
    require_softmax_scale,
    require_tensor,
)
from mla.engine.backend import MLABackend, StepInputs
from mla.engine.backend.step_check import CheckedStep, StepChecker, StepRules
from mla.engine.decision.resolver import Resolver
from mla.engine.functional.args import DecodeArgs
from mla.engine.functional.decode_graphs import require_graph_replay
from mla.engine.functional.plan_cache import PLAN_CACHE_SIZE, DecodeEntry, PlanCache, available_provider
from mla.engine.functional.read_back import StepCounts
from mla.strategy import Phase

_FLOAT_SCALE = "float"


def _described(tensor: torch.Tensor | None) -> tuple[object, ...] | None:
    return None if tensor is None else (tensor.shape, tensor.dtype, tensor.device)


def decode_signature(args: DecodeArgs) -> tuple[object, ...]:
    """What the call's checks depend on (hashable). Raises ``AttributeError``/``TypeError``
    for arguments of the wrong kind: the caller then runs the checks, which name them."""
    q, kv_cache, block_table, seq_lens = args.q, args.kv_cache, args.block_table, args.seq_lens
    qsl = args.query_start_loc
    scale: object = _FLOAT_SCALE
    kv_scale: object = args.kv_scale
    if kv_scale is None or isinstance(kv_scale, torch.Tensor):
        scale = _described(kv_scale)
    elif isinstance(kv_scale, bool) or not isinstance(kv_scale, numbers.Real):
        raise TypeError("kv_scale")
    return (
        q.shape, q.dtype, q.device, kv_cache.shape, kv_cache.stride(), kv_cache.dtype, kv_cache.device,
        block_table.shape, block_table.dtype, block_table.device,
        seq_lens.shape, seq_lens.dtype, seq_lens.device,
        _described(qsl), _described(args.out), _described(args.lse), scale,
        type(args.softmax_scale), args.softmax_scale, type(args.kv_lora_rank), args.kv_lora_rank,
        args.provider, args.strategy, args.platform, type(args.return_lse), args.return_lse,
        args.validate, args.graph,
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
    base_key: tuple[object, ...]
    """The plan key without the decode qlen bound (which depends on ``query_start_loc``)."""
    host_qsl: bool
    """``query_start_loc`` is given on the host."""
    replay: bool
    """Static conditions of the CUDA-graph replay hold (see :mod:`mla.engine.functional.decode_graphs`)."""
    scale_on_host: bool
    """``kv_scale`` is a float or a host tensor: its value is checked per call."""
    checked: bool
    """``validate="checked"``: the page-index fill counts bad lengths and block ids on the device
    and the door reads the counts after the launch (:mod:`~mla.engine.functional.read_back`)."""
    checker: StepChecker
    """The step rules of the call's shapes (no graph-padding rows: every row of q is a request's)."""
    unit_qsl_cpu: torch.Tensor
    """int64 ``[B+1]`` ``0..B`` on the host: the indptr of one token per request."""
    unit_qsl: torch.Tensor
    """The same, int32 on q's device."""


DECODE_CALLS: PlanCache[tuple[object, ...], DecodeCall] = PlanCache(4 * PLAN_CACHE_SIZE)
"""Checked signatures (least recently used evicted first)."""


def check_decode_call(args: DecodeArgs) -> DecodeCall:
    """Every check of :func:`mla.mla_decode`'s own arguments that depends on the signature alone
    (the value checks of a float ``kv_scale`` included); :class:`InvalidInputError` naming the
    argument. The step's values are the ``checker``'s."""
    mode = require_call_validate_mode(args.validate)
    replay = require_graph_replay(args.graph)
    q = require_tensor("q", args.q, ndim=3)
    kv_cache = require_tensor("kv_cache", args.kv_cache, ndim=3)
    block_table = require_index("block_table", args.block_table, ndim=2)
    seq_lens = require_index("seq_lens", args.seq_lens, ndim=1)
    require_float("q", q)
    require_float("kv_cache", kv_cache, allow_fp8=True)
    require_paged_cache("kv_cache", kv_cache)
    tensors = [("kv_cache", kv_cache), ("block_table", block_table), ("seq_lens", seq_lens)]
    qsl = None
    if args.query_start_loc is not None:
        qsl = require_index("query_start_loc", args.query_start_loc, ndim=1)
        if qsl.device.type != "cpu":
            tensors.append(("query_start_loc", qsl))
    require_same_device(("q", q), *tensors)
    scale = require_softmax_scale(args.softmax_scale)
    rank = require_int("kv_lora_rank", args.kv_lora_rank, minimum=1)
    require_bool("return_lse", args.return_lse)
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
    check_cache_scale(args.kv_scale, kv_cache.dtype, device=q.device)
    if args.out is not None:
        require_output("out", args.out, (num_tokens, num_heads, rank), q.dtype, q.device)
    if args.lse is not None:
        require_output("lse", args.lse, (num_tokens, num_heads), torch.float32, q.device)
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
    block_size, num_blocks = kv_cache.shape[1], kv_cache.shape[0]
    checker = StepChecker(
        StepRules(
            limits=EngineLimits(
                max_num_seqs=max(1, num_requests),
                max_model_len=max(1, block_table.shape[1] * block_size),
                max_num_batched_tokens=max(1, num_tokens),
                max_decode_qlen=max(1, num_tokens),
            ),
            block_size=max(1, block_size),
            num_blocks=num_blocks,
            device=q.device,
            validate="full" if mode == "full" else "fast",
            rows_of="q",
            model_len=False,
        )
    )
    unit = torch.arange(num_requests + 1, dtype=torch.int64)
    base_key = (
        tuple(q.shape), q.dtype, q.device, tuple(kv_cache.shape), kv_cache.dtype,
        tuple(block_table.shape), scale, rank, args.provider, args.strategy, args.platform, mode,
    )  # fmt: skip
    kv_scale = args.kv_scale
    return DecodeCall(
        num_tokens=num_tokens,
        num_heads=num_heads,
        num_requests=num_requests,
        kv_lora_rank=rank,
        block_size=block_size,
        num_blocks=num_blocks,
        base_key=base_key,
        host_qsl=qsl is not None and qsl.device.type == "cpu",
        replay=replay == "auto" and mode != "full",
        scale_on_host=kv_scale is not None
        and (not isinstance(kv_scale, torch.Tensor) or kv_scale.device.type == "cpu"),
        checked=mode == "checked",
        checker=checker,
        unit_qsl_cpu=unit,
        # Made on the device (a kernel, not a host-to-device copy: nothing to synchronize).
        unit_qsl=torch.arange(num_requests + 1, dtype=torch.int32, device=q.device),
    )


def check_scale_value(kv_scale: float | torch.Tensor, kv_dtype: torch.dtype) -> None:
    """A repeated call's ``kv_scale`` held on the host: finite, > 0 and keeping the dequantized
    ``kv_dtype`` cache finite (its kind and dtype were checked with the signature)."""
    if isinstance(kv_scale, torch.Tensor):
        require_dequant_range(require_scale("kv_scale", float(kv_scale.detach().reshape(()))), kv_dtype)
    else:
        require_dequant_range(require_scale("kv_scale", kv_scale), kv_dtype)


def check_step(call: DecodeCall, args: DecodeArgs) -> CheckedStep:
    """The call's step, checked by the call's ``checker`` (the engine's step rules): one request
    per ``seq_lens`` entry, all of them decodes, every row of q a request's. Host tensors only
    (a device ``query_start_loc`` is copied to the host once): the step's device tensors are
    made by :func:`device_step` when it runs."""
    qsl = args.query_start_loc
    host = call.unit_qsl_cpu if qsl is None else qsl if call.host_qsl else qsl.cpu()
    step = StepInputs(host, host, args.seq_lens, args.block_table, call.num_requests, call.num_tokens)
    return call.checker.check_values(step)


def check_counts(
    counts: list[int], call: DecodeCall, args: DecodeArgs, query_start_loc_cpu: torch.Tensor
) -> None:
    """``validate="checked"``, after the launch: the fill's counts of the call (keys outside the
    cache, requests with a bad length). When one is not 0, the ``validate="full"`` host rules run
    on host copies of the call's values and raise the error naming the argument and the fix; if
    they find nothing (the values changed since the launch), the counts are the error."""
    keys, lengths = counts
    if not keys and not lengths:
        return
    full = StepChecker(attrs.evolve(call.checker.rules, validate="full"))
    full.check_values(
        StepInputs(
            query_start_loc_cpu, query_start_loc_cpu, args.seq_lens, args.block_table, call.num_requests,
            call.num_tokens,
        )
    )  # fmt: skip
    if keys:
        raise InvalidInputError(
            "block_table",
            f"{keys} keys of this call were in blocks outside the cache's {call.num_blocks} blocks "
            "(masked: they read nothing) but the current block_table and seq_lens have none; were "
            "they changed while the call ran? Pass block ids in [0, num_blocks)",
        )
    raise InvalidInputError(
        "seq_lens",
        f"{lengths} requests of this call had a seq_len that was negative, below its query length "
        "or past the block table's capacity, but the current seq_lens have none; were they changed "
        "while the call ran?",
    )


def device_step(checked: CheckedStep, query_start_loc: torch.Tensor) -> CheckedStep:
    """``checked`` over the device tensors a run reads: ``query_start_loc`` (int32 on q's
    device), and ``seq_lens`` and ``block_table`` as int32."""
    step = checked.inputs
    seq_lens, table = step.seq_lens, step.block_table
    return checked.with_inputs(
        StepInputs(
            query_start_loc_cpu=step.query_start_loc_cpu,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens if seq_lens.dtype == torch.int32 else seq_lens.to(torch.int32),
            block_table=table if table.dtype == torch.int32 else table.to(torch.int32),
            num_decodes=step.num_decodes,
            num_decode_tokens=step.num_decode_tokens,
        )
    )


def new_entry(call: DecodeCall, args: DecodeArgs, max_decode_qlen: int) -> DecodeEntry:
    """A plan for the call's shapes: a backend sized for exactly this batch (no preallocation:
    the first build resolves and allocates)."""
    try:
        return _new_entry(call, args, max_decode_qlen)
    except InvalidInputError as error:
        # The backend's records name their own fields; the caller called mla_decode.
        own = _DECODE_ARGUMENT.get(error.argument)
        if own is None:
            raise
        name, what = own
        raise InvalidInputError(name, f"{what} {error.reason}") from error


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


def _new_entry(call: DecodeCall, args: DecodeArgs, max_decode_qlen: int) -> DecodeEntry:
    q, softmax_scale = args.q, args.softmax_scale
    plat = resolve_platform(args.platform, q.device)
    strategy = args.strategy
    forced = None if strategy is None else Resolver().forced_strategy(strategy, Phase.DECODE)
    dims = MLADims(
        num_heads=call.num_heads,
        kv_lora_rank=call.kv_lora_rank,
        qk_rope_head_dim=q.shape[-1] - call.kv_lora_rank,
        softmax_scale=softmax_scale,
    )
    limits = EngineLimits(
        max_num_seqs=call.num_requests,
        max_model_len=max(1, args.block_table.shape[1] * call.block_size),
        max_num_batched_tokens=max(1, call.num_tokens),
        max_decode_qlen=max_decode_qlen,
    )
    backend = MLABackend(
        dims,
        # An empty cache (every request of length 0) has no count to record.
        KVCacheSpec(call.block_size, args.kv_cache.dtype, num_blocks=call.num_blocks or None),
        limits,
        model_dtype=q.dtype,
        provider=available_provider(args.provider, plat),
        platform=plat,
        device=q.device,
        decode_strategy=forced,
        preallocate=False,
        validate=call.checker.rules.validate,
    )
    if not call.checked:
        return DecodeEntry(backend)
    # The fill counts the requests with a bad length next to the keys outside the cache: one
    # copy reads both.
    backend.index_buffers.count_lengths(backend.decode_counts[1:])
    return DecodeEntry(backend, counts=StepCounts(backend.decode_counts))


def run_step(
    backend: MLABackend,
    step: CheckedStep,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    kv_scale: torch.Tensor | None,
    counts: StepCounts | None = None,
) -> None:
    """Plan the checked step on ``backend`` and run its decode (device work only unless
    ``validate="full"``: what a CUDA graph captures); the call's door checked everything it can
    on the host. ``counts``: zeroed before the build and copied right after it, before the
    decode kernels (the caller reads them after the launch)."""
    if counts is not None:
        counts.reset()
    backend.builder.plan(step)
    if counts is not None:
        counts.start()
    strategy, plan = backend.current_decode()
    strategy.run(plan, q, kv_cache, kv_scale=kv_scale, out=out, lse=lse)


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
