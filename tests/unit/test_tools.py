"""Tools for multi-turn envs: schemas from signatures and docstrings, Hermes-format calls, and a call that fails in any
way answered as an error message to the model, never raised."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from rlrun.envs.tools import ToolSet


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first.
        b: the second.
    """
    return a + b


def divide(a: int, b: int) -> float:
    """Divide a by b.

    Args:
        a: the dividend.
        b: the divisor.
    """
    return a / b


def slow(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: how long.
    """
    time.sleep(seconds)
    return "woke"


def test_schemas_come_from_signatures_and_docstrings():
    tools = ToolSet([add])
    [schema] = tools.schemas
    assert schema["function"]["name"] == "add"
    assert schema["function"]["description"] == "Add two integers."
    assert schema["function"]["parameters"]["properties"]["a"] == {"type": "integer", "description": "the first."}
    assert schema["function"]["parameters"]["required"] == ["a", "b"]


def test_a_function_without_a_docstring_or_two_of_one_name_is_refused():
    def bare(x: int) -> int:
        return x

    with pytest.raises(ValueError, match="tool 'bare'"):
        ToolSet([bare])
    with pytest.raises(ValueError, match="two tools named 'add'"):
        ToolSet([add, add])


def test_calls_are_answered_in_order_and_failures_become_error_messages():
    tools = ToolSet([add, divide, slow], timeout_s=0.2)
    turn = (
        'first <tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
        '<tool_call>{"name": "divide", "arguments": {"a": 1, "b": 0}}</tool_call>'
        "<tool_call>not json</tool_call>"
        '<tool_call>{"name": "mul", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
        '<tool_call>{"name": "slow", "arguments": {"seconds": 2}}</tool_call>'
    )
    t0 = time.monotonic()
    results = tools.run(turn)
    assert time.monotonic() - t0 < 1.5  # the slow call is not waited for past its timeout
    assert [(r.name, r.ok) for r in results] == [
        ("add", True),
        ("divide", False),
        ("?", False),
        ("mul", False),
        ("add", False),
        ("slow", False),
    ]
    assert results[0].content == "5"
    assert results[1].content == "error: ZeroDivisionError: division by zero"
    assert results[2].content.startswith("error: the tool call is not JSON")
    assert results[3].content == "error: no tool named 'mul'; tools: add, divide, slow"
    assert "missing 1 required positional argument: 'b'" in results[4].content
    assert results[5].content == "error: slow took longer than 0.2 s"
    assert ToolSet.messages(results[:1]) == [{"role": "tool", "content": "5"}]
    assert ToolSet.text(results[:2]) == (
        "<tool_response>5</tool_response><tool_response>error: ZeroDivisionError: division by zero</tool_response>"
    )
    assert tools.run("no call here") == []


def test_a_tool_that_sleeps_never_fails_an_instant_one():
    """Issue 47's case, its seconds ÷ 10: a tool sleeping 5 s (timeout 0.3 s) called beside an instant one,
    one call of each in each of 28 turns answered 14 at a time (env ``respond`` threads). Before, every tool
    of the process shared 8 threads and a timeout counted the wait for one: 21 of 28 instant calls failed
    ``took longer than 3 s``. Now each tool has threads of its own and a call's timeout is its own run
    time."""
    tools = ToolSet([add, slow], timeout_s=0.3)
    calls = [{"name": "slow", "arguments": {"seconds": 5}}, {"name": "add", "arguments": {"a": 2, "b": 3}}]
    turn = "".join(f"<tool_call>{json.dumps(call)}</tool_call>" for call in calls)
    started = time.monotonic()
    with ThreadPoolExecutor(14) as respond_threads:
        answered = list(respond_threads.map(tools.run, [turn] * 28))
    took = time.monotonic() - started
    assert [r.content for _, r in answered] == ["5"] * 28  # every instant call answered
    assert {r.content for r, _ in answered} == {"error: slow took longer than 0.3 s"}
    # 8 calls of a tool at once: the 28 sleeping calls each gave their turn up at 0.3 s (4 rounds), never 5 s
    assert took < 3.0, took
    # its threads are daemon threads: a sleeping call never holds the process's exit
    assert all(t.daemon for t in threading.enumerate() if t.name.startswith("tool slow"))
