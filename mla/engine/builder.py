"""The metadata builder: plans one engine step (each phase resolved once) and splits a prefill's
cached context into workspace-sized chunks."""

from __future__ import annotations

import torch

from mla.core.errors import InvalidInputError
from mla.core.validate import check_indptr, require_index, require_int, used_cache_blocks
from mla.decode.base import DecodeBatch, DecodePlan
from mla.engine.checks import check_paged_step, require_instance
from mla.engine.resolver import Decision
from mla.engine.state import BackendState
from mla.engine.step import MLAMetadata, StepInputs
from mla.prefill.base import ContextChunk, PrefillBatch, PrefillPlan


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

    def build(self, step: StepInputs) -> MLAMetadata:
        """Plan one step and make it the backend's current metadata (also returned)."""
        be = self.backend
        full = be.validate == "full"
        require_instance("step", step, StepInputs)
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
            table_cpu = check_paged_step(
                query_start_loc_cpu=qsl_cpu,
                seq_lens_cpu=seq_cpu,
                block_table=block_table,
                block_size=be.cache.block_size,
                num_blocks=be.cache.num_blocks or (1 << 62),
                max_model_len=be.limits.max_model_len,
                block_ids=full,
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


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without a blocking copy (the source is a fresh temporary)."""
    return host.to(device, non_blocking=True)
