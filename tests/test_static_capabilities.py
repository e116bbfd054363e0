"""``KernelProvider.static_capabilities``: a provider's record as shipped, known without its
library; the CLI and the emulation read it through the class, with no per-provider branch."""

from __future__ import annotations

import sys
import types
from typing import ClassVar

import attrs
import pytest

import mla.providers
import mla.providers.registry
from mla.core.capabilities import REFERENCE_CAPABILITIES, Contract, ProviderCapabilities
from mla.core.platform import Platform, simulated_platform
from mla.core.support import Support
from mla.providers import emulation_capabilities, get_provider
from mla.providers.aiter import AiterProvider
from mla.providers.aiter.capabilities import aiter_capabilities
from mla.providers.base import KernelProvider
from mla.tools import cli

SHIPPED = attrs.evolve(REFERENCE_CAPABILITIES, provider="fake", contracts=frozenset({Contract.PAGED_DECODE}))


class FakeProvider(KernelProvider):
    """A provider whose library is missing here: ``capabilities`` fails, the static record holds."""

    name: ClassVar[str] = "fake"

    def availability(self) -> Support:
        return Support.no("provider-unavailable", "fakelib is not installed")

    def capabilities(self, platform: Platform) -> ProviderCapabilities:
        raise RuntimeError("fakelib is not installed")

    @classmethod
    def static_capabilities(cls, platform: Platform) -> ProviderCapabilities:
        return attrs.evolve(SHIPPED, archs=frozenset({platform.arch}))


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """The provider registry as it is, restored after the test."""
    monkeypatch.setattr(mla.providers.registry, "_ENTRIES", dict(mla.providers.registry._ENTRIES))
    monkeypatch.setattr(mla.providers.registry, "_INSTANCES", dict(mla.providers.registry._INSTANCES))


@pytest.fixture
def fake_provider(monkeypatch: pytest.MonkeyPatch, registry: None) -> None:
    module = types.ModuleType("fake_mla_provider")
    module.FakeProvider = FakeProvider  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fake_mla_provider", module)
    mla.providers.register_provider("fake", "fake_mla_provider:FakeProvider")


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_aiter_static_record_needs_no_aiter(arch: str) -> None:
    platform = simulated_platform(arch)
    assert AiterProvider.static_capabilities(platform) == aiter_capabilities(arch)
    assert emulation_capabilities("aiter", platform) == aiter_capabilities(arch)


def test_providers_without_a_static_record_report_their_own() -> None:
    platform = simulated_platform("cpu")
    assert KernelProvider.static_capabilities(platform) is None
    assert emulation_capabilities("torch", platform) == get_provider("torch").capabilities(platform)


def test_cli_falls_back_to_any_providers_static_record(fake_provider: None) -> None:
    view = cli.provider_view("fake", simulated_platform("gfx950"))
    assert not view.availability
    assert "capabilities-failed" in view.availability.codes
    assert view.capabilities == attrs.evolve(SHIPPED, archs=frozenset({"gfx950"}))
    assert cli.provider_view("fake", simulated_platform("gfx950"), static_fallback=False).capabilities is None


def test_emulation_uses_the_static_record(fake_provider: None) -> None:
    caps = emulation_capabilities("fake", simulated_platform("gfx942"))
    assert caps.provider == "fake"
    assert caps.archs == frozenset({"gfx942"})


def test_a_provider_module_that_does_not_import_has_no_record(registry: None) -> None:
    mla.providers.register_provider("broken", "no_such_module_here:Nope")
    view = cli.provider_view("broken", simulated_platform("cpu"))
    assert view.provider is None
    assert view.capabilities is None
    assert not view.availability
