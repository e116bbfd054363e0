"""Fixtures that make a strict fake of AMD aiter (or the unrelated PyPI ``aiter``) importable.

The fake lives in ``fake/amd`` (and the stand-in in ``fake/pypi``); :func:`fake_aiter` copies one
into a temporary directory with its configuration, the ``amd-aiter`` distribution metadata and
the C++ sources the native-H24 probes read, puts it first on ``sys.path``, and on teardown
removes it, purges every ``aiter`` module from ``sys.modules`` and forgets the shared ``aiter``
provider instance. Nothing outside these tests can import it.
"""

from __future__ import annotations

import importlib
import json
import shutil
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import attrs
import pytest

import mla.providers

FAKE_ROOT = Path(__file__).parent / "fake"
H24_SOURCES = {
    "kernels/mla/reduce.cu": (
        "MLA_REDUCE_CASE_EF( NUM_HEAD, 24, HEAD_DIM, 512, float )",
        "MLA_REDUCE_CASE_EF(NUM_HEAD, 16",
    ),
    "kernels/mla/metadata/v1_2_device.cuh": (
        "if (num_heads == 24) { natively_supported = true; }",
        "num_heads == 16",
    ),
}
"""Per probed source: (text with the 24-head marker, text without it; whitespace varies)."""


def _purge_aiter_modules() -> None:
    for name in [n for n in sys.modules if n == "aiter" or n.startswith("aiter.")]:
        del sys.modules[name]
    importlib.invalidate_caches()


@attrs.frozen
class FakeAiter:
    """One installed fake: its directory and its call log (once imported)."""

    site: Path

    @property
    def state(self) -> ModuleType:
        return importlib.import_module("aiter._state")

    def calls(self, name: str) -> list[dict[str, Any]]:
        return list(self.state.calls(name))


FakeInstaller = Callable[..., FakeAiter]


@pytest.fixture
def fake_aiter(tmp_path: Path) -> Iterator[FakeInstaller]:
    """``install(arch="gfx950", **options) -> FakeAiter``; a later call replaces the earlier fake.

    Options: ``cu_num``, ``omit`` (public names aiter does not export), ``gluon_modules``
    (``"mla_gluon"``/``"mla_decode_gluon"`` files kept), ``decode_signature``,
    ``reduce_signature``, ``h24_reducer``/``h24_planner`` (sources carry the 24-head marker),
    ``distribution`` (the ``amd-aiter`` version, ``None`` for a source build), ``package``
    (``"amd"`` or ``"pypi"``: the unrelated async library, registered as distribution ``aiter``).
    """
    sites: list[Path] = []

    def install(
        arch: str | None = "gfx950",
        *,
        cu_num: int = 8,
        omit: Sequence[str] = (),
        gluon_modules: Sequence[str] = ("mla_gluon", "mla_decode_gluon"),
        decode_signature: str = "current",
        reduce_signature: str = "current",
        h24_reducer: bool = False,
        h24_planner: bool = False,
        distribution: str | None = "0.1.10",
        package: str = "amd",
    ) -> FakeAiter:
        for old in sites:
            if str(old) in sys.path:
                sys.path.remove(str(old))
        site = tmp_path / f"site{len(sites)}"
        sites.append(site)
        shutil.copytree(FAKE_ROOT / package, site)
        if package == "amd":
            csrc = site / "aiter_meta" / "csrc"
            for relative, (with_marker, without) in H24_SOURCES.items():
                marked = h24_reducer if relative.endswith("reduce.cu") else h24_planner
                path = csrc / relative
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(with_marker if marked else without)
            gluon_dir = site / "aiter" / "ops" / "triton" / "gluon"
            for module in ("mla_gluon", "mla_decode_gluon"):
                if module not in gluon_modules:
                    (gluon_dir / f"{module}.py").unlink()
            config = {
                "arch": arch,
                "cu_num": cu_num,
                "omit": list(omit),
                "decode_signature": decode_signature,
                "reduce_signature": reduce_signature,
                "native_h24_planner": h24_planner,
                "csrc_dir": str(csrc),
            }
            (site / "aiter" / "fake_config.json").write_text(json.dumps(config))
        dist_name = {"amd": "amd_aiter", "pypi": "aiter"}[package]
        version = distribution if package == "amd" else "0.13.20191203"
        if version is not None:
            meta = site / f"{dist_name}-{version}.dist-info"
            meta.mkdir()
            name = dist_name.replace("_", "-")
            (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        sys.path.insert(0, str(site))
        _purge_aiter_modules()
        mla.providers.forget_instance("aiter")
        return FakeAiter(site)

    yield install
    for site in sites:
        if str(site) in sys.path:
            sys.path.remove(str(site))
    _purge_aiter_modules()
    mla.providers.forget_instance("aiter")
