"""Every bad-input rule gets a typed error naming the argument, before any kernel runs.

``InvalidInputError`` (also a ``ValueError``) for wrong shapes, dtypes, devices and index
values; ``UnsupportedError`` for a head count no strategy accepts or a forced strategy that does
not fit. On the backend path, nothing is written to caller outputs when a call is rejected.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import attrs
import pytest
import rejections
import torch

import mla
from mla import InvalidInputError, Support, TorchProvider, UnsupportedError
from mla.testing import (
    DecodeCase,
    PrefillCase,
    assert_matches_reference,
    emulated_provider,
    make_decode_inputs,
    make_prefill_inputs,
)
from mla.tools.reference import reference_prefill

RANK, ROPE = 64, 16
META = torch.device("meta")


def expect_invalid(argument: str, call: Callable[[], object], match: str | None = None) -> InvalidInputError:
    """:func:`rejections.expect_invalid`, and the error is a ``ValueError`` and an ``MLAError``
    whose message starts with the argument's name."""
    error = rejections.expect_invalid(argument, call, match)
    assert isinstance(error, ValueError)
    assert isinstance(error, mla.MLAError)
    assert error.argument == argument
    assert str(error).startswith(f"{argument}: ")
    return error


# -- mla_decode -------------------------------------------------------------------------------

DECODE_CASE = DecodeCase(heads=4, qlens=(2, 1), seq_lens=(20, 37), kv_lora_rank=RANK, rope_dim=ROPE)


def decode_args(**changes: Any) -> dict[str, Any]:
    args: dict[str, Any] = {
        **make_decode_inputs(DECODE_CASE).call_args(),
        "provider": "torch",
        "platform": "cpu",
    }
    args.update(changes)
    return args


def decode(**changes: Any) -> Callable[[], object]:
    args = decode_args(**changes)
    return lambda: mla.mla_decode(**args)


def test_valid_decode_input_passes() -> None:
    out, lse = decode()()  # type: ignore[misc]
    assert out.shape == (3, 4, RANK)
    assert lse.shape == (3, 4)


def test_decode_wrong_rank() -> None:
    q = decode_args()["q"]
    cache = decode_args()["kv_cache"]
    expect_invalid("q", decode(q=q[0]), "expected 3 dims")
    expect_invalid("kv_cache", decode(kv_cache=cache.flatten(0, 1)), "expected 3 dims")
    expect_invalid("block_table", decode(block_table=decode_args()["block_table"][0]), "expected 2 dims")
    expect_invalid("seq_lens", decode(seq_lens=decode_args()["seq_lens"][None]), "expected 1 dims")


def test_decode_wrong_last_dim() -> None:
    q, cache = decode_args()["q"], decode_args()["kv_cache"]
    expect_invalid("q", decode(q=q[..., :RANK]), "kv_lora_rank")
    # The cache's rows define the latent width; a query of another width is the query's fault.
    error = expect_invalid("q", decode(q=q[..., :-1]), "must equal kv_cache's last dim")
    assert f"rope {ROPE}" in str(error)
    expect_invalid("q", decode(kv_cache=cache[..., :-1]), "last dim")
    expect_invalid("kv_cache", decode(kv_cache=cache[..., :RANK]), "kv_lora_rank")


def test_decode_mismatched_devices() -> None:
    for name in ("kv_cache", "block_table", "seq_lens", "query_start_loc"):
        moved = decode_args()[name].to(META)
        error = expect_invalid(name, decode(**{name: moved}), "is on meta")
        assert "move it to cpu" in str(error)


def test_decode_integer_tensors_must_be_int32_or_int64() -> None:
    args = decode_args()
    expect_invalid("block_table", decode(block_table=args["block_table"].to(torch.int16)), "int32 or int64")
    expect_invalid("seq_lens", decode(seq_lens=args["seq_lens"].float()), "int32 or int64")
    expect_invalid(
        "query_start_loc", decode(query_start_loc=args["query_start_loc"].to(torch.uint8)), "int32"
    )


def test_decode_float_tensors_must_be_float() -> None:
    args = decode_args()
    expect_invalid("q", decode(q=args["q"].to(torch.int32)), "expected one of")
    expect_invalid("kv_cache", decode(kv_cache=args["kv_cache"].to(torch.int8)), "expected one of")


def test_decode_non_monotonic_query_start_loc() -> None:
    expect_invalid(
        "query_start_loc", decode(query_start_loc=torch.tensor([0, 2, 1], dtype=torch.int32)), "monotonic"
    )
    expect_invalid(
        "query_start_loc", decode(query_start_loc=torch.tensor([1, 2, 3], dtype=torch.int32)), "start at 0"
    )
    expect_invalid(
        "query_start_loc", decode(query_start_loc=torch.tensor([0, 2, 9], dtype=torch.int32)), "only 3 rows"
    )
    expect_invalid(
        "query_start_loc", decode(query_start_loc=torch.tensor([0, 3], dtype=torch.int32)), "entries"
    )


# Rules on seq_lens / block_table values: validate="full" checks them on the host before the
# launch (the default, validate="checked", finds them on the device: tests/test_checked_values.py).


def test_decode_seq_len_shorter_than_query() -> None:
    short = torch.tensor([1, 37], dtype=torch.int32)
    error = expect_invalid("seq_lens", decode(seq_lens=short, validate="full"))
    assert "request 0 has seq_len 1 < its query length 2" in str(error)
    negative = torch.tensor([-1, 37], dtype=torch.int32)
    expect_invalid("seq_lens", decode(seq_lens=negative, validate="full"), ">= 0")


def test_decode_block_ids_outside_the_cache() -> None:
    args = decode_args()
    num_blocks = args["kv_cache"].shape[0]
    for bad in (num_blocks, -1):
        table = args["block_table"].clone()
        table[1, 0] = bad
        error = expect_invalid("block_table", decode(block_table=table, validate="full"), "outside the cache")
        assert f"block id {bad} (request 1, column 0)" in str(error)


def test_decode_block_table_too_short() -> None:
    table = decode_args()["block_table"]
    error = expect_invalid("block_table", decode(block_table=table[:, :1], validate="full"), "columns")
    assert "needs 3 blocks of 16 for seq_len 37" in str(error)
    expect_invalid("block_table", decode(block_table=table[:1]), "1 rows for 2 requests")


def test_decode_fp8_cache_needs_kv_scale() -> None:
    cache = decode_args()["kv_cache"].to(torch.float8_e4m3fn)
    expect_invalid("kv_scale", decode(kv_cache=cache), "needs kv_scale")
    out, _ = decode(kv_cache=cache, kv_scale=1.0)()  # type: ignore[misc]
    assert not torch.isnan(out).any()


def test_decode_head_count_no_strategy_accepts() -> None:
    case = DecodeCase(heads=130, qlens=(1,), seq_lens=(9,), kv_lora_rank=RANK, rope_dim=ROPE)
    inputs = make_decode_inputs(case)
    with pytest.raises(UnsupportedError) as info:
        mla.mla_decode(
            inputs.q.to(torch.bfloat16),
            inputs.kv_cache,
            inputs.block_table,
            inputs.seq_lens,
            softmax_scale=case.scale,
            kv_lora_rank=RANK,
            provider=emulated_provider("aiter", "gfx942"),
            platform="gfx942",
        )
    assert "130 heads" in str(info.value)
    assert "H % 16 == 0" in str(info.value)
    assert info.value.explanation is not None


def test_decode_forced_strategy_that_does_not_fit() -> None:
    with pytest.raises(UnsupportedError, match="forced decode strategy 'gluon-decode'") as info:
        decode(strategy="gluon-decode")()  # qlen 2: GluonDecode is single-token only
    assert info.value.explanation is not None
    assert info.value.explanation.candidate("gluon-decode").reasons[0].code == "qlen"


# -- mla_prefill ------------------------------------------------------------------------------

PREFILL_CASE = PrefillCase(heads=4, q_lens=(3, 5), kv_lens=(3, 9), qk_nope_dim=32, rope_dim=16, v_dim=24)


def prefill_args(**changes: Any) -> dict[str, Any]:
    inputs = make_prefill_inputs(PREFILL_CASE)
    args: dict[str, Any] = {**inputs.call_args(), "provider": "torch", "platform": "cpu"}
    args.update(changes)
    return args


def prefill(**changes: Any) -> Callable[[], object]:
    args = prefill_args(**changes)
    return lambda: mla.mla_prefill(**args)


def test_valid_prefill_input_passes() -> None:
    out, lse = prefill()()  # type: ignore[misc]
    assert out.shape == (8, 4, 24)
    assert lse.shape == (8, 4)


def test_prefill_wrong_rank() -> None:
    args = prefill_args()
    for name in ("q", "k", "v"):
        expect_invalid(name, prefill(**{name: args[name][0]}), "expected 3 dims")
    expect_invalid("cu_seqlens_q", prefill(cu_seqlens_q=args["cu_seqlens_q"][None]), "expected 1 dims")


def test_prefill_wrong_last_dim_and_heads() -> None:
    args = prefill_args()
    expect_invalid("k", prefill(k=args["k"][..., :-1]), "to match q")
    expect_invalid("k", prefill(k=args["k"][:, :2]), "to match q")
    expect_invalid("v", prefill(v=args["v"][:-1]), "to match k")
    expect_invalid("v", prefill(v=args["v"][:, :2]), "to match k")
    expect_invalid("k", prefill(k=args["k"].float()), "share a dtype")


def test_prefill_mismatched_devices() -> None:
    args = prefill_args()
    for name in ("k", "v", "cu_seqlens_q", "cu_seqlens_k"):
        expect_invalid(name, prefill(**{name: args[name].to(META)}), "is on meta")


def test_prefill_integer_tensors_must_be_int32_or_int64() -> None:
    args = prefill_args()
    expect_invalid("cu_seqlens_q", prefill(cu_seqlens_q=args["cu_seqlens_q"].float()), "int32 or int64")
    expect_invalid(
        "cu_seqlens_k", prefill(cu_seqlens_k=args["cu_seqlens_k"].to(torch.int16)), "int32 or int64"
    )


def test_prefill_non_monotonic_cu_seqlens() -> None:
    expect_invalid(
        "cu_seqlens_q", prefill(cu_seqlens_q=torch.tensor([0, 6, 3], dtype=torch.int32)), "monotonic"
    )
    expect_invalid(
        "cu_seqlens_k", prefill(cu_seqlens_k=torch.tensor([0, 9, 3], dtype=torch.int32)), "monotonic"
    )
    expect_invalid("cu_seqlens_k", prefill(cu_seqlens_k=torch.tensor([0, 12], dtype=torch.int32)), "entries")


def test_prefill_max_seqlen_too_small() -> None:
    expect_invalid("max_seqlen_q", prefill(max_seqlen_q=4), "longest query 5")
    expect_invalid("max_seqlen_k", prefill(max_seqlen_k=8), "longest key range 9")


@pytest.mark.gpu
@pytest.mark.parametrize("provider", ["triton", "gluon"])
def test_prefill_values_are_checked_after_the_launch_on_clamping_kernels(
    provider: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a provider whose varlen kernels clamp each request's rows
    (``varlen_clamps_indptrs``), ``mla_prefill`` reads the indptrs after the launch (never
    through the before-the-launch read) and still raises on bad values; a good call gives the
    reference."""
    if not torch.cuda.is_available() or not mla.get_provider(provider).availability():
        pytest.skip(f"{provider} needs its GPU")
    from mla.engine.functional import prefill_call

    launched = []
    copy_class = prefill_call.IndptrCopy
    read_values = copy_class.values

    def values_after_the_launch(self: Any) -> tuple[torch.Tensor, torch.Tensor]:
        assert launched, "read the indptrs before the launch"
        launched.clear()
        return read_values(self)

    monkeypatch.setattr(copy_class, "values", values_after_the_launch)
    provider_class = type(mla.get_provider(provider))
    launch = provider_class.varlen_attention

    def recorded_launch(self: Any, varlen: Any) -> None:
        launched.append(True)
        launch(self, varlen)

    monkeypatch.setattr(provider_class, "varlen_attention", recorded_launch)
    on_gpu = {
        name: value.cuda() if isinstance(value, torch.Tensor) else value
        for name, value in prefill_args(provider=provider, platform=None).items()
    }

    def call(**changes: Any) -> Callable[[], object]:
        return lambda: mla.mla_prefill(**{**on_gpu, **changes})

    out, lse = call()()  # type: ignore[misc]
    ref = reference_prefill(
        on_gpu["q"], on_gpu["k"], on_gpu["v"], on_gpu["cu_seqlens_q"], on_gpu["cu_seqlens_k"],
        softmax_scale=PREFILL_CASE.scale,
    )  # fmt: skip
    assert_matches_reference(out, lse, *ref, context=f"{provider} mla_prefill (bf16)")
    bad_q = torch.tensor([0, 6, 3], dtype=torch.int32, device="cuda")
    expect_invalid("cu_seqlens_q", call(cu_seqlens_q=bad_q), "monotonic")
    bad_k = torch.tensor([0, 13, 12], dtype=torch.int32, device="cuda")
    expect_invalid("cu_seqlens_k", call(cu_seqlens_k=bad_k), "monotonic")
    expect_invalid("max_seqlen_q", call(max_seqlen_q=4), "longest query 5")
    torch.cuda.synchronize()  # the kernels of the failed calls touched nothing outside


def test_prefill_forced_strategy_that_does_not_fit() -> None:
    # 4 heads: aiter's fp8 prefill needs a multiple of 16.
    args = prefill_args(
        provider=emulated_provider("aiter", "gfx950"), platform="gfx950", strategy=mla.Fp8PersistentPrefill
    )
    with pytest.raises(UnsupportedError, match="forced prefill strategy") as info:
        mla.mla_prefill(**args)
    assert info.value.explanation is not None
    assert info.value.explanation.candidate("fp8-persistent-prefill").reasons[0].code == "heads"


# -- the backend: builder and impl --------------------------------------------------------------


def make_backend(**changes: Any) -> mla.MLABackend:
    options: dict[str, Any] = {
        "model_dtype": torch.float32,
        "provider": "torch",
        "platform": "cpu",
    }
    options.update(changes)
    cache = options.pop("cache", mla.KVCacheSpec(16, torch.float32, num_blocks=8))
    return mla.MLABackend(
        mla.MLADims(4, RANK, ROPE, 32, 24, softmax_scale=DECODE_CASE.scale),
        cache,
        mla.EngineLimits(4, 64, 64, max_decode_qlen=2),
        **options,
    )


def step(**changes: Any) -> mla.StepInputs:
    qsl = changes.pop("qsl", torch.tensor([0, 2, 3], dtype=torch.int32))
    values: dict[str, Any] = {
        "query_start_loc_cpu": qsl,
        "query_start_loc": qsl,
        "seq_lens": torch.tensor([20, 37], dtype=torch.int32),
        "block_table": torch.tensor([[3, 1, 0], [5, 2, 7]], dtype=torch.int32),
        "num_decodes": 2,
        "num_decode_tokens": 3,
    }
    values.update(changes)
    # The engine passes its host copy of seq_lens: the host rules run on it.
    values.setdefault("seq_lens_cpu", values["seq_lens"])
    return mla.StepInputs(**values)


def test_valid_step_builds() -> None:
    metadata = make_backend().builder.build(step())
    assert metadata.decode is not None


def test_builder_non_monotonic_query_start_loc() -> None:
    builder = make_backend().builder
    expect_invalid("query_start_loc", lambda: builder.build(step(qsl=torch.tensor([0, 3, 2]))), "monotonic")


@pytest.mark.parametrize(
    ("argument", "change", "match"),
    [
        (
            "query_start_loc",
            {"qsl": torch.zeros(0, dtype=torch.int32), "num_decodes": 0, "num_decode_tokens": 0},
            "at least one entry",
        ),
        ("seq_lens", {"seq_lens": torch.tensor([20, 37, 5], dtype=torch.int32)}, "describes 2 requests"),
        (
            "block_table",
            {"block_table": torch.tensor([[3, 1, 0]], dtype=torch.int32)},
            "1 rows for 2 requests",
        ),
    ],
    ids=["empty-indptr", "a-seq-len-too-many", "a-table-row-short"],
)
def test_builder_rejects_steps_of_mismatched_sizes(argument: str, change: dict[str, Any], match: str) -> None:
    builder = make_backend().builder
    expect_invalid(argument, lambda: builder.build(step(**change)), match)


def test_builder_integer_dtypes() -> None:
    builder = make_backend().builder
    expect_invalid(
        "seq_lens", lambda: builder.build(step(seq_lens=torch.tensor([20.0, 37.0]))), "int32 or int64"
    )
    table = torch.tensor([[3, 1, 0], [5, 2, 7]], dtype=torch.int16)
    expect_invalid("block_table", lambda: builder.build(step(block_table=table)), "int32 or int64")


def test_builder_seq_len_shorter_than_query() -> None:
    builder = make_backend().builder
    expect_invalid("seq_lens", lambda: builder.build(step(seq_lens=torch.tensor([1, 37]))), "query length 2")
    # A prefill request (no graph padding there) with seq_len 0.
    prefill_step = step(seq_lens=torch.tensor([20, 0]), num_decodes=1, num_decode_tokens=2)
    expect_invalid("seq_lens", lambda: builder.build(prefill_step), "prefill request 1 has seq_len 0")


def test_builder_seq_len_over_max_model_len() -> None:
    builder = make_backend().builder
    table = torch.tensor([[3, 1, 0, 4, 6], [5, 2, 7, 4, 6]], dtype=torch.int32)
    bad = step(seq_lens=torch.tensor([65, 37]), block_table=table)
    expect_invalid("seq_lens", lambda: builder.build(bad), "max_model_len 64")


def test_builder_block_ids_outside_the_cache() -> None:
    builder = make_backend(validate="full").builder
    table = torch.tensor([[3, 1, 0], [5, 8, 7]], dtype=torch.int32)
    expect_invalid(
        "block_table", lambda: builder.build(step(block_table=table)), "outside the cache's 8 blocks"
    )


def test_builder_block_table_too_short() -> None:
    builder = make_backend().builder
    table = torch.tensor([[3, 1], [5, 2]], dtype=torch.int32)
    expect_invalid("block_table", lambda: builder.build(step(block_table=table)), "2 columns")


def test_builder_step_shape_rules() -> None:
    builder = make_backend().builder
    expect_invalid("num_decodes", lambda: builder.build(step(num_decodes=3)), "must be in")
    expect_invalid("num_decode_tokens", lambda: builder.build(step(num_decode_tokens=2)), "own 3 tokens")
    expect_invalid("num_decode_tokens", lambda: builder.build(step(num_decode_tokens=9)), "exceeds")


def test_backend_context_workspace_smaller_than_a_block_per_request() -> None:
    expect_invalid(
        "context_chunk_tokens", lambda: make_backend(context_chunk_tokens=16), "one block per chunk"
    )


def test_backend_head_count_no_strategy_accepts() -> None:
    with pytest.raises(UnsupportedError, match="130 heads"):
        mla.MLABackend(
            mla.MLADims(130, RANK, ROPE, softmax_scale=(128 + ROPE) ** -0.5),
            mla.KVCacheSpec(16, torch.bfloat16),
            mla.EngineLimits(4, 64, 64),
            provider=emulated_provider("aiter", "gfx942"),
            platform="gfx942",
        )


def test_backend_forced_strategy_that_does_not_fit() -> None:
    # max_decode_qlen 2: the engine may send verify steps, which GluonDecode cannot run.
    with pytest.raises(UnsupportedError, match="decode qlen 2") as info:
        make_backend(decode_strategy=mla.GluonDecode)
    assert info.value.explanation is not None
    assert info.value.explanation.forced == "gluon-decode"


def _poisoned(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.full(shape, math.nan, dtype=dtype)


def _cache(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(8, 16, RANK + ROPE).to(dtype)


@pytest.mark.parametrize(
    ("argument", "change"),
    [
        ("q", {"q": torch.randn(4, 4, RANK + ROPE)}),
        ("q", {"q": torch.randn(3, 4, RANK + ROPE).to(torch.bfloat16)}),
        ("kv_cache", {"kv_cache": _cache(torch.bfloat16)}),
        ("kv_cache", {"kv_cache": _cache()[..., :-1]}),
        ("kv_cache", {"kv_cache": _cache().to(META)}),
        ("out", {"out": _poisoned(3, 4, RANK - 1)}),
        ("out", {"out": _poisoned(3, 4, RANK, dtype=torch.bfloat16)}),
        ("lse", {"lse": _poisoned(3, 3)}),
    ],
    ids=lambda x: x if isinstance(x, str) else "-".join(f"{k}" for k in x),
)
def test_impl_decode_rejects_and_writes_nothing(argument: str, change: dict[str, torch.Tensor]) -> None:
    backend = make_backend()
    metadata = backend.builder.build(step())
    args: dict[str, Any] = {
        "q": torch.randn(3, 4, RANK + ROPE),
        "kv_cache": _cache(),
        "out": _poisoned(3, 4, RANK),
        "lse": _poisoned(3, 4),
    }
    args.update(change)
    expect_invalid(argument, lambda: backend.impl.forward_decode(metadata, **args))
    for name in ("out", "lse"):
        if args[name].device.type != "meta":
            assert torch.isnan(args[name]).all(), f"{name} was written by a rejected call"


def test_impl_decode_fp8_cache_needs_kv_scale_and_writes_nothing() -> None:
    backend = make_backend(cache=mla.KVCacheSpec(16, torch.float8_e4m3fn, num_blocks=8))
    metadata = backend.builder.build(step())
    out, lse = _poisoned(3, 4, RANK), _poisoned(3, 4)
    cache = _cache(torch.float8_e4m3fn)
    q = torch.randn(3, 4, RANK + ROPE)
    expect_invalid("kv_scale", lambda: backend.impl.forward_decode(metadata, q, cache, out=out, lse=lse))
    assert torch.isnan(out).all()
    assert torch.isnan(lse).all()
    backend.impl.forward_decode(metadata, q, cache, out=out, lse=lse, kv_scale=0.5)
    assert not torch.isnan(out).any()


def test_impl_without_a_decode_phase() -> None:
    backend = make_backend()
    prefill_only = backend.builder.build(step(num_decodes=0, num_decode_tokens=0))
    expect_invalid(
        "metadata",
        lambda: backend.impl.forward_decode(
            prefill_only, torch.randn(3, 4, RANK + ROPE), _cache(), out=_poisoned(3, 4, RANK)
        ),
        "no decode requests",
    )
    decode_only = backend.builder.build(step())
    q = torch.randn(3, 4, 48)
    expect_invalid(
        "metadata",
        lambda: backend.impl.forward_prefill(decode_only, q, q, q[..., :24], out=_poisoned(3, 4, 24)),
        "no prefill requests",
    )


CONTEXT_CASE = PrefillCase(
    heads=4, q_lens=(2, 1), context_lens=(18, 36), qk_nope_dim=32, rope_dim=16, v_dim=24, kv_lora_rank=RANK
)
"""The step of ``_prefill_step`` (its up-projection is the ``expand_context`` callback)."""


def _prefill_step(cache_dtype: torch.dtype) -> tuple[mla.MLABackend, mla.MLAMetadata]:
    backend = make_backend(cache=mla.KVCacheSpec(16, cache_dtype, num_blocks=8))
    # Two prefill requests with cached context (seq_len > query length).
    metadata = backend.builder.build(step(num_decodes=0, num_decode_tokens=0))
    assert metadata.prefill is not None
    assert metadata.prefill.context_chunks
    return backend, metadata


@pytest.mark.parametrize(
    ("argument", "change"),
    [
        ("q", {"q": torch.randn(4, 4, 48)}),
        ("k", {"k": torch.randn(3, 4, 47)}),
        ("v", {"v": torch.randn(2, 4, 24)}),
        ("out", {"out": _poisoned(3, 4, 23)}),
        ("lse", {"lse": _poisoned(3, 5)}),
        ("expand_context", {"expand_context": None}),
        ("expand_context", {"kv_cache": None}),
    ],
    ids=lambda x: x if isinstance(x, str) else "-".join(f"{k}" for k in x),
)
def test_impl_prefill_rejects_and_writes_nothing(argument: str, change: dict[str, Any]) -> None:
    backend, metadata = _prefill_step(torch.float32)
    expand = make_prefill_inputs(CONTEXT_CASE).context.expand
    args: dict[str, Any] = {
        "q": torch.randn(3, 4, 48),
        "k": torch.randn(3, 4, 48),
        "v": torch.randn(3, 4, 24),
        "out": _poisoned(3, 4, 24),
        "lse": _poisoned(3, 4),
        "kv_cache": _cache(),
        "expand_context": expand,
    }
    args.update(change)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    expect_invalid(argument, lambda: backend.impl.forward_prefill(metadata, q, k, v, **args))
    assert torch.isnan(args["out"]).all()
    assert torch.isnan(args["lse"]).all()


def test_impl_prefill_fp8_context_needs_kv_scale_and_writes_nothing() -> None:
    backend, metadata = _prefill_step(torch.float8_e4m3fn)
    expand = make_prefill_inputs(CONTEXT_CASE).context.expand
    q, k, v = torch.randn(3, 4, 48), torch.randn(3, 4, 48), torch.randn(3, 4, 24)
    out, lse = _poisoned(3, 4, 24), _poisoned(3, 4)
    cache = _cache(torch.float8_e4m3fn)
    expect_invalid(
        "kv_scale",
        lambda: backend.impl.forward_prefill(
            metadata, q, k, v, out=out, lse=lse, kv_cache=cache, expand_context=expand
        ),
    )
    assert torch.isnan(out).all()
    assert torch.isnan(lse).all()


# -- every entry point, every class of bad input ---------------------------------------------------
#
# Each row is (entry point, the argument the error must name, the bad call). The calls run on a
# provider that records every kernel it is asked for: a rejected call must launch none, and must
# raise InvalidInputError or UnsupportedError (never a raw Python or torch exception).


class RecordingProvider(TorchProvider):
    """The torch reference kernels, recording each kernel call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def paged_mqa_decode(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append("paged_mqa_decode")
        super().paged_mqa_decode(*args, **kwargs)

    def small_head_decode(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append("small_head_decode")
        super().small_head_decode(*args, **kwargs)

    def varlen_attention(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append("varlen_attention")
        super().varlen_attention(*args, **kwargs)

    def write_kv(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append("write_kv")
        super().write_kv(*args, **kwargs)


class UnavailableProvider(TorchProvider):
    """A provider whose library or device is missing here (like Triton without a GPU)."""

    name = "nodevice"

    def availability(self) -> Support:
        return Support.no("no-device", "no CUDA/ROCm device is visible")


FP8 = torch.float8_e4m3fn
FP8_CASE = attrs.evolve(DECODE_CASE, kv_dtype=FP8)


def fp8_decode(**changes: Any) -> Callable[[], object]:
    inputs = make_decode_inputs(FP8_CASE)
    return decode(**{"kv_cache": inputs.kv_cache, "kv_scale": FP8_CASE.kv_scale, **changes})


SCALE_VALUES = [
    pytest.param(None, id="None"),
    pytest.param(math.nan, id="nan"),
    pytest.param(math.inf, id="inf"),
    pytest.param(0.0, id="zero"),
    pytest.param(-0.1, id="negative"),
    pytest.param("0.1", id="str"),
    pytest.param(True, id="bool"),
    pytest.param(torch.tensor(0.1), id="tensor"),
]


@pytest.mark.parametrize("value", SCALE_VALUES)
def test_softmax_scale_is_required_finite_and_positive(value: object) -> None:
    provider = RecordingProvider()
    error = expect_invalid("softmax_scale", decode(softmax_scale=value, provider=provider))
    assert "192**-0.5" in str(error)  # the message says what to pass
    expect_invalid("softmax_scale", prefill(softmax_scale=value, provider=provider))
    assert provider.calls == []


@pytest.mark.parametrize("value", [v for v in SCALE_VALUES if v.id not in ("None", "tensor")])
def test_kv_scale_of_an_fp8_cache_must_be_finite_and_positive(value: object) -> None:
    provider = RecordingProvider()
    expect_invalid("kv_scale", fp8_decode(kv_scale=value, provider=provider))
    assert provider.calls == []


@pytest.mark.parametrize("value", [0.64, 1.0, torch.tensor([0.5])], ids=["0.64", "1.0", "tensor"])
def test_kv_scale_with_a_float_cache_is_refused(value: object) -> None:
    provider = RecordingProvider()
    error = expect_invalid("kv_scale", decode(kv_scale=value, provider=provider), "only fp8")
    assert "kv_scale=None" in str(error)
    assert provider.calls == []


def test_kv_scale_as_a_one_element_tensor_is_accepted() -> None:
    out, _ = fp8_decode(kv_scale=torch.tensor([FP8_CASE.kv_scale]))()  # type: ignore[misc]
    reference, _ = fp8_decode()()  # type: ignore[misc]
    assert torch.equal(out, reference)


def _decode_rows_beyond_requests() -> dict[str, Any]:
    q = decode_args()["q"]
    return {"q": torch.cat([q, q[:2]])}


def _prefill_short(name: str) -> dict[str, Any]:
    args = prefill_args()
    cu = args[name].clone()
    return {
        name: cu[:-1],
        "cu_seqlens_k" if name == "cu_seqlens_q" else "cu_seqlens_q": args[
            "cu_seqlens_k" if name == "cu_seqlens_q" else "cu_seqlens_q"
        ][:-1],
    }


FUNCTIONAL_CASES = [
    # mla_decode
    ("decode", "q", lambda p: decode(q=decode_args()["q"].tolist(), provider=p), "torch.Tensor"),
    ("decode", "query_start_loc", lambda p: decode(provider=p, **_decode_rows_beyond_requests()), "5 rows"),
    ("decode", "kv_lora_rank", lambda p: decode(kv_lora_rank="64", provider=p), "an int"),
    ("decode", "kv_lora_rank", lambda p: decode(kv_lora_rank=64.0, provider=p), "an int"),
    ("decode", "provider", lambda p: decode(provider=3), "KernelProvider"),
    ("decode", "platform", lambda p: decode(platform="banana", provider=p), "unknown arch"),
    ("decode", "platform", lambda p: decode(platform=9, provider=p), "arch name"),
    ("decode", "lse", lambda p: decode(provider=p, lse=torch.empty(3, 4, device=META)), "move it to cpu"),
    (
        "decode",
        "kv_scale",
        lambda p: fp8_decode(provider=p, kv_scale=torch.tensor([1], dtype=torch.int32)),
        "a float tensor",
    ),
    (
        "decode",
        "kv_scale",
        lambda p: fp8_decode(provider=p, kv_scale=torch.tensor([1.0], device=META)),
        "keep it on cpu",
    ),
    (
        "decode",
        "kv_scale",
        lambda p: fp8_decode(provider=p, kv_scale=torch.tensor([1.0, 2.0])),
        "one-element tensor",
    ),
    # mla_prefill
    (
        "prefill",
        "cu_seqlens_q",
        lambda p: prefill(provider=p, **_prefill_short("cu_seqlens_q")),
        "q has 8 rows",
    ),
    (
        "prefill",
        "cu_seqlens_k",
        lambda p: prefill(provider=p, cu_seqlens_k=torch.tensor([0, 3, 11])),
        "k has 12",
    ),
    ("prefill", "max_seqlen_q", lambda p: prefill(provider=p, max_seqlen_q="5"), "an int"),
    ("prefill", "causal", lambda p: prefill(provider=p, causal="yes"), "True or False"),
    (
        "prefill",
        "cu_seqlens_q",
        lambda p: prefill(provider=p, cu_seqlens_q=torch.zeros(0, dtype=torch.int32)),
        "empty",
    ),
]


@pytest.mark.parametrize(
    ("entry", "argument", "make", "match"),
    FUNCTIONAL_CASES,
    ids=[f"{e}-{a}-{m.split()[-1]}" for e, a, _, m in FUNCTIONAL_CASES],
)
def test_functional_api_rejects(entry: str, argument: str, make: Any, match: str) -> None:
    provider = RecordingProvider()
    expect_invalid(argument, make(provider), match)
    assert provider.calls == []


@pytest.mark.parametrize("entry", ["decode", "prefill"])
def test_an_unavailable_provider_says_so_first(entry: str) -> None:
    call = decode if entry == "decode" else prefill
    with pytest.raises(mla.ProviderUnavailableError, match=r"^provider: 'nodevice' cannot run here") as info:
        call(provider=UnavailableProvider())()
    assert isinstance(info.value, UnsupportedError)
    assert "speculative" not in str(info.value)


@pytest.mark.parametrize(
    ("force", "message"),
    [
        ("nope", "unknown strategy 'nope'"),
        ("flash-varlen", "'flash-varlen' is a prefill strategy"),
        (mla.FlashVarlen, "'flash-varlen' is a prefill strategy"),
        (3, "expected a strategy NAME, class name or class"),
    ],
    ids=["unknown", "other-phase-name", "other-phase-class", "not-a-strategy"],
)
def test_functional_forced_strategy_is_checked(force: object, message: str) -> None:
    with pytest.raises(UnsupportedError, match=rf"^strategy: {message}"):
        decode(strategy=force)()


def test_a_strategy_class_name_is_an_alias_of_its_name() -> None:
    args = decode_args(q=decode_args()["q"][:2], query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32))
    by_name = mla.mla_decode(**{**args, "strategy": "asm-padded-persistent"})
    by_class_name = mla.mla_decode(**{**args, "strategy": "PaddedAsmPersistent"})
    assert torch.equal(by_name[0], by_class_name[0])
    backend = make_backend(decode_strategy="AsmNonPersistent", prefill_strategy="FlashVarlen")
    assert backend.force_decode is mla.AsmNonPersistent
    assert backend.force_prefill is mla.FlashVarlen
    with mla.override(decode=["GluonDecode"]):
        assert mla.DEFAULT_REGISTRY.names(mla.Phase.DECODE) == ("gluon-decode",)


# -- write_kv ------------------------------------------------------------------------------------


def write_args(**changes: Any) -> dict[str, Any]:
    args: dict[str, Any] = {
        "kv_c": torch.randn(3, RANK),
        "k_pe": torch.randn(3, ROPE),
        "kv_cache": torch.zeros(4, 16, RANK + ROPE),
        "slot_mapping": torch.tensor([5, -1, 63], dtype=torch.int64),
        "platform": "cpu",
    }
    args.update(changes)
    return args


def test_write_kv_skips_slots_outside_the_cache_in_fast_mode() -> None:
    """With validate="fast" (no read back), a slot past the cache is skipped: no write outside
    the cache, no raw IndexError."""
    args = write_args(slot_mapping=torch.tensor([5, 64, 1 << 40]), validate="fast")
    mla.write_kv(**args)
    flat = args["kv_cache"].view(-1, RANK + ROPE)
    assert torch.equal(flat[5], torch.cat([args["kv_c"][0], args["k_pe"][0]]))
    assert int((flat.abs().sum(-1) > 0).sum()) == 1


def test_write_kv_writes_valid_rows_and_skips_negative_slots() -> None:
    provider = RecordingProvider()
    args = write_args(provider=provider)
    mla.write_kv(**args)
    flat = args["kv_cache"].view(-1, RANK + ROPE)
    assert torch.equal(flat[5], torch.cat([args["kv_c"][0], args["k_pe"][0]]))
    assert torch.equal(flat[63], torch.cat([args["kv_c"][2], args["k_pe"][2]]))
    assert int((flat.abs().sum(-1) > 0).sum()) == 2
    assert provider.calls == ["write_kv"]


WRITE_CASES = [
    (
        "slot_mapping",
        {"slot_mapping": torch.tensor([5, -1, 64]), "validate": "full"},
        "outside the cache's 64",
    ),
    ("slot_mapping", {"slot_mapping": torch.tensor([5.0, -1.0, 6.0])}, "int32 or int64"),
    ("slot_mapping", {"slot_mapping": torch.tensor([5, 5, 6]), "validate": "full"}, "more than one token"),
    ("slot_mapping", {"slot_mapping": torch.tensor([5, 6])}, "2 entries for 3 new rows"),
    ("kv_scale", {"kv_cache": torch.zeros(4, 16, RANK + ROPE).to(FP8)}, "needs kv_scale"),
    ("kv_scale", {"kv_scale": 0.5}, "only fp8"),
    ("kv_scale", {"kv_cache": torch.zeros(4, 16, RANK + ROPE).to(FP8), "kv_scale": math.nan}, "finite"),
    ("k_pe", {"k_pe": torch.randn(2, ROPE)}, "2 rows but kv_c has 3"),
    ("kv_cache", {"kv_c": torch.randn(3, RANK - 1)}, "must be the kv_c \\+ k_pe widths"),
    ("kv_c", {"kv_c": torch.randn(3, RANK).to(torch.int32)}, "expected one of"),
    ("kv_c", {"kv_c": torch.randn(3, RANK).to(META)}, "is on meta"),
    ("kv_cache", {"kv_cache": [[0.0]]}, "torch.Tensor"),
]


@pytest.mark.parametrize(
    ("argument", "change", "match"), WRITE_CASES, ids=[f"{a}-{m.split()[-1]}" for a, _, m in WRITE_CASES]
)
def test_write_kv_rejects(argument: str, change: dict[str, Any], match: str) -> None:
    provider = RecordingProvider()
    args = write_args(provider=provider, **change)
    cache = args["kv_cache"]
    before = cache.clone() if isinstance(cache, torch.Tensor) and cache.device.type == "cpu" else None
    expect_invalid(argument, lambda: mla.write_kv(**args), match)
    assert provider.calls == []
    if before is not None:
        assert torch.equal(cache.view(torch.uint8), before.view(torch.uint8))


# -- configuration records and the backend ---------------------------------------------------------


RECORD_CASES = [
    ("num_heads", lambda: mla.MLADims("16")),
    ("num_heads", lambda: mla.MLADims(True)),
    ("softmax_scale", lambda: mla.MLADims(16, softmax_scale=math.nan)),
    ("softmax_scale", lambda: mla.MLADims(16, softmax_scale=-1.0)),
    ("softmax_scale", lambda: mla.MLADims(16, softmax_scale="0.07")),
    ("softmax_scale", lambda: mla.MLADims(16, softmax_scale=None)),
    ("softmax_scale", lambda: mla.MLADims(16)),
    ("block_size", lambda: mla.KVCacheSpec(16.0)),
    ("num_blocks", lambda: mla.KVCacheSpec(16, num_blocks=0)),
    ("kv_cache_dtype", lambda: mla.KVCacheSpec(16, dtype=3)),
    ("max_decode_qlen", lambda: mla.EngineLimits(4, 64, 64, max_decode_qlen="2")),
    ("graph_mode", lambda: mla.EngineLimits(4, 64, 64, graph_mode="always")),
]


@pytest.mark.parametrize(
    ("argument", "make"), RECORD_CASES, ids=[f"{a}-{i}" for i, (a, _) in enumerate(RECORD_CASES)]
)
def test_configuration_records_reject(argument: str, make: Callable[[], object]) -> None:
    expect_invalid(argument, make)


def test_mla_dims_has_no_default_softmax_scale() -> None:
    """No silent ``1/sqrt(qk_head_dim)``: a missing scale is an error that says how to compute it."""
    error = expect_invalid("softmax_scale", lambda: mla.MLADims(16, 512, 64, 128, 128))
    assert "required" in str(error)
    assert "deepseek_softmax_scale" in str(error)
    assert mla.MLADims(16, softmax_scale=0.1).scale == 0.1


BACKEND_CASES = [
    ("dims", {"dims": (4, RANK, ROPE)}, "mla.MLADims"),
    ("cache", {"cache": 16}, "mla.KVCacheSpec"),
    ("model_dtype", {"model_dtype": torch.int32}, "not a supported"),
    ("model_dtype", {"model_dtype": "fp8"}, "not a model dtype"),
    ("validate", {"validate": "paranoid"}, "expected 'fast' or 'full'"),
    ("platform", {"platform": "sm_9"}, "unknown arch"),
    ("device", {"device": 3}, "torch.device"),
    ("device", {"device": "gpu0"}, "not a torch device"),
    ("provider", {"provider": 3}, "KernelProvider"),
    ("context_chunk_tokens", {"context_chunk_tokens": "4096"}, "an int"),
    ("resolver", {"resolver": object()}, "an mla.Resolver"),
]


@pytest.mark.parametrize(
    ("argument", "change", "match"), BACKEND_CASES, ids=[f"{a}-{m.split()[-1]}" for a, _, m in BACKEND_CASES]
)
def test_backend_rejects(argument: str, change: dict[str, Any], match: str) -> None:
    options: dict[str, Any] = {
        "dims": mla.MLADims(4, RANK, ROPE, 32, 24, softmax_scale=(32 + ROPE) ** -0.5),
        "cache": mla.KVCacheSpec(16, torch.float32, num_blocks=8),
        "limits": mla.EngineLimits(4, 64, 64),
        "model_dtype": torch.float32,
        "provider": "torch",
        "platform": "cpu",
    }
    options.update(change)
    dims, cache, limits = options.pop("dims"), options.pop("cache"), options.pop("limits")
    expect_invalid(argument, lambda: mla.MLABackend(dims, cache, limits, **options), match)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"decode_strategy": "nope"}, "decode_strategy: unknown strategy 'nope'"),
        ({"prefill_strategy": "gluon-decode"}, "prefill_strategy: 'gluon-decode' is a decode strategy"),
        ({"decode_strategy": mla.FlashVarlen}, "decode_strategy: 'flash-varlen' is a prefill strategy"),
        ({"provider": UnavailableProvider()}, "provider: 'nodevice' cannot run here: [no-device]"),
    ],
    ids=["unknown-name", "prefill-for-decode", "class-of-other-phase", "unavailable-provider"],
)
def test_backend_errors_lead_with_their_cause(change: dict[str, Any], message: str) -> None:
    with pytest.raises(UnsupportedError) as info:
        make_backend(**change)
    text = str(info.value)
    assert text.startswith(message), text
    assert "speculative token count" not in text


def test_backend_qlen_error_names_the_speculative_limit_only_when_qlen_is_the_cause() -> None:
    # 8 heads on gfx942 run every qlen; past kernel qlen 4 only non-persistent: forcing the
    # persistent one fails at qlen 5 and says how to stay within what it runs.
    with pytest.raises(UnsupportedError, match=r"allow decode qlen 5 .*\(max_decode_qlen <= 4\)"):
        mla.MLABackend(
            mla.MLADims(8, RANK, ROPE, 32, 24, softmax_scale=(32 + ROPE) ** -0.5),
            mla.KVCacheSpec(16, torch.bfloat16),
            mla.EngineLimits(4, 64, 64, max_decode_qlen=5),
            provider=emulated_provider("aiter", "gfx942"),
            platform="gfx942",
            decode_strategy="PaddedAsmPersistent",
        )


# -- the builder -------------------------------------------------------------------------------------

BUILDER_CASES = [
    ("step", lambda: {"step": {"num_decodes": 2}}, "mla.StepInputs"),
    ("num_decodes", lambda: {"num_decodes": "2"}, "an int"),
    ("num_decodes", lambda: {"num_decodes": True}, "an int"),
    ("num_decode_tokens", lambda: {"num_decode_tokens": 3.0}, "an int"),
    ("query_start_loc", lambda: {"query_start_loc": [0, 2, 3]}, "torch.Tensor"),
    ("seq_lens", lambda: {"seq_lens": torch.tensor([20, 37]).to(META)}, "backend runs on cpu"),
    ("seq_lens", lambda: {"seq_lens": torch.tensor([20, 37, 5])}, "has 3 entries"),
    ("query_start_loc", lambda: {"query_start_loc": torch.tensor([0, 2])}, "2 entries"),
    ("seq_lens_cpu", lambda: {"seq_lens_cpu": torch.tensor([20.0, 37.0])}, "int32 or int64"),
    # Beyond the limits the backend was sized for (4 requests, qlen 2, 64 tokens, length 64).
    ("query_start_loc", lambda: {"qsl": torch.tensor([0, 3, 4])}, "max_decode_qlen 2"),
    (
        "query_start_loc",
        lambda: {"qsl": torch.tensor([0, 10, 11]), "seq_lens": torch.tensor([10, 37])},
        "a prefill placed before the decodes",
    ),
    (
        "query_start_loc",
        lambda: {
            "qsl": torch.tensor([0, 1, 65]),
            "seq_lens": torch.tensor([20, 64]),
            "num_decodes": 1,
            "num_decode_tokens": 1,
            "block_table": torch.arange(8, dtype=torch.int32).view(2, 4) % 8,
        },
        "max_num_batched_tokens 64",
    ),
]


@pytest.mark.parametrize(
    ("argument", "change", "match"),
    BUILDER_CASES,
    ids=[f"{a}-{i}" for i, (a, _, _) in enumerate(BUILDER_CASES)],
)
def test_builder_rejects(argument: str, change: Callable[[], dict[str, Any]], match: str) -> None:
    backend = make_backend()
    values = change()
    built = values.pop("step") if "step" in values else step(**values)
    expect_invalid(argument, lambda: backend.builder.build(built), match)
    # After a valid step (the builder's one-expression check has seen good inputs) too.
    backend.builder.build(step())
    expect_invalid(argument, lambda: backend.builder.build(built), match)
    assert backend.late_allocations == []


def test_builder_full_validation_cross_checks_host_and_device() -> None:
    cheap, full = make_backend(), make_backend(validate="full")
    stale_qsl = step(query_start_loc=torch.tensor([0, 1, 3], dtype=torch.int32))
    stale_lens = step(seq_lens_cpu=torch.tensor([20, 36]))
    for bad, argument in ((stale_qsl, "query_start_loc"), (stale_lens, "seq_lens")):
        cheap.builder.build(bad)  # the default reads the host copies only
        expect_invalid(argument, lambda bad=bad: full.builder.build(bad), "differs from")
    full.builder.build(step(seq_lens_cpu=torch.tensor([20, 37])))


# -- the impl --------------------------------------------------------------------------------------


def test_impl_decode_refuses_a_cache_smaller_than_the_spec() -> None:
    backend = make_backend()  # KVCacheSpec.num_blocks = 8: block ids were trusted against it
    metadata = backend.builder.build(step())
    out = _poisoned(3, 4, RANK)
    q = torch.randn(3, 4, RANK + ROPE)
    expect_invalid(
        "kv_cache",
        lambda: backend.impl.forward_decode(metadata, q, _cache()[:6], out=out),
        "has 6 blocks but needs 8",
    )
    assert torch.isnan(out).all()


def test_impl_decode_refuses_a_cache_without_the_blocks_the_step_reads() -> None:
    # num_blocks unknown: under validate="full" the build records the blocks the step reads
    # (block 7 here) and the run refuses a cache without them.
    backend = make_backend(cache=mla.KVCacheSpec(16, torch.float32), validate="full")
    metadata = backend.builder.build(step())
    out, lse = _poisoned(3, 4, RANK), _poisoned(3, 4)
    q = torch.randn(3, 4, RANK + ROPE)
    error = expect_invalid(
        "kv_cache",
        lambda: backend.impl.forward_decode(metadata, q, _cache()[:6], out=out, lse=lse),
        "has 6 blocks",
    )
    assert "needs 8" in str(error)
    assert torch.isnan(out).all()
    backend.impl.forward_decode(metadata, q, _cache(), out=out, lse=lse)
    assert not torch.isnan(out).any()


IMPL_DECODE_CASES = [
    ("metadata", {"metadata": "step"}, "mla.MLAMetadata"),
    ("q", {"q": [[0.0]]}, "torch.Tensor"),
    ("kv_cache", {"kv_cache": torch.randn(4, 32, RANK + ROPE)}, "[num_blocks, 16, 80]"),
    ("kv_cache", {"kv_cache": torch.randn(8 * 16, RANK + ROPE)}, "[num_blocks, 16, 80]"),
    ("kv_scale", {"kv_scale": 0.5}, "only fp8"),
    ("out", {"out": None}, "torch.Tensor"),
]


@pytest.mark.parametrize(
    ("argument", "change", "match"),
    IMPL_DECODE_CASES,
    ids=[f"{a}-{i}" for i, (a, _, _) in enumerate(IMPL_DECODE_CASES)],
)
def test_impl_decode_rejects_more(argument: str, change: dict[str, Any], match: str) -> None:
    backend = make_backend()
    args: dict[str, Any] = {
        "metadata": backend.builder.build(step()),
        "q": torch.randn(3, 4, RANK + ROPE),
        "kv_cache": _cache(),
        "out": _poisoned(3, 4, RANK),
        "lse": _poisoned(3, 4),
    }
    args.update(change)
    expect_invalid(argument, lambda: backend.impl.forward_decode(**args), match)
    assert torch.isnan(args["lse"]).all()


@pytest.mark.parametrize("kv_scale", [0.0, -1.0, math.nan, "0.5"], ids=["zero", "negative", "nan", "str"])
def test_impl_decode_fp8_scale_must_be_finite_and_positive(kv_scale: object) -> None:
    backend = make_backend(cache=mla.KVCacheSpec(16, FP8, num_blocks=8))
    metadata = backend.builder.build(step())
    out = _poisoned(3, 4, RANK)
    q = torch.randn(3, 4, RANK + ROPE)
    expect_invalid(
        "kv_scale",
        lambda: backend.impl.forward_decode(metadata, q, _cache(FP8), out=out, kv_scale=kv_scale),  # type: ignore[arg-type]
    )
    assert torch.isnan(out).all()


IMPL_PREFILL_CASES = [
    ("kv_scale", {"kv_scale": 0.5}, "only fp8"),
    ("expand_context", {"expand_context": "up_project"}, "callable"),
    ("kv_cache", {"kv_cache": _cache()[:4]}, "has 4 blocks"),
    ("kv_cache", {"kv_cache": torch.randn(8, 8, RANK + ROPE)}, "[num_blocks, 16, 80]"),
    ("q", {"q": None}, "torch.Tensor"),
]


def test_impl_prefill_kv_scale_without_a_cache() -> None:
    backend = make_backend()
    metadata = backend.builder.build(step(seq_lens=torch.tensor([2, 1]), num_decodes=0, num_decode_tokens=0))
    q, out = torch.randn(3, 4, 48), _poisoned(3, 4, 24)
    expect_invalid(
        "kv_scale",
        lambda: backend.impl.forward_prefill(metadata, q, q, q[..., :24], out=out, kv_scale=0.5),
        "without a kv_cache",
    )
    assert torch.isnan(out).all()


@pytest.mark.parametrize(
    ("argument", "change", "match"),
    IMPL_PREFILL_CASES,
    ids=[f"{a}-{i}" for i, (a, _, _) in enumerate(IMPL_PREFILL_CASES)],
)
def test_impl_prefill_rejects_more(argument: str, change: dict[str, Any], match: str) -> None:
    backend, metadata = _prefill_step(torch.float32)
    args: dict[str, Any] = {
        "q": torch.randn(3, 4, 48),
        "k": torch.randn(3, 4, 48),
        "v": torch.randn(3, 4, 24),
        "out": _poisoned(3, 4, 24),
        "lse": _poisoned(3, 4),
        "kv_cache": _cache(),
        "expand_context": make_prefill_inputs(CONTEXT_CASE).context.expand,
    }
    args.update(change)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    expect_invalid(argument, lambda: backend.impl.forward_prefill(metadata, q, k, v, **args), match)
    assert torch.isnan(args["out"]).all()
