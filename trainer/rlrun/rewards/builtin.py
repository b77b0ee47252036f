"""The builtin reward functions: ``exact``, ``lcs``, ``math`` and the ``regex`` factory.

Each follows TRL ``GRPOTrainer``'s reward function convention, so it is interchangeable with one written
for TRL: called with keyword arguments ``prompts``, ``completions`` (one per sample: a ``str``, or for a
chat prompt ``[{"role": "assistant", "content": text}]``), ``completion_ids`` and every other task field
(``answer``, a dataset's columns), each a list with one item per sample; it returns one ``float`` per
sample, or ``None`` where the reward does not apply (TRL's semantics: left out of the weighted sum).
Every function is pure and thread-safe: :mod:`rlrun.rewards.scoring` calls them in worker threads, or in
worker processes (``math`` by default: :data:`rlrun.api.spec.PROCESS_REWARDS`).

:data:`BUILTIN_REWARDS` maps the name a manifest gives (``spec.envs[].rewards[].name``) to a factory
that takes the reward's ``args`` as keyword arguments and returns the function.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

#: ``regex`` modes: which :mod:`re` function decides a match.
REGEX_MODES = ("search", "fullmatch")


def completion_text(completion: Any) -> str:
    """The text of one completion, in either of TRL's forms.

    Args:
        completion: a ``str`` (the completion of a text prompt), or a list of chat messages
            ``[{"role": "assistant", "content": text}, …]`` (the completion of a chat prompt). A message's
            ``content`` may be a ``str``, ``None``, or a list of parts (``{"type": "text", "text": …}``,
            whose texts are joined); a message without ``role`` counts as the assistant's.

    Returns:
        The ``str`` itself, or the content of the last assistant message ("" when there is none).

    Raises:
        TypeError: ``completion`` is neither a ``str`` nor a list of message mappings.
    """
    if isinstance(completion, str):
        return completion
    if not isinstance(completion, (list, tuple)):
        raise TypeError(f"a completion is a str or a list of chat messages, got {type(completion).__name__}")
    for message in reversed(completion):
        if not isinstance(message, Mapping):
            raise TypeError(f"a chat message is a mapping with role and content, got {type(message).__name__}")
        if message.get("role", "assistant") == "assistant":
            return _content_text(message.get("content"))
    return ""


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):  # multimodal parts: keep the text ones
        return "".join(
            p.get("text") or "" for p in content if isinstance(p, Mapping) and p.get("type", "text") == "text"
        )
    raise TypeError(f"a message's content is a str or a list of parts, got {type(content).__name__}")


def exact(completions: list[Any], answer: list[Any], **kwargs: Any) -> list[float | None]:
    """Exact match: ``1.0`` iff ``completion.strip() == str(answer).strip()``, else ``0.0``; ``None`` where the
    answer is ``None``.

    Surrounding whitespace (a trailing newline, a leading space) is ignored on both sides, nothing else is
    normalised. Source: the exact-match accuracy of answer-matching evaluations (e.g. SQuAD's EM without its
    normalisation).

    Raises:
        ValueError: ``completions`` and ``answer`` differ in length.
        TypeError: a completion is in neither form (:func:`completion_text`).
    """
    return [
        None if a is None else float(completion_text(c).strip() == str(a).strip())
        for c, a in zip(completions, answer, strict=True)
    ]


def lcs_length(a: str, b: str) -> int:
    """Length of the longest common subsequence of ``a`` and ``b`` (O(len(a)·len(b)) time, O(min) memory)."""
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
    """``LCS(completion, target) / max(len(completion), len(target))`` in ``[0, 1]``; 1.0 when both are empty."""
    longest = max(len(completion), len(target))
    if longest == 0:
        return 1.0
    return lcs_length(completion, target) / longest


def lcs(completions: list[Any], answer: list[Any], **kwargs: Any) -> list[float | None]:
    """Partial credit by characters: ``LCS(c, a) / max(len(c), len(a))`` (:func:`lcs_ratio`, characters of the
    completion text ``c`` and of ``a = str(answer)``, unstripped); ``None`` where the answer is ``None``.

    1.0 only for ``c == a`` (and when both are empty); both missing and extra characters cost. Source: the
    LCS similarity of ROUGE-L (Lin, 2004), with ``max`` as the denominator instead of an F-measure; the
    ``reverse-text`` env's ``lcs`` reward (:mod:`rlrun.envs.reverse_text`).

    Raises:
        ValueError: ``completions`` and ``answer`` differ in length.
        TypeError: a completion is in neither form (:func:`completion_text`).
    """
    return [
        None if a is None else lcs_ratio(completion_text(c), str(a)) for c, a in zip(completions, answer, strict=True)
    ]


class _TimeoutDisabledFilter(logging.Filter):
    """Drops math-verify's "Timeout is disabled" warning: we disable its timeouts on purpose (see :func:`math`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


@functools.cache
def _math_verify() -> ModuleType:
    """The ``math_verify`` module, imported on first use (half a second), its timeout warning filtered.

    Raises:
        ImportError: math-verify is not installed.
    """
    try:
        import math_verify
    except ImportError as exc:
        raise ImportError(f"the math reward needs math-verify (pip install math-verify): {exc}") from exc
    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(_TimeoutDisabledFilter())
    return math_verify


#: Answers that already hold a math delimiter or a box are parsed as they are; others are wrapped in ``$…$``.
_DELIMITED = re.compile(r"\$|\\\(|\\\[|\\boxed")


def gold_text(answer: str) -> str:
    """What :func:`math` parses as the gold answer: ``answer`` stripped, wrapped in ``$…$`` unless it already holds
    ``$``, ``\\(``, ``\\[`` or ``\\boxed``.

    math-verify's ``parse`` looks for LaTeX only inside delimiters (or a ``\\boxed``), and falls back to the
    *last plain number* of the text otherwise; a bare gold answer (MATH and GSM8K give them bare) would then lose
    everything but a number: ``\\sqrt{2}`` and ``x^2+1`` would not parse at all and ``(1, 2)`` would parse as
    ``2``. Wrapped, they parse as LaTeX: ``$0.5$`` → ``1/2``, ``$(1, 2)$`` → the interval, ``$1,000$`` → 1000.
    """
    answer = answer.strip()
    return answer if _DELIMITED.search(answer) else f"${answer}$"


def math(completions: list[Any], answer: list[Any], **kwargs: Any) -> list[float | None]:
    """Mathematical equivalence by math-verify: ``1.0`` if ``verify(parse(gold), parse(completion))``, else
    ``0.0``; ``None`` where the answer is ``None`` or does not parse (TRL ``accuracy_reward``'s skip).

    - gold: ``parse(gold_text(str(answer)))`` (:func:`gold_text`: a bare answer is wrapped in ``$…$``), so
      ``0.5``, ``1/2`` and ``\\frac{1}{2}`` are all the rational 1/2;
    - prediction: ``parse(completion text)`` with math-verify's default extraction (LaTeX, a ``\\boxed{}``
      first, then plain expressions; the last one in the text), so ``The answer is $\\frac{1}{2}$``,
      ``\\boxed{0.5}`` and ``The answer is 1/2`` all match ``0.5``;
    - ``verify(gold, prediction)``: symbolic and numeric equality (6 decimal places) of any pair.

    math-verify's own timeouts are off (``parsing_timeout=None``, ``timeout_seconds=None``): they use
    ``signal.alarm``, which raises ``ValueError`` outside the main thread, and cannot interrupt C code anyway
    (``$10^{10^{7}}$`` computes a 10-million-digit integer with the GIL held); the scorer enforces
    ``reward_timeout_seconds`` itself, killing the worker process this runs in by default. Source: Hugging
    Face math-verify (github.com/huggingface/Math-Verify), as TRL's ``accuracy_reward`` uses it.

    Raises:
        ValueError: ``completions`` and ``answer`` differ in length.
        TypeError: a completion is in neither form (:func:`completion_text`).
        ImportError: math-verify is not installed.
    """
    mv = _math_verify()
    scores: list[float | None] = []
    for c, a in zip(completions, answer, strict=True):
        if a is None:
            scores.append(None)
            continue
        gold = mv.parse(gold_text(str(a)), parsing_timeout=None)
        if not gold:
            scores.append(None)
            continue
        pred = mv.parse(completion_text(c), parsing_timeout=None)
        scores.append(float(mv.verify(gold, pred, timeout_seconds=None)))
    return scores


class RegexReward:
    """A format reward: ``1.0`` when ``pattern`` matches the completion text, else ``0.0`` (:func:`regex`)."""

    __name__ = "regex"

    def __init__(self, pattern: str, mode: str = "search") -> None:
        if mode not in REGEX_MODES:
            raise ValueError(f"regex mode must be one of {list(REGEX_MODES)}, got {mode!r}")
        if not isinstance(pattern, str):
            raise ValueError(f"regex pattern must be a str, got {type(pattern).__name__}")
        try:
            self.compiled = re.compile(pattern, re.DOTALL if mode == "fullmatch" else 0)
        except re.error as exc:
            raise ValueError(f"invalid regex pattern {pattern!r}: {exc}") from None
        self.pattern = pattern
        self.mode = mode

    def __call__(self, completions: list[Any], **kwargs: Any) -> list[float | None]:
        match = self.compiled.search if self.mode == "search" else self.compiled.fullmatch
        return [float(match(completion_text(c)) is not None) for c in completions]

    def __repr__(self) -> str:
        return f"regex({self.pattern!r}, mode={self.mode!r})"


def regex(pattern: str, mode: str = "search") -> RegexReward:
    """A format reward: ``1.0`` when ``re.search(pattern, text)`` (mode ``search``) or
    ``re.fullmatch(pattern, text, re.DOTALL)`` (mode ``fullmatch``: the whole text, ``.`` spanning newlines)
    matches the completion text (unstripped), else ``0.0``; it applies to every sample (never ``None``).

    Inline flags select others (``(?i)``, ``(?m)``, ``(?s)``). Source: the format rewards of DeepSeek-R1
    (``<think>…</think>`` tags), as TRL's ``think_format_reward`` and open-r1's ``format_reward`` write them.

    Raises:
        ValueError: ``pattern`` is not a str or does not compile, or ``mode`` is not one of :data:`REGEX_MODES`.
    """
    return RegexReward(pattern, mode)


def _exact() -> Callable[..., list[float | None]]:
    return exact


def _lcs() -> Callable[..., list[float | None]]:
    return lcs


def _math() -> Callable[..., list[float | None]]:
    _math_verify()  # a missing math-verify fails when the reward loads, not at its first group
    return math


#: Builtin rewards: name → factory taking the reward's ``args`` as keyword arguments, returning the function.
BUILTIN_REWARDS: dict[str, Callable[..., Callable[..., list[float | None]]]] = {
    "exact": _exact,
    "lcs": _lcs,
    "math": _math,
    "regex": regex,
}
