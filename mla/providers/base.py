"""The kernel-provider contract.

A provider implements kernel contracts as methods that take the contract's call record
(:mod:`mla.providers.calls`, where shapes, dtypes and shared conventions are documented) and
write into the caller's outputs. Every contract method has a default that raises
:class:`~mla.core.errors.UnsupportedError`, so ``ProviderCapabilities.contracts`` is the one
declaration of what a provider implements: a provider overrides exactly the methods of the
contracts it lists.
"""

from __future__ import annotations

import abc
from typing import ClassVar, NoReturn

import torch

from mla.core.capabilities import Contract, ProviderCapabilities
from mla.core.errors import InvalidInputError, UnsupportedError
from mla.core.platform import Platform
from mla.core.support import Support
from mla.providers.calls import (
    DecodeSchedule,
    DecodeScheduleBuffersCall,
    ExpandPagesCall,
    FillPagesCall,
    Fp8PrefillCall,
    Fp8PrefillPlanCall,
    GatherContextCall,
    IndexTopkCall,
    MergeStatesCall,
    PagedDecodeCall,
    PlanDecodeScheduleCall,
    SmallHeadDecodeCall,
    SparseAttentionCall,
    SparseSlotsCall,
    VarlenPrefillCall,
    WriteIndexKeysCall,
    WriteKVCall,
)
from mla.providers.context_gather import gather_context_rows
from mla.providers.sparse_slots import sparse_slots
from mla.providers.transforms import fill_page_indices

CONTRACT_METHODS: dict[Contract, tuple[str, ...]] = {
    Contract.PAGED_DECODE: ("paged_mqa_decode",),
    Contract.DECODE_SCHEDULE: ("decode_schedule_buffers", "plan_decode_schedule"),
    Contract.SMALL_HEAD_DECODE: ("small_head_decode",),
    Contract.VARLEN_PREFILL: ("varlen_attention",),
    Contract.FP8_PREFILL: ("plan_fp8_prefill", "fp8_prefill"),
    Contract.MERGE_STATES: ("merge_states",),
    Contract.EXPAND_PAGES: ("expand_page_indices",),
    Contract.KV_WRITE: ("write_kv",),
    Contract.SPARSE_ATTENTION: ("sparse_attention",),
    Contract.INDEXER: ("write_index_keys", "index_topk"),
}
"""The :class:`KernelProvider` methods a provider overrides for each contract it declares."""


class KernelProvider(abc.ABC):
    """One implementation of the kernel contracts.

    Subclasses set ``name``, implement :meth:`availability` (cached; "can it run here") and
    :meth:`capabilities` (what it computes, as data), and override the contract methods of the
    contracts their capability record lists.
    """

    name: ClassVar[str]

    @abc.abstractmethod
    def availability(self) -> Support:
        """Empty when the provider's library and a device it runs on are present here."""

    @abc.abstractmethod
    def capabilities(self, platform: Platform) -> ProviderCapabilities:
        """The capability record for ``platform`` (real or simulated)."""

    @classmethod
    def static_capabilities(cls, platform: Platform) -> ProviderCapabilities | None:
        """The record of this provider's kernels as shipped for ``platform``, known without its
        library or a device (``None``: only :meth:`capabilities` can say). Emulation and
        ``mla explain`` use it, so they give the same answer on every machine."""
        return None

    @classmethod
    def assume(
        cls, caps: ProviderCapabilities, platform: Platform, features: frozenset[str]
    ) -> ProviderCapabilities:
        """``caps`` with the optional ``features`` of this provider's kernels assumed present on
        ``platform`` (emulation and ``mla explain`` ask for them by name). The base knows no
        feature: :class:`InvalidInputError` naming ``assume`` for any."""
        raise InvalidInputError(
            "assume",
            f"provider {cls.name!r} has no optional feature to assume (asked: {', '.join(sorted(features))})",
        )

    def describe_probes(self) -> dict[str, object]:
        """Feature probes shown by ``mla info`` (library versions, optional kernels)."""
        return {}

    def kernel_note(
        self,
        *,
        phase: str,
        q_dtype: torch.dtype,
        kv_dtype: torch.dtype,
        kv_lora_rank: int,
        rope_dim: int,
    ) -> str | None:
        """Which of the provider's kernel families serves a case of ``phase`` (``"decode"`` or
        ``"prefill"``) and why, for providers that route cases between families (shown by
        ``mla explain``); ``None`` when there is nothing to say."""
        return None

    def _unsupported(self, contract: Contract, method: str) -> NoReturn:
        raise UnsupportedError(
            f"provider {self.name!r} does not implement the {contract.value} contract "
            f"({type(self).__name__}.{method}); a strategy that needs it must list it in REQUIRES "
            "so the resolver checks the provider's capability record first"
        )

    # -- decode -----------------------------------------------------------------------------

    def paged_mqa_decode(self, call: PagedDecodeCall) -> None:
        """Asm-style paged MQA decode; with ``call.schedule`` the persistent split-KV path."""
        self._unsupported(Contract.PAGED_DECODE, "paged_mqa_decode")

    def decode_schedule_buffers(self, call: DecodeScheduleBuffersCall) -> DecodeSchedule:
        """Allocate the fixed buffers of a persistent decode schedule (once, at init)."""
        self._unsupported(Contract.DECODE_SCHEDULE, "decode_schedule_buffers")

    def plan_decode_schedule(self, call: PlanDecodeScheduleCall) -> None:
        """Fill ``call.schedule`` on the device for this step (no host sync)."""
        self._unsupported(Contract.DECODE_SCHEDULE, "plan_decode_schedule")

    def small_head_decode(self, call: SmallHeadDecodeCall) -> None:
        """Gluon-style decode: every row an independent qlen-1 decode."""
        self._unsupported(Contract.SMALL_HEAD_DECODE, "small_head_decode")

    # -- prefill ----------------------------------------------------------------------------

    def varlen_attention(self, call: VarlenPrefillCall) -> None:
        """Flash-style varlen attention with LSE."""
        self._unsupported(Contract.VARLEN_PREFILL, "varlen_attention")

    def plan_fp8_prefill(self, call: Fp8PrefillPlanCall) -> object:
        """Host-side tile schedule for :meth:`fp8_prefill` (build time; may read host tensors)."""
        self._unsupported(Contract.FP8_PREFILL, "plan_fp8_prefill")

    def fp8_prefill(self, call: Fp8PrefillCall) -> None:
        """FP8 persistent prefill on the schedule from :meth:`plan_fp8_prefill`."""
        self._unsupported(Contract.FP8_PREFILL, "fp8_prefill")

    # -- utilities --------------------------------------------------------------------------

    def merge_states(self, call: MergeStatesCall) -> None:
        """LSE-merge two attention states."""
        self._unsupported(Contract.MERGE_STATES, "merge_states")

    def expand_page_indices(self, call: ExpandPagesCall) -> None:
        """Block table to flat per-token cache row ids."""
        self._unsupported(Contract.EXPAND_PAGES, "expand_page_indices")

    def fill_page_indices(self, call: FillPagesCall) -> None:
        """A step's ``kv_indptr`` and flat page indices from the device lengths (no host sync).

        The default runs :func:`~mla.providers.transforms.fill_page_indices` (about a dozen
        torch ops, any device); a provider overrides it with one fused kernel (the Triton
        provider does), since the builder calls it every decode step.
        """
        fill_page_indices(call)

    def gather_context(self, call: GatherContextCall) -> None:
        """A chunk of cached context's latent rows, inside-first, for its up-projection.

        The default runs :func:`~mla.providers.context_gather.gather_context_rows` (a dozen
        torch ops and two passes over the rows, any device); a provider overrides it with fused
        kernels (the Triton provider does), since every chunk of a chunked-context prefill
        calls it.
        """
        gather_context_rows(call)

    def write_kv(self, call: WriteKVCall) -> None:
        """Write new tokens' latent + rope rows into the paged cache."""
        self._unsupported(Contract.KV_WRITE, "write_kv")

    # -- sparse (DeepSeek Sparse Attention) ----------------------------------------------------

    def sparse_attention(self, call: SparseAttentionCall) -> None:
        """Sparse MLA: each query row attends its own list of cache slots."""
        self._unsupported(Contract.SPARSE_ATTENTION, "sparse_attention")

    def write_index_keys(self, call: WriteIndexKeysCall) -> None:
        """Write (and for fp8, quantize) new tokens' index keys into the index-key cache."""
        self._unsupported(Contract.INDEXER, "write_index_keys")

    def index_topk(self, call: IndexTopkCall) -> None:
        """The indexer's scores and top-k request-local positions per query row."""
        self._unsupported(Contract.INDEXER, "index_topk")

    def sparse_slots(self, call: SparseSlotsCall) -> None:
        """Request-local positions to cache slots, masking and counting invalid entries.

        The default runs :func:`~mla.providers.sparse_slots.sparse_slots` (a few torch ops, any
        device, no host sync); a provider may fuse it into one kernel.
        """
        sparse_slots(call)
