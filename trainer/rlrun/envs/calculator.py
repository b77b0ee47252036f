"""`calculator`: arithmetic with a tool — the model calls ``calculate`` and answers with its result.

Each task is one product, sum or difference of two ``digits``-digit numbers (``"What is 37*48?"``). The
model may call the ``calculate`` tool (:mod:`rlrun.envs.tools`, Hermes format); the env answers each call
with a ``tool`` message; the first turn that calls no tool is the answer and ends the episode (so does
``max_turns``). The reward scores that last turn: 1 when it is exactly the number, else 0.

The tool's schema travels in ``task.info["tools"]``, so a chat template that renders tools shows it to
the model; the builtin tiny model's template ignores it and learns the call from its demonstration:
``<tool_call>{"name": "calculate", "arguments": {"expression": "37*48"}}</tool_call>``, then ``1776``.

State (JSON): the number of tool calls so far. Splits: a question is held out when the first 8 hex digits
of its SHA-256, read as a number, are divisible by 10.
"""

from __future__ import annotations

import ast
import hashlib
import json
import operator
import random
from typing import Any

from rlrun.envs.base import Reply, Split, Task
from rlrun.envs.tools import ToolSet

OPERATIONS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
_AST_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
#: Longest expression ``calculate`` evaluates, characters.
MAX_EXPRESSION = 64


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression of integers.

    Args:
        expression: integers with +, -, * and parentheses, e.g. "12*(3+4)".
    """
    if len(expression) > MAX_EXPRESSION:
        raise ValueError(f"expression longer than {MAX_EXPRESSION} characters")

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _AST_OPS:
            return _AST_OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError("only integers, +, -, * and parentheses")

    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"not an expression: {exc.msg}") from None
    return str(value(tree.body))


def held_out(question: str) -> bool:
    """Whether ``question`` belongs to the eval split (about one in ten)."""
    return int(hashlib.sha256(question.encode()).hexdigest()[:8], 16) % 10 == 0


class CalculatorEnv:
    """Two-number arithmetic with the ``calculate`` tool.

    Args:
        digits: digits of each operand (1–6).
        operations: which of ``+``, ``-``, ``*`` tasks use.
        max_turns: most model turns (≥ 2: a call and an answer).
        tool_timeout_seconds: most seconds one tool call may take.

    Raises:
        ValueError: ``digits`` outside 1–6, an unknown operation, or ``max_turns`` < 2.
    """

    name = "calculator"
    resumable = True  # its state is plain JSON: a preempted episode is continued at its last durable turn

    def __init__(
        self, digits: int = 2, operations: str = "*", max_turns: int = 3, tool_timeout_seconds: float = 5.0
    ) -> None:
        if not 1 <= digits <= 6:
            raise ValueError(f"calculator: digits must be 1–6, got {digits}")
        if not operations or set(operations) - set(OPERATIONS):
            raise ValueError(f"calculator: operations must be some of {''.join(OPERATIONS)}, got {operations!r}")
        if max_turns < 2:
            raise ValueError(f"calculator: max_turns must be ≥ 2 (a call and an answer), got {max_turns}")
        self.digits, self.operations, self.max_turns = digits, operations, max_turns
        self.tools = ToolSet([calculate], timeout_s=tool_timeout_seconds)

    def task(self, seed: int, index: int, split: Split = "train") -> Task:
        """Task ``index`` of ``split`` (draws again until the question is in the split)."""
        rng = random.Random(f"calculator:{seed}:{split}:{index}")
        lo, hi = 10 ** (self.digits - 1) if self.digits > 1 else 0, 10**self.digits - 1
        while True:
            a, b, op = rng.randint(lo, hi), rng.randint(lo, hi), rng.choice(self.operations)
            expression = f"{a}{op}{b}"
            if held_out(expression) == (split == "eval"):
                break
        prompt = [{"role": "user", "content": f"What is {expression}?"}]
        answer = str(OPERATIONS[op](a, b))
        return Task(self.name, index, prompt, answer, {"expression": expression, "tools": self.tools.schemas})

    def start(self, task: Task) -> dict[str, Any]:
        """No tool calls yet."""
        return {"tool_calls": 0}

    def respond(self, task: Task, state: dict[str, Any], completion: str) -> Reply:
        """Each tool call answered (a ``tool`` message); a turn without one is the answer (done)."""
        results = self.tools.run(completion)
        if not results:
            return Reply(None, True, state)
        errors = sum(not r.ok for r in results)
        calls = state["tool_calls"] + len(results)
        return Reply(
            ToolSet.messages(results), False, {"tool_calls": calls}, tool_calls=len(results), tool_errors=errors
        )

    def reward(self, task: Task, completion: str) -> float:
        """1 when the answer turn is exactly the number, else 0."""
        return 1.0 if completion.strip() == task.answer else 0.0

    def demonstration(self, task: Task) -> list[str]:
        """A call of ``calculate`` on the question, then its result."""
        call = json.dumps({"name": "calculate", "arguments": {"expression": task.info["expression"]}})
        return [f"<tool_call>{call}</tool_call>", str(task.answer)]
