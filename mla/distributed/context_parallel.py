"""``DecodeContextParallel``: build and run one rank's share of a step over a token-sharded cache.

See :mod:`mla.distributed` for the layout and the combine.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import torch
import torch.distributed as dist

from mla.core.config import EngineLimits, KVCacheSpec, MLADims
from mla.core.errors import InvalidInputError
from mla.core.validate import require_tensor
from mla.distributed.combine import all_gather_into, combine_decode_states
from mla.distributed.layout import DCPLayout
from mla.distributed.step import ContextGather, DCPMetadata, compare_fingerprints, fingerprint_of
from mla.engine.backend import MLABackend, MLAMetadata, StepInputs
from mla.engine.backend.step_check import StepChecker, StepRules, derived_step
from mla.prefill.base import ContextExpander


class DecodeContextParallel:
    """Decode over a KV cache sharded by token across a ``torch.distributed`` group.

    Built once per rank with the rank's own head geometry (``dims.num_heads`` = heads this rank
    serves), the cache spec of the rank's local cache and the engine's global limits. It owns two
    :class:`~mla.engine.backend.MLABackend`: one decodes this rank's shard (``num_heads * W`` heads when
    ``split_heads``; one qlen-1 request per decode row, up to ``max_num_seqs * max_decode_qlen``;
    keys up to the largest local share of ``max_model_len``), one prefills over the gathered
    context. ``backend_options`` (``model_dtype``, ``provider``, ``platform``, ``device``,
    ``resolver``) go to both, ``decode_strategy`` to the first, ``prefill_strategy`` and
    ``context_chunk_tokens`` to the second.

    ``split_heads``: the group's ranks are tensor-parallel ranks, each holding its own
    ``num_heads`` (rank ``r`` heads ``r*H .. r*H+H-1`` of the group): q is all-gathered over
    heads and outputs are reduce-scattered back. Otherwise every rank holds the same heads and
    outputs are all-reduced.

    The engine's step (:class:`~mla.engine.backend.StepInputs`) keeps global ``seq_lens`` and positions;
    its ``block_table`` holds the block ids of the sharded caches (the same on every rank).
    """

    def __init__(
        self,
        dims: MLADims,
        cache: KVCacheSpec,
        limits: EngineLimits,
        *,
        group: Any = None,
        interleave: int = 1,
        split_heads: bool = True,
        check_steps: bool = True,
        **backend_options: Any,
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise InvalidInputError(
                "group", "torch.distributed is not initialized: call init_process_group first"
            )
        self.group = group
        self.layout = DCPLayout(dist.get_world_size(group), dist.get_rank(group), interleave)
        self.dims, self.cache, self.limits = dims, cache, limits
        self.split_heads = split_heads
        self.check_steps = check_steps
        """Compare the ranks' step fingerprints in each build (:meth:`check_same_step`)."""
        world = self.layout.world_size
        decode_heads = dims.num_heads * world if split_heads else dims.num_heads
        local_len = self.layout.max_local_length(limits.max_model_len)
        rows = limits.max_decode_tokens
        prefill_only = {"context_chunk_tokens", "prefill_strategy"}
        decode_options = {k: v for k, v in backend_options.items() if k not in prefill_only}
        prefill_options = {k: v for k, v in backend_options.items() if k != "decode_strategy"}
        self.decode_backend = MLABackend(
            attrs.evolve(dims, num_heads=decode_heads),
            cache,
            EngineLimits(
                max_num_seqs=rows,
                max_model_len=local_len,
                max_num_batched_tokens=max(rows, limits.max_num_batched_tokens),
                max_decode_qlen=1,
                graph_mode=limits.graph_mode,
            ),
            **decode_options,
        )
        self.prefill_backend = MLABackend(
            dims,
            KVCacheSpec(cache.block_size, cache.dtype),
            attrs.evolve(limits, max_decode_qlen=1),
            **prefill_options,
        )
        self.device = self.decode_backend.device
        self.model_dtype = self.decode_backend.model_dtype
        self.local_blocks = -(-local_len // cache.block_size)
        self.checker = StepChecker(
            StepRules(
                limits=limits,
                block_size=cache.block_size,
                num_blocks=cache.num_blocks,
                device=self.device,
                validate=self.decode_backend.validate,
                table_lengths=self._largest_shares,
                host_seq_lens=True,
            )
        )
        """Checks each global step (the engine's step rules; see :meth:`build`)."""
        dev = self.device
        # Persistent step buffers: a captured decode reads these addresses on every replay.
        # A step has at most max_num_batched_tokens rows, or max_decode_tokens with graph padding.
        slots = max(limits.max_num_batched_tokens, limits.max_decode_tokens)
        self._slot_mapping = torch.full((slots,), -1, dtype=torch.int64, device=dev)
        self._qsl = torch.arange(rows + 1, dtype=torch.int32, device=dev)
        self._seq_lens = torch.zeros(rows, dtype=torch.int32, device=dev)
        self._block_table = torch.zeros(rows, self.local_blocks, dtype=torch.int32, device=dev)

    def __repr__(self) -> str:
        lay = self.layout
        return (
            f"DecodeContextParallel(rank={lay.rank}/{lay.world_size}, interleave={lay.interleave}, "
            f"split_heads={self.split_heads}, decode={self.decode_backend!r})"
        )

    # -- build (host side, once per step) -----------------------------------------------------

    def build(self, step: StepInputs) -> DCPMetadata:
        """Derive this rank's local step from the engine's global one and plan it.

        The ranks first compare their steps' fingerprints (:meth:`check_same_step`), then the
        global step is checked once by :attr:`checker` (the engine's step rules against the
        global limits; the block table must hold the largest share one rank keeps of each
        request). Host work on ``query_start_loc_cpu`` and ``seq_lens_cpu`` (``seq_lens`` is
        copied from the device when the host copy is missing); block ids are read on the
        device, and checked on the host only with ``validate="full"``. Every rank runs the same
        checks on the same global values, so a bad step raises
        :class:`~mla.core.errors.InvalidInputError` on every rank. The local steps derived from
        the checked one are planned by the two backends without checking them again.
        """
        fingerprint = fingerprint_of(step)
        self.check_same_step(fingerprint)
        checked = self.checker.check(step)
        nd, num_requests = checked.num_decodes, checked.num_requests
        if self.dims.is_sparse and num_requests > nd:
            raise InvalidInputError(
                "num_decodes",
                f"the step has {num_requests - nd} prefill request(s); decode context parallelism "
                "serves a sparse model (index_topk) in decode steps only (decode and verify rows): "
                "its prefill gathers the context from every rank and attends it in the MHA form, "
                "while each rank's sparse rows select over the rank's own shard; run sparse "
                "prefills on an MLABackend without DCP",
            )
        assert checked.lengths.seq_lens is not None  # the rules read them on the host
        qsl = torch.tensor(checked.query_start_loc, dtype=torch.int64)
        seq = torch.tensor(checked.lengths.seq_lens, dtype=torch.int64)
        owned_decode = checked.owned_decode_tokens
        total = checked.num_decode_tokens + checked.num_prefill_tokens
        lay = self.layout
        qlens = qsl[1:] - qsl[:-1]
        row_req = torch.repeat_interleave(torch.arange(num_requests), qlens)
        row_pos = seq[row_req] - qlens[row_req] + torch.arange(int(qsl[-1])) - qsl[row_req]
        real = seq[row_req] > 0
        slot_mapping = self._fill_slot_mapping(step.block_table, row_req, row_pos, real, total)
        decode = None
        row_local = torch.zeros(0, dtype=torch.int64)
        if nd:
            row_local = torch.where(real[:owned_decode], lay.local_length(row_pos[:owned_decode] + 1), 0)
            decode = self._build_decode(step, row_req[:owned_decode], row_local)
        prefill = context = None
        if num_requests > nd:
            prefill, context = self._build_prefill(step, qsl, seq, nd)
        return DCPMetadata(
            num_decodes=nd,
            num_decode_tokens=checked.num_decode_tokens,
            num_prefills=num_requests - nd,
            num_prefill_tokens=checked.num_prefill_tokens,
            slot_mapping=slot_mapping,
            local_seq_lens_cpu=row_local,
            decode=decode,
            prefill=prefill,
            context=context,
            fingerprint=fingerprint,
        )

    def _largest_shares(self, seq_lens: list[int]) -> list[int]:
        """Keys of each request the block table must hold: the largest share of one rank."""
        shares: list[int] = self.layout.local_length(torch.tensor(seq_lens, dtype=torch.int64), 0).tolist()
        return shares

    def check_same_step(self, fingerprint: tuple[int, ...]) -> None:
        """Every rank of the group is building the same step (:func:`~mla.distributed.step.
        compare_fingerprints`; :class:`StepMismatchError` on every rank otherwise). Collective
        over the group (:meth:`build` runs it first, before any check that could fail on one
        rank only); skipped with ``check_steps=False`` and with one rank."""
        if self.check_steps and self.layout.world_size > 1:
            compare_fingerprints(fingerprint, self.layout, self.group, self.device)

    def _slots(self, block_table: torch.Tensor, requests: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """Cache slots of local positions ``local`` of ``requests`` (host int64 -> device int64)."""
        bs = self.cache.block_size
        req = requests.to(self.device)
        pos = local.to(self.device)
        return block_table[req, pos // bs].to(torch.int64) * bs + pos % bs

    def _fill_slot_mapping(
        self,
        block_table: torch.Tensor,
        row_req: torch.Tensor,
        row_pos: torch.Tensor,
        real: torch.Tensor,
        total: int,
    ) -> torch.Tensor:
        lay = self.layout
        mine = real & (lay.owner(row_pos) == lay.rank)
        rows = torch.nonzero(mine).flatten()
        out = self._slot_mapping[:total]
        out.fill_(-1)
        if rows.numel():
            slots = self._slots(block_table, row_req[rows], lay.local_position(row_pos[rows]))
            out[rows.to(self.device)] = slots
        return out

    def _build_decode(self, step: StepInputs, row_req: torch.Tensor, row_local: torch.Tensor) -> MLAMetadata:
        rows = row_req.numel()
        width = min(step.block_table.shape[1], self.local_blocks)
        self._seq_lens[:rows].copy_(row_local.to(torch.int32), non_blocking=True)
        self._block_table[:rows, :width].copy_(step.block_table[row_req.to(self.device), :width])
        qsl = list(range(rows + 1))
        local = StepInputs(
            query_start_loc_cpu=torch.tensor(qsl, dtype=torch.int64),
            query_start_loc=self._qsl[: rows + 1],
            seq_lens=self._seq_lens[:rows],
            seq_lens_cpu=row_local,
            block_table=self._block_table[:rows, :width],
            num_decodes=rows,
            num_decode_tokens=step.num_decode_tokens,
        )
        return self.decode_backend.builder.plan(derived_step(local, qsl, row_local.tolist()))

    def _build_prefill(
        self, step: StepInputs, qsl: torch.Tensor, seq: torch.Tensor, nd: int
    ) -> tuple[MLAMetadata, ContextGather | None]:
        lay, bs, dev = self.layout, self.cache.block_size, self.device
        qlens = (qsl[nd + 1 :] - qsl[nd:-1]).to(torch.int64)
        lens = seq[nd:]
        context = lens - qlens  # >= 0: the checker checked each prefill's seq_len covers its query
        # Each prefill request gets contiguous workspace blocks covering its whole sequence.
        blocks = (lens + bs - 1) // bs
        base = torch.cumsum(blocks, 0) - blocks
        width = max(1, int(blocks.max()))
        cols = torch.arange(width)[None, :]
        table = torch.where(cols < blocks[:, None], base[:, None] + cols, 0).to(torch.int32)
        cu = (qsl[nd:] - qsl[nd]).to(torch.int32)
        local = StepInputs(
            query_start_loc_cpu=cu,
            query_start_loc=cu.to(dev),
            seq_lens=lens.to(torch.int32).to(dev),
            seq_lens_cpu=lens,
            block_table=table.to(dev),
            num_decodes=0,
            num_decode_tokens=0,
        )
        prefill = self.prefill_backend.builder.plan(derived_step(local, cu.tolist(), lens.tolist()))
        total = int(context.sum())
        if total == 0:
            return prefill, None
        world = lay.world_size
        shares = torch.stack([lay.local_length(context, r) for r in range(world)], dim=1)  # [P, W]
        offsets = torch.cumsum(shares, 0) - shares
        largest = int(shares.sum(0).max())
        mine = shares[:, lay.rank]
        send_req = torch.repeat_interleave(torch.arange(mine.numel()), mine)
        send_pos = torch.arange(int(mine.sum())) - (torch.cumsum(mine, 0) - mine)[send_req]
        send = torch.zeros(largest, dtype=torch.int64, device=dev)
        if send_req.numel():
            slots = self._slots(step.block_table, send_req + nd, send_pos)
            send[: slots.numel()] = slots
            send[slots.numel() :] = slots[0]
        ctx_req = torch.repeat_interleave(torch.arange(context.numel()), context)
        ctx_pos = torch.arange(total) - (torch.cumsum(context, 0) - context)[ctx_req]
        owner = lay.owner(ctx_pos)
        source = owner * largest + offsets[ctx_req, owner] + lay.local_position(ctx_pos)
        target = base[ctx_req] * bs + ctx_pos
        workspace = torch.empty(
            int(blocks.sum()), bs, self.dims.latent_dim, dtype=self.cache.dtype, device=dev
        )
        return prefill, ContextGather(send, source.to(dev), target.to(dev), workspace)

    # -- run (device side) --------------------------------------------------------------------

    def write_kv(
        self,
        metadata: DCPMetadata,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        *,
        kv_scale: float | torch.Tensor | None = None,
    ) -> None:
        """Write the step's new latent rows ``kv_c [T, L]``, ``k_pe [T, R]`` that this rank owns
        into its cache (``T`` = the step's rows, decode rows first)."""
        rows = metadata.slot_mapping.numel()
        require_tensor("kv_c", kv_c, ndim=2)
        if kv_c.shape[0] != rows or k_pe.shape[0] != rows:
            raise InvalidInputError(
                "kv_c", f"expected {rows} rows (the step's tokens), got {kv_c.shape[0]} and {k_pe.shape[0]}"
            )
        self.decode_backend.impl.write_kv(kv_c, k_pe, kv_cache, metadata.slot_mapping, kv_scale=kv_scale)

    def forward_decode(
        self,
        metadata: DCPMetadata,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        *,
        out: torch.Tensor,
        lse: torch.Tensor | None = None,
        kv_scale: float | torch.Tensor | None = None,
    ) -> None:
        """Decode the step's rows over every rank's shard; collective over the group.

        q ``[num_decode_tokens, H, L+R]`` (this rank's heads) in the model dtype; writes out
        ``[.., H, L]`` and, when given, lse ``[.., H]`` float32: the same values the unsharded
        decode gives. Every rank of the group must call it for the same step.
        """
        impl = self.decode_backend.impl

        def run(q_local: torch.Tensor, part: torch.Tensor, part_lse: torch.Tensor) -> None:
            assert metadata.decode is not None
            impl.forward_decode(metadata.decode, q_local, kv_cache, out=part, lse=part_lse, kv_scale=kv_scale)

        wide = self.decode_backend.capabilities.decode_float32_out
        self._decode_and_combine(metadata, q, out, lse, run, wide=wide)

    def forward_sparse_decode(
        self,
        metadata: DCPMetadata,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        topk_indices: torch.Tensor,
        *,
        out: torch.Tensor,
        lse: torch.Tensor | None = None,
        kv_scale: float | torch.Tensor | None = None,
    ) -> None:
        """Sparse decode (DeepSeek Sparse Attention) of the step's decode and verify rows over
        every rank's shard; collective over the group.

        ``topk_indices`` int ``[num_decode_tokens, K]``: this rank's selection in **local**
        positions of its shard (``-1`` pads), as :meth:`index_topk` writes it. Each rank attends
        its own selection with the LSE and the ranks' states are combined as in
        :meth:`forward_decode`, so the result is sparse attention over the union of the ranks'
        selections (local position ``l`` of rank ``r`` is global position
        ``layout.global_position(l, r)``). q, out and lse as in :meth:`forward_decode`.
        """
        impl = self.decode_backend.impl

        def run(q_local: torch.Tensor, part: torch.Tensor, part_lse: torch.Tensor) -> None:
            assert metadata.decode is not None
            impl.forward_sparse_decode(
                metadata.decode, q_local, kv_cache, topk_indices, out=part, lse=part_lse, kv_scale=kv_scale
            )

        # The sparse kernels write their output in q's dtype.
        self._decode_and_combine(metadata, q, out, lse, run, wide=False)

    def index_topk(
        self,
        metadata: DCPMetadata,
        q: torch.Tensor,
        weights: torch.Tensor,
        index_cache: torch.Tensor,
        *,
        out: torch.Tensor,
    ) -> None:
        """The lightning indexer over this rank's shard of the index-key cache, for the step's
        decode rows (no collective): each row scores the positions of its causal window that
        this rank holds and keeps its best ``index_topk``, written to ``out`` (int32
        ``[num_decode_tokens, index_topk]``) as **local** positions of the shard (``-1`` pads),
        ready for :meth:`forward_sparse_decode`. ``q [T, Hi, D]`` and ``weights [T, Hi]`` are
        the indexer's (every index head; the same on every rank)."""
        decode = self._sparse_decode_plan(metadata)
        self.decode_backend.impl.index_topk(decode, q, weights, index_cache, out=out)

    def write_index_keys(self, metadata: DCPMetadata, keys: torch.Tensor, index_cache: torch.Tensor) -> None:
        """Write the step's index keys ``[T, D]`` that this rank owns into its shard of the
        index-key cache (the same slots as :meth:`write_kv`)."""
        rows = metadata.slot_mapping.numel()
        require_tensor("index_k", keys, ndim=2)
        if keys.shape[0] != rows:
            raise InvalidInputError(
                "index_k", f"expected {rows} rows (the step's tokens), got {keys.shape[0]}"
            )
        self.decode_backend.impl.write_index_keys(keys, index_cache, metadata.slot_mapping)

    def _sparse_decode_plan(self, metadata: DCPMetadata) -> MLAMetadata:
        if not self.dims.is_sparse:
            raise InvalidInputError(
                "metadata", "this group serves a dense model (MLADims.index_topk is None)"
            )
        if metadata.decode is None:
            raise InvalidInputError("metadata", "this step has no decode requests")
        return metadata.decode

    def _decode_and_combine(
        self,
        metadata: DCPMetadata,
        q: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor | None,
        run: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None],
        *,
        wide: bool,
    ) -> None:
        """Check q/out, gather q over heads (``split_heads``), ``run(q_local, part, part_lse)``
        on this rank's shard, and combine the ranks' partial states into ``out``/``lse``
        (``wide``: ``run`` writes float32 partials, so the combine rounds once)."""
        if metadata.num_decodes == 0:
            raise InvalidInputError("metadata", "this step has no decode requests")
        rows, heads, world = metadata.num_decode_tokens, self.dims.num_heads, self.layout.world_size
        require_tensor("q", q, ndim=3)
        require_tensor("out", out, ndim=3)
        if tuple(q.shape[:2]) != (rows, heads):
            raise InvalidInputError("q", f"expected [{rows}, {heads}, L+R], got {tuple(q.shape)}")
        if tuple(out.shape[:2]) != (rows, heads):
            raise InvalidInputError("out", f"expected [{rows}, {heads}, L], got {tuple(out.shape)}")
        if self.split_heads and world > 1:
            gathered = torch.empty((world * rows, *q.shape[1:]), dtype=q.dtype, device=q.device)
            all_gather_into(gathered, q.contiguous(), self.group)
            q_local = gathered.view(world, rows, heads, -1).transpose(0, 1).reshape(rows, world * heads, -1)
        else:
            q_local = q
        local_heads = q_local.shape[1]
        # float32 partials where the provider writes them, so the combine rounds once.
        part_dtype = torch.float32 if wide else out.dtype
        part = torch.empty((rows, local_heads, out.shape[-1]), dtype=part_dtype, device=out.device)
        part_lse = torch.empty((rows, local_heads), dtype=torch.float32, device=out.device)
        if metadata.decode is None:
            part.zero_()
            part_lse.fill_(float("-inf"))
        else:
            run(q_local, part, part_lse)
        combine_decode_states(
            part,
            part_lse,
            group=self.group,
            rank=self.layout.rank,
            world_size=world,
            split_heads=self.split_heads,
            out=out,
            lse=lse,
        )

    def forward_prefill(
        self,
        metadata: DCPMetadata,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        out: torch.Tensor,
        lse: torch.Tensor | None = None,
        kv_cache: torch.Tensor | None = None,
        kv_scale: float | torch.Tensor | None = None,
        expand_context: ContextExpander | None = None,
    ) -> None:
        """Prefill the step's new tokens (MHA form, this rank's heads) over their whole context.

        Collective over the group when the step has cached context: the context rows are
        gathered from every rank's ``kv_cache`` into the plan's workspace first.
        """
        if metadata.prefill is None:
            raise InvalidInputError("metadata", "this step has no prefill requests")
        workspace = None
        gather = metadata.context
        if gather is not None:
            if kv_cache is None:
                raise InvalidInputError("kv_cache", "this step has cached context: pass this rank's kv_cache")
            width = kv_cache.shape[-1]
            local = kv_cache.view(-1, width).view(torch.uint8)
            send = local[gather.send_slots]
            received = torch.empty(
                (self.layout.world_size * send.shape[0], send.shape[1]), dtype=torch.uint8, device=send.device
            )
            all_gather_into(received, send, self.group)
            workspace = gather.workspace
            flat = workspace.view(-1, width).view(torch.uint8)
            flat[gather.target_slots] = received[gather.source_rows]
        self.prefill_backend.impl.forward_prefill(
            metadata.prefill,
            q,
            k,
            v,
            out=out,
            lse=lse,
            kv_cache=workspace,
            kv_scale=kv_scale,
            expand_context=expand_context,
        )
