"""The layers of ``src/dmutex`` point only down, read from the imports of every module.

The rank rule: a module imports only from its own rank or a lower one.

 0 foundation: ``_errors``, ``_clock``, ``_validate``, ``_options``, ``_version``
 1 ``_core``: the engine and the store protocol (``abc.py``), no I/O
 2 ``_backends``: the stores and client detection; ``_observers``: the observers
   dmutex brings (logging, OpenTelemetry), on ``_core``'s events
 3 ``_runtime``: the drivers and renewers, which run the engine against real I/O
 4 ``_faces``: the public classes
 5 ``_cli``: the command
 6 ``dmutex`` itself (``__init__.py``, ``__main__.py``)

Every import counts: at module level, under ``if TYPE_CHECKING:``, and inside
functions. A module that no rank names fails the check too, so a new room is
placed on purpose.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "dmutex"

RANKS: dict[str, int] = {
    "dmutex._errors": 0,
    "dmutex._clock": 0,
    "dmutex._validate": 0,
    "dmutex._options": 0,
    "dmutex._version": 0,
    "dmutex._core": 1,
    "dmutex._backends": 2,
    "dmutex._observers": 2,
    "dmutex._runtime": 3,
    "dmutex._faces": 4,
    "dmutex._cli": 5,
    "dmutex": 6,
}


@dataclass(frozen=True)
class Import:
    """One module's import of another module of the package, where it is written."""

    line: int
    target: str
    eager: bool
    """Runs when the module is imported: at module level, not under TYPE_CHECKING."""


def module_name(path: Path) -> str:
    """``src/dmutex/_core/abc.py`` -> ``dmutex._core.abc``; a package is its ``__init__``."""
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    """Every module of the package, by dotted name."""
    return {module_name(path): path for path in sorted((SRC / PACKAGE).rglob("*.py"))}


def rank_of(name: str) -> int | None:
    """The rank of module ``name``: that of the longest prefix that ``RANKS`` names."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        prefix = ".".join(parts[:end])
        if prefix in RANKS:
            return RANKS[prefix]
    return None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(
    name: str, source: str, known: set[str], *, is_package: bool = False
) -> list[Import]:
    """The imports of package modules in ``source``, the text of module ``name``.

    Relative imports are resolved; ``from . import x`` names the submodule
    ``x`` where there is one (``known``), else the package.
    """
    package = name if is_package else name.rpartition(".")[0]
    found: list[Import] = []

    def visit(node: ast.AST, eager: bool) -> None:
        if isinstance(node, ast.Import):
            found.extend(Import(node.lineno, alias.name, eager) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            for alias in node.names:
                submodule = f"{origin}.{alias.name}"
                target = submodule if submodule in known else origin
                found.append(Import(node.lineno, target, eager))
        lazy = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) or (
            isinstance(node, ast.If) and _is_type_checking(node.test)
        )
        for child in ast.iter_child_nodes(node):
            visit(child, eager and not lazy)

    visit(ast.parse(source), True)
    return [i for i in found if i.target == PACKAGE or i.target.startswith(PACKAGE + ".")]


def all_imports() -> dict[str, list[Import]]:
    """Every module's imports of the package's modules."""
    found = modules()
    known = set(found)
    return {
        name: imports_of(name, path.read_text(), known, is_package=path.name == "__init__.py")
        for name, path in found.items()
    }


def where(name: str, item: Import) -> str:
    return f"{modules()[name].relative_to(SRC.parent)}:{item.line}"


def test_the_scan_finds_every_kind_of_import() -> None:
    """The check can fail: imports under TYPE_CHECKING, in functions, relative and absolute."""
    source = """
from typing import TYPE_CHECKING
import dmutex._cli.run
from .. import _clock
from ..effects import Steps
from . import engine

if TYPE_CHECKING:
    from ..._faces.sync import DMutex

def late() -> None:
    from dmutex._backends import open_store
"""
    known = {"dmutex._core.engine", "dmutex._core.effects", "dmutex._clock"}
    found = imports_of("dmutex._core.sub.mod", source, known)
    assert [(i.target, i.eager) for i in found] == [
        ("dmutex._cli.run", True),
        ("dmutex._core", True),  # "from .. import _clock" from _core.sub: _core._clock is no module
        ("dmutex._core.effects", True),
        ("dmutex._core.sub", True),
        ("dmutex._faces.sync", False),
        ("dmutex._backends", False),
    ]


def test_every_module_has_a_rank() -> None:
    found = modules()
    assert "dmutex._core.abc" in found  # the scan sees the modules, packages' too
    assert "dmutex._backends.redis" in found
    unranked = [name for name in found if rank_of(name) is None]
    assert not unranked, f"modules no rank names (add them to RANKS): {unranked}"


def test_layers_point_only_down() -> None:
    upward = []
    for name, imported in all_imports().items():
        rank = rank_of(name)
        assert rank is not None
        for item in imported:
            target = rank_of(item.target)
            assert target is not None, f"{where(name, item)}: {item.target} has no rank"
            if target > rank:
                upward.append(
                    f"{where(name, item)}: {name} (rank {rank}) imports "
                    f"{item.target} (rank {target})"
                )
    assert not upward, "imports that point up a layer:\n" + "\n".join(upward)


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``edges``, as a path that ends where it starts, or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}}) is None


def test_no_import_cycles() -> None:
    """No two modules import each other when imported (type-only imports may, for annotations)."""
    edges = {
        name: {i.target for i in imported if i.eager} - {name}
        for name, imported in all_imports().items()
    }
    cycle = _cycle(edges)
    assert cycle is None, "an import cycle: " + " -> ".join(cycle or [])
