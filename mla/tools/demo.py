"""``mla demo``: a small serving loop that drives :class:`~mla.engine.backend.MLABackend` and checks it.

The loop plays the engine's part on random latent data: requests arrive (some with a cached
prefix), their prompts are prefilled in chunks under a token budget (later chunks carry cached
context that the backend gathers, up-projects and merges), then they decode, one token at a time
or as speculative verifies of 2..``max_decode_qlen`` tokens with random acceptance. Decode-only
steps are sometimes padded the way CUDA-graph capture pads them (requests with ``seq_len`` 0 and
extra query rows). Each step's new latent rows go into a paged cache with randomly allocated
blocks through the provider's ``write_kv``; outputs are poisoned with NaN before the run and
compared afterwards with :mod:`mla.tools.reference` (float64), so an unwritten row fails the step.

``run_demo(DemoConfig(...)) -> DemoReport`` is the API; ``mla demo`` renders the report.
"""

from __future__ import annotations

import math
import random
import time
from collections import Counter
from collections.abc import Callable

import attrs
import torch

from mla.core.config import EngineLimits, KVCacheSpec, MLADims, dtype_name, is_fp8, normalize_dtype
from mla.core.errors import InvalidInputError
from mla.core.platform import Platform, detect_platform, simulated_platform
from mla.engine.backend import MLABackend, MLAMetadata, StepInputs
from mla.prefill.fp8_persistent import Fp8PersistentPrefill
from mla.providers import emulation_capabilities, resolve_provider
from mla.providers.base import KernelProvider
from mla.providers.calls import WriteKVCall
from mla.providers.quant import dequantize, quantize_per_tensor
from mla.providers.torch_ref import TorchProvider
from mla.tools.reference import reference_decode, reference_prefill

TOLERANCES: dict[torch.dtype, float] = {
    torch.float32: 1e-5,
    torch.float16: 1e-2,
    torch.bfloat16: 2e-2,
}
"""Largest accepted error per model dtype: output ``max|o - ref| / max|ref|`` per step, and the
LSE's absolute error."""

FP8_KV_SCALE = 1.0 / 32.0
"""Per-tensor dequant scale of an fp8 demo cache: unit-normal latents stay inside e4m3's range."""


def _positive(_inst: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value <= 0:
        raise InvalidInputError(attribute.name, f"must be > 0, got {value}")


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
    """``bf16`` or ``fp8`` (the provider's fp8 format, per-tensor scale :data:`FP8_KV_SCALE`)."""
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

    def __attrs_post_init__(self) -> None:
        if self.max_model_len < self.max_decode_qlen + 8:
            raise InvalidInputError(
                "max_model_len",
                f"{self.max_model_len} leaves no room for a prompt and a verify; use at least "
                f"max_decode_qlen + 8 = {self.max_decode_qlen + 8}",
            )
        if self.heads % self.dcp:
            raise InvalidInputError(
                "heads", f"{self.heads} heads do not split over dcp={self.dcp} ranks; use a multiple"
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


@attrs.frozen(eq=False)
class LatentUpProjection:
    """The model's ``kv_b_proj`` per head: latent rows to MHA-form keys and values.

    ``k = [c @ W_UK[h] | k_pe]`` ``[n, H, nope + rope]`` and ``v = c @ W_UV[h]`` ``[n, H, v]``
    for latent rows ``[c | k_pe]`` ``[n, L + R]``; float32 math, results in the input's dtype.
    Used both for the new tokens' k/v and as the backend's ``expand_context`` for cached rows.
    """

    w_uk: torch.Tensor
    """float32 ``[H, L, nope]``."""
    w_uv: torch.Tensor
    """float32 ``[H, L, v]``."""

    def __call__(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rank = self.w_uk.shape[1]
        heads = self.w_uk.shape[0]
        c = latent[:, :rank].to(torch.float32)
        k_pe = latent[:, rank:].to(torch.float32)
        k_nope = torch.einsum("nl,hld->nhd", c, self.w_uk)
        k = torch.cat([k_nope, k_pe[:, None, :].expand(-1, heads, -1)], dim=-1)
        v = torch.einsum("nl,hld->nhd", c, self.w_uv)
        return k.to(latent.dtype), v.to(latent.dtype)


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


def _select_provider(config: DemoConfig, platform: Platform) -> tuple[KernelProvider, str]:
    if config.emulate is not None:
        caps = emulation_capabilities(config.emulate, platform)
        return TorchProvider(capabilities=caps), f"torch (emulating {config.emulate})"
    provider = resolve_provider(config.provider, platform)
    return provider, provider.name


class ServingLoop:
    """The engine side of the demo: request state, paged cache, step composition, checks."""

    def __init__(self, config: DemoConfig) -> None:
        self.config = config
        self.rng = random.Random(config.seed)
        self.gen = torch.Generator().manual_seed(config.seed)
        self.platform = simulated_platform(config.arch) if config.arch else detect_platform(config.device)
        self.device = torch.device(
            config.device if config.device else ("cuda" if self.platform.is_gpu else "cpu")
        )
        self.provider, self.provider_label = _select_provider(config, self.platform)
        caps = self.provider.capabilities(self.platform)
        self.model_dtype = normalize_dtype(config.dtype, argument="dtype")
        kv = normalize_dtype(config.kv_dtype, argument="kv_dtype")
        self.kv_dtype = caps.fp8_dtype if is_fp8(kv) else kv
        self.kv_scale = FP8_KV_SCALE if is_fp8(self.kv_dtype) else None
        self.dims = MLADims(
            num_heads=config.heads,
            kv_lora_rank=config.kv_lora_rank,
            qk_rope_head_dim=config.rope_dim,
            qk_nope_head_dim=config.nope_dim,
            v_head_dim=config.v_dim,
        )
        self.max_blocks = -(-config.max_model_len // config.block_size)
        num_blocks = config.max_num_seqs * self.max_blocks + self.max_blocks
        self.limits = EngineLimits(
            max_num_seqs=config.max_num_seqs,
            max_model_len=config.max_model_len,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_decode_qlen=config.max_decode_qlen,
        )
        self.backend = MLABackend(
            self.dims,
            KVCacheSpec(config.block_size, self.kv_dtype, num_blocks=num_blocks),
            self.limits,
            model_dtype=self.model_dtype,
            provider=self.provider,
            platform=self.platform,
            device=self.device,
            context_chunk_tokens=config.context_chunk_tokens or config.max_num_seqs * config.block_size,
        )
        self.kv_cache = self._randn(num_blocks, config.block_size, self.dims.latent_dim).to(self.kv_dtype)
        self.free_blocks = list(range(num_blocks))
        self.rng.shuffle(self.free_blocks)
        rank = config.kv_lora_rank
        self.project = LatentUpProjection(
            w_uk=self._randn(config.heads, rank, config.nope_dim, dtype=torch.float32) / math.sqrt(rank),
            w_uv=self._randn(config.heads, rank, config.v_dim, dtype=torch.float32) / math.sqrt(rank),
        )
        self.requests: list[Request] = []
        self.next_rid = 0
        self.composition: Counter[str] = Counter()
        tol = TOLERANCES[self.model_dtype]
        self.decode_tally = _PhaseTally("decode", tol)
        self.prefill_tally = _PhaseTally("prefill", tol)
        self.failures: list[StepFailure] = []

    # -- random data -------------------------------------------------------------------------

    def _randn(self, *shape: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        data = torch.randn(*shape, generator=self.gen, dtype=torch.float32)
        return data.to(device=self.device, dtype=dtype or self.model_dtype)

    # -- request lifecycle -------------------------------------------------------------------

    def _ensure_blocks(self, request: Request, length: int) -> None:
        needed = -(-length // self.config.block_size)
        while len(request.blocks) < needed:
            request.blocks.append(self.free_blocks.pop(self.rng.randrange(len(self.free_blocks))))

    def _slots(self, request: Request, start: int, count: int) -> list[int]:
        bs = self.config.block_size
        return [request.blocks[p // bs] * bs + p % bs for p in range(start, start + count)]

    def _write(self, slots: list[int], rows: torch.Tensor) -> None:
        """Write latent rows ``[n, L+R]`` at flat ``slots`` (``-1`` = skip) through the provider."""
        if not slots:
            return
        rank = self.config.kv_lora_rank
        slot_mapping = torch.tensor(slots, dtype=torch.int64, device=self.device)
        scale = None if self.kv_scale is None else torch.tensor([self.kv_scale], device=self.device)
        self.backend.provider.write_kv(
            WriteKVCall(
                kv_c=rows[:, :rank],
                k_pe=rows[:, rank:],
                kv_cache=self.kv_cache,
                slot_mapping=slot_mapping,
                kv_scale=scale,
            )
        )

    def _admit(self) -> None:
        cfg = self.config
        headroom = cfg.max_model_len - cfg.max_decode_qlen
        while len(self.requests) < cfg.max_num_seqs and (not self.requests or self.rng.random() < 0.3):
            prompt = self.rng.randint(4, min(72, headroom // 2))
            final = min(headroom, prompt + self.rng.randint(4, 40))
            request = Request(self.next_rid, prompt, final)
            self.next_rid += 1
            if prompt > 1 and self.rng.random() < 0.35:
                # A prefix-cache hit: the prefix's latent rows are already in the cache.
                prefix = self.rng.randint(1, prompt - 1)
                self._ensure_blocks(request, prefix)
                self._write(self._slots(request, 0, prefix), self._randn(prefix, self.dims.latent_dim))
                request.computed = prefix
                self.composition["cached prefixes"] += 1
            self.requests.append(request)

    def _schedule(self) -> ScheduledStep:
        cfg = self.config
        decoding = [r for r in self.requests if not r.prefilling]
        prefilling = [r for r in self.requests if r.prefilling]
        mode = (
            self.rng.choice(("decode", "verify-uniform", "verify-mixed"))
            if cfg.max_decode_qlen > 1
            else "decode"
        )
        uniform_qlen = self.rng.randint(2, cfg.max_decode_qlen) if mode == "verify-uniform" else 1
        decodes = []
        for request in decoding:
            qlen = self.rng.randint(1, cfg.max_decode_qlen) if mode == "verify-mixed" else uniform_qlen
            decodes.append((request, min(qlen, cfg.max_model_len - request.computed)))
        budget = cfg.max_num_batched_tokens - sum(q for _, q in decodes)
        prefills = []
        decode_only = bool(decodes) and self.rng.random() < 0.35
        for request in [] if decode_only else prefilling:
            if budget <= 0:
                break
            chunk = min(request.prompt_len - request.computed, budget)
            prefills.append((request, chunk))
            budget -= chunk
        padding_requests = padding_qlen = extra_rows = 0
        if decodes and not prefills and self.rng.random() < 0.6:
            graph_batch = min(cfg.max_num_seqs, 1 << (len(decodes) - 1).bit_length())
            padding_requests = graph_batch - len(decodes)
            qlens = {q for _, q in decodes}
            padding_qlen = max(qlens) if len(qlens) == 1 and self.rng.random() < 0.5 else 0
            owned = sum(q for _, q in decodes) + padding_requests * padding_qlen
            extra_rows = min(self.limits.max_decode_tokens - owned, self.rng.randint(1, 3))
        return ScheduledStep(tuple(decodes), tuple(prefills), padding_requests, padding_qlen, extra_rows)

    def _advance(self, step: ScheduledStep) -> None:
        for request, qlen in step.decodes:
            # Speculative verify: the first token is always kept, each draft by chance; rejected
            # drafts stay in the cache past seq_len and are overwritten by the next step.
            accepted = 1 + sum(1 for _ in range(qlen - 1) if self.rng.random() < 0.6)
            request.computed += min(accepted, qlen)
        for request, chunk in step.prefills:
            request.computed += chunk
        for request in [r for r in self.requests if r.computed >= r.final_len]:
            self.free_blocks.extend(request.blocks)
            self.requests.remove(request)

    # -- one step ----------------------------------------------------------------------------

    def step(self, index: int) -> StepRecord:
        """Admit, schedule, write the new tokens' rows, build metadata, run and check one step."""
        self._admit()
        sched = self._schedule()
        self._count(sched)
        inputs, slots = self._step_inputs(sched)
        # New tokens' latent rows go into the cache before attention, as in an engine.
        latent = self._randn(len(slots), self.dims.latent_dim)
        self._write(slots, latent)
        metadata = self.backend.builder.build(inputs)
        self._on_step(sched, inputs, latent)
        ok = True
        decode_name = prefill_name = None
        if inputs.num_decodes:
            decode_name, passed = self._run_decode(index, metadata, inputs)
            ok &= passed
        if sched.prefills:
            new_rows = latent[inputs.num_decode_tokens :]
            prefill_name, passed = self._run_prefill(index, metadata, sched, new_rows)
            ok &= passed
        self._advance(sched)
        return StepRecord(
            index=index,
            total=self.config.steps,
            decode_strategy=decode_name,
            prefill_strategy=prefill_name,
            decode_tokens=inputs.num_decode_tokens,
            prefill_tokens=metadata.num_prefill_tokens,
            ok=ok,
        )

    def _step_inputs(self, sched: ScheduledStep) -> tuple[StepInputs, list[int]]:
        """The engine's step description (decodes, graph padding, prefills) and the cache slot
        of every query row (``-1`` for padding rows)."""
        num_requests = len(sched.decodes) + sched.padding_requests + len(sched.prefills)
        table = torch.full((num_requests, self.max_blocks), -1, dtype=torch.int32)
        qlens: list[int] = []
        seq_lens: list[int] = []
        slots: list[int] = []

        def add(request: Request, qlen: int) -> None:
            self._ensure_blocks(request, request.computed + qlen)
            table[len(qlens), : len(request.blocks)] = torch.tensor(request.blocks, dtype=torch.int32)
            slots.extend(self._slots(request, request.computed, qlen))
            qlens.append(qlen)
            seq_lens.append(request.computed + qlen)

        for request, qlen in sched.decodes:
            add(request, qlen)
        for _ in range(sched.padding_requests):
            qlens.append(sched.padding_request_qlen)
            seq_lens.append(0)
            slots.extend([-1] * sched.padding_request_qlen)
        slots.extend([-1] * sched.extra_rows)
        num_decode_tokens = sum(qlens) + sched.extra_rows
        for request, chunk in sched.prefills:
            add(request, chunk)
        qsl = torch.zeros(num_requests + 1, dtype=torch.int32)
        qsl[1:] = torch.cumsum(torch.tensor(qlens, dtype=torch.int32), 0)
        seq_cpu = torch.tensor(seq_lens, dtype=torch.int32)
        inputs = StepInputs(
            query_start_loc_cpu=qsl,
            query_start_loc=qsl.to(self.device),
            seq_lens=seq_cpu.to(self.device),
            seq_lens_cpu=seq_cpu,
            block_table=table.to(self.device),
            num_decodes=len(sched.decodes) + sched.padding_requests,
            num_decode_tokens=num_decode_tokens,
        )
        return inputs, slots

    def _count(self, sched: ScheduledStep) -> None:
        if sched.extra_rows or sched.padding_requests:
            self.composition["graph-padded steps"] += 1
            padding_rows = sched.extra_rows + sched.padding_requests * sched.padding_request_qlen
            self.composition["padding rows"] += padding_rows
            self.composition["padding requests"] += sched.padding_requests
        self.composition["verify requests"] += sum(1 for _, q in sched.decodes if q > 1)
        self.composition["prefills with cached context"] += sum(1 for r, _ in sched.prefills if r.computed)
        self.composition["prefills without context"] += sum(1 for r, _ in sched.prefills if not r.computed)

    def _run_decode(self, index: int, metadata: MLAMetadata, inputs: StepInputs) -> tuple[str, bool]:
        dims, nd = self.dims, inputs.num_decodes
        rows = inputs.num_decode_tokens
        q = self._randn(rows, dims.num_heads, dims.latent_dim)
        out = torch.full(
            (rows, dims.num_heads, dims.kv_lora_rank), math.nan, dtype=self.model_dtype, device=self.device
        )
        lse = torch.full((rows, dims.num_heads), math.nan, dtype=torch.float32, device=self.device)
        self.backend.impl.forward_decode(metadata, q, self.kv_cache, out=out, lse=lse, kv_scale=self.kv_scale)
        ref_out, ref_lse = reference_decode(
            q,
            self.kv_cache,
            inputs.block_table[:nd],
            inputs.seq_lens[:nd],
            inputs.query_start_loc[: nd + 1],
            softmax_scale=dims.scale,
            kv_lora_rank=dims.kv_lora_rank,
            kv_scale=self.kv_scale,
        )
        assert metadata.decode is not None
        name = metadata.decode.strategy
        self._on_decode(index, q, out, lse)
        return name, self._record(self.decode_tally, index, name, rows, (out, lse), (ref_out, ref_lse))

    def _context_rows(self, request: Request) -> torch.Tensor:
        """The request's cached latent rows as the engine's expander sees them (dequantized,
        in the model dtype), read through its own block list."""
        slots = torch.tensor(self._slots(request, 0, request.computed), dtype=torch.int64, device=self.device)
        rows = self.kv_cache.view(-1, self.dims.latent_dim)[slots].to(torch.float32)
        if self.kv_scale is not None:
            rows = rows * self.kv_scale
        return rows.to(self.model_dtype)

    def _run_prefill(
        self, index: int, metadata: MLAMetadata, sched: ScheduledStep, new_rows: torch.Tensor
    ) -> tuple[str, bool]:
        dims = self.dims
        tokens = new_rows.shape[0]
        q = self._randn(tokens, dims.num_heads, dims.qk_head_dim)
        k, v = self.project(new_rows)
        out = torch.full(
            (tokens, dims.num_heads, dims.v_head_dim), math.nan, dtype=self.model_dtype, device=self.device
        )
        lse = torch.full((tokens, dims.num_heads), math.nan, dtype=torch.float32, device=self.device)
        self.backend.impl.forward_prefill(
            metadata,
            q,
            k,
            v,
            out=out,
            lse=lse,
            kv_cache=self.kv_cache,
            kv_scale=self.kv_scale,
            expand_context=self.project,
        )
        assert metadata.prefill is not None
        name = metadata.prefill.strategy
        self.composition["context chunks"] += len(metadata.prefill.context_chunks)
        ref_q, ref_k, ref_v = q, k, v
        if name == Fp8PersistentPrefill.NAME:
            # The strategy's contract: the varlen math on q/k/v rounded to fp8 per tensor.
            fp8 = self.backend.capabilities.fp8_dtype
            ref_q, ref_k, ref_v = (dequantize(*quantize_per_tensor(x, fp8)) for x in (q, k, v))
        keys, values, cu_q, cu_k = [], [], [0], [0]
        start = 0
        for request, chunk in sched.prefills:
            if request.computed:
                k_ctx, v_ctx = self.project(self._context_rows(request))
                keys.append(k_ctx.to(ref_k.dtype))
                values.append(v_ctx.to(ref_v.dtype))
            keys.append(ref_k[start : start + chunk])
            values.append(ref_v[start : start + chunk])
            start += chunk
            cu_q.append(start)
            cu_k.append(cu_k[-1] + request.computed + chunk)
        ref_out, ref_lse = reference_prefill(
            ref_q,
            torch.cat(keys),
            torch.cat(values),
            torch.tensor(cu_q),
            torch.tensor(cu_k),
            softmax_scale=dims.scale,
            causal=True,
        )
        self._on_prefill(index, name, (q, k, v), out, lse)
        return name, self._record(self.prefill_tally, index, name, tokens, (out, lse), (ref_out, ref_lse))

    # -- hooks for loops that check more per step (mla.tools.demo_dcp) ---------------------------

    def _on_step(self, sched: ScheduledStep, inputs: StepInputs, latent: torch.Tensor) -> None:
        """After the step's rows (``latent [T, L+R]``) are written and its metadata built."""

    def _on_decode(self, index: int, q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
        """After the decode ran: its absorbed ``q`` and the backend's ``out``/``lse``."""

    def _on_prefill(
        self,
        index: int,
        strategy: str,
        qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        out: torch.Tensor,
        lse: torch.Tensor,
    ) -> None:
        """After the prefill ran: the strategy, its ``(q, k, v)`` and the backend's ``out``/``lse``."""

    def _record(
        self,
        tally: _PhaseTally,
        index: int,
        name: str,
        tokens: int,
        got: tuple[torch.Tensor, torch.Tensor],
        ref: tuple[torch.Tensor, torch.Tensor],
    ) -> bool:
        rel, lse_err = _errors(*got, *ref)
        tally.add(name, tokens, rel, lse_err)
        if rel <= tally.tolerance and lse_err <= tally.tolerance:
            return True
        self.failures.append(StepFailure(index, tally.phase, name, rel, lse_err))
        return False

    def report(self, steps: int, wall: float) -> DemoReport:
        decode, prefill = self.decode_tally.stats(), self.prefill_tally.stats()
        return DemoReport(
            config=self.config,
            provider=self.provider_label,
            arch=self.platform.arch,
            model_dtype=dtype_name(self.model_dtype),
            kv_dtype=dtype_name(self.kv_dtype),
            steps=steps,
            tokens=decode.tokens + prefill.tokens,
            decode=decode,
            prefill=prefill,
            composition=tuple(sorted(self.composition.items())),
            failures=tuple(self.failures),
            wall_seconds=wall,
        )


def run_demo(config: DemoConfig, progress: Callable[[StepRecord], None] | None = None) -> DemoReport:
    """Serve ``config.steps`` mixed steps through :class:`~mla.engine.backend.MLABackend`, checking each
    against :mod:`mla.tools.reference`.

    Raises :class:`~mla.core.errors.UnsupportedError` when the backend cannot serve the configuration
    (e.g. a decode qlen within ``max_decode_qlen`` that no strategy supports) and
    :class:`~mla.core.errors.ProviderUnavailableError` for a provider that cannot run here.
    Tolerance misses do not raise: they are in :attr:`DemoReport.failures`. One process:
    ``config.dcp > 1`` is :func:`mla.tools.demo_dcp.run_dcp_demo`'s (which builds on this module).
    """
    if config.dcp > 1:
        raise InvalidInputError(
            "config.dcp",
            f"run_demo serves one process; use mla.tools.demo_dcp.run_dcp_demo for dcp={config.dcp}",
        )
    start = time.perf_counter()
    loop = ServingLoop(config)
    for index in range(config.steps):
        record = loop.step(index)
        if progress is not None:
            progress(record)
    return loop.report(config.steps, time.perf_counter() - start)
