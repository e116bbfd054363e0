"""Shared machinery of the Gluon-style strategies: per-row keys over the small-head kernel.

A row's keys are a prefix of its request's (the whole request for single-token decode, the
causal window for a verify row). On a provider whose kernels read the block table
(``ProviderCapabilities.decode_reads_block_table``) a row is named by its request and key count
(``row_request``, ``row_indptr``: ``O(rows)``, copied from the host with the other step inputs)
and the kernel reads the request's block-table row; elsewhere each verify row's ids are gathered
into a per-row token list (``row_page_table``) on the device.
"""

from __future__ import annotations

from typing import ClassVar

import attrs
import torch

from mla.core.capabilities import Contract
from mla.core.context import DecodeContext
from mla.core.records import fast_constructor
from mla.core.support import ReasonCollector
from mla.decode.base import DecodeBatch, DecodeIndexBuffers, DecodePlan, DecodeStrategy, same_view
from mla.providers.calls import SmallHeadDecodeCall
from mla.providers.transforms import gather_row_page_table, verify_row_lengths
from mla.strategy import StrategyKind, StrategySetup, require_dtype, require_latent_dims


@attrs.frozen(eq=False)
class SmallHeadPlan(DecodePlan):
    """Rows for the small-head kernel: row ``t`` has ``row_indptr[t+1] - row_indptr[t]`` keys,
    ``page_table[row_indptr[t]:]`` or a prefix of its request's block-table row."""

    row_indptr: torch.Tensor
    """int32 ``[T+1]`` view of a persistent buffer (``kv_indptr`` itself when rows = requests)."""
    page_table: torch.Tensor | None
    """int32 flat token ids (a persistent buffer; ``kv_indices`` itself when rows = requests),
    or ``None``: the kernel reads ``block_table``."""
    block_table: torch.Tensor | None = None
    """The step's block table (the engine's tensor), or ``None`` (``page_table``)."""
    row_request: torch.Tensor | None = None
    """int32 ``[T]`` view: each row's block-table row (verify rows; clamped to a valid row for
    a row no request owns, whose key count is 0), or ``None``: row ``t`` is request ``t``."""


_SMALL_HEAD_PLAN = fast_constructor(SmallHeadPlan)
"""A build's plan record (:mod:`mla.core.records`)."""


@attrs.define
class SmallHeadWorkspace:
    row_indptr: torch.Tensor
    row_request: torch.Tensor
    row_page_table: torch.Tensor | None
    """Verify rows' flat ids, for kernels that take no block table (``None`` otherwise)."""


class SmallHeadDecode(DecodeStrategy):
    """Base of GluonDecode and GluonVerifyFlatten: every token row is a qlen-1 decode over its
    own causal window, built in ``build_metadata``."""

    KIND: ClassVar[StrategyKind] = StrategyKind.SMALL_HEAD
    REQUIRES: ClassVar[frozenset[Contract]] = frozenset({Contract.SMALL_HEAD_DECODE, Contract.EXPAND_PAGES})

    @classmethod
    def needs_token_ids(cls, setup: StrategySetup) -> bool:
        """Only where the provider's kernels take flat per-token ids (aiter's, the gluon
        provider's)."""
        return setup.capabilities.decode_token_ids

    def __init__(self, setup: StrategySetup, index_buffers: DecodeIndexBuffers | None = None) -> None:
        super().__init__(setup, index_buffers)
        rows = self.max_rows(setup)
        # Any decode step may carry up to max_decode_tokens rows (graph padding included);
        # only rows with a non-empty window take page-table space.
        tokens = setup.limits.max_decode_tokens
        dev = setup.device
        flat = self.needs_token_ids(setup)
        self.workspace = SmallHeadWorkspace(
            row_indptr=torch.zeros(tokens + 1, dtype=torch.int32, device=dev),
            row_request=torch.zeros(tokens, dtype=torch.int32, device=dev),
            row_page_table=(
                torch.zeros(rows * setup.limits.max_model_len, dtype=torch.int32, device=dev)
                if flat
                else None
            ),
        )
        self._last_plan: SmallHeadPlan | None = None
        """The previous one-token-per-request plan (reused while its geometry and views are the same)."""

    @classmethod
    def max_rows(cls, setup: StrategySetup) -> int:
        """Most rows with a non-empty causal window in one step."""
        return setup.limits.max_decode_tokens

    @classmethod
    def check(cls, ctx: DecodeContext, reasons: ReasonCollector) -> None:
        caps = ctx.capabilities
        limit = caps.small_head_max_heads
        reasons.require(
            limit is None or ctx.num_heads <= limit,
            "heads",
            f"{ctx.num_heads} heads: the small-head kernel takes at most {limit}",
        )
        kernel = "small-head kernel"
        require_dtype(reasons, "kv-dtype", "kv cache", ctx.kv_dtype, caps.small_head_kv_dtypes, kernel)
        require_dtype(reasons, "q-dtype", "query", ctx.q_dtype, caps.small_head_q_dtypes, kernel)
        require_latent_dims(ctx, reasons, kernel)

    def build_metadata(self, batch: DecodeBatch) -> SmallHeadPlan:
        """Fill the page indices (and, for multi-token requests, each row's window) for
        ``batch``; a one-token-per-request plan record is the previous build's when nothing it
        holds changed (its buffers now hold this step's values)."""
        setup = self.setup
        kv_indptr = self.index_buffers.fill_indptr(setup, batch)
        num_tokens = batch.num_tokens
        geometry = self.base_geometry(
            batch, kernel_heads=batch.context.num_heads, kernel_qlen=1, num_kernel_rows=num_tokens
        )
        lengths = batch.lengths
        kv_indices = self.index_buffers.kv_indices
        flat = self.needs_token_ids(setup)
        table = None if flat else batch.block_table
        if num_tokens == batch.num_requests and lengths.min_query == 1 == lengths.max_query:
            # One token per request: each row's window is its whole request, kv_indices (or the
            # block table) as is.
            plan = self._last_plan
            if (
                plan is None
                or plan.geometry is not geometry
                or plan.kv_indptr is not kv_indptr
                or not same_view(plan.block_table, table)
            ):
                plan = self._last_plan = _SMALL_HEAD_PLAN(
                    strategy=self.NAME,
                    geometry=geometry,
                    kv_indptr=kv_indptr,
                    kv_indices=kv_indices,
                    row_indptr=kv_indptr,
                    page_table=kv_indices if flat else None,
                    block_table=table,
                    row_request=None,
                )
            return plan
        request, window = verify_row_lengths(batch.query_start_loc_cpu, batch.host_seq_lens(), num_tokens)
        # A row reads at most its request's block-table row (the fill's bound on the indptr).
        window = window.clamp_(max=self.index_buffers.kv_bound(setup, batch))
        indptr_cpu = torch.zeros(num_tokens + 1, dtype=torch.int32)
        indptr_cpu[1:] = torch.cumsum(window, 0)
        ws = self.workspace
        row_indptr = ws.row_indptr[: num_tokens + 1]
        row_indptr.copy_(indptr_cpu, non_blocking=True)
        row_request = ws.row_request[:num_tokens]
        if not flat:
            # The row map is all a block-table kernel needs: no per-row token list, no gather.
            # A row no request owns (key count 0) names request 0, which it never reads.
            row_request.copy_(request.clamp(min=0).to(torch.int32), non_blocking=True)
            return SmallHeadPlan(
                self.NAME, geometry, kv_indptr, kv_indices, row_indptr=row_indptr, page_table=None,
                block_table=table, row_request=row_request,
            )  # fmt: skip
        assert kv_indices is not None
        assert ws.row_page_table is not None
        row_request.copy_(request.to(torch.int32), non_blocking=True)
        gather_row_page_table(
            kv_indices,
            kv_indptr,
            row_request.to(torch.int64),
            row_indptr.to(torch.int64),
            total=int(indptr_cpu[-1]),
            out=ws.row_page_table,
        )
        return SmallHeadPlan(
            self.NAME, geometry, kv_indptr, kv_indices, row_indptr=row_indptr, page_table=ws.row_page_table,
        )  # fmt: skip

    def capturable_build(self, plan: DecodePlan) -> bool:
        """One token per request: the build is the page-index fill alone (the verify rows'
        windows are planned on the host)."""
        return isinstance(plan, SmallHeadPlan) and plan.row_indptr is plan.kv_indptr

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
        assert isinstance(plan, SmallHeadPlan)
        setup = self.setup
        rank = setup.dims.kv_lora_rank
        setup.provider.small_head_decode(
            SmallHeadDecodeCall(
                q_nope=q[..., :rank],
                q_pe=q[..., rank:],
                kv_cache=kv_flat,
                page_table=plan.page_table,
                block_table=plan.block_table,
                row_request=plan.row_request,
                seq_info=plan.row_indptr,
                out=out,
                lse=lse,
                max_seqlen_k=plan.geometry.max_seqlen_k,
                page_size=setup.cache.block_size,
                softmax_scale=setup.dims.scale,
                kv_scale=kv_scale,
            )
        )
