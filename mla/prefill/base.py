"""Prefill strategy base: step inputs, plan geometry, cached-context chunks."""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import ClassVar

import attrs
import torch

from mla.core.config import dtype_name
from mla.core.context import PrefillContext
from mla.core.errors import InvalidInputError
from mla.core.records import fast_constructor
from mla.core.validate import require_no_overlap, require_tensor
from mla.strategy import GraphSupport, Phase, PlanBase, Strategy, check_cache, check_tensor

ContextExpander = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""Engine callback turning cached latent rows ``[n, L+R]`` (model dtype) into MHA-form keys and
``v [n, H, Dv]``: the keys either as ``k_nope [n, H, qk_nope]`` alone (the kv_b_proj
up-projection; the framework reads the rope lanes from the latent rows it passed, shared by
every head) or whole, ``k [n, H, qk_nope + R]`` (up-projection plus the rope part). Each
tensor needs a contiguous last dim only: views of one matmul output (``kv.view(n, H, -1)``
sliced into ``k_nope`` and ``v``) are taken as they are, without a copy."""


@attrs.frozen(eq=False)
class ContextChunk:
    """One chunk of cached context: per prefill request a slice of its context tokens."""

    token_indices: torch.Tensor
    """int32 ``[workspace_tokens]`` flat cache token ids (entries past ``num_tokens`` unused)."""
    cu_seqlens_k: torch.Tensor
    """int32 ``[P+1]`` on the device: the chunk's tokens per request."""
    max_seqlen_k: int
    num_tokens: int


@attrs.frozen(eq=False)
class PrefillBatch:
    """The prefill part of one step (new tokens; optional cached context)."""

    context: PrefillContext
    cu_seqlens_q_cpu: torch.Tensor | None
    """int ``[B+1]`` on the host; ``None`` when the values are checked after the launch
    (``mla.mla_prefill`` on a provider whose kernels clamp the ranges), which only strategies
    whose plan does not read them (:attr:`PrefillStrategy.PLAN_READS_HOST_INDPTRS`) get."""
    cu_seqlens_k_cpu: torch.Tensor | None
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    num_tokens: int
    num_kv_tokens: int
    causal: bool = True
    context_chunks: tuple[ContextChunk, ...] = ()
    cache_blocks: int = 0
    """Cache blocks the context chunks read (largest block id used, plus one) when the builder
    read the block table on the host (``validate="full"``), else 0: ``run`` refuses a
    ``kv_cache`` with fewer blocks."""
    launch_checked: bool = False
    """The tensors a run of this step gets have a signature whose launch already passed the
    provider's argument checks (:func:`mla.mla_prefill`'s door vouches for it from the second
    call of a signature): the plan's launch may tell the provider to skip them
    (:attr:`PrefillPlan.launch_checked`)."""


@attrs.frozen
class PrefillGeometry:
    num_heads: int
    num_tokens: int
    num_kv_tokens: int
    max_seqlen_q: int
    max_seqlen_k: int
    causal: bool
    cache_blocks: int = 0


@attrs.frozen(eq=False)
class PrefillPlan(PlanBase):
    geometry: PrefillGeometry
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    context_chunks: tuple[ContextChunk, ...]
    schedule: object | None = None
    launch_checked: bool = False
    """From :attr:`PrefillBatch.launch_checked`: a launch of the new tokens may pass
    ``checked=True`` to the provider (:attr:`~mla.providers.calls.VarlenPrefillCall.checked`)."""


_GEOMETRY = fast_constructor(PrefillGeometry)
_PLAN = fast_constructor(PrefillPlan)
"""A plan's records (:mod:`mla.core.records`: values of a batch the builder checked)."""


class PrefillStrategy(Strategy[PrefillContext]):
    """Runs the prefill phase in MHA form.

    q ``[T, H, Dqk]``, k ``[Tk, H, Dqk]``, v ``[Tk, H, Dv]``, out ``[T, H, Dv]`` (q's dtype),
    lse ``[T, H]`` float32. Causal masks are bottom-right aligned. Cached context (when the plan
    has chunks) is gathered from ``kv_cache``, expanded by the engine's ``expand_context`` and
    merged by LSE.
    """

    PHASE: ClassVar[Phase] = Phase.PREFILL
    GRAPH_SUPPORT: ClassVar[GraphSupport] = GraphSupport.NEVER
    PLAN_READS_HOST_INDPTRS: ClassVar[bool] = False
    """Whether :meth:`plan_schedule` reads the host ``cu_seqlens`` (a host-side tiling): such a
    plan always gets them (no launch before the values are read)."""

    def build_metadata(self, batch: PrefillBatch) -> PrefillPlan:
        return _PLAN(
            self.NAME,
            _GEOMETRY(
                batch.context.num_heads,
                batch.num_tokens,
                batch.num_kv_tokens,
                batch.max_seqlen_q,
                batch.max_seqlen_k,
                batch.causal,
                batch.cache_blocks,
            ),
            batch.cu_seqlens_q,
            batch.cu_seqlens_k,
            batch.context_chunks,
            self.plan_schedule(batch),
            batch.launch_checked,
        )

    def plan_schedule(self, batch: PrefillBatch) -> object | None:
        """Strategy-specific host planning (default: none)."""
        return None

    @abc.abstractmethod
    def launch(
        self,
        plan: PrefillPlan,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        out: torch.Tensor,
        lse: torch.Tensor,
        kv_cache: torch.Tensor | None,
        kv_scale: torch.Tensor | None,
        expand_context: ContextExpander | None,
    ) -> None:
        """Device side: the kernels for one validated call (``kv_scale`` as a float32 ``[1]``
        device tensor)."""

    def check_inputs(
        self,
        plan: PrefillPlan,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        out: torch.Tensor,
        lse: torch.Tensor,
        kv_cache: torch.Tensor | None,
        has_kv_scale: bool,
        expand_context: ContextExpander | None,
    ) -> None:
        """The engine's check of a run's tensors against ``plan`` (typed errors naming each
        argument), made once before :meth:`run`: q, k, v, ``out`` and ``lse`` fit its geometry,
        a plan with cached context has a ``kv_cache`` (and, for an fp8 cache, a ``kv_scale``:
        ``has_kv_scale``) and a callable ``expand_context``, and no output overlaps an input."""
        self.check_plan(plan)
        geo = plan.geometry
        require_tensor("q", q, ndim=3)
        require_tensor("v", v, ndim=3)
        check_tensor("q", q, shape=(geo.num_tokens, geo.num_heads, q.shape[-1]))
        check_tensor(
            "k", k, shape=(geo.num_kv_tokens, geo.num_heads, q.shape[-1]), dtype=q.dtype, device=q.device
        )
        check_tensor(
            "v", v, shape=(geo.num_kv_tokens, geo.num_heads, v.shape[-1]), dtype=q.dtype, device=q.device
        )
        check_tensor(
            "out", out, shape=(geo.num_tokens, geo.num_heads, v.shape[-1]), dtype=q.dtype, device=q.device
        )
        check_tensor("lse", lse, shape=(geo.num_tokens, geo.num_heads), dtype=torch.float32, device=q.device)
        if plan.context_chunks and (kv_cache is None or expand_context is None):
            raise InvalidInputError(
                "expand_context",
                "this step has cached context: pass kv_cache and an expand_context callback "
                "that up-projects latent rows to (k, v)",
            )
        if expand_context is not None and not callable(expand_context):
            raise InvalidInputError(
                "expand_context", f"expected a callable latent -> (k, v), got {type(expand_context).__name__}"
            )
        if kv_cache is not None:
            cache = self.setup.cache
            check_cache(
                kv_cache,
                block_size=cache.block_size,
                width=self.setup.dims.latent_dim,
                dtype=cache.dtype,
                device=q.device,
                num_blocks=max(cache.num_blocks or 0, geo.cache_blocks),
            )
            if plan.context_chunks and cache.is_fp8 and not has_kv_scale:
                raise InvalidInputError(
                    "kv_scale",
                    f"an fp8 kv_cache ({dtype_name(cache.dtype)}) needs kv_scale, its per-tensor "
                    "dequant scale (value = stored * kv_scale), to read this step's cached context",
                )
        inputs = (("q", q), ("k", k), ("v", v), ("kv_cache", kv_cache))
        require_no_overlap("out", out, *inputs, ("lse", lse))
        require_no_overlap("lse", lse, *inputs)

    def run(
        self,
        plan: PrefillPlan,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        out: torch.Tensor,
        lse: torch.Tensor,
        kv_cache: torch.Tensor | None = None,
        kv_scale: torch.Tensor | None = None,
        expand_context: ContextExpander | None = None,
    ) -> None:
        """Execute ``plan`` on inputs checked against it (:meth:`check_inputs`, which the
        engine runs at its door): only the plan's strategy and row count are asserted here.
        ``kv_scale`` (the float32 ``[1]`` device tensor the engine converted) dequantizes an
        fp8 ``kv_cache``'s context rows."""
        self.check_plan(plan)
        assert q.shape[0] == out.shape[0] == plan.geometry.num_tokens, "run: inputs of another plan"
        self.launch(
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
