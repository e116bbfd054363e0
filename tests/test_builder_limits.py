"""The builder enforces the engine limits the backend was sized for, as a property.

Random sequences of steps go through one backend per configuration, with the host copies an
engine passes (``query_start_loc_cpu``, ``seq_lens_cpu``). A step within the limits builds and
allocates no strategy after init (every buffer it uses was sized at init); a step beyond one
limit (requests, decode qlen, decode rows, tokens, model length, a prefill placed before the
decodes; block ids under ``validate="full"``) raises :class:`InvalidInputError` at ``build``,
naming the argument, and allocates nothing either.
"""

from __future__ import annotations

import attrs
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import mla
from mla import InvalidInputError
from mla.testing import emulated_provider

RANK, ROPE = 64, 16
LIMITS = mla.EngineLimits(max_num_seqs=4, max_model_len=48, max_num_batched_tokens=32, max_decode_qlen=3)
BLOCK_SIZE = 8
NUM_BLOCKS = 40
TABLE_WIDTH = 8
"""Block-table columns: more than a request within ``max_model_len`` needs (6)."""


@attrs.frozen
class Config:
    provider: str
    arch: str
    heads: int
    kv_dtype: torch.dtype
    num_blocks: int | None
    validate: str

    @property
    def id(self) -> str:
        blocks = "known" if self.num_blocks else "unknown"
        kv = str(self.kv_dtype).removeprefix("torch.")
        return f"{self.provider}-{self.arch}-h{self.heads}-{kv}-{blocks}-{self.validate}"


CONFIGS = [
    Config("torch", "cpu", 4, torch.float32, NUM_BLOCKS, "full"),
    Config("torch", "cpu", 8, torch.bfloat16, None, "fast"),
    Config("aiter", "gfx942", 8, torch.bfloat16, NUM_BLOCKS, "fast"),
    Config("aiter", "gfx950", 12, torch.bfloat16, NUM_BLOCKS, "fast"),
    Config("aiter", "gfx950", 16, torch.float8_e4m3fn, NUM_BLOCKS, "full"),
]
_BACKENDS: dict[Config, tuple[mla.MLABackend, frozenset[int]]] = {}


def backend_for(config: Config) -> tuple[mla.MLABackend, frozenset[int]]:
    """One backend per config, reused by every step; with the ids of the strategies allocated
    at init."""
    if config not in _BACKENDS:
        backend = mla.MLABackend(
            mla.MLADims(config.heads, RANK, ROPE, 32, 24, softmax_scale=(32 + ROPE) ** -0.5),
            mla.KVCacheSpec(BLOCK_SIZE, config.kv_dtype, num_blocks=config.num_blocks),
            LIMITS,
            model_dtype=torch.bfloat16 if config.provider == "aiter" else torch.float32,
            provider=emulated_provider(config.provider, config.arch),
            platform=config.arch,
            validate=config.validate,  # type: ignore[arg-type]
        )
        instances = [*backend.decode_strategies.values(), *backend.prefill_strategies.values()]
        _BACKENDS[config] = (backend, frozenset(id(s) for s in instances))
    return _BACKENDS[config]


@attrs.frozen
class Step:
    qlens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    num_decodes: int
    num_decode_tokens: int
    table: tuple[tuple[int, ...], ...]
    violation: str | None
    """The limit this step breaks (``None``: within every limit)."""
    argument: str | None
    """The argument the builder must name for it."""


@st.composite
def valid_step(draw: st.DrawFn) -> dict[str, object]:
    """Requests within every limit: decodes (some graph padding) first, then prefills."""
    num_requests = draw(st.integers(1, LIMITS.max_num_seqs))
    num_decodes = draw(st.integers(0, num_requests))
    top = draw(st.integers(1, LIMITS.max_decode_qlen))
    qlens, seq_lens = [], []
    budget = LIMITS.max_num_batched_tokens
    for index in range(num_requests):
        if index < num_decodes:
            padding = index > 0 and draw(st.booleans()) and draw(st.booleans())
            qlen = draw(st.sampled_from([0, top])) if padding else draw(st.integers(1, top))
            seq = 0 if padding else draw(st.integers(qlen, LIMITS.max_model_len))
        else:
            room = budget - sum(qlens) - (num_requests - index - 1)
            qlen = draw(st.integers(1, max(1, min(12, room))))
            seq = qlen + draw(st.sampled_from([0, draw(st.integers(0, LIMITS.max_model_len - qlen))]))
        qlens.append(qlen)
        seq_lens.append(seq)
    owned = sum(qlens[:num_decodes])
    extra = 0
    if num_decodes == num_requests and num_decodes:
        extra = draw(st.integers(0, LIMITS.max_decode_tokens - owned))
    return {
        "qlens": qlens,
        "seq_lens": seq_lens,
        "num_decodes": num_decodes,
        "num_decode_tokens": owned + extra,
    }


def _table(draw: st.DrawFn, num_requests: int) -> list[list[int]]:
    return [
        draw(st.lists(st.integers(0, NUM_BLOCKS - 1), min_size=TABLE_WIDTH, max_size=TABLE_WIDTH))
        for _ in range(num_requests)
    ]


VIOLATIONS = ("requests", "decode-qlen", "prefill-first", "decode-rows", "tokens", "model-len", "block-id")


@st.composite
def steps(draw: st.DrawFn, config: Config) -> Step:
    base = draw(valid_step())
    qlens: list[int] = list(base["qlens"])  # type: ignore[call-overload]
    seq_lens: list[int] = list(base["seq_lens"])  # type: ignore[call-overload]
    num_decodes: int = base["num_decodes"]  # type: ignore[assignment]
    num_decode_tokens: int = base["num_decode_tokens"]  # type: ignore[assignment]
    violation = draw(st.sampled_from((None, None, *VIOLATIONS)))
    if violation == "block-id" and (config.num_blocks is None or config.validate != "full"):
        # Block ids are read on the host only under validate="full" (and then checked against
        # the cache a run is handed when the spec does not know its size: test_bad_input.py).
        violation = None
    argument: str | None = None
    table = _table(draw, len(qlens))
    if violation == "requests":
        extra = draw(st.integers(1, 2))
        qlens, seq_lens = [1] * (LIMITS.max_num_seqs + extra), [5] * (LIMITS.max_num_seqs + extra)
        num_decodes = num_decode_tokens = len(qlens)
        table = _table(draw, len(qlens))
        argument = "query_start_loc"
    elif violation in ("decode-qlen", "prefill-first"):
        # The first request (counted as a decode) has more tokens than a decode may.
        qlen = draw(st.integers(LIMITS.max_decode_qlen + 1, 12))
        seq = draw(st.integers(qlen, LIMITS.max_model_len)) if violation == "decode-qlen" else qlen
        qlens[0], seq_lens[0] = qlen, seq
        num_decodes = max(num_decodes, 1)
        num_decode_tokens = sum(qlens[:num_decodes])
        argument = "query_start_loc"
    elif violation == "decode-rows":
        # A decode-only step padded to more rows than max_num_seqs * max_decode_qlen.
        qlens = [min(q, LIMITS.max_decode_qlen) for q in qlens]
        seq_lens = [max(s, q) if s else 0 for s, q in zip(seq_lens, qlens, strict=True)]
        num_decodes = len(qlens)
        num_decode_tokens = LIMITS.max_decode_tokens + draw(st.integers(1, 3))
        argument = "num_decode_tokens"
    elif violation == "tokens":
        qlens = [*qlens, LIMITS.max_num_batched_tokens + 1 - sum(qlens) + draw(st.integers(0, 4))]
        seq_lens = [*seq_lens, qlens[-1]]
        table = _table(draw, len(qlens))
        if len(qlens) > LIMITS.max_num_seqs:
            qlens, seq_lens, table = qlens[1:], seq_lens[1:], table[1:]
            num_decodes = max(0, num_decodes - 1)
        num_decode_tokens = sum(qlens[:num_decodes])
        argument = "query_start_loc" if sum(qlens) > LIMITS.max_num_batched_tokens else None
        violation = violation if argument else None
    elif violation == "model-len":
        index = draw(st.integers(0, len(qlens) - 1))
        seq_lens[index] = LIMITS.max_model_len + draw(st.integers(1, 8))
        argument = "seq_lens"
    elif violation == "block-id":
        live = [b for b, s in enumerate(seq_lens) if s > 0]
        if live:
            b = draw(st.sampled_from(live))
            column = draw(st.integers(0, (seq_lens[b] - 1) // BLOCK_SIZE))
            table[b][column] = NUM_BLOCKS + draw(st.integers(0, 5))
            argument = "block_table"
        else:
            violation = None
    return Step(
        tuple(qlens),
        tuple(seq_lens),
        num_decodes,
        num_decode_tokens,
        tuple(tuple(row) for row in table),
        violation,
        argument,
    )


def _inputs(step: Step) -> mla.StepInputs:
    qsl = torch.zeros(len(step.qlens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(step.qlens, dtype=torch.int32), 0)
    return mla.StepInputs(
        query_start_loc_cpu=qsl,
        query_start_loc=qsl.clone(),
        seq_lens=torch.tensor(step.seq_lens, dtype=torch.int32),
        seq_lens_cpu=torch.tensor(step.seq_lens, dtype=torch.int32),
        block_table=torch.tensor(step.table, dtype=torch.int32),
        num_decodes=step.num_decodes,
        num_decode_tokens=step.num_decode_tokens,
    )


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.id)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_steps_within_the_limits_build_without_late_allocation_and_beyond_them_fail_at_build(
    config: Config, data: st.DataObject
) -> None:
    backend, allocated = backend_for(config)
    sequence = data.draw(st.lists(steps(config), min_size=1, max_size=5))
    for step in sequence:
        event(f"violation: {step.violation}")
        if step.violation is None:
            metadata = backend.builder.build(_inputs(step))
            assert metadata.num_decodes == step.num_decodes
            if metadata.decode is not None:
                assert metadata.decode.geometry.kernel_qlen <= max(
                    backend.capabilities.kernel_qlen(q, uniform=u)
                    for q in range(1, LIMITS.max_decode_qlen + 1)
                    for u in (True, False)
                )
        else:
            with pytest.raises(InvalidInputError) as info:
                backend.builder.build(_inputs(step))
            assert info.value.argument == step.argument, (step, str(info.value))
            if step.violation == "prefill-first":
                assert "a prefill placed before the decodes" in str(info.value)
        assert backend.late_allocations == []
        instances = [*backend.decode_strategies.values(), *backend.prefill_strategies.values()]
        assert frozenset(id(s) for s in instances) == allocated


def test_a_provider_that_reads_every_id_needs_the_cache_block_count() -> None:
    """aiter's decode kernels read every token id: without ``KVCacheSpec.num_blocks`` the page
    fill could not keep a block past the cache out of their ranges, so a decode build refuses."""
    backend = mla.MLABackend(
        mla.MLADims(8, RANK, ROPE, 32, 24, softmax_scale=(32 + ROPE) ** -0.5),
        mla.KVCacheSpec(BLOCK_SIZE, torch.bfloat16),
        LIMITS,
        model_dtype=torch.bfloat16,
        provider=emulated_provider("aiter", "gfx942"),
        platform="gfx942",
    )
    qsl = torch.tensor([0, 1], dtype=torch.int32)
    lens = torch.tensor([5], dtype=torch.int32)
    step = mla.StepInputs(qsl, qsl, lens, torch.zeros(1, 1, dtype=torch.int32), 1, 1, seq_lens_cpu=lens)
    with pytest.raises(InvalidInputError, match="num_blocks") as info:
        backend.builder.build(step)
    assert info.value.argument == "cache"
