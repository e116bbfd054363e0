"""``benchmarks/dual_whatif.py`` edits the dual-chain kernel's source: every edit must still apply.

The what-if benchmark times variants of ``mla/providers/gluon/dual.py`` made by replacing
exact snippets of its source. When the kernel changes, an edit whose snippet is gone would make
the variant time the unchanged kernel; the benchmark refuses that, and this test says so on the
CPU, before a GPU session is spent on it.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _whatif() -> ModuleType:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location("dual_whatif", BENCHMARKS / "dual_whatif.py")
        assert spec is not None
        assert spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCHMARKS))


WHATIF = _whatif()


@pytest.mark.parametrize("name", sorted(WHATIF.VARIANTS), ids=str)
def test_every_edit_applies_once(name: str) -> None:
    source = WHATIF.variant_source(name)
    ast.parse(source)
    original = Path(WHATIF.dual_on_main.__file__).read_text()
    assert (source == original) == (name == "main")


def test_an_edit_that_no_longer_applies_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    gone = [("this text is not in dual.py", "")]
    monkeypatch.setitem(WHATIF.VARIANTS, "gone", (True, gone, "an edit of a removed snippet"))
    with pytest.raises(ValueError, match="occurs 0 times"):
        WHATIF.variant_source("gone")
