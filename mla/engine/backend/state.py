"""The backend's state: provider, resolver, strategies and their persistent buffers, and what
the custom ops run (:class:`BackendState`, the base of :class:`~mla.engine.backend.MLABackend`)."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from mla.core.capabilities import ProviderCapabilities
from mla.core.config import (
    FLOAT_DTYPES,
    EngineLimits,
    IndexerSpec,
    KVCacheSpec,
    MLADims,
    dtype_name,
    normalize_dtype,
)
from mla.core.context import DecodeContext, PrefillContext, decode_context, prefill_context
from mla.core.errors import (
    ConcurrentUseError,
    InvalidInputError,
    PlanMismatchError,
    ProviderUnavailableError,
    UnsupportedError,
)
from mla.core.platform import Platform, resolve_platform
from mla.core.validate import ValidateMode, require_int, require_validate_mode
from mla.decode.base import DecodeIndexBuffers, DecodePlan, DecodeStrategy
from mla.engine.backend import ops
from mla.engine.backend.checks import require_instance
from mla.engine.backend.scale import KVScale
from mla.engine.backend.step import MLAMetadata
from mla.engine.decision.registry import AnyStrategy
from mla.engine.decision.resolver import Decision, Resolver
from mla.prefill.base import ContextExpander, PrefillPlan, PrefillStrategy
from mla.providers import resolve_provider
from mla.providers.base import KernelProvider
from mla.sparse.base import SparseBuffers, SparsePlan, SparseStrategy
from mla.sparse.indexer import INDEXER_STRATEGIES, IndexerContext, IndexerStrategy
from mla.strategy import Phase, StrategySetup

S = TypeVar("S", DecodeStrategy, PrefillStrategy, SparseStrategy[Any])


def default_context_chunk_tokens(limits: EngineLimits, block_size: int) -> int:
    """vLLM's chunked-context workspace: ``min(max(8*max_model_len, 4*max_num_seqs*block), 64K)``
    tokens, at least ``max_num_seqs * block_size``."""
    size = min(max(8 * limits.max_model_len, 4 * limits.max_num_seqs * block_size), 64 * 1024)
    return max(size, limits.max_num_seqs * block_size)


class BackendState:
    """What an :class:`~mla.engine.backend.MLABackend` owns and runs, without its builder/impl
    pair (they read this state; see that class for the contract of the arguments)."""

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
        indexer: IndexerSpec | None = None,
        indexer_strategy: type[IndexerStrategy] | None = None,
    ) -> None:
        require_instance("dims", dims, MLADims)
        require_instance("cache", cache, KVCacheSpec)
        require_instance("limits", limits, EngineLimits)
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
        self.sparse_buffers: SparseBuffers | None = None
        self.indexer: IndexerStrategy | None = None
        self.sparse_strategies: dict[str, SparseStrategy[Any]] = {}
        self.decode_counts = torch.zeros(2, dtype=torch.int32, device=self.device)
        """int32 ``[2]`` device words of the dense page fill: ``[0]`` is :attr:`invalid_count`
        (a dense model's), ``[1]`` the requests with a bad length, counted only where a caller
        asked (``index_buffers.count_lengths``: the functional ``mla_decode``, which reads both
        words in one copy)."""
        self.invalid_count = self.decode_counts[:1]
        """int32 ``[1]`` device counter of the keys masked because they pointed outside the cache
        (:meth:`invalid_index_count`): the sparse slot conversion and the dense page fill both
        add to it."""
        if dims.is_sparse:
            self.indexer = self._make_indexer(indexer, indexer_strategy)
            self.sparse_buffers = SparseBuffers.allocate(self.setup)
            self.invalid_count = self.sparse_buffers.invalid_count
        elif indexer is not None or indexer_strategy is not None:
            raise InvalidInputError(
                "indexer",
                "was given for a dense model; set MLADims.index_topk to serve a DeepSeek Sparse "
                "Attention model",
            )
        self._index_buffers: DecodeIndexBuffers | None = None
        self.decode_strategies: dict[str, DecodeStrategy] = {}
        self.prefill_strategies: dict[str, PrefillStrategy] = {}
        self.late_allocations: list[str] = []
        """Strategies first allocated after init (a step the init-time enumeration missed)."""
        self.initialized = False
        """Set when init is done: strategies allocated from then on are late allocations."""
        if preallocate:
            self._preallocate()
        self.current_metadata: MLAMetadata | None = None
        """The metadata of the step being run (set by ``builder.build``)."""
        self.in_use = threading.RLock()
        """Held by the thread inside ``builder.build``/``plan`` or an eager ``impl`` call
        (re-entrant): a second thread's call raises :class:`~mla.core.errors.ConcurrentUseError`
        (:meth:`hold`)."""
        self.kv_scale = KVScale(cache.dtype, self.device)
        """The one owner of the fp8 ``kv_scale``: the doors check a caller's value and convert it
        here once (:class:`~mla.engine.backend.scale.KVScale`)."""
        self.op_id = ops.register_runner(self)
        self.provider_id = ops.provider_handle(self.provider)
        self.initialized = True

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(provider={self.provider.name!r}, arch={self.platform.arch!r}, "
            f"heads={self.dims.num_heads}, decode={sorted(self.decode_strategies)}, "
            f"prefill={sorted(self.prefill_strategies)}"
            + (f", sparse={sorted(self.sparse_strategies)})" if self.dims.is_sparse else ")")
        )

    @property
    def index_buffers(self) -> DecodeIndexBuffers:
        """The dense decode strategies' shared page-index buffers (allocated on first use)."""
        if self._index_buffers is None:
            self._index_buffers = DecodeIndexBuffers.allocate(self.setup, self.invalid_count)
        return self._index_buffers

    def _make_indexer(
        self, spec: IndexerSpec | None, strategy: type[IndexerStrategy] | None
    ) -> IndexerStrategy:
        """The sparse model's indexer: ``strategy`` (checked), else the first built-in that supports
        the spec on this provider."""
        spec = IndexerSpec() if spec is None else spec
        require_instance("indexer", spec, IndexerSpec)
        ctx = IndexerContext(
            spec=spec,
            q_dtype=self.model_dtype,
            capabilities=self.capabilities,
            provider_availability=self.provider.availability(),
        )
        candidates = INDEXER_STRATEGIES if strategy is None else (strategy,)
        reasons: list[str] = []
        for cls in candidates:
            if not (isinstance(cls, type) and issubclass(cls, IndexerStrategy)):
                raise InvalidInputError(
                    "indexer_strategy", f"expected an IndexerStrategy subclass, got {cls!r}"
                )
            support = cls.supports(ctx)
            if support:
                return cls(self.setup, spec)
            reasons.append(f"{cls.NAME}: {support}")
        raise UnsupportedError(
            f"no indexer runs this model on provider {self.capabilities.provider!r}: " + "; ".join(reasons)
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
            self._allocate(decision)
        for chunked in (False, True):
            try:
                decision = self.resolver.resolve(
                    self.prefill_context(has_chunked_context=chunked), force=self.force_prefill
                )
            except UnsupportedError as exc:
                raise self._unsupported(exc, "prefill", 0) from exc
            self._allocate(decision)

    def _allocate(self, decision: Decision) -> None:
        if self.dims.is_sparse:
            self.sparse_strategy(decision)
        elif decision.phase is Phase.DECODE:
            self.decode_strategy(decision)
        else:
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

    def sparse_strategy(self, decision: Decision | str) -> SparseStrategy[Any]:
        """The backend's instance of a sparse strategy (allocated on first use; they share the
        backend's sparse buffers)."""
        buffers = self.sparse_buffers
        assert buffers is not None

        def make(cls: AnyStrategy) -> SparseStrategy[Any]:
            if not issubclass(cls, SparseStrategy):
                raise UnsupportedError(
                    f"{cls.NAME} is a dense strategy; this backend serves a sparse model "
                    f"(index_topk={self.dims.index_topk})"
                )
            return cls(self.setup, buffers)

        return self._strategy(decision, self.sparse_strategies, make)

    def decode_strategy(self, decision: Decision | str) -> DecodeStrategy:
        """The backend's instance of a decode strategy (allocated on first use)."""

        def make(cls: AnyStrategy) -> DecodeStrategy:
            assert issubclass(cls, DecodeStrategy)
            return cls(self.setup, self.index_buffers)

        return self._strategy(decision, self.decode_strategies, make)

    def prefill_strategy(self, decision: Decision | str) -> PrefillStrategy:
        """The backend's instance of a prefill strategy (allocated on first use)."""

        def make(cls: AnyStrategy) -> PrefillStrategy:
            assert issubclass(cls, PrefillStrategy)
            return cls(self.setup)

        return self._strategy(decision, self.prefill_strategies, make)

    def _strategy(
        self, decision: Decision | str, allocated: dict[str, S], make: Callable[[AnyStrategy], S]
    ) -> S:
        name = decision if isinstance(decision, str) else decision.name
        if name not in allocated:
            cls = decision.strategy if isinstance(decision, Decision) else self.resolver.registry.get(name)
            if self.initialized:
                self.late_allocations.append(name)
            allocated[name] = make(cls)
        return allocated[name]

    # -- what the custom ops run -------------------------------------------------------------

    def current_decode(self) -> tuple[DecodeStrategy, DecodePlan]:
        """The current step's decode plan and the strategy that runs it."""
        plan = self._current("decode").decode
        assert plan is not None
        return self.decode_strategy(plan.strategy), plan

    def current_prefill(self) -> tuple[PrefillStrategy, PrefillPlan]:
        """The current step's prefill plan and the strategy that runs it."""
        plan = self._current("prefill").prefill
        assert plan is not None
        return self.prefill_strategy(plan.strategy), plan

    def checked_decode(
        self, q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None
    ) -> tuple[DecodeStrategy, DecodePlan]:
        """:meth:`current_decode`, with the inputs checked against the plan
        (:meth:`DecodeStrategy.check_inputs`): what the body of ``mla::decode`` runs."""
        strategy, plan = self.current_decode()
        strategy.check_inputs(plan, q, kv_cache, out, lse)
        return strategy, plan

    def checked_prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        kv_cache: torch.Tensor | None,
        has_kv_scale: bool,
        expand_context: ContextExpander | None,
    ) -> tuple[PrefillStrategy, PrefillPlan]:
        """:meth:`current_prefill`, with the inputs checked against the plan
        (:meth:`PrefillStrategy.check_inputs`): what the body of ``mla::prefill`` runs."""
        strategy, plan = self.current_prefill()
        strategy.check_inputs(
            plan,
            q,
            k,
            v,
            out=out,
            lse=lse,
            kv_cache=kv_cache,
            has_kv_scale=has_kv_scale,
            expand_context=expand_context,
        )
        return strategy, plan

    def checked_sparse(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        topk_indices: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor | None,
        prefill: bool,
    ) -> tuple[SparseStrategy[Any], SparsePlan]:
        """The current step's sparse decode or prefill plan and its strategy, with the inputs
        checked against the plan: what the body of ``mla::sparse_attention`` runs."""
        phase = "sparse_prefill" if prefill else "sparse_decode"
        plan = getattr(self._current(phase), phase)
        assert isinstance(plan, SparsePlan)
        strategy = self.sparse_strategy(plan.strategy)
        strategy.check_inputs(plan, q, kv_cache, topk_indices, out, lse)
        return strategy, plan

    def run_index_topk(
        self, q: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor, out: torch.Tensor
    ) -> None:
        """Run the indexer over the current step's rows (the body of ``mla::index_topk``)."""
        plan = self._current("index").index
        assert plan is not None
        assert self.indexer is not None
        self.indexer.run(plan, q, weights, index_cache, out=out)

    def run_write_index_keys(
        self, keys: torch.Tensor, index_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Write index keys (the body of ``mla::write_index_keys``)."""
        if self.indexer is None:
            raise InvalidInputError("index_cache", "this backend serves a dense model: it has no indexer")
        self.indexer.write_keys(keys, index_cache, slot_mapping)

    def invalid_index_count(self) -> int:
        """Keys masked since the backend was made because they pointed outside the cache (reads
        one device int: a sync; call it between steps, e.g. in a health check).

        A sparse model counts top-k entries outside their row's causal window, the block table
        or the cache (at each layer's slot conversion). A dense model counts, once per build,
        the decode keys (positions below a request's length) and the prefill's cached-context
        tokens whose block id is negative or past ``KVCacheSpec.num_blocks`` (when given): the
        kernels mask those keys, never clamp them into another block."""
        return int(self.invalid_count.item())

    def hold(self, call: str) -> bool:
        """Take :attr:`in_use` for an eager ``call`` (the caller releases it when this returns
        ``True``): :class:`ConcurrentUseError` when another thread holds it. ``False`` under
        ``torch.compile``: a compiled graph is not guarded."""
        if torch.compiler.is_compiling():
            return False
        if not self.in_use.acquire(blocking=False):
            raise ConcurrentUseError(
                f"{call} was called from thread {threading.current_thread().name!r} while another "
                "thread's call on the same MLABackend was in progress; a backend serves one step at "
                "a time (its builds write the buffers its runs read): serialize each step's build "
                "and run (one thread per backend, or a lock), or give each thread its own backend"
            )
        return True

    def _current(self, phase: str) -> MLAMetadata:
        metadata = self.current_metadata
        if metadata is None:
            raise InvalidInputError("metadata", "no step was built yet: call builder.build(step) first")
        if getattr(metadata, phase) is None:
            what = phase.replace("_", " ")
            raise InvalidInputError("metadata", f"this step has no {what} requests")
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
