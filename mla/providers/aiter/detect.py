"""Finding AMD aiter: by its API and its distribution, never by the import name alone.

The PyPI name ``aiter`` belongs to an unrelated async-iterator library (richardkiss/aiter) that
also installs a top-level ``aiter`` package; AMD's library ships as the ``amd-aiter``
distribution or as a ROCm/aiter source build. Detection, like vLLM's:
``find_spec``, the ``amd-aiter`` distribution, a guarded import (aiter's import runs
``rocminfo`` and fails on a host without ROCm), then the API surface.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
from types import ModuleType

import attrs

from mla.core.support import Reason, Support

AMD_DISTRIBUTION = "amd-aiter"
"""AMD aiter's distribution name on PyPI (``pip install amd-aiter``)."""
UNRELATED_DISTRIBUTION = "aiter"
"""The unrelated PyPI async-iterator library that installs the same top-level package."""
UNRELATED_EXPORTS = ("azip", "join_aiters", "map_aiter")
"""Names the unrelated library exports (its signature when the API check fails)."""
INSTALL_HINT = (
    "install AMD aiter with `pip install amd-aiter` or build ROCm/aiter from source "
    "(never `pip install aiter`: that is an unrelated async library)"
)


@attrs.frozen(eq=False)
class AiterLibrary:
    """The outcome of looking for AMD aiter here."""

    module: ModuleType | None
    """The imported ``aiter`` package when it is AMD aiter, else ``None``."""
    support: Support
    """Empty when ``module`` is AMD aiter; otherwise why not."""
    location: str | None = None
    version: str | None = None
    """The ``amd-aiter`` distribution's version; ``None`` for a source build."""

    @property
    def available(self) -> bool:
        return self.module is not None

    def describe(self) -> str:
        if self.module is None:
            return f"not available: {self.support}"
        origin = f"amd-aiter {self.version}" if self.version else "source build (no amd-aiter distribution)"
        return f"{origin} at {self.location}"


def _unavailable(code: str, message: str, location: str | None = None) -> AiterLibrary:
    return AiterLibrary(None, Support((Reason(code, message),)), location)


def _distribution_version(name: str) -> str | None:
    try:
        return importlib.metadata.distribution(name).version
    except importlib.metadata.PackageNotFoundError:
        return None


def _api_gaps(module: ModuleType) -> list[str]:
    """The parts of AMD aiter's API that ``module`` lacks (empty: it is AMD aiter)."""
    gaps = [] if hasattr(module, "dtypes") else ["aiter.dtypes"]
    mla_module = getattr(module, "mla", None)
    if not isinstance(mla_module, ModuleType):
        try:
            mla_module = importlib.import_module("aiter.mla")
        except ImportError:
            mla_module = None
    if mla_module is None or not callable(getattr(mla_module, "mla_decode_fwd", None)):
        gaps.append("aiter.mla.mla_decode_fwd")
    return gaps


def detect_aiter() -> AiterLibrary:
    """Look for AMD aiter without letting any failure escape (each becomes a reason)."""
    try:
        spec = importlib.util.find_spec("aiter")
    except (ImportError, ValueError) as exc:
        return _unavailable("aiter-missing", f"looking up 'aiter' failed ({exc}); {INSTALL_HINT}")
    if spec is None:
        return _unavailable("aiter-missing", f"AMD aiter is not installed: {INSTALL_HINT}")
    if spec.origin is None:
        places = ", ".join(spec.submodule_search_locations or ())
        return _unavailable(
            "not-amd-aiter",
            f"'aiter' resolves only to the directory {places} without __init__.py (a namespace "
            "package, e.g. the root of a source checkout on sys.path), not AMD aiter; "
            f"{INSTALL_HINT}, or run from another directory",
            places,
        )
    location = spec.origin
    version = _distribution_version(AMD_DISTRIBUTION)
    try:
        module = importlib.import_module("aiter")
    except Exception as exc:  # aiter's import may raise anything (RuntimeError from rocminfo, KeyError)
        hint = (
            "aiter reads the GPU arch from `rocminfo` at import: install ROCm or set GPU_ARCHS=gfx942|gfx950"
            if "rocminfo" in str(exc)
            else "check the ROCm installation"
        )
        return _unavailable(
            "aiter-import-failed", f"`import aiter` failed: {type(exc).__name__}: {exc} ({hint})", location
        )
    gaps = _api_gaps(module)
    if not gaps:
        return AiterLibrary(module, Support.yes(), location, version)
    unrelated = _distribution_version(UNRELATED_DISTRIBUTION)
    if all(hasattr(module, name) for name in UNRELATED_EXPORTS) or unrelated is not None:
        exports = "it exports " + ", ".join(UNRELATED_EXPORTS)
        dist = f"distribution aiter {unrelated}" if unrelated else exports
        clash = (
            f" (amd-aiter {version} is installed too, and both install a top-level 'aiter' package: "
            "uninstall both, then reinstall amd-aiter)"
            if version
            else ""
        )
        message = (
            f"not AMD aiter: the importable 'aiter' at {location} is the unrelated PyPI "
            f"async-iterator library ({dist}), lacking {', '.join(gaps)}{clash}; "
            f"`pip uninstall aiter`, then {INSTALL_HINT}"
        )
    else:
        message = f"not AMD aiter: the 'aiter' package at {location} lacks {', '.join(gaps)}; {INSTALL_HINT}"
    return _unavailable("not-amd-aiter", message, location)
