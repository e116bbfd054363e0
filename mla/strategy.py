"""Strategy base classes: one way to run one phase.

A strategy is mostly data: capability-style constraints as ClassVars, a ``supports(ctx)`` that
returns every reason, ``build_metadata`` (host side, once per step, may sync, writes into the
buffers the strategy allocated at init) and ``run`` (device side: no host sync, no
data-dependent shapes, graph-capturable for decode). New kernels are added by subclassing and
registering (:func:`mla.engine.decision.registry.register`), with no edit to the resolver.
"""

from __future__ import annotations

import abc
import enum
from typing import ClassVar, Generic, TypeVar

import attrs
import torch

from mla.core.capabilities import Contract, ProviderCapabilities
from mla.core.config import EngineLimits, GraphMode, KVCacheSpec, MLADims, dtype_name
from mla.core.context import DecodeContext, PrefillContext
from mla.core.errors import InvalidInputError, PlanMismatchError
from mla.core.platform import Platform
from mla.core.support import ReasonCollector, Support
from mla.core.validate import require_paged_cache
from mla.providers.base import KernelProvider


class Phase(enum.Enum):
    DECODE = "decode"
    PREFILL = "prefill"


class GraphSupport(enum.Enum):
    """What a strategy's ``run`` promises about CUDA-graph capture."""

    UNIFORM_BATCH = "uniform-batch"
    """Capturable for a fixed (batch size, qlen) shape; re-plan in place, then replay."""
    NEVER = "never"
    """Not captured (prefill: host-planned tiles or chunks)."""


class StrategyKind(enum.Enum):
    """Families the preference rules (:mod:`mla.engine.decision.preference`) order; support is
    not preference."""

    SMALL_HEAD = "small-head"
    PAGED = "paged"
    FP8_PREFILL = "fp8-prefill"
    FLASH = "flash"
    SPARSE = "sparse"
    """DeepSeek Sparse Attention: the only family a sparse model (``MLADims.index_topk``) runs."""
    CUSTOM = "custom"


@attrs.frozen(eq=False)
class StrategySetup:
    """What a strategy instance is built with: the backend's static configuration."""

    dims: MLADims
    cache: KVCacheSpec
    limits: EngineLimits
    q_dtype: torch.dtype
    platform: Platform
    provider: KernelProvider
    capabilities: ProviderCapabilities
    device: torch.device


CtxT = TypeVar("CtxT", DecodeContext, PrefillContext)


class Strategy(abc.ABC, Generic[CtxT]):
    """Shared shape of decode and prefill strategies."""

    NAME: ClassVar[str]
    """Short stable kebab-case id used in logs, plans, test ids and ``force=``."""
    PHASE: ClassVar[Phase]
    KIND: ClassVar[StrategyKind] = StrategyKind.CUSTOM
    REQUIRES: ClassVar[frozenset[Contract]] = frozenset()
    """Kernel contracts the provider must implement."""
    GRAPH_SUPPORT: ClassVar[GraphSupport] = GraphSupport.NEVER
    PERSISTENT: ClassVar[bool] = False
    """Runs on a device-planned persistent work schedule (a preference input)."""

    def __init__(self, setup: StrategySetup) -> None:
        self.setup = setup

    def __repr__(self) -> str:
        return f"{type(self).__name__}(provider={self.setup.provider.name!r})"

    @classmethod
    def supports(cls, ctx: CtxT) -> Support:
        """Every reason this strategy cannot compute ``ctx`` with the provider at hand."""
        reasons = provider_reasons(
            ctx.provider_availability, ctx.capabilities, cls.REQUIRES, where=f" on {ctx.platform.arch}"
        )
        caps = ctx.capabilities
        if caps.archs is not None:
            reasons.require(
                ctx.platform.arch in caps.archs,
                "arch",
                f"arch {ctx.platform.arch} is not one of {sorted(caps.archs)} that "
                f"{caps.provider!r} builds for",
            )
        reasons.require(
            serves_model(cls.KIND, ctx.dims),
            "sparse" if ctx.dims.is_sparse else "dense",
            f"the model is sparse (index_topk={ctx.dims.index_topk}): {cls.NAME} attends every "
            "token; a sparse strategy (SparseDecode, SparsePrefill) runs it"
            if ctx.dims.is_sparse
            else f"the model is dense (MLADims.index_topk is None): {cls.NAME} attends only the "
            "indexer's top-k tokens of a DeepSeek Sparse Attention model",
        )
        if isinstance(ctx, DecodeContext):
            reasons.require(
                ctx.graph_mode is not GraphMode.FULL or cls.GRAPH_SUPPORT is not GraphSupport.NEVER,
                "graph",
                f"the engine captures whole decode steps in CUDA graphs (graph_mode "
                f"{ctx.graph_mode.value!r}) and {cls.NAME} is not capturable (GRAPH_SUPPORT never)",
            )
        cls.check(ctx, reasons)
        return reasons.support()

    @classmethod
    @abc.abstractmethod
    def check(cls, ctx: CtxT, reasons: ReasonCollector) -> None:
        """Strategy-specific support rules; append a reason per violated rule."""

    def check_plan(self, plan: PlanBase) -> None:
        if plan.strategy != self.NAME:
            raise PlanMismatchError(
                f"{self.NAME}.run was handed a plan built by {plan.strategy!r}; the impl must "
                "run the strategy recorded in the metadata"
            )


def serves_model(kind: StrategyKind, dims: MLADims) -> bool:
    """Whether a strategy of ``kind`` serves a model of ``dims``: sparse strategies serve sparse
    models (``MLADims.index_topk``), every other kind dense ones."""
    return (kind is StrategyKind.SPARSE) == dims.is_sparse


def provider_reasons(
    availability: Support, caps: ProviderCapabilities, requires: frozenset[Contract], *, where: str = ""
) -> ReasonCollector:
    """A collector holding why the provider cannot serve a strategy that ``requires`` these
    contracts: it is not available here, or its record lacks one (``where``: e.g. " on gfx942")."""
    reasons = ReasonCollector()
    reasons.extend(availability.reasons)
    for contract in sorted(requires, key=lambda c: c.value):
        reasons.require(
            caps.has(contract),
            "missing-kernel",
            f"provider {caps.provider!r} does not ship the {contract.value} kernel{where}",
        )
    return reasons


def require_dtype(
    reasons: ReasonCollector,
    code: str,
    what: str,
    dtype: torch.dtype,
    allowed: frozenset[torch.dtype],
    kernel: str,
) -> None:
    """Rule shared by strategies: ``dtype`` (the ``what``, e.g. "query") is one ``kernel`` takes."""
    reasons.require(
        dtype in allowed,
        code,
        f"{what} {dtype_name(dtype)}: the {kernel} takes {sorted(dtype_name(d) for d in allowed)}",
    )


def require_latent_dims(ctx: DecodeContext, reasons: ReasonCollector, kernel: str) -> None:
    """Rule shared by decode strategies: the provider's kernels are built for these latent dims."""
    built = ctx.capabilities.latent_dims
    latent = (ctx.dims.kv_lora_rank, ctx.dims.qk_rope_head_dim)
    reasons.require(
        built is None or latent in built,
        "dims",
        f"kv_lora_rank/rope {latent[0]}/{latent[1]}: the {kernel} is built for {sorted(built or ())}",
    )


@attrs.frozen(eq=False)
class PlanBase:
    """What ``build_metadata`` returns: the decision and the geometry it was built for."""

    strategy: str
    """``NAME`` of the strategy that built the plan (and must run it)."""


def check_tensor(
    argument: str,
    tensor: torch.Tensor,
    *,
    shape: tuple[int, ...],
    dtype: torch.dtype | None = None,
    device: torch.device | None = None,
) -> None:
    """Cheap run-time agreement check between an input and the plan's geometry."""
    if not isinstance(tensor, torch.Tensor):
        raise InvalidInputError(argument, f"expected a torch.Tensor, got {type(tensor).__name__}")
    if tuple(tensor.shape) != shape:
        raise InvalidInputError(argument, f"expected shape {shape}, got {tuple(tensor.shape)}")
    if dtype is not None and tensor.dtype != dtype:
        raise InvalidInputError(
            argument, f"expected dtype {dtype_name(dtype)}, got {dtype_name(tensor.dtype)}"
        )
    if device is not None and tensor.device.type != device.type:
        raise InvalidInputError(argument, f"expected device {device}, got {tensor.device}")


def check_cache(
    kv_cache: torch.Tensor,
    *,
    block_size: int,
    width: int,
    dtype: torch.dtype,
    device: torch.device,
    num_blocks: int = 0,
) -> None:
    """The paged cache a run reads: ``[blocks >= num_blocks, block_size, width]`` of ``dtype``
    on ``device`` (``num_blocks``: the spec's count, or the blocks the step reads)."""
    if not isinstance(kv_cache, torch.Tensor):
        raise InvalidInputError("kv_cache", f"expected a torch.Tensor, got {type(kv_cache).__name__}")
    if kv_cache.dim() != 3 or tuple(kv_cache.shape[1:]) != (block_size, width):
        raise InvalidInputError(
            "kv_cache",
            f"expected [num_blocks, {block_size}, {width}] (KVCacheSpec.block_size, latent width), "
            f"got {tuple(kv_cache.shape)}",
        )
    check_tensor("kv_cache", kv_cache, shape=tuple(kv_cache.shape), dtype=dtype, device=device)
    require_paged_cache("kv_cache", kv_cache)
    if kv_cache.shape[0] < num_blocks:
        raise InvalidInputError(
            "kv_cache",
            f"has {kv_cache.shape[0]} blocks but needs {num_blocks} (KVCacheSpec.num_blocks, or the "
            f"largest block id this step's block_table reads, plus one); pass the cache the block "
            "table indexes",
        )
