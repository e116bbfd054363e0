"""A user's decode strategy, defined here, registered with a priority: the resolver picks it up
without any edit to mla, ``explain`` lists it, and it passes the conformance kit."""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar

import attrs
import pytest
import torch

import mla
from mla import Contract, DecodeStrategy, Resolver, StrategyKind
from mla.core.context import DecodeContext
from mla.core.support import ReasonCollector
from mla.decode.base import DecodeBatch, DecodeIndexBuffers, DecodePlan
from mla.strategy import StrategySetup
from mla.testing import (
    DecodeCase,
    check_decode_strategy,
    decode_cases,
    emulated_provider,
    make_decode_inputs,
    scratch_registry,
    simulated_decode_context,
)


@attrs.frozen(eq=False)
class DensePlan(DecodePlan):
    qo_indptr: torch.Tensor
    """int32 ``[B+1]`` view of a buffer allocated at init."""


class DenseWindowDecode(DecodeStrategy):
    """Dense masked attention: every query row gathers ``max_model_len`` cache rows through the
    flat page indices and masks them to its right-aligned causal window. No head or qlen
    padding, fixed shapes, no host sync in ``launch`` (graph-capturable), float32 math."""

    NAME: ClassVar[str] = "test-dense-window"
    KIND: ClassVar[StrategyKind] = StrategyKind.CUSTOM
    REQUIRES: ClassVar[frozenset[Contract]] = frozenset({Contract.EXPAND_PAGES})
    MAX_QLEN: ClassVar[int] = 8
    CAUSAL: ClassVar[bool] = True
    """Mask each row to its right-aligned causal window (a test switches it off to show the kit
    catches the bug)."""

    def __init__(self, setup: StrategySetup, index_buffers: DecodeIndexBuffers | None = None) -> None:
        super().__init__(setup, index_buffers)
        self.qo_indptr = torch.zeros(setup.limits.max_num_seqs + 1, dtype=torch.int32, device=setup.device)

    @classmethod
    def check(cls, ctx: DecodeContext, reasons: ReasonCollector) -> None:
        reasons.require(
            ctx.max_qlen <= cls.MAX_QLEN,
            "qlen",
            f"max qlen {ctx.max_qlen}: the dense window decode handles at most {cls.MAX_QLEN}",
        )

    def build_metadata(self, batch: DecodeBatch) -> DensePlan:
        kv_indptr, _ = self.index_buffers.fill(self.setup, batch)
        qo_indptr = self.qo_indptr[: batch.num_requests + 1]
        qo_indptr.copy_(batch.query_start_loc)
        geometry = self.base_geometry(
            batch,
            kernel_heads=batch.context.num_heads,
            kernel_qlen=batch.context.max_qlen,
            num_kernel_rows=batch.num_tokens,
        )
        return DensePlan(self.NAME, geometry, kv_indptr, self.index_buffers.kv_indices, qo_indptr=qo_indptr)

    def launch(
        self,
        plan: DecodePlan,
        q: torch.Tensor,
        kv_flat: torch.Tensor,
        *,
        kv_scale: torch.Tensor | None,
        out: torch.Tensor,
        lse: torch.Tensor | None,
    ) -> None:
        assert isinstance(plan, DensePlan)
        geo, dev = plan.geometry, q.device
        rows = torch.arange(geo.num_tokens, device=dev)
        req = torch.searchsorted(plan.qo_indptr[1:].contiguous(), rows.to(torch.int32), right=True)
        owned = req < geo.num_requests
        req = torch.clamp(req, max=geo.num_requests - 1).to(torch.int64)
        qlen = plan.qo_indptr[req + 1] - plan.qo_indptr[req]
        kv_len = plan.kv_indptr[req + 1] - plan.kv_indptr[req]
        window = torch.clamp(kv_len - qlen + (rows - plan.qo_indptr[req]) + 1, min=0)
        if not self.CAUSAL:
            window = kv_len
        window = torch.where(owned, window, torch.zeros_like(window))
        keys = torch.arange(geo.max_seqlen_k, device=dev)
        visible = keys[None, :] < window[:, None]
        position = torch.clamp(plan.kv_indptr[req][:, None] + keys[None, :], max=plan.kv_indices.numel() - 1)
        cache = kv_flat[plan.kv_indices[position].to(torch.int64)].to(torch.float32)
        if kv_scale is not None:
            cache = cache * kv_scale
        scores = torch.einsum("thd,tsd->ths", q.to(torch.float32), cache) * self.setup.dims.scale
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        row_lse = torch.logsumexp(scores, dim=-1)
        safe = torch.where(torch.isfinite(row_lse), row_lse, torch.zeros_like(row_lse))
        probs = torch.exp(scores - safe[..., None])
        out.copy_(torch.einsum("ths,tsl->thl", probs, cache[..., : out.shape[-1]]))
        if lse is not None:  # None: the caller wants no LSE (the production default)
            lse.copy_(row_lse)


PRIORITY = 5
"""Ahead of every built-in decode strategy (10..40)."""


@pytest.fixture
def registry() -> mla.Registry:
    return scratch_registry([(DenseWindowDecode, PRIORITY)])


@pytest.fixture
def registered_by_default() -> Iterator[None]:
    """Registers the strategy in the default registry for one test, then restores it."""
    before = mla.DEFAULT_REGISTRY.names(mla.Phase.DECODE)
    mla.register(DenseWindowDecode, priority=PRIORITY)
    try:
        yield
    finally:
        mla.DEFAULT_REGISTRY.unregister(DenseWindowDecode.NAME)
        assert mla.DEFAULT_REGISTRY.names(mla.Phase.DECODE) == before


def _ctx(
    *,
    heads: int = 8,
    qlen: int = 1,
    max_decode_qlen: int = 1,
    arch: str = "cpu",
    graph_mode: mla.GraphMode = mla.GraphMode.NONE,
) -> DecodeContext:
    return simulated_decode_context(
        arch,
        heads=heads,
        qlen=qlen,
        limits=mla.EngineLimits(16, 1024, 1024, max_decode_qlen=max_decode_qlen, graph_mode=graph_mode),
    )


@pytest.mark.parametrize("arch", ["cpu", "gfx942", "gfx950"])
def test_registered_strategy_is_chosen(registry: mla.Registry, arch: str) -> None:
    ctx = _ctx(arch=arch)
    decision = Resolver(registry).resolve(ctx)
    assert decision.strategy is DenseWindowDecode
    explanation = Resolver(registry).explain(ctx)
    assert explanation.chosen == DenseWindowDecode.NAME
    assert explanation.candidates[0].name == DenseWindowDecode.NAME
    assert explanation.candidate(DenseWindowDecode.NAME).supported
    # The default registry is untouched.
    assert DenseWindowDecode.NAME not in [c.name for c in Resolver().explain(ctx).candidates]


def test_unsupported_user_strategy_appears_with_its_reason(registry: mla.Registry) -> None:
    ctx = _ctx(qlen=9, max_decode_qlen=9)
    explanation = Resolver(registry).explain(ctx)
    candidate = explanation.candidate(DenseWindowDecode.NAME)
    assert candidate.reasons[0].code == "qlen"
    assert "at most 8" in candidate.reasons[0].message
    assert explanation.chosen == "asm-padded-persistent"
    assert f"{DenseWindowDecode.NAME}: not supported" in str(explanation)


class UncapturableDenseDecode(DenseWindowDecode):
    """The same strategy declared not CUDA-graph capturable."""

    NAME: ClassVar[str] = "test-dense-uncapturable"
    GRAPH_SUPPORT: ClassVar[mla.GraphSupport] = mla.GraphSupport.NEVER


@pytest.mark.parametrize("mode", list(mla.GraphMode))
def test_a_full_graph_engine_refuses_an_uncapturable_strategy(mode: mla.GraphMode) -> None:
    """``graph_mode=FULL`` captures whole decode steps: a ``GRAPH_SUPPORT = NEVER`` strategy is
    refused with a ``graph`` reason; piecewise capture runs attention eagerly, so it is fine."""
    ctx = _ctx(graph_mode=mode)
    support = UncapturableDenseDecode.supports(ctx)
    assert DenseWindowDecode.supports(ctx)
    if mode is mla.GraphMode.FULL:
        assert support.codes == ("graph",)
        assert "not capturable" in support.reasons[0].message
    else:
        assert support
    explanation = Resolver(scratch_registry([(UncapturableDenseDecode, PRIORITY)])).explain(ctx)
    assert (explanation.chosen == UncapturableDenseDecode.NAME) is (mode is not mla.GraphMode.FULL)
    assert ("graph_mode", mode.value) in explanation.context


def test_the_backend_refuses_to_force_an_uncapturable_strategy_under_full_graphs() -> None:
    dims, cache = mla.MLADims(8, softmax_scale=192**-0.5), mla.KVCacheSpec(16, "bf16")
    full = mla.EngineLimits(4, 64, 64, graph_mode=mla.GraphMode.FULL)
    with pytest.raises(mla.UnsupportedError, match="not capturable") as raised:
        mla.MLABackend(
            dims, cache, full, provider="torch", platform="cpu", decode_strategy=UncapturableDenseDecode
        )
    assert raised.value.explanation is not None
    assert raised.value.explanation.candidate(UncapturableDenseDecode.NAME).reasons[0].code == "graph"
    eager = attrs.evolve(full, graph_mode=mla.GraphMode.PIECEWISE)
    backend = mla.MLABackend(
        dims, cache, eager, provider="torch", platform="cpu", decode_strategy=UncapturableDenseDecode
    )
    assert UncapturableDenseDecode.NAME in backend.decode_strategies


def test_backend_runs_the_user_strategy(registry: mla.Registry) -> None:
    case = DecodeCase(heads=6, qlens=(3, 1, 2), seq_lens=(30, 17, 2), kv_lora_rank=64, rope_dim=16)
    inputs = make_decode_inputs(case)
    backend = mla.MLABackend(
        mla.MLADims(case.heads, case.kv_lora_rank, case.rope_dim, softmax_scale=case.scale),
        mla.KVCacheSpec(case.block_size, case.kv_dtype),
        mla.EngineLimits(4, 64, 64, max_decode_qlen=4),
        provider="torch",
        platform="cpu",
        resolver=Resolver(registry),
    )
    assert DenseWindowDecode.NAME in backend.decode_strategies
    metadata = backend.builder.build(inputs.step())
    assert metadata.decode_decision is not None
    assert metadata.decode_decision.strategy is DenseWindowDecode
    out, lse = inputs.poisoned_outputs()
    backend.impl.forward_decode(metadata, inputs.q, inputs.kv_cache, out=out, lse=lse)
    mla.testing.assert_matches_reference(out, lse, *inputs.reference())
    assert backend.late_allocations == []


def test_default_registration_reaches_the_functional_api(registered_by_default: None) -> None:
    case = DecodeCase(heads=3, qlens=(1, 1), seq_lens=(40, 9), kv_lora_rank=64, rope_dim=16, seed=3)
    inputs = make_decode_inputs(case)
    backend = mla.MLABackend(
        mla.MLADims(case.heads, case.kv_lora_rank, case.rope_dim, softmax_scale=case.scale),
        mla.KVCacheSpec(case.block_size, case.kv_dtype),
        mla.EngineLimits(2, 64, 64),
        provider="torch",
        platform="cpu",
    )
    assert backend.builder.build(inputs.step()).decode_decision.name == DenseWindowDecode.NAME  # type: ignore[union-attr]
    out, lse = mla.mla_decode(
        inputs.q,
        inputs.kv_cache,
        inputs.block_table,
        inputs.seq_lens,
        query_start_loc=inputs.query_start_loc,
        softmax_scale=case.scale,
        kv_lora_rank=case.kv_lora_rank,
        provider="torch",
        platform="cpu",
    )
    mla.testing.assert_matches_reference(out, lse, *inputs.reference())


KIT_CASES = list(
    decode_cases(
        heads=(1, 5, 16, 24),
        qlen_patterns=((1, 1), (3, 3), (2, 7, 5), (8, 1)),
        dtypes=((torch.float32, torch.float32), (torch.bfloat16, torch.float8_e4m3fn)),
        seed=7,
    )
)


@pytest.mark.parametrize(("provider", "arch"), [("torch", "cpu"), ("aiter", "gfx950")])
@pytest.mark.parametrize("case", KIT_CASES, ids=lambda c: c.id)
def test_user_strategy_passes_the_kit(
    registry: mla.Registry, provider: str, arch: str, case: DecodeCase
) -> None:
    result = check_decode_strategy(
        DenseWindowDecode, case, provider=emulated_provider(provider, arch), platform=arch, registry=registry
    )
    if not result.supported:
        pytest.skip(f"{DenseWindowDecode.NAME}: {result.reasons}")
    result.assert_passed()


def test_kit_catches_a_wrong_user_strategy() -> None:
    """A strategy that ignores the causal window (sees every key) fails the kit on verify rows."""

    class SeesTheFuture(DenseWindowDecode):
        NAME = "test-sees-the-future"
        CAUSAL = False

    case = DecodeCase(heads=2, qlens=(1,), seq_lens=(20,), kv_lora_rank=64, rope_dim=16)
    assert check_decode_strategy(SeesTheFuture, case, provider="torch", platform="cpu").ok
    verify = DecodeCase(heads=2, qlens=(3,), seq_lens=(20,), kv_lora_rank=64, rope_dim=16)
    result = check_decode_strategy(SeesTheFuture, verify, provider="torch", platform="cpu")
    assert result.supported
    assert not result.ok


def test_a_name_another_phase_holds_is_refused() -> None:
    class Clash(DenseWindowDecode):
        NAME = mla.FlashVarlen.NAME  # a prefill strategy's

    registry = scratch_registry([(DenseWindowDecode, PRIORITY)])
    before = registry.version
    with pytest.raises(mla.InvalidInputError, match="already the name of a prefill strategy") as info:
        mla.register(Clash, priority=PRIORITY, registry=registry)
    assert info.value.argument == "strategy"
    assert "FlashVarlen" in str(info.value)
    assert registry.version == before
    assert Clash.NAME not in registry.names(mla.Phase.DECODE)
