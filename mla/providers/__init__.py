"""Kernel providers: lookup by name, lazy import, and the ``auto`` choice.

``torch`` is always importable. ``triton`` and ``aiter`` import their libraries only when asked,
so ``import mla`` works on any machine.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from mla.core.capabilities import ProviderCapabilities
from mla.core.errors import InvalidInputError, ProviderUnavailableError
from mla.core.platform import Platform, simulated_platform
from mla.providers.aiter.capabilities import with_native_h24
from mla.providers.base import KernelProvider
from mla.providers.torch_ref import TorchProvider

PROVIDER_MODULES: dict[str, tuple[str, str]] = {
    "torch": ("mla.providers.torch_ref", "TorchProvider"),
    "triton": ("mla.providers.triton", "TritonProvider"),
    "gluon": ("mla.providers.gluon", "GluonProvider"),
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


def auto_order(platform: Platform) -> tuple[str, ...]:
    """Providers ``auto`` tries on ``platform``, best first: aiter on ROCm, gluon on NVIDIA
    Hopper (sm90), triton on any GPU; the torch reference comes after all of them."""
    order: list[str] = []
    if platform.is_gpu:
        if platform.vendor == "amd":
            order.append("aiter")
        if platform.arch == "sm90":
            order.append("gluon")
        order.append("triton")
    return tuple(order)


def auto_provider(platform: Platform) -> KernelProvider:
    """The first available provider of :func:`auto_order`, the torch reference otherwise."""
    order = auto_order(platform)
    for name in order:
        try:
            provider = get_provider(name)
        except ProviderUnavailableError:
            continue
        if provider.availability():
            return provider
    return get_provider("torch")


def resolve_provider(spec: str | KernelProvider, platform: Platform) -> KernelProvider:
    """``spec`` as a provider object: a provider, a name, or ``"auto"``.

    An unknown name raises :class:`ProviderUnavailableError`; anything else that is not a name
    or a provider raises :class:`InvalidInputError` naming ``provider``."""
    if isinstance(spec, KernelProvider):
        return spec
    if not isinstance(spec, str):
        raise InvalidInputError(
            "provider",
            f"expected 'auto', a provider name ({', '.join(PROVIDER_MODULES)}) or a KernelProvider, "
            f"got {type(spec).__name__}",
        )
    if spec == "auto":
        return auto_provider(platform)
    return get_provider(spec)


def require_available(provider: KernelProvider) -> None:
    """Raise :class:`ProviderUnavailableError` with every reason when ``provider`` cannot run
    here (library or device missing)."""
    availability = provider.availability()
    if not availability:
        raise ProviderUnavailableError(
            f"provider: {provider.name!r} cannot run here: {availability}; pass provider='auto' "
            "(the best provider that runs here) or another provider"
        )


def emulation_capabilities(
    name: str, platform: Platform, *, native_h24: bool = False
) -> ProviderCapabilities:
    """The capability record that emulating provider ``name`` imposes on the torch provider.

    The provider's :meth:`~KernelProvider.static_capabilities` for ``platform`` where it has one
    (aiter: its kernels as shipped; no ROCm needed, the same on every machine), else the record
    the provider reports. ``native_h24`` assumes aiter's native-H24 reducer and planner
    (:func:`~mla.providers.aiter.capabilities.with_native_h24`).
    """
    provider = get_provider(name)
    caps = type(provider).static_capabilities(platform) or provider.capabilities(platform)
    return with_native_h24(caps, platform.arch) if native_h24 else caps


def emulated_provider(name: str, platform: Platform | str, *, native_h24: bool = False) -> TorchProvider:
    """The torch reference kernels under provider ``name``'s capability record.

    With ``"aiter"`` its head granularity, qlen limits and kernel-table gaps trigger the
    padding, verify-flattening and persistent-schedule paths on a CPU. ``"torch"`` is the plain
    reference provider. ``platform`` may be an arch name (simulated).
    """
    if name == "torch" and not native_h24:
        return TorchProvider()
    plat = simulated_platform(platform) if isinstance(platform, str) else platform
    return TorchProvider(emulation_capabilities(name, plat, native_h24=native_h24))


__all__ = [
    "PROVIDER_MODULES",
    "KernelProvider",
    "TorchProvider",
    "auto_order",
    "auto_provider",
    "emulated_provider",
    "emulation_capabilities",
    "get_provider",
    "provider_names",
    "require_available",
    "resolve_provider",
]
