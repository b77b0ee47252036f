"""Write ``examples/data/arithmetic.jsonl``: 2000 integer additions and subtractions, one task a line.

Each line is ``{"prompt": "12+7=", "answer": "19"}``: two operands in ``0..99``, ``+`` or ``-`` (a
subtraction never goes below zero), so a prompt has at most 6 characters and an answer at most 3, all
printable ASCII — small enough for the tiny char-level model with its 64-token context. The rows are
distinct prompts drawn without replacement by ``random.Random(SEED)``, in a shuffled order, so the file
is the same bytes on every machine (``tests/unit/test_dataset_env.py`` checks the committed file against it). It is the
``dataset`` env's example (:mod:`rlrun.envs.dataset`); the file is committed, and this script is how to regenerate it::

    python examples/data/make_arithmetic.py            # rewrites examples/data/arithmetic.jsonl
    python examples/data/make_arithmetic.py --out x.jsonl --rows 500
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

#: The seed of the committed file.
SEED = 23
#: Rows of the committed file.
ROWS = 2000
#: Operands are drawn from ``0..MAX_OPERAND``.
MAX_OPERAND = 99
#: Where the committed file lives: beside this script.
DEFAULT_OUT = Path(__file__).with_name("arithmetic.jsonl")


def all_problems() -> list[tuple[str, str]]:
    """Every ``(prompt, answer)``: ``a+b=`` and, for ``a ≥ b``, ``a-b=``, in a fixed order."""
    operands = range(MAX_OPERAND + 1)
    problems = [(f"{a}+{b}=", str(a + b)) for a in operands for b in operands]
    problems += [(f"{a}-{b}=", str(a - b)) for a in operands for b in operands if a >= b]
    return problems


def make_rows(rows: int = ROWS, seed: int = SEED) -> list[dict[str, str]]:
    """``rows`` distinct problems drawn by ``random.Random(seed)``, as ``{"prompt", "answer"}`` rows.

    Raises:
        ValueError: ``rows`` is not in ``1..`` the number of distinct problems (15050).
    """
    problems = all_problems()
    if not 1 <= rows <= len(problems):
        raise ValueError(f"rows must be in 1..{len(problems)}, got {rows}")
    return [{"prompt": p, "answer": a} for p, a in random.Random(seed).sample(problems, rows)]


def write_jsonl(path: Path, rows: list[dict[str, str]]) -> None:
    """Write ``rows`` to ``path``, one JSON object a line (``\\n`` endings on every platform)."""
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="file to write (default: %(default)s)")
    parser.add_argument("--rows", type=int, default=ROWS, help="number of rows (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=SEED, help="random seed (default: %(default)s)")
    args = parser.parse_args(argv)
    write_jsonl(args.out, make_rows(args.rows, args.seed))


if __name__ == "__main__":
    main()
