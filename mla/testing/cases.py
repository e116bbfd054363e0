"""Case records and generators: one decode or prefill batch described by its lengths, geometry
and dtypes, and pairwise selections of them over the factors that change a strategy's path."""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterator, Sequence
from typing import Literal

import attrs
import torch

from mla.core.config import FLOAT_DTYPES, MLADims, dtype_name, is_fp8

DEFAULT_FP8_KV_SCALE = 0.05
"""Per-tensor dequant scale of generated fp8 caches (values ``N(0, 1)`` stored as ``x / 0.05``)."""


def pairwise(sizes: Sequence[int]) -> list[tuple[int, ...]]:
    """Index combinations over factors of the given sizes that cover every pair of values of
    every two factors (all-pairs, deterministic, by ``allpairspy``): about ``max(a * b)``
    combinations for the two largest factors, instead of the full product."""
    if any(n <= 0 for n in sizes):
        return []
    if len(sizes) < 2:
        return [tuple(combo) for combo in itertools.product(*(range(n) for n in sizes))]
    try:
        from allpairspy import AllPairs  # noqa: PLC0415 (from the test extra; only needed here)
    except ImportError as exc:  # pragma: no cover - the test extra installs it
        raise ImportError(
            "mla.testing's pairwise case selection needs allpairspy: pip install 'mla[test]'"
        ) from exc
    return [tuple(int(i) for i in row) for row in AllPairs([list(range(n)) for n in sizes])]


def _combinations(sizes: Sequence[int], exhaustive: bool) -> list[tuple[int, ...]]:
    if exhaustive:
        return list(itertools.product(*(range(n) for n in sizes)))
    return pairwise(sizes)


def _tuple_of_ints(value: Sequence[int]) -> tuple[int, ...]:
    return tuple(int(v) for v in value)


def _optional_tuple(value: Sequence[int] | None) -> tuple[int, ...] | None:
    return None if value is None else _tuple_of_ints(value)


def _short(dtype: torch.dtype) -> str:
    return {
        torch.float32: "f32",
        torch.float16: "f16",
        torch.bfloat16: "bf16",
        torch.float8_e4m3fn: "fp8e4m3",
        torch.float8_e4m3fnuz: "fp8e4m3fnuz",
        torch.float8_e5m2: "fp8e5m2",
    }.get(dtype, dtype_name(dtype))


def _join(values: Sequence[int]) -> str:
    return ".".join(str(v) for v in values)


class _PagedBatch:
    """What a decode-shaped batch's case records share (:class:`DecodeCase`,
    :class:`~mla.testing.SparseCase`): its requests' rows and the latent geometry, and the one
    statement of the rules its lengths, q dtype and ``max_decode_qlen`` follow."""

    __slots__ = ()
    heads: int
    qlens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    block_size: int
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    kv_scale: float
    extra_rows: int
    kv_lora_rank: int
    rope_dim: int
    max_decode_qlen: int | None
    softmax_scale: float | None

    def _check_requests(self) -> None:
        """Each request's ``0 <= qlen <= seq_len`` (or ``seq_len == 0``, a graph-padding one)."""
        if not self.qlens or len(self.qlens) != len(self.seq_lens):
            raise ValueError(f"need one qlen per seq_len (at least one request): {self}")
        for qlen, seq in zip(self.qlens, self.seq_lens, strict=True):
            if qlen < 0 or seq < 0 or 0 < seq < qlen:
                raise ValueError(
                    f"request with qlen {qlen}, seq_len {seq}: need 0 <= qlen <= seq_len or seq_len 0"
                )

    def _check_q_dtype(self) -> None:
        if self.q_dtype not in FLOAT_DTYPES:
            raise ValueError(f"q_dtype must be bf16/fp16/fp32, got {self.q_dtype}")

    def _check_max_decode_qlen(self) -> None:
        if self.max_decode_qlen is not None and self.max_decode_qlen < self.max_qlen:
            raise ValueError(f"max_decode_qlen {self.max_decode_qlen} < the batch's max qlen {self.max_qlen}")

    @property
    def num_requests(self) -> int:
        return len(self.qlens)

    @property
    def num_tokens(self) -> int:
        """Rows of q: the requests' tokens plus the extra padding rows."""
        return sum(self.qlens) + self.extra_rows

    @property
    def max_qlen(self) -> int:
        return max(1, *self.qlens)

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.rope_dim

    @property
    def scale(self) -> float:
        return self.softmax_scale if self.softmax_scale is not None else 1.0 / math.sqrt(self.latent_dim)

    @property
    def kv_is_fp8(self) -> bool:
        return is_fp8(self.kv_dtype)

    @property
    def kv_scale_or_none(self) -> float | None:
        """``kv_scale`` for a per-tensor fp8 cache, else ``None``."""
        return self.kv_scale if self.kv_is_fp8 else None

    def _dims(self, index_topk: int | None = None) -> MLADims:
        return MLADims(
            num_heads=self.heads,
            kv_lora_rank=self.kv_lora_rank,
            qk_rope_head_dim=self.rope_dim,
            softmax_scale=self.scale,
            index_topk=index_topk,
        )


@attrs.frozen
class DecodeCase(_PagedBatch):
    """One decode batch to check: per-request query and KV lengths, geometry and dtypes.

    A request with ``seq_len == 0`` is a graph-padding request (any qlen, its rows give zeros and
    ``-inf``); ``extra_rows`` rows of q past ``query_start_loc[-1]`` belong to no request (CUDA
    graph padding). ``seq_len`` counts the KV including the request's new tokens.
    """

    heads: int
    qlens: tuple[int, ...] = attrs.field(converter=_tuple_of_ints)
    seq_lens: tuple[int, ...] = attrs.field(converter=_tuple_of_ints)
    block_size: int = 16
    q_dtype: torch.dtype = torch.bfloat16
    kv_dtype: torch.dtype = torch.bfloat16
    kv_scale: float = DEFAULT_FP8_KV_SCALE
    """Dequant scale of an fp8 cache (ignored for float caches)."""
    extra_rows: int = 0
    kv_lora_rank: int = 512
    rope_dim: int = 64
    max_decode_qlen: int | None = None
    """The engine's largest decode qlen (buffers are sized for it); default: the batch's."""
    seed: int = 0
    softmax_scale: float | None = None
    """Default ``1/sqrt(kv_lora_rank + rope_dim)`` (scores of unit variance on random data)."""

    def __attrs_post_init__(self) -> None:
        if self.heads <= 0 or self.block_size <= 0 or self.kv_lora_rank <= 0 or self.rope_dim <= 0:
            raise ValueError(f"heads, block_size and dims must be > 0: {self}")
        self._check_requests()
        if self.extra_rows < 0 or self.num_tokens == 0:
            raise ValueError(f"the batch needs at least one query row: {self}")
        self._check_q_dtype()
        if self.kv_dtype not in FLOAT_DTYPES and not is_fp8(self.kv_dtype):
            raise ValueError(f"kv_dtype must be a float or fp8 dtype, got {self.kv_dtype}")
        self._check_max_decode_qlen()

    @property
    def id(self) -> str:
        """A readable pytest id: heads, qlens, seq lens, block size, dtypes, padding, dims."""
        pad = f"-x{self.extra_rows}" if self.extra_rows else ""
        return (
            f"h{self.heads}-q{_join(self.qlens)}-s{_join(self.seq_lens)}-bs{self.block_size}-"
            f"{_short(self.q_dtype)}-{_short(self.kv_dtype)}{pad}-d{self.kv_lora_rank}+{self.rope_dim}"
        )


DEFAULT_DECODE_HEADS = (1, 2, 4, 8, 12, 16, 24, 32, 128)
DEFAULT_QLEN_PATTERNS: tuple[tuple[int, ...], ...] = (
    *((q, q) for q in range(1, 9)),
    (1, 3, 2),
    (4, 1),
    (2, 7, 5),
    (8, 3),
)
"""Uniform batches of qlen 1..8 and mixed ones."""
PaddingKind = Literal["none", "rows", "requests", "both"]
DEFAULT_PADDING: tuple[PaddingKind, ...] = ("none", "rows", "requests", "both")
"""``rows``: 2 trailing rows owned by no request; ``requests``: an extra request of the batch's
qlen with ``seq_len 0``; ``both``: an extra request of qlen 0 and ``seq_len 0`` plus trailing rows
for it (vLLM's uniform graph-padding shape)."""


def _padded(
    qlens: tuple[int, ...], seq_lens: list[int], padding: PaddingKind
) -> tuple[tuple[int, ...], list[int], int]:
    top = max(qlens)
    if padding == "rows":
        return qlens, seq_lens, 2
    if padding == "requests":
        return (*qlens, top), [*seq_lens, 0], 0
    if padding == "both":
        return (*qlens, 0), [*seq_lens, 0], top
    return qlens, seq_lens, 0


def _case_seed(seed: int, index: int) -> int:
    r"""The seed of a generator's ``index``-th case (distinct across indices and ``seed``\ s)."""
    return seed * 1_000_003 + index


def _decode_lengths(
    qlens: tuple[int, ...], max_seq_len: int, padding: PaddingKind, case_seed: int
) -> tuple[tuple[int, ...], list[int], int]:
    """``(qlens, seq_lens, extra_rows)`` of a decode case: seq lens random in
    ``[qlen, max_seq_len]`` (deterministic per ``case_seed``), then ``padding`` added."""
    rng = random.Random(case_seed)
    seq_lens = [rng.randint(max(q, 1), max(max_seq_len, q)) for q in qlens]
    return _padded(qlens, seq_lens, padding)


def decode_cases(
    *,
    heads: Sequence[int] = DEFAULT_DECODE_HEADS,
    qlen_patterns: Sequence[Sequence[int]] = DEFAULT_QLEN_PATTERNS,
    block_sizes: Sequence[int] = (1, 16, 64),
    dtypes: Sequence[tuple[torch.dtype, torch.dtype]] = (
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float8_e4m3fn),
    ),
    padding: Sequence[PaddingKind] = DEFAULT_PADDING,
    kv_lora_rank: int = 64,
    rope_dim: int = 16,
    max_seq_len: int = 80,
    max_decode_qlen: int | None = None,
    exhaustive: bool = False,
    seed: int = 0,
) -> Iterator[DecodeCase]:
    """Decode cases over heads x qlen patterns x block sizes x ``(q, kv)`` dtypes x padding.

    By default a pairwise selection (every pair of values of every two factors appears in some
    case) keeps the count near ``len(heads) * len(qlen_patterns)``; ``exhaustive=True`` yields
    the full product. Seq lens are random in ``[qlen, max_seq_len]`` (deterministic per ``seed``).
    Small default dims (64 + 16) keep a CPU run fast; pass 512/64 for the real geometry.
    """
    patterns = [tuple(int(q) for q in p) for p in qlen_patterns]
    sizes = (len(heads), len(patterns), len(block_sizes), len(dtypes), len(padding))
    for index, (ih, ip, ib, idt, ipad) in enumerate(_combinations(sizes, exhaustive)):
        case_seed = _case_seed(seed, index)
        qlens, seq_lens, extra = _decode_lengths(patterns[ip], max_seq_len, padding[ipad], case_seed)
        q_dtype, kv_dtype = dtypes[idt]
        yield DecodeCase(
            heads=heads[ih],
            qlens=qlens,
            seq_lens=seq_lens,
            block_size=block_sizes[ib],
            q_dtype=q_dtype,
            kv_dtype=kv_dtype,
            extra_rows=extra,
            kv_lora_rank=kv_lora_rank,
            rope_dim=rope_dim,
            max_decode_qlen=max_decode_qlen,
            seed=case_seed,
        )


@attrs.frozen
class PrefillCase:
    """One prefill batch: per-request new-token counts, key counts and cached context.

    ``kv_lens`` (default: ``q_lens``) may exceed ``q_lens`` for the functional API (keys before
    the queries, bottom-right causal). ``context_lens`` (default: none) are cached tokens that the
    backend path reads from a paged cache and expands with :class:`~mla.testing.RandomUpProjection`; a case
    with context needs ``kv_lens == q_lens`` (the backend's new tokens are their own keys).
    ``context_nope_keys``: the up-projection returns the keys' nope lanes alone (the
    ``expand_context`` form whose rope lanes the framework reads from the latent rows).
    """

    heads: int
    q_lens: tuple[int, ...] = attrs.field(converter=_tuple_of_ints)
    kv_lens: tuple[int, ...] | None = attrs.field(default=None, converter=_optional_tuple)
    context_lens: tuple[int, ...] | None = attrs.field(default=None, converter=_optional_tuple)
    dtype: torch.dtype = torch.bfloat16
    causal: bool = True
    qk_nope_dim: int = 128
    rope_dim: int = 64
    v_dim: int = 128
    kv_lora_rank: int = 512
    """Latent width of the cached context rows (plus ``rope_dim``)."""
    kv_dtype: torch.dtype | None = None
    """Cache dtype for the context (default: ``dtype``); fp8 uses ``kv_scale``."""
    kv_scale: float = DEFAULT_FP8_KV_SCALE
    block_size: int = 16
    context_chunk_tokens: int | None = None
    """The backend's context workspace; small values force several chunks per request."""
    context_nope_keys: bool = False
    """The case's up-projection returns ``k_nope [n, H, qk_nope]`` (strided views of one
    ``[n, H, qk_nope + v]`` output) instead of whole keys (``expand_context``'s two forms)."""
    seed: int = 0
    softmax_scale: float | None = None
    """Default ``1/sqrt(qk_nope_dim + rope_dim)`` (DeepSeek's convention)."""

    def __attrs_post_init__(self) -> None:
        if not self.q_lens or min(self.q_lens) < 0 or sum(self.q_lens) == 0:
            raise ValueError(f"need at least one query token and no negative q_lens: {self}")
        for name in ("kv_lens", "context_lens"):
            value = getattr(self, name)
            if value is not None and (len(value) != len(self.q_lens) or min(value) < 0):
                raise ValueError(f"{name} needs one length >= 0 per request: {self}")
        if self.has_context and self.keys != self.q_lens:
            raise ValueError("a case with cached context needs kv_lens == q_lens")
        if self.dtype not in FLOAT_DTYPES:
            raise ValueError(f"dtype must be bf16/fp16/fp32, got {self.dtype}")

    @property
    def keys(self) -> tuple[int, ...]:
        return self.kv_lens if self.kv_lens is not None else self.q_lens

    @property
    def contexts(self) -> tuple[int, ...]:
        return self.context_lens if self.context_lens is not None else (0,) * len(self.q_lens)

    @property
    def has_context(self) -> bool:
        return any(self.contexts)

    @property
    def cache_dtype(self) -> torch.dtype:
        return self.kv_dtype if self.kv_dtype is not None else self.dtype

    @property
    def qk_dim(self) -> int:
        return self.qk_nope_dim + self.rope_dim

    @property
    def scale(self) -> float:
        return self.softmax_scale if self.softmax_scale is not None else 1.0 / math.sqrt(self.qk_dim)

    @property
    def dims(self) -> MLADims:
        return MLADims(
            num_heads=self.heads,
            kv_lora_rank=self.kv_lora_rank,
            qk_rope_head_dim=self.rope_dim,
            qk_nope_head_dim=self.qk_nope_dim,
            v_head_dim=self.v_dim,
            softmax_scale=self.scale,
        )

    @property
    def id(self) -> str:
        kv = f"-k{_join(self.keys)}" if self.kv_lens is not None and self.keys != self.q_lens else ""
        ctx = f"-c{_join(self.contexts)}" if self.has_context else ""
        cache = f"-kv{_short(self.cache_dtype)}" if self.has_context else ""
        chunk = f"-w{self.context_chunk_tokens}" if self.has_context and self.context_chunk_tokens else ""
        chunk += "-knope" if self.has_context and self.context_nope_keys else ""
        mask = "" if self.causal else "-full"
        return (
            f"h{self.heads}-q{_join(self.q_lens)}{kv}{ctx}{chunk}-{_short(self.dtype)}{cache}{mask}-"
            f"d{self.qk_nope_dim}+{self.rope_dim}v{self.v_dim}"
        )


DEFAULT_PREFILL_HEADS = (1, 4, 12, 16, 32)
DEFAULT_PREFILL_LENGTHS: tuple[tuple[tuple[int, ...], tuple[int, ...] | None], ...] = (
    ((5,), None),
    ((3, 17, 1), None),
    ((9, 4), (20, 4)),
    ((1, 12, 6), (1, 30, 6)),
    ((33,), (40,)),
)
"""``(q_lens, kv_lens)`` patterns: equal, several requests, keys longer than queries."""


def prefill_cases(
    *,
    heads: Sequence[int] = DEFAULT_PREFILL_HEADS,
    lengths: Sequence[tuple[Sequence[int], Sequence[int] | None]] = DEFAULT_PREFILL_LENGTHS,
    dtypes: Sequence[torch.dtype] = (torch.float32, torch.bfloat16),
    causal: Sequence[bool] = (True, False),
    qk_nope_dim: int = 32,
    rope_dim: int = 16,
    v_dim: int = 24,
    exhaustive: bool = False,
    seed: int = 0,
) -> Iterator[PrefillCase]:
    """Functional-API prefill cases (no cached context) over heads x lengths x dtypes x mask,
    pairwise unless ``exhaustive``. Small dims by default; 128/64/128 is DeepSeek's."""
    sizes = (len(heads), len(lengths), len(dtypes), len(causal))
    for index, (ih, il, idt, ic) in enumerate(_combinations(sizes, exhaustive)):
        q_lens, kv_lens = lengths[il]
        yield PrefillCase(
            heads=heads[ih],
            q_lens=q_lens,
            kv_lens=kv_lens,
            dtype=dtypes[idt],
            causal=causal[ic],
            qk_nope_dim=qk_nope_dim,
            rope_dim=rope_dim,
            v_dim=v_dim,
            seed=_case_seed(seed, index),
        )


def context_prefill_cases(
    *,
    heads: Sequence[int] = (2, 16),
    dtypes: Sequence[tuple[torch.dtype, torch.dtype]] = (
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float8_e4m3fn),
    ),
    contexts: Sequence[tuple[tuple[int, ...], tuple[int, ...], int | None]] = (
        ((4, 7), (0, 37), None),
        ((6, 2, 3), (21, 0, 50), 48),
        ((5,), (70,), 16),
    ),
    block_sizes: Sequence[int] = (1, 16),
    qk_nope_dim: int = 32,
    rope_dim: int = 16,
    v_dim: int = 24,
    kv_lora_rank: int = 64,
    seed: int = 0,
) -> Iterator[PrefillCase]:
    """Backend prefill cases with cached context: ``(q_lens, context_lens, workspace_tokens)``
    patterns x dtypes x block sizes, pairwise. Small workspaces force several chunks per request
    (a workspace must hold one block per request: ``>= len(q_lens) * block_size``)."""
    sizes = (len(heads), len(dtypes), len(contexts), len(block_sizes))
    for index, (ih, idt, ic, ib) in enumerate(pairwise(sizes)):
        dtype, kv_dtype = dtypes[idt]
        q_lens, context_lens, workspace = contexts[ic]
        yield PrefillCase(
            heads=heads[ih],
            q_lens=q_lens,
            context_lens=context_lens,
            dtype=dtype,
            kv_dtype=kv_dtype,
            block_size=block_sizes[ib],
            context_chunk_tokens=workspace,
            qk_nope_dim=qk_nope_dim,
            rope_dim=rope_dim,
            v_dim=v_dim,
            kv_lora_rank=kv_lora_rank,
            seed=_case_seed(seed, index),
        )
