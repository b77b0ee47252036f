"""An env's answer after a model turn, as the chat template renders it (what a multi-turn episode's stream
extends with: :mod:`rlrun.orchestrator.turns`, and the tiny model's warm start: :mod:`rlrun.model.conversations`).

The template renders a fixed two-message conversation (a user message, an assistant message) with and
without the answer's messages; the text after the assistant's EOS is the answer's text, through the next
generation prompt. So the answer is rendered exactly as the template would render it in a conversation,
without ever rendering what the model said (a template may rewrite past turns).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from rlrun.envs.base import Messages, Task

#: The conversation :func:`reply_renderer` renders answers after: its assistant turn is what the model's
#: finished turn stands for.
_BASE: Messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]


class TemplateError(ValueError):
    """A chat template whose rendering of an answer cannot extend a sampled turn (module docstring)."""


def reply_renderer(tokenizer: Any) -> Callable[[Messages, list | None], str]:
    """``render(messages, tools) -> text``: the chat template's text of ``messages`` following an assistant turn
    that ended with the EOS token, through the next generation prompt (module docstring); ``tools``: the
    task's tool schemas, rendered as the task's prompt was (``task.info["tools"]``).

    Raises:
        TemplateError: the template does not end an assistant message with ``tokenizer.eos_token``, or renders
            the conversation's start differently once an answer follows (it rewrites the past).
    """
    marker = "y" + tokenizer.eos_token
    heads: dict[str, str] = {}  # tools (as JSON) → the template's text through the base's assistant EOS

    def head(tools: list | None) -> str:
        key = json.dumps(tools, sort_keys=True)
        if key not in heads:
            base = tokenizer.apply_chat_template(_BASE, tokenize=False, **({"tools": tools} if tools else {}))
            cut = base.rfind(marker)
            if cut < 0:
                raise TemplateError(
                    f"the chat template does not end an assistant message with the EOS token "
                    f"{tokenizer.eos_token!r}: a multi-turn env's answers cannot extend the sampled turns"
                )
            heads[key] = base[: cut + len(marker)]
        return heads[key]

    def render(messages: Messages, tools: list | None = None) -> str:
        start = head(tools)
        kwargs = {"tools": tools} if tools else {}
        full = tokenizer.apply_chat_template([*_BASE, *messages], tokenize=False, add_generation_prompt=True, **kwargs)
        if not full.startswith(start):
            raise TemplateError(
                "the chat template renders a finished assistant turn differently once a message follows"
            )
        return full[len(start) :]

    return render


def answer_text(render: Callable[[Messages, list | None], str] | None, task: Task, message: str | Messages) -> str:
    """The text of an env's answer ``message`` to ``task`` after a finished model turn: for a plain-text prompt, the
    text as is; for a chat prompt, its messages (a text is one ``user`` message) through ``render``
    (:func:`reply_renderer`) with the task's tools (``task.info["tools"]``).

    Raises:
        ValueError: chat messages for a plain-text prompt.
    """
    if not task.is_chat:
        if not isinstance(message, str):
            raise ValueError(f"env {task.env} answered a plain-text prompt with chat messages: answer with text")
        return message
    messages = [{"role": "user", "content": message}] if isinstance(message, str) else message
    return render(messages, task.info.get("tools"))  # type: ignore[misc]
