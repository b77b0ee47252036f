"""`reverse-text`: reverse a short string of real English words.

Task source: the words of *The Zen of Python* (PEP 20), read from the standard
library's ``this`` module. That text has not changed since Python 2.2, ships with
every CPython, and needs no download, so every machine and every pod derives the
same task stream from the same seed. Words are lower-cased and reduced to
``a–z``; one-letter fragments are dropped (84 distinct words).

Prompt format: the text followed by ``=``; the expected completion is the text
reversed character by character, then EOS. Example: prompt ``"flat is="``,
completion ``"si talf"``.

Reward: longest-common-subsequence ratio
``LCS(completion, target) / max(len(completion), len(target))`` in ``[0, 1]``:
1 only for an exact reversal, and both missing and extra characters cost.
"""

from __future__ import annotations

import codecs
import contextlib
import functools
import io
import random
import re

from rlrun.envs.base import Task

PROMPT_SEPARATOR = "="
ALPHABET = " abcdefghijklmnopqrstuvwxyz"


@functools.cache
def zen_words() -> tuple[str, ...]:
    """The distinct words (2+ letters, ``a–z``) of PEP 20, sorted."""
    with contextlib.redirect_stdout(io.StringIO()):  # importing `this` prints the poem
        import this
    text = codecs.decode(this.s, "rot13").lower()
    return tuple(sorted({w for w in re.findall(r"[a-z]+", text) if len(w) >= 2}))


def lcs_length(a: str, b: str) -> int:
    """Length of the longest common subsequence of ``a`` and ``b`` (O(len(a)·len(b)))."""
    if len(a) < len(b):
        a, b = b, a
    prev = [0] * (len(b) + 1)
    for ca in a:
        cur = [0] * (len(b) + 1)
        for j, cb in enumerate(b, start=1):
            cur[j] = prev[j - 1] + 1 if ca == cb else max(prev[j], cur[j - 1])
        prev = cur
    return prev[-1]


def lcs_ratio(completion: str, target: str) -> float:
    """``LCS(completion, target) / max(len(completion), len(target))``; 1.0 when both are empty."""
    longest = max(len(completion), len(target))
    if longest == 0:
        return 1.0
    return lcs_length(completion, target) / longest


class ReverseTextEnv:
    """Tasks of 1 to ``max_words`` Zen-of-Python words, at most ``max_chars`` characters.

    Args:
        max_words: most words in one text (≥ 1).
        max_chars: longest text in characters (≥ the longest word, 14).
    """

    name = "reverse-text"

    def __init__(self, max_words: int = 2, max_chars: int = 16) -> None:
        words = zen_words()
        if max_words < 1:
            raise ValueError(f"reverse-text: max_words must be ≥ 1, got {max_words}")
        if max_chars < max(len(w) for w in words):
            raise ValueError(f"reverse-text: max_chars must be ≥ {max(len(w) for w in words)}, got {max_chars}")
        self.max_words = max_words
        self.max_chars = max_chars
        self.words = words

    def text(self, seed: int, index: int) -> str:
        """The text of task ``index`` for ``seed``; a pure function of both."""
        rng = random.Random(f"reverse-text:{seed}:{index}")
        while True:
            n = rng.randint(1, self.max_words)
            text = " ".join(rng.choice(self.words) for _ in range(n))
            if len(text) <= self.max_chars:
                return text

    def task(self, seed: int, index: int) -> Task:
        """Task ``index`` of the stream for ``seed``."""
        text = self.text(seed, index)
        return Task(env=self.name, index=index, prompt=text + PROMPT_SEPARATOR, answer=text[::-1])

    def reward(self, task: Task, completion: str) -> float:
        """LCS ratio between ``completion`` and ``task.answer``, in ``[0, 1]``."""
        return lcs_ratio(completion, task.answer)
