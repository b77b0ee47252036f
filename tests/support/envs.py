"""Scripted envs for tests and benchmarks, named in a manifest by import path (``tests.support.envs:UntilOne``).

Used by ``tests/integration/test_crash_injection.py`` and ``benchmarks/turn_durability.py``, whose fake servers
answer each turn ``1`` or ``2``.
"""

from __future__ import annotations

from rlrun.envs.base import Reply, Task


class UntilOne:
    """A resumable multi-turn env with plain-text prompts ``go<i>=``: the episode ends when the model says ``1``
    (reward 1), else the env answers ``no=``; at most ``max_turns`` turns.

    Args:
        prompts: distinct prompts (task ``i`` is prompted ``go<i mod prompts>=``); None: one per task (``go<i>=``).
        max_turns: most model turns per episode.
    """

    name = "until-one"
    resumable = True  # its state is plain JSON: a preempted episode is continued at its last durable turn

    def __init__(self, prompts: int | None = None, max_turns: int = 6) -> None:
        self.prompts = prompts
        self.max_turns = max_turns

    def task(self, seed: int, index: int, split: str = "train") -> Task:
        i = index if self.prompts is None else index % self.prompts
        return Task(self.name, index, f"go{i}=", "1")

    def start(self, task: Task) -> dict:
        return {"turns": 0}

    def respond(self, task: Task, state: dict, completion: str) -> Reply:
        return Reply(None if completion == "1" else "no=", completion == "1", {"turns": state["turns"] + 1})

    def reward(self, task: Task, completion: str) -> float:
        return 1.0 if completion == "1" else 0.0
