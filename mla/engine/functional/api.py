"""Functional entry points: one call, one decision, reference-checked semantics.

:func:`mla_decode` and :func:`mla_prefill` validate their inputs, resolve the strategy (or check
the forced one) and run it. The plan (a backend or strategy with its persistent buffers) is
cached per (shapes, dtypes, device, scale, provider, strategy, platform, validate) in a small
LRU (:data:`~mla.engine.functional.plan_cache.PLAN_CACHE_SIZE` entries per function), so a repeated call
costs the kernels plus a small constant: no re-resolution, no buffer allocation, and for decode
no device-to-host copy.
:func:`write_kv` writes new latent rows into the paged cache. Engines use
:class:`~mla.engine.backend.MLABackend` instead, which sizes buffers from the engine limits.
Under ``torch.compile`` each call is one op of :mod:`mla.engine.functional.ops` whose body is
the eager call (no graph break).
"""

from __future__ import annotations

import operator
from typing import Literal, overload

import torch

from mla.core.errors import InvalidInputError
from mla.core.platform import Platform, resolve_platform
from mla.core.validate import (
    ValidateMode,
    require_bool,
    require_float,
    require_index,
    require_indptr_of_rows,
    require_int,
    require_no_overlap,
    require_same_device,
    require_softmax_scale,
    require_tensor,
    require_validate_mode,
)
from mla.engine.backend import ops
from mla.engine.backend.checks import check_kv_write
from mla.engine.decision.registry import AnyStrategy
from mla.engine.functional import decode_graphs
from mla.engine.functional import ops as functional_ops
from mla.engine.functional.decode_call import (
    DECODE_CALLS,
    DecodeCall,
    check_decode_call,
    check_scale_value,
    decode_signature,
    new_entry,
    query_start_values,
    require_output,
    run_step,
)
from mla.engine.functional.decode_graphs import GraphReplay, require_graph_replay, tensor_key
from mla.engine.functional.plan_cache import (
    DECODE_PLANS,
    PREFILL_PLANS,
    DecodeEntry,
    available_provider,
    prefill_entry,
)
from mla.prefill.base import PrefillBatch
from mla.providers.base import KernelProvider

__all__ = ["mla_decode", "mla_prefill", "write_kv"]


@overload
def mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    query_start_loc: torch.Tensor | None = ...,
    softmax_scale: float,
    kv_lora_rank: int = ...,
    kv_scale: float | torch.Tensor | None = ...,
    provider: str | KernelProvider = ...,
    strategy: str | AnyStrategy | None = ...,
    platform: Platform | str | None = ...,
    out: torch.Tensor | None = ...,
    lse: torch.Tensor | None = ...,
    return_lse: Literal[True] = ...,
    validate: ValidateMode = ...,
    graph: GraphReplay = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...


@overload
def mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    query_start_loc: torch.Tensor | None = ...,
    softmax_scale: float,
    kv_lora_rank: int = ...,
    kv_scale: float | torch.Tensor | None = ...,
    provider: str | KernelProvider = ...,
    strategy: str | AnyStrategy | None = ...,
    platform: Platform | str | None = ...,
    out: torch.Tensor | None = ...,
    lse: None = ...,
    return_lse: Literal[False],
    validate: ValidateMode = ...,
    graph: GraphReplay = ...,
) -> torch.Tensor: ...


def mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    query_start_loc: torch.Tensor | None = None,
    softmax_scale: float,
    kv_lora_rank: int = 512,
    kv_scale: float | torch.Tensor | None = None,
    provider: str | KernelProvider = "auto",
    strategy: str | AnyStrategy | None = None,
    platform: Platform | str | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    return_lse: bool = True,
    validate: ValidateMode = "fast",
    graph: GraphReplay = "auto",
) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
    """Absorbed MLA decode over a paged latent cache.

    Query row ``i`` of request ``b`` (``q_b`` rows, ``s_b`` keys) attends keys
    ``0 .. s_b - q_b + i`` of its block-table rows; values are the first ``kv_lora_rank``
    lanes of each cache row.

    Args:
        q: ``[T, H, kv_lora_rank + rope]`` bf16/fp16/fp32; ``T`` is the requests' rows
            (``query_start_loc[-1]``, or ``B`` without it): no row without a request.
        kv_cache: ``[num_blocks, block_size, kv_lora_rank + rope]``; bf16/fp16/fp32, or fp8
            with ``kv_scale`` (value = stored * kv_scale).
        block_table: int32/int64 ``[B, max_blocks]``.
        seq_lens: int ``[B]``: KV length of each request including its new tokens (0 marks a
            graph-padding request).
        query_start_loc: int ``[B+1]`` on q's device or on the host; default one token per
            request. A device tensor costs one device-to-host copy (pass the host copy, or
            ``None`` for single-token decode, to avoid it).
        softmax_scale: the model's scale, required: a finite float > 0 (there is no default:
            DeepSeek-V3's YaRN scale differs from ``192**-0.5``; never ``1/sqrt(576)``).
        kv_scale: the fp8 cache's dequant scale: a finite float > 0, or a 0-d/one-element float
            tensor on q's device (read on the device, no host sync); ``None`` for a float cache.
        provider: ``"auto"``, ``"torch"``, ``"triton"``, ``"aiter"`` or a provider object.
        strategy: force a decode strategy (class, ``NAME`` or class name); checked like
            automatic selection.
        platform: a :class:`Platform`, or an arch name such as ``"gfx950"`` to simulate.
        out: optional ``[T, H, kv_lora_rank]`` output in q's dtype (written in place).
        lse: optional ``[T, H]`` float32 LSE output (written in place).
        return_lse: ``False`` returns ``out`` alone and skips computing the LSE (unless ``lse``
            is given).
        validate: ``"fast"`` (default) checks shapes, dtypes and devices and never copies
            ``block_table`` or ``seq_lens`` to the host: lengths past the block table are
            clamped on the device, and block ids outside ``kv_cache`` are masked (their keys
            read nothing and count for nothing; memory-safe, not an error).
            ``"full"`` (debug) copies them and raises on any bad length or block id.
        graph: ``"auto"`` (default) replays repeated calls from a CUDA graph on a CUDA device
            (below); ``"off"`` always runs eagerly (``mla.engine.functional.decode_graphs.GRAPH_REPLAY =
            False`` turns replay off for every call).

    Repeated calls: the plan (strategy and persistent buffers) is cached per shapes, dtypes,
    device, scale, provider, strategy, platform and validate mode, and the argument checks per
    signature, so a repeated call re-checks only values that can change (a float
    ``kv_scale``, the ``query_start_loc`` indptr). On a CUDA device, with ``out`` given (and
    ``lse`` too unless ``return_lse=False``) and ``validate="fast"``, the second call on the
    same tensors (data pointers and strides of q, kv_cache, block_table, seq_lens,
    query_start_loc, out, lse and a ``kv_scale`` tensor; the same ``query_start_loc`` values)
    also captures the step (metadata build and kernels, sized by the block table, never by the
    data) in a :class:`torch.cuda.CUDAGraph` kept with the plan
    (:data:`~mla.engine.functional.decode_graphs.GRAPHS_PER_PLAN` per plan), and later calls replay it:
    one launch, reading the tensors' current values and the current ``kv_scale`` (a float is
    written to a device buffer the graph reads). Calls run eagerly while the current stream is
    capturing (the caller's own graph records them), with ``validate="full"``, without ``out``,
    and when the strategy's build needs host data.

    Returns:
        ``(out [T, H, kv_lora_rank] in q's dtype, lse [T, H] float32 natural log)``, or ``out``
        when ``return_lse=False``.

    Raises:
        InvalidInputError: bad shapes, dtypes, devices (or, with ``validate="full"``, values).
        UnsupportedError: no strategy (or not the forced one) supports the case.

    Under ``torch.compile`` the call is one ``mla::functional_decode`` op (no graph break):
    the outputs are allocated in the compiled code and the op runs this function.
    """
    if torch.compiler.is_compiling():
        return _traced_decode(
            q, kv_cache, block_table, seq_lens, query_start_loc, softmax_scale, kv_lora_rank, kv_scale,
            provider, strategy, platform, out, lse, return_lse, validate, graph,
        )  # fmt: skip
    signature: tuple[object, ...] | None = None
    call = None
    try:
        signature = decode_signature(
            q, kv_cache, block_table, seq_lens, query_start_loc, softmax_scale, kv_lora_rank, kv_scale,
            provider, strategy, platform, out, lse, return_lse, validate, graph,
        )  # fmt: skip
        call = DECODE_CALLS.get(signature)
    except (AttributeError, TypeError):  # not tensors, unhashable options: the checks name them
        signature = None
    if call is None:
        call = check_decode_call(
            q, kv_cache, block_table, seq_lens, query_start_loc, softmax_scale, kv_lora_rank, kv_scale,
            provider, strategy, platform, out, lse, return_lse, validate, graph,
        )  # fmt: skip
        if signature is not None:
            DECODE_CALLS.put(signature, call)
    elif call.scale_on_host:
        assert kv_scale is not None
        check_scale_value(kv_scale, kv_cache.dtype)
    num_tokens, num_requests = call.num_tokens, call.num_requests
    if out is not None or lse is not None:
        inputs = (("q", q), ("kv_cache", kv_cache), ("block_table", block_table), ("seq_lens", seq_lens))
        require_no_overlap("out", out, *inputs, ("query_start_loc", query_start_loc), ("lse", lse))
        require_no_overlap("lse", lse, *inputs, ("query_start_loc", query_start_loc))
    qsl_values: list[int] | None = None
    max_qlen = 1
    if query_start_loc is not None:
        qsl_cpu, qsl_values = query_start_values(call, query_start_loc)
        if num_requests:
            max_qlen = max(1, *map(operator.sub, qsl_values[1:], qsl_values[:-1]))
    if out is None:
        out = torch.empty(num_tokens, call.num_heads, call.kv_lora_rank, dtype=q.dtype, device=q.device)
    if lse is None and return_lse:
        lse = torch.empty(num_tokens, call.num_heads, dtype=torch.float32, device=q.device)
    result = (out, lse) if return_lse and lse is not None else out
    if num_requests == 0 or num_tokens == 0 or call.num_heads == 0:  # nothing to attend
        out.zero_()
        if lse is not None:
            lse.fill_(float("-inf"))
        return result
    key = (call.base_key, max(max_qlen, -(-num_tokens // num_requests)))
    entry = DECODE_PLANS.get(key)
    if entry is None:
        entry = new_entry(call, q, kv_cache, block_table, softmax_scale, key[1], provider, strategy, platform)
        DECODE_PLANS.put(key, entry)
    backend = entry.backend
    # One step at a time per cached plan: threads sharing it take turns (its backend's
    # builds write the buffers its runs read).
    with backend.in_use:
        scale = backend.kv_scale.convert(kv_scale)  # checked with the call's signature and values
        if call.replay and decode_graphs.replay_allowed(q):
            # A host query_start_loc is keyed by its values (the graph reads its own device copy),
            # a device one also by its address (the graph reads it).
            qsl_key = None
            if qsl_values is not None:
                qsl_key = (None if call.host_qsl else tensor_key(query_start_loc), tuple(qsl_values))
            graph_key = (
                call, tensor_key(q), tensor_key(kv_cache), tensor_key(block_table), tensor_key(seq_lens),
                tensor_key(out), tensor_key(lse), None if scale is None else scale.data_ptr(), qsl_key,
            )  # fmt: skip
            state = entry.graphs.get(graph_key)
            if isinstance(state, decode_graphs.CapturedCall):
                state.graph.replay()
                return result
            if state is None:
                entry.graphs.put(graph_key, decode_graphs.SEEN)
            elif state is decode_graphs.SEEN:
                _capture(
                    entry,
                    graph_key,
                    call,
                    q,
                    kv_cache,
                    block_table,
                    seq_lens,
                    query_start_loc,
                    out,
                    lse,
                    scale,
                )
                return result
        if query_start_loc is None:
            qsl_cpu, qsl = entry.unit_qsl_cpu, entry.unit_qsl
        elif query_start_loc.device == q.device:
            qsl = query_start_loc if query_start_loc.dtype == torch.int32 else query_start_loc.to(torch.int32)
        else:
            qsl = qsl_cpu.to(device=q.device, dtype=torch.int32, non_blocking=True)
        run_step(call, backend, q, kv_cache, block_table, seq_lens, qsl_cpu, qsl, out, lse, scale)
        return result


def _capture(
    entry: DecodeEntry,
    graph_key: tuple[object, ...],
    call: DecodeCall,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    scale: torch.Tensor | None,
) -> None:
    """Run the call eagerly (its result; every kernel compiled), then capture the same step
    into a graph for the following calls (or mark it eager when its build needs host data)."""
    backend = entry.backend
    keep: tuple[torch.Tensor, ...] = ()
    if query_start_loc is None:
        qsl_cpu, qsl = entry.unit_qsl_cpu, entry.unit_qsl
    else:
        qsl_cpu = query_start_loc.cpu()
        if query_start_loc.device.type == "cpu":  # the graph reads a device copy it owns
            qsl = qsl_cpu.to(device=q.device, dtype=torch.int32)
            keep = (qsl,)
        else:
            qsl = query_start_loc if query_start_loc.dtype == torch.int32 else query_start_loc.to(torch.int32)

    def step() -> None:
        run_step(call, backend, q, kv_cache, block_table, seq_lens, qsl_cpu, qsl, out, lse, scale)

    step()
    metadata = backend.current_metadata
    plan = None if metadata is None else metadata.decode
    state: decode_graphs.GraphState = decode_graphs.EAGER
    if plan is not None and backend.decode_strategy(plan.strategy).capturable_build(plan):
        state = decode_graphs.capture_or_mark(step, q.device)
        if isinstance(state, decode_graphs.CapturedCall):
            state.keep = keep
    entry.graphs.put(graph_key, state)


@overload
def mla_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    softmax_scale: float,
    causal: bool = ...,
    provider: str | KernelProvider = ...,
    strategy: str | AnyStrategy | None = ...,
    platform: Platform | str | None = ...,
    out: torch.Tensor | None = ...,
    lse: torch.Tensor | None = ...,
    return_lse: Literal[True] = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...


@overload
def mla_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    softmax_scale: float,
    causal: bool = ...,
    provider: str | KernelProvider = ...,
    strategy: str | AnyStrategy | None = ...,
    platform: Platform | str | None = ...,
    out: torch.Tensor | None = ...,
    lse: torch.Tensor | None = ...,
    return_lse: Literal[False],
) -> torch.Tensor: ...


def mla_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    softmax_scale: float,
    causal: bool = True,
    provider: str | KernelProvider = "auto",
    strategy: str | AnyStrategy | None = None,
    platform: Platform | str | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    return_lse: bool = True,
) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
    """Varlen MHA prefill (bottom-right causal), MLA-shaped: q/k ``[T, H, Dqk]``, v ``[Tk, H, Dv]``.

    ``cu_seqlens_q``/``cu_seqlens_k`` are int ``[B+1]`` indptrs ending at ``T`` and ``Tk``
    (every row belongs to a request); ``softmax_scale`` is required (a finite float > 0).
    Returns ``(out [T, H, Dv] in q's dtype, lse [T, H] float32 natural log)``, or ``out`` alone
    with ``return_lse=False``; ``out``/``lse`` may be given to be written in place. The
    ``cu_seqlens`` are copied to the host once per call (checked there and, for the fp8
    prefill, tiled there). Raises :class:`InvalidInputError` for bad input and
    :class:`UnsupportedError` when no strategy (or not the forced one: a class, ``NAME`` or
    class name) fits. Under ``torch.compile`` the call is one ``mla::functional_prefill`` op
    (no graph break): the outputs are allocated in the compiled code and the op runs this
    function.
    """
    if torch.compiler.is_compiling():
        return _traced_prefill(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
            provider, strategy, platform, out, lse, return_lse,
        )  # fmt: skip
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        require_tensor(name, tensor, ndim=3)
        require_float(name, tensor)
    require_index("cu_seqlens_q", cu_seqlens_q, ndim=1)
    require_index("cu_seqlens_k", cu_seqlens_k, ndim=1)
    require_same_device(
        ("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)
    )
    softmax_scale = require_softmax_scale(softmax_scale)
    max_seqlen_q = require_int("max_seqlen_q", max_seqlen_q, minimum=0)
    max_seqlen_k = require_int("max_seqlen_k", max_seqlen_k, minimum=0)
    causal = require_bool("causal", causal)
    require_bool("return_lse", return_lse)
    num_tokens, num_heads, qk_dim = q.shape
    if k.shape[1:] != (num_heads, qk_dim):
        raise InvalidInputError("k", f"expected [Tk, {num_heads}, {qk_dim}] to match q, got {tuple(k.shape)}")
    if v.shape[0] != k.shape[0] or v.shape[1] != num_heads:
        raise InvalidInputError(
            "v", f"expected [{k.shape[0]}, {num_heads}, Dv] to match k, got {tuple(v.shape)}"
        )
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise InvalidInputError("k", f"q, k and v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if out is not None:
        require_output("out", out, (num_tokens, num_heads, v.shape[-1]), q.dtype, q.device)
    if lse is not None:
        require_output("lse", lse, (num_tokens, num_heads), torch.float32, q.device)
    inputs = (("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k))
    require_no_overlap("out", out, *inputs, ("lse", lse))
    require_no_overlap("lse", lse, *inputs)
    cu_q_cpu = cu_seqlens_q.cpu().to(torch.int64)
    cu_k_cpu = cu_seqlens_k.cpu().to(torch.int64)
    require_indptr_of_rows("cu_seqlens_q", cu_q_cpu.tolist(), num_tokens, "q")
    require_indptr_of_rows("cu_seqlens_k", cu_k_cpu.tolist(), k.shape[0], "k")
    if cu_q_cpu.numel() != cu_k_cpu.numel():
        raise InvalidInputError(
            "cu_seqlens_k", f"has {cu_k_cpu.numel()} entries, cu_seqlens_q {cu_q_cpu.numel()}"
        )
    lens_q, lens_k = cu_q_cpu[1:] - cu_q_cpu[:-1], cu_k_cpu[1:] - cu_k_cpu[:-1]
    if lens_q.numel() and int(lens_q.max()) > max_seqlen_q:
        raise InvalidInputError("max_seqlen_q", f"{max_seqlen_q} < longest query {int(lens_q.max())}")
    if lens_k.numel() and int(lens_k.max()) > max_seqlen_k:
        raise InvalidInputError("max_seqlen_k", f"{max_seqlen_k} < longest key range {int(lens_k.max())}")
    key = (
        tuple(q.shape), tuple(k.shape), tuple(v.shape), q.dtype, q.device, lens_q.numel(),
        softmax_scale, provider, strategy, platform,
    )  # fmt: skip
    entry = PREFILL_PLANS.get(key)
    if entry is None:
        entry = prefill_entry(q, v, lens_q.numel(), softmax_scale, provider, strategy, platform)
        PREFILL_PLANS.put(key, entry)
    batch = PrefillBatch(
        context=entry.context,
        cu_seqlens_q_cpu=cu_q_cpu.to(torch.int32),
        cu_seqlens_k_cpu=cu_k_cpu.to(torch.int32),
        cu_seqlens_q=cu_seqlens_q.to(torch.int32),
        cu_seqlens_k=cu_seqlens_k.to(torch.int32),
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        num_tokens=num_tokens,
        num_kv_tokens=k.shape[0],
        causal=causal,
    )
    if out is None:
        out = torch.empty(num_tokens, num_heads, v.shape[-1], dtype=q.dtype, device=q.device)
    if lse is None:
        lse = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=q.device)
    with entry.lock:  # one call at a time
        plan = entry.runner.build_metadata(batch)
        entry.runner.run(plan, q, k, v, out=out, lse=lse)
    return (out, lse) if return_lse else out


def write_kv(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    kv_scale: float | torch.Tensor | None = None,
    provider: str | KernelProvider = "auto",
    platform: Platform | str | None = None,
    validate: ValidateMode = "fast",
) -> None:
    """Write new latent rows into the paged cache, in vLLM's ``concat_and_cache_mla`` order.

    kv_c ``[N, kv_lora_rank]`` and k_pe ``[N, rope]`` (float), kv_cache
    ``[num_blocks, block_size, kv_lora_rank + rope]`` (float, or fp8 with ``kv_scale``: the
    cache stores ``value / kv_scale``), slot_mapping int ``[N]`` flat slots
    ``block * block_size + offset`` (negative: skipped). ``kv_scale`` is a finite float > 0 or
    a 0-d / one-element float tensor on the cache's device, and ``None`` for a float cache.
    Slots outside the cache are skipped by every provider (memory-safe); ``validate="full"``
    reads ``slot_mapping`` on the host and rejects them, and any slot two tokens share. Runs
    ``mla::write_kv`` (under ``torch.compile``: one ``mla::functional_write_kv`` op, whose body
    is this function). Raises :class:`InvalidInputError` naming the bad argument.
    """
    if torch.compiler.is_compiling():
        _traced_write_kv(kv_c, k_pe, kv_cache, slot_mapping, kv_scale, provider, platform, validate)
        return
    mode = require_validate_mode(validate)
    check_kv_write(kv_c, k_pe, kv_cache, slot_mapping, kv_scale, mode)
    prov = available_provider(provider, resolve_platform(platform, kv_cache.device))
    scale: torch.Tensor | None
    if isinstance(kv_scale, torch.Tensor):
        scale = kv_scale.reshape(1).to(torch.float32)
    elif kv_scale is not None:
        scale = torch.full((1,), kv_scale, dtype=torch.float32, device=kv_cache.device)
    else:
        scale = None
    ops.write_kv(kv_c, k_pe, kv_cache, slot_mapping, scale, ops.provider_handle(prov))


# -- under torch.compile: one op per call ------------------------------------------------------
#
# A compiled call allocates the outputs the eager call would (shapes from the inputs' shapes)
# and records one op whose body is the eager call (mla.engine.functional.ops). Arguments of a
# kind the op cannot carry are left to the eager call, which names the bad one (a graph break;
# under fullgraph=True dynamo's error says so).

_UNTRACEABLE = "an argument is not of the kind the op takes; the eager call names it"
_eager_decode = torch.compiler.disable(mla_decode, reason=_UNTRACEABLE)  # type: ignore[no-untyped-call]
_eager_prefill = torch.compiler.disable(mla_prefill, reason=_UNTRACEABLE)  # type: ignore[no-untyped-call]
_eager_write_kv = torch.compiler.disable(write_kv, reason=_UNTRACEABLE)  # type: ignore[no-untyped-call]


def _traced_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor | None,
    softmax_scale: float,
    kv_lora_rank: int,
    kv_scale: float | torch.Tensor | None,
    provider: str | KernelProvider,
    strategy: str | AnyStrategy | None,
    platform: Platform | str | None,
    out: torch.Tensor | None,
    lse: torch.Tensor | None,
    return_lse: bool,
    validate: ValidateMode,
    graph: GraphReplay,
) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
    """What a compiled :func:`mla_decode` records: its outputs and ``mla::functional_decode``."""
    scales = functional_ops.scale_arguments(kv_scale)
    handle = -1
    if (
        scales is not None
        and functional_ops.tensors(q, kv_cache, block_table, seq_lens)
        and functional_ops.optional_tensors(query_start_loc, out, lse)
        and functional_ops.is_number(softmax_scale)
        and functional_ops.is_count(kv_lora_rank)
        and functional_ops.is_flag(return_lse)
        and q.dim() == 3
    ):
        # Eagerly, only a call given its outputs replays a CUDA graph (the op is always given them).
        replayable = out is not None and (lse is not None or not return_lse)
        handle = functional_ops.options_handle(provider, strategy, platform, validate, graph, replayable)
    if scales is None or handle < 0:
        return _eager_decode(  # type: ignore[no-any-return]
            q, kv_cache, block_table, seq_lens, query_start_loc=query_start_loc,
            softmax_scale=softmax_scale, kv_lora_rank=kv_lora_rank, kv_scale=kv_scale,
            provider=provider, strategy=strategy, platform=platform, out=out, lse=lse,
            return_lse=return_lse, validate=validate, graph=graph,
        )  # fmt: skip
    num_tokens, num_heads = q.shape[0], q.shape[1]
    if out is None:
        out = torch.empty(num_tokens, num_heads, kv_lora_rank, dtype=q.dtype, device=q.device)
    if lse is None and return_lse:
        lse = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=q.device)
    functional_ops.decode(
        q, kv_cache, block_table, seq_lens, query_start_loc, float(softmax_scale), kv_lora_rank,
        scales[0], scales[1], out, lse, return_lse, handle,
    )  # fmt: skip
    return (out, lse) if return_lse and lse is not None else out


def _decode_body(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor | None,
    softmax_scale: float,
    kv_lora_rank: int,
    kv_scale: torch.Tensor | None,
    kv_scale_value: float | None,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    return_lse: bool,
    options: int,
) -> None:
    provider, strategy, platform, validate, graph, replayable = functional_ops.options(options)
    if not replayable:  # the caller gave no outputs: eagerly, such a call never replays
        require_graph_replay(graph)
        graph = "off"
    mla_decode(  # type: ignore[call-overload]  # return_lse: a bool, not a Literal
        q, kv_cache, block_table, seq_lens, query_start_loc=query_start_loc, softmax_scale=softmax_scale,
        kv_lora_rank=kv_lora_rank, kv_scale=kv_scale_value if kv_scale is None else kv_scale,
        provider=provider, strategy=strategy, platform=platform, out=out, lse=lse,
        return_lse=return_lse, validate=validate, graph=graph,
    )  # fmt: skip


def _traced_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    provider: str | KernelProvider,
    strategy: str | AnyStrategy | None,
    platform: Platform | str | None,
    out: torch.Tensor | None,
    lse: torch.Tensor | None,
    return_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
    """What a compiled :func:`mla_prefill` records: its outputs and ``mla::functional_prefill``."""
    handle = -1
    if (
        functional_ops.tensors(q, k, v, cu_seqlens_q, cu_seqlens_k)
        and functional_ops.optional_tensors(out, lse)
        and functional_ops.is_count(max_seqlen_q)
        and functional_ops.is_count(max_seqlen_k)
        and functional_ops.is_number(softmax_scale)
        and functional_ops.is_flag(causal)
        and functional_ops.is_flag(return_lse)
        and q.dim() == 3
        and v.dim() == 3
    ):
        handle = functional_ops.options_handle(provider, strategy, platform)
    if handle < 0:
        return _eager_prefill(  # type: ignore[no-any-return]
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            softmax_scale=softmax_scale, causal=causal, provider=provider, strategy=strategy,
            platform=platform, out=out, lse=lse, return_lse=return_lse,
        )  # fmt: skip
    num_tokens, num_heads = q.shape[0], q.shape[1]
    if out is None:
        out = torch.empty(num_tokens, num_heads, v.shape[-1], dtype=q.dtype, device=q.device)
    if lse is None:
        lse = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=q.device)
    functional_ops.prefill(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, float(softmax_scale), causal,
        out, lse, handle,
    )  # fmt: skip
    return (out, lse) if return_lse else out


def _prefill_body(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    out: torch.Tensor,
    lse: torch.Tensor,
    options: int,
) -> None:
    provider, strategy, platform = functional_ops.options(options)
    mla_prefill(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=softmax_scale,
        causal=causal, provider=provider, strategy=strategy, platform=platform, out=out, lse=lse,
    )  # fmt: skip


def _traced_write_kv(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: float | torch.Tensor | None,
    provider: str | KernelProvider,
    platform: Platform | str | None,
    validate: ValidateMode,
) -> None:
    """What a compiled :func:`write_kv` records: ``mla::functional_write_kv``."""
    scales = functional_ops.scale_arguments(kv_scale)
    handle = -1
    if scales is not None and functional_ops.tensors(kv_c, k_pe, kv_cache, slot_mapping):
        handle = functional_ops.options_handle(provider, platform, validate)
    if scales is None or handle < 0:
        _eager_write_kv(
            kv_c, k_pe, kv_cache, slot_mapping, kv_scale=kv_scale, provider=provider, platform=platform,
            validate=validate,
        )  # fmt: skip
        return
    functional_ops.write_kv(kv_c, k_pe, kv_cache, slot_mapping, scales[0], scales[1], handle)


def _write_kv_body(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: torch.Tensor | None,
    kv_scale_value: float | None,
    options: int,
) -> None:
    provider, platform, validate = functional_ops.options(options)
    write_kv(
        kv_c, k_pe, kv_cache, slot_mapping, kv_scale=kv_scale_value if kv_scale is None else kv_scale,
        provider=provider, platform=platform, validate=validate,
    )  # fmt: skip


functional_ops.implement("functional_decode", _decode_body)
functional_ops.implement("functional_prefill", _prefill_body)
functional_ops.implement("functional_write_kv", _write_kv_body)
