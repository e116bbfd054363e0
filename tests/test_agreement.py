"""Builder/impl agreement (one decision per phase, buffers sized at init), as a property over random steps.

For random step compositions within the engine limits (decodes of any qlen up to
``max_decode_qlen``, graph-padding requests and rows, prefills with and without cached
context), the impl launches exactly the strategy the builder recorded, with the plan it built;
the plan's geometry (kernel heads, kernel qlen, kernel rows) fits the buffers allocated at init;
no strategy is allocated after init; decode launches read no tensor value on the host; and the
outputs match the reference.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import mla
from mla.core.errors import PlanMismatchError
from mla.decode._paged import PagedDecode
from mla.decode._small_head import SmallHeadDecode
from mla.testing import (
    CachedContext,
    PrefillCase,
    PrefillInputs,
    RandomUpProjection,
    assert_matches_reference,
    emulated_provider,
    rounded_inputs,
)
from mla.tools.reference import reference_decode

BF16, F32, FP8 = torch.bfloat16, torch.float32, torch.float8_e4m3fn
RANK, ROPE, NOPE, V_DIM = 64, 16, 32, 24
MAX_SEQS, MAX_MODEL_LEN = 5, 48
KV_SCALE = 0.05


@attrs.frozen
class Config:
    provider: str
    arch: str
    heads: int
    max_decode_qlen: int
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    block_size: int

    @property
    def id(self) -> str:
        kv = str(self.kv_dtype).removeprefix("torch.")
        return f"{self.provider}-{self.arch}-h{self.heads}-T{self.max_decode_qlen}-{kv}-bs{self.block_size}"


CONFIGS = [
    Config("torch", "cpu", 3, 4, F32, F32, 16),
    Config("aiter", "gfx942", 8, 8, BF16, BF16, 1),
    Config("aiter", "gfx950", 12, 4, BF16, BF16, 16),
    Config("aiter", "gfx950", 16, 6, BF16, FP8, 64),
    Config("aiter", "gfx942", 24, 2, BF16, FP8, 16),
    Config("aiter", "gfx950", 4, 1, BF16, BF16, 1),
]

_BACKENDS: dict[Config, tuple[mla.MLABackend, list[tuple[str, object]]]] = {}


_SYNCING = ("item", "tolist", "__bool__", "__int__", "__float__")


@contextlib.contextmanager
def no_host_reads() -> Iterator[None]:
    """Within the block, reading a tensor's values on the host (``.item()``, ``.tolist()``,
    ``bool()``, ``int()``, ``float()``) raises: on a GPU each would be a device sync."""

    def refuse(name: str) -> Callable[..., object]:
        def method(self: torch.Tensor, *args: object) -> object:
            raise AssertionError(f"Tensor.{name} called inside a decode launch (a host sync on a GPU)")

        return method

    saved = {name: getattr(torch.Tensor, name) for name in _SYNCING}
    try:
        for name in _SYNCING:
            setattr(torch.Tensor, name, refuse(name))
        yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


def _spy(instance: Any, log: list[tuple[str, object]]) -> None:
    original: Callable[..., None] = instance.launch
    decode = isinstance(instance, mla.DecodeStrategy)

    def launch(plan: object, *args: Any, **kwargs: Any) -> None:
        log.append((instance.NAME, plan))
        if decode:
            with no_host_reads():
                original(plan, *args, **kwargs)
        else:
            original(plan, *args, **kwargs)

    instance.launch = launch


def cache_blocks(config: Config) -> int:
    """Blocks of every example's cache (and of the spec): room for the longest step's table."""
    return MAX_SEQS * -(-MAX_MODEL_LEN // config.block_size) + 1


def backend_for(config: Config) -> tuple[mla.MLABackend, list[tuple[str, object]]]:
    """One backend per config, reused across examples: buffers sized at init must fit them all."""
    if config not in _BACKENDS:
        backend = mla.MLABackend(
            mla.MLADims(config.heads, RANK, ROPE, NOPE, V_DIM, softmax_scale=1 / math.sqrt(RANK + ROPE)),
            mla.KVCacheSpec(config.block_size, config.kv_dtype, num_blocks=cache_blocks(config)),
            mla.EngineLimits(MAX_SEQS, MAX_MODEL_LEN, 128, max_decode_qlen=config.max_decode_qlen),
            model_dtype=config.q_dtype,
            provider=emulated_provider(config.provider, config.arch),
            platform=config.arch,
        )
        log: list[tuple[str, object]] = []
        for instance in [*backend.decode_strategies.values(), *backend.prefill_strategies.values()]:
            _spy(instance, log)
        _BACKENDS[config] = (backend, log)
    return _BACKENDS[config]


@attrs.frozen
class Step:
    decode_qlens: tuple[int, ...]
    decode_seq_lens: tuple[int, ...]
    extra_rows: int
    prefill_qlens: tuple[int, ...]
    prefill_contexts: tuple[int, ...]
    seed: int


@st.composite
def steps(draw: st.DrawFn, config: Config) -> Step:
    limit = config.max_decode_qlen
    num_decodes = draw(st.integers(0, MAX_SEQS))
    num_prefills = draw(st.integers(0 if num_decodes else 1, MAX_SEQS - num_decodes))
    if draw(st.booleans()):
        qlen = draw(st.integers(1, limit))
        qlens = [qlen] * num_decodes
    else:
        qlens = [draw(st.integers(1, limit)) for _ in range(num_decodes)]
    seq_lens = [draw(st.integers(q, MAX_MODEL_LEN)) for q in qlens]
    # Trailing graph-padding requests: seq_len 0, qlen 0 or the batch's qlen.
    padding = draw(st.integers(0, num_decodes // 2)) if num_decodes > 1 else 0
    top = max(qlens, default=1)
    for index in range(num_decodes - padding, num_decodes):
        qlens[index] = draw(st.sampled_from([0, top]))
        seq_lens[index] = 0
    if num_decodes and sum(qlens) == 0:
        qlens[0], seq_lens[0] = 1, draw(st.integers(1, MAX_MODEL_LEN))
    extra = 0
    if num_decodes and not num_prefills:
        extra = draw(st.integers(0, MAX_SEQS * limit - sum(qlens)))
    prefill_qlens = [draw(st.integers(1, 12)) for _ in range(num_prefills)]
    contexts = [draw(st.sampled_from([0, 0, draw(st.integers(1, MAX_MODEL_LEN - q))])) for q in prefill_qlens]
    return Step(
        tuple(qlens),
        tuple(seq_lens),
        extra,
        tuple(prefill_qlens),
        tuple(contexts),
        draw(st.integers(0, 2**16)),
    )


def _table(seq_lens: list[int], block_size: int, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(needed) + 1
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(len(seq_lens), -(-MAX_MODEL_LEN // block_size), dtype=torch.int32)
    cursor = 0
    for b, n in enumerate(needed):
        table[b, :n] = perm[cursor : cursor + n]
        cursor += n
    return table, num_blocks


def _indptr(lengths: list[int] | tuple[int, ...]) -> torch.Tensor:
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    out[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0).to(torch.int32)
    return out


def _check_decode_geometry(backend: mla.MLABackend, metadata: mla.MLAMetadata, step: Step) -> None:
    plan, decision = metadata.decode, metadata.decode_decision
    assert plan is not None
    assert decision is not None
    assert plan.strategy == decision.name
    strategy = backend.decode_strategies[plan.strategy]
    geo = plan.geometry
    caps = backend.capabilities
    assert geo.num_heads == backend.dims.num_heads
    assert geo.num_tokens == metadata.num_decode_tokens
    assert geo.q_dtype == backend.model_dtype
    assert geo.kv_dtype == backend.cache.dtype
    total_kv = sum(step.decode_seq_lens)
    assert int(plan.kv_indptr[-1]) == total_kv
    indices = backend.index_buffers.kv_indices
    # The per-token list exists only for kernels that take flat ids; others read the table.
    assert (indices is None) == (not caps.decode_token_ids)
    assert indices is None or indices.numel() >= total_kv
    if isinstance(strategy, PagedDecode):
        ws = strategy.workspace
        assert geo.kernel_heads == caps.padded_heads(geo.num_heads) == ws.q_kernel.shape[1]
        assert ws.o_kernel.shape[1] == ws.lse_kernel.shape[1] == geo.kernel_heads
        assert geo.kernel_qlen <= ws.max_kernel_qlen
        assert geo.num_kernel_rows <= ws.q_kernel.shape[0]
        assert geo.num_kernel_rows + 1 <= ws.o_kernel.shape[0]
        assert geo.num_requests + 1 <= ws.qo_indptr.numel()
        assert geo.num_tokens <= ws.kernel_row.numel()
        if strategy.PERSISTENT:
            schedule = ws.schedule
            assert isinstance(schedule, mla.providers.split_kv.SplitKVSchedule)
            assert schedule.partial_o.shape[1] >= geo.kernel_qlen
            assert schedule.partial_o.shape[2] == geo.kernel_heads
            assert schedule.max_batch >= geo.num_requests
        else:
            assert ws.schedule is None
    else:
        assert isinstance(strategy, SmallHeadDecode)
        assert geo.kernel_heads == geo.num_heads
        assert geo.kernel_qlen == 1
        ws_small = strategy.workspace
        assert geo.num_tokens + 1 <= ws_small.row_indptr.numel()
        if ws_small.row_page_table is not None:
            assert int(plan.row_indptr[-1]) <= ws_small.row_page_table.numel()  # type: ignore[attr-defined]
        else:
            assert plan.page_table is None  # type: ignore[attr-defined]


def _run_step(config: Config, step: Step) -> None:
    backend, log = backend_for(config)
    gen = torch.Generator().manual_seed(step.seed)
    num_decodes = len(step.decode_qlens)
    seq_lens = [
        *step.decode_seq_lens,
        *(c + q for c, q in zip(step.prefill_contexts, step.prefill_qlens, strict=True)),
    ]
    qlens = [*step.decode_qlens, *step.prefill_qlens]
    table, _used = _table(seq_lens, config.block_size, gen)
    values = torch.randn(cache_blocks(config), config.block_size, RANK + ROPE, generator=gen)
    if config.kv_dtype == FP8:
        cache = (values / KV_SCALE).to(FP8)
        kv_scale: float | None = KV_SCALE
    else:
        cache = values.to(config.kv_dtype)
        kv_scale = None
    qsl = _indptr(qlens)
    num_decode_tokens = int(qsl[num_decodes]) + step.extra_rows
    metadata = backend.builder.build(
        mla.StepInputs(
            query_start_loc_cpu=qsl,
            query_start_loc=qsl.clone(),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_table=table,
            num_decodes=num_decodes,
            num_decode_tokens=num_decode_tokens,
        )
    )
    log.clear()
    if num_decodes:
        _check_decode_geometry(backend, metadata, step)
        event(f"decode: {metadata.decode.strategy}")  # type: ignore[union-attr]
        q = torch.randn(num_decode_tokens, config.heads, RANK + ROPE, generator=gen).to(config.q_dtype)
        out = torch.full((num_decode_tokens, config.heads, RANK), math.nan, dtype=config.q_dtype)
        lse = torch.full((num_decode_tokens, config.heads), math.nan)
        backend.impl.forward_decode(metadata, q, cache, out=out, lse=lse, kv_scale=kv_scale)
        assert [(name, plan) for name, plan in log] == [(metadata.decode.strategy, metadata.decode)]  # type: ignore[union-attr]
        ref = reference_decode(
            q,
            cache,
            table[:num_decodes],
            torch.tensor(step.decode_seq_lens),
            qsl[: num_decodes + 1],
            softmax_scale=backend.dims.scale,
            kv_lora_rank=RANK,
            kv_scale=kv_scale,
        )
        assert_matches_reference(out, lse, *ref, context=f"decode {metadata.decode.strategy}")  # type: ignore[union-attr]
    else:
        assert metadata.decode is None
    log.clear()
    if step.prefill_qlens:
        plan, decision = metadata.prefill, metadata.prefill_decision
        assert plan is not None
        assert decision is not None
        assert plan.strategy == decision.name
        assert bool(plan.context_chunks) == any(step.prefill_contexts)
        event(f"prefill: {plan.strategy}")
        case = PrefillCase(
            heads=config.heads,
            q_lens=step.prefill_qlens,
            context_lens=step.prefill_contexts,
            dtype=config.q_dtype,
            qk_nope_dim=NOPE,
            rope_dim=ROPE,
            v_dim=V_DIM,
            kv_lora_rank=RANK,
            kv_dtype=config.kv_dtype,
            kv_scale=KV_SCALE,
            block_size=config.block_size,
            softmax_scale=backend.dims.scale,
        )
        tokens = sum(step.prefill_qlens)
        q = torch.randn(tokens, config.heads, NOPE + ROPE, generator=gen).to(config.q_dtype)
        k = torch.randn(tokens, config.heads, NOPE + ROPE, generator=gen).to(config.q_dtype)
        v = torch.randn(tokens, config.heads, V_DIM, generator=gen).to(config.q_dtype)
        cu = _indptr(step.prefill_qlens)
        inputs = PrefillInputs(
            case=case,
            q=q,
            k=k,
            v=v,
            cu_seqlens_q=cu,
            cu_seqlens_k=cu,
            max_seqlen_q=max(step.prefill_qlens),
            max_seqlen_k=max(step.prefill_qlens),
            context=CachedContext(
                kv_cache=cache,
                kv_scale=kv_scale,
                block_table=table[num_decodes:],
                seq_lens=torch.tensor(seq_lens[num_decodes:], dtype=torch.int32),
                expand=RandomUpProjection.random(case, gen, torch.device("cpu")),
            ),
        )
        out = torch.full((tokens, config.heads, V_DIM), math.nan, dtype=config.q_dtype)
        lse = torch.full((tokens, config.heads), math.nan)
        backend.impl.forward_prefill(
            metadata,
            q,
            k,
            v,
            out=out,
            lse=lse,
            kv_cache=cache,
            kv_scale=kv_scale,
            expand_context=inputs.context.expand,
        )
        assert [(name, p) for name, p in log] == [(plan.strategy, plan)]
        rounded = rounded_inputs(backend.prefill_strategies[plan.strategy], q, k, v)
        ref = inputs.reference(*rounded) if rounded is not None else inputs.reference()
        assert_matches_reference(out, lse, *ref, context=f"prefill {plan.strategy}")
    else:
        assert metadata.prefill is None
    assert backend.late_allocations == []


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.id)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_impl_runs_what_the_builder_recorded(config: Config, data: st.DataObject) -> None:
    _run_step(config, data.draw(steps(config)))


def test_init_allocates_every_strategy_the_limits_need() -> None:
    backend, _ = backend_for(CONFIGS[1])
    # gfx942, 8 heads, max decode qlen 8: persistent up to kernel qlen 4, non-persistent past it.
    assert set(backend.decode_strategies) == {"asm-padded-persistent", "asm-non-persistent"}
    assert set(backend.prefill_strategies) == {"flash-varlen"}
    backend, _ = backend_for(CONFIGS[2])
    assert set(backend.decode_strategies) == {"asm-padded-persistent", "gluon-verify-flatten"}


def _two_plans() -> tuple[mla.MLABackend, mla.MLAMetadata, mla.MLAMetadata, torch.Tensor]:
    backend, _ = backend_for(CONFIGS[1])
    table = torch.arange(2 * MAX_MODEL_LEN, dtype=torch.int32).view(2, MAX_MODEL_LEN)
    cache = torch.randn(cache_blocks(CONFIGS[1]), 1, RANK + ROPE).to(BF16)

    def build(qlen: int) -> mla.MLAMetadata:
        qsl = torch.tensor([0, qlen, 2 * qlen], dtype=torch.int32)
        return backend.builder.build(
            mla.StepInputs(qsl, qsl, torch.tensor([20, 30], dtype=torch.int32), table, 2, 2 * qlen)
        )

    return backend, build(1), build(6), cache


def test_plan_handed_to_the_wrong_strategy_raises() -> None:
    backend, persistent, non_persistent, cache = _two_plans()
    assert persistent.decode is not None
    assert non_persistent.decode is not None
    assert persistent.decode.strategy == "asm-padded-persistent"
    assert non_persistent.decode.strategy == "asm-non-persistent"
    q = torch.randn(2, 8, RANK + ROPE).to(BF16)
    out = torch.full((2, 8, RANK), math.nan, dtype=BF16)
    lse = torch.full((2, 8), math.nan)
    wrong = backend.decode_strategies["asm-non-persistent"]
    with pytest.raises(PlanMismatchError, match="built by 'asm-padded-persistent'"):
        wrong.run(persistent.decode, q, cache, kv_scale=None, out=out, lse=lse)
    assert torch.isnan(out).all()
    assert torch.isnan(lse).all()


def test_prefill_plan_handed_to_the_wrong_strategy_raises() -> None:
    backend = mla.MLABackend(
        mla.MLADims(16, RANK, ROPE, NOPE, V_DIM, softmax_scale=(NOPE + ROPE) ** -0.5),
        mla.KVCacheSpec(16, FP8),
        mla.EngineLimits(2, 64, 64),
        provider=emulated_provider("aiter", "gfx950"),
        platform="gfx950",
    )
    qsl = torch.tensor([0, 5], dtype=torch.int32)
    metadata = backend.builder.build(
        mla.StepInputs(
            qsl, qsl, torch.tensor([5], dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32), 0, 0
        )
    )
    assert metadata.prefill is not None
    assert metadata.prefill.strategy == "fp8-persistent-prefill"
    flash = backend.prefill_strategy("flash-varlen")
    q = k = torch.randn(5, 16, NOPE + ROPE).to(BF16)
    v = torch.randn(5, 16, V_DIM).to(BF16)
    out = torch.full((5, 16, V_DIM), math.nan, dtype=BF16)
    with pytest.raises(PlanMismatchError, match="fp8-persistent-prefill"):
        flash.run(metadata.prefill, q, k, v, out=out, lse=torch.empty(5, 16))
    assert torch.isnan(out).all()


def test_impl_refuses_inputs_of_another_geometry() -> None:
    """The run checks its inputs against the plan's geometry (cheaply) before any kernel."""
    backend, _, metadata, cache = _two_plans()  # the ops run the current (last built) plan
    q = torch.randn(3, 8, RANK + ROPE).to(BF16)
    out = torch.full((3, 8, RANK), math.nan, dtype=BF16)
    with pytest.raises(mla.InvalidInputError, match="q: expected shape"):
        backend.impl.forward_decode(metadata, q, cache, out=out)
    assert torch.isnan(out).all()
