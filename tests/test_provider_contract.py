"""The provider contract: call records, undeclared contracts, and ``kv_scale`` as a device tensor.

A provider declares what it implements in its capability record and overrides exactly those
methods; every other contract method raises ``UnsupportedError`` naming the provider and the
contract. ``kv_scale`` reaches the kernels as a one-element device tensor that is read when the
kernel runs, so changing the tensor in place changes the next result (what a replayed CUDA graph
relies on).
"""

from __future__ import annotations

from typing import ClassVar

import attrs
import pytest
import torch

from mla import EngineLimits, KVCacheSpec, MLABackend, MLADims
from mla.core.capabilities import ALL_CONTRACTS, REFERENCE_CAPABILITIES, Contract, ProviderCapabilities
from mla.core.errors import InvalidInputError, UnsupportedError
from mla.core.platform import Platform, simulated_platform
from mla.core.support import Support
from mla.decode.asm_non_persistent import AsmNonPersistent
from mla.decode.asm_padded_persistent import PaddedAsmPersistent
from mla.decode.base import DecodeStrategy
from mla.decode.gluon import GluonDecode
from mla.providers import KernelProvider, emulated_provider, get_provider
from mla.providers.base import CONTRACT_METHODS
from mla.providers.quant import ScaleBuffer
from mla.testing import DecodeCase, compare_to_reference, make_decode_inputs

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


class MergeOnlyProvider(KernelProvider):
    """A provider that implements one contract and declares only that one."""

    name: ClassVar[str] = "merge-only"

    def availability(self) -> Support:
        return Support.yes()

    def capabilities(self, platform: Platform) -> ProviderCapabilities:
        return attrs.evolve(
            REFERENCE_CAPABILITIES, provider=self.name, contracts=frozenset({Contract.MERGE_STATES})
        )

    def merge_states(self, call: object) -> None:  # type: ignore[override]
        raise AssertionError("not called in these tests")


def test_every_contract_has_its_methods() -> None:
    assert set(CONTRACT_METHODS) == set(ALL_CONTRACTS)
    methods = [m for names in CONTRACT_METHODS.values() for m in names]
    assert len(methods) == len(set(methods))
    assert all(callable(getattr(KernelProvider, m)) for m in methods)


@pytest.mark.parametrize(
    ("contract", "method"),
    [(c, m) for c, names in CONTRACT_METHODS.items() for m in names if c != Contract.MERGE_STATES],
    ids=lambda x: getattr(x, "value", x),
)
def test_an_undeclared_contract_raises_unsupported_naming_it(contract: Contract, method: str) -> None:
    provider = MergeOnlyProvider()
    with pytest.raises(UnsupportedError) as info:
        getattr(provider, method)(object())
    message = str(info.value)
    assert "'merge-only'" in message
    assert contract.value in message
    assert method in message


def test_a_provider_needs_only_availability_and_capabilities() -> None:
    class Incomplete(KernelProvider):
        name: ClassVar[str] = "incomplete"

        def availability(self) -> Support:
            return Support.yes()

    with pytest.raises(TypeError, match="capabilities"):
        Incomplete()  # type: ignore[abstract]
    MergeOnlyProvider()  # no contract method is abstract


@pytest.mark.parametrize("name", ["torch", "triton"])
def test_builtin_providers_override_every_declared_contract(name: str) -> None:
    if name == "triton":
        pytest.importorskip("triton")
    provider = get_provider(name)
    caps = provider.capabilities(simulated_platform("cpu"))
    for contract in caps.contracts:
        for method in CONTRACT_METHODS[contract]:
            assert getattr(type(provider), method) is not getattr(KernelProvider, method), (
                f"{name} declares {contract.value} but does not implement {method}"
            )


# -- the kv_scale buffer ----------------------------------------------------------------------


def test_scale_buffer_turns_a_float_into_its_device_buffer() -> None:
    scales = ScaleBuffer.allocate(torch.device("cpu"))
    assert scales.tensor(None) is None
    first = scales.tensor(0.5)
    assert first is scales.buffer
    assert first.dtype == torch.float32
    assert first.shape == (1,)
    assert float(first) == 0.5
    assert scales.tensor(0.25) is scales.buffer
    assert float(scales.buffer) == 0.25


def test_scale_buffer_passes_a_device_tensor_through_and_copies_others() -> None:
    scales = ScaleBuffer.allocate(torch.device("cpu"))
    own = torch.tensor(0.75)  # 0-dim float32 on the buffer's device: used as is
    got = scales.tensor(own)
    assert got is not None
    assert got.data_ptr() == own.data_ptr()
    assert got.shape == (1,)
    other = torch.tensor([0.125], dtype=torch.float64)  # another dtype: copied into the buffer
    assert scales.tensor(other) is scales.buffer
    assert float(scales.buffer) == 0.125
    # A float equal to the one written before is written again after a tensor was copied in.
    scales.tensor(0.5)
    scales.tensor(torch.tensor([0.3], dtype=torch.float64))
    scales.tensor(0.5)
    assert float(scales.buffer) == 0.5


@pytest.mark.parametrize("bad", [torch.ones(2), torch.ones(1, dtype=torch.int32)], ids=["two", "int"])
def test_scale_buffer_rejects_a_tensor_that_is_not_one_float(bad: torch.Tensor) -> None:
    with pytest.raises(InvalidInputError, match="kv_scale"):
        ScaleBuffer.allocate(torch.device("cpu")).tensor(bad)


# -- kv_scale read on the device, end to end --------------------------------------------------

FP8_CASE = DecodeCase(
    heads=4,
    qlens=(1, 1, 1),
    seq_lens=(40, 3, 17),
    block_size=16,
    q_dtype=torch.float16,
    kv_dtype=torch.float8_e4m3fn,
    kv_lora_rank=32,
    rope_dim=16,
)
PROVIDERS = {
    "torch": ("cpu", lambda: get_provider("torch")),
    "aiter-emulated": ("gfx950", lambda: emulated_provider("aiter", "gfx950")),
    "triton": ("cpu" if DEVICE.type == "cpu" else "sm90", lambda: get_provider("triton")),
}


def _backend(
    case: DecodeCase, strategy: type[DecodeStrategy], provider: KernelProvider, arch: str, blocks: int
) -> MLABackend:
    return MLABackend(
        MLADims(
            num_heads=case.heads,
            kv_lora_rank=case.kv_lora_rank,
            qk_rope_head_dim=case.rope_dim,
            softmax_scale=case.scale,
        ),
        KVCacheSpec(case.block_size, case.kv_dtype, num_blocks=blocks),
        EngineLimits(
            max_num_seqs=case.num_requests,
            max_model_len=max(case.seq_lens),
            max_num_batched_tokens=case.num_tokens,
            max_decode_qlen=1,
        ),
        model_dtype=case.q_dtype,
        provider=provider,
        platform=arch,
        device=DEVICE,
        decode_strategy=strategy,
        preallocate=False,
    )


@pytest.mark.parametrize(
    ("provider_name", "strategy"),
    [
        pytest.param(p, s, id=f"{p}-{s.NAME}", marks=[pytest.mark.interpret] if p == "triton" else [])
        for p in PROVIDERS
        for s in (GluonDecode, PaddedAsmPersistent, AsmNonPersistent)
        if not (p == "aiter-emulated" and s is GluonDecode)  # aiter's Gluon kernel takes no fp8 cache
    ],
)
def test_a_device_kv_scale_is_read_when_the_kernel_runs(
    provider_name: str, strategy: type[DecodeStrategy]
) -> None:
    arch, make_provider = PROVIDERS[provider_name]
    if provider_name == "triton":
        pytest.importorskip("triton")
    case = FP8_CASE
    if provider_name == "aiter-emulated":
        case = attrs.evolve(case, q_dtype=torch.bfloat16)
    inputs = make_decode_inputs(case, DEVICE)
    assert inputs.kv_scale is not None
    backend = _backend(case, strategy, make_provider(), arch, inputs.kv_cache.shape[0])
    metadata = backend.builder.build(inputs.step())
    assert metadata.decode is not None
    assert metadata.decode.strategy == strategy.NAME
    reference = inputs.reference()

    scale = torch.full((1,), 4 * inputs.kv_scale, device=DEVICE)  # wrong until filled below
    wrong, wrong_lse = inputs.poisoned_outputs()
    backend.impl.forward_decode(metadata, inputs.q, inputs.kv_cache, out=wrong, lse=wrong_lse, kv_scale=scale)
    assert not compare_to_reference(wrong, wrong_lse, *reference).ok

    scale.fill_(inputs.kv_scale)  # in place: same tensor, new value
    out, lse = inputs.poisoned_outputs()
    backend.impl.forward_decode(metadata, inputs.q, inputs.kv_cache, out=out, lse=lse, kv_scale=scale)
    comparison = compare_to_reference(out, lse, *reference)
    assert comparison.ok, comparison

    from_float, from_float_lse = inputs.poisoned_outputs()
    backend.impl.forward_decode(
        metadata, inputs.q, inputs.kv_cache, out=from_float, lse=from_float_lse, kv_scale=inputs.kv_scale
    )
    assert torch.equal(from_float, out)
    assert torch.equal(from_float_lse, lse)
