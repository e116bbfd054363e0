"""The package's import graph: no cycles, and no import from a lower layer to a higher one.

Every ``import`` in ``mla/**/*.py`` counts, those inside functions too (a deferred import is
still a dependency). The layer order is declared once, in :data:`LAYERS`; a module belongs to
the layer whose prefix names it most closely.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "mla"

LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("core", ("mla.core",)),
    ("providers", ("mla.providers",)),
    ("strategies", ("mla.strategy", "mla.decode", "mla.prefill", "mla.sparse")),
    ("decision", ("mla.engine.decision",)),
    ("engine", ("mla.engine", "mla.engine.backend")),
    ("functional", ("mla.engine.functional",)),
    ("model", ("mla.layers", "mla.distributed")),
    ("tools", ("mla", "mla.__main__", "mla.tools", "mla.testing")),
)
"""Layers from the bottom up; a module may import its own layer and the ones below it."""


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES: dict[str, pathlib.Path] = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str, path: pathlib.Path) -> set[str]:
    """The ``mla`` modules ``name`` imports (``from m import x`` counts ``m.x`` when that is a module)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [
                f"{module}.{alias.name}" if f"{module}.{alias.name}" in MODULES else module
                for alias in node.names
            ]
        else:
            continue
        for target in targets:
            # ``import mla.a.b`` names the deepest module that exists.
            module = target
            while module not in MODULES and "." in module:
                module = module.rsplit(".", 1)[0]
            if module in MODULES and module != name:
                found.add(module)
    return found


GRAPH: dict[str, set[str]] = {name: imports_of(name, path) for name, path in MODULES.items()}


def layer_of(name: str) -> int:
    best: tuple[int, int] | None = None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            named = name == prefix or name.startswith(prefix + ".")
            if named and (best is None or len(prefix) > best[0]):
                best = (len(prefix), index)
    if best is None:
        raise AssertionError(f"{name} is in no layer: add it to LAYERS in {__file__}")
    return best[1]


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as ``[a, b, ..., a]``, or ``None``."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return [*path[path.index(dep) :], dep]
            if dep not in state:
                cycle = visit(dep)
                if cycle is not None:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle is not None:
                return cycle
    return None


def test_every_module_has_a_layer() -> None:
    assert len(MODULES) > 20
    for name in MODULES:
        layer_of(name)


def test_no_import_cycles() -> None:
    cycle = find_cycle(GRAPH)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or ())


def test_imports_run_down_the_layers() -> None:
    upward = [
        f"{name} ({LAYERS[layer_of(name)][0]}) imports {dep} ({LAYERS[layer_of(dep)][0]})"
        for name, deps in sorted(GRAPH.items())
        for dep in sorted(deps)
        if layer_of(dep) > layer_of(name)
    ]
    assert not upward, "imports that run up the layers:\n" + "\n".join(upward)


def test_the_checks_catch_a_cycle_and_an_upward_import() -> None:
    """The walkers themselves: a planted cycle is found, a planted upward import is seen."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    assert layer_of("mla.core.support") < layer_of("mla.providers.base") < layer_of("mla.decode.base")
    assert layer_of("mla.decode.base") < layer_of("mla.engine.decision.resolver")
    assert layer_of("mla.engine.decision.resolver") < layer_of("mla.engine.backend.builder")
    assert layer_of("mla.engine.backend") < layer_of("mla.engine.functional.decode")
    assert layer_of("mla.engine.functional.decode") < layer_of("mla.tools.cli")
    assert "mla.core.errors" in GRAPH["mla.core.config"]
    # A package's __init__ counts the submodules it hands on.
    assert "mla.providers.aiter.provider" in GRAPH["mla.providers.aiter"]


@pytest.mark.parametrize("name", ["mla.__main__", "mla.tools.cli"])
def test_the_entry_points_sit_on_top(name: str) -> None:
    assert layer_of(name) == len(LAYERS) - 1


MAX_MODULE_LINES = 500
"""The longest a module may be, kernel bodies excepted."""
KERNEL_MODULES = frozenset(
    {
        "mla.providers.gluon.kernels",
        "mla.providers.gluon.dual",
        "mla.providers.triton.indexer",
        "mla.providers.triton.sparse",
        "mla.providers.triton.topk",
    }
)
"""Modules over the limit because of the kernel bodies they hold (Triton/Gluon ``@jit`` code)."""


def test_modules_stay_short() -> None:
    lengths = {name: len(path.read_text().splitlines()) for name, path in MODULES.items()}
    long = {name: n for name, n in lengths.items() if n > MAX_MODULE_LINES and name not in KERNEL_MODULES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them): {long}"
    # The exceptions are kernel files: most of their lines are inside jit functions.
    for name in KERNEL_MODULES:
        source = MODULES[name].read_text()
        assert "@triton.jit" in source or "@gluon.jit" in source, name
