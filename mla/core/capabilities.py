"""What a kernel provider can compute, as data.

A :class:`ProviderCapabilities` record lists the kernel contracts (:mod:`mla.providers.base`) a provider
implements and the limits its kernels have (head granularity, qlen limits, dtypes, kernel-table
gaps). Strategies read only this record in ``supports``; the record is separate from availability
("is the library importable here"). Any record can be imposed on the torch reference provider, so
the transforms that real hardware limits trigger run on a CPU (aiter's record:
:mod:`mla.providers.aiter.capabilities`).
"""

from __future__ import annotations

import enum

import attrs
import torch

from mla.core.config import DS_MLA_DTYPE, FP8_DTYPES


class Contract(enum.Enum):
    """The kernel contracts a provider may implement (:class:`mla.providers.base.KernelProvider`)."""

    PAGED_DECODE = "paged-decode"
    """Asm-style paged MQA decode over a flat latent cache (optionally scheduled)."""
    DECODE_SCHEDULE = "decode-schedule"
    """Device-side split-KV work schedule plus reduce for the paged decode."""
    SMALL_HEAD_DECODE = "small-head-decode"
    """Gluon-style decode: q_nope/q_pe, flat page table and indptr per row."""
    VARLEN_PREFILL = "varlen-prefill"
    """Flash-style varlen attention (q/k 192, v 128), causal bottom-right, LSE."""
    FP8_PREFILL = "fp8-prefill"
    """FP8 persistent prefill: fp8 q/k/v, tiled schedule, fp32 partials and a reduce."""
    MERGE_STATES = "merge-states"
    """Combine (o, lse) pairs."""
    EXPAND_PAGES = "expand-pages"
    """Block table to flat per-token indices for any block size."""
    KV_WRITE = "kv-write"
    """Write latent + rope rows of new tokens into the paged cache."""
    SPARSE_ATTENTION = "sparse-attention"
    """Sparse MLA in the absorbed form: each query row attends its own list of cache slots."""
    INDEXER = "indexer"
    """DeepSeek Sparse Attention's lightning indexer: index-key writes, scores and top-k."""


ALL_CONTRACTS: frozenset[Contract] = frozenset(Contract)
_FLOATS = frozenset({torch.bfloat16, torch.float16, torch.float32})


@attrs.frozen
class PagedKernel:
    """One family of a provider's paged-decode kernels: the (kernel heads, kernel qlen) range it
    runs in persistent or non-persistent mode, for an fp8 or a float KV cache."""

    persistent: bool
    fp8: bool
    """fp8 KV cache (and fp8 query: providers quantize q for fp8 caches)."""
    heads: frozenset[int]
    """Kernel head counts (after head padding)."""
    min_qlen: int = 1
    max_qlen: int | None = None
    """Largest kernel qlen (``None``: any)."""
    head_multiple: int | None = None
    """Any multiple of this many kernel heads runs too (aiter's persistent decode folds them
    onto its 16-head kernel as extra pseudo-requests); ``None``: only ``heads``."""
    padded: bool | None = None
    """Which query head counts the row serves: ``True`` only fewer heads than the provider's
    granularity, padded up to it; ``False`` only the others; ``None`` both."""

    def runs(self, *, persistent: bool, fp8: bool, heads: int, qlen: int, padded: bool = False) -> bool:
        return (
            self.persistent == persistent
            and self.fp8 == fp8
            and (self.padded is None or self.padded == padded)
            and (heads in self.heads or (self.head_multiple is not None and heads % self.head_multiple == 0))
            and qlen >= self.min_qlen
            and (self.max_qlen is None or qlen <= self.max_qlen)
        )

    def __str__(self) -> str:
        mode = "persistent" if self.persistent else "non-persistent"
        qlens = f"qlen {self.min_qlen}..{self.max_qlen if self.max_qlen is not None else 'any'}"
        heads = [str(h) for h in sorted(self.heads)]
        if self.head_multiple is not None:
            heads.append(f"any multiple of {self.head_multiple}")
        only = {None: "", True: " (padded heads only)", False: " (unpadded heads only)"}[self.padded]
        return f"{mode} {'fp8' if self.fp8 else 'float'} KV, heads [{', '.join(heads)}]{only}, {qlens}"


@attrs.frozen
class ProviderCapabilities:
    """Limits of one provider's kernels on one arch. ``None`` means "no limit".

    Head-count rules: a paged decode runs ``H`` heads as ``padded_heads(H)`` kernel heads; a head
    count is valid when ``H <= max_unpadded_heads`` or ``H % head_granularity == 0``.
    """

    provider: str
    contracts: frozenset[Contract] = ALL_CONTRACTS
    archs: frozenset[str] | None = None
    """Archs the kernels are built for; ``None`` = any."""
    q_dtypes: frozenset[torch.dtype] = _FLOATS
    """Query dtypes of the paged decode."""
    kv_dtypes: frozenset[torch.dtype] = _FLOATS | FP8_DTYPES
    varlen_q_dtypes: frozenset[torch.dtype] = _FLOATS
    """q/k/v dtypes of the varlen (flash-style) prefill."""

    head_granularity: int = 1
    """Paged-decode kernels need a multiple of this many heads (16 for aiter's asm kernels)."""
    max_unpadded_heads: int | None = None
    """Head counts above this must already be a multiple of ``head_granularity`` (aiter: 128)."""
    native_head_counts: frozenset[int] = frozenset()
    """Head counts the paged decode runs natively although not a multiple of the granularity."""

    small_head_max_heads: int | None = None
    """Largest head count the small-head (Gluon-style) decode accepts."""
    small_head_q_dtypes: frozenset[torch.dtype] = _FLOATS
    small_head_kv_dtypes: frozenset[torch.dtype] = _FLOATS | FP8_DTYPES

    uniform_qlen_padding: tuple[tuple[int, int], ...] = ()
    """``(qlen, kernel_qlen)`` pairs: uniform batches of that qlen are padded (prepended zero
    rows) to the kernel qlen. aiter: 2 and 3 run as 4."""

    paged_kernels: frozenset[PagedKernel] | None = None
    """The paged-decode kernel table: the (mode, KV, kernel heads, kernel qlen, padded heads)
    combinations that exist (``None``: every one). The one statement of the paged kernels'
    gaps; the paged strategies check it in one place."""
    latent_dims: frozenset[tuple[int, int]] | None = None
    """``(kv_lora_rank, rope)`` pairs the decode kernels (paged and small-head) are built for
    (``None``: any; aiter's asm and Gluon kernels: 512/64)."""

    fp8_prefill_head_multiple: int = 1
    """The fp8 prefill kernel needs a head count that is a multiple of this."""
    fp8_prefill_heads: frozenset[int] | None = None
    """Head counts the fp8 prefill (and its reduce) runs (``None``: any multiple above)."""
    fp8_prefill_dims: frozenset[tuple[int, int]] | None = None
    """``(qk_head_dim, v_head_dim)`` pairs the fp8 prefill kernel is built for (``None``: any)."""
    fp8_dtype: torch.dtype = torch.float8_e4m3fn
    """The fp8 format the provider's fp8 kernels take (gfx942: ``float8_e4m3fnuz``)."""

    sparse_kv_dtypes: frozenset[torch.dtype] = _FLOATS | frozenset({torch.float8_e4m3fn, DS_MLA_DTYPE})
    """KV-cache dtypes the sparse attention reads (``uint8`` = ``fp8_ds_mla``)."""
    index_key_dtypes: frozenset[torch.dtype] = frozenset(
        {torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn}
    )
    """Index-key cache dtypes the indexer reads."""

    decode_masks_outside_ids: bool = True
    """The decode kernels mask a token id outside the cache they are handed (the page fill's
    ``-1`` mark included: no memory read, no key). ``False`` (aiter's kernels read every id):
    the page fill leaves the tokens of a block outside the cache out of the request's range
    (``FillPagesCall.compact``), so the kernel never sees their ids."""
    decode_reads_block_table: bool = False
    """The decode kernels (paged and small-head) read the engine's block table themselves
    (``PagedDecodeCall.block_table``, ``SmallHeadDecodeCall.block_table``: position ``p`` of a
    request is cache row ``block_table[b, p // page_size] * page_size + p % page_size``, a block
    id outside the cache masked; so this needs ``decode_masks_outside_ids``). The builder then
    allocates and fills no per-token list (its index memory is O(requests x pages)); ``False``
    (aiter's and the gluon provider's kernels): the page fill expands the table into flat
    per-token ids (``FillPagesCall.kv_indices``; :attr:`decode_token_ids`)."""
    decode_multi_row_stores_masked: bool = True
    """The non-persistent paged decode at a kernel qlen above 1 writes exactly the rows its
    requests own (its multi-row tiles mask their stores), so it runs on the caller's ``q`` and
    ``out`` like a qlen-1 decode: no copy into a workspace and back. ``False`` (aiter's asm
    kernels): a multi-row tile can leave lanes past its rows unwritten or write them, so the
    strategy hands it a zeroed workspace and copies the owned rows out."""
    varlen_clamps_indptrs: bool = False
    """The varlen prefill kernels clamp each request's row range into ``q``/``k``'s rows, so a
    bad ``cu_seqlens`` reads and writes nothing outside the tensors. ``mla.mla_prefill`` then
    launches before its one device-to-host read of the indptrs and checks their values after
    it (raising as before), so the read waits for the previous kernels while this call's
    kernel is already queued (with ``validate="fast"`` it reads nothing). ``False``: the values
    are read and checked before the launch."""
    varlen_context_operands: bool = False
    """The varlen prefill takes the chunked-context forms of
    :class:`~mla.providers.calls.VarlenPrefillCall`: the rope lanes as one ``k_pe [Tk, R]``
    operand shared by every head (``k`` strided ``[Tk, H, Dqk - R]``) and a prior state merged
    into in the epilogue (``prior_out``/``prior_lse``). ``FlashVarlen`` then attends a context
    chunk without assembling its keys and without separate merge passes; ``False`` (aiter's
    ``flash_attn_varlen_func``): it assembles ``[Tk, H, Dqk]`` keys and merges with the
    ``merge-states`` kernel."""
    decode_float32_out: bool = True
    """The paged decode kernels also write a float32 ``out`` for a 16-bit query (the torch
    reference computes in float32, the Triton kernels convert on store): padded-decode
    workspaces and decode context parallelism's partials then stay float32 (one rounding)."""

    persistent_decode_preferred: bool = True
    """A preference hint, never a limit: whether the provider's persistent paged decode is the
    faster of its two paged modes (the resolver orders them by it)."""

    def has(self, contract: Contract) -> bool:
        return contract in self.contracts

    @property
    def decode_token_ids(self) -> bool:
        """Whether the decode kernels take the flat per-token view (the page fill expands the
        block table for them): unless they read the block table, which they can only do if
        they also mask the ids outside the cache (a kernel that reads every id it is given
        gets a compacted per-token range instead)."""
        return not (self.decode_reads_block_table and self.decode_masks_outside_ids)

    def padded_heads(self, num_heads: int) -> int:
        """Kernel head count for ``num_heads`` query heads in the paged decode."""
        g = self.head_granularity
        if num_heads in self.native_head_counts or num_heads % g == 0:
            return num_heads
        return -(-num_heads // g) * g

    def heads_valid(self, num_heads: int) -> bool:
        """vLLM's ROCm AITER MLA head rule: ``H > 0 and (H <= max_unpadded or H % granularity == 0)``."""
        if num_heads <= 0:
            return False
        if num_heads % self.head_granularity == 0 or num_heads in self.native_head_counts:
            return True
        return self.max_unpadded_heads is None or num_heads <= self.max_unpadded_heads

    def has_paged_kernel(
        self, *, persistent: bool, fp8: bool, heads: int, qlen: int, padded: bool = False
    ) -> bool:
        """Whether the kernel table has a paged decode for ``heads`` kernel heads at kernel qlen
        ``qlen`` (``padded``: the query has fewer heads than the granularity)."""
        if self.paged_kernels is None:
            return True
        return any(
            k.runs(persistent=persistent, fp8=fp8, heads=heads, qlen=qlen, padded=padded)
            for k in self.paged_kernels
        )

    def paged_kernel_rows(self, *, persistent: bool, fp8: bool) -> tuple[PagedKernel, ...]:
        """The table's rows of one mode and KV kind (for messages), in a stable order."""
        rows = [k for k in self.paged_kernels or () if k.persistent == persistent and k.fp8 == fp8]
        return tuple(sorted(rows, key=str))

    def kernel_qlen(self, qlen: int, *, uniform: bool) -> int:
        """The qlen the paged decode runs a batch of max qlen ``qlen`` at."""
        if uniform:
            for logical, kernel in self.uniform_qlen_padding:
                if logical == qlen:
                    return kernel
        return qlen

    def describe(self) -> dict[str, object]:
        """A JSON-friendly view for ``mla info`` (numbers stay numbers, dtypes become names)."""
        out: dict[str, object] = {}
        for field in attrs.fields(type(self)):
            out[field.name] = _json_value(getattr(self, field.name))
        return out


def _json_value(value: object) -> object:
    if isinstance(value, frozenset):
        items = [_json_value(v) for v in value]
        return sorted(items, key=lambda v: (not isinstance(v, int), v if isinstance(v, int) else str(v)))
    if isinstance(value, tuple):
        return [_json_value(v) for v in value]
    if isinstance(value, Contract):
        return value.value
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, PagedKernel):
        return str(value)
    return value


REFERENCE_CAPABILITIES = ProviderCapabilities(
    provider="torch", decode_reads_block_table=True, varlen_context_operands=True
)
"""The torch provider's own record: every contract, no head or qlen limit, any float/fp8 dtype,
decode over the block table, the varlen prefill's chunked-context operands."""
