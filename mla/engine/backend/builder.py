"""The metadata builder: plans one engine step (each phase resolved once) and splits a prefill's
cached context into workspace-sized chunks."""

from __future__ import annotations

import torch
from torch import Tensor

from mla.core.config import GraphMode
from mla.core.context import DecodeContext, PrefillContext
from mla.core.errors import InvalidInputError
from mla.core.records import fast_constructor
from mla.core.validate import (
    INDEX_DTYPES,
    HostLengths,
    check_indptr_values,
    check_paged_request_values,
    require_index,
    require_int,
    used_cache_blocks,
)
from mla.decode.base import DecodeBatch, DecodePlan, DecodeStrategy
from mla.engine.backend.checks import check_paged_step, require_instance
from mla.engine.backend.state import BackendState
from mla.engine.backend.step import MLAMetadata, StepInputs
from mla.engine.decision.resolver import Decision
from mla.prefill.base import ContextChunk, PrefillBatch, PrefillPlan
from mla.providers.transforms import flat_token_ids
from mla.sparse.base import SparseRows, rows_plan

_INDEX = frozenset(INDEX_DTYPES)
_DECODE_BATCH = fast_constructor(DecodeBatch)
_HOST_LENGTHS = fast_constructor(HostLengths)
_METADATA = fast_constructor(MLAMetadata)
"""The build's records (:mod:`mla.core.records`: values the build checked, every field passed)."""


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

    def __init__(self, backend: BackendState) -> None:
        self.backend = backend
        self._decode_choices: dict[tuple[int, bool, int], tuple[DecodeContext, Decision, DecodeStrategy]] = {}
        self._devices: set[torch.device] = set()
        """Devices of the backend's type seen on the step's device tensors."""
        self._uniform_indptrs: dict[int, list[int]] = {}
        """Per qlen ``q``: ``[0, q, 2q, ..., q * max_num_seqs]`` (a uniform step's indptr)."""

    def build(self, step: StepInputs) -> MLAMetadata:
        """Plan one step and make it the backend's current metadata (also returned).

        The host copies are read once each (``.tolist()``) and checked as Python ints; a
        decode-only step then costs a few Python lines, one page-index fill on the device (one
        kernel on the Triton provider) and the strategy's own planning, and (per decode shape)
        one cached resolution.
        """
        be = self.backend
        full = be.validate == "full"
        if type(step) is not StepInputs:
            require_instance("step", step, StepInputs)  # (a subclass passes)
        qsl_host, qsl_dev = step.query_start_loc_cpu, step.query_start_loc
        seq_lens, block_table = step.seq_lens, step.block_table
        seq_host = step.seq_lens_cpu
        num_decodes, num_decode_tokens = step.num_decodes, step.num_decode_tokens
        # The argument checks as one expression over the usual types (an index dtype, the
        # dims, a device of the backend's type); anything else takes the checks one by one,
        # which name the first bad argument.
        ok = self._devices
        if not (
            type(qsl_host) is Tensor
            and type(qsl_dev) is Tensor
            and type(seq_lens) is Tensor
            and type(block_table) is Tensor
            and (
                seq_host is None
                or (type(seq_host) is Tensor and seq_host.dtype in _INDEX and seq_host.dim() == 1)
            )
            and qsl_host.dtype in _INDEX
            and qsl_dev.dtype in _INDEX
            and seq_lens.dtype in _INDEX
            and block_table.dtype in _INDEX
            and qsl_host.dim() == 1
            and qsl_dev.dim() == 1
            and seq_lens.dim() == 1
            and block_table.dim() == 2
            and qsl_dev.device in ok
            and seq_lens.device in ok
            and block_table.device in ok
            and type(num_decodes) is int
            and type(num_decode_tokens) is int
            and num_decodes >= 0
            and num_decode_tokens >= 0
        ):
            num_decodes, num_decode_tokens = self._check_arguments(step)
        qsl: list[int] = qsl_host.tolist()
        lens: list[int] | None = None if seq_host is None else seq_host.tolist()
        lengths = self._host_lengths(qsl, lens)
        if not qsl or qsl[0] != 0 or lengths.min_query < 0:
            check_indptr_values("query_start_loc", qsl)  # raises, naming the bad entry
        num_requests = len(qsl) - 1
        if qsl_dev.numel() != num_requests + 1:
            raise InvalidInputError(
                "query_start_loc",
                f"has {qsl_dev.numel()} entries but query_start_loc_cpu has "
                f"{num_requests + 1}; pass the same indptr on the device and on the host",
            )
        if num_decodes > num_requests:
            raise InvalidInputError("num_decodes", f"must be in [0, {num_requests}], got {num_decodes}")
        limits = be.limits
        if num_requests > limits.max_num_seqs:
            raise InvalidInputError(
                "query_start_loc",
                f"{num_requests} requests exceed max_num_seqs {limits.max_num_seqs}; split the "
                "step or build the backend with a larger EngineLimits.max_num_seqs",
            )
        if seq_lens.numel() != num_requests:
            raise InvalidInputError(
                "seq_lens",
                f"has {seq_lens.numel()} entries but query_start_loc describes {num_requests} requests",
            )
        table_shape = block_table.shape
        if table_shape[0] < num_requests:
            raise InvalidInputError("block_table", f"has {table_shape[0]} rows for {num_requests} requests")
        num_prefills = num_requests - num_decodes
        if full:
            self._cross_check(step, qsl, lens)
        if lens is None and (full or num_prefills):
            lens = seq_lens.tolist()
            lengths = HostLengths.of(lengths.query_lens, lens)
        table_cpu: torch.Tensor | None = None
        block_size = be.cache.block_size
        if full and lens is not None:
            table_cpu = check_paged_step(
                query_lens=lengths.query_lens,
                seq_lens=lens,
                block_table=block_table,
                block_size=block_size,
                num_blocks=be.cache.num_blocks or (1 << 62),
                max_model_len=limits.max_model_len,
                block_ids=True,
                lengths=lengths,
            )
        elif lens is not None:
            check_paged_request_values(
                query_lens=lengths.query_lens,
                seq_lens=lens,
                block_table_shape=table_shape,
                block_size=block_size,
                max_model_len=limits.max_model_len,
                lengths=lengths,
            )
        decode_lengths = lengths if num_decodes == num_requests else lengths.first(num_decodes)
        self._check_limits(decode_lengths, qsl[-1])
        owned_decode_tokens = qsl[num_decodes]
        if num_decode_tokens < owned_decode_tokens or (
            num_prefills and num_decode_tokens != owned_decode_tokens
        ):
            raise InvalidInputError(
                "num_decode_tokens",
                f"got {num_decode_tokens}; the decode requests own {owned_decode_tokens} "
                "tokens (extra graph-padding rows are allowed only in decode-only steps)",
            )
        if num_decode_tokens > limits.max_decode_tokens:
            raise InvalidInputError(
                "num_decode_tokens",
                f"{num_decode_tokens} exceeds max_num_seqs * max_decode_qlen = {limits.max_decode_tokens}",
            )
        if be.dims.is_sparse:
            metadata = self._build_sparse(step, qsl, lengths, num_decodes, num_decode_tokens)
            be.current_metadata = metadata
            return metadata
        decode_plan = prefill_plan = None
        decode_decision = prefill_decision = None
        if num_decodes:
            decode_decision, decode_plan = self._build_decode(
                step, qsl, decode_lengths, table_cpu, num_decodes, num_decode_tokens
            )
        if num_prefills:
            assert lens is not None
            qsl_cpu = torch.tensor(qsl, dtype=torch.int64)
            prefill_decision, prefill_plan = self._build_prefill(
                step, qsl_cpu, torch.tensor(lens, dtype=torch.int64), table_cpu, num_decodes
            )
        metadata = _METADATA(
            num_decodes=num_decodes,
            num_decode_tokens=num_decode_tokens,
            num_prefills=num_prefills,
            num_prefill_tokens=qsl[-1] - owned_decode_tokens,
            decode=decode_plan,
            prefill=prefill_plan,
            decode_decision=decode_decision,
            prefill_decision=prefill_decision,
            sparse_decode=None,
            sparse_prefill=None,
            index=None,
        )
        be.current_metadata = metadata
        return metadata

    def _check_arguments(self, step: StepInputs) -> tuple[int, int]:
        """The argument checks one by one, in order (each raises naming its argument); returns
        ``num_decodes`` and ``num_decode_tokens``. Devices that pass join the fast check's set."""
        be = self.backend
        require_index("query_start_loc_cpu", step.query_start_loc_cpu, ndim=1)
        qsl_dev = require_index("query_start_loc", step.query_start_loc, ndim=1)
        seq_lens = require_index("seq_lens", step.seq_lens, ndim=1)
        block_table = require_index("block_table", step.block_table, ndim=2)
        device_type = be.device.type
        for name, tensor in (
            ("query_start_loc", qsl_dev),
            ("seq_lens", seq_lens),
            ("block_table", block_table),
        ):
            if tensor.device.type != device_type:
                raise InvalidInputError(
                    name, f"is on {tensor.device} but the backend runs on {be.device}; move it there"
                )
            self._devices.add(tensor.device)
        num_decodes = require_int("num_decodes", step.num_decodes, minimum=0)
        num_decode_tokens = require_int("num_decode_tokens", step.num_decode_tokens, minimum=0)
        if step.seq_lens_cpu is not None:
            require_index("seq_lens_cpu", step.seq_lens_cpu, ndim=1)
        return num_decodes, num_decode_tokens

    def _host_lengths(self, qsl: list[int], lens: list[int] | None) -> HostLengths:
        """:meth:`HostLengths.from_indptr`, with the ranges of a uniform indptr (every request
        ``q <= max_decode_qlen`` tokens, the decode steps' usual shape) found by one list
        comparison with the uniform prefix of its qlen instead of a pass per reduction."""
        count = len(qsl) - 1
        limits = self.backend.limits
        if not (0 < count <= limits.max_num_seqs and qsl[0] == 0):
            return HostLengths.from_indptr(qsl, lens)
        qlen, rest = divmod(qsl[-1], count)
        if rest or not 0 < qlen <= limits.max_decode_qlen:
            return HostLengths.from_indptr(qsl, lens)
        uniform = self._uniform_indptrs.get(qlen)
        if uniform is None:
            uniform = list(range(0, qlen * limits.max_num_seqs + 1, qlen))
            self._uniform_indptrs[qlen] = uniform
        if qsl != uniform[: count + 1]:
            return HostLengths.from_indptr(qsl, lens)
        query_lens = [qlen] * (len(qsl) - 1)
        lo = hi = 0
        if lens:
            lo, hi = min(lens), max(lens)
        return _HOST_LENGTHS(
            query_lens=query_lens, seq_lens=lens, min_query=qlen, max_query=qlen, min_seq=lo, max_seq=hi
        )

    def _check_limits(self, decode: HostLengths, total: int) -> None:
        """The step's decode qlens and token count are within the limits the backend was sized
        (and its strategies allocated) for (host rules on ``query_start_loc_cpu``)."""
        limits = self.backend.limits
        if decode.query_lens and decode.max_query > limits.max_decode_qlen:
            b = decode.query_lens.index(decode.max_query)
            raise InvalidInputError(
                "query_start_loc",
                f"decode request {b} has {decode.max_query} query tokens > max_decode_qlen "
                f"{limits.max_decode_qlen}. Decode requests (qlen <= max_decode_qlen: one token, or "
                "a speculative verify) come first in the batch and num_decodes counts them; a "
                "prefill placed before the decodes, a num_decodes that is too large, or more "
                "speculative tokens than EngineLimits.max_decode_qlen allows look like this",
            )
        if total > limits.max_num_batched_tokens:
            raise InvalidInputError(
                "query_start_loc",
                f"the step has {total} query tokens > max_num_batched_tokens "
                f"{limits.max_num_batched_tokens}; split the step or raise the limit",
            )

    def _cross_check(self, step: StepInputs, qsl: list[int], lens: list[int] | None) -> None:
        """``validate="full"``: the device tensors hold what their host copies say (one
        device-to-host copy each)."""
        device_qsl = step.query_start_loc.tolist()
        if device_qsl != qsl:
            raise InvalidInputError(
                "query_start_loc",
                f"the device copy {device_qsl} differs from query_start_loc_cpu "
                f"{qsl}; pass the same indptr on both sides",
            )
        if lens is not None:
            device_lens = step.seq_lens.tolist()
            if device_lens != lens:
                raise InvalidInputError(
                    "seq_lens",
                    f"the device copy {device_lens} differs from seq_lens_cpu "
                    f"{lens}; pass the same lengths on both sides",
                )

    def _build_sparse(
        self, step: StepInputs, qsl: list[int], lengths: HostLengths, nd: int, num_decode_tokens: int
    ) -> MLAMetadata:
        """A sparse model's checked step: the row map of all rows on the device, one plan per
        phase over its rows, and the indexer's plan over all of them."""
        be = self.backend
        buffers, indexer = be.sparse_buffers, be.indexer
        assert buffers is not None
        assert indexer is not None
        prefill_rows = qsl[-1] - qsl[nd]
        num_rows = num_decode_tokens + prefill_rows
        if num_rows > buffers.max_rows:
            raise InvalidInputError(
                "query_start_loc",
                f"the step has {num_rows} rows, more than max_num_batched_tokens "
                f"{be.limits.max_num_batched_tokens}; split the step",
            )
        table = step.block_table
        max_keys = min(table.shape[1] * be.cache.block_size, be.limits.max_model_len)
        lens = lengths.seq_lens
        if lens and be.limits.graph_mode is GraphMode.NONE:
            max_keys = max(1, min(max_keys, max(lens)))
        buffers.map_rows(step.query_start_loc, step.seq_lens, num_rows=num_rows, max_keys=max_keys)
        num_requests = len(qsl) - 1
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
        index_plan = rows_plan(
            indexer.NAME, be.setup, buffers, SparseRows(table, 0, num_rows, max_keys)
        )
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

    def _build_decode(
        self,
        step: StepInputs,
        qsl: list[int],
        lengths: HostLengths,
        table_cpu: torch.Tensor | None,
        nd: int,
        num_tokens: int,
    ) -> tuple[Decision, DecodePlan]:
        """The decode part of a checked step (its first ``nd`` requests, ``num_tokens`` rows;
        ``lengths`` theirs) planned by the strategy
        of its shape."""
        whole = nd == len(qsl) - 1
        if not whole:
            qsl = qsl[: nd + 1]
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
        qsl_host, seq_host = step.query_start_loc_cpu, step.seq_lens_cpu
        if lens is not None and seq_host is None:
            seq_host = torch.tensor(lens, dtype=torch.int64)
        table, qsl_dev, seq_dev = step.block_table, step.query_start_loc, step.seq_lens
        if not whole:
            qsl_host, qsl_dev, seq_dev = qsl_host[: nd + 1], qsl_dev[: nd + 1], seq_dev[:nd]
            seq_host = None if seq_host is None else seq_host[:nd]
        if table.shape[0] != nd:
            table = table[:nd]
        cache_blocks = 0
        if table_cpu is not None and lens is not None:
            cache_blocks = used_cache_blocks(
                table_cpu[:nd], torch.tensor(lens), self.backend.cache.block_size
            )
        batch = _DECODE_BATCH(
            context=ctx,
            query_start_loc_cpu=qsl_host,
            seq_lens_cpu=seq_host,
            query_start_loc=qsl_dev,
            seq_lens=seq_dev,
            block_table=table,
            num_tokens=num_tokens,
            cache_blocks=cache_blocks,
            query_start_loc_list=qsl,
            lengths=lengths,
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
                    token_indices=flat_token_ids(blocks, position, bs, be.cache.num_blocks).to(torch.int32),
                    cu_seqlens_k=_to_device(cu.to(torch.int32), be.device),
                    max_seqlen_k=int(counts.max()),
                    num_tokens=total,
                )
            )
        return tuple(chunks)


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without a blocking copy (the source is a fresh temporary)."""
    return host.to(device, non_blocking=True)
