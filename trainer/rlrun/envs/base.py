"""The environment interface: a named source of tasks plus a reward function.

An env is deliberately small so that a new one is a single module: it produces
:class:`Task` objects deterministically from ``(seed, index)`` — which is what
lets the orchestrator's train source resume from a bare cursor — and scores a
decoded completion against a task with a reward in ``[0, 1]``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class Task:
    """One prompt to roll out.

    Attributes:
        env: name of the env that made the task.
        index: position of the task in the env's deterministic stream.
        prompt: text shown to the model (already in the env's prompt format).
        answer: reference the reward function compares against.
    """

    env: str
    index: int
    prompt: str
    answer: str

    def to_dict(self) -> dict[str, Any]:
        """Plain, JSON-compatible form (used in shipped batches and snapshots)."""
        return {"env": self.env, "index": self.index, "prompt": self.prompt, "answer": self.answer}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Task:
        """Inverse of :meth:`to_dict`."""
        return cls(env=data["env"], index=int(data["index"]), prompt=data["prompt"], answer=data["answer"])


class Env(Protocol):
    """What the orchestrator needs from an env."""

    name: str

    def task(self, seed: int, index: int) -> Task:
        """Return task number ``index`` of the stream seeded by ``seed`` (pure function)."""
        ...

    def reward(self, task: Task, completion: str) -> float:
        """Score ``completion`` (decoded text up to EOS) for ``task``, in ``[0, 1]``."""
        ...


EnvFactory = Callable[..., Env]
