"""The demo's records: its configuration, tolerances, per-step records and report, and the
request/step records its scheduler passes around."""

from __future__ import annotations

import math
from collections import Counter

import attrs
import torch

from mla.core.errors import InvalidInputError, input_validator
from mla.providers.base import KernelProvider

TOLERANCES: dict[torch.dtype, float] = {
    torch.float32: 1e-5,
    torch.float16: 1e-2,
    torch.bfloat16: 2e-2,
}
"""Largest accepted error per model dtype: output ``max|o - ref| / max|ref|`` per step, and the
LSE's absolute error."""

FP8_KV_SCALE = 1.0 / 32.0
"""Per-tensor dequant scale of an fp8 demo cache: unit-normal latents stay inside e4m3's range."""


_positive = input_validator(attrs.validators.gt(0), "> 0")


@attrs.frozen
class DemoConfig:
    """What the demo serves. The defaults finish in seconds on a 2-core CPU with the torch
    provider: DeepSeek's latent dims (512 + 64, prefill 128 + 64 / 128) at 16 heads, short
    sequences and the smallest context-chunk workspace, so cached context is merged over several
    chunks. Raises :class:`~mla.core.errors.InvalidInputError` for sizes the loop cannot serve."""

    provider: str | KernelProvider = "auto"
    """``auto`` (the best available provider: torch on a CPU), ``torch``, ``triton``, ``aiter``,
    or a provider object."""
    steps: int = attrs.field(default=64, validator=_positive)
    heads: int = attrs.field(default=16, validator=_positive)
    """Query heads per rank (DeepSeek-V3 at TP8)."""
    seed: int = 0
    kv_dtype: str = "bf16"
    """``bf16`` or ``fp8`` (the provider's fp8 format, per-tensor scale :data:`FP8_KV_SCALE`);
    with ``sparse`` also ``fp8_ds_mla`` (per-tile scales)."""
    max_decode_qlen: int = attrs.field(default=4, validator=_positive)
    """Largest decode qlen (speculative tokens + 1); verifies use 2..this."""
    dtype: str = "bf16"
    """Model dtype of q/k/v and outputs: ``bf16``, ``fp16`` or ``fp32``."""
    arch: str | None = None
    """Simulate this arch (``gfx950``, ``gfx942``, ``sm90``...) instead of detecting the device."""
    emulate: str | None = None
    """Run the torch reference kernels under this provider's capability record (``aiter``,
    ``triton``), so the padding and flattening paths its limits trigger run on a CPU."""
    kv_lora_rank: int = attrs.field(default=512, validator=_positive)
    rope_dim: int = attrs.field(default=64, validator=_positive)
    nope_dim: int = attrs.field(default=128, validator=_positive)
    v_dim: int = attrs.field(default=128, validator=_positive)
    block_size: int = attrs.field(default=16, validator=_positive)
    max_num_seqs: int = attrs.field(default=8, validator=_positive)
    max_model_len: int = attrs.field(default=192, validator=_positive)
    max_num_batched_tokens: int = attrs.field(default=96, validator=_positive)
    context_chunk_tokens: int | None = None
    """Workspace of the chunked-context prefill (tokens gathered per chunk); default the
    smallest the backend accepts, ``max_num_seqs * block_size``, so long contexts take several
    chunks."""
    device: str | None = None
    """Torch device (default: the platform's: ``cuda`` on a GPU, else ``cpu``)."""
    dcp: int = attrs.field(default=1, validator=_positive)
    """Decode context parallelism: serve with this many processes (gloo on a CPU, NCCL on GPUs),
    each holding a token shard of the cache and ``heads / dcp`` of the heads, and check every
    step against the single-process backend (:mod:`mla.tools.demo_dcp`)."""
    dcp_interleave: int = attrs.field(default=1, validator=_positive)
    """Tokens per rank per round of the sharded cache (vLLM's interleave size)."""
    sparse: bool = False
    """Serve a DeepSeek Sparse Attention model (:mod:`mla.tools.demo_sparse`): every step writes
    index keys, runs the indexer and attends only the selected tokens."""
    index_topk: int = attrs.field(default=16, validator=_positive)
    """Tokens the sparse model's indexer keeps per row: far fewer than the demo's sequences, so
    selection really drops tokens."""
    index_heads: int = attrs.field(default=4, validator=_positive)
    index_head_dim: int = attrs.field(default=64, validator=_positive)
    index_key_dtype: str = "bf16"
    """The index-key cache: ``bf16`` or ``fp8`` (per-token scale, 132 bytes at head dim 128)."""

    def __attrs_post_init__(self) -> None:
        if self.kv_dtype == "fp8_ds_mla" and not self.sparse:
            raise InvalidInputError(
                "kv_dtype", "fp8_ds_mla caches serve sparse models: add --sparse (or use bf16/fp8)"
            )
        if self.sparse and self.dcp > 1:
            raise InvalidInputError("dcp", "the sparse demo serves one process; drop --dcp or --sparse")
        if self.max_model_len < self.max_decode_qlen + 8:
            raise InvalidInputError(
                "max_model_len",
                f"{self.max_model_len} leaves no room for a prompt and a verify; use at least "
                f"max_decode_qlen + 8 = {self.max_decode_qlen + 8}",
            )
        if self.heads % self.dcp:
            raise InvalidInputError(
                "heads",
                f"{self.heads} heads do not split over dcp={self.dcp} ranks; use a head count that "
                f"is a multiple of {self.dcp} (--heads {self.dcp * max(1, self.heads // self.dcp)}), "
                f"or a --dcp that divides {self.heads}",
            )
        if self.max_num_batched_tokens <= self.max_num_seqs * self.max_decode_qlen:
            raise InvalidInputError(
                "max_num_batched_tokens",
                f"{self.max_num_batched_tokens} must exceed max_num_seqs * max_decode_qlen = "
                f"{self.max_num_seqs * self.max_decode_qlen} so prefills get tokens next to a full "
                "decode batch",
            )


@attrs.frozen
class PhaseStats:
    """What one phase did over the run."""

    phase: str
    steps: int
    """Steps that ran this phase."""
    tokens: int
    """Query rows computed (decode: including graph-padding rows)."""
    strategies: tuple[tuple[str, int], ...]
    """``(strategy NAME, steps)`` in first-use order."""
    max_rel_error: float
    """Largest ``max|out - ref| / max|ref|`` of any step (``inf`` for a NaN output)."""
    max_lse_error: float
    """Largest absolute LSE error of any step (``inf`` when ``-inf`` rows disagree)."""
    tolerance: float

    @property
    def passed(self) -> bool:
        return self.max_rel_error <= self.tolerance and self.max_lse_error <= self.tolerance


@attrs.frozen
class StepFailure:
    """A step whose output missed the tolerance."""

    step: int
    phase: str
    strategy: str
    rel_error: float
    lse_error: float


@attrs.frozen
class StepRecord:
    """One finished step, as handed to the progress callback."""

    index: int
    total: int
    decode_strategy: str | None
    prefill_strategy: str | None
    decode_tokens: int
    prefill_tokens: int
    ok: bool


@attrs.frozen
class DemoReport:
    """The outcome of :func:`run_demo`."""

    config: DemoConfig
    provider: str
    """The provider that ran (``torch (emulating aiter)`` under emulation)."""
    arch: str
    model_dtype: str
    kv_dtype: str
    steps: int
    tokens: int
    decode: PhaseStats
    prefill: PhaseStats
    composition: tuple[tuple[str, int], ...]
    """Counts of the step features exercised (prefills with cached context, verifies, padding)."""
    failures: tuple[StepFailure, ...]
    wall_seconds: float
    extra: tuple[PhaseStats, ...] = ()
    """Further checks (``mla demo --dcp``: each rank's sharded decode and prefill against the
    single-process backend, worst over ranks)."""

    @property
    def passed(self) -> bool:
        phases = (self.decode, self.prefill, *self.extra)
        return not self.failures and all(stats.passed for stats in phases)

    def strategies(self, phase: str) -> dict[str, int]:
        """``{strategy NAME: steps}`` for ``phase`` (``decode`` or ``prefill``)."""
        stats = self.decode if phase == "decode" else self.prefill
        return dict(stats.strategies)

    def summary(self) -> str:
        """The summary table ``mla demo`` prints."""
        head = (
            f"mla demo: provider {self.provider} on {self.arch}, {self.config.heads} heads, "
            f"model {self.model_dtype}, kv cache {self.kv_dtype}, max decode qlen "
            f"{self.config.max_decode_qlen}"
        )
        if self.config.dcp > 1:
            head += (
                f"; decode context parallelism over {self.config.dcp} ranks "
                f"(interleave {self.config.dcp_interleave})"
            )
        header = ("phase", "steps", "tokens", "strategy (steps)", "max rel err", "max lse err", "tol", "")
        rows = [header]
        for stats in (self.decode, self.prefill, *self.extra):
            strategies = ", ".join(f"{name} ({count})" for name, count in stats.strategies) or "-"
            rows.append(
                (
                    stats.phase,
                    str(stats.steps),
                    str(stats.tokens),
                    strategies,
                    f"{stats.max_rel_error:.2e}",
                    f"{stats.max_lse_error:.2e}",
                    f"{stats.tolerance:.0e}",
                    "ok" if stats.passed else "FAIL",
                )
            )
        rows.append(("total", str(self.steps), str(self.tokens), "", "", "", "", ""))
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        lines = [head, ""]
        for index, row in enumerate(rows):
            lines.append(
                "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
            )
            if index == 0:
                lines.append("  ".join("-" * width for width in widths))
        lines.append("")
        lines.append("exercised: " + ", ".join(f"{name} {count}" for name, count in self.composition))
        for failure in self.failures[:10]:
            lines.append(
                f"FAILED step {failure.step} {failure.phase} ({failure.strategy}): rel err "
                f"{failure.rel_error:.3e}, lse err {failure.lse_error:.3e}"
            )
        verdict = "PASSED" if self.passed else "FAILED"
        lines.append(
            f"{verdict}: every step checked against mla.tools.reference in {self.wall_seconds:.1f} s"
        )
        return "\n".join(lines)


@attrs.define
class Request:
    """One sequence: its prompt, how much of it is in the cache, and its blocks."""

    rid: int
    prompt_len: int
    final_len: int
    """The sequence finishes once this many tokens are in the cache."""
    computed: int = 0
    """Tokens in the cache (the KV length before this step's new tokens)."""
    blocks: list[int] = attrs.Factory(list)

    @property
    def prefilling(self) -> bool:
        return self.computed < self.prompt_len


@attrs.frozen(eq=False)
class ScheduledStep:
    """The engine's batch for one step, decodes first, before any tensor is made."""

    decodes: tuple[tuple[Request, int], ...]
    """``(request, qlen)`` of each decode request."""
    prefills: tuple[tuple[Request, int], ...]
    """``(request, new tokens)`` of each prefill request (context = ``request.computed``)."""
    padding_requests: int
    """Graph-padding requests (``seq_len`` 0) appended after the decodes."""
    padding_request_qlen: int
    extra_rows: int
    """Graph-padding query rows past every request's rows."""


class _PhaseTally:
    def __init__(self, phase: str, tolerance: float) -> None:
        self.phase, self.tolerance = phase, tolerance
        self.steps = self.tokens = 0
        self.strategies: Counter[str] = Counter()
        self.rel = self.lse = 0.0

    def add(self, strategy: str, tokens: int, rel: float, lse: float) -> None:
        self.steps += 1
        self.tokens += tokens
        self.strategies[strategy] += 1
        self.rel, self.lse = max(self.rel, rel), max(self.lse, lse)

    def stats(self) -> PhaseStats:
        return PhaseStats(
            self.phase,
            self.steps,
            self.tokens,
            tuple(self.strategies.items()),
            self.rel,
            self.lse,
            self.tolerance,
        )


def _errors(
    out: torch.Tensor, lse: torch.Tensor, ref_out: torch.Tensor, ref_lse: torch.Tensor
) -> tuple[float, float]:
    """(output error relative to ``max|ref|``, absolute LSE error); ``inf`` for NaN or a
    ``-inf`` pattern that differs."""
    got = out.detach().cpu().to(torch.float64)
    if not bool(torch.isfinite(got).all()):
        return math.inf, math.inf
    scale = max(float(ref_out.abs().max()) if ref_out.numel() else 0.0, 1e-30)
    rel = float((got - ref_out).abs().max()) / scale if got.numel() else 0.0
    got_lse = lse.detach().cpu().to(torch.float64)
    finite = torch.isfinite(ref_lse)
    if bool(torch.isnan(got_lse).any()) or not bool((torch.isfinite(got_lse) == finite).all()):
        return rel, math.inf
    if not bool((got_lse[~finite] == ref_lse[~finite]).all()):
        return rel, math.inf
    lse_err = float((got_lse[finite] - ref_lse[finite]).abs().max()) if bool(finite.any()) else 0.0
    return rel, lse_err
