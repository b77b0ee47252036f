"""Product code stands on its own: no dev-only package imported, no import cycle.

Checked statically (``ast``) over every module of ``rlrun`` and ``rlrun_operator``, so
nothing is imported and the function-level imports count as much as the module-level
ones (a lazy import is still a dependency; a cycle through one only fails later, at the
first call). Imports under ``if TYPE_CHECKING:`` never run and are left out of both checks.

Dev-only packages are derived, not listed: the import names whose distributions are
direct requirements of ``pyproject.toml``'s ``dev`` extra and of no other requirement
(``dependencies`` or another extra), mapped through ``importlib.metadata``.
"""

from __future__ import annotations

import ast
import importlib.metadata
import itertools
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.requirements import Requirement

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[2]
#: Package roots of the product: import name → its directory.
PACKAGES = {"rlrun": ROOT / "trainer" / "rlrun", "rlrun_operator": ROOT / "operator" / "rlrun_operator"}


def _dist(name: str) -> str:
    """A distribution name normalized as PEP 503 does (``PyYAML`` → ``pyyaml``, ``a.b_c`` → ``a-b-c``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def dev_only_imports() -> dict[str, list[str]]:
    """``{import name: [its dev-only distributions]}`` for every installed dev-only distribution."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project.get("optional-dependencies", {})
    dev = {_dist(Requirement(r).name) for r in extras.get("dev", [])}
    product = {_dist(Requirement(r).name) for r in project.get("dependencies", [])}
    for extra, requirements in extras.items():
        if extra != "dev":
            product |= {_dist(Requirement(r).name) for r in requirements}
    out = {}
    for module, dists in importlib.metadata.packages_distributions().items():
        normalized = {_dist(d) for d in dists}
        if normalized & dev and not normalized & product:
            out[module] = sorted(normalized & dev)
    return out


@dataclass(frozen=True)
class Import:
    """One import statement of a product module.

    Attributes:
        module: the importing module (``rlrun.manifest``).
        line: its line number.
        names: the absolute dotted names it may import: ``from a.b import c`` gives ``a.b`` and ``a.b.c``
            (``c`` may be a submodule).
    """

    module: str
    line: int
    names: tuple[str, ...]


def product_modules(packages: dict[str, Path] = PACKAGES) -> dict[str, Path]:
    """``{dotted module name: file}`` for every module of ``packages`` (a package as its ``__init__``)."""
    out = {}
    for package, directory in packages.items():
        for path in sorted(directory.rglob("*.py")):
            parts = [package, *path.relative_to(directory).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _runtime_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node of ``tree`` except the bodies of ``if TYPE_CHECKING:`` (never executed)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for orelse in node.orelse:
                yield orelse
                yield from _runtime_nodes(orelse)
            continue
        yield node
        yield from _runtime_nodes(node)


def imports_of(module: str, path: Path) -> list[Import]:
    """The imports a module executes (at module level or inside functions), relative ones made absolute."""
    is_package = path.name == "__init__.py"
    out = []
    with warnings.catch_warnings():  # a bad escape in a docstring is not this test's business
        warnings.simplefilter("ignore")
        tree = ast.parse(path.read_text(), str(path))
    for node in _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                out.append(Import(module, node.lineno, (alias.name,)))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module if is_package else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{base}" if base else package
            names = (base, *(f"{base}.{alias.name}" for alias in node.names if alias.name != "*"))
            out.append(Import(module, node.lineno, names))
    return out


def _ancestors(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def import_graph(modules: dict[str, Path]) -> dict[str, dict[str, int]]:
    """``{module: {product module it makes Python import: line}}``.

    Importing ``a.b.c`` imports the packages ``a`` and ``a.b`` first, so they are edges too,
    except the importer's own packages (already being imported when it runs).
    """
    graph: dict[str, dict[str, int]] = {m: {} for m in modules}
    for module, path in modules.items():
        own = set(_ancestors(module))
        for imp in imports_of(module, path):
            for name in imp.names:
                if name not in modules:
                    continue
                for target in [*_ancestors(name), name]:
                    if target in modules and target != module and target not in own:
                        graph[module].setdefault(target, imp.line)
    return graph


def import_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle (``[a, b, …, a]``) per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [_cycle_in(graph, set(c)) for c in components]


def _cycle_in(graph: dict[str, dict[str, int]], component: set[str]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first search back to it)."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w == start:
                    return [*paths[v], start]
                if w in component and w not in paths:
                    paths[w] = [*paths[v], w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start} in {sorted(component)}")


def describe(graph: dict[str, dict[str, int]], cycle: list[str]) -> str:
    return " → ".join(f"{a} (line {graph[a][b]})" for a, b in itertools.pairwise(cycle)) + f" → {cycle[-1]}"


def test_dev_only_packages_are_derived_from_pyproject():
    dev_only = dev_only_imports()
    assert {"celpy", "kmock", "kubernetes_validate", "jsonschema", "pytest"} <= set(dev_only)
    assert not {"pydantic", "yaml", "httpx", "kopf", "kubernetes", "rlrun", "rlrun_operator"} & set(dev_only)


def test_no_product_module_imports_a_dev_only_package():
    dev_only = dev_only_imports()
    offenders = [
        f"{imp.module}:{imp.line} imports {name} (dev-only: {', '.join(dev_only[top])})"
        for module, path in product_modules().items()
        for imp in imports_of(module, path)
        for name in imp.names[:1]
        if (top := name.split(".")[0]) in dev_only
    ]
    assert offenders == [], "\n".join(offenders)


def test_product_modules_have_no_import_cycle():
    graph = import_graph(product_modules())
    cycles = [describe(graph, c) for c in import_cycles(graph)]
    assert cycles == [], "import cycles (module-level and function-level imports):\n" + "\n".join(cycles)


def test_the_cycle_finder_sees_function_level_imports_and_parent_packages(tmp_path):
    files = {
        "__init__.py": "",
        "a.py": "def late():\n    from p import b\n",  # function level
        "b.py": "from p.c.d import x\n",  # runs p/c/__init__.py first
        "c/__init__.py": "from ..a import late\n",
        "c/d.py": "from . import e\nx = 1\n",  # a sibling: p.c is already being imported, no cycle
        "c/e.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p import b\n",  # never runs
    }
    for name, text in files.items():
        (tmp_path / "p" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "p" / name).write_text(text)
    graph = import_graph(product_modules({"p": tmp_path / "p"}))
    assert graph["p.c.d"] == {"p.c.e": 1} and graph["p.c.e"] == {}
    (cycle,) = import_cycles(graph)
    assert cycle == ["p.a", "p.b", "p.c", "p.a"]
    assert describe(graph, cycle) == "p.a (line 2) → p.b (line 1) → p.c (line 1) → p.a"
