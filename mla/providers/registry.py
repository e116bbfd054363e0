"""Named kernel providers: registration, lookup by name, and the ``auto`` choice.

A named provider is one :class:`ProviderEntry`, made by :func:`register_provider`: the name,
where the provider comes from (``"module:Class"``, imported on first use, so ``import mla``
imports no kernel library; or a factory such as the provider class itself), and whether
``provider="auto"`` tries it on a platform, at which rank. Nothing else in the package lists the
providers: :func:`get_provider`, :func:`provider_names`, :func:`auto_order`, ``mla info`` and
the CLI's choices read the entries. ``docs/adding-a-provider.md`` walks through a registration.

The entries of the four shipped providers are registered at the bottom of this module. The
torch reference is always importable and is ``auto``'s fallback, so it has no ``auto`` rule.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping

import attrs

from mla.core.errors import InvalidInputError, ProviderUnavailableError
from mla.core.platform import Platform
from mla.providers.base import KernelProvider

ProviderFactory = Callable[[], KernelProvider]
"""Makes the provider (called once per name, on first use); a provider class is one."""


@attrs.frozen
class ProviderEntry:
    """One named provider (see the module docstring); made by :func:`register_provider`."""

    name: str
    target: str | ProviderFactory
    """``"package.module:ClassName"`` (imported on first use) or a factory."""
    auto: Callable[[Platform], bool] | None = None
    """The platforms ``provider="auto"`` tries it on (``None``: never; it is still used by name
    or as an object)."""
    rank: int = 50
    """``auto``'s order among the providers it tries on one platform: lower first, then the
    order of registration."""

    def factory(self) -> ProviderFactory:
        """The factory: a string target is imported here (``ImportError`` when it cannot be)."""
        if not isinstance(self.target, str):
            return self.target
        module_name, _, attr = self.target.partition(":")
        factory: ProviderFactory = getattr(importlib.import_module(module_name), attr)
        return factory

    def location(self) -> tuple[str, str]:
        """``(module, attribute)`` the provider comes from (a factory: its own module and name)."""
        if isinstance(self.target, str):
            module_name, _, attr = self.target.partition(":")
            return module_name, attr
        return self.target.__module__, getattr(self.target, "__qualname__", repr(self.target))


_ENTRIES: dict[str, ProviderEntry] = {}
_INSTANCES: dict[str, KernelProvider] = {}


def register_provider(
    name: str,
    target: str | ProviderFactory,
    *,
    auto: Callable[[Platform], bool] | None = None,
    rank: int = 50,
    replace: bool = False,
) -> ProviderEntry:
    """Make a provider known by ``name`` (see :class:`ProviderEntry` for ``target``, ``auto``
    and ``rank``) and return its entry.

    The shipped providers rank 10 (aiter on AMD GPUs, gluon on Hopper) and 20 (triton on any
    GPU). Raises :class:`InvalidInputError` naming the argument: ``name`` empty, ``"auto"`` or
    already registered (unless ``replace``: the new entry takes the name, and the next
    :func:`get_provider` makes a new instance), ``target`` neither ``"module:Class"`` nor
    callable, ``auto`` not callable, ``rank`` not an int.
    """
    if not isinstance(name, str) or not name or name == "auto":
        raise InvalidInputError(
            "name", f"a provider name is a non-empty string other than 'auto', got {name!r}"
        )
    if name in _ENTRIES and not replace:
        raise InvalidInputError(
            "name", f"a provider {name!r} is already registered; pass replace=True to replace it"
        )
    if isinstance(target, str):
        module_name, colon, attr = target.partition(":")
        if not (colon and module_name and attr):
            raise InvalidInputError("target", f"expected 'package.module:ClassName', got {target!r}")
    elif not callable(target):
        raise InvalidInputError(
            "target", f"expected 'module:Class' or a factory, got {type(target).__name__}"
        )
    if auto is not None and not callable(auto):
        raise InvalidInputError(
            "auto", f"expected a function of the platform or None, got {type(auto).__name__}"
        )
    if type(rank) is not int:
        raise InvalidInputError("rank", f"expected an int, got {rank!r}")
    entry = ProviderEntry(name=name, target=target, auto=auto, rank=rank)
    _ENTRIES.pop(name, None)  # a replacement moves to the end of the registration order
    _ENTRIES[name] = entry
    _INSTANCES.pop(name, None)
    return entry


def unregister_provider(name: str) -> ProviderEntry:
    """Forget provider ``name`` (and its instance); returns its entry. Raises
    :class:`InvalidInputError` naming ``name`` when no provider has that name."""
    if name not in _ENTRIES:
        raise InvalidInputError("name", f"no provider {name!r} is registered; known: {', '.join(_ENTRIES)}")
    _INSTANCES.pop(name, None)
    return _ENTRIES.pop(name)


def forget_instance(name: str) -> None:
    """Drop the shared instance of provider ``name`` (if one was made): the next
    :func:`get_provider` makes a new one, which probes its library again (after the library was
    installed or replaced, e.g. in tests)."""
    _INSTANCES.pop(name, None)


def provider_entries() -> tuple[ProviderEntry, ...]:
    """Every registered provider, in the order of registration."""
    return tuple(_ENTRIES.values())


def provider_names() -> tuple[str, ...]:
    """The registered names, in the order of registration (the torch reference first)."""
    return tuple(_ENTRIES)


class _Locations(Mapping[str, tuple[str, str]]):
    """A read-only view: provider name -> ``(module, attribute)`` it comes from."""

    def __getitem__(self, name: str) -> tuple[str, str]:
        return _ENTRIES[name].location()

    def __iter__(self) -> Iterator[str]:
        return iter(tuple(_ENTRIES))

    def __len__(self) -> int:
        return len(_ENTRIES)


PROVIDER_MODULES: Mapping[str, tuple[str, str]] = _Locations()
"""Provider name -> ``(module, attribute)`` of its provider, a read-only view of the registry
(register with :func:`register_provider`)."""


def get_provider(name: str) -> KernelProvider:
    """The provider called ``name`` (one shared instance per name, made on first use).

    Raises :class:`ProviderUnavailableError` for an unknown name or a provider module that
    cannot be imported; an importable provider may still report reasons in ``availability()``.
    """
    provider = _INSTANCES.get(name)
    if provider is not None:
        return provider
    entry = _ENTRIES.get(name)
    if entry is None:
        raise ProviderUnavailableError(
            f"provider: unknown provider {name!r}; known: {', '.join(_ENTRIES)} or 'auto'"
        )
    try:
        factory = entry.factory()
    except ImportError as exc:
        raise ProviderUnavailableError(f"provider: {name!r} cannot be imported here: {exc}") from exc
    provider = factory()
    if not isinstance(provider, KernelProvider):
        raise ProviderUnavailableError(
            f"provider: {name!r} made a {type(provider).__name__}, not a KernelProvider"
        )
    _INSTANCES[name] = provider
    return provider


def auto_order(platform: Platform) -> tuple[str, ...]:
    """The providers ``auto`` tries on ``platform``, best first: those whose ``auto`` rule takes
    the platform, by rank, then registration order (shipped: aiter on ROCm, gluon on NVIDIA
    Hopper (sm90), triton on any GPU). The torch reference comes after all of them."""
    tried = [
        (entry.rank, i, entry.name)
        for i, entry in enumerate(_ENTRIES.values())
        if entry.auto and entry.auto(platform)
    ]
    return tuple(name for _, _, name in sorted(tried))


def auto_provider(platform: Platform) -> KernelProvider:
    """The first available provider of :func:`auto_order`, the torch reference otherwise."""
    for name in auto_order(platform):
        try:
            provider = get_provider(name)
        except ProviderUnavailableError:
            continue
        if provider.availability():
            return provider
    return get_provider("torch")


def resolve_provider(spec: str | KernelProvider, platform: Platform) -> KernelProvider:
    """``spec`` as a provider object: a provider, a registered name, or ``"auto"``.

    An unknown name raises :class:`ProviderUnavailableError`; anything else that is not a name
    or a provider raises :class:`InvalidInputError` naming ``provider``."""
    if isinstance(spec, KernelProvider):
        return spec
    if not isinstance(spec, str):
        raise InvalidInputError(
            "provider",
            f"expected 'auto', a provider name ({', '.join(_ENTRIES)}) or a KernelProvider, "
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


def _on_amd_gpu(platform: Platform) -> bool:
    return platform.is_gpu and platform.vendor == "amd"


def _on_hopper(platform: Platform) -> bool:
    return platform.is_gpu and platform.arch == "sm90"


def _on_gpu(platform: Platform) -> bool:
    return platform.is_gpu


register_provider("torch", "mla.providers.torch_ref:TorchProvider")
register_provider("triton", "mla.providers.triton:TritonProvider", auto=_on_gpu, rank=20)
register_provider("gluon", "mla.providers.gluon:GluonProvider", auto=_on_hopper, rank=10)
register_provider("aiter", "mla.providers.aiter:AiterProvider", auto=_on_amd_gpu, rank=10)


__all__ = [
    "PROVIDER_MODULES",
    "ProviderEntry",
    "ProviderFactory",
    "auto_order",
    "auto_provider",
    "forget_instance",
    "get_provider",
    "provider_entries",
    "provider_names",
    "register_provider",
    "require_available",
    "resolve_provider",
    "unregister_provider",
]
