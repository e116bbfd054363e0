"""Cases and inputs of the sparse conformance kit (:mod:`mla.testing.sparse`).

:class:`SparseCase` describes one sparse step (requests, query lengths, heads, cache and index-key
dtypes, padding); :func:`sparse_cases` enumerates the kit's cases; :func:`make_sparse_inputs`
builds a case's tensors: the latent and index-key caches with every cache row no row of its
request selects poisoned with NaN, and a hand-made selection (:func:`random_selection`) of
request-local positions inside each row's causal window, with ``-1`` between and after them.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence
from typing import Literal

import attrs
import torch

from mla.core.config import (
    DS_MLA_TILE,
    FLOAT_DTYPES,
    IndexerSpec,
    KVCacheSpec,
    MLADims,
    is_ds_mla,
)
from mla.engine.backend import StepInputs
from mla.providers.formats import pack_ds_mla
from mla.testing.cases import (
    DEFAULT_FP8_KV_SCALE,
    PaddingKind,
    _case_seed,
    _combinations,
    _decode_lengths,
    _join,
    _PagedBatch,
    _short,
    _tuple_of_ints,
)
from mla.testing.inputs import _cache_values, _paged_fields, _paged_table, _PagedInputs, indptr
from mla.tools.reference import reference_sparse

SparsePhase = Literal["decode", "prefill"]
SELECTION_POISON = 0x3FFF_FFFF
"""What an indexer check's output holds before the run (an entry left unwritten fails it)."""


def _kv_dtype(value: torch.dtype | str) -> torch.dtype:
    if isinstance(value, str):
        return KVCacheSpec(1, value).dtype
    return value


def _key_dtype(value: torch.dtype | str) -> torch.dtype:
    if isinstance(value, str):
        return IndexerSpec(key_dtype=value).key_dtype
    return value


def _cache_short(dtype: torch.dtype) -> str:
    return "ds_mla" if is_ds_mla(dtype) else _short(dtype)


@attrs.frozen
class SparseCase(_PagedBatch):
    """One batch of a sparse model: per-request query and KV lengths, geometry, dtypes, top-k.

    ``phase="decode"`` is a decode-only step (qlen 1 and up, mixed; a request with
    ``seq_len == 0`` is a graph-padding request; ``extra_rows`` rows belong to no request);
    ``phase="prefill"`` is a prefill-only step (``seq_len - qlen`` cached tokens before each
    request's new ones). ``topk`` is the model's ``index_topk``; ``width`` the selection's
    columns (default ``topk``; fewer is allowed). ``kv_dtype`` is a float dtype, a per-tensor
    fp8 dtype (read with ``kv_scale``) or ``"fp8_ds_mla"``. ``index_*`` describe the indexer
    (:class:`~mla.IndexerSpec`) for :func:`check_indexer_strategy`.
    """

    heads: int
    qlens: tuple[int, ...] = attrs.field(converter=_tuple_of_ints)
    seq_lens: tuple[int, ...] = attrs.field(converter=_tuple_of_ints)
    phase: SparsePhase = "decode"
    topk: int = 16
    width: int | None = None
    block_size: int = 16
    q_dtype: torch.dtype = torch.bfloat16
    kv_dtype: torch.dtype = attrs.field(default=torch.bfloat16, converter=_kv_dtype)
    kv_scale: float = DEFAULT_FP8_KV_SCALE
    extra_rows: int = 0
    kv_lora_rank: int = 128
    rope_dim: int = 32
    max_decode_qlen: int | None = None
    index_heads: int = 4
    index_head_dim: int = 32
    index_key_dtype: torch.dtype = attrs.field(default=torch.bfloat16, converter=_key_dtype)
    seed: int = 0
    softmax_scale: float | None = None
    """Default ``1/sqrt(kv_lora_rank + rope_dim)`` (scores of unit variance on random data)."""

    def __attrs_post_init__(self) -> None:
        if self.phase not in ("decode", "prefill"):
            raise ValueError(f"phase must be 'decode' or 'prefill', got {self.phase!r}")
        if min(self.heads, self.block_size, self.kv_lora_rank, self.rope_dim, self.topk) <= 0:
            raise ValueError(f"heads, block_size, dims and topk must be > 0: {self}")
        if self.width is not None and not 0 <= self.width <= self.topk:
            raise ValueError(f"width {self.width} must be in [0, topk={self.topk}]")
        self._check_requests()
        for qlen, seq in zip(self.qlens, self.seq_lens, strict=True):
            if self.phase == "prefill" and not 0 < qlen <= seq:
                raise ValueError(f"a prefill request needs 0 < qlen <= seq_len, got {qlen}, {seq}")
        if self.extra_rows < 0 or (self.extra_rows and self.phase == "prefill"):
            raise ValueError("extra (graph-padding) rows are only allowed in decode steps")
        if self.num_tokens == 0:
            raise ValueError(f"the batch needs at least one query row: {self}")
        self._check_q_dtype()
        if self.kv_dtype not in FLOAT_DTYPES and not self.kv_is_fp8 and not self.kv_is_ds_mla:
            raise ValueError(f"kv_dtype must be a float, fp8 or 'fp8_ds_mla', got {self.kv_dtype}")
        if self.kv_is_ds_mla and self.kv_lora_rank % DS_MLA_TILE:
            raise ValueError(f"fp8_ds_mla needs kv_lora_rank a multiple of {DS_MLA_TILE}")
        self._check_max_decode_qlen()

    @property
    def columns(self) -> int:
        """Columns of the selection (``width``, default ``topk``)."""
        return self.topk if self.width is None else self.width

    @property
    def kv_is_ds_mla(self) -> bool:
        return is_ds_mla(self.kv_dtype)

    @property
    def dims(self) -> MLADims:
        return self._dims(index_topk=self.topk)

    @property
    def indexer(self) -> IndexerSpec:
        return IndexerSpec(
            num_heads=self.index_heads, head_dim=self.index_head_dim, key_dtype=self.index_key_dtype
        )

    def window(self, request: int, row: int) -> int:
        """Positions row ``row`` of ``request`` may see (right-aligned causal; 0 for padding)."""
        return max(0, self.seq_lens[request] - self.qlens[request] + row + 1)

    @property
    def id(self) -> str:
        """A readable pytest id: phase, heads, qlens, seq lens, top-k, block size, dtypes, dims."""
        pad = f"-x{self.extra_rows}" if self.extra_rows else ""
        width = f"w{self.width}" if self.width is not None and self.width != self.topk else ""
        return (
            f"{self.phase}-h{self.heads}-q{_join(self.qlens)}-s{_join(self.seq_lens)}-k{self.topk}{width}-"
            f"bs{self.block_size}-{_short(self.q_dtype)}-{_cache_short(self.kv_dtype)}{pad}-"
            f"d{self.kv_lora_rank}+{self.rope_dim}"
        )


DEFAULT_SPARSE_HEADS = (1, 3, 16)
DEFAULT_SPARSE_DTYPES: tuple[tuple[torch.dtype, torch.dtype | str], ...] = (
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.float8_e4m3fn),
    (torch.bfloat16, "fp8_ds_mla"),
)
"""``(q, kv)`` dtypes: float32, bf16, per-tensor fp8 and ``fp8_ds_mla`` caches."""
DEFAULT_SPARSE_DECODE_PATTERNS: tuple[tuple[int, ...], ...] = ((1,), (1, 1, 1), (2, 3), (1, 4, 2))
DEFAULT_SPARSE_PREFILL_PATTERNS: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] = (
    ((5,), (0,)),
    ((3, 7), (20, 0)),
    ((1, 4, 2), (9, 30, 0)),
)
"""``(q_lens, context_lens)`` of prefill steps: with and without cached context."""


def sparse_cases(
    *,
    phase: SparsePhase = "decode",
    heads: Sequence[int] = DEFAULT_SPARSE_HEADS,
    decode_patterns: Sequence[Sequence[int]] = DEFAULT_SPARSE_DECODE_PATTERNS,
    prefill_patterns: Sequence[tuple[Sequence[int], Sequence[int]]] = DEFAULT_SPARSE_PREFILL_PATTERNS,
    block_sizes: Sequence[int] = (1, 16),
    dtypes: Sequence[tuple[torch.dtype, torch.dtype | str]] = DEFAULT_SPARSE_DTYPES,
    topks: Sequence[int] = (8, 64),
    padding: Sequence[PaddingKind] = ("none", "rows", "requests", "both"),
    kv_lora_rank: int = 128,
    rope_dim: int = 32,
    max_seq_len: int = 48,
    index_key_dtype: torch.dtype | str = torch.bfloat16,
    exhaustive: bool = False,
    seed: int = 0,
) -> Iterator[SparseCase]:
    """Sparse cases of one phase over heads x patterns x block sizes x dtypes x top-k (x graph
    padding for decode), pairwise unless ``exhaustive``. Decode seq lens are random in
    ``[qlen, max_seq_len]``; a top-k above a row's window leaves its last columns ``-1``.
    Small dims (128 + 32: ``fp8_ds_mla`` needs a multiple of 128) keep a CPU run fast."""
    patterns: list[tuple[tuple[int, ...], tuple[int, ...]]]
    if phase == "decode":
        patterns = [(tuple(int(q) for q in p), ()) for p in decode_patterns]
        pads: Sequence[PaddingKind] = padding
    else:
        patterns = [(tuple(int(q) for q in p), tuple(int(c) for c in c_)) for p, c_ in prefill_patterns]
        pads = ("none",)
    sizes = (len(heads), len(patterns), len(block_sizes), len(dtypes), len(topks), len(pads))
    for index, (ih, ip, ib, idt, ik, ipad) in enumerate(_combinations(sizes, exhaustive)):
        case_seed = _case_seed(seed, index)
        qlens, contexts = patterns[ip]
        if phase == "decode":
            qlens, seq_lens, extra = _decode_lengths(qlens, max_seq_len, pads[ipad], case_seed)
        else:
            seq_lens, extra = [c + q for c, q in zip(contexts, qlens, strict=True)], 0
        q_dtype, kv_dtype = dtypes[idt]
        yield SparseCase(
            heads=heads[ih],
            qlens=qlens,
            seq_lens=seq_lens,
            phase=phase,
            topk=topks[ik],
            block_size=block_sizes[ib],
            q_dtype=q_dtype,
            kv_dtype=kv_dtype,
            extra_rows=extra,
            kv_lora_rank=kv_lora_rank,
            rope_dim=rope_dim,
            index_key_dtype=index_key_dtype,
            seed=case_seed,
        )


# -- inputs -------------------------------------------------------------------------------------


def encode_latent_cache(
    values: torch.Tensor, kv_dtype: torch.dtype, *, kv_lora_rank: int, kv_scale: float | None = None
) -> torch.Tensor:
    """Cache rows ``[..., W]`` in ``kv_dtype`` of float latent rows ``[..., L+R]``: a float
    dtype as is, per-tensor fp8 as ``value / kv_scale``, ``fp8_ds_mla`` packed
    (:func:`~mla.providers.formats.pack_ds_mla`). NaN rows stay NaN (``fp8_ds_mla``: NaN tile
    scales and rope)."""
    lead = values.shape[:-1]
    flat = values.reshape(-1, values.shape[-1]).to(torch.float32)
    if is_ds_mla(kv_dtype):
        rows = pack_ds_mla(flat[:, :kv_lora_rank], flat[:, kv_lora_rank:])
    else:
        rows = _cache_values(flat, kv_dtype, kv_scale)
    return rows.reshape(*lead, rows.shape[-1])


def poisoned_index_cache(
    spec: IndexerSpec, num_blocks: int, block_size: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """An index-key cache of ``spec``'s layout filled with NaN (fp8: every byte ``0xFF``, an e4m3
    NaN value and a NaN float32 scale), so a key read that its row may not see shows up."""
    shape = (num_blocks, block_size, spec.row_width)
    if spec.is_fp8:
        return torch.full(shape, 0xFF, dtype=torch.uint8, device=device)
    return torch.full(shape, math.nan, dtype=spec.storage_dtype, device=device)


@attrs.frozen(eq=False)
class SparseInputs(_PagedInputs):
    """Random inputs of one :class:`SparseCase` on one device (see :func:`make_sparse_inputs`)."""

    case: SparseCase
    q: torch.Tensor
    """``[T, H, L+R]`` in ``case.q_dtype``."""
    kv_cache: torch.Tensor
    """``[num_blocks, block_size, W]`` in the case's format; NaN wherever no row of the owning
    request selected the position (and in every block no request owns)."""
    kv_scale: float | None
    block_table: torch.Tensor
    """int32 ``[B, max_blocks]`` over a random block permutation (stale columns past a
    request's blocks)."""
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    topk_indices: torch.Tensor
    """int32 ``[T, columns]``: request-local positions inside each row's window, ``-1`` pads."""

    @property
    def num_blocks(self) -> int:
        return int(self.kv_cache.shape[0])

    def reference(self) -> tuple[torch.Tensor, torch.Tensor]:
        """float64 ``(out [T, H, L], lse [T, H])`` on the CPU."""
        return self._reference_with(reference_sparse, self.topk_indices)

    def step(self) -> StepInputs:
        """The batch as a decode-only or a prefill-only engine step."""
        return self._step(decode=self.case.phase == "decode")

    def slots(self) -> list[list[int]]:
        """Per request, the flat cache slot of each of its positions ``0 .. seq_len - 1``."""
        table = self.block_table.cpu().to(torch.int64)
        bs = self.case.block_size
        return [
            [int(table[b, p // bs]) * bs + p % bs for p in range(seq)]
            for b, seq in enumerate(self.case.seq_lens)
        ]


def random_selection(case: SparseCase, gen: torch.Generator) -> torch.Tensor:
    """int32 ``[T, columns]`` request-local positions: each row picks distinct positions of its
    window (many rows as many as fit, others fewer, an occasional one none) and scatters them
    over random columns, ``-1`` elsewhere; the first row of each request leaves at least one
    ``-1`` between its positions; padding rows hold only ``-1``."""
    columns = case.columns
    out = torch.full((case.num_tokens, columns), -1, dtype=torch.int32)
    rng = random.Random(case.seed + 7)
    row = 0
    for b, qlen in enumerate(case.qlens):
        for i in range(qlen):
            window = case.window(b, i)
            most = min(columns, window)
            if i == 0:
                count = min(most, max(0, columns - 1 - rng.randint(0, 2)))
            else:
                count = rng.choice((most, most, rng.randint(0, most)))
            if count:
                chosen = torch.randperm(window, generator=gen)[:count].to(torch.int32)
                where = torch.randperm(columns, generator=gen)[:count]
                out[row, where] = chosen
            row += 1
    return out


def make_sparse_inputs(case: SparseCase, device: torch.device | str = "cpu") -> SparseInputs:
    """Random q, the selection, and a paged cache over a random block permutation whose rows are
    ``N(0, 1)`` where a row of the owning request selected the position and NaN everywhere else
    (fp8 caches quantized with ``case.kv_scale``). Deterministic per ``case.seed``."""
    gen = torch.Generator().manual_seed(case.seed)
    table, num_blocks = _paged_table([max(1, s) for s in case.seq_lens], case.block_size, gen)
    selection = random_selection(case, gen)
    values = torch.full((num_blocks * case.block_size, case.latent_dim), math.nan)
    table64 = table.to(torch.int64)
    qsl = indptr(case.qlens)
    for b, seq in enumerate(case.seq_lens):
        rows = selection[int(qsl[b]) : int(qsl[b + 1])].to(torch.int64)
        chosen = torch.unique(rows[rows >= 0])
        chosen = chosen[chosen < seq]
        slots = table64[b, chosen // case.block_size] * case.block_size + chosen % case.block_size
        values[slots] = torch.randn(chosen.numel(), case.latent_dim, generator=gen)
    cache = encode_latent_cache(
        values, case.kv_dtype, kv_lora_rank=case.kv_lora_rank, kv_scale=case.kv_scale_or_none
    ).view(num_blocks, case.block_size, -1)
    q = torch.randn(case.num_tokens, case.heads, case.latent_dim, generator=gen).to(case.q_dtype)
    return SparseInputs(
        **_paged_fields(case, device, q=q, kv_cache=cache, block_table=table, query_start_loc=qsl),
        topk_indices=selection.to(torch.device(device)),
    )


__all__ = [
    "DEFAULT_SPARSE_DTYPES",
    "SELECTION_POISON",
    "SparseCase",
    "SparseInputs",
    "SparsePhase",
    "encode_latent_cache",
    "make_sparse_inputs",
    "poisoned_index_cache",
    "random_selection",
    "sparse_cases",
]
