"""Decode strategy base: the step inputs, the plan geometry and the shared page-index buffers."""

from __future__ import annotations

import abc
from typing import ClassVar

import attrs
import torch

from mla.core.config import GraphMode
from mla.core.context import DecodeContext
from mla.core.errors import InvalidInputError
from mla.core.records import fast_constructor
from mla.core.step_rules import HostLengths
from mla.core.validate import require_no_overlap
from mla.providers.calls import FillPagesCall
from mla.strategy import (
    GraphSupport,
    Phase,
    PlanBase,
    Strategy,
    StrategySetup,
    check_cache,
    check_tensor,
)


def same_view(held: torch.Tensor | None, given: torch.Tensor | None) -> bool:
    """Whether a plan holding ``held`` reads what ``given`` holds: the same tensor, or a view of
    the same memory with the same shape and strides (an engine slices its persistent block
    table anew every step: ``block_table[:num_reqs]``), or both ``None``."""
    if held is given:
        return True
    if held is None or given is None:
        return False
    return (
        held.data_ptr() == given.data_ptr()
        and held.shape == given.shape
        and held.stride() == given.stride()
        and held.dtype == given.dtype
        and held.device == given.device
    )


def _host_values(batch: DecodeBatch) -> list[int]:
    values: list[int] = batch.query_start_loc_cpu.tolist()
    return values


def _host_lengths(batch: DecodeBatch) -> HostLengths:
    lens = None if batch.seq_lens_cpu is None else batch.seq_lens_cpu.tolist()
    return HostLengths.from_indptr(batch.query_start_loc_list, lens)


@attrs.frozen(eq=False)
class DecodeBatch:
    """The decode part of one step, as the builder hands it to ``build_metadata``.

    Requests are ordered as in the engine's batch; rows of q past ``query_start_loc[-1]`` and
    requests with ``seq_len == 0`` are graph padding (their output rows are zero, LSE ``-inf``).
    The host tensors also come as Python ints (``query_start_loc_list``, ``lengths``): the
    builder passes what it checked, and host rules in ``build_metadata`` should use them (a
    torch op on a small host tensor costs more than a reduction over the whole list).
    """

    context: DecodeContext
    query_start_loc_cpu: torch.Tensor
    """int ``[B+1]`` on the host."""
    seq_lens_cpu: torch.Tensor | None
    """int ``[B]`` on the host: KV length including the new tokens. ``None`` when the engine
    passed no host copy: the page indices are then planned on the device by the block table's
    capacity (no copy), and a strategy that needs host lengths calls :meth:`host_seq_lens`."""
    query_start_loc: torch.Tensor
    """int32 ``[B+1]`` on the device."""
    seq_lens: torch.Tensor
    """int32 ``[B]`` on the device."""
    block_table: torch.Tensor
    """int32 ``[B, max_blocks]`` on the device."""
    num_tokens: int
    """Rows of the decode query (``>= query_start_loc[-1]``)."""
    cache_blocks: int = 0
    """Cache blocks the requests' block-table rows read (the largest block id used, plus one)
    when the builder read the block table on the host (``validate="full"``), else 0: ``run``
    refuses a ``kv_cache`` with fewer blocks."""
    query_start_loc_list: list[int] = attrs.field(default=attrs.Factory(_host_values, takes_self=True))
    """``query_start_loc_cpu`` as Python ints (read from the tensor when not given)."""
    lengths: HostLengths = attrs.field(default=attrs.Factory(_host_lengths, takes_self=True))
    """Query lengths and host seq_lens as Python ints with their ranges (computed from the
    host tensors when not given)."""

    @property
    def num_requests(self) -> int:
        return self.seq_lens.numel()

    def host_seq_lens(self) -> torch.Tensor:
        """``seq_lens`` on the host: the engine's copy, else one device-to-host copy."""
        return self.seq_lens_cpu if self.seq_lens_cpu is not None else self.seq_lens.cpu()

    @property
    def max_seq_len(self) -> int | None:
        """The batch's longest KV length when known on the host, else ``None``."""
        lengths = self.lengths
        return lengths.max_seq if lengths.seq_lens else None

    @property
    def num_owned_tokens(self) -> int:
        return self.query_start_loc_list[-1]


@attrs.frozen
class DecodeGeometry:
    """What a decode plan was built for; ``run`` checks its inputs against it."""

    num_heads: int
    kernel_heads: int
    num_requests: int
    num_tokens: int
    num_owned_tokens: int
    max_qlen: int
    kernel_qlen: int
    num_kernel_rows: int
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    max_seqlen_k: int
    """Bound on any request's KV length: the engine's ``max_model_len`` when decode steps are
    captured in CUDA graphs, else the batch's longest sequence (when known on the host)."""
    cache_blocks: int = 0
    """The ``kv_cache`` must have at least this many blocks (:attr:`DecodeBatch.cache_blocks`)."""


_DECODE_GEOMETRY = fast_constructor(DecodeGeometry)
_FILL_PAGES_CALL = fast_constructor(FillPagesCall)
"""The build's records (:mod:`mla.core.records`: values a build computed, every field passed)."""


@attrs.frozen(eq=False)
class DecodePlan(PlanBase):
    """Base decode plan: geometry plus the page indices of the step."""

    geometry: DecodeGeometry
    kv_indptr: torch.Tensor
    """int32 ``[B+1]`` view of the persistent buffer: the requests' key counts."""
    kv_indices: torch.Tensor | None
    """int32 flat token ids: the whole persistent buffer (static size), or ``None`` when no
    strategy of the backend reads the per-token view (:meth:`DecodeStrategy.needs_token_ids`)."""


@attrs.define
class DecodeIndexBuffers:
    """Persistent page-index buffers shared by every decode strategy of a backend."""

    kv_indptr: torch.Tensor
    """int32 ``[max_num_seqs + 1]``."""
    invalid_count: torch.Tensor
    """int32 ``[1]`` device counter: each fill adds the keys it found outside the cache (the
    backend's ``invalid_index_count``)."""
    kv_indices: torch.Tensor | None = None
    """int32 ``[max_num_seqs * max_model_len + 1]`` flat per-token ids, allocated only when a
    strategy reads them (:meth:`require_token_ids`; ``None`` otherwise: the kernels read the
    block table); the last entry is a scratch slot that the device-side fill may write its
    masked-off lanes to."""
    length_count: torch.Tensor | None = None
    """int32 ``[1]`` device counter each fill adds the requests with a bad length to
    (``FillPagesCall.length_count``), set by :meth:`count_lengths`; ``None`` (the engine's
    default): not counted."""
    _views: dict[int, torch.Tensor] = attrs.field(factory=dict, init=False, repr=False)

    @classmethod
    def allocate(cls, setup: StrategySetup, invalid_count: torch.Tensor | None = None) -> DecodeIndexBuffers:
        """The indptr and the counter (``invalid_count``: a counter the backend shares, else a
        new one); no per-token list until a strategy asks for one."""
        limits, dev = setup.limits, setup.device
        if invalid_count is None:
            invalid_count = torch.zeros(1, dtype=torch.int32, device=dev)
        return cls(
            kv_indptr=torch.zeros(limits.max_num_seqs + 1, dtype=torch.int32, device=dev),
            invalid_count=invalid_count,
        )

    def count_lengths(self, counter: torch.Tensor) -> None:
        """From now on every fill also adds to ``counter`` (int32 ``[1]`` on the device) the
        requests whose ``seq_len`` it cannot take as it is: negative, past the fill's bound
        (the block table's capacity; such a length is clamped) or ``0 < seq_len < qlen``. The
        functional ``mla_decode`` reads it after its launch; nothing in the engine does."""
        self.length_count = counter

    def require_token_ids(self, setup: StrategySetup) -> torch.Tensor:
        """The flat per-token list (``max_num_seqs * max_model_len + 1`` int32), allocated on
        the first call: from then on every fill writes it."""
        if self.kv_indices is None:
            limits = setup.limits
            self.kv_indices = torch.zeros(
                limits.max_num_seqs * limits.max_model_len + 1, dtype=torch.int32, device=setup.device
            )
        return self.kv_indices

    def fill(
        self, setup: StrategySetup, batch: DecodeBatch, *, qo_indptr: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, int | None]:
        """Write this step's kv_indptr (and the flat indices, when allocated) from the device
        ``seq_lens`` (one :meth:`~mla.providers.base.KernelProvider.fill_page_indices`: one
        kernel on the Triton provider, no host-to-device copy, no sync), and copy
        ``batch.query_start_loc`` into ``qo_indptr`` when given (same launch); return the indptr
        view and the total token count (``None`` when it is known only on the device;
        :meth:`fill_indptr` skips it).

        Work is sized by the batch's longest length when the host knows it, else by the block
        table's capacity ``min(max_blocks * block_size, max_model_len)`` (static, so the fill
        can be captured in a CUDA graph). Lengths are clamped to that bound; a block id outside
        the cache (negative, or past ``KVCacheSpec.num_blocks`` when known) becomes the token
        id -1, and the kernels mask every id outside the cache tensor they are handed, so bad
        input cannot make a kernel read outside the cache or another block; the fill adds such
        tokens to :attr:`invalid_count` (once per build). Without the flat list (kernels that
        read the block table) the fill writes the indptr and counts, per page. For a provider whose
        kernels read every id (``ProviderCapabilities.decode_masks_outside_ids`` false: aiter's)
        such tokens are left out of their request's range instead (``FillPagesCall.compact``).
        After :meth:`count_lengths` the fill also counts the requests with a bad length.
        ``validate="full"`` rejects such input on the host.
        """
        indptr = self.fill_indptr(setup, batch, qo_indptr=qo_indptr)
        lengths = batch.lengths
        if not lengths.seq_lens:
            return indptr, None
        bound = self.kv_bound(setup, batch)
        if lengths.min_seq >= 0 and lengths.max_seq <= bound:
            return indptr, lengths.total_seq
        return indptr, sum(min(max(length, 0), bound) for length in lengths.seq_lens)

    def fill_indptr(
        self, setup: StrategySetup, batch: DecodeBatch, *, qo_indptr: torch.Tensor | None = None
    ) -> torch.Tensor:
        """:meth:`fill` without the total token count (what a build needs): returns the
        ``kv_indptr`` view."""
        indptr = self.indptr_view(batch.num_requests)
        compact = not setup.capabilities.decode_masks_outside_ids
        if compact and setup.cache.num_blocks is None:
            # Such kernels read every id they are given: only this fill can keep a block past the
            # cache out of their ranges, and it knows the cache's size from the spec alone.
            raise InvalidInputError(
                "cache",
                f"provider {setup.capabilities.provider!r}'s decode kernels read every token id "
                "they are given: give KVCacheSpec(num_blocks=...) (the cache's block count) so "
                "that block ids past the cache are left out of each request's keys",
            )
        bound = self.kv_bound(setup, batch)
        lengths = batch.lengths
        if lengths.seq_lens and lengths.min_seq >= 0 and lengths.max_seq <= bound:
            bound = lengths.max_seq
        setup.provider.fill_page_indices(
            _FILL_PAGES_CALL(
                seq_lens=batch.seq_lens,
                block_table=batch.block_table,
                kv_indptr=indptr,
                kv_indices=self.kv_indices,
                block_size=setup.cache.block_size,
                max_len=bound,
                num_blocks=setup.cache.num_blocks,
                # Kernels that read every id they are given get a range without such tokens.
                compact=compact,
                query_start_loc=(
                    batch.query_start_loc if qo_indptr is not None or self.length_count is not None else None
                ),
                qo_indptr=qo_indptr,
                invalid_count=self.invalid_count,
                length_count=self.length_count,
            )
        )
        return indptr

    @staticmethod
    def kv_bound(setup: StrategySetup, batch: DecodeBatch) -> int:
        """The most KV positions a request of ``batch`` can have: its block table's capacity,
        capped by ``max_model_len``."""
        return min(batch.block_table.shape[1] * setup.cache.block_size, setup.limits.max_model_len)

    def indptr_view(self, num_requests: int) -> torch.Tensor:
        """``kv_indptr[: num_requests + 1]`` (the view is made once per size)."""
        view = self._views.get(num_requests)
        if view is None:
            view = self._views[num_requests] = self.kv_indptr[: num_requests + 1]
        return view


class DecodeStrategy(Strategy[DecodeContext]):
    """Runs the decode phase in the absorbed MQA form.

    ``build_metadata(batch) -> DecodePlan`` writes into buffers allocated at init;
    ``run(plan, q, kv_cache, kv_scale=, out=, lse=)`` reads only the plan.
    q ``[T, H, L+R]`` in the model dtype, kv_cache ``[blocks, block_size, L+R]``,
    out ``[T, H, L]`` (q's dtype), lse ``[T, H]`` float32 (natural log) or ``None`` when the
    caller needs no LSE (the provider then skips computing it). ``kv_scale`` reaches ``run`` and
    ``launch`` as the float32 ``[1]`` device tensor the engine converted once (``None``: a float
    cache). The engine checks a run's tensors with :meth:`check_inputs` before ``run``.
    """

    PHASE: ClassVar[Phase] = Phase.DECODE
    GRAPH_SUPPORT: ClassVar[GraphSupport] = GraphSupport.UNIFORM_BATCH

    def __init__(self, setup: StrategySetup, index_buffers: DecodeIndexBuffers | None = None) -> None:
        super().__init__(setup)
        self.index_buffers = index_buffers or DecodeIndexBuffers.allocate(setup)
        if self.needs_token_ids(setup):
            self.index_buffers.require_token_ids(setup)
        self._last_geometry: tuple[tuple[int, ...], DecodeGeometry] | None = None

    @classmethod
    def needs_token_ids(cls, setup: StrategySetup) -> bool:
        """Whether the strategy reads the flat per-token list (``index_buffers.kv_indices``):
        then it is allocated at init (``max_num_seqs * max_model_len`` int32) and every fill
        writes it. ``True`` unless a strategy knows better (a strategy written against
        ``kv_indices`` keeps it); the built-in ones need it only on providers whose kernels do
        not read the block table (``ProviderCapabilities.decode_reads_block_table``)."""
        return True

    @abc.abstractmethod
    def build_metadata(self, batch: DecodeBatch) -> DecodePlan:
        """Host side, once per step: fill persistent buffers, return the plan."""

    def capturable_build(self, plan: DecodePlan) -> bool:
        """Whether rebuilding ``plan``'s step (same host inputs, no host ``seq_lens``) is device
        work only, with nothing copied from host memory and nothing read back: then a CUDA
        graph can capture build and run together (the functional API's replay path does).
        ``False`` unless a strategy knows better."""
        return False

    @abc.abstractmethod
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
        """Device side: the kernels for one validated call (no host sync); ``lse=None``: the
        caller wants no LSE, so none is written."""

    def check_inputs(
        self,
        plan: DecodePlan,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor | None,
    ) -> None:
        """The engine's check of a run's tensors against ``plan`` (typed errors naming each
        argument), made once before :meth:`run`: q, the cache, ``out`` and ``lse`` (when given)
        fit its geometry, and no output overlaps an input."""
        self.check_plan(plan)
        geo = plan.geometry
        dims = self.setup.dims
        check_tensor("q", q, shape=(geo.num_tokens, geo.num_heads, dims.latent_dim), dtype=geo.q_dtype)
        cache = self.setup.cache
        check_cache(
            kv_cache,
            block_size=cache.block_size,
            width=dims.latent_dim,
            dtype=geo.kv_dtype,
            device=q.device,
            num_blocks=max(cache.num_blocks or 0, geo.cache_blocks),
        )
        wide = out.dtype == torch.float32 and self.setup.capabilities.decode_float32_out
        check_tensor(
            "out",
            out,
            shape=(geo.num_tokens, geo.num_heads, dims.kv_lora_rank),
            dtype=torch.float32 if wide else geo.q_dtype,
            device=q.device,
        )
        if lse is not None:
            check_tensor(
                "lse", lse, shape=(geo.num_tokens, geo.num_heads), dtype=torch.float32, device=q.device
            )
        require_no_overlap("out", out, ("kv_cache", kv_cache), ("q", q), ("lse", lse))
        require_no_overlap("lse", lse, ("kv_cache", kv_cache), ("q", q))

    def run(
        self,
        plan: DecodePlan,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        *,
        kv_scale: torch.Tensor | None,
        out: torch.Tensor,
        lse: torch.Tensor | None = None,
    ) -> None:
        """Execute ``plan`` on inputs checked against it (:meth:`check_inputs`, which the
        engine runs at its door): only the plan's strategy and row count are asserted here.

        ``kv_scale`` is the float32 ``[1]`` device tensor of an fp8 cache (``None`` for a float
        cache); ``lse=None`` skips computing the LSE.
        """
        self.check_plan(plan)
        assert q.shape[0] == out.shape[0] == plan.geometry.num_tokens, "run: inputs of another plan"
        kv_flat = kv_cache.view(-1, self.setup.dims.latent_dim)
        self.launch(plan, q, kv_flat, kv_scale=kv_scale, out=out, lse=lse)

    def base_geometry(
        self, batch: DecodeBatch, *, kernel_heads: int, kernel_qlen: int, num_kernel_rows: int
    ) -> DecodeGeometry:
        """The plan geometry of ``batch``: the previous build's record when every value is the
        same (steps of one batch size under CUDA graphs, where ``max_seqlen_k`` is the static
        bound), else a new one."""
        ctx = batch.context
        values = (
            ctx.num_heads,
            kernel_heads,
            batch.num_requests,
            batch.num_tokens,
            batch.num_owned_tokens,
            ctx.max_qlen,
            kernel_qlen,
            num_kernel_rows,
            self.max_seqlen_k(batch),
            batch.cache_blocks,
        )
        last = self._last_geometry
        if last is not None and last[0] == values:
            return last[1]
        heads, _, requests, tokens, owned, max_qlen, _, _, max_seqlen_k, cache_blocks = values
        setup = self.setup
        geometry = _DECODE_GEOMETRY(
            num_heads=heads,
            kernel_heads=kernel_heads,
            num_requests=requests,
            num_tokens=tokens,
            num_owned_tokens=owned,
            max_qlen=max_qlen,
            kernel_qlen=kernel_qlen,
            num_kernel_rows=num_kernel_rows,
            q_dtype=setup.q_dtype,
            kv_dtype=setup.cache.dtype,
            max_seqlen_k=max_seqlen_k,
            cache_blocks=cache_blocks,
        )
        self._last_geometry = (values, geometry)
        return geometry

    def max_seqlen_k(self, batch: DecodeBatch) -> int:
        """The KV-length bound the kernels are launched with: the engine's ``max_model_len``
        when the engine captures decode steps in CUDA graphs (``graph_mode`` other than
        ``NONE``: a captured step stays valid as sequences grow), else the batch's longest
        sequence when the host knows it, so work follows the batch, not the limits."""
        limits = self.setup.limits
        longest = batch.max_seq_len
        if limits.graph_mode is not GraphMode.NONE or longest is None:
            return limits.max_model_len
        return max(1, min(longest, limits.max_model_len))
