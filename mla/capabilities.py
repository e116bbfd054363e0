"""What a kernel provider can compute, as data.

A :class:`ProviderCapabilities` record lists the kernel contracts (:mod:`mla.providers.base`) a provider
implements and the limits its kernels have (head granularity, qlen limits, dtypes, kernel-table
gaps). Strategies read only this record in ``supports``; the record is separate from availability
("is the library importable here"). Any record can be imposed on the torch reference provider, so
the transforms that real hardware limits trigger run on a CPU (see :func:`aiter_capabilities`).
"""

from __future__ import annotations

import enum

import attrs
import torch

from mla.config import FP8_DTYPES


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


ALL_CONTRACTS: frozenset[Contract] = frozenset(Contract)
_FLOATS = frozenset({torch.bfloat16, torch.float16, torch.float32})
_BF16 = frozenset({torch.bfloat16})


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

    def runs(self, *, persistent: bool, fp8: bool, heads: int, qlen: int) -> bool:
        return (
            self.persistent == persistent
            and self.fp8 == fp8
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
        return f"{mode} {'fp8' if self.fp8 else 'float'} KV, heads [{', '.join(heads)}], {qlens}"


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
    persistent_small_head_max_qlen: int | None = None
    """Padded (H < granularity) bf16/fp16 persistent decode exists only up to this kernel qlen."""
    persistent_fp8_max_qlen: int | None = None
    """fp8-KV persistent decode exists only up to this kernel qlen."""
    nonpersistent_fp8_max_qlen: int | None = None
    """fp8-KV non-persistent decode exists only up to this kernel qlen."""
    nonpersistent_fp8_head_qlen_products: frozenset[int] | None = None
    """fp8-KV non-persistent decode looks its kernel up by ``kernel_heads * kernel_qlen``; only
    these products exist (aiter's ``get_block_n_fp8`` keys)."""

    paged_kernels: frozenset[PagedKernel] | None = None
    """The paged-decode kernel table: the combinations that exist (``None``: every one). The
    limits above read as rules; this is the table they summarize."""
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

    persistent_decode_preferred: bool = True
    """A preference hint, never a limit: whether the provider's persistent paged decode is the
    faster of its two paged modes (the resolver orders them by it)."""

    def has(self, contract: Contract) -> bool:
        return contract in self.contracts

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

    def has_paged_kernel(self, *, persistent: bool, fp8: bool, heads: int, qlen: int) -> bool:
        """Whether the kernel table has a paged decode for this combination."""
        if self.paged_kernels is None:
            return True
        return any(k.runs(persistent=persistent, fp8=fp8, heads=heads, qlen=qlen) for k in self.paged_kernels)

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


REFERENCE_CAPABILITIES = ProviderCapabilities(provider="torch")
"""The torch provider's own record: every contract, no head or qlen limit, any float/fp8 dtype."""

AITER_GET_BLOCK_N_FP8_KEYS: frozenset[int] = frozenset({8, 16, 24, 32, 48, 64, 128, 256, 384, 512})
"""Head x qlen products aiter's non-persistent fp8 decode has a kernel block for
(``aiter/mla.py::get_block_n_fp8``); any other product raises KeyError inside aiter."""


AITER_FOLD_HEADS = 16
"""aiter's persistent decode runs any multiple of 16 heads, natively or folded onto its
16-head kernel (``q.view(T * H / 16, 16, D)``: the extra heads become pseudo-requests), also
above 128 heads, as vLLM's ROCm AITER MLA backend relies on for 144, 160, ... heads per rank."""


def aiter_paged_kernels(arch: str) -> frozenset[PagedKernel]:
    """aiter's paged-decode kernel table on ``arch`` as the strategies can reach it (kernel heads
    a multiple of 16, or a native 24; fp8 KV always with an fp8 query).

    Derived from ROCm/aiter e4048607: ``aiter/mla.py::mla_decode_fwd``'s native/fold rule,
    ``csrc/py_itfs_cu/asm_mla.cu``'s qlen/gqa remap and the ``hsa/<arch>/mla/mla_asm.csv``
    rows, and ``mla_reduce_v1``'s head list (at most 128, so more heads run folded). A
    combination outside the table is a ``cannot get heuristic kernel`` abort, an
    ``AITER_CHECK`` or a ``get_block_n_fp8`` KeyError.
    """
    fold = AITER_FOLD_HEADS
    if arch == "gfx950":
        return frozenset(
            {
                # bf16 persistent remaps to the gqa32/qlen4 or gqa64/qlen1 kernel at any qlen;
                # 24 heads need the native-H24 reducer and planner (see native_head_counts).
                PagedKernel(True, False, frozenset({24}), head_multiple=fold),
                # fp8 persistent: gqa16 qlen 1/2/4 and the gqa32 remap past qlen 4; 24 heads
                # run as 32 inside the aiter provider (mla_decode_fwd has no fp8 24-head path).
                PagedKernel(True, True, frozenset({24}), head_multiple=fold),
                PagedKernel(False, False, frozenset({16, 32, 64, 128})),
                PagedKernel(False, True, frozenset({16, 128}), 1, 4),
            }
        )
    if arch == "gfx942":
        return frozenset(
            {
                # Every head count folds onto the gqa16 kernel, which exists up to qlen 4.
                PagedKernel(True, False, frozenset(), 1, 4, head_multiple=fold),
                PagedKernel(True, True, frozenset(), 1, 4, head_multiple=fold),
                # 128 fp8 heads are native (qSeqLen 0: any qlen).
                PagedKernel(True, True, frozenset({128})),
                PagedKernel(False, False, frozenset({16, 32, 128})),
                PagedKernel(False, False, frozenset({64}), 2),
                PagedKernel(False, True, frozenset({16, 128}), 1, 4),
            }
        )
    return frozenset()


def aiter_capabilities(
    arch: str,
    *,
    gluon: bool | None = None,
    fp8_prefill: bool | None = None,
    native_h24: bool = False,
    provider: str = "aiter",
) -> ProviderCapabilities:
    """The capability record of AMD aiter's MLA kernels on ``arch`` (ROCm/aiter e4048607).

    ``gluon`` / ``fp8_prefill`` default to "shipped on gfx950 only"; ``native_h24`` is the
    reducer-and-planner probe (off unless both ship; honoured on gfx950 only, where
    ``mla_decode_fwd`` runs 24 bf16 heads natively). Kernel-table gaps become limits:
    no padded bf16 persistent kernel past qlen 4 (persistent gate), fp8 persistent past qlen 4
    only on gfx950 (gqa32 remap), fp8 non-persistent only to qlen 4 and only at
    ``get_block_n_fp8`` products; :func:`aiter_paged_kernels` is the full table (e.g. gfx942
    has no persistent kernel past qlen 4 at any head count).
    """
    gfx950 = arch == "gfx950"
    contracts = set(ALL_CONTRACTS)
    if not (gfx950 if gluon is None else gluon):
        contracts.discard(Contract.SMALL_HEAD_DECODE)
    if not (gfx950 if fp8_prefill is None else fp8_prefill):
        contracts.discard(Contract.FP8_PREFILL)
    return ProviderCapabilities(
        provider=provider,
        contracts=frozenset(contracts),
        archs=frozenset({"gfx942", "gfx950"}),
        q_dtypes=_BF16,
        kv_dtypes=_BF16 | frozenset({torch.float8_e4m3fn, torch.float8_e4m3fnuz}),
        # aiter's CK varlen flash attention (flash_attn_varlen_func) takes fp16 and bf16.
        varlen_q_dtypes=_BF16 | frozenset({torch.float16}),
        head_granularity=16,
        max_unpadded_heads=128,
        native_head_counts=frozenset({24}) if native_h24 and gfx950 else frozenset(),
        small_head_max_heads=15,
        small_head_q_dtypes=_BF16,
        small_head_kv_dtypes=_BF16,
        uniform_qlen_padding=((2, 4), (3, 4)),
        persistent_small_head_max_qlen=4,
        persistent_fp8_max_qlen=None if gfx950 else 4,
        nonpersistent_fp8_max_qlen=4,
        nonpersistent_fp8_head_qlen_products=AITER_GET_BLOCK_N_FP8_KEYS,
        paged_kernels=aiter_paged_kernels(arch),
        fp8_prefill_head_multiple=16,
        fp8_dtype=torch.float8_e4m3fn if gfx950 else torch.float8_e4m3fnuz,
    )


def with_native_h24(caps: ProviderCapabilities, arch: str) -> ProviderCapabilities:
    """``caps`` with aiter's native-H24 reducer and planner assumed present: 24 heads run
    unpadded where aiter's record allows it on ``arch`` (gfx950); no change elsewhere."""
    extra = aiter_capabilities(arch, native_h24=True).native_head_counts
    if extra <= caps.native_head_counts:
        return caps
    return attrs.evolve(caps, native_head_counts=caps.native_head_counts | extra)
