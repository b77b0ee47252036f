"""Scripted envs for tests and benchmarks, named in a manifest by import path (``tests.support.envs:UntilOne``,
``tests.support.envs:Faulty``).

``UntilOne`` (and ``InPlace``, its state changed in place) are used by
``tests/integration/test_crash_injection.py``, ``tests/unit/test_turn_durability.py`` and
``benchmarks/turn_durability.py``, whose fake servers answer each turn ``1`` or ``2``; ``Faulty`` by the tests
of how a run stops (``tests/unit/test_stops.py``); ``Hangs`` by those of env code that hangs or fails
(``tests/unit/test_hung_env_code.py``, ``tests/processes/test_hung_env_exit.py``).
"""

from __future__ import annotations

import threading

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


class InPlace(UntilOne):
    """:class:`UntilOne` whose ``respond`` records each model turn in its state **in place** (``state["moves"]``
    appended, the same dict returned), as a user's env may: the kept state must still be the state as of the kept
    turn (one move per turn played). While :attr:`gate` is clear, a ``respond`` after a conversation's first waits
    for it once it has recorded its move (a pause then finds conversations in the middle of a ``respond``), at most
    :attr:`most_held` at once (each holds one of the event loop's worker threads, which the orchestrator's file
    writes need too); :attr:`held` counts those waiting."""

    gate = threading.Event()
    held = 0
    most_held = 2
    _lock = threading.Lock()

    def start(self, task: Task) -> dict:
        return {"moves": []}

    def respond(self, task: Task, state: dict, completion: str) -> Reply:
        state["moves"].append(completion)
        with InPlace._lock:
            hold = len(state["moves"]) > 1 and not InPlace.gate.is_set() and InPlace.held < InPlace.most_held
            InPlace.held += hold
        if hold:
            InPlace.gate.wait()
            with InPlace._lock:
                InPlace.held -= 1
        return Reply(None if completion == "1" else "no=", completion == "1", state)


InPlace.gate.set()


class Faulty:
    """A single-turn env whose task ``i`` is prompted ``t<i>=`` (the fake server answers the prompt reversed; reward 1
    for ``<i>t`` exactly, else 0), with the faults that stop a run at a chosen task.

    Args:
        long_at: task index whose prompt is too long for the context (``PromptTooLongError`` when it is dispatched).
        raise_at: task index whose ``task()`` raises (the env's data source failing).
        reward_fails_from: from this task index on, the reward raises (``RewardsFailing`` after 64 requests).
    """

    name = "faulty"

    def __init__(self, long_at: int | None = None, raise_at: int | None = None, reward_fails_from: int | None = None):
        self.long_at = long_at
        self.raise_at = raise_at
        self.reward_fails_from = reward_fails_from

    def task(self, seed: int, index: int, split: str = "train") -> Task:
        if index == self.raise_at:
            raise RuntimeError(f"task {index}: the env's data source is gone")
        prompt = ("x" * 100 if index == self.long_at else f"t{index}") + "="
        return Task(self.name, index, prompt, prompt[-2::-1])

    def reward(self, task: Task, completion: str) -> float:
        if self.reward_fails_from is not None and task.index >= self.reward_fails_from:
            raise ConnectionError("the judge is unreachable")
        return 1.0 if completion == task.answer else 0.0


class Hangs:
    """A multi-turn env with :class:`Faulty`'s prompts (task ``i``: ``t<i>=``, reward 1 for ``<i>t`` exactly)
    whose ``start`` (or ``respond``: ``hang_in``) hangs on every ``every``-th task until :attr:`release` is
    set — env code waiting on a sandbox that never answers; with ``fail_all`` every ``start`` raises instead.
    Its ``respond`` ends the episode after the first model turn (what the reward scores).

    Args:
        every: a task whose index is a multiple of it hangs (0: none).
        hang_in: ``"start"`` or ``"respond"``.
        fail_all: every ``start`` raises ``ConnectionError``.
    """

    name = "hangs"
    max_turns = 2
    release = threading.Event()

    def __init__(self, every: int = 5, hang_in: str = "start", fail_all: bool = False) -> None:
        self.every, self.hang_in, self.fail_all = every, hang_in, fail_all

    def task(self, seed: int, index: int, split: str = "train") -> Task:
        prompt = f"t{index}="
        return Task(self.name, index, prompt, prompt[-2::-1])

    def _maybe_hang(self, task: Task, where: str) -> None:
        if where == self.hang_in and self.every and task.index % self.every == 0:
            Hangs.release.wait()

    def start(self, task: Task) -> dict:
        if self.fail_all:
            raise ConnectionError("the sandbox is gone")
        self._maybe_hang(task, "start")
        return {}

    def respond(self, task: Task, state: dict, completion: str) -> Reply:
        self._maybe_hang(task, "respond")
        return Reply(None, True, state)

    def reward(self, task: Task, completion: str) -> float:
        return 1.0 if completion == task.answer else 0.0
