"""`guess-number`: a multi-turn game with feedback — find a secret number from "higher" / "lower" hints.

Each task names a range of ``width`` numbers inside ``[low, high]`` (``Guess my number, 7 to 22.``) and hides
a secret in it; after each guess the env answers ``higher``, ``lower`` or ends the episode (found it). An
episode has at most ``max_turns`` guesses; binary search (``mid = (lo + hi) // 2``) needs at most
⌊log2(width)⌋ + 1: 5 for the default width 16, so the default 6 leaves one. The reward scores the last turn
(:class:`~rlrun.envs.base.MultiTurnEnv`): 1 when it is the secret, else 0. A turn that is not a number is
answered ``a number, please`` (it costs a turn).

State (JSON, what a resumed episode restores): the guesses so far.

Splits: a task is the pair (range, secret); a pair is held out when the first 8 hex digits of the SHA-256 of
``"guess-number:<first>:<secret>"``, read as a number, are divisible by 5 (about a fifth): ``train`` draws the
others, ``eval`` only those (a number all of whose tasks are held out gives its first back to ``train``).
Every number is a secret of some training task (in other ranges), so a policy
cannot score on train by never guessing the held-out numbers — it must search; holding out secrets of a single
range made skipping them the best training policy (measured: held-out solved fell 0.20 → 0.10 while the
training reward rose). Demonstration (the builtin tiny model's warm start): the turns of a binary search.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

from rlrun.envs.base import Reply, Split, Task


def held_out(first: int, secret: int) -> bool:
    """Whether the task (range starting at ``first``, ``secret``) belongs to the eval split (about one in five)."""
    return int(hashlib.sha256(f"guess-number:{first}:{secret}".encode()).hexdigest()[:8], 16) % 5 == 0


def parse_guess(text: str) -> int | None:
    """The guess a model turn states: the whole turn, stripped, as an integer (None: not one)."""
    text = text.strip()
    return int(text) if text.lstrip("-").isdigit() else None


class GuessNumberEnv:
    """Guess a secret in a range of ``width`` numbers inside ``[low, high]`` within ``max_turns`` guesses.

    Args:
        low, high: where ranges lie, inclusive.
        width: numbers per task's range (≥ 2, ≤ ``high − low + 1``; default 16, or the whole of ``[low, high]``
            when that is smaller).
        max_turns: most guesses per episode (≥ 1).

    Raises:
        ValueError: a width outside those bounds, too few (range, secret) tasks to hold some out while every
            number stays a training secret (ranges need room to move), or ``max_turns`` < 1.
    """

    name = "guess-number"
    resumable = True  # its state is plain JSON: a preempted episode is continued at its last durable turn

    def __init__(self, low: int = 1, high: int = 40, width: int | None = None, max_turns: int = 6) -> None:
        width = min(16, high - low + 1) if width is None else width
        if not 2 <= width <= high - low + 1:
            raise ValueError(f"guess-number: width must be 2 to high − low + 1 = {high - low + 1}, got {width}")
        if max_turns < 1:
            raise ValueError(f"guess-number: max_turns must be ≥ 1, got {max_turns}")
        self.low, self.high, self.width, self.max_turns = low, high, width, max_turns
        tasks = [(a, n) for a in range(low, high - width + 2) for n in range(a, a + width)]
        self._split = {"train": [t for t in tasks if not held_out(*t)], "eval": [t for t in tasks if held_out(*t)]}
        trained = {n for _, n in self._split["train"]}
        for n in sorted({n for _, n in self._split["eval"]} - trained):  # an edge number all of whose tasks are held
            give_back = min(t for t in self._split["eval"] if t[1] == n)  # out: one goes to train (module docstring)
            self._split["eval"].remove(give_back)
            self._split["train"].append(give_back)
        if not self._split["eval"] or len(tasks) < 10:
            raise ValueError(
                f"guess-number: {low}..{high} with width {width} makes too few tasks to hold some out: give ranges "
                "room to move (high − low + 1 a few numbers more than width)"
            )

    def task(self, seed: int, index: int, split: Split = "train") -> Task:
        """Task ``index`` of ``split``: a (range, secret) pair drawn uniformly from the split's."""
        first, secret = random.Random(f"guess-number:{seed}:{split}:{index}").choice(self._split[split])
        last = first + self.width - 1
        prompt = [{"role": "user", "content": f"Guess my number, {first} to {last}."}]
        return Task(self.name, index, prompt, str(secret), {"low": first, "high": last})

    def start(self, task: Task) -> dict[str, Any]:
        """No guesses yet."""
        return {"guesses": []}

    def respond(self, task: Task, state: dict[str, Any], completion: str) -> Reply:
        """``higher`` / ``lower`` / done (found); ``a number, please`` for a turn that is no number."""
        guess = parse_guess(completion)
        guesses = [*state["guesses"], guess]
        if guess is None:
            return Reply("a number, please", False, {"guesses": guesses})
        secret = int(task.answer)  # type: ignore[arg-type]
        if guess == secret:
            return Reply(None, True, {"guesses": guesses})
        return Reply("higher" if guess < secret else "lower", False, {"guesses": guesses})

    def reward(self, task: Task, completion: str) -> float:
        """1 when the last guess is the secret, else 0."""
        return 1.0 if parse_guess(completion) == int(task.answer) else 0.0  # type: ignore[arg-type]

    def demonstration(self, task: Task) -> list[str]:
        """The guesses of a binary search for the secret, one turn each."""
        secret, lo, hi, turns = int(task.answer), task.info["low"], task.info["high"], []  # type: ignore[arg-type]
        while True:
            mid = (lo + hi) // 2
            turns.append(str(mid))
            if mid == secret:
                return turns
            lo, hi = (mid + 1, hi) if mid < secret else (lo, mid - 1)
