"""Kernel providers: lookup by name, lazy import, and the ``auto`` choice.

``torch`` is always importable. ``triton`` and ``aiter`` import their libraries only when asked,
so ``import mla`` works on any machine.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from mla.errors import ProviderUnavailableError
from mla.platform import Platform
from mla.providers.base import KernelProvider
from mla.providers.torch_ref import TorchProvider

PROVIDER_MODULES: dict[str, tuple[str, str]] = {
    "torch": ("mla.providers.torch_ref", "TorchProvider"),
    "triton": ("mla.providers.triton", "TritonProvider"),
    "aiter": ("mla.providers.aiter", "AiterProvider"),
}
"""Provider name -> (module, class), imported on first use."""

_INSTANCES: dict[str, KernelProvider] = {}


def provider_names() -> tuple[str, ...]:
    return tuple(PROVIDER_MODULES)


def get_provider(name: str) -> KernelProvider:
    """The provider called ``name`` (one shared instance per name).

    Raises :class:`ProviderUnavailableError` for an unknown name or a provider module that
    cannot be imported; an importable provider may still report reasons in ``availability()``.
    """
    if name in _INSTANCES:
        return _INSTANCES[name]
    if name not in PROVIDER_MODULES:
        raise ProviderUnavailableError(
            f"provider: unknown provider {name!r}; known: {', '.join(PROVIDER_MODULES)} or 'auto'"
        )
    module_name, class_name = PROVIDER_MODULES[name]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ProviderUnavailableError(f"provider: {name!r} cannot be imported here: {exc}") from exc
    factory: Callable[[], KernelProvider] = getattr(module, class_name)
    provider = factory()
    _INSTANCES[name] = provider
    return provider


def auto_provider(platform: Platform) -> KernelProvider:
    """The best provider for ``platform``: aiter on ROCm when available, Triton on a GPU when
    available, the torch reference otherwise."""
    order = []
    if platform.is_gpu:
        if platform.vendor == "amd":
            order.append("aiter")
        order.append("triton")
    for name in order:
        try:
            provider = get_provider(name)
        except ProviderUnavailableError:
            continue
        if provider.availability():
            return provider
    return get_provider("torch")


def resolve_provider(spec: str | KernelProvider, platform: Platform) -> KernelProvider:
    """``spec`` as a provider object: a provider, a name, or ``"auto"``."""
    if isinstance(spec, KernelProvider):
        return spec
    if spec == "auto":
        return auto_provider(platform)
    return get_provider(spec)


__all__ = [
    "PROVIDER_MODULES",
    "KernelProvider",
    "TorchProvider",
    "auto_provider",
    "get_provider",
    "provider_names",
    "resolve_provider",
]
