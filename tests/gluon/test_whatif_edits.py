"""``benchmarks/whatif.py`` edits the Gluon kernels' source: every edit must still apply, and
every variant compile.

The what-if benchmark times variants of ``mla/providers/gluon/dual.py`` and ``pingpong.py``
made by replacing exact snippets of their source. When a kernel changes, an edit whose snippet
is gone would make the variant time the unchanged kernel; the benchmark refuses that, and this
test says so on the CPU, before a GPU session is spent on it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from benchmark_modules import BENCHMARKS, load_benchmark
from sm90_compile import run_without_interpreter

pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")

WHATIF = load_benchmark("whatif")


CASES = [(kernel, name) for kernel, spec in sorted(WHATIF.KERNELS.items()) for name in spec.variants]


@pytest.mark.parametrize(("kernel", "name"), CASES, ids=[f"{k}-{n}" for k, n in CASES])
def test_every_edit_applies_once(kernel: str, name: str) -> None:
    spec = WHATIF.KERNELS[kernel]
    source = WHATIF.variant_source(spec, name)
    ast.parse(source)
    original = Path(spec.module.__file__).read_text()
    assert (source == original) == (name == "main")


@pytest.mark.parametrize("kernel", sorted(WHATIF.KERNELS))
def test_every_variant_compiles_for_sm90(kernel: str) -> None:
    """An edit can apply and still not compile (a name it relies on gone from the kernel): every
    variant must compile for sm_90 and fit an SM's shared memory. ``--compile-only`` needs no
    GPU, but not the interpreter the CPU tests run Triton in, so it runs in a process of its own."""
    stdout = run_without_interpreter([str(BENCHMARKS / "whatif.py"), "--kernel", kernel, "--compile-only"])
    for name in WHATIF.KERNELS[kernel].variants:
        assert re.search(rf"\|\s*{re.escape(name)}\s*\|", stdout), stdout


def test_an_edit_that_no_longer_applies_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = WHATIF.KERNELS["dual"]
    gone = [("this text is not in dual.py", "")]
    monkeypatch.setitem(spec.variants, "gone", (True, gone, "an edit of a removed snippet"))
    with pytest.raises(ValueError, match=r"occurs 0 times in dual\.py"):
        WHATIF.variant_source(spec, "gone")


def test_an_edit_must_apply_as_often_as_it_says(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = WHATIF.KERNELS["dual"]
    twice = [("def mla_decode_dual_kernel(", "def mla_decode_dual_kernel(", 2)]
    monkeypatch.setitem(spec.variants, "twice", (True, twice, "an edit of a snippet that occurs once"))
    with pytest.raises(ValueError, match=r"occurs 1 times in dual\.py \(expected 2\)"):
        WHATIF.variant_source(spec, "twice")


def test_a_shape_label_is_parsed_or_refused() -> None:
    assert WHATIF.parse_shape("H16q4B64S4096") == (16, 4, 64, 4096)
    with pytest.raises(ValueError, match="H<heads>q<qlen>B<batch>S<seqlen>"):
        WHATIF.parse_shape("B64S4096")
