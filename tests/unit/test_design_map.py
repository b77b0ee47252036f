"""``docs/design.md``'s map lists every product module, and nothing that is not one.

A row's first cell names its modules in backticks, relative to its table's package root (the
``(`trainer/rlrun/`)`` or ``(`operator/rlrun_operator/`)`` in the line that introduces the table). A
package's ``__init__.py`` counts as a module when it holds more than a docstring.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "design.md"
ROOTS = ("trainer/rlrun", "operator/rlrun_operator")


def product_modules() -> set[str]:
    """Every module file, as ``trainer/rlrun/orchestrator/loop.py``; an ``__init__.py`` only when it has code."""
    out = set()
    for root in ROOTS:
        for path in (ROOT / root).rglob("*.py"):
            if path.name == "__init__.py":
                body = ast.parse(path.read_text()).body
                if all(isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) for n in body):
                    continue
            out.add(path.relative_to(ROOT).as_posix())
    return out


def mapped_modules(text: str) -> dict[str, int]:
    """``{module path: line}`` for every module a map row names (the map: the section up to ``## Decisions``)."""
    section = text[text.index("## Map") : text.index("## Decisions")]
    out: dict[str, int] = {}
    root = None
    for number, line in enumerate(section.splitlines(), start=text[: text.index("## Map")].count("\n") + 1):
        introduced = re.search(r"\(`((?:trainer|operator)/[\w/]+)/`\)", line)
        if introduced and not line.startswith("|"):
            root = introduced.group(1)
        if not line.startswith("| `"):
            continue
        assert root is not None, f"docs/design.md:{number}: a map row before any package root line"
        first_cell = line.split("|")[1]
        for name in re.findall(r"`([^`]+)`", first_cell):
            out[f"{root}/{name}"] = number
    return out


def test_the_design_map_lists_every_product_module_and_nothing_else():
    mapped = mapped_modules(DESIGN.read_text())
    modules = product_modules()
    assert {"trainer/rlrun/orchestrator/loop.py", "operator/rlrun_operator/stages.py"} <= modules
    unmapped = sorted(modules - set(mapped))
    stale = sorted(f"{m} (line {line})" for m, line in mapped.items() if m not in modules)
    assert unmapped == [], "product modules missing from docs/design.md's map:\n" + "\n".join(unmapped)
    assert stale == [], "docs/design.md's map names modules that do not exist:\n" + "\n".join(stale)


def test_the_map_reader_takes_each_tables_package_root():
    text = (
        "# Design\n\n## Map\n\nRuntime (`trainer/rlrun/`):\n\n| module | job |\n|---|---|\n"
        "| `a.py`, `b/c.py` | x (`not/this.py`) |\n\nOperator (`operator/rlrun_operator/`):\n\n"
        "| `d.py` | y |\n\n## Decisions\n| `e.py` | not a map row |\n"
    )
    assert mapped_modules(text) == {
        "trainer/rlrun/a.py": 9,
        "trainer/rlrun/b/c.py": 9,
        "operator/rlrun_operator/d.py": 13,
    }


def test_every_product_module_opens_with_a_docstring_naming_its_job():
    missing = [
        path.relative_to(ROOT).as_posix()
        for root in ROOTS
        for path in sorted((ROOT / root).rglob("*.py"))
        if not (ast.get_docstring(ast.parse(path.read_text())) or "").strip()
    ]
    assert missing == []


def test_no_product_module_is_over_450_lines():
    """One job per module keeps each one short (issue 21); a module growing past this is carved, not waived."""
    long = {
        path.relative_to(ROOT).as_posix(): n
        for root in ROOTS
        for path in sorted((ROOT / root).rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > 450
    }
    assert long == {}
