"""``validate="checked"``, the default of ``mla_decode``, ``write_kv`` and ``mla_prefill``: bad
index values raise ``InvalidInputError`` naming the argument, found without a host read before
the launch.

The decode's page-index fill counts the keys in blocks outside the cache and the requests with a
bad length on the device; the door reads the counts after the launch and, when one moved, names
the argument through the ``validate="full"`` host rules. ``write_kv`` reads the largest slot
after the write; ``mla_prefill`` reads the indptrs (after the launch on kernels that clamp).
``validate="fast"`` reads nothing back (and stays memory-safe). On a CPU the CUDA-graph replay
runs with the stand-ins of ``tests/test_overhead.py``; the ``gpu`` tests replay real graphs.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from rejections import expect_invalid

import mla
from mla.core.step_rules import check_block_ids, check_paged_request_values
from mla.engine.functional import decode_graphs
from mla.engine.functional.plan_cache import DECODE_PLANS
from mla.providers.calls import FillPagesCall
from mla.testing import DecodeCase, assert_matches_reference, make_decode_inputs
from mla.tools.reference import reference_decode

if TYPE_CHECKING:
    from conftest import StepGraph

RANK, ROPE, HEADS = 64, 16, 4
CASE = DecodeCase(
    heads=HEADS, qlens=(2, 1), seq_lens=(20, 37), kv_lora_rank=RANK, rope_dim=ROPE,
    q_dtype=torch.float32, kv_dtype=torch.float32,
)  # fmt: skip
SINGLE = DecodeCase(
    heads=HEADS, qlens=(1, 1), seq_lens=(20, 37), kv_lora_rank=RANK, rope_dim=ROPE,
    q_dtype=torch.float32, kv_dtype=torch.float32,
)  # fmt: skip

PROVIDERS = ["torch", pytest.param("triton", marks=pytest.mark.interpret)]
"""The torch provider's fill (the torch form, also aiter's) and the Triton fill kernel (also
the Gluon provider's), interpreted on a CPU."""


def require(provider: str) -> None:
    if not mla.get_provider(provider).availability():
        pytest.skip(f"{provider} is unavailable here")


def decode_args(case: DecodeCase = CASE, device: str = "cpu", **changes: Any) -> dict[str, Any]:
    args: dict[str, Any] = {
        **make_decode_inputs(case, device).call_args(),
        "provider": "torch",
        "platform": "cpu",
    }
    args.update(changes)
    return args


def bad_values(args: dict[str, Any]) -> dict[str, tuple[str, dict[str, torch.Tensor]]]:
    """Each rule's bad value (a change of ``args``) and the argument its error names."""
    table, lens = args["block_table"], args["seq_lens"]
    num_blocks = args["kv_cache"].shape[0]
    past, negative = table.clone(), table.clone()
    past[1, 1], negative[0, 0] = num_blocks, -3
    return {
        "seq-len-below-qlen": ("seq_lens", {"seq_lens": torch.tensor([1, 37], dtype=lens.dtype)}),
        "negative-seq-len": ("seq_lens", {"seq_lens": torch.tensor([20, -1], dtype=lens.dtype)}),
        "table-too-short": ("block_table", {"block_table": table[:, :2].contiguous()}),
        "block-id-past-the-cache": ("block_table", {"block_table": past}),
        "negative-block-id": ("block_table", {"block_table": negative}),
    }


BAD = list(bad_values(decode_args()))

STRATEGIES = [None, "asm-non-persistent", "asm-padded-persistent", "gluon-verify-flatten"]
"""Automatic selection and each multi-token strategy's fill (the paged one copies the query
indptr in the fill, the padded one pads qlens, the verify rows read it for the row map)."""


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s or "auto")
@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize("provider", PROVIDERS)
def test_a_bad_value_raises_by_default_as_validate_full_does(
    provider: str, bad: str, strategy: str | None
) -> None:
    """The default call raises the ``validate="full"`` error (same argument, same message) after
    its launch; ``validate="fast"`` does not raise (the kernels mask or clamp: no read outside
    the tensors, finite outputs); the good call after it does not raise (the counts are per
    call) and matches the reference."""
    require(provider)
    args = decode_args(provider=provider, strategy=strategy)
    argument, change = bad_values(args)[bad]
    full = expect_invalid(argument, lambda: mla.mla_decode(**{**args, **change, "validate": "full"}))
    checked = expect_invalid(argument, lambda: mla.mla_decode(**{**args, **change}))
    assert str(checked) == str(full)
    out, lse = mla.mla_decode(**{**args, **change, "validate": "fast"})
    assert bool(torch.isfinite(out).all())
    out, lse = mla.mla_decode(**args)
    ref = reference_decode(
        args["q"], args["kv_cache"], args["block_table"], args["seq_lens"], args["query_start_loc"],
        softmax_scale=CASE.scale, kv_lora_rank=RANK,
    )  # fmt: skip
    assert_matches_reference(out, lse, *ref, context=f"{provider} good call after {bad}")


@pytest.mark.parametrize("strategy", [None, "gluon-decode", "asm-non-persistent"], ids=lambda s: s or "auto")
@pytest.mark.parametrize("provider", PROVIDERS)
def test_single_token_decode_without_query_start_loc(provider: str, strategy: str | None) -> None:
    """Without ``query_start_loc`` (one token per request) every rule but the query-length one
    applies: a negative length, a table too short and block ids outside the cache raise."""
    require(provider)
    args = decode_args(SINGLE, provider=provider, strategy=strategy, query_start_loc=None)
    for bad, (argument, change) in bad_values(args).items():
        if bad == "seq-len-below-qlen":
            mla.mla_decode(**{**args, **change})  # seq_len 1 covers its one token
            continue
        expect_invalid(argument, lambda change=change: mla.mla_decode(**{**args, **change}))
    mla.mla_decode(**args)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_graph_padding_requests_are_valid(provider: str) -> None:
    """A ``seq_len`` of 0 (a graph-padding request, whatever its qlen) is not an error; its rows
    are zeros with ``lse = -inf``."""
    require(provider)
    args = decode_args(provider=provider, seq_lens=torch.tensor([0, 37], dtype=torch.int32))
    out, lse = mla.mla_decode(**args)
    assert bool((out[:2] == 0).all())
    assert bool((lse[:2] == float("-inf")).all())


# -- the device detection is the host rule ------------------------------------------------------


def host_rules_reject(
    qsl: list[int], lens: list[int], table: torch.Tensor, block_size: int, blocks: int
) -> bool:
    """Whether ``validate="full"``'s host rules reject the step (the functional decode's: no
    model length, the block table's capacity bounds each request)."""
    qlens = [b - a for a, b in itertools.pairwise(qsl)]
    try:
        check_paged_request_values(
            query_lens=qlens, seq_lens=lens, block_table_shape=tuple(table.shape), block_size=block_size
        )
        check_block_ids(
            seq_lens_cpu=torch.tensor(lens), block_table_cpu=table, block_size=block_size, num_blocks=blocks
        )
    except mla.InvalidInputError:
        return True
    return False


@st.composite
def steps(draw: st.DrawFn) -> tuple[list[int], list[int], list[list[int]], int, int]:
    """A step of 1-5 requests: qlens 0-3, lengths -2 .. past the table, block ids -2 .. past
    the cache (mostly inside), block size 1, 4 or 16."""
    block_size = draw(st.sampled_from([1, 4, 16]))
    width = draw(st.integers(0, 3))
    count = draw(st.integers(1, 5))
    blocks = draw(st.integers(1, 12))
    qlens = draw(st.lists(st.integers(0, 3), min_size=count, max_size=count))
    qsl = [0]
    for qlen in qlens:
        qsl.append(qsl[-1] + qlen)
    capacity = width * block_size
    lens = draw(st.lists(st.integers(-2, capacity + 2), min_size=count, max_size=count))
    ids = st.one_of(st.integers(0, blocks - 1), st.integers(-2, blocks + 1))
    table = draw(st.lists(st.lists(ids, min_size=width, max_size=width), min_size=count, max_size=count))
    return qsl, lens, table, block_size, blocks


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("token_ids", [True, False], ids=["per-token", "block-table"])
@settings(max_examples=60, deadline=None)
@given(step=steps())
def test_the_fill_counts_exactly_the_steps_the_host_rules_reject(
    provider: str, token_ids: bool, step: tuple[list[int], list[int], list[list[int]], int, int]
) -> None:
    """The fill's two counts (keys outside the cache, requests with a bad length), bounded by
    the block table's capacity as the functional decode's fill is, are not both 0 exactly when
    the host rules of ``validate="full"`` reject the step (a length below its qlen but > 0,
    negative or past the table, a used block id outside the cache)."""
    require(provider)
    qsl, lens, rows, block_size, blocks = step
    width = len(rows[0])
    table = torch.tensor(rows, dtype=torch.int32).view(len(rows), width)
    max_len = width * block_size
    counts = torch.zeros(2, dtype=torch.int32)
    call = FillPagesCall(
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_table=table,
        kv_indptr=torch.zeros(len(lens) + 1, dtype=torch.int32),
        kv_indices=torch.zeros(len(lens) * max_len + 1, dtype=torch.int32) if token_ids else None,
        block_size=block_size,
        max_len=max_len,
        num_blocks=blocks,
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        invalid_count=counts[:1],
        length_count=counts[1:],
    )
    mla.get_provider(provider).fill_page_indices(call)
    assert bool(counts.any()) == host_rules_reject(qsl, lens, table, block_size, blocks), counts.tolist()


@settings(max_examples=40, deadline=None)
@given(step=steps())
def test_the_default_decode_raises_exactly_what_validate_full_raises(
    step: tuple[list[int], list[int], list[list[int]], int, int],
) -> None:
    """Over random steps, the default ``mla_decode`` raises exactly when ``validate="full"``
    does, with the same error (torch provider)."""
    qsl, lens, rows, block_size, blocks = step
    if qsl[-1] == 0:
        return  # q needs a row (a step without query tokens is q's case, not the values')
    gen = torch.Generator().manual_seed(len(lens))
    args = {
        "q": torch.randn(qsl[-1], HEADS, RANK + ROPE, generator=gen),
        "kv_cache": torch.randn(blocks, block_size, RANK + ROPE, generator=gen),
        "block_table": torch.tensor(rows, dtype=torch.int32).view(len(rows), len(rows[0])),
        "seq_lens": torch.tensor(lens, dtype=torch.int32),
        "query_start_loc": torch.tensor(qsl, dtype=torch.int32),
        "softmax_scale": 0.125,
        "kv_lora_rank": RANK,
        "provider": "torch",
    }
    errors = []
    for validate in ("full", "checked"):
        try:
            mla.mla_decode(**args, validate=validate)
            errors.append(None)
        except mla.InvalidInputError as error:
            errors.append(str(error))
    assert errors[0] == errors[1]


# -- CUDA-graph replay ------------------------------------------------------------------------


@pytest.mark.parametrize("with_out", [True, False], ids=["out", "own-outputs"])
@pytest.mark.parametrize("provider", PROVIDERS)
def test_a_replayed_call_raises_on_values_written_between_calls(
    provider: str, with_out: bool, replay_on_cpu: list[StepGraph]
) -> None:
    """The replayed step (build and kernels, read back after it) raises on a bad block id or
    length written into the caller's tensors between calls, and the next good replay does not."""
    require(provider)
    args = decode_args(provider=provider)
    if with_out:
        args["out"], args["lse"] = torch.empty(3, HEADS, RANK), torch.empty(3, HEADS)
    table, lens = args["block_table"], args["seq_lens"]
    for _ in range(3):  # seen, captured, replayed
        mla.mla_decode(**args)
    assert len(replay_on_cpu) == 1
    good_id, good_len = int(table[1, 2]), int(lens[0])
    table[1, 2] = args["kv_cache"].shape[0]
    error = expect_invalid("block_table", lambda: mla.mla_decode(**args))
    assert "outside the cache" in str(error)
    table[1, 2] = good_id
    mla.mla_decode(**args)
    lens[0] = 1
    expect_invalid("seq_lens", lambda: mla.mla_decode(**args))
    lens[0] = good_len
    out, lse = mla.mla_decode(**args)
    assert replay_on_cpu[0].replays == 5
    ref = reference_decode(
        args["q"], args["kv_cache"], table, lens, args["query_start_loc"], softmax_scale=CASE.scale,
        kv_lora_rank=RANK,
    )  # fmt: skip
    assert_matches_reference(out, lse, *ref, context="replay after the errors")


def test_a_call_with_bad_values_is_not_captured(replay_on_cpu: list[StepGraph]) -> None:
    """The call that would capture checks its eager run's counts first: bad values raise and
    nothing is captured; the next good calls capture and replay."""
    args = decode_args()
    mla.mla_decode(**args)
    table = args["block_table"]
    good = int(table[0, 0])
    table[0, 0] = -1
    expect_invalid("block_table", lambda: mla.mla_decode(**args))
    assert replay_on_cpu == []
    table[0, 0] = good
    mla.mla_decode(**args)
    mla.mla_decode(**args)
    assert [graph.replays for graph in replay_on_cpu] == [1]


def test_without_external_events_checked_calls_stay_eager(replay_on_cpu: list[StepGraph]) -> None:
    """Where torch cannot record an event inside a graph for the host to wait on (no
    ``external`` events), the plan's checked calls are never captured; they run eagerly."""
    args = decode_args()
    mla.mla_decode(**args)
    (entry,) = DECODE_PLANS._entries.values()
    assert entry.counts is not None
    entry.counts.replayable = False
    for _ in range(2):
        mla.mla_decode(**args)
    assert replay_on_cpu == []
    assert list(entry.graphs._entries.values()) == [decode_graphs.EAGER]


def test_a_changed_value_found_by_the_device_alone_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """When the counts moved but the host rules pass on the current values (the caller changed
    them while the call ran), the counts are the error."""
    from mla.engine.functional import decode_call

    args = decode_args()
    table = args["block_table"]
    table[1, 0] = -1
    real_check = decode_call.check_counts

    def repaired(counts: list[int], *rest: Any) -> None:
        table[1, 0] = 0  # "changed while the call ran"
        real_check(counts, *rest)

    monkeypatch.setattr(mla.engine.functional.decode, "check_counts", repaired)
    error = expect_invalid("block_table", lambda: mla.mla_decode(**args))
    assert "16 keys of this call" in str(error)
    table[1, 0] = 0
    args["seq_lens"][0] = 1
    monkeypatch.setattr(
        mla.engine.functional.decode,
        "check_counts",
        lambda counts, *rest: (args["seq_lens"].fill_(20), real_check(counts, *rest)),
    )
    error = expect_invalid("seq_lens", lambda: mla.mla_decode(**args))
    assert "1 requests of this call" in str(error)


@pytest.mark.gpu
@pytest.mark.parametrize("provider", ["torch", "triton", "gluon"])
def test_gpu_replayed_and_eager_calls_raise_on_bad_values(provider: str) -> None:
    """On a CUDA device: a replayed call (a real graph: build, the counts' copy and its event,
    kernels) raises on a bad block id or length written between calls, as an eager call
    (``graph="off"``) does; good calls around them match the reference."""
    if not torch.cuda.is_available() or not mla.get_provider(provider).availability():
        pytest.skip(f"{provider} needs its GPU")
    DECODE_PLANS.clear()
    case = DecodeCase(heads=16, qlens=(2, 1), seq_lens=(200, 377), kv_lora_rank=512, rope_dim=64)
    args = decode_args(case, "cuda", provider=provider, platform=None)
    args["out"] = torch.empty(3, 16, 512, dtype=case.q_dtype, device="cuda")
    args["lse"] = torch.empty(3, 16, device="cuda")
    table, lens = args["block_table"], args["seq_lens"]
    for graph in ("auto", "off"):
        for _ in range(3):  # seen, captured, replayed (or eager three times)
            mla.mla_decode(**args, graph=graph)
        good_id, good_len = int(table[1, 2]), int(lens[0])
        table[1, 2] = args["kv_cache"].shape[0]
        expect_invalid("block_table", lambda graph=graph: mla.mla_decode(**args, graph=graph))
        table[1, 2] = good_id
        lens[0] = 1
        expect_invalid("seq_lens", lambda graph=graph: mla.mla_decode(**args, graph=graph))
        lens[0] = good_len
        out, lse = mla.mla_decode(**args, graph=graph)
        ref = reference_decode(
            args["q"], args["kv_cache"], table, lens, args["query_start_loc"], softmax_scale=case.scale,
            kv_lora_rank=512,
        )  # fmt: skip
        assert_matches_reference(out, lse, *ref, context=f"{provider} graph={graph}")
    (entry,) = DECODE_PLANS._entries.values()
    plan = entry.backend.current_decode()[1]
    if entry.backend.decode_strategy(plan.strategy).capturable_build(plan):  # replays were real
        assert any(isinstance(state, decode_graphs.CapturedCall) for state in entry.graphs._entries.values())
    fast = {**args, "validate": "fast"}
    table[1, 2] = args["kv_cache"].shape[0]
    for _ in range(3):
        mla.mla_decode(**fast)  # trusted: masked, no read back
    torch.cuda.synchronize()


# -- write_kv -------------------------------------------------------------------------------------


def write_args(provider: str = "torch", **changes: Any) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(3)
    args: dict[str, Any] = {
        "kv_c": torch.randn(4, RANK, generator=gen),
        "k_pe": torch.randn(4, ROPE, generator=gen),
        "kv_cache": torch.zeros(4, 16, RANK + ROPE),
        "slot_mapping": torch.tensor([5, -1, 63, 17], dtype=torch.int64),
        "provider": provider,
        "platform": "cpu",
    }
    args.update(changes)
    return args


@pytest.mark.parametrize("provider", PROVIDERS)
def test_write_kv_raises_on_a_slot_past_the_cache_after_the_write(provider: str) -> None:
    """A slot past the cache raises naming ``slot_mapping`` (the token and the fix); the other
    rows are written, the bad one skipped. -1 (padding) is valid; ``fast`` does not raise."""
    require(provider)
    args = write_args(provider, slot_mapping=torch.tensor([5, -1, 64, 17]))
    error = expect_invalid("slot_mapping", lambda: mla.write_kv(**args))
    assert "token 2 has slot 64 outside the cache's 64 slots" in str(error)
    flat = args["kv_cache"].view(-1, RANK + ROPE)
    assert torch.equal(flat[5], torch.cat([args["kv_c"][0], args["k_pe"][0]]))
    assert torch.equal(flat[17], torch.cat([args["kv_c"][3], args["k_pe"][3]]))
    assert int((flat.abs().sum(-1) > 0).sum()) == 2
    mla.write_kv(**{**args, "validate": "fast"})
    good = write_args(provider)
    mla.write_kv(**good)
    assert int((good["kv_cache"].view(-1, RANK + ROPE).abs().sum(-1) > 0).sum()) == 3
    mla.write_kv(**write_args(provider, slot_mapping=torch.full((4,), -1)))  # all padding
    mla.write_kv(
        **write_args(
            provider,
            kv_c=torch.randn(0, RANK),
            k_pe=torch.randn(0, ROPE),
            slot_mapping=torch.zeros(0, dtype=torch.int64),
        )
    )


def test_write_kv_names_a_slot_changed_while_the_write_ran(monkeypatch: pytest.MonkeyPatch) -> None:
    from mla.engine.functional import write

    args = write_args(slot_mapping=torch.tensor([5, -1, 99, 17]))
    real = write._check_written_slots

    def repaired(slot_mapping: torch.Tensor, top: int, kv_cache: torch.Tensor) -> None:
        slot_mapping[2] = 6
        real(slot_mapping, top, kv_cache)

    monkeypatch.setattr(write, "_check_written_slots", repaired)
    error = expect_invalid("slot_mapping", lambda: mla.write_kv(**args))
    assert "held slot 99" in str(error)


# -- mla_prefill ------------------------------------------------------------------------------------


def prefill_args(provider: str, **changes: Any) -> dict[str, Any]:
    from mla.testing import PrefillCase, make_prefill_inputs

    case = PrefillCase(
        heads=4, q_lens=(3, 5), kv_lens=(3, 9), qk_nope_dim=32, rope_dim=16, v_dim=32,
        dtype=torch.float16 if provider == "triton" else torch.float32,
    )  # fmt: skip
    inputs = make_prefill_inputs(case)
    args: dict[str, Any] = {
        "q": inputs.q, "k": inputs.k, "v": inputs.v, "cu_seqlens_q": inputs.cu_seqlens_q,
        "cu_seqlens_k": inputs.cu_seqlens_k, "max_seqlen_q": inputs.max_seqlen_q,
        "max_seqlen_k": inputs.max_seqlen_k, "softmax_scale": case.scale, "provider": provider,
        "platform": "sm90" if provider == "triton" else "cpu",
    }  # fmt: skip
    args.update(changes)
    return args


@pytest.mark.parametrize("provider", PROVIDERS)
def test_prefill_validate_modes(provider: str) -> None:
    """``checked`` (default) and ``full`` raise on a bad indptr; ``fast`` trusts it where the
    kernels clamp (the Triton provider: no read, no error, a memory-safe launch) and reads it
    before the launch elsewhere (the torch provider: the error still comes)."""
    require(provider)
    bad = {"cu_seqlens_q": torch.tensor([0, 6, 3], dtype=torch.int32)}
    args = prefill_args(provider, **bad)
    for validate in ("checked", "full"):
        expect_invalid("cu_seqlens_q", lambda validate=validate: mla.mla_prefill(**args, validate=validate))
    if provider == "triton":
        mla.mla_prefill(**args, validate="fast")
    else:
        expect_invalid("cu_seqlens_q", lambda: mla.mla_prefill(**args, validate="fast"))
    good = prefill_args(provider)
    for validate in ("checked", "fast", "full"):
        mla.mla_prefill(**good, validate=validate)
    expect_invalid("validate", lambda: mla.mla_prefill(**good, validate="paranoid"))


@pytest.mark.parametrize(
    "call",
    [
        lambda v: mla.mla_decode(**decode_args(), validate=v),
        lambda v: mla.write_kv(**write_args(), validate=v),
    ],
    ids=["mla_decode", "write_kv"],
)
def test_an_unknown_validate_mode_is_named(call: Callable[[str], object]) -> None:
    error = expect_invalid("validate", lambda: call("paranoid"))
    assert "'checked'" in str(error)
