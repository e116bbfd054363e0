"""``mla info``: the platform, each kernel provider as the CLI sees it (availability, capability
record, probes) and the strategies of each phase, as JSON-ready payload and text."""

from __future__ import annotations

import importlib
import json
import textwrap
from typing import IO, Any

import attrs
import torch

import mla
from mla.core.capabilities import ProviderCapabilities
from mla.core.errors import ProviderUnavailableError
from mla.core.platform import Platform, detect_platform
from mla.core.support import Support
from mla.engine.decision.registry import DEFAULT_REGISTRY, Registry
from mla.providers import (
    PROVIDER_MODULES,
    auto_provider,
    emulation_capabilities,
    get_provider,
    provider_names,
)
from mla.providers.aiter.capabilities import with_native_h24
from mla.providers.base import KernelProvider
from mla.providers.torch_ref import TorchProvider
from mla.strategy import Phase


def _json_default(value: object) -> str:
    return str(value).removeprefix("torch.")


def dump_json(payload: object, out: IO[str]) -> None:
    out.write(json.dumps(payload, indent=2, default=_json_default) + "\n")


def reasons_json(support: Support) -> list[dict[str, str]]:
    return [{"code": r.code, "message": r.message} for r in support.reasons]


def _unavailable(exc: Exception) -> Support:
    message = str(exc) if isinstance(exc, ProviderUnavailableError) else f"{type(exc).__name__}: {exc}"
    return Support.no("provider-unavailable", message)


# -- providers as the CLI sees them -----------------------------------------------------------


@attrs.frozen(eq=False)
class ProviderView:
    """A provider for ``info``/``explain``: the object when it imports, its availability here,
    and its capability record on the platform in question."""

    name: str
    provider: KernelProvider | None
    """``None`` when the provider module cannot be imported here."""
    availability: Support
    capabilities: ProviderCapabilities | None
    """``None`` when the record cannot be known here."""
    emulated_by: str | None = None
    """``"torch"`` when the torch reference kernels run under this provider's record."""


def provider_view(
    name: str, platform: Platform, *, native_h24: bool = False, static_fallback: bool = True
) -> ProviderView:
    """Look ``name`` up without failing: a provider that cannot be imported or probed here is
    shown with the error as its availability reason.

    When the provider cannot give its record and ``static_fallback`` is set, its capabilities
    fall back to its :meth:`~mla.providers.base.KernelProvider.static_capabilities` for
    ``platform`` (aiter's as shipped). ``native_h24`` assumes aiter's native-H24 reducer and
    planner (:func:`mla.providers.aiter.capabilities.with_native_h24`).
    """
    provider: KernelProvider | None = None
    caps: ProviderCapabilities | None = None
    # Diagnostics must not die on a half-installed provider: any failure becomes a reason.
    try:
        provider = get_provider(name)
        availability = provider.availability()
    except Exception as exc:
        provider, availability = None, _unavailable(exc)
    if provider is not None:
        try:
            caps = provider.capabilities(platform)
        except Exception as exc:
            availability += Support.no("capabilities-failed", f"{type(exc).__name__}: {exc}")
    if caps is None and static_fallback:
        caps = static_capabilities(name, provider, platform)
    if caps is not None and native_h24:
        caps = with_native_h24(caps, platform.arch)
    return ProviderView(name, provider, availability, caps)


def static_capabilities(
    name: str, provider: KernelProvider | None, platform: Platform
) -> ProviderCapabilities | None:
    """The provider's static record, from its class when it could not be built here."""
    if provider is not None:
        return type(provider).static_capabilities(platform)
    module_name, class_name = PROVIDER_MODULES[name]
    try:
        cls: type[KernelProvider] = getattr(importlib.import_module(module_name), class_name)
    except Exception:  # the module itself does not import here: nothing is known
        return None
    return cls.static_capabilities(platform)


def emulated_view(name: str, platform: Platform, *, native_h24: bool = False) -> ProviderView:
    """The torch reference provider under ``name``'s capability record (always available; see
    :func:`mla.providers.emulation_capabilities`)."""
    try:
        caps = emulation_capabilities(name, platform, native_h24=native_h24)
    except Exception as exc:
        raise ProviderUnavailableError(
            f"emulate: the capability record of {name!r} is not known here ({exc}); "
            "emulate 'aiter', or install the provider's library"
        ) from exc
    return ProviderView(name, TorchProvider(capabilities=caps), Support.yes(), caps, emulated_by="torch")


# -- mla info --------------------------------------------------------------------------------


def _platform_json(platform: Platform) -> dict[str, Any]:
    return {
        "vendor": platform.vendor,
        "arch": platform.arch,
        "num_compute_units": platform.num_compute_units,
        "device_type": platform.device_type,
        "knobs": attrs.asdict(platform.knobs),
    }


def _strategies_json(registry: Registry) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for phase in Phase:
        rows = []
        for reg in registry.entries(phase):
            cls = reg.strategy
            paragraph = (cls.__doc__ or "").strip().split("\n\n")[0]
            rows.append(
                {
                    "name": cls.NAME,
                    "class": f"{cls.__module__}.{cls.__qualname__}",
                    "priority": reg.priority,
                    "kind": cls.KIND.value,
                    "requires": sorted(c.value for c in cls.REQUIRES),
                    "graph_support": cls.GRAPH_SUPPORT.value,
                    "summary": " ".join(paragraph.split()),
                }
            )
        out[phase.value] = rows
    return out


def _provider_json(view: ProviderView) -> dict[str, Any]:
    probes: dict[str, object] = {}
    if view.provider is not None:
        try:
            probes = view.provider.describe_probes()
        except Exception as exc:  # a diagnostic listing shows a failing probe instead of dying
            probes = {"error": f"{type(exc).__name__}: {exc}"}
    return {
        "name": view.name,
        "available": bool(view.availability),
        "reasons": reasons_json(view.availability),
        "capabilities": view.capabilities.describe() if view.capabilities is not None else None,
        "probes": probes,
    }


def info_payload(platform: Platform | None = None) -> dict[str, Any]:
    """What ``mla info --json`` prints (a JSON-ready dict)."""
    platform = platform or detect_platform()
    providers = []
    for name in provider_names():
        view = provider_view(name, platform, static_fallback=platform.vendor == "amd")
        providers.append(_provider_json(view))
    return {
        "version": mla.__version__,
        "torch": torch.__version__,
        "platform": _platform_json(platform),
        "auto_provider": auto_provider(platform).name,
        "providers": providers,
        "strategies": _strategies_json(DEFAULT_REGISTRY),
    }


def _format_value(value: object) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(_format_value(v) for v in value) + "]"
    return _json_default(value)


def render_info(payload: dict[str, Any]) -> str:
    plat = payload["platform"]
    knobs = ", ".join(f"{k}={v}" for k, v in plat["knobs"].items())
    lines = [
        f"mla {payload['version']} (torch {payload['torch']})",
        f"platform: {plat['arch']} ({plat['vendor']}, {plat['num_compute_units']} compute units, "
        f"device {plat['device_type']}); knobs: {knobs}",
        f"provider='auto' picks here: {payload['auto_provider']}",
        "",
        "providers:",
    ]
    for prov in payload["providers"]:
        lines.append(f"  {prov['name']}: {'available' if prov['available'] else 'unavailable'}")
        lines += [f"      - [{r['code']}] {r['message']}" for r in prov["reasons"]]
        caps = prov["capabilities"]
        if caps is None:
            lines.append("    capabilities: unknown here")
        else:
            lines.append(f"    capabilities on {plat['arch']}:")
            lines += [
                f"      {key}: {_format_value(value)}" for key, value in caps.items() if key != "provider"
            ]
        probes = prov["probes"]
        if probes:
            lines.append("    probes:")
            lines += [f"      {key}: {_format_value(value)}" for key, value in probes.items()]
    lines += ["", "strategies in priority order (preference rules reorder per case; see `mla explain`):"]
    for phase, rows in payload["strategies"].items():
        lines.append(f"  {phase}:")
        for row in rows:
            lines.append(
                f"    {row['priority']:>4}  {row['name']:<24} kind={row['kind']:<12} "
                f"graph={row['graph_support']:<14} requires={','.join(row['requires'])}"
            )
            lines += textwrap.wrap(
                row["summary"], width=100, initial_indent=" " * 10, subsequent_indent=" " * 10
            )
    return "\n".join(lines)
