"""The documentation stands on its own: examples import what they use and run, and nothing
cites a document that is not in the repository."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
SOURCES = sorted(
    path
    for folder in ("mla", "tests", "benchmarks")
    for path in (ROOT / folder).rglob("*.py")
    if path != Path(__file__).resolve()
)
OUTSIDE_CITATIONS = re.compile(r"DESIGN(\.md)? ?§|\bthe seed\b|seed's|aiter-contract|anchors\.md|/shared/")
"""Documents the project was designed from that do not ship with it."""
FENCE = re.compile(r"```python\n(.*?)```", re.DOTALL)


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.mark.parametrize("path", DOCS + SOURCES, ids=_rel)
def test_no_citation_of_documents_outside_the_repository(path: Path) -> None:
    hits = [
        f"{_rel(path)}:{number}: {line.strip()}"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if OUTSIDE_CITATIONS.search(line)
    ]
    assert not hits, "\n".join(hits)


def _blocks(path: Path) -> list[str]:
    return FENCE.findall(path.read_text())


@pytest.mark.parametrize("path", DOCS, ids=_rel)
def test_examples_import_mla_testing_where_they_use_it(path: Path) -> None:
    """``import mla`` does not import ``mla.testing``: a block that uses it imports it."""
    for block in _blocks(path):
        if "mla.testing." in block:
            assert re.search(r"^\s*import mla\.testing", block, re.MULTILINE), block
    prose = FENCE.sub("", path.read_text())
    assert not re.search(r"`[^`]*mla\.testing\.\w+\(", prose), (
        f"{_rel(path)}: a call through mla.testing in prose"
    )


def test_readme_example_runs() -> None:
    (block,) = [b for b in _blocks(ROOT / "README.md") if "mla_decode" in b]
    scope: dict[str, object] = {}
    exec(compile(block, "README.md", "exec"), scope)
    out = scope["out"]
    assert isinstance(out, torch.Tensor)
    assert out.shape == (4, 16, 512)
    assert torch.isfinite(out.float()).all()


def test_sparse_example_runs() -> None:
    (block,) = _blocks(ROOT / "docs" / "sparse.md")
    scope: dict[str, object] = {}
    exec(compile(block, "docs/sparse.md", "exec"), scope)
    topk = scope["topk"]
    assert isinstance(topk, torch.Tensor)
    assert bool((topk[0] >= 0).all())  # request 0 sees 41 positions: 16 are kept
    assert bool(torch.isfinite(scope["out"]).all())  # type: ignore[call-overload]


@pytest.mark.parametrize("name", ["adding-a-kernel.md", "adding-a-provider.md"])
def test_every_example_of_the_kernel_and_provider_guides_runs(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every Python block of the two guides, in order, in one scope; the provider registry is
    restored afterwards (the provider guide registers one)."""
    from mla.providers import registry

    monkeypatch.setattr(registry, "_ENTRIES", dict(registry._ENTRIES))
    monkeypatch.setattr(registry, "_INSTANCES", dict(registry._INSTANCES))
    blocks = _blocks(ROOT / "docs" / name)
    assert blocks, f"docs/{name} has no Python example"
    scope: dict[str, object] = {"__name__": f"docs_{name.removesuffix('.md').replace('-', '_')}"}
    for block in blocks:
        exec(compile(block, f"docs/{name}", "exec"), scope)
