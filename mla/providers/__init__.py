"""Kernel providers: the registry of named providers (:mod:`mla.providers.registry`: lookup by
name, lazy import, the ``auto`` choice, :func:`register_provider`) and the emulation of any
provider's capability record on the torch reference kernels.

``torch`` is always importable. ``triton``, ``gluon`` and ``aiter`` import their libraries only
when asked, so ``import mla`` works on any machine.
"""

from __future__ import annotations

from mla.core.capabilities import ProviderCapabilities
from mla.core.platform import Platform, simulated_platform
from mla.providers.base import KernelProvider
from mla.providers.registry import (
    PROVIDER_MODULES,
    ProviderEntry,
    auto_order,
    auto_provider,
    forget_instance,
    get_provider,
    provider_entries,
    provider_names,
    register_provider,
    require_available,
    resolve_provider,
    unregister_provider,
)
from mla.providers.torch_ref import TorchProvider


def emulation_capabilities(name: str, platform: Platform, **assume: bool) -> ProviderCapabilities:
    """The capability record that emulating provider ``name`` imposes on the torch provider.

    The provider's :meth:`~KernelProvider.static_capabilities` for ``platform`` where it has one
    (aiter: its kernels as shipped; no ROCm needed, the same on every machine), else the record
    the provider reports. ``assume`` names features to assume present, each ``feature=True``
    (``False`` assumes nothing), which the provider's :meth:`~KernelProvider.assume` applies
    (aiter: ``native_h24=True``, its native-H24 reducer and planner).
    """
    provider = get_provider(name)
    cls = type(provider)
    caps = cls.static_capabilities(platform) or provider.capabilities(platform)
    features = frozenset(feature for feature, on in assume.items() if on)
    return cls.assume(caps, platform, features) if features else caps


def emulated_provider(name: str, platform: Platform | str, **assume: bool) -> TorchProvider:
    """The torch reference kernels under provider ``name``'s capability record
    (:func:`emulation_capabilities`, with ``assume``).

    With ``"aiter"`` its head granularity, qlen limits and kernel-table gaps trigger the
    padding, verify-flattening and persistent-schedule paths on a CPU. ``"torch"`` is the plain
    reference provider. ``platform`` may be an arch name (simulated).
    """
    if name == "torch" and not any(assume.values()):
        return TorchProvider()
    plat = simulated_platform(platform) if isinstance(platform, str) else platform
    return TorchProvider(emulation_capabilities(name, plat, **assume))


__all__ = [
    "PROVIDER_MODULES",
    "KernelProvider",
    "ProviderEntry",
    "TorchProvider",
    "auto_order",
    "auto_provider",
    "emulated_provider",
    "emulation_capabilities",
    "forget_instance",
    "get_provider",
    "provider_entries",
    "provider_names",
    "register_provider",
    "require_available",
    "resolve_provider",
    "unregister_provider",
]
