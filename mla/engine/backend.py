"""The engine-facing backend: a metadata builder and an attention impl over one resolver.

Shaped like vLLM's builder/impl pair. The builder turns a step's inputs into
:class:`MLAMetadata`, resolving each phase exactly once; the impl runs the strategy recorded in
the metadata and never decides anything itself.

Usage::

    backend = MLABackend(dims, cache, limits, model_dtype=torch.bfloat16)
    meta = backend.builder.build(StepInputs(...))
    backend.impl.forward_decode(meta, q_decode, kv_cache, out=out_decode)
    backend.impl.forward_prefill(meta, q, k, v, out=out_prefill, kv_cache=kv_cache,
                                 expand_context=up_project)
"""

from __future__ import annotations

import itertools

import attrs
import torch

from mla.core.capabilities import ProviderCapabilities
from mla.core.config import FLOAT_DTYPES, EngineLimits, KVCacheSpec, MLADims, dtype_name, normalize_dtype
from mla.core.context import DecodeContext, PrefillContext, decode_context, prefill_context
from mla.core.errors import InvalidInputError, PlanMismatchError, ProviderUnavailableError, UnsupportedError
from mla.core.platform import Platform, resolve_platform
from mla.core.validate import (
    ValidateMode,
    check_block_ids,
    check_cache_scale,
    check_indptr,
    check_kv_scale,
    check_paged_requests,
    check_slots,
    check_write_kv,
    require_index,
    require_int,
    require_same_device,
    require_tensor,
    require_validate_mode,
    used_cache_blocks,
)
from mla.decode.base import DecodeBatch, DecodeIndexBuffers, DecodePlan, DecodeStrategy
from mla.engine import ops
from mla.engine.registry import AnyStrategy
from mla.engine.resolver import Decision, Resolver
from mla.prefill.base import ContextChunk, ContextExpander, PrefillBatch, PrefillPlan, PrefillStrategy
from mla.providers import resolve_provider
from mla.providers.base import KernelProvider
from mla.providers.quant import ScaleBuffer
from mla.strategy import Phase, StrategySetup


@attrs.frozen(eq=False)
class StepInputs:
    """One engine step, decode requests first (vLLM's reordered batch).

    ``num_decode_tokens`` may exceed ``query_start_loc[num_decodes]`` in a decode-only step: the
    extra rows are CUDA-graph padding. Requests with ``seq_len == 0`` are graph-padding requests.
    """

    query_start_loc_cpu: torch.Tensor
    """int ``[B+1]`` on the host."""
    query_start_loc: torch.Tensor
    """int32 ``[B+1]`` on the device."""
    seq_lens: torch.Tensor
    """int32 ``[B]`` on the device (KV length including the new tokens)."""
    block_table: torch.Tensor
    """int32 ``[B, max_blocks]`` on the device."""
    num_decodes: int
    num_decode_tokens: int
    seq_lens_cpu: torch.Tensor | None = None
    """Host copy of ``seq_lens``. When omitted, a decode-only step plans its page indices on the
    device (no copy, work sized by the block table); a step with prefills (or
    ``validate="full"``) copies ``seq_lens`` from the device."""


@attrs.frozen(eq=False)
class MLAMetadata:
    """Everything the impl needs for one step: each phase's decision and plan."""

    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    num_prefill_tokens: int
    decode: DecodePlan | None
    prefill: PrefillPlan | None
    decode_decision: Decision | None
    prefill_decision: Decision | None


def default_context_chunk_tokens(limits: EngineLimits, block_size: int) -> int:
    """vLLM's chunked-context workspace: ``min(max(8*max_model_len, 4*max_num_seqs*block), 64K)``
    tokens, at least ``max_num_seqs * block_size``."""
    size = min(max(8 * limits.max_model_len, 4 * limits.max_num_seqs * block_size), 64 * 1024)
    return max(size, limits.max_num_seqs * block_size)


def _require_instance(argument: str, value: object, cls: type) -> None:
    if not isinstance(value, cls):
        raise InvalidInputError(argument, f"expected an mla.{cls.__name__}, got {type(value).__name__}")


class MLABackend:
    """Owns the provider, the resolver, the strategies and their persistent buffers.

    Decode strategies for every step the limits allow are resolved and allocated at init (an
    unsupported qlen within the limits raises :class:`UnsupportedError` here, not mid-run).
    ``decode_strategy``/``prefill_strategy`` force a strategy (``NAME``, class name or class)
    through the same checks. A provider that cannot run here raises
    :class:`ProviderUnavailableError` (an :class:`UnsupportedError`) with its reasons.

    ``validate`` (see :data:`mla.core.validate.ValidateMode`): ``"fast"`` never copies device data to
    the host in ``builder.build``; ``"full"`` adds the host checks of every block id and checks
    that the device ``query_start_loc``/``seq_lens`` equal their host copies.

    The backend registers itself with the custom ops (:mod:`mla.engine.ops`) under ``op_id``;
    ``builder.build`` makes the step's metadata the backend's ``current_metadata``, which the
    ops run.
    """

    def __init__(
        self,
        dims: MLADims,
        cache: KVCacheSpec,
        limits: EngineLimits,
        *,
        model_dtype: torch.dtype = torch.bfloat16,
        provider: str | KernelProvider = "auto",
        platform: Platform | str | None = None,
        device: torch.device | str | None = None,
        resolver: Resolver | None = None,
        decode_strategy: str | AnyStrategy | None = None,
        prefill_strategy: str | AnyStrategy | None = None,
        preallocate: bool = True,
        context_chunk_tokens: int | None = None,
        validate: ValidateMode = "fast",
    ) -> None:
        _require_instance("dims", dims, MLADims)
        _require_instance("cache", cache, KVCacheSpec)
        _require_instance("limits", limits, EngineLimits)
        model_dtype = normalize_dtype(model_dtype, argument="model_dtype")
        if model_dtype not in FLOAT_DTYPES:
            raise InvalidInputError(
                "model_dtype", f"{dtype_name(model_dtype)} is not a model dtype; use bf16, fp16 or fp32"
            )
        if device is not None and not isinstance(device, torch.device | str):
            raise InvalidInputError("device", f"expected a torch.device or str, got {type(device).__name__}")
        try:
            torch_device = torch.device(device) if device is not None else None
        except (RuntimeError, TypeError) as exc:
            raise InvalidInputError("device", f"{device!r} is not a torch device: {exc}") from None
        self.platform = resolve_platform(platform, torch_device)
        self.device = torch_device or torch.device("cuda" if self.platform.is_gpu else "cpu")
        self.dims, self.cache, self.limits, self.model_dtype = dims, cache, limits, model_dtype
        self.validate: ValidateMode = require_validate_mode(validate)
        self.provider = resolve_provider(provider, self.platform)
        self.capabilities: ProviderCapabilities = self.provider.capabilities(self.platform)
        if resolver is not None and not isinstance(resolver, Resolver):
            raise InvalidInputError("resolver", f"expected an mla.Resolver, got {type(resolver).__name__}")
        self.resolver = resolver or Resolver()
        self.force_decode: AnyStrategy | None = (
            None
            if decode_strategy is None
            else self.resolver.forced_strategy(decode_strategy, Phase.DECODE, argument="decode_strategy")
        )
        self.force_prefill: AnyStrategy | None = (
            None
            if prefill_strategy is None
            else self.resolver.forced_strategy(prefill_strategy, Phase.PREFILL, argument="prefill_strategy")
        )
        if context_chunk_tokens is not None:
            require_int("context_chunk_tokens", context_chunk_tokens, minimum=1)
        self.context_chunk_tokens = context_chunk_tokens or default_context_chunk_tokens(
            limits, cache.block_size
        )
        if self.context_chunk_tokens < limits.max_num_seqs * cache.block_size:
            # Each request's chunk is at least one block, so a smaller workspace overflows.
            raise InvalidInputError(
                "context_chunk_tokens",
                f"{self.context_chunk_tokens} < max_num_seqs * block_size = "
                f"{limits.max_num_seqs * cache.block_size}; every request needs one block per chunk",
            )
        self.setup = StrategySetup(
            dims=dims,
            cache=cache,
            limits=limits,
            q_dtype=model_dtype,
            platform=self.platform,
            provider=self.provider,
            capabilities=self.capabilities,
            device=self.device,
        )
        self.index_buffers = DecodeIndexBuffers.allocate(self.setup)
        self.decode_strategies: dict[str, DecodeStrategy] = {}
        self.prefill_strategies: dict[str, PrefillStrategy] = {}
        self.late_allocations: list[str] = []
        """Strategies first allocated after init (a step the init-time enumeration missed)."""
        if preallocate:
            self._preallocate()
        self.current_metadata: MLAMetadata | None = None
        """The metadata of the step being run (set by ``builder.build``)."""
        self.kv_scale_buffer = ScaleBuffer.allocate(self.device)
        self.op_id = ops.register_runner(self)
        self.provider_id = ops.provider_handle(self.provider)
        self.builder = MetadataBuilder(self)
        self.impl = AttentionImpl(self)

    def __repr__(self) -> str:
        return (
            f"MLABackend(provider={self.provider.name!r}, arch={self.platform.arch!r}, "
            f"heads={self.dims.num_heads}, decode={sorted(self.decode_strategies)}, "
            f"prefill={sorted(self.prefill_strategies)})"
        )

    # -- contexts and decisions --------------------------------------------------------------

    def decode_context(self, *, max_qlen: int, uniform_qlen: bool) -> DecodeContext:
        return decode_context(
            dims=self.dims,
            cache=self.cache,
            q_dtype=self.model_dtype,
            platform=self.platform,
            capabilities=self.capabilities,
            availability=self.provider.availability(),
            limits=self.limits,
            max_qlen=max_qlen,
            uniform_qlen=uniform_qlen,
        )

    def prefill_context(self, *, has_chunked_context: bool) -> PrefillContext:
        return prefill_context(
            dims=self.dims,
            cache=self.cache,
            q_dtype=self.model_dtype,
            platform=self.platform,
            capabilities=self.capabilities,
            availability=self.provider.availability(),
            has_chunked_context=has_chunked_context,
        )

    def _preallocate(self) -> None:
        """Resolve every decode shape the limits allow and the prefill cases; allocate."""
        for qlen, uniform in itertools.product(range(1, self.limits.max_decode_qlen + 1), (True, False)):
            ctx = self.decode_context(max_qlen=qlen, uniform_qlen=uniform)
            try:
                decision = self.resolver.resolve(ctx, force=self.force_decode)
            except UnsupportedError as exc:
                raise self._unsupported(exc, "decode", qlen) from exc
            self.decode_strategy(decision)
        for chunked in (False, True):
            try:
                decision = self.resolver.resolve(
                    self.prefill_context(has_chunked_context=chunked), force=self.force_prefill
                )
            except UnsupportedError as exc:
                raise self._unsupported(exc, "prefill", 0) from exc
            self.prefill_strategy(decision)

    def _unsupported(self, exc: UnsupportedError, phase: str, qlen: int) -> UnsupportedError:
        """The error of a failed init-time resolution, leading with its real cause."""
        availability = self.provider.availability()
        if not availability:
            return ProviderUnavailableError(
                f"provider: {self.provider.name!r} cannot run here: {availability}; pass "
                "provider='auto' (the best provider that runs here) or another provider",
                exc.explanation,
            )
        forced = self.force_decode if phase == "decode" else self.force_prefill
        what = (
            f"forced {phase} strategy {forced.NAME!r} does not support"
            if forced is not None
            else f"no {phase} strategy supports"
        )
        where = f"{self.capabilities.provider!r} ({self.platform.arch})"
        if qlen > 1:
            return UnsupportedError(
                f"the engine limits allow decode qlen {qlen} (max_decode_qlen "
                f"{self.limits.max_decode_qlen}), which {what} on {where}; lower the speculative "
                f"token count (max_decode_qlen <= {qlen - 1}) or pick another provider",
                exc.explanation,
            )
        return UnsupportedError(
            f"{'the ' if forced is not None else ''}{what} this model on provider {where}: "
            f"{self.dims.num_heads} heads, {dtype_name(self.model_dtype)} queries, "
            f"{dtype_name(self.cache.dtype)} KV cache; see every candidate's reasons below",
            exc.explanation,
        )

    def decode_strategy(self, decision: Decision | str) -> DecodeStrategy:
        """The backend's instance of a decode strategy (allocated on first use)."""
        name = decision if isinstance(decision, str) else decision.name
        if name not in self.decode_strategies:
            cls = decision.strategy if isinstance(decision, Decision) else self.resolver.registry.get(name)
            assert issubclass(cls, DecodeStrategy)
            if self.builder_ready:
                self.late_allocations.append(name)
            self.decode_strategies[name] = cls(self.setup, self.index_buffers)
        return self.decode_strategies[name]

    def prefill_strategy(self, decision: Decision | str) -> PrefillStrategy:
        name = decision if isinstance(decision, str) else decision.name
        if name not in self.prefill_strategies:
            cls = decision.strategy if isinstance(decision, Decision) else self.resolver.registry.get(name)
            assert issubclass(cls, PrefillStrategy)
            if self.builder_ready:
                self.late_allocations.append(name)
            self.prefill_strategies[name] = cls(self.setup)
        return self.prefill_strategies[name]

    @property
    def builder_ready(self) -> bool:
        return hasattr(self, "builder")

    # -- what the custom ops run -------------------------------------------------------------

    def run_decode(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor | None,
        kv_scale: torch.Tensor | None,
    ) -> None:
        """Run the current step's decode plan (the body of ``mla::decode``)."""
        plan = self._current("decode").decode
        assert plan is not None
        strategy = self.decode_strategy(plan.strategy)
        strategy.run(plan, q, kv_cache, kv_scale=kv_scale, out=out, lse=lse)

    def run_prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        kv_cache: torch.Tensor | None,
        kv_scale: torch.Tensor | None,
        expand_context: ContextExpander | None,
    ) -> None:
        """Run the current step's prefill plan (the body of ``mla::prefill``)."""
        plan = self._current("prefill").prefill
        assert plan is not None
        strategy = self.prefill_strategy(plan.strategy)
        strategy.run(
            plan,
            q,
            k,
            v,
            out=out,
            lse=lse,
            kv_cache=kv_cache,
            kv_scale=kv_scale,
            expand_context=expand_context,
        )

    def _current(self, phase: str) -> MLAMetadata:
        metadata = self.current_metadata
        if metadata is None:
            raise InvalidInputError("metadata", "no step was built yet: call builder.build(step) first")
        if getattr(metadata, phase) is None:
            raise InvalidInputError("metadata", f"this step has no {phase} requests")
        return metadata

    def check_current(self, metadata: MLAMetadata, phase: str) -> None:
        """Eager calls: ``metadata`` must be the current step's (the ops run the current plan)."""
        if metadata is not self.current_metadata:
            raise PlanMismatchError(
                "metadata is not this backend's current metadata: builder.build was called for "
                "another step since (the ops run the most recently built plan); run each step's "
                "layers before building the next step"
            )
        self._current(phase)

    def kv_scale_tensor(self, kv_scale: float | torch.Tensor | None) -> torch.Tensor | None:
        """``kv_scale`` as the float32 ``[1]`` device tensor the ops take (``None`` stays).

        A tensor (0-d or one element, float, on the backend's device) is used as is (converted
        to float32 when needed), so a captured graph reads its current value; a float is written
        into the backend's :class:`~mla.providers.quant.ScaleBuffer`.
        """
        if isinstance(kv_scale, torch.Tensor):
            check_kv_scale(kv_scale, self.device)
        return self.kv_scale_buffer.tensor(kv_scale)


class MetadataBuilder:
    """Turns step inputs into metadata; the only place a step's strategies are decided.

    With the host copies the engine already has (``query_start_loc_cpu``, ``seq_lens_cpu``) a
    build copies nothing from the device (``validate="fast"``): the rules needing host data run
    on those copies, block ids are checked only under ``validate="full"``, which also checks
    that the device ``query_start_loc``/``seq_lens`` hold what their host copies say.

    Every step is checked against the engine limits the backend was sized for (requests,
    decode qlen, decode rows, tokens, model length) on the host copies, so a step beyond them
    raises :class:`InvalidInputError` here instead of running outside the buffers allocated at
    init: a step within them never allocates a strategy late.
    """

    def __init__(self, backend: MLABackend) -> None:
        self.backend = backend

    def build(self, step: StepInputs) -> MLAMetadata:
        """Plan one step and make it the backend's current metadata (also returned)."""
        be = self.backend
        full = be.validate == "full"
        _require_instance("step", step, StepInputs)
        qsl_cpu = require_index("query_start_loc_cpu", step.query_start_loc_cpu, ndim=1).cpu().to(torch.int64)
        device_inputs = (
            ("query_start_loc", require_index("query_start_loc", step.query_start_loc, ndim=1)),
            ("seq_lens", require_index("seq_lens", step.seq_lens, ndim=1)),
            ("block_table", require_index("block_table", step.block_table, ndim=2)),
        )
        for name, tensor in device_inputs:
            if tensor.device.type != be.device.type:
                raise InvalidInputError(
                    name, f"is on {tensor.device} but the backend runs on {be.device}; move it there"
                )
        seq_lens, block_table = step.seq_lens, step.block_table
        num_decodes = require_int("num_decodes", step.num_decodes, minimum=0)
        num_decode_tokens = require_int("num_decode_tokens", step.num_decode_tokens, minimum=0)
        num_requests = qsl_cpu.numel() - 1
        check_indptr("query_start_loc", qsl_cpu)
        if step.query_start_loc.numel() != qsl_cpu.numel():
            raise InvalidInputError(
                "query_start_loc",
                f"has {step.query_start_loc.numel()} entries but query_start_loc_cpu has "
                f"{qsl_cpu.numel()}; pass the same indptr on the device and on the host",
            )
        if num_decodes > num_requests:
            raise InvalidInputError("num_decodes", f"must be in [0, {num_requests}], got {num_decodes}")
        if num_requests > be.limits.max_num_seqs:
            raise InvalidInputError(
                "query_start_loc",
                f"{num_requests} requests exceed max_num_seqs {be.limits.max_num_seqs}; split the "
                "step or build the backend with a larger EngineLimits.max_num_seqs",
            )
        if seq_lens.numel() != num_requests:
            raise InvalidInputError(
                "seq_lens",
                f"has {seq_lens.numel()} entries but query_start_loc describes {num_requests} requests",
            )
        if block_table.shape[0] < num_requests:
            raise InvalidInputError(
                "block_table", f"has {block_table.shape[0]} rows for {num_requests} requests"
            )
        num_prefills = num_requests - num_decodes
        seq_cpu = step.seq_lens_cpu
        if seq_cpu is not None:
            seq_cpu = require_index("seq_lens_cpu", seq_cpu, ndim=1).to(torch.int64)
        if full:
            self._cross_check(step, qsl_cpu, seq_cpu)
        if seq_cpu is None and (full or num_prefills):
            seq_cpu = seq_lens.cpu().to(torch.int64)
        table_cpu: torch.Tensor | None = None
        if seq_cpu is not None:
            check_paged_requests(
                query_start_loc_cpu=qsl_cpu,
                seq_lens_cpu=seq_cpu,
                block_table_shape=tuple(block_table.shape),
                block_size=be.cache.block_size,
                max_model_len=be.limits.max_model_len,
            )
            if full:
                table_cpu = block_table.cpu()
                check_block_ids(
                    seq_lens_cpu=seq_cpu,
                    block_table_cpu=table_cpu,
                    block_size=be.cache.block_size,
                    num_blocks=be.cache.num_blocks or (1 << 62),
                )
        self._check_limits(qsl_cpu, num_decodes)
        owned_decode_tokens = int(qsl_cpu[num_decodes])
        if num_decode_tokens < owned_decode_tokens or (
            num_prefills and num_decode_tokens != owned_decode_tokens
        ):
            raise InvalidInputError(
                "num_decode_tokens",
                f"got {num_decode_tokens}; the decode requests own {owned_decode_tokens} "
                "tokens (extra graph-padding rows are allowed only in decode-only steps)",
            )
        if num_decode_tokens > be.limits.max_decode_tokens:
            raise InvalidInputError(
                "num_decode_tokens",
                f"{num_decode_tokens} exceeds max_num_seqs * max_decode_qlen = {be.limits.max_decode_tokens}",
            )
        decode_plan = prefill_plan = None
        decode_decision = prefill_decision = None
        if num_decodes:
            decode_decision, decode_plan = self._build_decode(
                step, qsl_cpu, seq_cpu, table_cpu, num_decodes, num_decode_tokens
            )
        if num_prefills:
            assert seq_cpu is not None
            prefill_decision, prefill_plan = self._build_prefill(
                step, qsl_cpu, seq_cpu, table_cpu, num_decodes
            )
        metadata = MLAMetadata(
            num_decodes=num_decodes,
            num_decode_tokens=num_decode_tokens,
            num_prefills=num_prefills,
            num_prefill_tokens=int(qsl_cpu[-1]) - owned_decode_tokens,
            decode=decode_plan,
            prefill=prefill_plan,
            decode_decision=decode_decision,
            prefill_decision=prefill_decision,
        )
        be.current_metadata = metadata
        return metadata

    def _check_limits(self, qsl_cpu: torch.Tensor, num_decodes: int) -> None:
        """The step's decode qlens and token count are within the limits the backend was sized
        (and its strategies allocated) for (host rules on ``query_start_loc_cpu``)."""
        limits = self.backend.limits
        qlens = qsl_cpu[1:] - qsl_cpu[:-1]
        decode_qlens = qlens[:num_decodes]
        if decode_qlens.numel() and int(decode_qlens.max()) > limits.max_decode_qlen:
            b = int(torch.argmax(decode_qlens))
            raise InvalidInputError(
                "query_start_loc",
                f"decode request {b} has {int(decode_qlens[b])} query tokens > max_decode_qlen "
                f"{limits.max_decode_qlen}. Decode requests (qlen <= max_decode_qlen: one token, or "
                "a speculative verify) come first in the batch and num_decodes counts them; a "
                "prefill placed before the decodes, a num_decodes that is too large, or more "
                "speculative tokens than EngineLimits.max_decode_qlen allows look like this",
            )
        total = int(qsl_cpu[-1])
        if total > limits.max_num_batched_tokens:
            raise InvalidInputError(
                "query_start_loc",
                f"the step has {total} query tokens > max_num_batched_tokens "
                f"{limits.max_num_batched_tokens}; split the step or raise the limit",
            )

    def _cross_check(self, step: StepInputs, qsl_cpu: torch.Tensor, seq_cpu: torch.Tensor | None) -> None:
        """``validate="full"``: the device tensors hold what their host copies say (one
        device-to-host copy each)."""
        device_qsl = step.query_start_loc.cpu().to(torch.int64)
        if not torch.equal(device_qsl, qsl_cpu):
            raise InvalidInputError(
                "query_start_loc",
                f"the device copy {device_qsl.tolist()} differs from query_start_loc_cpu "
                f"{qsl_cpu.tolist()}; pass the same indptr on both sides",
            )
        if seq_cpu is not None:
            device_lens = step.seq_lens.cpu().to(torch.int64)
            if not torch.equal(device_lens, seq_cpu):
                raise InvalidInputError(
                    "seq_lens",
                    f"the device copy {device_lens.tolist()} differs from seq_lens_cpu "
                    f"{seq_cpu.tolist()}; pass the same lengths on both sides",
                )

    def _build_decode(
        self,
        step: StepInputs,
        qsl_cpu: torch.Tensor,
        seq_cpu: torch.Tensor | None,
        table_cpu: torch.Tensor | None,
        nd: int,
        num_tokens: int,
    ) -> tuple[Decision, DecodePlan]:
        be = self.backend
        qsl = qsl_cpu[: nd + 1]
        qlens = qsl[1:] - qsl[:-1]
        max_qlen = max(1, int(qlens.max()))
        lens = None if seq_cpu is None else seq_cpu[:nd]
        if bool((qlens == max_qlen).all()):
            uniform = True
        elif lens is None:
            # Without host lengths the graph-padding requests cannot be told apart.
            uniform = False
        else:
            real = lens > 0
            padded_qlens = qlens[~real]
            uniform = bool((qlens[real] == max_qlen).all()) and bool(
                ((padded_qlens == 0) | (padded_qlens == max_qlen)).all()
            )
        ctx = be.decode_context(max_qlen=max_qlen, uniform_qlen=uniform)
        decision = be.resolver.resolve(ctx, force=be.force_decode)
        strategy = be.decode_strategy(decision)
        batch = DecodeBatch(
            context=ctx,
            query_start_loc_cpu=qsl,
            seq_lens_cpu=lens,
            query_start_loc=step.query_start_loc[: nd + 1],
            seq_lens=step.seq_lens[:nd],
            block_table=step.block_table[:nd],
            num_tokens=num_tokens,
            cache_blocks=(
                0
                if table_cpu is None or lens is None
                else used_cache_blocks(table_cpu[:nd], lens, be.cache.block_size)
            ),
        )
        return decision, strategy.build_metadata(batch)

    def _build_prefill(
        self,
        step: StepInputs,
        qsl_cpu: torch.Tensor,
        seq_cpu: torch.Tensor,
        table_cpu: torch.Tensor | None,
        nd: int,
    ) -> tuple[Decision, PrefillPlan]:
        be = self.backend
        cu_q_cpu = (qsl_cpu[nd:] - qsl_cpu[nd]).to(torch.int32)
        qlens = (cu_q_cpu[1:] - cu_q_cpu[:-1]).to(torch.int64)
        lens = seq_cpu[nd:]
        context_lens = lens - qlens
        if bool((context_lens < 0).any()):
            b = int(torch.nonzero(context_lens < 0)[0, 0])
            raise InvalidInputError(
                "seq_lens",
                f"prefill request {nd + b} has seq_len {int(lens[b])} < query length {int(qlens[b])}",
            )
        has_context = bool((context_lens > 0).any())
        ctx = be.prefill_context(has_chunked_context=has_context)
        decision = be.resolver.resolve(ctx, force=be.force_prefill)
        strategy = be.prefill_strategy(decision)
        cu_q = _to_device(cu_q_cpu, be.device)
        chunks = self._context_chunks(context_lens, step.block_table[nd:]) if has_context else ()
        max_q = int(qlens.max()) if qlens.numel() else 0
        batch = PrefillBatch(
            context=ctx,
            cu_seqlens_q_cpu=cu_q_cpu,
            cu_seqlens_k_cpu=cu_q_cpu,
            cu_seqlens_q=cu_q,
            cu_seqlens_k=cu_q,
            max_seqlen_q=max_q,
            max_seqlen_k=max_q,
            num_tokens=int(cu_q_cpu[-1]),
            num_kv_tokens=int(cu_q_cpu[-1]),
            causal=True,
            context_chunks=chunks,
            cache_blocks=(
                0
                if table_cpu is None
                else used_cache_blocks(table_cpu[nd:], context_lens, be.cache.block_size)
            ),
        )
        return decision, strategy.build_metadata(batch)

    def _context_chunks(
        self, context_lens: torch.Tensor, block_table: torch.Tensor
    ) -> tuple[ContextChunk, ...]:
        """Split the prefill requests' cached context into chunks of at most the workspace.

        Sized by the batch: when the whole context fits the workspace it is one chunk of exactly
        the context tokens; otherwise each request takes an equal block-aligned share of the
        workspace per chunk (vLLM's chunked-context rule). Each chunk's ``token_indices`` hold
        exactly its tokens, so ``expand_context`` sees only real context rows.
        """
        be = self.backend
        bs = be.cache.block_size
        workspace = be.context_chunk_tokens
        total_context = int(context_lens.sum())
        if total_context <= workspace:
            per_request = max(bs, -(-int(context_lens.max()) // bs) * bs)
        else:
            with_context = int((context_lens > 0).sum())
            per_request = max(bs, (workspace // with_context) // bs * bs)
        num_chunks = -(-int(context_lens.max()) // per_request)
        chunks = []
        for c in range(num_chunks):
            starts = torch.clamp(torch.full_like(context_lens, c * per_request), max=context_lens)
            ends = torch.minimum(starts + per_request, context_lens)
            counts = ends - starts
            cu = torch.zeros(counts.numel() + 1, dtype=torch.int64)
            cu[1:] = torch.cumsum(counts, 0)
            total = int(cu[-1])
            pos = torch.arange(total)
            req = torch.searchsorted(cu[1:], pos, right=True)
            position = _to_device(starts[req] + pos - cu[req], be.device)
            blocks = block_table[_to_device(req, be.device), position // bs].to(torch.int64)
            chunks.append(
                ContextChunk(
                    token_indices=(blocks * bs + position % bs).to(torch.int32),
                    cu_seqlens_k=_to_device(cu.to(torch.int32), be.device),
                    max_seqlen_k=int(counts.max()),
                    num_tokens=total,
                )
            )
        return tuple(chunks)


def _same_device(q: torch.Tensor, **others: object) -> None:
    """Every tensor argument is on q's device (the op dispatches on the devices it is given)."""
    require_same_device(("q", q), *((name, t) for name, t in others.items() if isinstance(t, torch.Tensor)))


def _require_inputs(**tensors: object) -> None:
    """The impl's tensor arguments are tensors (a readable error before any op dispatch)."""
    for name, value in tensors.items():
        require_tensor(name, value)


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without a blocking copy (the source is a fresh temporary)."""
    return host.to(device, non_blocking=True)


class AttentionImpl:
    """Runs decode, prefill and the KV write through the custom ops of :mod:`mla.engine.ops`.

    Each method checks its inputs, then calls one op with the backend's handle; the op runs the
    backend's current plan. Eager calls also check that ``metadata`` is the current step's
    (:class:`PlanMismatchError` otherwise). Under ``torch.compile`` the metadata argument is not
    read, so the compiled graph neither guards on it nor changes from step to step.
    """

    def __init__(self, backend: MLABackend) -> None:
        self.backend = backend

    def forward_decode(
        self,
        metadata: MLAMetadata,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        *,
        out: torch.Tensor,
        lse: torch.Tensor | None = None,
        kv_scale: float | torch.Tensor | None = None,
    ) -> None:
        """q ``[num_decode_tokens, H, L+R]``; writes out ``[.., H, L]`` and, when given, lse
        ``[.., H]`` float32. ``lse=None`` (plain decode; the LSE is only needed to merge states,
        e.g. under decode context parallelism) lets the provider skip computing it.
        ``kv_scale`` (fp8 cache) is a float or a one-element device tensor; kernels read it on
        the device, so a captured graph replays with the tensor's current value."""
        be = self.backend
        if not torch.compiler.is_compiling():
            _require_instance("metadata", metadata, MLAMetadata)
            be.check_current(metadata, "decode")
        _require_inputs(q=q, kv_cache=kv_cache, out=out)
        _same_device(q, kv_cache=kv_cache, out=out, lse=lse, kv_scale=kv_scale)
        check_cache_scale(kv_scale, be.cache.dtype, device=q.device)
        ops.decode(q, kv_cache, out, lse, be.kv_scale_tensor(kv_scale), be.op_id)

    def forward_prefill(
        self,
        metadata: MLAMetadata,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        out: torch.Tensor,
        lse: torch.Tensor | None = None,
        kv_cache: torch.Tensor | None = None,
        kv_scale: float | torch.Tensor | None = None,
        expand_context: ContextExpander | ops.ContextExpanderHandle | None = None,
    ) -> None:
        """q/k ``[num_prefill_tokens, H, Dqk]``, v ``[.., H, Dv]``; writes out ``[.., H, Dv]``.

        ``expand_context``: the engine's latent -> (k, v) callback, or (required under
        ``torch.compile``) its handle from :func:`mla.register_context_expander`.
        """
        be = self.backend
        compiling = torch.compiler.is_compiling()
        if not compiling:
            _require_instance("metadata", metadata, MLAMetadata)
            be.check_current(metadata, "prefill")
        _require_inputs(q=q, k=k, v=v, out=out)
        _same_device(q, k=k, v=v, out=out, lse=lse, kv_cache=kv_cache, kv_scale=kv_scale)
        if kv_cache is None and kv_scale is not None:
            raise InvalidInputError("kv_scale", "was given without a kv_cache; pass both or neither")
        check_cache_scale(kv_scale, be.cache.dtype, device=q.device, required=False)
        if lse is None:
            lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device)
        scale = be.kv_scale_tensor(kv_scale)
        if expand_context is None or isinstance(expand_context, ops.ContextExpanderHandle):
            expander_id = 0 if expand_context is None else expand_context.id
            ops.prefill(q, k, v, out, lse, kv_cache, scale, be.op_id, expander_id)
            return
        if compiling:
            raise InvalidInputError(
                "expand_context",
                "under torch.compile pass a handle: register the callback once with "
                "mla.register_context_expander(fn) (e.g. at layer init) and pass the handle",
            )
        handle = ops.register_context_expander(expand_context)
        try:
            ops.prefill(q, k, v, out, lse, kv_cache, scale, be.op_id, handle.id)
        finally:
            handle.release()

    def write_kv(
        self,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        *,
        kv_scale: float | torch.Tensor | None = None,
    ) -> None:
        """Write the step's new latent rows ``kv_c [N, L]`` and rope rows ``k_pe [N, R]`` into
        ``kv_cache [blocks, block_size, L+R]`` at flat slots ``slot_mapping [N]`` (negative
        slots are skipped, and slots outside the cache too; ``validate="full"`` rejects those
        and shared slots on the host; vLLM's ``concat_and_cache_mla`` argument order). fp8
        caches store ``value / kv_scale``."""
        be = self.backend
        check_write_kv(kv_c, k_pe, kv_cache, slot_mapping, kv_scale)
        if be.validate == "full":
            check_slots(slot_mapping.cpu(), num_blocks=kv_cache.shape[0], block_size=kv_cache.shape[1])
        ops.write_kv(kv_c, k_pe, kv_cache, slot_mapping, be.kv_scale_tensor(kv_scale), be.provider_id)
