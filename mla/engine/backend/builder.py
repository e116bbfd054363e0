"""The metadata builder: plans one engine step (each phase resolved once) and splits a prefill's
cached context into workspace-sized chunks."""

from __future__ import annotations

import torch

from mla.core.config import GraphMode
from mla.core.context import DecodeContext, PrefillContext
from mla.core.records import fast_constructor
from mla.core.step_rules import used_cache_blocks
from mla.decode.base import DecodeBatch, DecodePlan, DecodeStrategy
from mla.engine.backend.state import BackendState
from mla.engine.backend.step import MLAMetadata, StepInputs, VarlenStep
from mla.engine.backend.step_check import CheckedStep, StepChecker, StepRules
from mla.engine.decision.resolver import Decision
from mla.prefill.base import ContextChunk, PrefillBatch, PrefillPlan, PrefillStrategy
from mla.providers.transforms import flat_token_ids
from mla.sparse.base import SparseRows, rows_plan

_DECODE_BATCH = fast_constructor(DecodeBatch)
_METADATA = fast_constructor(MLAMetadata)
_PREFILL_BATCH = fast_constructor(PrefillBatch)
"""The build's records (:mod:`mla.core.records`: values the build checked, every field passed)."""


class MetadataBuilder:
    """Turns step inputs into metadata; the only place a step's strategies are decided.

    :meth:`build` checks the step with the backend's :class:`~mla.engine.backend.step_check.StepChecker`
    (``checker``: the engine limits the backend was sized for, its cache and device, its
    ``validate`` mode) and :meth:`plan` plans the checked step without checking it again. With
    the host copies the engine already has (``query_start_loc_cpu``, ``seq_lens_cpu``) a build
    copies nothing from the device (``validate="fast"``). A step beyond the limits raises
    :class:`InvalidInputError` before anything runs outside the buffers allocated at init: a
    step within them never allocates a strategy late.
    """

    def __init__(self, backend: BackendState) -> None:
        self.backend = backend
        self.checker = StepChecker(
            StepRules(
                limits=backend.limits,
                block_size=backend.cache.block_size,
                num_blocks=backend.cache.num_blocks,
                device=backend.device,
                validate=backend.validate,
            )
        )
        self._decode_choices: dict[tuple[int, bool, int], tuple[DecodeContext, Decision, DecodeStrategy]] = {}
        self._prefill_choices: dict[tuple[bool, int], tuple[PrefillContext, Decision, PrefillStrategy]] = {}

    def build(self, step: StepInputs) -> MLAMetadata:
        """Check one step and plan it (:meth:`plan`); the metadata is also the backend's
        current metadata."""
        held = self.backend.hold("builder.build")
        try:
            return self.plan(self.checker.check(step))
        finally:
            if held:
                self.backend.in_use.release()

    def plan(self, step: CheckedStep) -> MLAMetadata:
        """Plan a checked step and make it the backend's current metadata (also returned).

        A decode-only step costs a few Python lines, one page-index fill on the device (one
        kernel on the Triton provider) and the strategy's own planning, and (per decode shape)
        one cached resolution. ``step`` comes from the backend's ``checker`` (or, for a step the
        engine derived from a checked one, :func:`~mla.engine.backend.step_check.derived_step`).
        """
        be = self.backend
        held = be.hold("builder.plan")
        try:
            metadata = self._build_sparse(step) if be.dims.is_sparse else self._build_dense(step)
            be.current_metadata = metadata
            return metadata
        finally:
            if held:
                be.in_use.release()

    def plan_varlen(self, step: VarlenStep) -> MLAMetadata:
        """Plan a prefill over given keys (the functional ``mla_prefill``'s step, checked by its
        caller: no cached context) and make it the backend's current metadata."""
        be = self.backend
        held = be.hold("builder.plan_varlen")
        try:
            ctx, decision, strategy = self._prefill_choice(has_context=False)
            if step.cu_seqlens_q_cpu is None:
                assert not strategy.PLAN_READS_HOST_INDPTRS, "plan_varlen: this plan needs host indptrs"
            num_requests, num_tokens = step.cu_seqlens_q.numel() - 1, step.num_tokens
            batch = _PREFILL_BATCH(
                context=ctx,
                cu_seqlens_q_cpu=step.cu_seqlens_q_cpu,
                cu_seqlens_k_cpu=step.cu_seqlens_k_cpu,
                cu_seqlens_q=step.cu_seqlens_q,
                cu_seqlens_k=step.cu_seqlens_k,
                max_seqlen_q=step.max_seqlen_q,
                max_seqlen_k=step.max_seqlen_k,
                num_tokens=num_tokens,
                num_kv_tokens=step.num_kv_tokens,
                causal=step.causal,
                context_chunks=(),
                cache_blocks=0,
                launch_checked=step.launch_checked,
            )
            metadata = _METADATA(
                num_decodes=0,
                num_decode_tokens=0,
                num_prefills=num_requests,
                num_prefill_tokens=num_tokens,
                decode=None,
                prefill=strategy.build_metadata(batch),
                decode_decision=None,
                prefill_decision=decision,
                sparse_decode=None,
                sparse_prefill=None,
                index=None,
            )
            be.current_metadata = metadata
            return metadata
        finally:
            if held:
                be.in_use.release()

    def _build_dense(self, step: CheckedStep) -> MLAMetadata:
        nd, num_requests = step.num_decodes, step.num_requests
        decode_plan = prefill_plan = None
        decode_decision = prefill_decision = None
        if nd:
            decode_decision, decode_plan = self._build_decode(step)
        if nd < num_requests:
            prefill_decision, prefill_plan = self._build_prefill(step)
        return _METADATA(
            num_decodes=nd,
            num_decode_tokens=step.num_decode_tokens,
            num_prefills=num_requests - nd,
            num_prefill_tokens=step.num_prefill_tokens,
            decode=decode_plan,
            prefill=prefill_plan,
            decode_decision=decode_decision,
            prefill_decision=prefill_decision,
            sparse_decode=None,
            sparse_prefill=None,
            index=None,
        )

    def _build_sparse(self, step: CheckedStep) -> MLAMetadata:
        """A sparse model's checked step: the row map of all rows on the device, one plan per
        phase over its rows, and the indexer's plan over all of them."""
        be = self.backend
        buffers, indexer = be.sparse_buffers, be.indexer
        assert buffers is not None
        assert indexer is not None
        inputs, qsl, lengths = step.inputs, step.query_start_loc, step.lengths
        nd, num_decode_tokens, num_requests = step.num_decodes, step.num_decode_tokens, step.num_requests
        prefill_rows = step.num_prefill_tokens
        num_rows = num_decode_tokens + prefill_rows
        # The buffers hold max(max_num_batched_tokens, max_decode_tokens) rows: the checker's limits.
        assert num_rows <= buffers.max_rows
        table = inputs.block_table
        max_keys = min(table.shape[1] * be.cache.block_size, be.limits.max_model_len)
        lens = lengths.seq_lens
        if lens and be.limits.graph_mode is GraphMode.NONE:
            max_keys = max(1, min(max_keys, max(lens)))
        buffers.map_rows(inputs.query_start_loc, inputs.seq_lens, num_rows=num_rows, max_keys=max_keys)
        decode_plan = prefill_plan = None
        decode_decision = prefill_decision = None
        if nd:
            decode_lengths = lengths if nd == num_requests else lengths.first(nd)
            max_qlen = max(1, decode_lengths.max_query)
            ctx: DecodeContext | PrefillContext = be.decode_context(
                max_qlen=max_qlen, uniform_qlen=decode_lengths.min_query == max_qlen
            )
            decode_decision = be.resolver.resolve(ctx, force=be.force_decode)
            decode_plan = be.sparse_strategy(decode_decision).build_metadata(
                SparseRows(table, 0, num_decode_tokens, max_keys)
            )
        if prefill_rows:
            assert lens is not None
            has_context = any(lens[b] > qsl[b + 1] - qsl[b] for b in range(nd, num_requests))
            ctx = be.prefill_context(has_chunked_context=has_context)
            prefill_decision = be.resolver.resolve(ctx, force=be.force_prefill)
            prefill_plan = be.sparse_strategy(prefill_decision).build_metadata(
                SparseRows(table, num_decode_tokens, prefill_rows, max_keys)
            )
        index_plan = rows_plan(indexer.NAME, be.setup, buffers, SparseRows(table, 0, num_rows, max_keys))
        return _METADATA(
            num_decodes=nd,
            num_decode_tokens=num_decode_tokens,
            num_prefills=num_requests - nd,
            num_prefill_tokens=prefill_rows,
            decode=None,
            prefill=None,
            decode_decision=decode_decision,
            prefill_decision=prefill_decision,
            sparse_decode=decode_plan,
            sparse_prefill=prefill_plan,
            index=index_plan,
        )

    def _decode_choice(self, max_qlen: int, uniform: bool) -> tuple[DecodeContext, Decision, DecodeStrategy]:
        """The context, decision and strategy instance of a decode shape (resolved once per
        shape and registry version)."""
        be = self.backend
        key = (max_qlen, uniform, be.resolver.registry.version)
        choice = self._decode_choices.get(key)
        if choice is None:
            ctx = be.decode_context(max_qlen=max_qlen, uniform_qlen=uniform)
            decision = be.resolver.resolve(ctx, force=be.force_decode)
            choice = self._decode_choices[key] = (ctx, decision, be.decode_strategy(decision))
        return choice

    def varlen_strategy(self) -> PrefillStrategy:
        """The strategy :meth:`plan_varlen` plans with (resolved once per registry version)."""
        return self._prefill_choice(has_context=False)[2]

    def _prefill_choice(self, *, has_context: bool) -> tuple[PrefillContext, Decision, PrefillStrategy]:
        """The context, decision and strategy instance of a prefill (resolved once per
        chunked-context presence and registry version)."""
        be = self.backend
        key = (has_context, be.resolver.registry.version)
        choice = self._prefill_choices.get(key)
        if choice is None:
            ctx = be.prefill_context(has_chunked_context=has_context)
            decision = be.resolver.resolve(ctx, force=be.force_prefill)
            choice = self._prefill_choices[key] = (ctx, decision, be.prefill_strategy(decision))
        return choice

    def _build_decode(self, step: CheckedStep) -> tuple[Decision, DecodePlan]:
        """The decode part of a checked step (its first ``num_decodes`` requests and
        ``num_decode_tokens`` rows) planned by the strategy of its shape."""
        inputs, nd = step.inputs, step.num_decodes
        whole = nd == step.num_requests
        qsl = step.query_start_loc if whole else step.query_start_loc[: nd + 1]
        lengths = step.lengths if whole else step.lengths.first(nd)
        lens = lengths.seq_lens
        max_qlen = max(1, lengths.max_query)
        if lengths.min_query == max_qlen:
            uniform = True
        elif lens is None:
            # Without host lengths the graph-padding requests cannot be told apart.
            uniform = False
        else:
            uniform = all(
                q == max_qlen if length > 0 else q in (0, max_qlen)
                for q, length in zip(lengths.query_lens, lens, strict=True)
            )
        ctx, decision, strategy = self._decode_choice(max_qlen, uniform)
        qsl_host, seq_host = inputs.query_start_loc_cpu, inputs.seq_lens_cpu
        if lens is not None and seq_host is None:
            seq_host = torch.tensor(lens, dtype=torch.int64)
        table, qsl_dev, seq_dev = inputs.block_table, inputs.query_start_loc, inputs.seq_lens
        if not whole:
            qsl_host, qsl_dev, seq_dev = qsl_host[: nd + 1], qsl_dev[: nd + 1], seq_dev[:nd]
            seq_host = None if seq_host is None else seq_host[:nd]
        if table.shape[0] != nd:
            table = table[:nd]
        cache_blocks = 0
        if step.block_table_cpu is not None and lens is not None:
            cache_blocks = used_cache_blocks(
                step.block_table_cpu[:nd], torch.tensor(lens), self.backend.cache.block_size
            )
        batch = _DECODE_BATCH(
            context=ctx,
            query_start_loc_cpu=qsl_host,
            seq_lens_cpu=seq_host,
            query_start_loc=qsl_dev,
            seq_lens=seq_dev,
            block_table=table,
            num_tokens=step.num_decode_tokens,
            cache_blocks=cache_blocks,
            query_start_loc_list=qsl,
            lengths=lengths,
        )
        return decision, strategy.build_metadata(batch)

    def _build_prefill(self, step: CheckedStep) -> tuple[Decision, PrefillPlan]:
        """The prefill part of a checked step (its requests after the decodes)."""
        be, nd = self.backend, step.num_decodes
        assert step.lengths.seq_lens is not None  # the checker reads them for a step with prefills
        qsl = step.query_start_loc
        cu_q_cpu = torch.tensor([t - qsl[nd] for t in qsl[nd:]], dtype=torch.int32)
        qlens = torch.tensor(step.lengths.query_lens[nd:], dtype=torch.int64)
        context_lens = torch.tensor(step.lengths.seq_lens[nd:], dtype=torch.int64) - qlens
        has_context = bool((context_lens > 0).any())
        ctx, decision, strategy = self._prefill_choice(has_context=has_context)
        cu_q = _to_device(cu_q_cpu, be.device)
        table = step.inputs.block_table[nd:]
        chunks = self._context_chunks(context_lens, table) if has_context else ()
        max_q = int(qlens.max()) if qlens.numel() else 0
        table_cpu = step.block_table_cpu
        bs = be.cache.block_size
        batch = PrefillBatch(
            context=ctx,
            cu_seqlens_q_cpu=cu_q_cpu,
            cu_seqlens_k_cpu=cu_q_cpu,
            cu_seqlens_q=cu_q,
            cu_seqlens_k=cu_q,
            max_seqlen_q=max_q,
            max_seqlen_k=max_q,
            num_tokens=step.num_prefill_tokens,
            num_kv_tokens=step.num_prefill_tokens,
            causal=True,
            context_chunks=chunks,
            cache_blocks=(0 if table_cpu is None else used_cache_blocks(table_cpu[nd:], context_lens, bs)),
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
            token_ids = flat_token_ids(blocks, position, bs, be.cache.num_blocks)
            # Context tokens outside the cache are masked by expand_context and counted here.
            be.invalid_count.add_((token_ids < 0).sum().to(torch.int32).reshape(1))
            chunks.append(
                ContextChunk(
                    token_indices=token_ids.to(torch.int32),
                    cu_seqlens_k=_to_device(cu.to(torch.int32), be.device),
                    max_seqlen_k=int(counts.max()),
                    num_tokens=total,
                )
            )
        return tuple(chunks)


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without a blocking copy (the source is a fresh temporary)."""
    return host.to(device, non_blocking=True)
