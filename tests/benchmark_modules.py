"""Import a module of ``benchmarks/`` in the tests.

The benchmark scripts are not a package: each puts its own folder on ``sys.path`` and imports
its siblings by name (``_common``, ``decode``, ``gluon_compile``). Tests that check their pure
parts (the what-if edits, the GPU-state sampler) load them the same way, with that folder on the
path while the module runs its imports.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
"""The repository's ``benchmarks/`` folder."""


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as a module named ``name`` (its siblings importable meanwhile)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
        assert spec is not None
        assert spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCHMARKS))
