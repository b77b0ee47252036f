"""The project's environment keeps Python's standard library first: ``import operator`` (which the operator
package must never shadow: ARCHITECTURE.md) is the stdlib's, in a fresh interpreter started at the repository root."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_stdlib_operator_module_is_not_shadowed():
    out = subprocess.run(
        [sys.executable, "-c", "import operator, rlrun_operator; print(operator.add(2, 3), operator.__file__)"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    value, path = out.stdout.split()
    assert value == "5"
    assert "site-packages" not in path and str(ROOT) not in path
