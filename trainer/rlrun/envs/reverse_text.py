"""`reverse-text`: reverse a short string of real English words.

Task source: the words of *The Zen of Python* (PEP 20), read from the standard
library's ``this`` module. That text has not changed since Python 2.2, ships with
every CPython, and needs no download, so every machine and every pod derives the
same task stream from the same seed. Words are lower-cased and reduced to
``a–z``; one-letter fragments are dropped (84 distinct words).

Prompt format: the text followed by ``=``; the expected completion is the text
reversed character by character, then EOS. Example: prompt ``"flat is="``,
completion ``"si talf"``.

Reward (``reward`` arg): ``exact`` — 1 for the exact reversal, else 0 — or ``lcs``, the
longest-common-subsequence ratio ``LCS(completion, target) / max(len(completion), len(target))``
in ``[0, 1]``: 1 only for an exact reversal, and both missing and extra characters cost. The
partial credit of ``lcs`` teaches the tiny model to be sure rather than right (issue 27: eight
copies of one wrong answer score alike, so sharpening pays); the default example uses ``exact``
(``docs/design.md``, "Evaluation").

Splits: a text is **held out** when the first 8 hex digits of its SHA-256, read as a number,
are divisible by 10 (about a tenth of the texts). The ``train`` stream (and the builtin model's
warm start) draws only texts that are not held out; the ``eval`` stream only held-out ones, from
its own seed namespace. So no eval task is a training task, for any pair of seeds.
"""

from __future__ import annotations

import codecs
import contextlib
import functools
import hashlib
import io
import random
import re

from rlrun.envs.base import SPLITS, Split, Task
from rlrun.rewards.builtin import lcs_length as lcs_length  # re-exported: it moved to the builtin rewards
from rlrun.rewards.builtin import lcs_ratio

PROMPT_SEPARATOR = "="
ALPHABET = " abcdefghijklmnopqrstuvwxyz"


@functools.cache
def zen_words() -> tuple[str, ...]:
    """The distinct words (2+ letters, ``a–z``) of PEP 20, sorted."""
    with contextlib.redirect_stdout(io.StringIO()):  # importing `this` prints the poem
        import this
    text = codecs.decode(this.s, "rot13").lower()
    return tuple(sorted({w for w in re.findall(r"[a-z]+", text) if len(w) >= 2}))


#: Rewards the env can give (the ``reward`` arg).
REWARDS = ("exact", "lcs")


@functools.cache
def held_out(text: str) -> bool:
    """Whether ``text`` belongs to the eval split (about one text in ten; module docstring)."""
    return int(hashlib.sha256(text.encode()).hexdigest()[:8], 16) % 10 == 0


class ReverseTextEnv:
    """Tasks of 1 to ``max_words`` Zen-of-Python words, at most ``max_chars`` characters.

    Args:
        min_words: fewest words in one text (1 ≤ min_words ≤ max_words).
        max_words: most words in one text (≥ 1).
        max_chars: longest text in characters (≥ the longest word, 14).
        reward: ``"lcs"`` (partial credit) or ``"exact"`` (1 for the exact reversal, else 0).
    """

    name = "reverse-text"

    def __init__(self, max_words: int = 2, max_chars: int = 16, reward: str = "lcs", min_words: int = 1) -> None:
        words = zen_words()
        if max_words < 1:
            raise ValueError(f"reverse-text: max_words must be ≥ 1, got {max_words}")
        if max_chars < max(len(w) for w in words):
            raise ValueError(f"reverse-text: max_chars must be ≥ {max(len(w) for w in words)}, got {max_chars}")
        if not 1 <= min_words <= max_words:
            raise ValueError(f"reverse-text: min_words must be between 1 and max_words ({max_words}), got {min_words}")
        if reward not in REWARDS:
            raise ValueError(f"reverse-text: reward must be one of {list(REWARDS)}, got {reward!r}")
        self.min_words = min_words
        self.max_words = max_words
        self.max_chars = max_chars
        self.words = words
        self.reward_kind = reward

    def text(self, seed: int, index: int, split: Split = "train") -> str:
        """The text of task ``index`` of ``split`` for ``seed``; a pure function of the three.

        Raises:
            ValueError: ``split`` is neither ``train`` nor ``eval``.
        """
        if split not in SPLITS:
            raise ValueError(f"reverse-text: split must be one of {list(SPLITS)}, got {split!r}")
        namespace = "reverse-text" if split == "train" else "reverse-text-eval"
        rng = random.Random(f"{namespace}:{seed}:{index}")
        while True:
            n = rng.randint(self.min_words, self.max_words)
            text = " ".join(rng.choice(self.words) for _ in range(n))
            if len(text) <= self.max_chars and held_out(text) == (split == "eval"):
                return text

    def task(self, seed: int, index: int, split: Split = "train") -> Task:
        """Task ``index`` of ``split``'s stream for ``seed``."""
        text = self.text(seed, index, split)
        return Task(env=self.name, index=index, prompt=text + PROMPT_SEPARATOR, answer=text[::-1])

    def reward(self, task: Task, completion: str) -> float:
        """``exact``: 1.0 when ``completion`` is ``task.answer``, else 0.0; ``lcs``: their LCS ratio, in ``[0, 1]``."""
        if self.reward_kind == "exact":
            return float(completion == task.answer)
        return lcs_ratio(completion, task.answer)
