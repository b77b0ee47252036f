"""`guess-number`: a multi-turn game with feedback — find a secret number from "higher" / "lower" hints.

The model is asked for a number between ``low`` and ``high``; after each guess the env answers
``higher``, ``lower`` or ends the episode (found it). An episode has at most ``max_turns`` guesses
(binary search needs ⌈log2(high − low + 1)⌉; 1 to 64 takes at most 6, so the default 7 leaves one).
The reward scores the last turn (:class:`~rlrun.envs.base.MultiTurnEnv`): 1 when it is the secret, else 0.
A turn that is not a number is answered ``a number, please`` (it costs a turn).

State (JSON, what a resumed episode restores): the guesses so far.

Splits: a secret is held out when the first 8 hex digits of the SHA-256 of ``"guess-number:<n>"``, read as
a number, are divisible by 5 (about a fifth of the numbers): ``train`` draws the others, ``eval`` only
those. Demonstration (the builtin tiny model's warm start): the turns of a binary search.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

from rlrun.envs.base import Reply, Split, Task


def held_out(number: int) -> bool:
    """Whether secret ``number`` belongs to the eval split (about one in five)."""
    return int(hashlib.sha256(f"guess-number:{number}".encode()).hexdigest()[:8], 16) % 5 == 0


def parse_guess(text: str) -> int | None:
    """The guess a model turn states: the whole turn, stripped, as an integer (None: not one)."""
    text = text.strip()
    return int(text) if text.lstrip("-").isdigit() else None


class GuessNumberEnv:
    """Guess a secret in ``[low, high]`` within ``max_turns`` guesses.

    Args:
        low, high: the range, inclusive (``high − low`` ≥ 4, so both splits have numbers).
        max_turns: most guesses per episode (≥ 1).

    Raises:
        ValueError: a range too small, or ``max_turns`` < 1.
    """

    name = "guess-number"
    resumable = True  # its state is plain JSON: a preempted episode is continued at its last durable turn

    def __init__(self, low: int = 1, high: int = 64, max_turns: int = 7) -> None:
        if high - low < 4:
            raise ValueError(f"guess-number: high − low must be ≥ 4, got {low}..{high}")
        if max_turns < 1:
            raise ValueError(f"guess-number: max_turns must be ≥ 1, got {max_turns}")
        self.low, self.high, self.max_turns = low, high, max_turns
        numbers = range(low, high + 1)
        self._split = {"train": [n for n in numbers if not held_out(n)], "eval": [n for n in numbers if held_out(n)]}
        if not self._split["eval"]:
            self._split["eval"] = [self._split["train"].pop()]  # a tiny range: one number held out all the same

    def task(self, seed: int, index: int, split: Split = "train") -> Task:
        """Task ``index`` of ``split``: a secret drawn uniformly from the split's numbers."""
        secret = random.Random(f"guess-number:{seed}:{split}:{index}").choice(self._split[split])
        prompt = [{"role": "user", "content": f"Guess my number, {self.low} to {self.high}."}]
        return Task(self.name, index, prompt, str(secret))

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
        secret, lo, hi, turns = int(task.answer), self.low, self.high, []  # type: ignore[arg-type]
        while True:
            mid = (lo + hi) // 2
            turns.append(str(mid))
            if mid == secret:
                return turns
            lo, hi = (mid + 1, hi) if mid < secret else (lo, mid - 1)
