"""The functional decode, :func:`mla_decode`: one call, one step through a cached engine pair.

The route of a call: the door (:mod:`~mla.engine.functional.decode_call`: the call's own
arguments checked once per signature, its step by the engine's step checker), the plan cache (a
backend sized for the call's shapes), the builder (``plan``) and the strategy's ``run``; a call
that replays a captured CUDA graph stops after the door, and one that replayed before goes
straight to its graph (:mod:`~mla.engine.functional.replay_memo`). Under
``torch.compile`` the call is one op of :mod:`mla.engine.functional.ops` whose body is the
eager call (no graph break).
"""

from __future__ import annotations

import itertools
from typing import Literal, overload

import torch

from mla.core.platform import Platform
from mla.core.validate import CallValidateMode, require_no_overlap
from mla.engine.backend.step_check import CheckedStep
from mla.engine.decision.registry import AnyStrategy
from mla.engine.functional import decode_graphs, replay_memo
from mla.engine.functional import ops as functional_ops
from mla.engine.functional.args import DecodeArgs
from mla.engine.functional.decode_call import (
    DECODE_CALLS,
    DecodeCall,
    check_counts,
    check_decode_call,
    check_scale_value,
    check_step,
    decode_signature,
    device_step,
    new_entry,
    run_step,
)
from mla.engine.functional.decode_graphs import GraphReplay, require_graph_replay, tensor_key
from mla.engine.functional.plan_cache import DECODE_PLANS, DecodeEntry, checked_signature
from mla.engine.functional.read_back import active
from mla.providers.base import KernelProvider

__all__ = ["mla_decode"]


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
    validate: CallValidateMode = ...,
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
    validate: CallValidateMode = ...,
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
    validate: CallValidateMode = "checked",
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
        validate: ``"checked"`` (default) raises :class:`InvalidInputError` for bad values
            too, found on the device: the page-index fill counts the requests whose ``seq_len``
            is negative, below its query length (but > 0) or past the block table's capacity,
            and the keys in blocks outside ``kv_cache``; the door reads both counts in one small
            device-to-host copy (pinned, started right after the fill) after the launch, and
            when one is not 0 names ``seq_lens`` or ``block_table`` through the ``"full"``
            host rules (the outputs of a call that raised are unspecified). A call recorded
            into the caller's own CUDA graph cannot read back and runs as ``"fast"``.
            ``"fast"`` trusts the values: lengths past the block table are clamped on the
            device, and block ids outside ``kv_cache`` are masked (their keys read nothing and
            count for nothing; memory-safe, not an error). ``"full"`` (debug) copies
            ``block_table`` and ``seq_lens`` to the host and raises before any kernel runs.
        graph: ``"auto"`` (default) replays repeated calls from a CUDA graph on a CUDA device
            (below); ``"off"`` always runs eagerly (``mla.engine.functional.decode_graphs.GRAPH_REPLAY =
            False`` turns replay off for every call).

    Repeated calls: the plan (strategy and persistent buffers) is cached per shapes, dtypes,
    device, scale, provider, strategy, platform and validate mode, and the argument checks per
    signature, so a repeated call re-checks only values that can change (a float
    ``kv_scale``, the ``query_start_loc`` indptr). On a CUDA device (``validate="checked"`` or
    ``"fast"``), the second call on the same tensors (data pointers and strides of q, kv_cache,
    block_table, seq_lens, query_start_loc, out, lse and a ``kv_scale`` tensor; the same
    ``query_start_loc`` values) also captures the step (metadata build and kernels, sized by
    the block table, never by the data) in a :class:`torch.cuda.CUDAGraph` kept with the plan
    (:data:`~mla.engine.functional.decode_graphs.GRAPHS_PER_PLAN` per plan), and later calls
    replay it: one launch, reading the tensors' current values and the current ``kv_scale`` (a
    float is written to a device buffer the graph reads); a call that replayed once is found
    again by one key (:mod:`~mla.engine.functional.replay_memo`). Without ``out=`` (or ``lse=``) the
    graph writes buffers of its own and the call returns fresh copies of them (one device copy
    each; ``out=`` saves it). With ``validate="checked"`` the graph also zeroes the fill's
    counts, copies them to the plan's pinned host buffer and records the plan's event right
    after the fill; the call waits for that event (this call's fill, not its kernels) and reads
    the counts. Calls run eagerly while the current stream is capturing (the caller's own graph
    records them), with ``validate="full"``, and when the strategy's build needs host data.

    Returns:
        ``(out [T, H, kv_lora_rank] in q's dtype, lse [T, H] float32 natural log)``, or ``out``
        when ``return_lse=False``.

    Raises:
        InvalidInputError: bad shapes, dtypes, devices, and (unless ``validate="fast"``) bad
            ``seq_lens``/``block_table`` values, naming the argument and the fix.
        UnsupportedError: no strategy (or not the forced one) supports the case.

    Under ``torch.compile`` the call is one ``mla::functional_decode`` op (no graph break):
    the outputs are allocated in the compiled code and the op runs this function.
    """
    args = DecodeArgs(
        q, kv_cache, block_table, seq_lens, query_start_loc, softmax_scale, kv_lora_rank, kv_scale,
        provider, strategy, platform, out, lse, return_lse, validate, graph,
    )  # fmt: skip
    if torch.compiler.is_compiling():
        return _traced_decode(args)
    return _decode(args)


def _decode(args: DecodeArgs) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
    """The eager call: the door, the plan, the step (or its CUDA-graph replay)."""
    key = allowed = None
    if _may_replay(args):
        allowed = decode_graphs.replay_allowed(args.q)
        if allowed:  # a call replayed before: one key, one lookup (mla.engine.functional.replay_memo)
            key = replay_memo.replay_key(args)
            recalled = None if key is None else replay_memo.recall(key)
            if recalled is not None:
                return _replay_recalled(*recalled, args)
    call, cached = checked_signature(DECODE_CALLS, decode_signature, check_decode_call, args)
    if cached and call.scale_on_host:
        assert args.kv_scale is not None
        check_scale_value(args.kv_scale, args.kv_cache.dtype)
    qsl = args.query_start_loc
    replayable = call.replay and (decode_graphs.replay_allowed(args.q) if allowed is None else allowed)
    if replayable and (qsl is None or call.host_qsl):
        replayed = _replay(call, args, None if qsl is None else tuple(qsl.tolist()), key)
        if replayed is not None:
            return replayed
    step = check_step(call, args)
    q, kv_cache, num_tokens = args.q, args.kv_cache, call.num_tokens
    out, lse = args.out, args.lse
    if out is None:
        out = torch.empty(num_tokens, call.num_heads, call.kv_lora_rank, dtype=q.dtype, device=q.device)
    if lse is None and args.return_lse:
        lse = torch.empty(num_tokens, call.num_heads, dtype=torch.float32, device=q.device)
    result = (out, lse) if args.return_lse and lse is not None else out
    _check_outputs_apart(args)
    if call.num_requests == 0 or num_tokens == 0 or call.num_heads == 0:  # nothing to attend
        out.zero_()
        if lse is not None:
            lse.fill_(float("-inf"))
        return result
    entry = _plan_entry(call, args, max(1, step.lengths.max_query))
    backend = entry.backend
    # One step at a time per cached plan: threads sharing it take turns (its backend's
    # builds write the buffers its runs read).
    with backend.in_use:
        scale = backend.kv_scale.convert(args.kv_scale)  # checked at the door (signature, value)
        if replayable:
            graph_key = _graph_key(call, args, scale, tuple(step.query_start_loc))
            state = entry.graphs.get(graph_key)
            if isinstance(state, decode_graphs.CapturedCall):  # (a device query_start_loc's)
                return _launch(state, entry, call, args, step.inputs.query_start_loc_cpu)
            if state is None:
                entry.graphs.put(graph_key, decode_graphs.SEEN)
            elif state is decode_graphs.SEEN:
                _capture(entry, graph_key, call, args, step, out, lse, scale)
                return result
        if qsl is None:
            qsl_dev = call.unit_qsl
        elif qsl.device == q.device:
            qsl_dev = qsl if qsl.dtype == torch.int32 else qsl.to(torch.int32)
        else:
            host = step.inputs.query_start_loc_cpu
            qsl_dev = host.to(device=q.device, dtype=torch.int32, non_blocking=True)
        counts = active(entry.counts, q.device)
        run_step(backend, device_step(step, qsl_dev), q, kv_cache, out, lse, scale, counts)
        # Read after the launch: the wait does not hold the kernels back.
        if counts is not None and not counts.clean():
            check_counts(counts.read(), call, args, step.inputs.query_start_loc_cpu)
        return result


def _may_replay(args: DecodeArgs) -> bool:
    """The options let the call replay (``graph="auto"``, ``validate`` not ``"full"``) and q is
    a tensor: what the shortcut needs before :func:`~mla.engine.functional.decode_graphs.replay_allowed`
    (arguments of another kind are the door's to name)."""
    graph, validate = args.graph, args.validate
    return (
        isinstance(graph, str)
        and graph == "auto"
        and isinstance(validate, str)
        and validate != "full"
        and isinstance(args.q, torch.Tensor)
    )


def _plan_entry(call: DecodeCall, args: DecodeArgs, max_query: int) -> DecodeEntry:
    """The cached plan for the call's shapes and decode qlen bound (made on first use)."""
    key = (call.base_key, max_query)
    entry = DECODE_PLANS.get(key)
    if entry is None:
        entry = new_entry(call, args, max_query)
        DECODE_PLANS.put(key, entry)
    return entry


def _graph_key(
    call: DecodeCall, args: DecodeArgs, scale: torch.Tensor | None, qsl_values: tuple[int, ...] | None
) -> tuple[object, ...]:
    """What a captured step reads: the call's signature (``call``), every tensor's address and
    strides (the caller's ``out``/``lse``, or ``None`` where the graph writes its own), the
    scale buffer, and the ``query_start_loc`` values (a host one's; a device one is also keyed
    by its address, which the graph reads)."""
    qsl = args.query_start_loc
    qsl_key = None if qsl is None else (None if call.host_qsl else tensor_key(qsl), qsl_values)
    return (
        call, tensor_key(args.q), tensor_key(args.kv_cache), tensor_key(args.block_table),
        tensor_key(args.seq_lens), tensor_key(args.out), tensor_key(args.lse),
        None if scale is None else scale.data_ptr(), qsl_key,
    )  # fmt: skip


def _replay(
    call: DecodeCall, args: DecodeArgs, qsl_values: tuple[int, ...] | None, key: tuple[object, ...] | None
) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor | None:
    """A repeated call's graph replay, before any step check: a captured graph's key holds the
    signature, every tensor's address and strides and the host ``query_start_loc`` values, so
    the call it was captured from passed the same checks (outputs apart from the inputs
    included). ``None``: nothing captured for this call yet. A replayed call is recorded under
    its flat ``key`` (:mod:`~mla.engine.functional.replay_memo`), where the next one finds it."""
    max_query = 1
    if qsl_values is not None:  # unchecked here: only a lookup (a miss runs the checks)
        max_query = max((b - a for a, b in itertools.pairwise(qsl_values)), default=1)
    plan_key = (call.base_key, max(1, max_query))
    entry = DECODE_PLANS.get(plan_key)
    if entry is None:
        return None
    with entry.backend.in_use:
        scale = entry.backend.kv_scale.convert(args.kv_scale)
        graph_key = _graph_key(call, args, scale, qsl_values)
        state = entry.graphs.get(graph_key)
        if not isinstance(state, decode_graphs.CapturedCall):
            return None
        if key is not None:
            record = replay_memo.ReplayRecord(call, entry, state, decode_signature(args), plan_key, graph_key)
            replay_memo.remember(key, record)
        qsl = args.query_start_loc
        return _launch(state, entry, call, args, call.unit_qsl_cpu if qsl is None else qsl)


def _replay_recalled(
    call: DecodeCall, entry: DecodeEntry, state: decode_graphs.CapturedCall, args: DecodeArgs
) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
    """A recorded call's replay (:func:`~mla.engine.functional.replay_memo.recall`): what
    :func:`_replay` does once it has found the graph."""
    if call.scale_on_host:
        assert args.kv_scale is not None
        check_scale_value(args.kv_scale, args.kv_cache.dtype)
    with entry.backend.in_use:
        entry.backend.kv_scale.convert(args.kv_scale)
        qsl = args.query_start_loc
        return _launch(state, entry, call, args, call.unit_qsl_cpu if qsl is None else qsl)


def _launch(
    state: decode_graphs.CapturedCall,
    entry: DecodeEntry,
    call: DecodeCall,
    args: DecodeArgs,
    query_start_loc_cpu: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
    """Replay ``state`` and return the call's results; with ``validate="checked"``, raise for
    this call's counts. The copies of the graph's own outputs (a call without ``out=``/``lse=``)
    are queued before the host waits for the counts, so their host work overlaps the fill."""
    state.graph.replay()
    result = state.results(args.out, args.lse, args.return_lse)
    counts = entry.counts
    if counts is not None and not counts.clean():
        check_counts(counts.read(), call, args, query_start_loc_cpu)
    return result


def _check_outputs_apart(args: DecodeArgs) -> None:
    """The caller's ``out``/``lse`` share no memory with the inputs (or each other)."""
    out, lse = args.out, args.lse
    if out is None and lse is None:
        return
    qsl = ("query_start_loc", args.query_start_loc)
    inputs = (
        ("q", args.q),
        ("kv_cache", args.kv_cache),
        ("block_table", args.block_table),
        ("seq_lens", args.seq_lens),
    )
    require_no_overlap("out", out, *inputs, qsl, ("lse", lse))
    require_no_overlap("lse", lse, *inputs, qsl)


def _capture(
    entry: DecodeEntry,
    graph_key: tuple[object, ...],
    call: DecodeCall,
    args: DecodeArgs,
    step: CheckedStep,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    scale: torch.Tensor | None,
) -> None:
    """Run the call eagerly into ``out``/``lse`` (its result; every kernel compiled), then
    capture the same step into a graph for the following calls (or mark it eager when its
    build needs host data). Outputs the caller did not pass are the graph's own buffers, which
    each replay's call returns copies of."""
    backend, q, kv_cache, qsl = entry.backend, args.q, args.kv_cache, args.query_start_loc
    keep: tuple[torch.Tensor, ...] = ()
    if qsl is None:
        qsl_dev = call.unit_qsl
    elif qsl.device.type == "cpu":  # the graph reads a device copy it owns
        qsl_dev = step.inputs.query_start_loc_cpu.to(device=q.device, dtype=torch.int32)
        keep = (qsl_dev,)
    else:
        qsl_dev = qsl if qsl.dtype == torch.int32 else qsl.to(torch.int32)

    def graph_step(into: torch.Tensor, into_lse: torch.Tensor | None) -> None:
        # The int32 views of seq_lens and block_table are made inside: a replay converts the
        # caller's current values. With entry.counts the graph zeroes the fill's counts, copies
        # them to the host and records the plan's event right after the fill (read per replay).
        run_step(backend, device_step(step, qsl_dev), q, kv_cache, into, into_lse, scale, entry.counts)

    graph_step(out, lse)
    if entry.counts is not None:  # a call with bad values raises here, before any capture
        check_counts(entry.counts.read(), call, args, step.inputs.query_start_loc_cpu)
    metadata = backend.current_metadata
    plan = None if metadata is None else metadata.decode
    state: decode_graphs.GraphState = decode_graphs.EAGER
    counts_replay = entry.counts is None or entry.counts.replayable
    if plan is not None and counts_replay and backend.decode_strategy(plan.strategy).capturable_build(plan):
        own_out = torch.empty_like(out) if args.out is None else None
        own_lse = torch.empty_like(lse) if lse is not None and args.lse is None else None
        graph_out = out if own_out is None else own_out
        graph_lse = lse if own_lse is None else own_lse
        state = decode_graphs.capture_or_mark(lambda: graph_step(graph_out, graph_lse), q.device)
        if isinstance(state, decode_graphs.CapturedCall):
            state.keep = keep
            state.own_out, state.own_lse = own_out, own_lse
    entry.graphs.put(graph_key, state)


# -- under torch.compile: one op per call ------------------------------------------------------
#
# A compiled call allocates the outputs the eager call would (shapes from the inputs' shapes)
# and records one op whose body is the eager call (mla.engine.functional.ops). Arguments of a
# kind the op cannot carry are left to the eager call, which names the bad one (a graph break;
# under fullgraph=True dynamo's error says so).

_eager_decode = torch.compiler.disable(_decode, reason=functional_ops.UNTRACEABLE)  # type: ignore[no-untyped-call]


def _traced_decode(args: DecodeArgs) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
    """What a compiled :func:`mla_decode` records: its outputs and ``mla::functional_decode``."""
    q, out, lse, return_lse = args.q, args.out, args.lse, args.return_lse
    scales = functional_ops.scale_arguments(args.kv_scale)
    handle = -1
    if (
        scales is not None
        and functional_ops.tensors(q, args.kv_cache, args.block_table, args.seq_lens)
        and functional_ops.optional_tensors(args.query_start_loc, out, lse)
        and functional_ops.is_number(args.softmax_scale)
        and functional_ops.is_count(args.kv_lora_rank)
        and functional_ops.is_flag(return_lse)
        and q.dim() == 3
    ):
        # Eagerly, only a call given its outputs replays a CUDA graph (the op is always given them).
        replayable = out is not None and (lse is not None or not return_lse)
        handle = functional_ops.options_handle(
            args.provider, args.strategy, args.platform, args.validate, args.graph, replayable
        )
    if scales is None or handle < 0:
        return _eager_decode(args)  # type: ignore[no-any-return]
    num_tokens, num_heads = q.shape[0], q.shape[1]
    if out is None:
        out = torch.empty(num_tokens, num_heads, args.kv_lora_rank, dtype=q.dtype, device=q.device)
    if lse is None and return_lse:
        lse = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=q.device)
    functional_ops.decode(
        q, args.kv_cache, args.block_table, args.seq_lens, args.query_start_loc, float(args.softmax_scale),
        args.kv_lora_rank, scales[0], scales[1], out, lse, return_lse, handle,
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
    """The body of ``mla::functional_decode`` (its schema's arguments): the eager call."""
    provider, strategy, platform, validate, graph, replayable = functional_ops.options(options)
    if not replayable:  # the caller gave no outputs: eagerly, such a call never replays
        require_graph_replay(graph)
        graph = "off"
    _decode(
        DecodeArgs(
            q, kv_cache, block_table, seq_lens, query_start_loc, softmax_scale, kv_lora_rank,
            kv_scale_value if kv_scale is None else kv_scale, provider, strategy, platform, out, lse,
            return_lse, validate, graph,
        )
    )  # fmt: skip


functional_ops.implement("functional_decode", _decode_body)
