"""The provider registry (:mod:`mla.providers.registry`): a named provider is one registration,
``provider="auto" | name | KernelProvider`` resolve through it, and aiter's optional features
reach the emulation through the provider class, not through the registry."""

from __future__ import annotations

from typing import ClassVar

import attrs
import pytest
import torch
from test_layering import GRAPH

import mla
from mla.core.capabilities import REFERENCE_CAPABILITIES, ProviderCapabilities
from mla.core.errors import InvalidInputError, ProviderUnavailableError
from mla.core.platform import Platform, simulated_platform
from mla.providers import (
    PROVIDER_MODULES,
    TorchProvider,
    auto_order,
    auto_provider,
    emulated_provider,
    emulation_capabilities,
    get_provider,
    provider_names,
    register_provider,
    registry,
    resolve_provider,
    unregister_provider,
)
from mla.providers.aiter.capabilities import aiter_capabilities, with_native_h24

HOPPER, MI300, A100, CPU = (simulated_platform(a) for a in ("sm90", "gfx942", "sm80", "cpu"))


def _gpu(platform: Platform) -> Platform:
    return attrs.evolve(platform, device_type="cuda")


class Padded16(TorchProvider):
    """The torch kernels under a record that asks for multiples of 16 heads."""

    name: ClassVar[str] = "padded16"

    def capabilities(self, platform: Platform) -> ProviderCapabilities:
        return attrs.evolve(REFERENCE_CAPABILITIES, provider=self.name, head_granularity=16)


@pytest.fixture(autouse=True)
def _restore_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "_ENTRIES", dict(registry._ENTRIES))
    monkeypatch.setattr(registry, "_INSTANCES", dict(registry._INSTANCES))


def test_the_shipped_providers_and_their_auto_order() -> None:
    assert provider_names() == ("torch", "triton", "gluon", "aiter")
    assert auto_order(_gpu(HOPPER)) == ("gluon", "triton")
    assert auto_order(_gpu(MI300)) == ("aiter", "triton")
    assert auto_order(_gpu(A100)) == ("triton",)
    assert auto_order(CPU) == ()
    assert PROVIDER_MODULES["torch"] == ("mla.providers.torch_ref", "TorchProvider")
    assert list(PROVIDER_MODULES) == list(provider_names())


def test_a_registered_provider_is_used_by_name_and_by_auto() -> None:
    entry = register_provider("padded16", Padded16, auto=lambda p: p.arch == "cpu", rank=5)
    assert provider_names()[-1] == "padded16"
    assert PROVIDER_MODULES["padded16"] == (__name__, "Padded16")
    provider = get_provider("padded16")
    assert isinstance(provider, Padded16)
    assert get_provider("padded16") is provider  # one instance per name
    assert resolve_provider("padded16", CPU) is provider
    assert auto_order(CPU) == ("padded16",)
    assert auto_provider(CPU) is provider
    assert entry.auto is not None
    # A provider object is used as given, registered or not.
    other = Padded16()
    assert resolve_provider(other, CPU) is other


def test_auto_orders_by_rank_then_registration() -> None:
    register_provider("late", Padded16, auto=lambda p: p.is_gpu, rank=20)
    register_provider("first", Padded16, auto=lambda p: p.is_gpu, rank=1)
    assert auto_order(_gpu(HOPPER)) == ("first", "gluon", "triton", "late")


def test_auto_falls_back_to_torch_past_unavailable_providers() -> None:
    register_provider("missing", "no_such_module_here:Nope", auto=lambda p: True, rank=0)
    assert auto_order(CPU) == ("missing",)
    assert isinstance(auto_provider(CPU), TorchProvider)
    with pytest.raises(ProviderUnavailableError, match="cannot be imported"):
        get_provider("missing")


def test_a_functional_call_runs_on_a_registered_provider() -> None:
    register_provider("padded16", Padded16)
    torch.manual_seed(0)
    q = torch.randn(2, 8, 576)
    kv_cache = torch.randn(4, 16, 576)
    block_table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    seq_lens = torch.tensor([20, 9], dtype=torch.int32)
    out, lse = mla.mla_decode(q, kv_cache, block_table, seq_lens, softmax_scale=0.1, provider="padded16")
    ref, ref_lse = mla.mla_decode(q, kv_cache, block_table, seq_lens, softmax_scale=0.1, provider="torch")
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse, ref_lse)


def test_replace_and_unregister() -> None:
    register_provider("padded16", Padded16)
    first = get_provider("padded16")
    with pytest.raises(InvalidInputError, match=r"^name: .*already registered"):
        register_provider("padded16", Padded16)
    register_provider("padded16", Padded16, replace=True)
    assert get_provider("padded16") is not first  # a new entry makes a new instance
    assert unregister_provider("padded16").name == "padded16"
    assert "padded16" not in provider_names()
    with pytest.raises(ProviderUnavailableError, match="unknown provider 'padded16'"):
        get_provider("padded16")
    with pytest.raises(InvalidInputError, match=r"^name: "):
        unregister_provider("padded16")


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"name": "", "target": Padded16}, "name"),
        ({"name": "auto", "target": Padded16}, "name"),
        ({"name": "torch", "target": Padded16}, "name"),
        ({"name": "x", "target": "no_colon"}, "target"),
        ({"name": "x", "target": ":Cls"}, "target"),
        ({"name": "x", "target": 3}, "target"),
        ({"name": "x", "target": Padded16, "auto": True}, "auto"),
        ({"name": "x", "target": Padded16, "rank": 1.5}, "rank"),
    ],
)
def test_registration_errors_name_the_argument(kwargs: dict[str, object], argument: str) -> None:
    with pytest.raises(InvalidInputError) as caught:
        register_provider(**kwargs)  # type: ignore[arg-type]
    assert caught.value.argument == argument


def test_a_factory_must_make_a_provider() -> None:
    register_provider("not-a-provider", object)  # type: ignore[arg-type]
    with pytest.raises(ProviderUnavailableError, match="not a KernelProvider"):
        get_provider("not-a-provider")


def test_aiter_features_are_assumed_by_the_aiter_class() -> None:
    gfx950 = simulated_platform("gfx950")
    caps = emulation_capabilities("aiter", gfx950, native_h24=True)
    assert caps == with_native_h24(aiter_capabilities("gfx950"), "gfx950")
    assert 24 in caps.native_head_counts
    assert emulation_capabilities("aiter", gfx950, native_h24=False) == aiter_capabilities("gfx950")
    assert 24 in emulated_provider("aiter", "gfx950", native_h24=True).capabilities(gfx950).native_head_counts
    with pytest.raises(InvalidInputError, match=r"^assume: aiter has no optional feature wide_heads"):
        emulation_capabilities("aiter", gfx950, wide_heads=True)
    with pytest.raises(InvalidInputError, match=r"^assume: provider 'torch'"):
        emulation_capabilities("torch", gfx950, native_h24=True)


def test_the_generic_registry_imports_no_provider_wing() -> None:
    for module in ("mla.providers", "mla.providers.registry", "mla.providers.base"):
        wings = {m for m in GRAPH[module] if m.startswith(("mla.providers.aiter", "mla.providers.gluon"))}
        wings |= {m for m in GRAPH[module] if m.startswith("mla.providers.triton")}
        assert not wings, (module, wings)
