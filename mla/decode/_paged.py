"""Shared machinery of the asm-style strategies: head padding, qlen padding, paged decode."""

from __future__ import annotations

from typing import ClassVar

import attrs
import torch

from mla.core.capabilities import Contract, ProviderCapabilities
from mla.core.config import dtype_name
from mla.core.context import DecodeContext
from mla.core.records import fast_constructor
from mla.core.support import ReasonCollector
from mla.decode.base import (
    DecodeBatch,
    DecodeIndexBuffers,
    DecodePlan,
    DecodeStrategy,
    same_view,
)
from mla.providers.calls import (
    DecodeSchedule,
    DecodeScheduleBuffersCall,
    PagedDecodeCall,
    PlanDecodeScheduleCall,
)
from mla.providers.transforms import HeadPadding, qlen_padding_maps
from mla.strategy import StrategyKind, StrategySetup, require_dtype, require_latent_dims


@attrs.frozen(eq=False)
class PagedPlan(DecodePlan):
    """Plan of a paged (asm-style) decode."""

    qo_indptr: torch.Tensor
    """int32 ``[B+1]``: kernel rows per request (uniform step ``kernel_qlen`` when qlen-padded)."""
    qlen_padded: bool
    """Kernel rows differ from caller rows: ``source_index``/``kernel_row`` remap them."""
    source_index: torch.Tensor
    """int64 ``[Tk]`` (view): caller row each kernel row reads (0 for a prepended zero row)."""
    source_keep: torch.Tensor
    """``[Tk]`` in the model dtype (view): 1 for a kernel row holding a caller row, 0 for a
    prepended zero row."""
    kernel_row: torch.Tensor
    """int64 ``[T]`` (view): kernel row per caller row, ``Tk`` = the zero sink row."""
    schedule: DecodeSchedule | None
    """The provider's persistent schedule buffers, planned for this step (``None``: not persistent)."""
    block_table: torch.Tensor | None
    """The step's block table (the engine's tensor, its decode rows), which the provider's
    kernels read (``ProviderCapabilities.decode_reads_block_table``); ``None``: they read
    ``kv_indices``."""


_PAGED_PLAN = fast_constructor(PagedPlan)
"""A build's plan record (:mod:`mla.core.records`)."""


@attrs.define
class PagedWorkspace:
    """Buffers sized at init for the largest (kernel heads, kernel qlen) this strategy runs."""

    padding: HeadPadding
    max_kernel_qlen: int
    qo_indptr: torch.Tensor
    source_index: torch.Tensor
    source_keep: torch.Tensor
    kernel_row: torch.Tensor
    q_kernel: torch.Tensor
    """``[max_kernel_rows, Hk, L+R]`` in the model dtype."""
    o_kernel: torch.Tensor
    """``[max_kernel_rows + 1, Hk, L]``; the last row is the zero sink."""
    lse_kernel: torch.Tensor
    """``[max_kernel_rows + 1, Hk]`` float32; the last row is the ``-inf`` sink."""
    schedule: DecodeSchedule | None
    _views: dict[tuple[int, int, int], tuple[torch.Tensor, ...]] = attrs.field(
        factory=dict, init=False, repr=False
    )

    def views(
        self, num_requests: int, rows: int, num_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``qo_indptr[:B+1]``, ``source_index[:rows]``, ``source_keep[:rows]`` and
        ``kernel_row[:T]`` (each view made once per size: slicing is a torch op)."""
        key = (num_requests, rows, num_tokens)
        views = self._views.get(key)
        if views is None:
            views = self._views[key] = (
                self.qo_indptr[: num_requests + 1],
                self.source_index[:rows],
                self.source_keep[:rows],
                self.kernel_row[:num_tokens],
            )
        qo, source, keep, row = views
        return qo, source, keep, row


def max_kernel_qlen(caps: ProviderCapabilities, max_decode_qlen: int) -> int:
    """The largest kernel qlen any step within the engine limits can run at (PR #45227:
    buffers must be sized for the kernel qlen, never the logical one)."""
    return max(
        max(caps.kernel_qlen(q, uniform=True), caps.kernel_qlen(q, uniform=False))
        for q in range(1, max_decode_qlen + 1)
    )


class PagedDecode(DecodeStrategy):
    """Base of the asm-style strategies over the provider's paged MQA decode."""

    KIND: ClassVar[StrategyKind] = StrategyKind.PAGED
    REQUIRES: ClassVar[frozenset[Contract]] = frozenset({Contract.PAGED_DECODE, Contract.EXPAND_PAGES})

    @classmethod
    def needs_token_ids(cls, setup: StrategySetup) -> bool:
        """Only where the provider's kernels take flat per-token ids (aiter's, the gluon
        provider's)."""
        return setup.capabilities.decode_token_ids

    def __init__(self, setup: StrategySetup, index_buffers: DecodeIndexBuffers | None = None) -> None:
        super().__init__(setup, index_buffers)
        caps, limits, dims, dev = setup.capabilities, setup.limits, setup.dims, setup.device
        padding = HeadPadding(dims.num_heads, caps.padded_heads(dims.num_heads))
        kq = max_kernel_qlen(caps, limits.max_decode_qlen)
        rows = limits.max_num_seqs * kq
        heads = padding.kernel_heads
        schedule = None
        if self.PERSISTENT:
            schedule = setup.provider.decode_schedule_buffers(
                DecodeScheduleBuffersCall(
                    max_batch=limits.max_num_seqs,
                    max_kernel_qlen=kq,
                    kernel_heads=heads,
                    kv_lora_rank=dims.kv_lora_rank,
                    q_dtype=setup.q_dtype,
                    kv_dtype=setup.cache.dtype,
                    platform=setup.platform,
                    device=dev,
                )
            )
        self.workspace = PagedWorkspace(
            padding=padding,
            max_kernel_qlen=kq,
            qo_indptr=torch.zeros(limits.max_num_seqs + 1, dtype=torch.int32, device=dev),
            source_index=torch.zeros(rows, dtype=torch.int64, device=dev),
            source_keep=torch.zeros(rows, dtype=setup.q_dtype, device=dev),
            kernel_row=torch.zeros(limits.max_decode_tokens, dtype=torch.int64, device=dev),
            q_kernel=torch.zeros(rows, heads, dims.latent_dim, dtype=setup.q_dtype, device=dev),
            # float32 where the provider writes it: a float32 ``out`` (decode context
            # parallelism's partials) is then rounded nowhere on the way.
            o_kernel=torch.zeros(
                rows + 1,
                heads,
                dims.kv_lora_rank,
                dtype=torch.float32 if setup.capabilities.decode_float32_out else setup.q_dtype,
                device=dev,
            ),
            lse_kernel=torch.zeros(rows + 1, heads, dtype=torch.float32, device=dev),
            schedule=schedule,
        )
        self._last_plan: PagedPlan | None = None

    @classmethod
    def check(cls, ctx: DecodeContext, reasons: ReasonCollector) -> None:
        caps = ctx.capabilities
        heads = ctx.num_heads
        g, cap = caps.head_granularity, caps.max_unpadded_heads
        reasons.require(
            caps.heads_valid(heads),
            "heads",
            f"{heads} heads: the paged decode needs H > 0 and (H <= {cap} or H % {g} == 0)",
        )
        require_dtype(reasons, "q-dtype", "query", ctx.q_dtype, caps.q_dtypes, "paged decode")
        require_dtype(reasons, "kv-dtype", "kv cache", ctx.kv_dtype, caps.kv_dtypes, "paged decode")
        require_latent_dims(ctx, reasons, "paged decode")
        kernel_heads, kernel_qlen = caps.padded_heads(heads), ctx.kernel_qlen
        padded = heads < caps.head_granularity
        fp8, mode = ctx.kv_is_fp8, "persistent" if cls.PERSISTENT else "non-persistent"
        found = caps.has_paged_kernel(
            persistent=cls.PERSISTENT, fp8=fp8, heads=kernel_heads, qlen=kernel_qlen, padded=padded
        )
        rows = "; ".join(map(str, caps.paged_kernel_rows(persistent=cls.PERSISTENT, fp8=fp8)))
        reasons.require(
            not caps.heads_valid(heads) or found,
            "kernel-table",
            f"{caps.provider} on {ctx.platform.arch} has no {mode} "
            f"{'fp8' if fp8 else dtype_name(ctx.kv_dtype)}-KV decode kernel for {kernel_heads} "
            f"kernel heads{f' (padded from {heads})' if padded else ''} at kernel qlen "
            f"{kernel_qlen} (its {mode} kernels: {rows or 'none'})",
        )

    def build_metadata(self, batch: DecodeBatch) -> PagedPlan:
        """Fill the page indices (and the qlen-padding maps, the persistent schedule) for
        ``batch``; the plan record is the previous build's when nothing it holds changed (its
        buffers now hold this step's values)."""
        setup, ws = self.setup, self.workspace
        ctx = batch.context
        num_requests, num_tokens = batch.num_requests, batch.num_tokens
        kernel_qlen = ctx.kernel_qlen
        qlen_padded = kernel_qlen != ctx.max_qlen
        lengths = batch.lengths
        uniform_rows = qlen_padded or lengths.min_query == kernel_qlen == lengths.max_query
        if qlen_padded:
            kv_indptr = self.index_buffers.fill_indptr(setup, batch)
            maps = qlen_padding_maps(batch.query_start_loc_cpu, num_tokens, kernel_qlen)
            rows = maps.num_kernel_rows
            qo_indptr, source_index, source_keep, kernel_row = ws.views(num_requests, rows, num_tokens)
            qo_indptr.copy_(maps.qo_indptr, non_blocking=True)
            source = maps.source_token
            source_index.copy_(torch.clamp(source, min=0), non_blocking=True)
            source_keep.copy_((source >= 0).to(setup.q_dtype), non_blocking=True)
            kernel_row.copy_(maps.kernel_row, non_blocking=True)
        else:
            rows = num_tokens
            qo_indptr, source_index, source_keep, kernel_row = ws.views(num_requests, rows, num_tokens)
            # The kernel rows are the caller's: the fill's launch copies query_start_loc too.
            kv_indptr = self.index_buffers.fill_indptr(setup, batch, qo_indptr=qo_indptr)
        geometry = self.base_geometry(
            batch, kernel_heads=ws.padding.kernel_heads, kernel_qlen=kernel_qlen, num_kernel_rows=rows
        )
        if ws.schedule is not None:
            setup.provider.plan_decode_schedule(
                PlanDecodeScheduleCall(
                    schedule=ws.schedule,
                    qo_indptr=qo_indptr,
                    kv_indptr=kv_indptr,
                    batch_size=num_requests,
                    kernel_qlen=kernel_qlen,
                    uniform_qlen=uniform_rows,
                )
            )
        table = None if self.needs_token_ids(setup) else batch.block_table
        plan = self._last_plan
        if (
            plan is not None
            and same_view(plan.block_table, table)
            and plan.geometry is geometry
            and plan.kv_indptr is kv_indptr
            and plan.qo_indptr is qo_indptr
            and plan.qlen_padded == qlen_padded
            and plan.source_index is source_index
            and plan.source_keep is source_keep
            and plan.kernel_row is kernel_row
        ):
            return plan
        plan = self._last_plan = _PAGED_PLAN(
            strategy=self.NAME,
            geometry=geometry,
            kv_indptr=kv_indptr,
            kv_indices=self.index_buffers.kv_indices,
            qo_indptr=qo_indptr,
            qlen_padded=qlen_padded,
            source_index=source_index,
            source_keep=source_keep,
            kernel_row=kernel_row,
            schedule=ws.schedule,
            block_table=table,
        )
        return plan

    def capturable_build(self, plan: DecodePlan) -> bool:
        """Without qlen padding the build is device work only (the padding maps are copied
        from the host)."""
        return isinstance(plan, PagedPlan) and not plan.qlen_padded

    def launch(
        self,
        plan: DecodePlan,
        q: torch.Tensor,
        kv_flat: torch.Tensor,
        *,
        kv_scale: torch.Tensor | None,
        out: torch.Tensor,
        lse: torch.Tensor | None,
    ) -> None:
        assert isinstance(plan, PagedPlan)
        setup, ws, geo = self.setup, self.workspace, plan.geometry
        rows = geo.num_kernel_rows
        padding = ws.padding
        direct = (
            not plan.qlen_padded
            and padding.kernel_heads == padding.num_heads
            and q.is_contiguous()
            and out.is_contiguous()
            and (geo.kernel_qlen == 1 or self.PERSISTENT or setup.capabilities.decode_multi_row_stores_masked)
        )
        if direct:
            q_kernel, o_target, lse_target = q, out, lse
        else:
            o_kernel, lse_kernel = ws.o_kernel[: rows + 1], ws.lse_kernel[: rows + 1]
            q_kernel = ws.q_kernel[:rows]
            if plan.qlen_padded and padding.kernel_heads == padding.num_heads:
                torch.index_select(q, 0, plan.source_index, out=q_kernel)
                q_kernel.mul_(plan.source_keep[:, None, None])
            elif plan.qlen_padded:
                padding.pad(q.index_select(0, plan.source_index) * plan.source_keep[:, None, None], q_kernel)
            else:
                padding.pad(q, q_kernel)
            if geo.kernel_qlen > 1 and not self.PERSISTENT:
                o_kernel.zero_()  # vLLM's guard: unwritten lanes of a multi-row tile cannot leak
            o_target, lse_target = o_kernel[:rows], None if lse is None else lse_kernel[:rows]
        setup.provider.paged_mqa_decode(
            PagedDecodeCall(
                q=q_kernel,
                kv_cache=kv_flat,
                kv_indptr=plan.kv_indptr,
                kv_indices=None if plan.block_table is not None else plan.kv_indices,
                qo_indptr=plan.qo_indptr,
                out=o_target,
                lse=lse_target,
                max_qlen=geo.kernel_qlen,
                max_seqlen_k=geo.max_seqlen_k,
                page_size=setup.cache.block_size,
                softmax_scale=setup.dims.scale,
                kv_scale=kv_scale,
                schedule=plan.schedule,
                block_table=plan.block_table,
            )
        )
        owned = geo.num_owned_tokens
        if direct:
            if owned < geo.num_tokens:  # graph-padding rows
                out[owned:].zero_()
                if lse is not None:
                    lse[owned:].fill_(float("-inf"))
            return
        # The sink row: caller rows no request owns read zeros and -inf.
        o_kernel[rows].zero_()
        if plan.qlen_padded:
            out.copy_(padding.unpad(o_kernel)[plan.kernel_row])
            if lse is not None:
                lse_kernel[rows].fill_(float("-inf"))
                lse.copy_(padding.unpad(lse_kernel)[plan.kernel_row])
            return
        out[:owned].copy_(padding.unpad(o_kernel[:owned]))
        out[owned:].zero_()
        if lse is not None:
            lse[:owned].copy_(padding.unpad(lse_kernel[:owned]))
            lse[owned:].fill_(float("-inf"))
