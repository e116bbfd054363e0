"""The door of :func:`mla.mla_prefill` (:mod:`mla.engine.functional.prefill_call`): the checks
of a call's signature run once, a repeated call still raises on what may change between calls
(values, given outputs' memory), the provider's own checks are skipped from the second launch
of a signature on a plan, and a plan's pinned indptr buffers are made once."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from rejections import expect_invalid

import mla
from mla import InvalidInputError, TorchProvider
from mla.engine.functional import plan_cache, prefill_call
from mla.engine.functional import prefill as functional_prefill
from mla.providers.calls import VarlenPrefillCall
from mla.testing import PrefillCase, make_prefill_inputs

CASE = PrefillCase(heads=2, q_lens=(3, 5), kv_lens=(3, 9), qk_nope_dim=16, rope_dim=16, v_dim=16)


class RecordingProvider(TorchProvider):
    """The torch provider, recording each varlen launch's ``checked`` flag; ``fail`` makes the
    next launches raise (as a provider's own argument check would)."""

    def __init__(self) -> None:
        super().__init__()
        self.checked: list[bool] = []
        self.fail = 0

    def varlen_attention(self, call: VarlenPrefillCall) -> None:
        self.checked.append(call.checked)
        if self.fail:
            self.fail -= 1
            raise InvalidInputError("q", "refused by the provider's check")
        super().varlen_attention(call)


def args_of(**changes: Any) -> dict[str, Any]:
    args: dict[str, Any] = {**make_prefill_inputs(CASE).call_args(), "provider": "torch"}
    args.update(changes)
    return args


@pytest.fixture
def door_checks(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[object]]:
    """Counts the runs of the door's signature checks (empty caches to start with)."""
    prefill_call.PREFILL_CALLS.clear()
    plan_cache.PREFILL_PLANS.clear()
    runs: list[object] = []
    check = prefill_call.check_prefill_call

    def counted(args: Any) -> prefill_call.PrefillCall:
        runs.append(args)
        return check(args)

    monkeypatch.setattr(functional_prefill, "check_prefill_call", counted)
    yield runs
    prefill_call.PREFILL_CALLS.clear()


def test_the_checks_of_a_signature_run_once(door_checks: list[object]) -> None:
    args = args_of()
    first = mla.mla_prefill(**args)
    second = mla.mla_prefill(**args_of())  # new tensors, the same signature
    assert len(door_checks) == 1
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    # Another signature (q's strides, the indptrs' dtype, return_lse, the scale) runs them.
    strided_q = torch.empty(args["q"].shape[0], 3, *args["q"].shape[1:], dtype=args["q"].dtype)[:, 0]
    strided_q.copy_(args["q"])
    mla.mla_prefill(**{**args, "q": strided_q})
    mla.mla_prefill(**{**args, "cu_seqlens_q": args["cu_seqlens_q"].long()})
    mla.mla_prefill(**{**args, "return_lse": False})
    mla.mla_prefill(**{**args, "softmax_scale": 2 * CASE.scale})
    assert len(door_checks) == 5
    mla.mla_prefill(**{**args, "q": strided_q})
    assert len(door_checks) == 5


def test_a_cached_signature_still_raises_on_what_changes_between_calls(door_checks: list[object]) -> None:
    args = args_of()
    out = torch.empty(args["q"].shape[0], CASE.heads, CASE.v_dim, dtype=args["q"].dtype)

    def call(**changes: Any) -> Callable[[], object]:
        return lambda: mla.mla_prefill(**{**args, "out": out, **changes})

    call()()
    # The values: not in the signature, checked on every call.
    expect_invalid("max_seqlen_q", call(max_seqlen_q=4), "longest query 5")
    expect_invalid("max_seqlen_q", call(max_seqlen_q=-1), ">= 0")
    expect_invalid("max_seqlen_k", call(max_seqlen_k=9.0), "an int")
    expect_invalid("cu_seqlens_q", call(cu_seqlens_q=torch.tensor([0, 6, 3], dtype=torch.int32)), "monotonic")
    # A given output's memory against the inputs: checked on every call.
    shared = torch.empty(2 * out.numel(), dtype=out.dtype)
    v_over = shared[-args["v"].numel() :].view(args["v"].shape)
    v_over.copy_(args["v"])
    call(out=shared[: out.numel()].view(out.shape))()  # apart from args["v"]: fine
    expect_invalid("out", call(v=v_over, out=shared[-out.numel() :].view(out.shape)), "overlaps v")
    expect_invalid("lse", call(lse=args["q"][..., 0]), "expected dtype float32")  # (another signature)
    assert len(door_checks) == 2
    # Kinds and options are in the signature: a new one runs the checks, which name it.
    expect_invalid("causal", call(causal=1), "True or False")
    expect_invalid("softmax_scale", call(softmax_scale=-1.0), "positive")
    expect_invalid("q", call(q=args["q"].tolist()), "torch.Tensor")  # (no signature: checked)
    assert len(prefill_call.PREFILL_CALLS) == 1  # the checks that raised cached nothing


def test_the_provider_checks_are_skipped_from_the_second_launch(door_checks: list[object]) -> None:
    provider = RecordingProvider()
    args = args_of(provider=provider)
    for _ in range(3):
        mla.mla_prefill(**args)
    assert provider.checked == [False, True, True]
    # Another signature (q's strides) is launched unchecked first.
    strided_q = torch.empty(args["q"].shape[0], 3, *args["q"].shape[1:], dtype=args["q"].dtype)[:, 0]
    strided_q.copy_(args["q"])
    for _ in range(2):
        mla.mla_prefill(**{**args, "q": strided_q})
    assert provider.checked[3:] == [False, True]
    # A launch that raised marks nothing: the next call of a new signature runs the checks again.
    provider.checked.clear()
    provider.fail = 1
    new = {**args, "return_lse": False}
    expect_invalid("q", lambda: mla.mla_prefill(**new), "refused")
    mla.mla_prefill(**new)
    mla.mla_prefill(**new)
    assert provider.checked == [False, False, True]
    # Another provider object (another plan) gets its own first, checked launch.
    other = RecordingProvider()
    mla.mla_prefill(**{**args, "provider": other})
    assert other.checked == [False]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton kernels on CPU tensors")
def test_the_triton_providers_own_check_still_names_a_bad_layout(door_checks: list[object]) -> None:
    """A last dim the Triton kernel cannot read (a check of the provider, not of the door) is
    refused with the provider's error on every call of its signature; a good signature on the
    same plan is unaffected."""
    args = args_of(provider="triton", q=make_prefill_inputs(CASE).q.half())
    args.update(k=args["k"].half(), v=args["v"].half())
    mla.mla_prefill(**args)
    wide = torch.empty(*args["q"].shape[:2], 2 * args["q"].shape[2], dtype=torch.float16)
    strided_q = wide[..., ::2]
    strided_q.copy_(args["q"])
    for _ in range(2):
        expect_invalid(
            "q", lambda: mla.mla_prefill(**{**args, "q": strided_q}), "last dim must be contiguous"
        )
    mla.mla_prefill(**args)


def test_a_plans_pinned_indptr_buffers_are_made_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """:class:`~mla.engine.functional.plan_cache.HostIndptrs` (a CUDA call's copies; here with
    host buffers and a stand-in event): one ``[2, B+1]`` buffer per indptr dtype, reused by
    every call, and a copy that was recorded and never waited for is waited for before the
    buffers are handed out again."""
    made: list[torch.Tensor] = []
    events: list[StandInEvent] = []

    def buffer(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        made.append(torch.empty(shape, dtype=dtype))
        return made[-1]

    def event() -> StandInEvent:
        events.append(StandInEvent())
        return events[-1]

    monkeypatch.setattr(plan_cache, "pinned_buffer", buffer)
    monkeypatch.setattr(plan_cache, "new_event", event)
    host = plan_cache.HostIndptrs()
    for _ in range(3):
        rows = host.rows(torch.int32, 5)
        assert host.rows(torch.int32, 5) is rows
        host.record()
        host.wait()
    assert [b.shape for b in made] == [(2, 5)]
    assert [(e.records, e.waits) for e in events] == [(3, 3)]
    host.rows(torch.int64, 5)
    assert len(made) == 2
    host.record()  # a copy the call never waited for (it raised)...
    assert host.pending
    host.rows(torch.int32, 5)  # ...is waited for before the next call's copy
    assert events[0].waits == 4
    assert not host.pending
    assert len(made) == 2


class StandInEvent:
    def __init__(self) -> None:
        self.records = 0
        self.waits = 0

    def record(self) -> None:
        self.records += 1

    def synchronize(self) -> None:
        self.waits += 1


def test_the_step_values_are_copies_of_the_pinned_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan gets int32 copies of its own from the CUDA path (the pinned rows are the next
    call's); host tensors pass as they are (int32) or converted."""
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    copy = prefill_call.IndptrCopy(cu, cu, plan_cache.HostIndptrs())
    step_q, step_k = copy.step_values()
    assert step_q is cu
    assert step_k is cu
    copy.buffers = plan_cache.HostIndptrs()  # as the CUDA path leaves it
    monkeypatch.setattr(plan_cache.HostIndptrs, "wait", lambda self: None)
    step_q, step_k = copy.step_values()
    assert step_q is not cu
    assert step_q.dtype == torch.int32
    assert step_q.tolist() == cu.tolist()


@pytest.mark.gpu
def test_cuda_calls_reuse_their_plans_pinned_indptr_buffers() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    plan_cache.PREFILL_PLANS.clear()
    inputs = make_prefill_inputs(CASE, "cuda")
    args = args_of(
        q=inputs.q, k=inputs.k, v=inputs.v, cu_seqlens_q=inputs.cu_seqlens_q, cu_seqlens_k=inputs.cu_seqlens_k
    )
    mla.mla_prefill(**args)
    (entry,) = plan_cache.PREFILL_PLANS._entries.values()
    buffers = dict(entry.host_indptrs._pinned)
    assert all(b.is_pinned() for b in buffers.values())
    for _ in range(3):
        mla.mla_prefill(**args)
    assert entry.host_indptrs._pinned == buffers
    (buffer,) = buffers.values()
    assert buffer[0].tolist() == inputs.cu_seqlens_q.tolist()
    assert buffer[1].tolist() == inputs.cu_seqlens_k.tolist()
    bad = torch.tensor([0, 6, 3], dtype=torch.int32, device="cuda")
    with pytest.raises(InvalidInputError, match="monotonic"):
        mla.mla_prefill(**{**args, "cu_seqlens_q": bad})


def test_one_tensor_as_both_indptrs_is_checked_for_each(door_checks: list[object]) -> None:
    """The shared tensor's values are checked once when q and k have as many rows, and against
    k's rows when they differ."""
    args = args_of()
    square = {**args, "k": args["k"][:8], "v": args["v"][:8], "max_seqlen_k": 5}
    cu = args["cu_seqlens_q"]
    mla.mla_prefill(**{**square, "cu_seqlens_k": cu})
    bad = torch.tensor([0, 6, 3], dtype=torch.int32)
    expect_invalid(
        "cu_seqlens_q",
        lambda: mla.mla_prefill(**{**square, "cu_seqlens_q": bad, "cu_seqlens_k": bad}),
        "monotonic",
    )
    expect_invalid(
        "max_seqlen_k",
        lambda: mla.mla_prefill(**{**square, "cu_seqlens_k": cu, "max_seqlen_k": 4}),
        "longest key range 5",
    )
    expect_invalid(
        "cu_seqlens_k", lambda: mla.mla_prefill(**{**args, "cu_seqlens_k": cu}), "but k has 12 rows"
    )


def test_a_cached_call_reports_the_first_bad_argument_first(door_checks: list[object]) -> None:
    """Bad ``max_seqlen_q`` and an overlapping ``out`` together: the same error on a cached
    signature as on a new one (the door's order)."""
    args = args_of()
    out = args["q"].new_empty(args["q"].shape[0], CASE.heads, CASE.v_dim)
    shared = torch.empty(2 * out.numel(), dtype=out.dtype)
    v_over = shared[-args["v"].numel() :].view(args["v"].shape)
    bad = {**args, "v": v_over, "out": shared[-out.numel() :].view(out.shape), "max_seqlen_q": -1}
    expect_invalid("max_seqlen_q", lambda: mla.mla_prefill(**bad), ">= 0")
    mla.mla_prefill(**{**args, "out": out})
    expect_invalid("max_seqlen_q", lambda: mla.mla_prefill(**bad), ">= 0")
    assert len(door_checks) == 2
