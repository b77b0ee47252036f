"""Product code stands on its own: no dev-only package imported, no import cycle.

Checked statically (``ast``) over every module of ``rlrun`` and ``rlrun_operator``, so
nothing is imported and the function-level imports count as much as the module-level
ones (a lazy import is still a dependency; a cycle through one only fails later, at the
first call). Imports under ``if TYPE_CHECKING:`` never run, but a cycle through them is still two
modules that each need the other to be understood: the cycle check counts them, the dev-only check
does not.

The layers (``docs/design.md``, "Layers"): the *foundation* (``rlrun.api``, ``rlrun.envs``,
``rlrun.model`` and the modules at ``rlrun``'s top level) imports no *process package* (``rlrun.training``,
``rlrun.orchestrator``, ``rlrun.launcher``, ``rlrun.rollout``, ``rlrun_operator``): the processes meet
through the foundation (the run directory's formats, the API), never through each other. Process packages
import none of each other, with two exceptions that are the contract itself: the orchestrator calls the
rollout servers through :mod:`rlrun.rollout.client`, and the operator, of the foundation, imports only
:mod:`rlrun.api`, :mod:`rlrun.roles` (what each role's pod runs) and :mod:`rlrun.manifest` (it accepts
exactly the manifests the roles accept, envs built once). The entry point (``rlrun.cli``,
``rlrun.__main__``) starts every role and may import anything.

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


#: The process packages: each runs as its own process (or set of ranks) and meets the others through the foundation.
PROCESS_PACKAGES = ("rlrun.training", "rlrun.orchestrator", "rlrun.launcher", "rlrun.rollout", "rlrun_operator")
#: The composition root: the ``rlrun`` command line, which starts each role.
ENTRY_POINTS = ("rlrun.cli", "rlrun.__main__")
#: ``{process package: what it may import of other process packages}`` (see the module docstring).
ALLOWED_BETWEEN_PROCESSES = {"rlrun.orchestrator": ("rlrun.rollout", "rlrun.rollout.client")}
#: What the operator may import of the foundation (a module or package and what is under it).
OPERATOR_FOUNDATION = ("rlrun.api", "rlrun.roles", "rlrun.manifest")


def _within(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def process_package(module: str) -> str | None:
    """The process package ``module`` belongs to (``rlrun.orchestrator.loop`` → ``rlrun.orchestrator``), or None."""
    return next((p for p in PROCESS_PACKAGES if _within(module, (p,))), None)


def layer_violations(graph: dict[str, dict[str, int]]) -> list[str]:
    """``["a (line N) imports b: <rule>", …]`` for every import edge of ``graph`` that breaks a layer rule."""
    out = []
    for module, targets in sorted(graph.items()):
        if module in ENTRY_POINTS:
            continue
        own = process_package(module)
        for target, line in sorted(targets.items()):
            theirs = process_package(target)
            where = f"{module} (line {line}) imports {target}"
            if theirs is None:
                if target in ENTRY_POINTS:
                    out.append(f"{where}: only the entry point imports the entry point")
                elif (
                    own == "rlrun_operator" and target.startswith("rlrun.") and not _within(target, OPERATOR_FOUNDATION)
                ):
                    out.append(f"{where}: the operator imports only {', '.join(OPERATOR_FOUNDATION)} of rlrun")
            elif own is None:
                out.append(f"{where}: the foundation imports no process package")
            elif own != theirs and target not in ALLOWED_BETWEEN_PROCESSES.get(own, ()):
                out.append(f"{where}: process packages import none of each other")
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


def imports_of(module: str, path: Path, type_checking: bool = False) -> list[Import]:
    """The imports a module executes (at module level or inside functions), relative ones made absolute;
    with ``type_checking``, also those under ``if TYPE_CHECKING:``."""
    is_package = path.name == "__init__.py"
    out = []
    with warnings.catch_warnings():  # a bad escape in a docstring is not this test's business
        warnings.simplefilter("ignore")
        tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree) if type_checking else _runtime_nodes(tree):
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


def import_graph(modules: dict[str, Path], type_checking: bool = False) -> dict[str, dict[str, int]]:
    """``{module: {product module it makes Python import: line}}`` (with ``type_checking``, also the imports
    under ``if TYPE_CHECKING:``).

    Importing ``a.b.c`` imports the packages ``a`` and ``a.b`` first, so they are edges too,
    except the importer's own packages (already being imported when it runs).
    """
    graph: dict[str, dict[str, int]] = {m: {} for m in modules}
    for module, path in modules.items():
        own = set(_ancestors(module))
        for imp in imports_of(module, path, type_checking):
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


def test_product_modules_have_no_import_cycle_even_through_type_checking():
    graph = import_graph(product_modules(), type_checking=True)
    cycles = [describe(graph, c) for c in import_cycles(graph)]
    assert cycles == [], "import cycles through `if TYPE_CHECKING:` imports:\n" + "\n".join(cycles)


def test_product_modules_keep_to_their_layers():
    graph = import_graph(product_modules(), type_checking=True)
    assert {"rlrun.training", "rlrun.orchestrator.loop", "rlrun_operator.reconcile", "rlrun.api.spec"} <= set(graph)
    violations = layer_violations(graph)
    assert violations == [], "imports across the layers (docs/design.md, Layers):\n" + "\n".join(violations)


def test_the_layer_rules_name_each_kind_of_wrong_way_import():
    graph = {
        "rlrun.checkpoint": {"rlrun.training.parts": 3, "rlrun.errors": 4},
        "rlrun.training.trainer": {"rlrun.orchestrator.weights": 7, "rlrun.checkpoint": 8},
        "rlrun.orchestrator.loop": {"rlrun.rollout.client": 9, "rlrun.launcher.local": 10},
        "rlrun_operator.specs": {"rlrun.manifest": 1, "rlrun.api.spec": 2, "rlrun.ledger": 5, "rlrun": 6},
        "rlrun.cli": {"rlrun.training.trainer": 1, "rlrun_operator.main": 2},
        "rlrun.roles": {"rlrun.cli": 11},
    }
    assert layer_violations(graph) == [
        "rlrun.checkpoint (line 3) imports rlrun.training.parts: the foundation imports no process package",
        "rlrun.orchestrator.loop (line 10) imports rlrun.launcher.local: process packages import none of each other",
        "rlrun.roles (line 11) imports rlrun.cli: only the entry point imports the entry point",
        "rlrun.training.trainer (line 7) imports rlrun.orchestrator.weights: process packages import none of each "
        "other",
        "rlrun_operator.specs (line 5) imports rlrun.ledger: the operator imports only rlrun.api, rlrun.roles, "
        "rlrun.manifest of rlrun",
    ]


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
    # counted with the TYPE_CHECKING imports: p.c.e → p.b → p.c (the package being imported) → p.a → p.b
    graph = import_graph(product_modules({"p": tmp_path / "p"}), type_checking=True)
    assert graph["p.c.e"] == {"p.b": 3}
