"""The routes through the engine (docs/index.md, "Routes"): the Python call chain from
``MLAAttention.forward`` to the provider's decode kernel call, and the fp8 ``kv_scale`` checked
once, converted once and owned by the backend alone."""

from __future__ import annotations

import inspect
import pathlib
from typing import Any

import pytest
import torch

import mla
from mla.core import validate
from mla.engine.backend import scale as scale_module
from mla.engine.backend.scale import KVScale
from mla.layers import MLAAttention

PACKAGE = pathlib.Path(mla.__file__).resolve().parent
RANK, ROPE, NOPE, VDIM, HEADS, BLOCK = 32, 16, 16, 16, 4, 4
FP8 = torch.float8_e4m3fn


def _backend(strategy: str) -> mla.MLABackend:
    return mla.MLABackend(
        mla.MLADims(HEADS, RANK, ROPE, NOPE, VDIM, softmax_scale=(NOPE + ROPE) ** -0.5),
        mla.KVCacheSpec(BLOCK, FP8, num_blocks=8),
        mla.EngineLimits(max_num_seqs=2, max_model_len=16, max_num_batched_tokens=8),
        model_dtype=torch.float32,
        provider="torch",
        platform="cpu",
        decode_strategy=strategy,
    )


def _decode_step(backend: mla.MLABackend) -> mla.MLAMetadata:
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32)
    seq = torch.tensor([5, 9], dtype=torch.int32)
    table = torch.arange(8, dtype=torch.int32).view(2, 4)
    return backend.builder.build(mla.StepInputs(qsl, qsl, seq, table, 2, 2, seq))


def _mla_frames() -> list[str]:
    """The ``mla`` functions on the caller's stack, outermost first."""
    names = []
    for frame in reversed(inspect.stack()[2:]):
        path = pathlib.Path(frame.filename).resolve()
        if PACKAGE in path.parents:
            names.append(f"{path.relative_to(PACKAGE).as_posix()}:{frame.function}")
    return names


@pytest.mark.parametrize(
    ("strategy", "method", "launch"),
    [
        ("asm-non-persistent", "paged_mqa_decode", "decode/_paged.py:launch"),
        ("gluon-decode", "small_head_decode", "decode/_small_head.py:launch"),
    ],
)
def test_kv_scale_is_checked_once_converted_once_and_owned_by_the_backend(
    strategy: str, method: str, launch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MLAAttention.forward -> impl.forward_decode -> mla::decode's body -> run -> launch ->
    the provider: five hops to the provider's decode call; the one check and conversion of
    ``kv_scale`` happen at the impl (the backend's :class:`KVScale`), and the provider gets the
    backend's buffer."""
    backend = _backend(strategy)
    metadata = _decode_step(backend)
    layer = MLAAttention(backend, torch.randn(HEADS * (NOPE + VDIM), RANK))
    checks: list[object] = []
    conversions: list[object] = []
    seen: dict[str, Any] = {}

    real_check, real_convert = validate.check_cache_scale, KVScale.convert

    def check(value: object, *args: Any, **kwargs: Any) -> None:
        checks.append(value)
        real_check(value, *args, **kwargs)

    def convert(self: KVScale, value: Any) -> torch.Tensor | None:
        conversions.append(value)
        return real_convert(self, value)

    provider_call = getattr(backend.provider, method)

    def recorded(call: Any) -> None:
        seen["frames"] = _mla_frames()
        seen["kv_scale"] = call.kv_scale
        provider_call(call)

    monkeypatch.setattr(scale_module, "check_cache_scale", check)
    monkeypatch.setattr(KVScale, "convert", convert)
    monkeypatch.setattr(backend.provider, method, recorded)
    gen = torch.Generator().manual_seed(0)
    cache = (torch.randn(8, BLOCK, RANK + ROPE, generator=gen) * 4).to(FP8)
    q_nope = torch.randn(2, HEADS, NOPE, generator=gen)
    q_pe = torch.randn(2, HEADS, ROPE, generator=gen)
    kv_c, k_pe = torch.randn(2, RANK, generator=gen), torch.randn(2, ROPE, generator=gen)
    checks.clear()
    backend.impl.forward_decode(
        metadata, layer.absorb_query(q_nope, q_pe), cache, out=torch.empty(2, HEADS, RANK), kv_scale=0.25
    )
    assert checks == [0.25]
    assert conversions == [0.25]
    assert seen["kv_scale"] is backend.kv_scale.buffer
    assert float(seen["kv_scale"]) == 0.25
    decode_route = seen["frames"]
    assert decode_route[-3:] == ["engine/backend/ops.py:decode_body", "decode/base.py:run", launch]
    # Through the layer: the write is its own route (one check, in check_kv_write), the decode
    # route is the one above below MLAAttention.forward.
    checks.clear()
    conversions.clear()
    slots = torch.tensor([4, 4 * 2 + 8], dtype=torch.int64)
    layer(metadata, q_nope, q_pe, kv_c, k_pe, cache, slot_mapping=slots, kv_scale=0.25)
    route = seen["frames"][seen["frames"].index("layers.py:forward") :]
    assert route == ["layers.py:forward", "engine/backend/impl.py:forward_decode", *decode_route[-3:]]
    assert conversions == [0.25, 0.25]  # write_kv's route and forward_decode's, once each
    # Strategies own no scale buffer: the backend's KVScale is the only one.
    for owned in backend.decode_strategies.values():
        assert not any(isinstance(value, KVScale) for value in vars(owned).values())
        assert not hasattr(owned, "kv_scale_buffer")


def test_a_device_kv_scale_tensor_reaches_the_provider_as_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    """A float32 one-element tensor on the device is not copied: a captured graph reads it."""
    backend = _backend("asm-non-persistent")
    metadata = _decode_step(backend)
    seen: dict[str, Any] = {}
    provider_call = backend.provider.paged_mqa_decode

    def recorded(call: Any) -> None:
        seen["kv_scale"] = call.kv_scale
        provider_call(call)

    monkeypatch.setattr(backend.provider, "paged_mqa_decode", recorded)
    scale = torch.tensor([0.5])
    cache = torch.randn(8, BLOCK, RANK + ROPE).to(FP8)
    backend.impl.forward_decode(
        metadata, torch.randn(2, HEADS, RANK + ROPE), cache, out=torch.empty(2, HEADS, RANK), kv_scale=scale
    )
    assert seen["kv_scale"].data_ptr() == scale.data_ptr()


def test_mla_decode_and_mla_prefill_take_the_same_route(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both functional calls: their door, a cached backend's builder, then the strategy's
    ``run`` and ``launch`` (no strategy is called around the engine pair)."""
    from mla.providers.torch_ref import TorchProvider

    routes: dict[str, list[str]] = {}
    plans: list[str] = []
    for method in ("paged_mqa_decode", "small_head_decode", "varlen_attention"):
        real = getattr(TorchProvider, method)

        def recorded(self: Any, call: Any, _real: Any = real, _method: str = method) -> None:
            routes[_method] = _mla_frames()
            _real(self, call)

        monkeypatch.setattr(TorchProvider, method, recorded)
    for name in ("plan", "plan_varlen"):
        real_plan = getattr(mla.MetadataBuilder, name)

        def planned(self: Any, step: Any, _real: Any = real_plan, _name: str = name) -> Any:
            plans.append(_name)
            return _real(self, step)

        monkeypatch.setattr(mla.MetadataBuilder, name, planned)
    gen = torch.Generator().manual_seed(1)
    cache = torch.randn(8, BLOCK, RANK + ROPE, generator=gen)
    table = torch.arange(8, dtype=torch.int32).view(2, 4)
    mla.mla_decode(
        torch.randn(2, HEADS, RANK + ROPE, generator=gen),
        cache,
        table,
        torch.tensor([5, 9], dtype=torch.int32),
        softmax_scale=0.1,
        kv_lora_rank=RANK,
        provider="torch",
        graph="off",
    )
    qk, v = torch.randn(6, HEADS, NOPE + ROPE, generator=gen), torch.randn(6, HEADS, VDIM, generator=gen)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    mla.mla_prefill(qk, qk.clone(), v, cu, cu, 4, 4, softmax_scale=0.1, provider="torch")
    assert plans == ["plan", "plan_varlen"]
    (decode_method,) = {"paged_mqa_decode", "small_head_decode"} & set(routes)
    decode, prefill = routes[decode_method], routes["varlen_attention"]
    assert decode[decode.index("engine/functional/decode.py:mla_decode") :][:3] == [
        "engine/functional/decode.py:mla_decode",
        "engine/functional/decode.py:_decode",
        "engine/functional/decode_call.py:run_step",
    ]
    assert decode[-2] == "decode/base.py:run"
    assert prefill[prefill.index("engine/functional/prefill.py:mla_prefill") :] == [
        "engine/functional/prefill.py:mla_prefill",
        "engine/functional/prefill.py:_prefill",
        "prefill/base.py:run",
        "prefill/flash_varlen.py:launch",
    ]


def test_a_step_is_checked_once_by_the_one_step_checker(monkeypatch: pytest.MonkeyPatch) -> None:
    """``builder.build`` and ``mla_decode`` check their step with the step checker, once: the
    builder's ``plan`` and the strategies' ``run`` check nothing again."""
    from mla.engine.backend.step_check import StepChecker

    calls: list[int] = []
    real = StepChecker.check_values

    def counted(self: StepChecker, step: mla.StepInputs) -> Any:
        calls.append(step.num_decodes)
        return real(self, step)

    monkeypatch.setattr(StepChecker, "check_values", counted)
    backend = _backend("asm-non-persistent")
    _decode_step(backend)
    assert calls == [2]
    gen = torch.Generator().manual_seed(2)
    for mode in ("fast", "full"):
        calls.clear()
        mla.mla_decode(
            torch.randn(3, HEADS, RANK + ROPE, generator=gen),
            torch.randn(8, BLOCK, RANK + ROPE, generator=gen),
            torch.arange(8, dtype=torch.int32).view(2, 4),
            torch.tensor([5, 9], dtype=torch.int32),
            query_start_loc=torch.tensor([0, 1, 3]),
            softmax_scale=0.1,
            kv_lora_rank=RANK,
            provider="torch",
            validate=mode,
        )
        assert calls == [2]


@pytest.mark.parametrize("strategy", ["asm-non-persistent", "asm-padded-persistent", "gluon-verify-flatten"])
def test_the_block_table_reaches_the_decode_call_with_no_per_token_expansion(
    strategy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/index.md, "the block table": on a provider whose kernels read the block table,
    ``mla_decode``'s ``block_table`` reaches the provider's decode call as the caller's tensor;
    the build's one fill writes the indptr only (no per-token list), nothing expands pages."""
    from mla.providers.torch_ref import TorchProvider

    seen: dict[str, Any] = {}
    for method in ("paged_mqa_decode", "small_head_decode", "fill_page_indices", "expand_page_indices"):
        real = getattr(TorchProvider, method)

        def recorded(self: Any, call: Any, _real: Any = real, _method: str = method) -> None:
            seen[_method] = call
            _real(self, call)

        monkeypatch.setattr(TorchProvider, method, recorded)
    gen = torch.Generator().manual_seed(2)
    table = torch.arange(8, dtype=torch.int32).view(2, 4)
    qsl = torch.tensor([0, 2, 4], dtype=torch.int32)
    mla.mla_decode(
        torch.randn(4, HEADS, RANK + ROPE, generator=gen),
        torch.randn(8, BLOCK, RANK + ROPE, generator=gen),
        table,
        torch.tensor([5, 9], dtype=torch.int32),
        query_start_loc=qsl,
        softmax_scale=0.1,
        kv_lora_rank=RANK,
        provider="torch",
        strategy=strategy,
        graph="off",
    )
    assert "expand_page_indices" not in seen
    assert seen["fill_page_indices"].kv_indices is None
    call = seen["small_head_decode" if strategy == "gluon-verify-flatten" else "paged_mqa_decode"]
    assert call.block_table.data_ptr() == table.data_ptr()
    if strategy == "gluon-verify-flatten":
        assert call.page_table is None
        assert call.row_request.tolist() == [0, 0, 1, 1]  # the row map instead of a token list
        assert call.seq_info.tolist() == [0, 4, 9, 17, 26]  # windows 4, 5 (5 keys) and 8, 9 (9 keys)
    else:
        assert call.kv_indices is None
