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
from typing import Any

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
from mla.tools.demo_records import (
    FP8_KV_SCALE,
    TOLERANCES,
    DemoConfig,
    DemoReport,
    Request,
    ScheduledStep,
    StepFailure,
    StepRecord,
    _errors,
    _PhaseTally,
)
from mla.tools.reference import reference_decode, reference_prefill


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
        self.kv_dtype = self._kv_dtype(config, caps.fp8_dtype)
        self.kv_scale = FP8_KV_SCALE if is_fp8(self.kv_dtype) else None
        self.dims = self._dims(config)
        self.max_blocks = -(-config.max_model_len // config.block_size)
        num_blocks = config.max_num_seqs * self.max_blocks + self.max_blocks
        self.limits = EngineLimits(
            max_num_seqs=config.max_num_seqs,
            max_model_len=config.max_model_len,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_decode_qlen=config.max_decode_qlen,
        )
        self.backend = self._backend(KVCacheSpec(config.block_size, self.kv_dtype, num_blocks=num_blocks))
        self.kv_cache = self._initial_cache(num_blocks)
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
        self.decode_reference: tuple[torch.Tensor, torch.Tensor] = (torch.empty(0), torch.empty(0))
        """The last decode's float64 reference ``(out, lse)`` (read by :meth:`_on_decode` hooks)."""
        self.prefill_tally = _PhaseTally("prefill", tol)
        self.failures: list[StepFailure] = []

    # -- what a loop serves (a sparse loop overrides these: mla.tools.demo_sparse) -------------

    @staticmethod
    def _kv_dtype(config: DemoConfig, fp8_dtype: torch.dtype) -> torch.dtype:
        kv = normalize_dtype(config.kv_dtype, argument="kv_dtype")
        return fp8_dtype if is_fp8(kv) else kv

    @staticmethod
    def _dims(config: DemoConfig) -> MLADims:
        return MLADims(
            config.heads, config.kv_lora_rank, config.rope_dim, config.nope_dim, config.v_dim,
            softmax_scale=(config.nope_dim + config.rope_dim) ** -0.5,
        )  # fmt: skip

    def _backend(self, cache: KVCacheSpec, **options: Any) -> MLABackend:
        """The loop's backend (``options``: further ``MLABackend`` arguments)."""
        config = self.config
        return MLABackend(
            self.dims,
            cache,
            self.limits,
            model_dtype=self.model_dtype,
            provider=self.provider,
            platform=self.platform,
            device=self.device,
            context_chunk_tokens=config.context_chunk_tokens or config.max_num_seqs * config.block_size,
            **options,
        )

    def _initial_cache(self, num_blocks: int) -> torch.Tensor:
        """The paged cache, filled with random rows (stale data a request must never read)."""
        return self._randn(num_blocks, self.config.block_size, self.dims.latent_dim).to(self.kv_dtype)

    # -- random data -------------------------------------------------------------------------

    def _randn(self, *shape: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen).to(device=self.device, dtype=dtype or self.model_dtype)

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
        self.decode_reference = (ref_out, ref_lse)
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
        message = f"run_demo serves one process; use mla.tools.demo_dcp.run_dcp_demo for dcp={config.dcp}"
        raise InvalidInputError("config.dcp", message)
    start = time.perf_counter()
    loop = ServingLoop(config)
    for index in range(config.steps):
        record = loop.step(index)
        if progress is not None:
            progress(record)
    return loop.report(config.steps, time.perf_counter() - start)
