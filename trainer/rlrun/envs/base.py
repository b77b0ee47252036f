"""The environment interface: a named source of tasks plus a reward function.

An env is deliberately small so that a new one is a single module: it produces
:class:`Task` objects deterministically from ``(seed, index, split)`` — which is what
lets the orchestrator's train source resume from a bare cursor — and scores a
decoded completion against a task with a reward in ``[0, 1]`` (1: solved).

Two splits: ``train`` feeds training, ``eval`` is held out for evaluation
(:mod:`rlrun.orchestrator.evaluation`). They must be disjoint *as tasks*, not only as
streams: two streams drawn from one small space overlap whatever their seeds (and a
generator that derives item ``i`` of seed ``s`` from ``Random(s + i)`` makes seed ``s + 1``
seed ``s`` shifted by one), so an env partitions its task space and draws each split from
its own part.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

#: The two task streams of an env: ``train`` (what the run trains on) and ``eval`` (held out: what
#: evaluation scores, never trained). An env guarantees that no eval task is a training task.
Split = Literal["train", "eval"]
SPLITS: tuple[Split, ...] = ("train", "eval")


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

    def task(self, seed: int, index: int, split: Split = "train") -> Task:
        """Return task number ``index`` of ``split``'s stream seeded by ``seed`` (pure function; no eval task
        is ever a train task, whatever the seeds)."""
        ...

    def reward(self, task: Task, completion: str) -> float:
        """Score ``completion`` (decoded text up to EOS) for ``task``, in ``[0, 1]``."""
        ...


EnvFactory = Callable[..., Env]
