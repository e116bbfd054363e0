"""The host cost of the engine path: what a decode build dispatches, and ``mla_decode``'s
repeated-call fast path (checks cached per signature, CUDA-graph replay of repeated calls).

On a CPU the replay machinery runs with two stand-ins (the ``replay_on_cpu`` fixture): the
device check allows replay, and ``capture`` returns a :class:`StepGraph` whose ``replay()``
re-runs the captured step. That checks the selection logic, the per-plan LRU, the fallbacks,
and that a replayed step reads the caller's tensors and the ``kv_scale`` buffer when it runs
(nothing baked in at capture). The ``gpu`` tests capture and replay real graphs.
"""

from __future__ import annotations

import collections
import functools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs
import pytest
import torch
from gpu_providers import gpu_providers
from hypothesis import given
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import mla
from mla.core.step_rules import HostLengths
from mla.engine.functional import decode as decode_module
from mla.engine.functional import decode_graphs, replay_memo
from mla.engine.functional.plan_cache import DECODE_PLANS, DecodeEntry, PlanCache
from mla.testing import assert_matches_reference, emulated_provider
from mla.tools.reference import reference_decode

if TYPE_CHECKING:
    from conftest import StepGraph

RANK, ROPE, HEADS = 64, 16, 4
BLOCK, NUM_BLOCKS = 16, 24
SCALE = 0.125
ARGS: dict[str, Any] = {"softmax_scale": SCALE, "kv_lora_rank": RANK, "provider": "torch"}


class Inputs:
    """One decode batch on the CPU (``batch`` single-token requests) with its outputs."""

    def __init__(self, batch: int = 3, seed: int = 0, kv_dtype: torch.dtype = torch.float32) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.q = torch.randn(batch, HEADS, RANK + ROPE, generator=gen)
        values = torch.randn(NUM_BLOCKS, BLOCK, RANK + ROPE, generator=gen)
        self.cache = (values / 0.05).clamp(-448, 448).to(kv_dtype) if kv_dtype.itemsize == 1 else values
        self.table = torch.randperm(NUM_BLOCKS, generator=gen)[: batch * 3].view(batch, 3).to(torch.int32)
        self.seq_lens = torch.randint(1, 3 * BLOCK + 1, (batch,), generator=gen, dtype=torch.int32)
        self.out = torch.full((batch, HEADS, RANK), math.nan)
        self.lse = torch.full((batch, HEADS), math.nan)

    def refill(self, seed: int) -> None:
        """New values in the same tensors (what an engine loop does between steps)."""
        gen = torch.Generator().manual_seed(seed)
        self.q.copy_(torch.randn(self.q.shape, generator=gen))
        self.seq_lens.copy_(torch.randint(1, 3 * BLOCK + 1, self.seq_lens.shape, generator=gen))
        self.table.copy_(torch.randperm(NUM_BLOCKS, generator=gen)[: self.table.numel()].view_as(self.table))
        self.out.fill_(math.nan)
        self.lse.fill_(math.nan)

    def decode(self, **options: Any) -> Any:
        args = {**ARGS, "out": self.out, "lse": self.lse, **options}
        return mla.mla_decode(self.q, self.cache, self.table, self.seq_lens, **args)

    def check(self, context: str, kv_scale: float | None = None) -> None:
        ref = reference_decode(
            self.q,
            self.cache,
            self.table,
            self.seq_lens,
            softmax_scale=SCALE,
            kv_lora_rank=RANK,
            kv_scale=kv_scale,
        )
        assert_matches_reference(self.out, self.lse, *ref, context=context)


def only_entry() -> DecodeEntry:
    entries = list(DECODE_PLANS._entries.values())
    assert len(entries) == 1
    return entries[0]


def states() -> list[object]:
    return list(only_entry().graphs._entries.values())


# -- replay selection -----------------------------------------------------------------------------


def test_second_call_captures_and_later_calls_replay_current_values(replay_on_cpu: list[StepGraph]) -> None:
    data = Inputs()
    data.decode()
    assert states() == [decode_graphs.SEEN]
    assert replay_on_cpu == []
    data.check("first call (eager)")
    data.refill(1)
    data.decode()
    assert len(replay_on_cpu) == 1
    assert isinstance(states()[0], decode_graphs.CapturedCall)
    data.check("second call (eager, then captured)")
    for seed in (2, 3):
        data.refill(seed)
        got = data.decode()
        assert got == (data.out, data.lse)
        data.check(f"replay with seed {seed}")
    assert len(replay_on_cpu) == 1
    assert replay_on_cpu[0].replays == 2


def test_return_lse_false_replays_into_out_alone(replay_on_cpu: list[StepGraph]) -> None:
    data = Inputs()
    for seed in range(3):
        data.refill(seed)
        got = data.decode(lse=None, return_lse=False)
        assert got is data.out
        ref = reference_decode(
            data.q, data.cache, data.table, data.seq_lens, softmax_scale=SCALE, kv_lora_rank=RANK
        )
        torch.testing.assert_close(data.out.double().cpu(), ref[0].cpu(), rtol=1e-4, atol=1e-4)
    assert replay_on_cpu[0].replays == 1


def test_a_new_float_kv_scale_is_read_by_the_replay(replay_on_cpu: list[StepGraph]) -> None:
    data = Inputs(kv_dtype=torch.float8_e4m3fn)
    for scale in (0.05, 0.05, 0.02, 0.08):
        data.decode(kv_scale=scale)
        data.check(f"kv_scale {scale}", kv_scale=scale)
    assert len(replay_on_cpu) == 1
    assert replay_on_cpu[0].replays == 2


@pytest.mark.parametrize(
    "scale",
    [torch.tensor([0.05]), torch.tensor(0.05, dtype=torch.bfloat16)],
    ids=["float32-used-in-place", "bf16-copied-to-the-buffer"],
)
def test_a_kv_scale_tensor_updated_in_place_is_read_by_the_replay(
    replay_on_cpu: list[StepGraph], scale: torch.Tensor
) -> None:
    data = Inputs(kv_dtype=torch.float8_e4m3fn)
    for value in (0.046875, 0.046875, 0.03125, 0.0625):  # exact in bf16
        scale.fill_(value)
        data.decode(kv_scale=scale)
        data.check(f"kv_scale tensor {value}", kv_scale=value)
    assert replay_on_cpu[0].replays == 2


@pytest.mark.parametrize(
    "options",
    [{"out": None, "lse": None}, {"out": None}, {"lse": None}],
    ids=["no-out-no-lse", "no-out", "no-lse-but-wanted"],
)
def test_calls_without_outputs_replay_into_the_graphs_own_and_return_copies(
    replay_on_cpu: list[StepGraph], options: dict[str, Any]
) -> None:
    """The README's call (fresh outputs every call) replays too: the graph writes buffers of its
    own and each call returns copies, so a result kept from an earlier call is not overwritten
    by a later replay. An output the caller passes is the caller's."""
    data = Inputs()
    results = []
    for seed in range(4):
        data.refill(seed)
        out, lse = data.decode(**options)
        ref = reference_decode(
            data.q, data.cache, data.table, data.seq_lens, softmax_scale=SCALE, kv_lora_rank=RANK
        )
        results.append((out.clone(), lse.clone(), ref))
        assert (out is data.out) == ("out" not in options)
        assert (lse is data.lse) == ("lse" not in options)
    assert len(replay_on_cpu) == 1
    assert replay_on_cpu[0].replays == 2
    for seed, (out, lse, ref) in enumerate(results):
        assert_matches_reference(out, lse, *ref, context=f"{options} seed {seed}")


def test_kept_results_of_replayed_calls_stay_theirs(replay_on_cpu: list[StepGraph]) -> None:
    """Results held across calls (no clone by the caller) keep their own values."""
    data = Inputs()
    kept = []
    for seed in range(4):
        data.refill(seed)
        ref = reference_decode(
            data.q, data.cache, data.table, data.seq_lens, softmax_scale=SCALE, kv_lora_rank=RANK
        )
        kept.append((data.decode(out=None, lse=None), ref))
    assert replay_on_cpu[0].replays == 2
    for seed, ((out, lse), ref) in enumerate(kept):
        assert_matches_reference(out, lse, *ref, context=f"kept result of call {seed}")


@pytest.mark.parametrize(
    "options",
    [{"validate": "full"}, {"graph": "off"}],
    ids=["validate-full", "graph-off"],
)
def test_calls_that_cannot_replay_run_eagerly(
    replay_on_cpu: list[StepGraph], options: dict[str, Any]
) -> None:
    data = Inputs()
    for seed in range(3):
        data.refill(seed)
        got = data.decode(**options)
        out, lse = got
        ref = reference_decode(
            data.q, data.cache, data.table, data.seq_lens, softmax_scale=SCALE, kv_lora_rank=RANK
        )
        assert_matches_reference(out, lse, *ref, context=f"{options} seed {seed}")
    assert replay_on_cpu == []
    assert states() == []


def test_the_process_wide_switch_turns_replay_off(
    replay_on_cpu: list[StepGraph], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(decode_graphs, "GRAPH_REPLAY", False)
    data = Inputs()
    for _ in range(3):
        data.decode()
    assert replay_on_cpu == []
    assert states() == []


def test_a_cpu_device_never_replays() -> None:
    DECODE_PLANS.clear()
    data = Inputs()
    for seed in range(3):
        data.refill(seed)
        data.decode()
        data.check(f"cpu seed {seed}")
    assert states() == []


def test_each_tensor_set_gets_its_own_graph_and_the_lru_is_bounded(replay_on_cpu: list[StepGraph]) -> None:
    data = Inputs()
    outs = [torch.empty_like(data.out) for _ in range(decode_graphs.GRAPHS_PER_PLAN + 2)]
    for out in outs:
        for _ in range(2):
            data.decode(out=out)
    assert len(replay_on_cpu) == len(outs)
    assert len(only_entry().graphs) == decode_graphs.GRAPHS_PER_PLAN
    data.decode(out=outs[-1])
    assert replay_on_cpu[-1].replays == 1
    data.decode(out=outs[0])  # evicted: seen again, not replayed
    assert replay_on_cpu[0].replays == 0
    assert states()[-1] is decode_graphs.SEEN


def test_query_start_loc_values_key_the_graph(replay_on_cpu: list[StepGraph]) -> None:
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(4, HEADS, RANK + ROPE, generator=gen)
    cache = torch.randn(NUM_BLOCKS, BLOCK, RANK + ROPE, generator=gen)
    table = torch.arange(6, dtype=torch.int32).view(2, 3)
    seq_lens = torch.tensor([20, 33], dtype=torch.int32)
    out, lse = torch.empty(4, HEADS, RANK), torch.empty(4, HEADS)
    for round_ in range(3):
        for indptr in ([0, 1, 4], [0, 3, 4]):
            qsl = torch.tensor(indptr, dtype=torch.int32)
            mla.mla_decode(q, cache, table, seq_lens, query_start_loc=qsl, out=out, lse=lse, **ARGS)
            ref = reference_decode(q, cache, table, seq_lens, qsl, softmax_scale=SCALE, kv_lora_rank=RANK)
            assert_matches_reference(out, lse, *ref, context=f"{indptr} round {round_}")
    assert [graph.replays for graph in replay_on_cpu] == [1, 1]


def test_a_build_that_needs_host_data_is_never_captured(replay_on_cpu: list[StepGraph]) -> None:
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(4, HEADS, RANK + ROPE, generator=gen)
    cache = torch.randn(NUM_BLOCKS, BLOCK, RANK + ROPE, generator=gen)
    table = torch.arange(6, dtype=torch.int32).view(2, 3)
    seq_lens = torch.tensor([20, 33], dtype=torch.int32)
    qsl = torch.tensor([0, 2, 4], dtype=torch.int32)
    out, lse = torch.empty(4, HEADS, RANK), torch.empty(4, HEADS)
    for _ in range(3):
        mla.mla_decode(
            q,
            cache,
            table,
            seq_lens,
            query_start_loc=qsl,
            out=out,
            lse=lse,
            strategy="gluon-verify-flatten",
            **ARGS,
        )
        ref = reference_decode(q, cache, table, seq_lens, qsl, softmax_scale=SCALE, kv_lora_rank=RANK)
        assert_matches_reference(out, lse, *ref, context="verify-flatten")
    assert replay_on_cpu == []
    assert states() == [decode_graphs.EAGER]


def test_a_failed_capture_warns_once_and_stays_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    attempts: list[int] = []

    def failing(step: Callable[[], None], device: torch.device) -> StepGraph:
        attempts.append(1)
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(decode_graphs, "device_allows_replay", lambda q: True)
    monkeypatch.setattr(decode_graphs, "capture", failing)
    DECODE_PLANS.clear()
    data = Inputs()
    data.decode()
    with pytest.warns(RuntimeWarning, match="runs eagerly"):
        data.decode()
    for seed in range(2):
        data.refill(seed)
        data.decode()
        data.check(f"eager after a failed capture, seed {seed}")
    assert attempts == [1]
    assert states() == [decode_graphs.EAGER]


# -- the recorded replay (mla.engine.functional.replay_memo) ---------------------------------------


def test_a_replayed_call_is_found_again_by_one_key(
    replay_on_cpu: list[StepGraph], monkeypatch: pytest.MonkeyPatch
) -> None:
    """After its first replay a call is recorded under its flat key: the next ones replay the
    same graph without the signature, plan or graph lookups, on the tensors' current values."""
    data = Inputs()
    for _ in range(3):  # seen, captured, replayed (and recorded)
        data.decode()
    assert len(replay_memo.RECORDS) == 1
    lookups: list[object] = []
    real = decode_module.checked_signature
    monkeypatch.setattr(decode_module, "checked_signature", lambda *a: (lookups.append(a), real(*a))[1])
    for seed in (4, 5):
        data.refill(seed)
        assert data.decode() == (data.out, data.lse)
        data.check(f"recorded replay, seed {seed}")
    assert lookups == []
    assert replay_on_cpu[0].replays == 3
    for options in ({"graph": "off"}, {"validate": "full"}, {"validate": "fast"}):
        data.refill(6)
        data.decode(**options)  # other options, another key: no replay of this graph
        data.check(f"{options} after a recorded replay")
    assert replay_on_cpu[0].replays == 3


def test_a_graph_replayed_through_its_record_stays_recently_used(replay_on_cpu: list[StepGraph]) -> None:
    """The record keeps the plan's graph LRU as a lookup would: a graph replayed between the
    captures of as many other tensor sets as the plan holds is not the one evicted."""
    data = Inputs()
    for _ in range(3):
        data.decode()
    for other in [torch.empty_like(data.out) for _ in range(decode_graphs.GRAPHS_PER_PLAN)]:
        for _ in range(2):
            data.decode(out=other)  # seen, captured
        data.decode()  # recorded: replays, and marks its graph used
    assert replay_on_cpu[0].replays == 1 + decode_graphs.GRAPHS_PER_PLAN
    data.refill(7)
    data.decode()
    assert replay_on_cpu[0].replays == 2 + decode_graphs.GRAPHS_PER_PLAN
    data.check("the recorded graph after the other captures")


def test_a_record_is_dropped_with_its_graph(replay_on_cpu: list[StepGraph]) -> None:
    """A record whose graph (or plan) left the caches is not used: the call runs as a new one."""
    data = Inputs()
    for _ in range(3):
        data.decode()
    for other in [torch.empty_like(data.out) for _ in range(decode_graphs.GRAPHS_PER_PLAN)]:
        for _ in range(2):
            data.decode(out=other)  # the first graph is evicted after the last of these
    data.decode()
    assert replay_on_cpu[0].replays == 1
    assert states()[-1] is decode_graphs.SEEN
    assert replay_memo.RECORDS == {}
    for _ in range(3):
        data.decode()
    assert replay_on_cpu[0].replays == 1
    DECODE_PLANS.clear()
    data.refill(8)
    data.decode()
    assert states() == [decode_graphs.SEEN]
    data.check("after the plans were cleared")


def test_a_tensor_moved_in_place_is_not_replayed_at_its_old_address(replay_on_cpu: list[StepGraph]) -> None:
    """The key is read from the tensors at each call: the same ``out`` object given new memory
    (``set_``) gets its own graph, written at its new address."""
    data = Inputs()
    for _ in range(3):
        data.decode()
    data.out.set_(torch.full_like(data.out, math.nan))
    data.refill(9)
    data.decode()
    data.check("out moved to new memory")
    assert replay_on_cpu[0].replays == 1
    assert states()[-1] is decode_graphs.SEEN


def test_plan_cache_touch_and_changes() -> None:
    cache: PlanCache[str, object] = PlanCache(2)
    a, b = object(), object()
    cache.put("a", a)
    cache.put("b", b)
    changes = cache.changes
    assert cache.touch("b", b)  # already the most recent: no change
    assert cache.changes == changes
    assert not cache.touch("a", b)  # another value
    assert cache.touch("a", a)
    assert cache.changes == changes + 1
    cache.put("c", object())  # evicts "b", now the least recently used
    assert not cache.holds("b", b)
    assert cache.holds("a", a)
    cache.clear()
    assert not cache.touch("a", a)


# -- cached checks --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "argument"),
    [
        ({"graph": "always"}, "graph"),
        ({"return_lse": 1}, "return_lse"),
        ({"kv_lora_rank": 64.0}, "kv_lora_rank"),
        ({"softmax_scale": math.nan}, "softmax_scale"),
        ({"out": torch.empty(3, HEADS, RANK + 1)}, "out"),
    ],
)
def test_a_repeated_signature_never_skips_a_check_it_did_not_pass(
    options: dict[str, Any], argument: str
) -> None:
    data = Inputs()
    for _ in range(2):
        data.decode()
        with pytest.raises(mla.InvalidInputError) as info:
            data.decode(**options)
        assert info.value.argument == argument


@pytest.mark.parametrize("bad", [-1.0, math.inf, math.nan, 0.0])
def test_a_repeated_call_checks_its_float_kv_scale_value(bad: float) -> None:
    data = Inputs(kv_dtype=torch.float8_e4m3fn)
    data.decode(kv_scale=0.05)
    with pytest.raises(mla.InvalidInputError) as info:
        data.decode(kv_scale=bad)
    assert info.value.argument == "kv_scale"
    with pytest.raises(mla.InvalidInputError):
        data.decode(kv_scale=torch.tensor([bad]))


def test_a_repeated_call_checks_its_query_start_loc_values() -> None:
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(4, HEADS, RANK + ROPE, generator=gen)
    cache = torch.randn(NUM_BLOCKS, BLOCK, RANK + ROPE, generator=gen)
    table = torch.arange(6, dtype=torch.int32).view(2, 3)
    seq_lens = torch.tensor([20, 33], dtype=torch.int32)
    mla.mla_decode(q, cache, table, seq_lens, query_start_loc=torch.tensor([0, 1, 4]), **ARGS)
    for bad, match in (([0, 3, 2], "monotonic"), ([0, 1, 3], "q has 4 rows"), ([1, 2, 4], "start at 0")):
        with pytest.raises(mla.InvalidInputError, match=match) as info:
            mla.mla_decode(q, cache, table, seq_lens, query_start_loc=torch.tensor(bad), **ARGS)
        assert info.value.argument == "query_start_loc"


# -- what a build dispatches ----------------------------------------------------------------------


class OpCounter(TorchDispatchMode):
    """Counts aten ops, except while ``paused`` (inside a provider call)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.paused = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not self.paused:
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


PROVIDER_METHODS = (
    "fill_page_indices",
    "expand_page_indices",
    "plan_decode_schedule",
    "paged_mqa_decode",
    "small_head_decode",
)


@pytest.mark.parametrize(
    ("strategy", "provider_calls"),
    [
        ("asm-non-persistent", {"fill_page_indices": 1}),
        ("asm-padded-persistent", {"fill_page_indices": 1, "plan_decode_schedule": 1}),
        ("gluon-decode", {"fill_page_indices": 1}),
    ],
)
def test_a_decode_build_with_host_copies_is_provider_calls_only(
    strategy: str, provider_calls: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode-only B=128 build with the engine's host copies: no torch op of its own (the
    host rules run on Python ints), one fused page-index fill (plus the schedule planner for a
    persistent strategy)."""
    batch, max_len = 128, 64
    backend = mla.MLABackend(
        mla.MLADims(HEADS, RANK, ROPE, softmax_scale=SCALE),
        mla.KVCacheSpec(BLOCK, torch.float32, num_blocks=batch * max_len // BLOCK),
        mla.EngineLimits(batch, max_len, batch),
        model_dtype=torch.float32,
        provider="torch",
        platform="cpu",
        decode_strategy=strategy,
    )
    counter = OpCounter()
    calls: collections.Counter[str] = collections.Counter()
    for name in PROVIDER_METHODS:
        method = getattr(backend.provider, name)

        def counted(call: Any, _method: Any = method, _name: str = name) -> Any:
            calls[_name] += 1
            counter.paused += 1
            try:
                return _method(call)
            finally:
                counter.paused -= 1

        monkeypatch.setattr(backend.provider, name, counted)
    lens = torch.randint(1, max_len + 1, (batch,), dtype=torch.int32)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    step = mla.StepInputs(
        query_start_loc_cpu=qsl,
        query_start_loc=qsl.clone(),
        seq_lens=lens.clone(),
        seq_lens_cpu=lens,
        block_table=torch.randperm(batch * max_len // BLOCK, dtype=torch.int32).view(batch, -1),
        num_decodes=batch,
        num_decode_tokens=batch,
    )
    backend.builder.build(step)
    calls.clear()
    with counter:
        metadata = backend.builder.build(step)
    assert metadata.decode is not None
    assert metadata.decode.strategy == strategy
    assert dict(counter.ops) == {}
    assert dict(calls) == provider_calls
    expected = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]).to(torch.int32)
    assert torch.equal(metadata.decode.kv_indptr, expected)


@st.composite
def indptrs(draw: st.DrawFn) -> list[int]:
    """Query indptrs: uniform (qlen 0..4, up to 6 requests), one entry off uniform, arbitrary."""
    kind = draw(st.sampled_from(["uniform", "nearly uniform", "arbitrary"]))
    if kind == "arbitrary":
        return draw(st.lists(st.integers(-2, 9), min_size=1, max_size=8))
    qlen, count = draw(st.integers(0, 4)), draw(st.integers(0, 6))
    qsl = [qlen * i for i in range(count + 1)]
    if kind == "nearly uniform":
        qsl[draw(st.integers(0, count))] += draw(st.integers(-2, 2))
    return qsl


@given(qsl=indptrs(), with_lens=st.booleans())
def test_the_uniform_indptr_shortcut_finds_what_the_general_path_finds(
    qsl: list[int], with_lens: bool
) -> None:
    """The builder's host lengths (a list comparison for a uniform indptr within the limits)
    equal :meth:`HostLengths.from_indptr`'s on every indptr."""
    builder = shortcut_backend().builder
    lens = [7 * i + 3 for i in range(len(qsl) - 1)] if with_lens else None
    got = builder.checker.host_lengths(qsl, lens)
    want = HostLengths.from_indptr(qsl, lens)
    assert attrs.astuple(got, recurse=False) == attrs.astuple(want, recurse=False)


def test_the_previous_uniform_indptr_is_matched_only_by_an_equal_one() -> None:
    """The builder remembers the last uniform indptr; a repeated one, another one and a
    non-uniform one each get :meth:`HostLengths.from_indptr`'s lengths."""
    builder = shortcut_backend().builder
    for qsl, lens in (
        ([0, 2, 4, 6], [5, 6, 7]),
        ([0, 2, 4, 6], [9, 3, 8]),
        ([0, 2, 4, 6], None),
        ([0, 1, 2, 3], [2, 2, 2]),
        ([0, 2, 4, 5], [4, 4, 4]),
        ([0, 2, 4, 6], [-1, 3, 4]),
        ([0, 1, 2, 3], []),
    ):
        got = builder.checker.host_lengths(qsl, lens)
        assert attrs.astuple(got, recurse=False) == attrs.astuple(
            HostLengths.from_indptr(qsl, lens), recurse=False
        )
        assert got.total_seq == sum(lens or [])


@pytest.mark.parametrize("strategy", ["asm-non-persistent", "asm-padded-persistent", "gluon-decode"])
@pytest.mark.parametrize("graph_mode", ["none", "full"])
def test_a_build_reuses_its_plan_record_only_while_nothing_in_it_changed(
    strategy: str, graph_mode: str
) -> None:
    """Builds of one shape share the plan record while its geometry holds (the KV bound is the
    batch's longest sequence without graphs, max_model_len with them); the metadata is new
    every build (stale metadata is refused by identity); the buffers hold the latest step."""
    max_len = 64
    backend = mla.MLABackend(
        mla.MLADims(HEADS, RANK, ROPE, softmax_scale=SCALE),
        mla.KVCacheSpec(BLOCK, torch.float32, num_blocks=NUM_BLOCKS),
        mla.EngineLimits(6, max_len, 16, graph_mode=graph_mode),
        model_dtype=torch.float32,
        provider="torch",
        platform="cpu",
        decode_strategy=strategy,
    )
    table = torch.arange(NUM_BLOCKS, dtype=torch.int32)[:24].view(6, 4)

    def build(lens: list[int]) -> mla.MLAMetadata:
        qsl = torch.arange(len(lens) + 1, dtype=torch.int32)
        seq = torch.tensor(lens, dtype=torch.int32)
        step = mla.StepInputs(
            query_start_loc_cpu=qsl,
            query_start_loc=qsl.clone(),
            seq_lens=seq.clone(),
            seq_lens_cpu=seq,
            block_table=table[: len(lens)],
            num_decodes=len(lens),
            num_decode_tokens=len(lens),
        )
        return backend.builder.build(step)

    first, again, longer, fewer = build([5, 9, 3]), build([5, 9, 3]), build([6, 40, 4]), build([7, 2])
    plans = [m.decode for m in (first, again, longer, fewer)]
    assert all(p is not None for p in plans)
    assert len({id(m) for m in (first, again, longer, fewer)}) == 4
    assert plans[1] is plans[0]
    assert (plans[2] is plans[0]) == (graph_mode == "full")
    assert plans[3] is not plans[0]
    bound = [p.geometry.max_seqlen_k for p in plans if p is not None]
    assert bound == ([max_len] * 4 if graph_mode == "full" else [9, 9, 40, 7])
    assert [p.geometry.num_requests for p in plans if p is not None] == [3, 3, 3, 2]
    last = plans[3]
    assert last is not None
    assert last.kv_indptr.tolist() == [0, 7, 9]


@functools.cache
def shortcut_backend() -> mla.MLABackend:
    """Limits 5 requests and qlen 3: the indptrs above include uniform ones beyond each."""
    return mla.MLABackend(
        mla.MLADims(HEADS, RANK, ROPE, softmax_scale=SCALE),
        mla.KVCacheSpec(BLOCK, torch.float32, num_blocks=NUM_BLOCKS),
        mla.EngineLimits(5, 64, 32, max_decode_qlen=3),
        model_dtype=torch.float32,
        provider="torch",
        platform="cpu",
        preallocate=False,
    )


def test_capturable_build_declarations() -> None:
    def plan_of(
        strategy: str, qlen: int, provider: str | mla.KernelProvider = "torch", platform: str = "cpu"
    ) -> tuple[bool, str]:
        emulated = platform != "cpu"  # aiter's record: 512/64 latent dims, bf16
        shape = (8, 512, 64) if emulated else (HEADS, RANK, ROPE)
        dims = mla.MLADims(*shape, softmax_scale=SCALE)
        dtype = torch.bfloat16 if emulated else torch.float32
        backend = mla.MLABackend(
            dims,
            mla.KVCacheSpec(BLOCK, dtype, num_blocks=NUM_BLOCKS),
            mla.EngineLimits(2, 48, 2 * qlen, max_decode_qlen=qlen),
            model_dtype=dtype,
            provider=provider,
            platform=platform,
            decode_strategy=strategy,
            preallocate=False,
        )
        qsl = torch.arange(0, 2 * qlen + 1, qlen, dtype=torch.int32)
        step = mla.StepInputs(
            query_start_loc_cpu=qsl,
            query_start_loc=qsl,
            seq_lens=torch.tensor([20, 33], dtype=torch.int32),
            block_table=torch.arange(6, dtype=torch.int32).view(2, 3),
            num_decodes=2,
            num_decode_tokens=2 * qlen,
        )
        plan = backend.builder.build(step).decode
        assert plan is not None
        return backend.decode_strategy(plan.strategy).capturable_build(plan), plan.strategy

    assert plan_of("asm-non-persistent", 1) == (True, "asm-non-persistent")
    assert plan_of("asm-padded-persistent", 2) == (True, "asm-padded-persistent")
    assert plan_of("gluon-decode", 1) == (True, "gluon-decode")
    assert plan_of("gluon-verify-flatten", 2) == (False, "gluon-verify-flatten")
    # aiter's kernel qlen 4 for a qlen-3 step: the padding maps come from the host.
    aiter = emulated_provider("aiter", "gfx950")
    assert plan_of("asm-padded-persistent", 3, aiter, "gfx950") == (False, "asm-padded-persistent")


# -- GPU: real graphs -----------------------------------------------------------------------------


class GpuInputs:
    """A bf16 batch on the GPU (H16, block 16) with static outputs."""

    def __init__(self, provider: str, kv_dtype: torch.dtype = torch.bfloat16, batch: int = 4) -> None:
        self.provider, self.batch = provider, batch
        self.num_blocks, self.width = batch * 8, 8
        gen = torch.Generator().manual_seed(11)
        values = torch.randn(self.num_blocks, 16, 576, generator=gen)
        self.cache = (values if kv_dtype.itemsize > 1 else values.clamp(-400, 400)).to(kv_dtype).cuda()
        self.q = torch.randn(batch, 16, 576, generator=gen).to(torch.bfloat16).cuda()
        self.table = torch.empty(batch, self.width, dtype=torch.int32, device="cuda")
        self.seq_lens = torch.empty(batch, dtype=torch.int32, device="cuda")
        self.out = torch.empty(batch, 16, 512, dtype=torch.bfloat16, device="cuda")
        self.lse = torch.empty(batch, 16, device="cuda")
        self.refill(0)

    def refill(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.q.copy_(torch.randn(self.q.shape, generator=gen).to(torch.bfloat16))
        self.seq_lens.copy_(torch.randint(1, self.width * 16 + 1, (self.batch,), generator=gen))
        perm = torch.randperm(self.num_blocks, generator=gen)[: self.table.numel()]
        self.table.copy_(perm.view_as(self.table))
        self.out.fill_(math.nan)
        self.lse.fill_(math.nan)

    def decode(self, **options: Any) -> None:
        args: dict[str, Any] = {
            "softmax_scale": 0.07,
            "provider": self.provider,
            "out": self.out,
            "lse": self.lse,
        }
        args.update(options)
        mla.mla_decode(self.q, self.cache, self.table, self.seq_lens, **args)

    def check(self, context: str, kv_scale: float | None = None) -> None:
        torch.cuda.synchronize()
        ref = reference_decode(
            self.q, self.cache, self.table, self.seq_lens, softmax_scale=0.07, kv_scale=kv_scale
        )
        assert_matches_reference(self.out, self.lse, *ref, context=context)


@pytest.mark.gpu
@pytest.mark.parametrize("provider", gpu_providers())
def test_gpu_replay_matches_eager_with_new_values_in_the_same_tensors(provider: str) -> None:
    DECODE_PLANS.clear()
    data = GpuInputs(provider)
    data.decode()
    data.decode()
    data.check(f"{provider} capture call")
    captured = [s for s in states() if isinstance(s, decode_graphs.CapturedCall)]
    assert len(captured) == 1, states()
    for seed in (1, 2, 3):
        data.refill(seed)
        data.decode()
        data.check(f"{provider} replay seed {seed}")
        replayed_out, replayed_lse = data.out.clone(), data.lse.clone()
        data.decode(graph="off")
        torch.cuda.synchronize()
        torch.testing.assert_close(replayed_out, data.out)
        torch.testing.assert_close(replayed_lse, data.lse)


@pytest.mark.gpu
@pytest.mark.parametrize("provider", gpu_providers())
def test_gpu_replay_reads_the_current_kv_scale(provider: str) -> None:
    DECODE_PLANS.clear()
    data = GpuInputs(provider, torch.float8_e4m3fn)
    for value in (0.02, 0.02, 0.005, 0.05):
        data.decode(kv_scale=value)
        data.check(f"{provider} float kv_scale {value}", kv_scale=value)
    scale = torch.full((1,), 0.02, device="cuda")
    for value in (0.02, 0.02, 0.01, 0.04):
        scale.fill_(value)
        data.decode(kv_scale=scale)
        data.check(f"{provider} device kv_scale {value}", kv_scale=value)
    assert sum(isinstance(s, decode_graphs.CapturedCall) for s in states()) == 2


@pytest.mark.gpu
@pytest.mark.parametrize("provider", gpu_providers())
def test_gpu_calls_inside_a_callers_capture_run_eagerly(provider: str) -> None:
    DECODE_PLANS.clear()
    data = GpuInputs(provider)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        data.decode()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        data.decode()
    assert not any(isinstance(s, decode_graphs.CapturedCall) for s in states())
    for seed in (1, 2):
        data.refill(seed)
        graph.replay()
        data.check(f"{provider} caller's graph, seed {seed}")


@pytest.mark.gpu
@pytest.mark.parametrize("provider", gpu_providers())
def test_gpu_replayed_mla_decode_does_not_sync(provider: str) -> None:
    DECODE_PLANS.clear()
    data = GpuInputs(provider, batch=128)
    for _ in range(2):  # seen, then captured
        data.decode(lse=None, return_lse=False)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            data.decode(lse=None, return_lse=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    ref = reference_decode(data.q, data.cache, data.table, data.seq_lens, softmax_scale=0.07)
    torch.testing.assert_close(data.out.double().cpu(), ref[0].cpu(), rtol=2e-2, atol=2e-2)
    assert any(isinstance(s, decode_graphs.CapturedCall) for s in states())
