"""The sparse engine path (DeepSeek Sparse Attention) on the torch provider: resolution, the
builder's row map, the impl's sparse calls against the float64 references, the layer, bad input
and ``torch.compile``.

Every step runs the way an engine runs it: ``builder.build``, ``impl.write_kv`` and
``impl.write_index_keys`` of the step's tokens, ``impl.index_topk`` over all of its rows, then
``impl.forward_sparse_decode`` on the decode rows and ``impl.forward_sparse_prefill`` on the
prefill rows. Caches are NaN wherever no request owns the position (``fp8_ds_mla``: NaN tile
scales; fp8 index keys: NaN bytes and scales), outputs and LSE are NaN before each call, and the
selection comes both from mla's indexer and from hand-made lists with ``-1`` between and after
the positions. The indexer is checked without depending on how ties break
(:func:`mla.tools.demo_sparse.selection_gap`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

import attrs
import pytest
import sparse_steps
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from layouts import strided_last_dim
from rejections import expect_invalid
from sparse_steps import assert_close, check_selection
from torch import nn
from torch._dynamo.utils import counters

import mla
from mla.core.config import DS_MLA_DTYPE, ds_mla_row_bytes
from mla.providers import TorchProvider
from mla.providers.calls import SparseAttentionCall, SparseSlotsCall
from mla.testing import encode_latent_cache, poisoned_index_cache, simulated_capabilities
from mla.testing.sparse import SELECTION_POISON

RANK, ROPE, NOPE, VDIM = 128, 16, 16, 32
BLOCK, NUM_BLOCKS, WIDTH = 8, 32, 6
TOPK = 12
INDEX_HEADS, INDEX_DIM = 4, 32
SCALE = (RANK + ROPE) ** -0.5
MAX_LEN = BLOCK * (WIDTH - 1)
F32, BF16, E4M3 = torch.float32, torch.bfloat16, torch.float8_e4m3fn
LIMITS = mla.EngineLimits(max_num_seqs=4, max_model_len=MAX_LEN, max_num_batched_tokens=16, max_decode_qlen=4)


@attrs.frozen
class KVFormat:
    name: str
    model_dtype: torch.dtype
    cache_dtype: torch.dtype
    kv_scale: float | None
    tol: float


FORMATS = [
    KVFormat("float32", F32, F32, None, 1e-5),
    KVFormat("bf16", BF16, BF16, None, 2e-2),
    KVFormat("fp8", F32, E4M3, 0.0625, 1e-5),
    KVFormat("fp8_ds_mla", BF16, DS_MLA_DTYPE, None, 2e-2),
]
"""Per-tensor fp8 and ``fp8_ds_mla`` are compared with the reference on the same quantized
cache (it dequantizes), so the model dtype's tolerance applies."""


def _dims(heads: int, topk: int = TOPK, rank: int = RANK) -> mla.MLADims:
    return mla.MLADims(heads, rank, ROPE, NOPE, VDIM, softmax_scale=SCALE, index_topk=topk)


def _indexer(key_dtype: torch.dtype | str = F32) -> mla.IndexerSpec:
    return mla.IndexerSpec(num_heads=INDEX_HEADS, head_dim=INDEX_DIM, key_dtype=key_dtype)


def _backend(
    heads: int = 3,
    fmt: KVFormat = FORMATS[0],
    key_dtype: torch.dtype | str = F32,
    *,
    limits: mla.EngineLimits = LIMITS,
    provider: str | mla.KernelProvider = "torch",
    **options: Any,
) -> mla.MLABackend:
    """A sparse model's backend on the torch provider (CPU; or ``provider``), sized by
    :data:`LIMITS`."""
    return mla.MLABackend(
        _dims(heads),
        mla.KVCacheSpec(BLOCK, fmt.cache_dtype, num_blocks=NUM_BLOCKS),
        limits,
        model_dtype=fmt.model_dtype,
        indexer=_indexer(key_dtype),
        provider=provider,
        platform="cpu",
        **options,
    )


# -- steps ----------------------------------------------------------------------------------------


@attrs.frozen
class Scenario:
    """One engine step: decode requests first, ``extra`` graph-padding rows after them."""

    name: str
    qlens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    num_decodes: int
    extra: int = 0


SCENARIOS = [
    Scenario("decode", (1, 1, 1), (20, 5, 33), 3),
    Scenario("verify-mixed", (1, 3, 2, 4), (17, 9, 30, 4), 4),
    Scenario("decode-graph-padding", (2, 2, 2), (15, 30, 0), 3, extra=2),
    Scenario("prefill", (6, 3), (6, 3), 0),
    Scenario("prefill-context", (5, 4), (19, 4), 0),
    Scenario("mixed", (1, 2, 5, 4), (25, 12, 19, 4), 2),
]


@attrs.frozen(eq=False)
class Step:
    """A scenario's engine inputs and its row bookkeeping."""

    scenario: Scenario
    inputs: mla.StepInputs
    table: torch.Tensor
    """int64 host copy of the block table."""

    @property
    def rows(self) -> int:
        return self.inputs.num_decode_tokens + self.prefill_rows

    @property
    def owned(self) -> int:
        return sum(self.scenario.qlens)

    @property
    def num_decode_tokens(self) -> int:
        return self.inputs.num_decode_tokens

    @property
    def prefill_rows(self) -> int:
        return sum(self.scenario.qlens[self.scenario.num_decodes :])

    def slot(self, request: int, position: int) -> int:
        return int(self.table[request, position // BLOCK]) * BLOCK + position % BLOCK

    def row_positions(self) -> list[tuple[int, int] | None]:
        """Per query row: ``(request, window)`` (positions ``0 .. window - 1`` visible), or
        ``None`` for a graph-padding row."""
        out: list[tuple[int, int] | None] = []
        sc = self.scenario
        for b, (qlen, seq) in enumerate(zip(sc.qlens, sc.seq_lens, strict=True)):
            out += [(b, max(0, seq - qlen + i + 1)) for i in range(qlen)]
        return out + [None] * sc.extra

    def new_slots(self) -> torch.Tensor:
        """The slot of each row's new token (``-1`` for padding rows and padding requests)."""
        sc = self.scenario
        slots = []
        for b, (qlen, seq) in enumerate(zip(sc.qlens, sc.seq_lens, strict=True)):
            slots += [self.slot(b, seq - qlen + i) if seq else -1 for i in range(qlen)]
        return torch.tensor(slots + [-1] * sc.extra, dtype=torch.int64)

    def new_rows(self, latent: list[torch.Tensor]) -> torch.Tensor:
        """float32 ``[rows, L+R]``: each row's new token from the requests' ``latent`` rows
        (zeros for padding rows)."""
        out = torch.zeros(self.rows, RANK + ROPE)
        for t, where in enumerate(self.row_positions()):
            if where is not None and where[1] > 0:
                b, window = where
                out[t] = latent[b][window - 1]
        return out


def make_step(scenario: Scenario, gen: torch.Generator) -> Step:
    """Blocks from a random permutation; columns past a request's blocks hold random (stale,
    possibly another request's) block ids."""
    perm = torch.randperm(NUM_BLOCKS, generator=gen)
    table = torch.randint(0, NUM_BLOCKS, (len(scenario.qlens), WIDTH), generator=gen)
    cursor = 0
    for b, seq in enumerate(scenario.seq_lens):
        need = -(-seq // BLOCK)
        table[b, :need] = perm[cursor : cursor + need]
        cursor += need
    qsl = torch.zeros(len(scenario.qlens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(scenario.qlens), 0)
    lens = torch.tensor(scenario.seq_lens, dtype=torch.int32)
    inputs = mla.StepInputs(
        query_start_loc_cpu=qsl,
        query_start_loc=qsl.clone(),
        seq_lens=lens.clone(),
        seq_lens_cpu=lens,
        block_table=table.to(torch.int32),
        num_decodes=scenario.num_decodes,
        num_decode_tokens=int(qsl[scenario.num_decodes]) + scenario.extra,
    )
    return Step(scenario, inputs, table)


@attrs.frozen(eq=False)
class Caches:
    kv_cache: torch.Tensor
    index_cache: torch.Tensor
    latent: list[torch.Tensor]
    """Per request, float32 ``[seq_len, L+R]``: the latent rows written (model dtype values)."""


def fill_caches(backend: mla.MLABackend, step: Step, fmt: KVFormat, gen: torch.Generator) -> Caches:
    """NaN caches; each request's cached context and the step's new tokens written through the
    impl (``write_kv``, ``write_index_keys``), as a model writes them."""
    assert backend.indexer is not None
    spec = backend.indexer.spec
    nan_rows = torch.full((NUM_BLOCKS * BLOCK, RANK + ROPE), math.nan)
    kv_cache = encode_latent_cache(nan_rows, fmt.cache_dtype, kv_lora_rank=RANK, kv_scale=fmt.kv_scale)
    kv_cache = kv_cache.view(NUM_BLOCKS, BLOCK, -1)
    index_cache = poisoned_index_cache(spec, NUM_BLOCKS, BLOCK)
    latent: list[torch.Tensor] = []
    impl = backend.impl
    sc = step.scenario
    for b, seq in enumerate(sc.seq_lens):
        rows = torch.randn(seq, RANK + ROPE, generator=gen).to(fmt.model_dtype).float()
        latent.append(rows)
        slots = torch.tensor([step.slot(b, p) for p in range(seq)], dtype=torch.int64)
        context = seq - sc.qlens[b] if seq else 0
        impl.write_kv(
            rows[:context, :RANK].to(fmt.model_dtype),
            rows[:context, RANK:].to(fmt.model_dtype),
            kv_cache,
            slots[:context],
            kv_scale=fmt.kv_scale,
        )
        keys = torch.randn(seq, INDEX_DIM, generator=gen).to(fmt.model_dtype)
        impl.write_index_keys(keys, index_cache, slots)
    kv_c = step.new_rows(latent)
    impl.write_kv(
        kv_c[:, :RANK].to(fmt.model_dtype),
        kv_c[:, RANK:].to(fmt.model_dtype),
        kv_cache,
        step.new_slots(),
        kv_scale=fmt.kv_scale,
    )
    return Caches(kv_cache, index_cache, latent)


def hand_selection(step: Step, width: int, gen: torch.Generator) -> torch.Tensor:
    """int32 ``[rows, width]``: distinct positions of each row's window in random columns, ``-1``
    between and after them (some rows fewer, one none); padding rows only ``-1``."""
    rng = random.Random(int(torch.randint(0, 1 << 30, (1,), generator=gen)))
    out = torch.full((step.rows, width), -1, dtype=torch.int32)
    for t, where in enumerate(step.row_positions()):
        if where is None:
            continue
        _, window = where
        most = min(width, window)
        count = 0 if t == 0 else rng.choice((most, most, rng.randint(0, most)))
        if count:
            out[t, torch.randperm(width, generator=gen)[:count]] = torch.randperm(window, generator=gen)[
                :count
            ].to(torch.int32)
    return out


def poisoned(rows: int, heads: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.full((rows, heads, RANK), math.nan, dtype=dtype),
        torch.full((rows, heads), math.nan, dtype=torch.float32),
    )


def rejected_decode(
    backend: mla.MLABackend,
    metadata: Any,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    selection: torch.Tensor,
    argument: str,
    match: str | None = None,
) -> torch.Tensor:
    """``forward_sparse_decode`` into NaN-poisoned outputs (of ``q``'s rows and heads, in its
    dtype), expected to raise the :class:`~mla.InvalidInputError` naming ``argument``; returns
    the output buffer, for the caller to check that nothing was written."""
    out, lse = poisoned(q.shape[0], q.shape[1], q.dtype)
    expect_invalid(
        argument,
        lambda: backend.impl.forward_sparse_decode(metadata, q, kv_cache, selection, out=out, lse=lse),
        match,
    )
    return out


def attend(
    backend: mla.MLABackend,
    metadata: mla.MLAMetadata,
    step: Step,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    selection: torch.Tensor,
    kv_scale: float | torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's sparse attention through the impl (decode rows, then prefill rows) into one
    NaN-poisoned output."""
    out, lse = poisoned(step.rows, q.shape[1], q.dtype)
    nd = step.num_decode_tokens
    return sparse_steps.attend(backend, metadata, nd, q, kv_cache, selection, kv_scale, out, lse)


def reference(
    step: Step, q: torch.Tensor, kv_cache: torch.Tensor, selection: torch.Tensor, kv_scale: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`reference_sparse` per phase, rows concatenated."""
    return sparse_steps.reference(
        step.inputs, step.scenario.num_decodes, step.num_decode_tokens, step.rows, q, kv_cache, selection,
        kv_scale, softmax_scale=SCALE, kv_lora_rank=RANK,
    )  # fmt: skip


def index_inputs(step: Step, dtype: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    index_q = torch.randn(step.rows, INDEX_HEADS, INDEX_DIM, generator=gen).to(dtype)
    weights = torch.randn(step.rows, INDEX_HEADS, generator=gen) * INDEX_HEADS**-0.5
    return index_q, weights


@pytest.fixture(autouse=True)
def _one_thread() -> Any:
    """Tiny tensors: one intra-op thread. Parallel kernels only add thread wake-ups, which cost
    tens of milliseconds per op on a busy 2-core host (the whole file ran 5x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# -- resolution -----------------------------------------------------------------------------------


SPARSE_NAMES = {"sparse-decode", "sparse-prefill"}


def test_sparse_model_resolves_the_sparse_strategies_for_every_qlen() -> None:
    limits = mla.EngineLimits(4, MAX_LEN, 32, max_decode_qlen=8)
    backend = _backend(limits=limits)
    assert set(backend.sparse_strategies) == SPARSE_NAMES
    assert not backend.decode_strategies
    assert not backend.prefill_strategies
    assert isinstance(backend.indexer, mla.LightningIndexer)
    for qlen in range(1, limits.max_decode_qlen + 1):
        for uniform in (True, False):
            ctx = backend.decode_context(max_qlen=qlen, uniform_qlen=uniform)
            assert backend.resolver.resolve(ctx).name == "sparse-decode", (qlen, uniform)
    for chunked in (False, True):
        prefill = backend.prefill_context(has_chunked_context=chunked)
        assert backend.resolver.resolve(prefill).name == "sparse-prefill"


@pytest.mark.parametrize("sparse", [False, True], ids=["dense-model", "sparse-model"])
def test_explanations_list_only_the_models_family(sparse: bool) -> None:
    dims = mla.MLADims(16, softmax_scale=192**-0.5, index_topk=2048 if sparse else None)
    caps = simulated_capabilities("cpu", "torch")
    common: dict[str, Any] = {
        "dims": dims,
        "cache": mla.KVCacheSpec(16, BF16),
        "q_dtype": BF16,
        "platform": mla.simulated_platform("cpu"),
        "capabilities": caps,
        "availability": mla.Support.yes(),
    }
    explanations = [
        mla.Resolver().explain(
            mla.decode_context(limits=mla.EngineLimits(8, 4096, 64), max_qlen=1, uniform_qlen=True, **common)
        ),
        mla.Resolver().explain(mla.prefill_context(has_chunked_context=True, **common)),
    ]
    for explanation in explanations:
        names = {c.name for c in explanation.candidates}
        if sparse:
            assert names <= SPARSE_NAMES, names
            assert explanation.chosen in SPARSE_NAMES
            assert "index_topk = 2048" in str(explanation)
        else:
            assert not names & SPARSE_NAMES, names
            assert explanation.chosen is not None
            assert "index_topk" not in str(explanation)


def test_forcing_a_dense_strategy_on_a_sparse_model_names_the_sparse_reason() -> None:
    with pytest.raises(mla.UnsupportedError) as info:
        _backend(decode_strategy="gluon-decode")
    explanation = info.value.explanation
    assert explanation is not None
    assert explanation.forced == "gluon-decode"
    codes = [r.code for r in explanation.candidate("gluon-decode").reasons]
    assert codes == ["sparse"], codes
    assert "index_topk" in str(explanation)
    # And the other way round: a sparse strategy forced on a dense model names the dense model.
    dense = mla.MLABackend(
        mla.MLADims(3, RANK, ROPE, softmax_scale=SCALE),
        mla.KVCacheSpec(BLOCK, F32),
        LIMITS,
        provider="torch",
        platform="cpu",
    )
    ctx = dense.decode_context(max_qlen=1, uniform_qlen=True)
    explanation = dense.resolver.explain(ctx, force="sparse-decode")
    assert explanation.chosen is None
    assert [r.code for r in explanation.candidate("sparse-decode").reasons] == ["dense"]


def test_aiter_record_refuses_sparse_for_its_missing_kernel() -> None:
    caps = mla.aiter_capabilities("gfx950")
    assert not caps.has(mla.Contract.SPARSE_ATTENTION)
    ctx = mla.decode_context(
        dims=mla.MLADims(16, softmax_scale=192**-0.5, index_topk=2048),
        cache=mla.KVCacheSpec(64, BF16),
        q_dtype=BF16,
        platform=mla.simulated_platform("gfx950"),
        capabilities=caps,
        availability=mla.Support.yes(),
        limits=mla.EngineLimits(8, 4096, 64),
        max_qlen=1,
        uniform_qlen=True,
    )
    explanation = mla.Resolver().explain(ctx)
    assert explanation.chosen is None
    reasons = explanation.candidate("sparse-decode").reasons
    assert [r.code for r in reasons] == ["missing-kernel"]
    assert "sparse-attention" in reasons[0].message
    assert "index_topk = 2048" in str(explanation)
    # A backend on the emulated aiter provider refuses the sparse model the same way.
    with pytest.raises(mla.UnsupportedError, match="aiter"):
        mla.MLABackend(
            mla.MLADims(16, softmax_scale=192**-0.5, index_topk=2048),
            mla.KVCacheSpec(64, BF16),
            mla.EngineLimits(8, 4096, 64),
            provider=mla.testing.emulated_provider("aiter", "gfx950"),
            platform="gfx950",
            device="cpu",
        )


# -- engine vs reference --------------------------------------------------------------------------


@pytest.mark.parametrize("keys", ["float-keys", "fp8-keys"])
@pytest.mark.parametrize("heads", [1, 3, 16], ids=lambda h: f"h{h}")
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_engine_steps_match_the_reference(fmt: KVFormat, heads: int, keys: str) -> None:
    key_dtype = E4M3 if keys == "fp8-keys" else fmt.model_dtype
    backend = _backend(heads, fmt, key_dtype)
    assert backend.indexer is not None
    spec = backend.indexer.spec
    gen = torch.Generator().manual_seed(heads * 101 + len(fmt.name) + (7 if keys == "fp8-keys" else 0))
    for scenario in SCENARIOS:
        context = f"{fmt.name} h{heads} {keys} {scenario.name}"
        step = make_step(scenario, gen)
        metadata = backend.builder.build(step.inputs)
        assert (metadata.sparse_decode is not None) == bool(scenario.num_decodes)
        assert (metadata.sparse_prefill is not None) == (scenario.num_decodes < len(scenario.qlens))
        caches = fill_caches(backend, step, fmt, gen)
        q = torch.randn(step.rows, heads, RANK + ROPE, generator=gen).to(fmt.model_dtype)

        index_q, weights = index_inputs(step, fmt.model_dtype, gen)
        selected = torch.full((step.rows, TOPK), SELECTION_POISON, dtype=torch.int32)
        backend.impl.index_topk(metadata, index_q, weights, caches.index_cache, out=selected)
        check_selection(
            step.inputs, step.owned, selected, index_q, weights, caches.index_cache, spec, TOPK, context
        )

        for label, selection in (
            ("indexer", selected),
            ("hand-made", hand_selection(step, TOPK - 3, gen)),
        ):
            got = attend(backend, metadata, step, q, caches.kv_cache, selection, fmt.kv_scale)
            want = reference(step, q, caches.kv_cache, selection, fmt.kv_scale)
            assert_close(got, want, fmt.tol, f"{context} ({label} selection)")
    assert backend.invalid_index_count() == 0


class RecordingSparse(TorchProvider):
    """The torch provider, recording each slot conversion and sparse attention call."""

    def __init__(self) -> None:
        super().__init__()
        self.slot_calls: list[SparseSlotsCall] = []
        self.attention_calls: list[SparseAttentionCall] = []

    def sparse_slots(self, call: SparseSlotsCall) -> None:
        self.slot_calls.append(call)
        super().sparse_slots(call)

    def sparse_attention(self, call: SparseAttentionCall) -> None:
        self.attention_calls.append(call)
        super().sparse_attention(call)


@pytest.mark.parametrize("selection_kind", ["indexer", "hand-made"])
@pytest.mark.parametrize("scenario", [SCENARIOS[3], SCENARIOS[4]], ids=lambda s: s.name)
def test_a_causal_sparse_prefill_attends_with_row_lengths(scenario: Scenario, selection_kind: str) -> None:
    """The run converts the selection into the plan's slot and length views (``1 +`` each row's
    last valid column: a causal prefill's early rows, whose windows are shorter than the top-k,
    end early) and hands the attention the same lengths; the result is the reference's."""
    fmt = FORMATS[0]
    provider = RecordingSparse()
    backend = _backend(3, fmt, provider=provider)
    gen = torch.Generator().manual_seed(23)
    step = make_step(scenario, gen)
    metadata = backend.builder.build(step.inputs)
    plan = metadata.sparse_prefill
    assert plan is not None
    caches = fill_caches(backend, step, fmt, gen)
    q = torch.randn(step.rows, 3, RANK + ROPE, generator=gen)
    if selection_kind == "indexer":
        index_q, weights = index_inputs(step, fmt.model_dtype, gen)
        selection = torch.full((step.rows, TOPK), SELECTION_POISON, dtype=torch.int32)
        backend.impl.index_topk(metadata, index_q, weights, caches.index_cache, out=selection)
    else:
        selection = hand_selection(step, TOPK - 3, gen)
    plan.lengths.fill_(-7)
    got = attend(backend, metadata, step, q, caches.kv_cache, selection, fmt.kv_scale)
    assert_close(got, reference(step, q, caches.kv_cache, selection, fmt.kv_scale), fmt.tol, scenario.name)
    (slots_call,), (attention_call,) = provider.slot_calls, provider.attention_calls
    assert slots_call.lengths is plan.lengths
    assert attention_call.lengths is plan.lengths
    assert attention_call.slots is slots_call.slots
    buffers = backend.sparse_buffers
    assert buffers is not None
    assert plan.lengths.data_ptr() == buffers.lengths.data_ptr(), "a view of the backend's buffer"
    columns = torch.arange(1, selection.shape[1] + 1)
    want = torch.where(selection >= 0, columns, 0).amax(dim=1)  # every selected position is in its window
    assert plan.lengths.tolist() == want.tolist()
    windows = [w for _, w in filter(None, step.row_positions())]
    assert min(windows) < TOPK, "early rows see fewer positions than the top-k"
    if selection_kind == "indexer":
        assert plan.lengths.tolist() == [min(TOPK, w) for w in windows]
    assert int(plan.lengths.min()) < selection.shape[1], "some rows end before the last column"


def test_a_device_kv_scale_is_read_on_the_device() -> None:
    fmt = FORMATS[2]
    backend = _backend(4, fmt)
    gen = torch.Generator().manual_seed(3)
    step = make_step(SCENARIOS[1], gen)
    metadata = backend.builder.build(step.inputs)
    caches = fill_caches(backend, step, fmt, gen)
    q = torch.randn(step.rows, 4, RANK + ROPE, generator=gen)
    selection = hand_selection(step, TOPK, gen)
    assert fmt.kv_scale is not None
    for scale in (torch.tensor(fmt.kv_scale), torch.tensor([fmt.kv_scale * 2])):
        got = attend(backend, metadata, step, q, caches.kv_cache, selection, scale)
        want = reference(step, q, caches.kv_cache, selection, float(scale))
        assert_close(got, want, fmt.tol, f"device kv_scale {float(scale)}")


# -- the row map (hypothesis) ---------------------------------------------------------------------


@st.composite
def steps(draw: st.DrawFn) -> tuple[list[int], list[int], int, int]:
    """``(qlens, seq_lens, num_decodes, extra_rows)`` within :data:`HYPO_LIMITS`."""
    decodes = draw(st.integers(0, 3))
    prefills = draw(st.integers(0 if decodes else 1, 2))
    qlens, seq_lens = [], []
    for _ in range(decodes):
        pad = draw(st.booleans()) and draw(st.booleans())
        qlen = draw(st.integers(0 if pad else 1, 3))
        qlens.append(qlen)
        seq_lens.append(0 if pad else draw(st.integers(qlen, MAX_LEN)))
    for _ in range(prefills):
        qlen = draw(st.integers(1, 6))
        qlens.append(qlen)
        seq_lens.append(draw(st.integers(qlen, MAX_LEN)))
    extra = draw(st.integers(0, 3)) if not prefills else 0
    if sum(qlens) + extra == 0:
        extra = 1
    return qlens, seq_lens, decodes, extra


HYPO_LIMITS = mla.EngineLimits(5, MAX_LEN, 24, max_decode_qlen=3)


@settings(max_examples=60, deadline=None)
@given(step=steps(), graph=st.sampled_from([mla.GraphMode.NONE, mla.GraphMode.FULL]))
def test_row_map_equals_the_plain_computation(
    step: tuple[list[int], list[int], int, int], graph: mla.GraphMode
) -> None:
    qlens, seq_lens, nd, extra = step
    backend = _ROW_MAP_BACKENDS[graph]
    qsl = [0]
    for q in qlens:
        qsl.append(qsl[-1] + q)
    qsl_t = torch.tensor(qsl, dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    table = torch.arange(len(qlens) * WIDTH, dtype=torch.int32).view(len(qlens), WIDTH) % NUM_BLOCKS
    metadata = backend.builder.build(
        mla.StepInputs(
            query_start_loc_cpu=qsl_t,
            query_start_loc=qsl_t.clone(),
            seq_lens=lens.clone(),
            seq_lens_cpu=lens,
            block_table=table,
            num_decodes=nd,
            num_decode_tokens=qsl[nd] + extra,
        )
    )
    rows = qsl[-1] + extra
    want_request: list[int | None] = []
    want_keys: list[int] = []
    for b, (q, s) in enumerate(zip(qlens, seq_lens, strict=True)):
        want_request += [b] * q
        want_keys += [max(0, s - q + i + 1) for i in range(q)]
    want_request += [None] * extra
    want_keys += [0] * extra
    buffers = backend.sparse_buffers
    assert buffers is not None
    got_keys = buffers.row_keys[:rows].tolist()
    got_request = buffers.row_request[:rows].tolist()
    assert got_keys == want_keys
    for t, (want, got) in enumerate(zip(want_request, got_request, strict=True)):
        if want is None:
            assert 0 <= got < len(qlens), (t, got)  # graph padding: any row of the table
        else:
            assert got == want, (t, got, want)
    # Each phase's plan views its rows of the map; the indexer's views all of them.
    ndt = qsl[nd] + extra
    assert metadata.index is not None
    assert metadata.index.row_keys.tolist() == want_keys
    if metadata.sparse_decode is not None:
        assert metadata.sparse_decode.row_keys.tolist() == want_keys[:ndt]
    if metadata.sparse_prefill is not None:
        assert metadata.sparse_prefill.row_keys.tolist() == want_keys[ndt:]
        assert metadata.sparse_prefill.row_request.tolist() == want_request[ndt:]


_ROW_MAP_BACKENDS = {
    mode: _backend(limits=attrs.evolve(HYPO_LIMITS, graph_mode=mode))
    for mode in (mla.GraphMode.NONE, mla.GraphMode.FULL)
}


# -- the layer ------------------------------------------------------------------------------------


def plain_layer(
    step: Step,
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent: list[torch.Tensor],
    selection: torch.Tensor,
    kv_b_proj: torch.Tensor,
    heads: int,
) -> torch.Tensor:
    """The layer's output in float64, in MHA form: per row, keys ``[W_UK c | k_pe]`` and values
    ``W_UV c`` of its selected positions inside its window; padding rows 0."""
    weight = kv_b_proj.double().view(heads, NOPE + VDIM, RANK)
    w_k, w_v = weight[:, :NOPE], weight[:, NOPE:]
    out = torch.zeros(step.rows, heads, VDIM, dtype=torch.float64)
    for t, where in enumerate(step.row_positions()):
        if where is None:
            continue
        b, window = where
        chosen = sorted({int(p) for p in selection[t] if 0 <= int(p) < window})
        if not chosen:
            continue
        rows = latent[b][chosen].double()
        c, k_pe = rows[:, :RANK], rows[:, RANK:]
        k_nope = torch.einsum("hdl,pl->phd", w_k, c)
        v = torch.einsum("hvl,pl->phv", w_v, c)
        scores = torch.einsum("hd,phd->hp", q_nope[t].double(), k_nope)
        scores = (scores + torch.einsum("hr,pr->hp", q_pe[t].double(), k_pe)) * SCALE
        out[t] = torch.einsum("hp,phv->hv", torch.softmax(scores, dim=-1), v)
    return out


def test_layer_matches_a_plain_float64_recomputation() -> None:
    heads = 3
    fmt = FORMATS[0]
    backend = _backend(heads, fmt)
    assert backend.indexer is not None
    spec = backend.indexer.spec
    gen = torch.Generator().manual_seed(17)
    kv_b_proj = torch.randn(heads * (NOPE + VDIM), RANK, generator=gen) * RANK**-0.5
    layer = mla.MLAAttention(backend, kv_b_proj)
    for scenario in (SCENARIOS[5], SCENARIOS[2]):
        step = make_step(scenario, gen)
        metadata = backend.builder.build(step.inputs)
        caches = fill_caches(backend, step, fmt, gen)
        # The layer writes the new tokens' rows again (the same values).
        slots, new = step.new_slots(), step.new_rows(caches.latent)
        index_k = torch.randn(step.rows, INDEX_DIM, generator=gen)
        q_nope = torch.randn(step.rows, heads, NOPE, generator=gen)
        q_pe = torch.randn(step.rows, heads, ROPE, generator=gen)
        index_q, weights = index_inputs(step, F32, gen)
        args = (metadata, q_nope, q_pe, new[:, :RANK], new[:, RANK:], caches.kv_cache)
        index: dict[str, Any] = {"index_k": index_k, "index_cache": caches.index_cache}
        out = layer(*args, slot_mapping=slots, index_q=index_q, index_weights=weights, **index)
        # The layer's indexer ran on these inputs: the same call gives its selection.
        selected = torch.full((step.rows, TOPK), SELECTION_POISON, dtype=torch.int32)
        backend.impl.index_topk(metadata, index_q, weights, caches.index_cache, out=selected)
        check_selection(
            step.inputs, step.owned, selected, index_q, weights, caches.index_cache, spec, TOPK, scenario.name
        )
        given = hand_selection(step, TOPK, gen)
        out_given = layer(*args, slot_mapping=slots, topk_indices=given, **index)
        for label, got, selection in (("indexer", out, selected), ("given", out_given, given)):
            want = plain_layer(step, q_nope, q_pe, caches.latent, selection, layer.kv_b_proj, heads)
            error = float(torch.linalg.vector_norm(got.double() - want) / torch.linalg.vector_norm(want))
            assert error <= 1e-5, f"{scenario.name} ({label}): rel. error {error:.3g}"
            assert bool((got[step.owned :] == 0).all()), "graph-padding rows must be 0"


# -- bad input ------------------------------------------------------------------------------------


def _ready(
    backend: mla.MLABackend, scenario: Scenario = SCENARIOS[1], seed: int = 5, fmt: KVFormat = FORMATS[0]
) -> tuple[Step, mla.MLAMetadata, Caches, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    step = make_step(scenario, gen)
    metadata = backend.builder.build(step.inputs)
    caches = fill_caches(backend, step, fmt, gen)
    q = torch.randn(step.rows, backend.dims.num_heads, RANK + ROPE, generator=gen).to(fmt.model_dtype)
    return step, metadata, caches, q


def _out_of_window(step: Step) -> tuple[torch.Tensor, int, int]:
    """A valid selection plus one entry at the first position row 1 may not see (the next
    token of its verify request: a real, written cache row). Returns it, the row and column."""
    selection = hand_selection(step, TOPK, torch.Generator().manual_seed(1))
    where = step.row_positions()[1]
    assert where is not None
    row, (_, window) = 1, where
    column = int(torch.nonzero(selection[row] == -1)[0, 0])
    selection[row, column] = window
    return selection, row, column


def test_an_index_outside_its_window_is_rejected_under_full_validation() -> None:
    backend = _backend(validate="full")
    step, metadata, caches, q = _ready(backend)
    selection, _, _ = _out_of_window(step)
    out = rejected_decode(
        backend, metadata, q, caches.kv_cache, selection, "topk_indices", "outside the row's request window"
    )
    assert torch.isnan(out).all()
    assert backend.invalid_index_count() == 0


def test_an_index_outside_its_window_is_masked_and_counted_by_default() -> None:
    backend = _backend()
    step, metadata, caches, q = _ready(backend)
    selection, row, column = _out_of_window(step)
    dropped = selection.clone()
    dropped[row, column] = -1
    got = attend(backend, metadata, step, q, caches.kv_cache, selection, None)
    want = reference(step, q, caches.kv_cache, dropped, None)
    assert_close(got, want, 1e-5, "out-of-window entry masked")
    assert backend.invalid_index_count() == 1
    attend(backend, metadata, step, q, caches.kv_cache, selection, None)
    assert backend.invalid_index_count() == 2  # cumulative, one per call


def test_a_block_id_outside_the_cache_is_masked_and_counted() -> None:
    backend = _backend()
    step, metadata, caches, q = _ready(backend, SCENARIOS[0])
    # Request 0 (20 tokens): its second block becomes an id past the cache.
    step.inputs.block_table[0, 1] = NUM_BLOCKS + 3
    selection = torch.full((step.rows, TOPK), -1, dtype=torch.int32)
    selection[0, :4] = torch.tensor([3, 9, 17, 19], dtype=torch.int32)  # 9: in the bad block
    selection[2, :2] = torch.tensor([30, 1], dtype=torch.int32)
    dropped = selection.clone()
    dropped[0, 1] = -1
    got = attend(backend, metadata, step, q, caches.kv_cache, selection, None)
    want = reference(step, q, caches.kv_cache, dropped, None)
    assert_close(got, want, 1e-5, "bad block id masked")
    assert backend.invalid_index_count() == 1


@pytest.mark.parametrize(("backend_format", "cache_format"), [("fp8_ds_mla", "bf16"), ("bf16", "fp8_ds_mla")])
def test_a_cache_of_another_format_is_rejected(backend_format: str, cache_format: str) -> None:
    fmt = next(f for f in FORMATS if f.name == backend_format)
    backend = _backend(3, fmt, BF16)
    step, metadata, _, q = _ready(backend, fmt=fmt)
    other = next(f for f in FORMATS if f.name == cache_format)
    wrong = encode_latent_cache(
        torch.randn(NUM_BLOCKS, BLOCK, RANK + ROPE), other.cache_dtype, kv_lora_rank=RANK
    )
    selection = hand_selection(step, TOPK, torch.Generator().manual_seed(2))
    out = rejected_decode(backend, metadata, q, wrong, selection, "kv_cache", "KVCacheSpec format")
    assert torch.isnan(out).all()


@pytest.mark.parametrize("mismatch", ["blocks", "block-size"])
def test_an_index_cache_of_other_geometry_is_rejected(mismatch: str) -> None:
    backend = _backend()
    step, metadata, _, _ = _ready(backend)
    blocks, block_size = (NUM_BLOCKS - 1, BLOCK) if mismatch == "blocks" else (NUM_BLOCKS, 2 * BLOCK)
    index_cache = torch.zeros(blocks, block_size, INDEX_DIM)
    index_q, weights = index_inputs(step, F32, torch.Generator().manual_seed(0))
    out = torch.full((step.rows, TOPK), SELECTION_POISON, dtype=torch.int32)
    expect_invalid(
        "index_cache", lambda: backend.impl.index_topk(metadata, index_q, weights, index_cache, out=out)
    )
    assert bool((out == SELECTION_POISON).all())
    keys = torch.randn(2, INDEX_DIM)
    expect_invalid(
        "index_cache", lambda: backend.impl.write_index_keys(keys, index_cache, torch.tensor([0, 1]))
    )


def test_index_key_slots_must_be_integers() -> None:
    backend = _backend()
    index_cache = torch.zeros(NUM_BLOCKS, BLOCK, INDEX_DIM)
    keys = torch.randn(2, INDEX_DIM)
    expect_invalid(
        "slot_mapping",
        lambda: backend.impl.write_index_keys(keys, index_cache, torch.tensor([1.7, 2.0])),
        "int32 or int64",
    )
    assert bool((index_cache == 0).all())


def test_a_kv_cache_with_fewer_blocks_than_the_spec_is_rejected() -> None:
    backend = _backend()
    step, metadata, caches, q = _ready(backend)
    small = caches.kv_cache[: NUM_BLOCKS // 2].contiguous()
    selection = hand_selection(step, TOPK, torch.Generator().manual_seed(0))
    rejected_decode(backend, metadata, q, small, selection, "kv_cache")


def test_dense_forward_decode_on_a_sparse_backend_names_metadata() -> None:
    backend = _backend()
    step, metadata, caches, q = _ready(backend)
    out, _ = poisoned(step.rows, 3, F32)
    expect_invalid(
        "metadata",
        lambda: backend.impl.forward_decode(metadata, q, caches.kv_cache, out=out),
        "forward_sparse_decode",
    )


def test_an_indexer_for_a_dense_model_is_rejected() -> None:
    dims, cache = mla.MLADims(4, RANK, ROPE, softmax_scale=SCALE), mla.KVCacheSpec(BLOCK, F32)
    expect_invalid(
        "indexer",
        lambda: mla.MLABackend(dims, cache, LIMITS, indexer=_indexer(), provider="torch", platform="cpu"),
        "dense model",
    )


def test_fp8_ds_mla_write_needs_whole_latent_tiles() -> None:
    backend = mla.MLABackend(
        _dims(2, rank=64),
        mla.KVCacheSpec(BLOCK, "fp8_ds_mla"),
        LIMITS,
        model_dtype=BF16,
        provider="torch",
        platform="cpu",
        indexer=_indexer(BF16),
    )
    cache = torch.zeros(NUM_BLOCKS, BLOCK, ds_mla_row_bytes(64, ROPE), dtype=torch.uint8)
    expect_invalid(
        "kv_c",
        lambda: backend.impl.write_kv(torch.randn(2, 64), torch.randn(2, ROPE), cache, torch.tensor([0, 1])),
        "multiple of 128",
    )


# -- torch.compile --------------------------------------------------------------------------------

HIDDEN = 48


class SparseToyLayer(nn.Module):
    """Projections -> write_kv + write_index_keys -> index_topk -> sparse decode -> o_proj."""

    def __init__(self, backend: mla.MLABackend) -> None:
        super().__init__()
        self.backend = backend
        self.heads = backend.dims.num_heads
        self.q_proj = nn.Linear(HIDDEN, self.heads * (RANK + ROPE))
        self.kv_proj = nn.Linear(HIDDEN, RANK + ROPE)
        self.index_q_proj = nn.Linear(HIDDEN, INDEX_HEADS * INDEX_DIM)
        self.index_k_proj = nn.Linear(HIDDEN, INDEX_DIM)
        self.weights_proj = nn.Linear(HIDDEN, INDEX_HEADS)
        self.o_proj = nn.Linear(self.heads * RANK, HIDDEN)

    def forward(
        self,
        metadata: mla.MLAMetadata,
        x: torch.Tensor,
        kv_cache: torch.Tensor,
        index_cache: torch.Tensor,
        slots: torch.Tensor,
    ) -> torch.Tensor:
        impl, rows = self.backend.impl, x.shape[0]
        kv = self.kv_proj(x)
        impl.write_kv(kv[:, :RANK], kv[:, RANK:], kv_cache, slots)
        impl.write_index_keys(self.index_k_proj(x), index_cache, slots)
        topk = torch.empty(rows, TOPK, dtype=torch.int32, device=x.device)
        index_q = self.index_q_proj(x).view(rows, INDEX_HEADS, INDEX_DIM)
        impl.index_topk(metadata, index_q, self.weights_proj(x) * INDEX_HEADS**-0.5, index_cache, out=topk)
        out = torch.empty(rows, self.heads, RANK, dtype=x.dtype, device=x.device)
        q = self.q_proj(x).view(rows, self.heads, RANK + ROPE)
        impl.forward_sparse_decode(metadata, q, kv_cache, topk, out=out)
        result: torch.Tensor = self.o_proj(out.view(rows, self.heads * RANK))
        return result


def test_compiled_sparse_layer_matches_eager_without_recompiling() -> None:
    torch._dynamo.reset()
    counters.clear()
    backend = _backend(4)
    layer = SparseToyLayer(backend)
    # aot_eager: Dynamo and the functionalization of the mutating ops, without Inductor's slow
    # C++ codegen on a CPU (tests/test_engine_ops.py compiles the dense decode with Inductor).
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    gen = torch.Generator().manual_seed(0)
    kv_cache = torch.randn(NUM_BLOCKS, BLOCK, RANK + ROPE, generator=gen)
    index_cache = torch.randn(NUM_BLOCKS, BLOCK, INDEX_DIM, generator=gen)
    eager = (kv_cache.clone(), index_cache.clone())
    compiled_caches = (kv_cache.clone(), index_cache.clone())
    for index, scenario in enumerate(
        (Scenario("a", (1, 1, 1), (20, 5, 33), 3), Scenario("b", (1, 1, 1), (9, 38, 14), 3))
    ):
        step = make_step(scenario, gen)
        x = torch.randn(step.rows, HIDDEN, generator=gen)
        slots = step.new_slots()
        metadata = backend.builder.build(step.inputs)
        with torch.no_grad():
            expected = layer(metadata, x, *eager, slots)
            got = compiled(metadata, x, *compiled_caches, slots)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4, msg=f"step {index}")
        for a, b in zip(compiled_caches, eager, strict=True):
            torch.testing.assert_close(a, b, msg=f"caches after step {index}")
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["recompiles"], dict(counters["recompiles"])
    explanation = torch._dynamo.explain(layer)(
        metadata, x, compiled_caches[0].clone(), compiled_caches[1].clone(), slots
    )
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


BAD_SPARSE_INPUTS: dict[str, tuple[str, Callable[[torch.Tensor], Any], str]] = {
    "kv_cache-not-a-tensor": ("kv_cache", lambda cache: cache.numpy(), "expected a torch.Tensor"),
    "kv_cache-flat-rows": ("kv_cache", lambda cache: cache.view(-1, cache.shape[-1]), "KVCacheSpec format"),
    "kv_cache-other-device": (
        "kv_cache",
        lambda cache: torch.empty_like(cache, device="meta"),
        "move it to cpu",
    ),
    "kv_cache-non-contiguous": ("kv_cache", strided_last_dim, "contiguous"),
    "topk-a-list": ("topk_indices", lambda sel: sel.tolist(), "expected a torch.Tensor"),
    "topk-float": ("topk_indices", lambda sel: sel.float(), "expected int32"),
    "topk-one-dim": ("topk_indices", lambda sel: sel.reshape(-1), "expected int32"),
    "topk-a-row-short": ("topk_indices", lambda sel: sel[:-1], "rows"),
    "topk-other-device": ("topk_indices", lambda sel: torch.empty_like(sel, device="meta"), "move it to cpu"),
    "topk-wider-than-index_topk": (
        "topk_indices",
        lambda sel: torch.full((sel.shape[0], TOPK + 1), -1, dtype=torch.int32),
        "more than the backend's index buffer",
    ),
}
"""An input the sparse attention must refuse: the argument, how it is made from a good one, and a
fragment of the message."""


@pytest.mark.parametrize("case", list(BAD_SPARSE_INPUTS))
def test_a_bad_sparse_input_is_rejected_before_any_write(case: str) -> None:
    backend = _backend()
    step, metadata, caches, q = _ready(backend)
    argument, make_bad, message = BAD_SPARSE_INPUTS[case]
    inputs = {
        "kv_cache": caches.kv_cache,
        "topk_indices": hand_selection(step, TOPK, torch.Generator().manual_seed(0)),
    }
    inputs[argument] = make_bad(inputs[argument])
    out, lse = poisoned(step.rows, 3, F32)
    expect_invalid(
        argument,
        lambda: backend.impl.forward_sparse_decode(
            metadata, q, inputs["kv_cache"], inputs["topk_indices"], out=out, lse=lse
        ),
        message,
    )
    assert torch.isnan(out).all()
    assert torch.isnan(lse).all()


BAD_INDEX_CACHES: dict[str, tuple[Callable[[torch.Tensor], Any], str]] = {
    "not-a-tensor": (lambda cache: cache.numpy(), "expected a torch.Tensor"),
    "other-device": (lambda cache: torch.empty_like(cache, device="meta"), "move it to cpu"),
    "non-contiguous": (strided_last_dim, "contiguous tensor on"),
}
"""An index-key cache the indexer must refuse, as made from a good one, and its message."""


@pytest.mark.parametrize("case", list(BAD_INDEX_CACHES))
def test_a_bad_index_cache_is_rejected_before_any_write(case: str) -> None:
    backend = _backend()
    step, metadata, caches, _ = _ready(backend)
    make_bad, message = BAD_INDEX_CACHES[case]
    bad = make_bad(caches.index_cache)
    index_q, weights = index_inputs(step, F32, torch.Generator().manual_seed(0))
    out = torch.full((step.rows, TOPK), SELECTION_POISON, dtype=torch.int32)
    expect_invalid(
        "index_cache", lambda: backend.impl.index_topk(metadata, index_q, weights, bad, out=out), message
    )
    assert bool((out == SELECTION_POISON).all())


def test_integer_index_queries_are_rejected() -> None:
    backend = _backend()
    step, metadata, caches, _ = _ready(backend)
    index_q, weights = index_inputs(step, F32, torch.Generator().manual_seed(0))
    out = torch.full((step.rows, TOPK), SELECTION_POISON, dtype=torch.int32)
    expect_invalid(
        "index_q",
        lambda: backend.impl.index_topk(
            metadata, index_q.to(torch.int32), weights, caches.index_cache, out=out
        ),
        "expected bf16, fp16 or fp32",
    )
    assert bool((out == SELECTION_POISON).all())


@pytest.mark.parametrize("strategy", [int, mla.GluonDecode], ids=["not-a-strategy", "a-decode-strategy"])
def test_an_indexer_strategy_of_another_kind_is_rejected(strategy: type) -> None:
    expect_invalid(
        "indexer_strategy",
        lambda: _backend(indexer_strategy=strategy),
        "expected an IndexerStrategy subclass",
    )


def _dense_backend() -> mla.MLABackend:
    dims = mla.MLADims(3, RANK, ROPE, NOPE, VDIM, softmax_scale=SCALE)
    cache = mla.KVCacheSpec(BLOCK, F32, num_blocks=NUM_BLOCKS)
    return mla.MLABackend(dims, cache, LIMITS, model_dtype=F32, provider="torch", platform="cpu")


def test_the_sparse_doors_of_a_dense_backend_name_what_is_missing() -> None:
    backend, sparse = _dense_backend(), _backend()
    step, _, caches, q = _ready(sparse)
    metadata = backend.builder.build(step.inputs)
    selection = hand_selection(step, TOPK, torch.Generator().manual_seed(0))
    out = rejected_decode(backend, metadata, q, caches.kv_cache, selection, "metadata", "dense model")
    assert torch.isnan(out).all()
    index_q, weights = index_inputs(step, F32, torch.Generator().manual_seed(0))
    picked = torch.full((step.rows, TOPK), SELECTION_POISON, dtype=torch.int32)
    expect_invalid(
        "metadata",
        lambda: backend.impl.index_topk(metadata, index_q, weights, caches.index_cache, out=picked),
        "no indexer",
    )
    assert bool((picked == SELECTION_POISON).all())
    expect_invalid(
        "index_cache",
        lambda: backend.impl.write_index_keys(
            torch.randn(2, INDEX_DIM), caches.index_cache, torch.tensor([0, 1])
        ),
        "no indexer",
    )


def _layer_call(change: str) -> tuple[mla.MLAAttention, tuple[Any, ...], dict[str, Any]]:
    """A sparse layer, its positional arguments and its keyword arguments with one ``change``."""
    heads, fmt = 3, FORMATS[0]
    backend = _backend(heads, fmt)
    gen = torch.Generator().manual_seed(3)
    layer = mla.MLAAttention(backend, torch.randn(heads * (NOPE + VDIM), RANK, generator=gen) * RANK**-0.5)
    step = make_step(SCENARIOS[1], gen)
    metadata = backend.builder.build(step.inputs)
    caches = fill_caches(backend, step, fmt, gen)
    new = step.new_rows(caches.latent)
    q_nope = torch.randn(step.rows, heads, NOPE, generator=gen)
    q_pe = torch.randn(step.rows, heads, ROPE, generator=gen)
    args = (metadata, q_nope, q_pe, new[:, :RANK], new[:, RANK:], caches.kv_cache)
    index_q, weights = index_inputs(step, F32, gen)
    kwargs: dict[str, Any] = {
        "slot_mapping": step.new_slots(),
        "index_q": index_q,
        "index_weights": weights,
        "index_k": torch.randn(step.rows, INDEX_DIM, generator=gen),
        "index_cache": caches.index_cache,
    }
    if change == "index_k-alone":
        kwargs["index_cache"] = None
    elif change == "index_cache-geometry":
        kwargs["index_cache"] = caches.index_cache[:-1].contiguous()
    elif change == "topk-rows":
        kwargs["topk_indices"] = hand_selection(step, TOPK, gen)[:-1]
    elif change == "no-selection":
        kwargs.update(index_q=None, index_k=None, index_cache=None)
    return layer, args, kwargs


@pytest.mark.parametrize(
    ("change", "argument", "match"),
    [
        pytest.param("index_k-alone", "index_k", "go together", id="index_k-alone"),
        pytest.param(
            "index_cache-geometry",
            "index_cache",
            "shares the KV cache's block table",
            id="index_cache-geometry",
        ),
        pytest.param("topk-rows", "topk_indices", r"rows \(the step's\)", id="topk-rows"),
        pytest.param("no-selection", "topk_indices", "needs the indexer's inputs", id="no-selection"),
    ],
)
def test_the_sparse_layer_names_a_missing_or_mismatched_input(change: str, argument: str, match: str) -> None:
    layer, args, kwargs = _layer_call(change)
    expect_invalid(argument, lambda: layer(*args, **kwargs), match)


@pytest.mark.parametrize("key_dtype", [torch.int8, torch.float8_e5m2, "int4"], ids=str)
def test_an_index_key_dtype_the_cache_cannot_store_is_rejected(key_dtype: torch.dtype | str) -> None:
    with pytest.raises(mla.InvalidInputError) as info:
        mla.IndexerSpec(num_heads=INDEX_HEADS, head_dim=INDEX_DIM, key_dtype=key_dtype)
    assert info.value.argument == "key_dtype", str(info.value)
