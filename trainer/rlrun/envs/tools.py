"""Tools for multi-turn envs: Python functions the model may call, and its calls answered.

A :class:`ToolSet` is built from plain functions with type hints and a Google-style docstring; their
JSON schemas (the OpenAI / Hugging Face ``tools`` format) come from ``transformers.utils.get_json_schema``,
so a task can hand them to a chat template that renders tools (``task.info["tools"]``:
:mod:`rlrun.orchestrator.episodes` passes them as ``apply_chat_template(..., tools=…)``).

**Call format** — the Hermes format, the one Qwen2.5, Qwen3 and Hermes chat templates describe to the
model and the builtin tiny model is warm-started on: each call is a JSON object in its own tag,
anywhere in the model's turn::

    <tool_call>{"name": "calculate", "arguments": {"expression": "12*34"}}</tool_call>

**Results** — one per call, in call order: for a chat prompt a ``{"role": "tool", "content": result}``
message each (:meth:`ToolSet.messages`), rendered by the chat template; for a plain-text prompt the text
``<tool_response>result</tool_response>`` each (:meth:`ToolSet.text`).

**A failing call never fails the episode**: a call that is not JSON, names an unknown tool, has wrong
arguments, raises, or takes longer than ``timeout_s`` is answered ``error: …`` (the model sees what went
wrong, as it would from a real tool) and counted in ``tool_errors``.

**A slow tool costs only its own calls**: each tool runs in threads of its own (a
:class:`~rlrun.worker_threads.WorkerThreads`), :data:`TOOL_THREADS` calls of it at once, and ``timeout_s`` is a call's
own run time, from when a thread starts it. A call past it is answered at once and its thread (Python cannot stop a
thread) is replaced by a spare while it finishes, up to :data:`TOOL_SPARE` such calls of the tool; past that many, a
call of that tool that gets no thread within ``timeout_s`` is answered ``error: … no thread was free …`` — a tool
that can hang should bound itself. Before (issue 47), every tool of the process shared 8 threads and a timeout
counted the wait for one: a tool sleeping 50 s (timeout 3 s) made 21 of 28 calls of an instant tool fail
``took longer than 3 s``. The threads are daemon threads: a hung call never holds the orchestrator's exit.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from transformers.utils import get_json_schema

from rlrun.envs.base import Messages
from rlrun.worker_threads import NoThreadFree, RanTooLong, WorkerThreads

#: Calls of one tool run at once (each tool has threads of its own: module docstring).
TOOL_THREADS = 8
#: Spare threads of one tool: they stand in for those its calls past their timeout still hold.
TOOL_SPARE = 24
#: One tool call, Hermes format (module docstring).
TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolResult:
    """One call answered.

    Attributes:
        name: the tool called (``?`` when the call did not say).
        content: what the model is shown: the tool's return value as text, or ``error: …``.
        ok: False when the call failed (counted in ``tool_errors``).
    """

    name: str
    content: str
    ok: bool


class ToolSet:
    """Tools a model may call (module docstring).

    Args:
        tools: functions with type hints and a Google-style docstring (``Args:`` describing each
            parameter); each is called with the call's ``arguments`` as keyword arguments and its
            return value shown as ``str(value)``.
        timeout_s: most seconds one call may run, from when a thread starts it (its own run time).

    Raises:
        ValueError: two tools with one name, or a function ``get_json_schema`` cannot describe (no
            docstring, a parameter without a type hint or description).
    """

    def __init__(self, tools: list[Callable[..., Any]], timeout_s: float = 5.0) -> None:
        self.tools: dict[str, Callable[..., Any]] = {}
        self.threads: dict[str, WorkerThreads] = {}  # each tool's own (module docstring)
        self.schemas: list[dict[str, Any]] = []
        for tool in tools:
            try:
                schema = get_json_schema(tool)
            except Exception as exc:  # transformers raises its own TypeHintParsingException / DocstringParsingException
                raise ValueError(f"tool {getattr(tool, '__name__', tool)!r}: {exc}") from exc
            name = schema["function"]["name"]
            if name in self.tools:
                raise ValueError(f"two tools named {name!r}")
            self.tools[name] = tool
            self.threads[name] = WorkerThreads(f"tool {name}", TOOL_THREADS, TOOL_SPARE)
            self.schemas.append(schema)
        self.timeout_s = timeout_s

    def calls(self, completion: str) -> list[str]:
        """The bodies of the tool calls in a model turn, in order (empty: the turn calls no tool)."""
        return TOOL_CALL.findall(completion)

    def call(self, body: str) -> ToolResult:
        """Run one call (the text inside ``<tool_call>…</tool_call>``); never raises (module docstring)."""
        try:
            call = json.loads(body)
        except json.JSONDecodeError as exc:
            return ToolResult("?", f"error: the tool call is not JSON ({exc.msg})", False)
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return ToolResult("?", 'error: a tool call is {"name": …, "arguments": {…}}', False)
        name, args = call["name"], call.get("arguments", {})
        if name not in self.tools:
            return ToolResult(name, f"error: no tool named {name!r}; tools: {', '.join(self.tools)}", False)
        if not isinstance(args, dict):
            return ToolResult(name, "error: arguments must be a JSON object", False)
        try:
            tool = functools.partial(self.tools[name], **args)
            value = self.threads[name].call(tool, timeout_s=self.timeout_s)
            return ToolResult(name, str(value), True)
        except RanTooLong as exc:
            return ToolResult(name, f"error: {name} {exc}", False)
        except NoThreadFree as exc:  # it never ran
            return ToolResult(name, f"error: {exc}", False)
        except Exception as exc:  # the tool's failure is the model's observation, never the orchestrator's crash
            return ToolResult(name, f"error: {type(exc).__name__}: {exc}", False)

    def run(self, completion: str) -> list[ToolResult]:
        """Every call of a model turn answered, in order."""
        return [self.call(body) for body in self.calls(completion)]

    @staticmethod
    def messages(results: list[ToolResult]) -> Messages:
        """Results as chat messages (role ``tool``), for a chat prompt."""
        return [{"role": "tool", "content": r.content} for r in results]

    @staticmethod
    def text(results: list[ToolResult]) -> str:
        """Results as plain text (``<tool_response>…</tool_response>`` each), for a plain-text prompt."""
        return "".join(f"<tool_response>{r.content}</tool_response>" for r in results)
