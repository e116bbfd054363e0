"""The conformance kit: run any strategy on generated cases and compare it to the reference math.

Users run it on their own strategy subclass; the project's own strategy tests use it too::

    from mla.testing import check_decode_strategy, decode_cases, emulated_provider

    for case in decode_cases(heads=(8, 16)):
        result = check_decode_strategy(MyDecode, case, provider="torch", platform="cpu")
        if not result.supported:
            print(f"{MyDecode.NAME}: {result.reasons}")   # pytest.skip(...) in a test
            continue
        result.assert_passed()

A decode check builds an :class:`~mla.backend.MLABackend` sized for the case, forces the
strategy (the resolver runs the same ``supports`` checks as automatic selection), builds the
step's metadata, poisons the caller outputs with NaN, runs ``impl.forward_decode`` and compares
output and LSE to :func:`mla.reference.reference_decode` (float64). Inputs are random, never
zeros; cache blocks are a random permutation, so a strategy that assumes contiguous blocks
fails. Prefill checks run through :func:`mla.mla_prefill` or the backend (optionally with cached
context expanded by a random up-projection and merged by LSE).

Tolerances are relative Frobenius errors per output dtype (:data:`TOLERANCES`). An fp8 KV cache
uses the q/out dtype's tolerance, because the reference dequantizes the very same cache. A
strategy that rounds its inputs to fp8 (it exposes ``quantize(q, k, v)``, like
:class:`~mla.prefill.fp8_persistent.Fp8PersistentPrefill`) is compared with the reference computed
on its dequantized inputs, so the tolerance stays tight.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import random
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Literal

import attrs
import torch
import torch.utils.deterministic as det

from mla.api import mla_prefill
from mla.backend import MLABackend, StepInputs
from mla.config import FLOAT_DTYPES, EngineLimits, KVCacheSpec, MLADims, dtype_name, is_fp8
from mla.decode.base import DecodeStrategy
from mla.errors import UnsupportedError
from mla.explain import Explanation
from mla.platform import Platform, simulated_platform
from mla.prefill.base import PrefillStrategy
from mla.providers import emulated_provider, resolve_provider
from mla.providers.base import KernelProvider
from mla.quant import dequantize
from mla.reference import reference_decode, reference_prefill
from mla.registry import DEFAULT_REGISTRY, AnyStrategy, Registry
from mla.resolver import Resolver
from mla.strategy import Phase, StrategySetup
from mla.support import Reason, Support

__all__ = [
    "TOLERANCES",
    "CachedContext",
    "CheckResult",
    "Comparison",
    "DecodeCase",
    "DecodeInputs",
    "PrefillCase",
    "PrefillInputs",
    "RandomUpProjection",
    "assert_matches_reference",
    "check_decode_strategy",
    "check_prefill_strategy",
    "compare_to_reference",
    "context_prefill_cases",
    "decode_cases",
    "decode_support",
    "emulated_provider",
    "make_decode_inputs",
    "make_prefill_inputs",
    "pairwise",
    "poisoned_empty",
    "prefill_cases",
    "rounded_inputs",
    "scratch_registry",
    "tolerance_for",
]

TOLERANCES: Mapping[torch.dtype, float] = {
    torch.float32: 1e-5,
    torch.float16: 5e-3,
    torch.bfloat16: 2e-2,
}
"""Largest relative Frobenius error of the output (and relative LSE error) per output dtype."""

DEFAULT_FP8_KV_SCALE = 0.05
"""Per-tensor dequant scale of generated fp8 caches (values ``N(0, 1)`` stored as ``x / 0.05``)."""


def tolerance_for(dtype: torch.dtype) -> float:
    """The tolerance for outputs of ``dtype`` (bf16, fp16 or fp32)."""
    if dtype not in TOLERANCES:
        known = ", ".join(dtype_name(d) for d in TOLERANCES)
        raise ValueError(f"no tolerance for output dtype {dtype_name(dtype)}; known: {known}")
    return TOLERANCES[dtype]


# -- comparison ------------------------------------------------------------------------------


@attrs.frozen
class Comparison:
    """How far a strategy's ``(out, lse)`` is from the float64 reference."""

    dtype: torch.dtype
    """The output dtype (decides the tolerance)."""
    tolerance: float
    out_error: float
    """``||out - ref|| / ||ref||`` (Frobenius, float64); NaN when ``out`` has NaNs."""
    lse_error: float
    """Largest ``|lse - ref| / (1 + |ref|)`` over entries finite in both."""
    unwritten_rows: int
    """Token rows whose output or LSE still holds the NaN poison."""
    lse_inf_mismatches: int
    """LSE entries that are ``-inf`` in exactly one of the result and the reference."""

    @property
    def ok(self) -> bool:
        return (
            self.unwritten_rows == 0
            and self.lse_inf_mismatches == 0
            and self.out_error <= self.tolerance
            and self.lse_error <= self.tolerance
        )

    def __str__(self) -> str:
        verdict = "ok" if self.ok else "MISMATCH"
        return (
            f"{verdict}: out rel. error {self.out_error:.3g}, lse rel. error {self.lse_error:.3g} "
            f"(tolerance {self.tolerance:g} for {dtype_name(self.dtype)}), "
            f"{self.unwritten_rows} unwritten rows, {self.lse_inf_mismatches} -inf LSE mismatches"
        )


def compare_to_reference(
    out: torch.Tensor,
    lse: torch.Tensor,
    ref_out: torch.Tensor,
    ref_lse: torch.Tensor,
    *,
    tolerance: float | None = None,
) -> Comparison:
    """Compare ``out [T, H, D]`` / ``lse [T, H]`` with the reference (any device, any float dtype).

    Rows of ``ref_lse`` that are ``-inf`` (no visible key, graph padding) must be ``-inf`` in
    ``lse`` too, and their output rows zero (they count in the Frobenius error). ``tolerance``
    defaults to :func:`tolerance_for` the output dtype.
    """
    if out.shape != ref_out.shape or lse.shape != ref_lse.shape:
        raise ValueError(
            f"shapes differ: out {tuple(out.shape)} vs {tuple(ref_out.shape)}, "
            f"lse {tuple(lse.shape)} vs {tuple(ref_lse.shape)}"
        )
    tol = tolerance_for(out.dtype) if tolerance is None else tolerance
    o, r = out.detach().cpu().to(torch.float64), ref_out.detach().cpu().to(torch.float64)
    lse_d, ref_lse_d = lse.detach().cpu().to(torch.float64), ref_lse.detach().cpu().to(torch.float64)
    nan_rows = torch.isnan(o).flatten(1).any(1) | torch.isnan(lse_d).flatten(1).any(1)
    denom = float(torch.linalg.vector_norm(r))
    out_error = float(torch.linalg.vector_norm(o - r)) / (denom if denom > 0 else 1.0)
    inf_mismatch = torch.isneginf(lse_d) != torch.isneginf(ref_lse_d)
    finite = torch.isfinite(lse_d) & torch.isfinite(ref_lse_d)
    lse_rel = (lse_d - ref_lse_d).abs() / (1.0 + ref_lse_d.abs())
    lse_error = float(lse_rel[finite].max()) if bool(finite.any()) else 0.0
    if bool(torch.isnan(lse_d).any()):
        lse_error = math.nan
    return Comparison(
        dtype=out.dtype,
        tolerance=tol,
        out_error=out_error,
        lse_error=lse_error,
        unwritten_rows=int(nan_rows.sum()),
        lse_inf_mismatches=int((inf_mismatch & ~torch.isnan(lse_d)).sum()),
    )


def assert_matches_reference(
    out: torch.Tensor,
    lse: torch.Tensor,
    ref_out: torch.Tensor,
    ref_lse: torch.Tensor,
    *,
    context: str = "",
) -> Comparison:
    """:func:`compare_to_reference`, raising ``AssertionError`` (with the numbers) on a mismatch."""
    comparison = compare_to_reference(out, lse, ref_out, ref_lse)
    if not comparison.ok:
        prefix = f"{context}: " if context else ""
        raise AssertionError(f"{prefix}{comparison}")
    return comparison


@contextlib.contextmanager
def poisoned_empty() -> Iterator[None]:
    """Within the block, ``torch.empty`` fills float tensors with NaN (integers with their max).

    Poisons outputs that a function allocates itself (``mla_decode``/``mla_prefill``), so rows it
    forgets to write show up as NaN. Uses PyTorch's deterministic mode in warn-only form and
    restores the previous state on exit.
    """
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    fill = bool(getattr(det, "fill_uninitialized_memory", False))
    torch.use_deterministic_algorithms(True, warn_only=True)
    setattr(det, "fill_uninitialized_memory", True)  # noqa: B010 (untyped module attribute)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*does not have a deterministic implementation.*")
            yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
        setattr(det, "fill_uninitialized_memory", fill)  # noqa: B010


# -- providers and registries ----------------------------------------------------------------


def scratch_registry(
    extra: Sequence[tuple[AnyStrategy, int]] = (), *, base: Registry = DEFAULT_REGISTRY
) -> Registry:
    """A fresh registry holding ``base``'s registrations (as narrowed by an active override) plus
    ``extra`` ``(strategy, priority)`` pairs, so a test can register a strategy without touching
    the default registry."""
    registry = Registry()
    for phase in Phase:
        for reg in base.entries(phase):
            registry.register(reg.strategy, priority=reg.priority)
    for strategy, priority in extra:
        registry.register(strategy, priority=priority)
    return registry


def _platform(platform: Platform | str) -> Platform:
    return simulated_platform(platform) if isinstance(platform, str) else platform


def _device(platform: Platform, device: torch.device | str | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    return torch.device("cuda" if platform.is_gpu else "cpu")


# -- case generation -------------------------------------------------------------------------


def pairwise(sizes: Sequence[int]) -> list[tuple[int, ...]]:
    """Index combinations over factors of the given sizes that cover every pair of values of
    every two factors (greedy all-pairs, deterministic): about ``max(a * b)`` combinations for
    the two largest factors, instead of the full product."""
    if any(n <= 0 for n in sizes):
        return []
    if len(sizes) < 2:
        return [tuple(combo) for combo in itertools.product(*(range(n) for n in sizes))]
    uncovered = {
        (i, a, j, b)
        for i, j in itertools.combinations(range(len(sizes)), 2)
        for a in range(sizes[i])
        for b in range(sizes[j])
    }
    rows: list[tuple[int, ...]] = []
    while uncovered:
        i, a, j, b = min(uncovered)
        row: dict[int, int] = {i: a, j: b}
        for k in range(len(sizes)):
            if k not in row:
                gains = [_pair_gain(uncovered, row, k, v) for v in range(sizes[k])]
                row[k] = gains.index(max(gains))
        full = tuple(row[k] for k in range(len(sizes)))
        rows.append(full)
        for p, q in itertools.combinations(range(len(sizes)), 2):
            uncovered.discard((p, full[p], q, full[q]))
    return rows


def _pair_gain(uncovered: set[tuple[int, int, int, int]], row: dict[int, int], k: int, value: int) -> int:
    """Uncovered pairs that setting factor ``k`` to ``value`` would cover in ``row``."""
    return sum(
        ((m, chosen, k, value) if m < k else (k, value, m, chosen)) in uncovered for m, chosen in row.items()
    )


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


@attrs.frozen
class DecodeCase:
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
        if not self.qlens or len(self.qlens) != len(self.seq_lens):
            raise ValueError(f"need one qlen per seq_len (at least one request): {self}")
        for qlen, seq in zip(self.qlens, self.seq_lens, strict=True):
            if qlen < 0 or seq < 0 or 0 < seq < qlen:
                raise ValueError(
                    f"request with qlen {qlen}, seq_len {seq}: need 0 <= qlen <= seq_len or seq_len 0"
                )
        if self.extra_rows < 0 or self.num_tokens == 0:
            raise ValueError(f"the batch needs at least one query row: {self}")
        if self.q_dtype not in FLOAT_DTYPES:
            raise ValueError(f"q_dtype must be bf16/fp16/fp32, got {self.q_dtype}")
        if self.kv_dtype not in FLOAT_DTYPES and not is_fp8(self.kv_dtype):
            raise ValueError(f"kv_dtype must be a float or fp8 dtype, got {self.kv_dtype}")
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
        case_seed = seed * 1_000_003 + index
        rng = random.Random(case_seed)
        seq_lens = [rng.randint(max(q, 1), max(max_seq_len, q)) for q in patterns[ip]]
        qlens, seq_lens, extra = _padded(patterns[ip], seq_lens, padding[ipad])
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


# -- inputs ----------------------------------------------------------------------------------


def _paged_table(
    seq_lens: Sequence[int], block_size: int, gen: torch.Generator, *, spare_blocks: int = 2
) -> tuple[torch.Tensor, int]:
    """A block table over a random permutation of blocks (never contiguous by construction);
    columns past a request's last block hold stale (valid but unrelated) ids."""
    needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(needed) + spare_blocks
    width = max(needed) + 1
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.randint(0, num_blocks, (len(seq_lens), width), generator=gen, dtype=torch.int64)
    cursor = 0
    for b, n in enumerate(needed):
        table[b, :n] = perm[cursor : cursor + n]
        cursor += n
    return table.to(torch.int32), num_blocks


def _random_cache(
    num_blocks: int,
    block_size: int,
    width: int,
    dtype: torch.dtype,
    kv_scale: float,
    gen: torch.Generator,
) -> torch.Tensor:
    values = torch.randn(num_blocks, block_size, width, generator=gen)
    if is_fp8(dtype):
        finfo = torch.finfo(dtype)
        return torch.clamp(values / kv_scale, finfo.min, finfo.max).to(dtype)
    return values.to(dtype)


def _indptr(lengths: Sequence[int]) -> torch.Tensor:
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    out[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0).to(torch.int32)
    return out


@attrs.frozen(eq=False)
class DecodeInputs:
    """Random inputs of one :class:`DecodeCase` on one device (see :func:`make_decode_inputs`)."""

    case: DecodeCase
    q: torch.Tensor
    """``[T, H, L+R]`` in ``case.q_dtype`` (padding rows random too)."""
    kv_cache: torch.Tensor
    """``[num_blocks, block_size, L+R]`` in ``case.kv_dtype`` (fp8: ``value / kv_scale``)."""
    kv_scale: float | None
    """``case.kv_scale`` for an fp8 cache, else ``None``."""
    block_table: torch.Tensor
    """int32 ``[B, max_blocks]``."""
    seq_lens: torch.Tensor
    """int32 ``[B]``."""
    query_start_loc: torch.Tensor
    """int32 ``[B+1]``."""

    def reference(self) -> tuple[torch.Tensor, torch.Tensor]:
        """float64 ``(out [T, H, L], lse [T, H])`` on the CPU (DESIGN §5)."""
        return reference_decode(
            self.q,
            self.kv_cache,
            self.block_table,
            self.seq_lens,
            self.query_start_loc,
            softmax_scale=self.case.scale,
            kv_lora_rank=self.case.kv_lora_rank,
            kv_scale=self.kv_scale,
        )

    def step(self) -> StepInputs:
        """The batch as a decode-only engine step."""
        qsl = self.query_start_loc
        return StepInputs(
            query_start_loc_cpu=qsl.cpu(),
            query_start_loc=qsl,
            seq_lens=self.seq_lens,
            seq_lens_cpu=self.seq_lens.cpu(),
            block_table=self.block_table,
            num_decodes=self.case.num_requests,
            num_decode_tokens=self.case.num_tokens,
        )

    def poisoned_outputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """NaN-filled ``out [T, H, L]`` (q dtype) and ``lse [T, H]`` (float32)."""
        case, dev = self.case, self.q.device
        out = torch.full(
            (case.num_tokens, case.heads, case.kv_lora_rank), math.nan, dtype=case.q_dtype, device=dev
        )
        lse = torch.full((case.num_tokens, case.heads), math.nan, dtype=torch.float32, device=dev)
        return out, lse


def make_decode_inputs(case: DecodeCase, device: torch.device | str = "cpu") -> DecodeInputs:
    """Random q, a paged cache over a random block permutation (fp8 caches quantized with
    ``case.kv_scale``), int32 block table, seq lens and query_start_loc. Deterministic per
    ``case.seed``; values are ``N(0, 1)``, never zeros."""
    gen = torch.Generator().manual_seed(case.seed)
    table, num_blocks = _paged_table(case.seq_lens, case.block_size, gen)
    cache = _random_cache(num_blocks, case.block_size, case.latent_dim, case.kv_dtype, case.kv_scale, gen)
    q = torch.randn(case.num_tokens, case.heads, case.latent_dim, generator=gen).to(case.q_dtype)
    dev = torch.device(device)
    return DecodeInputs(
        case=case,
        q=q.to(dev),
        kv_cache=cache.to(dev),
        kv_scale=case.kv_scale if case.kv_is_fp8 else None,
        block_table=table.to(dev),
        seq_lens=torch.tensor(case.seq_lens, dtype=torch.int32, device=dev),
        query_start_loc=_indptr(case.qlens).to(dev),
    )


@attrs.frozen
class PrefillCase:
    """One prefill batch: per-request new-token counts, key counts and cached context.

    ``kv_lens`` (default: ``q_lens``) may exceed ``q_lens`` for the functional API (keys before
    the queries, bottom-right causal). ``context_lens`` (default: none) are cached tokens that the
    backend path reads from a paged cache and expands with :class:`RandomUpProjection`; a case
    with context needs ``kv_lens == q_lens`` (the backend's new tokens are their own keys).
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
        mask = "" if self.causal else "-full"
        return (
            f"h{self.heads}-q{_join(self.q_lens)}{kv}{ctx}{chunk}-{_short(self.dtype)}{cache}{mask}-"
            f"d{self.qk_nope_dim}+{self.rope_dim}v{self.v_dim}"
        )


@attrs.define
class RandomUpProjection:
    """A random ``kv_b_proj`` stand-in: latent rows ``[n, L+R]`` -> ``k [n, H, nope+R]``,
    ``v [n, H, Dv]`` (``k_nope``/``v`` from the first ``L`` lanes, the rope lanes shared by every
    head). Outputs in the input dtype; math in float32."""

    w_k: torch.Tensor
    """float32 ``[L, H, nope]``."""
    w_v: torch.Tensor
    """float32 ``[L, H, Dv]``."""
    kv_lora_rank: int

    @classmethod
    def random(cls, case: PrefillCase, gen: torch.Generator, device: torch.device) -> RandomUpProjection:
        rank, heads = case.kv_lora_rank, case.heads
        w_k = torch.randn(rank, heads, case.qk_nope_dim, generator=gen) / math.sqrt(rank)
        w_v = torch.randn(rank, heads, case.v_dim, generator=gen) / math.sqrt(rank)
        return cls(w_k.to(device), w_v.to(device), rank)

    def __call__(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        nope = latent[:, : self.kv_lora_rank].to(torch.float32)
        rope = latent[:, self.kv_lora_rank :].to(torch.float32)
        heads = self.w_k.shape[1]
        k_nope = torch.einsum("nl,lhd->nhd", nope, self.w_k)
        k = torch.cat([k_nope, rope[:, None, :].expand(-1, heads, -1)], dim=-1)
        v = torch.einsum("nl,lhd->nhd", nope, self.w_v)
        return k.to(latent.dtype), v.to(latent.dtype)


@attrs.frozen(eq=False)
class CachedContext:
    """The cached-context half of a backend prefill step."""

    kv_cache: torch.Tensor
    """``[num_blocks, block_size, L+R]`` (random permutation of blocks)."""
    kv_scale: float | None
    block_table: torch.Tensor
    """int32 ``[P, max_blocks]`` covering context + new tokens."""
    seq_lens: torch.Tensor
    """int32 ``[P]``: context + new tokens."""
    expand: RandomUpProjection


@attrs.frozen(eq=False)
class PrefillInputs:
    """Random inputs of one :class:`PrefillCase` (see :func:`make_prefill_inputs`)."""

    case: PrefillCase
    q: torch.Tensor
    """``[T, H, nope+R]``."""
    k: torch.Tensor
    """``[Tk, H, nope+R]`` (new tokens' keys)."""
    v: torch.Tensor
    """``[Tk, H, Dv]``."""
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    context: CachedContext

    def context_kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per request, the expanded ``(k, v)`` of its cached context, computed as a strategy
        must: gather, dequantize (fp8), cast to the model dtype, up-project."""
        case, ctx = self.case, self.context
        flat = ctx.kv_cache.view(-1, ctx.kv_cache.shape[-1])
        table = ctx.block_table.cpu().to(torch.int64)
        parts = []
        for b, count in enumerate(case.contexts):
            pos = torch.arange(count)
            slots = (table[b, pos // case.block_size] * case.block_size + pos % case.block_size).to(
                flat.device
            )
            latent = flat[slots].to(torch.float32)
            if ctx.kv_scale is not None:
                latent = latent * ctx.kv_scale
            parts.append(ctx.expand(latent.to(case.dtype)))
        return parts

    def reference(
        self,
        q: torch.Tensor | None = None,
        k: torch.Tensor | None = None,
        v: torch.Tensor | None = None,
        *,
        with_context: bool | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """float64 ``(out, lse)`` over ``[context | new keys]`` per request (bottom-right causal).

        ``q``/``k``/``v`` replace the inputs (e.g. by a strategy's dequantized fp8 inputs).
        ``with_context`` defaults to whether the case has context.
        """
        q = self.q if q is None else q
        k = self.k if k is None else k
        v = self.v if v is None else v
        use_context = self.case.has_context if with_context is None else with_context
        if not use_context:
            return reference_prefill(
                q,
                k,
                v,
                self.cu_seqlens_q,
                self.cu_seqlens_k,
                softmax_scale=self.case.scale,
                causal=self.case.causal,
            )
        cu_k = self.cu_seqlens_k.cpu().to(torch.int64)
        keys, values, lengths = [], [], []
        for b, (k_ctx, v_ctx) in enumerate(self.context_kv()):
            k0, k1 = int(cu_k[b]), int(cu_k[b + 1])
            keys.append(torch.cat([k_ctx.cpu(), k[k0:k1].cpu()]))
            values.append(torch.cat([v_ctx.cpu(), v[k0:k1].cpu()]))
            lengths.append(keys[-1].shape[0])
        return reference_prefill(
            q,
            torch.cat(keys),
            torch.cat(values),
            self.cu_seqlens_q,
            _indptr(lengths),
            softmax_scale=self.case.scale,
            causal=self.case.causal,
        )

    def step(self) -> StepInputs:
        """The batch as a prefill-only engine step (new tokens are their own keys)."""
        cu = self.cu_seqlens_q
        return StepInputs(
            query_start_loc_cpu=cu.cpu(),
            query_start_loc=cu,
            seq_lens=self.context.seq_lens,
            seq_lens_cpu=self.context.seq_lens.cpu(),
            block_table=self.context.block_table,
            num_decodes=0,
            num_decode_tokens=0,
        )

    def poisoned_outputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        case, dev = self.case, self.q.device
        tokens = self.q.shape[0]
        out = torch.full((tokens, case.heads, case.v_dim), math.nan, dtype=case.dtype, device=dev)
        lse = torch.full((tokens, case.heads), math.nan, dtype=torch.float32, device=dev)
        return out, lse


def make_prefill_inputs(case: PrefillCase, device: torch.device | str = "cpu") -> PrefillInputs:
    """Random q/k/v (``N(0, 1)``), cu_seqlens, and the cached context: a paged latent cache over
    a random block permutation, its block table (covering context + new tokens) and a random
    up-projection. Deterministic per ``case.seed``."""
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(case.seed)
    tokens, kv_tokens = sum(case.q_lens), sum(case.keys)
    q = torch.randn(tokens, case.heads, case.qk_dim, generator=gen).to(case.dtype)
    k = torch.randn(kv_tokens, case.heads, case.qk_dim, generator=gen).to(case.dtype)
    v = torch.randn(kv_tokens, case.heads, case.v_dim, generator=gen).to(case.dtype)
    seq_lens = [c + n for c, n in zip(case.contexts, case.q_lens, strict=True)]
    table, num_blocks = _paged_table(seq_lens, case.block_size, gen)
    cache = _random_cache(
        num_blocks, case.block_size, case.kv_lora_rank + case.rope_dim, case.cache_dtype, case.kv_scale, gen
    )
    context = CachedContext(
        kv_cache=cache.to(dev),
        kv_scale=case.kv_scale if is_fp8(case.cache_dtype) else None,
        block_table=table.to(dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        expand=RandomUpProjection.random(case, gen, dev),
    )
    return PrefillInputs(
        case=case,
        q=q.to(dev),
        k=k.to(dev),
        v=v.to(dev),
        cu_seqlens_q=_indptr(case.q_lens).to(dev),
        cu_seqlens_k=_indptr(case.keys).to(dev),
        max_seqlen_q=max(case.q_lens),
        max_seqlen_k=max(case.keys),
        context=context,
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
            seed=seed * 1_000_003 + index,
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
            seed=seed * 1_000_003 + index,
        )


# -- strategy checks -------------------------------------------------------------------------


@attrs.frozen
class CheckResult:
    """The outcome of running one strategy on one case."""

    strategy: str
    case: str
    """The case id."""
    support: Support
    """Why the strategy cannot run the case (empty: it ran)."""
    ran: str | None = None
    """The strategy the backend recorded in the step's metadata (must equal ``strategy``)."""
    comparison: Comparison | None = None

    @property
    def supported(self) -> bool:
        return bool(self.support)

    @property
    def reasons(self) -> str:
        """Every reason, readable (``"[heads] 130 heads: ..."``); for ``pytest.skip``."""
        return str(self.support)

    @property
    def ok(self) -> bool:
        return (
            self.supported
            and self.ran == self.strategy
            and self.comparison is not None
            and self.comparison.ok
        )

    def assert_passed(self) -> None:
        """Raise ``AssertionError`` with the details unless the strategy ran and matched."""
        if not self.ok:
            raise AssertionError(str(self))

    def __str__(self) -> str:
        head = f"{self.strategy} on {self.case}"
        if not self.supported:
            return f"{head}: not supported: {self.reasons}"
        if self.ran != self.strategy:
            return f"{head}: the backend ran {self.ran!r} instead"
        return f"{head}: {self.comparison}"


def _unsupported(strategy: AnyStrategy, case_id: str, exc: UnsupportedError) -> CheckResult:
    explanation: Explanation | None = exc.explanation
    reasons: tuple[Reason, ...]
    try:
        reasons = explanation.candidate(strategy.NAME).reasons if explanation is not None else ()
    except KeyError:
        reasons = ()
    if not reasons:
        reasons = (Reason("unsupported", str(exc)),)
    return CheckResult(strategy.NAME, case_id, Support(reasons))


def _provider(provider: str | KernelProvider, platform: Platform) -> KernelProvider:
    return resolve_provider(provider, platform)


def _decode_backend(
    strategy_cls: type[DecodeStrategy],
    case: DecodeCase,
    inputs: DecodeInputs,
    *,
    provider: KernelProvider,
    platform: Platform,
    device: torch.device,
    registry: Registry | None,
) -> MLABackend:
    """A backend sized for ``case`` with ``strategy_cls`` forced (nothing resolved yet)."""
    max_decode_qlen = case.max_decode_qlen or case.max_qlen
    limits = EngineLimits(
        max_num_seqs=max(case.num_requests, -(-case.num_tokens // max_decode_qlen)),
        max_model_len=max(1, *case.seq_lens),
        max_num_batched_tokens=case.num_tokens,
        max_decode_qlen=max_decode_qlen,
    )
    dims = MLADims(
        num_heads=case.heads,
        kv_lora_rank=case.kv_lora_rank,
        qk_rope_head_dim=case.rope_dim,
        softmax_scale=case.scale,
    )
    return MLABackend(
        dims,
        KVCacheSpec(case.block_size, case.kv_dtype, num_blocks=inputs.kv_cache.shape[0]),
        limits,
        model_dtype=case.q_dtype,
        provider=provider,
        platform=platform,
        device=device,
        resolver=Resolver(registry or DEFAULT_REGISTRY),
        decode_strategy=strategy_cls,
        preallocate=False,
    )


def decode_support(
    strategy_cls: type[DecodeStrategy],
    case: DecodeCase,
    *,
    provider: str | KernelProvider,
    platform: Platform | str,
    registry: Registry | None = None,
) -> Support:
    """Whether the backend would run ``case`` with ``strategy_cls`` forced (builds the step's
    metadata on the CPU, runs no kernel): empty when supported, else every reason."""
    plat = _platform(platform)
    prov = _provider(provider, plat)
    dev = torch.device("cpu")
    inputs = make_decode_inputs(case, dev)
    backend = _decode_backend(
        strategy_cls, case, inputs, provider=prov, platform=plat, device=dev, registry=registry
    )
    try:
        backend.builder.build(inputs.step())
    except UnsupportedError as exc:
        return _unsupported(strategy_cls, case.id, exc).support
    return Support.yes()


def check_decode_strategy(
    strategy_cls: type[DecodeStrategy],
    case: DecodeCase,
    *,
    provider: str | KernelProvider,
    platform: Platform | str,
    registry: Registry | None = None,
    device: torch.device | str | None = None,
) -> CheckResult:
    """Run ``case`` through an :class:`MLABackend` with ``strategy_cls`` forced and compare.

    The backend is sized for the case (``max_num_seqs`` = its requests, ``max_model_len`` = its
    longest sequence, ``max_decode_qlen`` = ``case.max_decode_qlen`` or its max qlen). Outputs
    are caller-provided and NaN-poisoned, so unwritten rows fail. An unsupported case returns a
    result with ``supported == False`` and every reason from the resolver's explanation.

    ``provider`` is a name or a provider object (see :func:`emulated_provider`); ``platform`` a
    :class:`Platform` or an arch name to simulate; ``registry`` the registry the backend's
    resolver reads (default: the default one; a forced class need not be registered).
    """
    plat = _platform(platform)
    dev = _device(plat, device)
    prov = _provider(provider, plat)
    inputs = make_decode_inputs(case, dev)
    backend = _decode_backend(
        strategy_cls, case, inputs, provider=prov, platform=plat, device=dev, registry=registry
    )
    try:
        metadata = backend.builder.build(inputs.step())
    except UnsupportedError as exc:
        return _unsupported(strategy_cls, case.id, exc)
    assert metadata.decode is not None
    out, lse = inputs.poisoned_outputs()
    backend.impl.forward_decode(
        metadata, inputs.q, inputs.kv_cache, out=out, lse=lse, kv_scale=inputs.kv_scale
    )
    ref_out, ref_lse = inputs.reference()
    return CheckResult(
        strategy_cls.NAME,
        case.id,
        Support.yes(),
        ran=metadata.decode.strategy,
        comparison=compare_to_reference(out, lse, ref_out, ref_lse),
    )


PrefillPath = Literal["auto", "api", "backend"]


def rounded_inputs(
    instance: PrefillStrategy, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The (dequantized) inputs a prefill strategy really computes with when it rounds them to
    fp8 (it has ``quantize(q, k, v)``); ``None`` when it takes them as they are. Compare such a
    strategy with the reference on these, so the tolerance stays tight."""
    quantize: Callable[..., tuple[tuple[torch.Tensor, torch.Tensor], ...]] | None = getattr(
        instance, "quantize", None
    )
    if quantize is None:
        return None
    (q8, qs), (k8, ks), (v8, vs) = quantize(q, k, v)
    return dequantize(q8, qs), dequantize(k8, ks), dequantize(v8, vs)


def check_prefill_strategy(
    strategy_cls: type[PrefillStrategy],
    case: PrefillCase,
    *,
    provider: str | KernelProvider,
    platform: Platform | str,
    registry: Registry | None = None,
    path: PrefillPath = "auto",
    device: torch.device | str | None = None,
) -> CheckResult:
    """Run ``case`` with ``strategy_cls`` forced and compare to the reference.

    ``path="api"`` calls :func:`mla.mla_prefill` (its own outputs, poisoned through
    :func:`poisoned_empty`); ``path="backend"`` builds an :class:`MLABackend` step (cached
    context read from the paged cache, expanded by the case's random up-projection, merged by
    LSE; caller outputs NaN-poisoned). ``"auto"``: the backend when the case has context, else
    the API. ``registry`` applies to the backend path (the API resolves with the default
    registry; a forced class need not be registered in either).
    """
    plat = _platform(platform)
    dev = _device(plat, device)
    prov = _provider(provider, plat)
    inputs = make_prefill_inputs(case, dev)
    chosen = ("backend" if case.has_context else "api") if path == "auto" else path
    if chosen == "api" and case.has_context:
        raise ValueError(f"case {case.id} has cached context, which only the backend path runs")
    if chosen == "backend" and (case.keys != case.q_lens or not case.causal):
        raise ValueError(
            f"case {case.id}: the backend path runs causal steps whose new tokens are their own "
            "keys (kv_lens == q_lens); use the API path"
        )
    if chosen == "api":
        try:
            with poisoned_empty():
                out, lse = mla_prefill(
                    inputs.q,
                    inputs.k,
                    inputs.v,
                    inputs.cu_seqlens_q,
                    inputs.cu_seqlens_k,
                    inputs.max_seqlen_q,
                    inputs.max_seqlen_k,
                    softmax_scale=case.scale,
                    causal=case.causal,
                    provider=prov,
                    strategy=strategy_cls,
                    platform=plat,
                )
        except UnsupportedError as exc:
            return _unsupported(strategy_cls, case.id, exc)
        instance = strategy_cls(
            StrategySetup(
                dims=case.dims,
                cache=KVCacheSpec(case.block_size, case.dtype),
                limits=EngineLimits(len(case.q_lens), max(1, *case.keys), sum(case.q_lens)),
                q_dtype=case.dtype,
                platform=plat,
                provider=prov,
                capabilities=prov.capabilities(plat),
                device=dev,
            )
        )
        ran: str | None = strategy_cls.NAME
    else:
        seq_lens = [c + n for c, n in zip(case.contexts, case.q_lens, strict=True)]
        backend = MLABackend(
            case.dims,
            KVCacheSpec(case.block_size, case.cache_dtype, num_blocks=inputs.context.kv_cache.shape[0]),
            EngineLimits(
                max_num_seqs=len(case.q_lens),
                max_model_len=max(seq_lens),
                max_num_batched_tokens=sum(case.q_lens),
            ),
            model_dtype=case.dtype,
            provider=prov,
            platform=plat,
            device=dev,
            resolver=Resolver(registry or DEFAULT_REGISTRY),
            prefill_strategy=strategy_cls,
            preallocate=False,
            context_chunk_tokens=case.context_chunk_tokens,
        )
        try:
            metadata = backend.builder.build(inputs.step())
        except UnsupportedError as exc:
            return _unsupported(strategy_cls, case.id, exc)
        assert metadata.prefill is not None
        out, lse = inputs.poisoned_outputs()
        backend.impl.forward_prefill(
            metadata,
            inputs.q,
            inputs.k,
            inputs.v,
            out=out,
            lse=lse,
            kv_cache=inputs.context.kv_cache,
            kv_scale=inputs.context.kv_scale,
            expand_context=inputs.context.expand,
        )
        ran = metadata.prefill.strategy
        instance = backend.prefill_strategy(ran)
    rounded = rounded_inputs(instance, inputs.q, inputs.k, inputs.v)
    ref_out, ref_lse = inputs.reference(*rounded) if rounded is not None else inputs.reference()
    tolerance = tolerance_for(out.dtype)
    if rounded is not None:
        # The reference sees the same fp8-rounded inputs; fp8 kernels may still keep their
        # intermediates (the probabilities P) in 16 bits, so no tighter than float16.
        tolerance = max(tolerance, TOLERANCES[torch.float16])
    return CheckResult(
        strategy_cls.NAME,
        case.id,
        Support.yes(),
        ran=ran,
        comparison=compare_to_reference(out, lse, ref_out, ref_lse, tolerance=tolerance),
    )
