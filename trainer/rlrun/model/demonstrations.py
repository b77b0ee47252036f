"""What the builtin ``tiny`` model is warm-started on: demonstrations drawn from the run's own envs.

A **demonstration** is a train-split task and the completion a good policy would write for it:
``env.demonstration(task)`` when the env has that optional method (``(task) -> str | None``, e.g. a
worked solution; a multi-turn env's ``list[str]`` of turns, played into one transcript:
:mod:`rlrun.model.conversations`), else ``task.answer``; a task with neither is skipped. Its **prompt** is what the
rollout server is sent: a plain-text prompt as is, a chat prompt rendered by the tokenizer's chat
template with the generation prompt. The model is taught ``completion`` + EOS after it.

Invariants: the warm start's tasks are a pure function of the recipe's seed and the envs (the same
recipe draws the same rows), and they come from a seed namespace of their own — the envs are asked
for ``task(env_seed("rlrun-tiny", seed), i, "train")``, a 48-bit seed derived from the string
``"rlrun-tiny:{seed}"``, never adjacent to a manifest's seed (an env that seeds item ``i`` of seed
``s`` with ``s + i`` would otherwise replay the run's stream shifted by one). Each row's env is drawn
with the spec's weights from ``random.Random("rlrun-tiny:{seed}")``; each env's tasks are taken in
index order. Only ``train`` tasks are drawn, so no held-out (``eval``) task is ever warm-started on.

The warm start checks its progress on train tasks of a namespace of their own (``rlrun-tiny-check``),
and a stream can be told not to train on their prompts (``exclude``), so that a check measures what
the model does on tasks it was not taught, as RL will. An env whose tasks are nearly all check tasks
(:data:`PROBE_LIMIT` excluded in a row: a dataset of a few dozen rows) is trained on them after all,
and its :class:`EnvDraws` says so (``checks_trained``).
"""

from __future__ import annotations

import hashlib
import logging
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlrun.envs.base import Env, Task
from rlrun.model.conversations import transcript

log = logging.getLogger(__name__)

#: Tasks in a row an env may yield without a usable demonstration (no answer, or longer than the context)
#: before the warm start stops drawing from it.
PROBE_LIMIT = 64


class NoDemonstrationsError(ValueError):
    """No env of the run yields a usable demonstration; the message says what each env lacked. Retrying cannot
    heal it (``permanent``, exit status 78)."""

    permanent = True
    reason = "NoDemonstrations"


#: The seed namespace of the warm start's tasks.
WARM_START = "rlrun-tiny"
#: The seed namespace of the tasks the warm start checks its progress on (:mod:`rlrun.model.tiny_envs`).
CHECKS = "rlrun-tiny-check"


def env_seed(namespace: str, seed: int) -> int:
    """The env seed ``namespace`` draws tasks with: the first 48 bits of SHA-256 of ``"{namespace}:{seed}"``."""
    return int(hashlib.sha256(f"{namespace}:{seed}".encode()).hexdigest()[:12], 16)


def demonstration(env: Any, task: Task, tokenizer: Any) -> str | None:
    """The completion to teach for ``task``: ``env.demonstration(task)`` when the env has it, else ``task.answer``;
    a multi-turn env's list of turns becomes its transcript (:func:`rlrun.model.conversations.transcript`)."""
    demonstrate = getattr(env, "demonstration", None)
    if not callable(demonstrate):
        return task.answer
    shown = demonstrate(task)
    return transcript(tokenizer, env, task, shown) if isinstance(shown, list) else shown


def render_prompt(tokenizer: Any, task: Task) -> str:
    """``task``'s prompt as the rollout server sees it: plain text as is, a chat prompt (with the task's tool
    schemas, ``task.info["tools"]``) through the chat template with the generation prompt."""
    if isinstance(task.prompt, str):
        return task.prompt
    tools = {"tools": task.info["tools"]} if task.info.get("tools") else {}
    return tokenizer.apply_chat_template(task.prompt, add_generation_prompt=True, tokenize=False, **tools)


@dataclass(frozen=True)
class Row:
    """One warm-start example.

    Attributes:
        env: the env's index in the stream's env list.
        task: the task.
        prompt: its rendered prompt text (special tokens as text: ``<|user|>…``).
        completion: the text to teach after it (EOS is appended when encoding).
        tokens: prompt + completion + EOS, in tokens.
    """

    env: int
    task: Task
    prompt: str
    completion: str
    tokens: int


@dataclass
class EnvDraws:
    """What the warm start drew from one env: tasks asked for, used, and why the others were skipped."""

    name: str
    asked: int = 0
    used: int = 0
    no_answer: int = 0
    too_long: int = 0
    held_for_checks: int = 0
    checks_trained: bool = False
    unusable_in_a_row: int = field(default=0, repr=False)
    held_in_a_row: int = field(default=0, repr=False)

    @property
    def exhausted(self) -> bool:
        """Whether the last :data:`PROBE_LIMIT` tasks in a row were unusable (the env is no longer drawn)."""
        return self.unusable_in_a_row >= PROBE_LIMIT

    def to_dict(self) -> dict[str, Any]:
        """``{"name", "asked", "used", "no_answer", "too_long", "held_for_checks", "checks_trained"}``."""
        keys = ("name", "asked", "used", "no_answer", "too_long", "held_for_checks", "checks_trained")
        return {k: getattr(self, k) for k in keys}


class DemonstrationStream:
    """Warm-start rows drawn from ``envs`` with ``weights`` (module docstring for the order).

    Args:
        envs: ``(name, env)`` of the run's envs, in the spec's order.
        weights: their sampling weights (> 0).
        tokenizer: renders chat prompts and counts tokens (the extra characters of :mod:`.chat_tokenizer`
            do not change a count: an unknown character is one ``<|unk|>``).
        max_tokens: the context: a row longer than this is skipped.
        seed: the recipe's seed.
        namespace: :data:`WARM_START`, or :data:`CHECKS` for the tasks progress is checked on.
        exclude: per env, rendered prompts not to train on (the check tasks'); none: exclude nothing.
        quiet: no warning when it stops drawing from an env. Default: only the :data:`WARM_START` stream warns (the
            check stream draws from the same envs and would say it again).
    """

    def __init__(
        self,
        envs: Sequence[tuple[str, Env]],
        weights: Sequence[float],
        tokenizer: Any,
        max_tokens: int,
        seed: int,
        namespace: str = WARM_START,
        exclude: Sequence[set[str]] | None = None,
        quiet: bool | None = None,
    ) -> None:
        self.envs = [env for _, env in envs]
        self.weights = list(weights)
        self.draws = [EnvDraws(name) for name, _ in envs]
        self.quiet = namespace != WARM_START if quiet is None else quiet
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        self.env_seed = env_seed(namespace, seed)
        self.rng = random.Random(f"{namespace}:{seed}")
        self.exclude = [set(e) for e in exclude] if exclude is not None else [set() for _ in envs]

    def __iter__(self) -> Iterator[Row]:
        return self

    def __next__(self) -> Row:
        """The next usable row (the stream never ends; it raises instead when no env is left).

        Raises:
            NoDemonstrationsError: every env is exhausted (its last :data:`PROBE_LIMIT` tasks unusable).
        """
        while True:
            live = [i for i, d in enumerate(self.draws) if not d.exhausted]
            if not live:
                raise NoDemonstrationsError(self._why_none())
            i = self.rng.choices(live, weights=[self.weights[j] for j in live])[0]
            row = self._try(i)
            if row is not None:
                return row

    def _try(self, i: int) -> Row | None:
        draws, env = self.draws[i], self.envs[i]
        task = env.task(self.env_seed, draws.asked, "train")
        draws.asked += 1
        completion = demonstration(env, task, self.tokenizer)
        if completion is None:
            draws.no_answer += 1
            draws.unusable_in_a_row += 1
            if draws.exhausted and not self.quiet:
                log.warning(
                    "warm start: env %s gave no answer in %d tasks in a row; not drawing from it",
                    draws.name,
                    PROBE_LIMIT,
                )
            return None
        prompt = render_prompt(self.tokenizer, task)
        if prompt in self.exclude[i]:
            draws.held_for_checks += 1
            draws.held_in_a_row += 1
            if draws.held_in_a_row >= PROBE_LIMIT:
                log.warning(
                    "warm start: env %s gave %d check tasks in a row; training on its check tasks too",
                    draws.name,
                    PROBE_LIMIT,
                )
                self.exclude[i] = set()
                draws.checks_trained = True
            return None
        draws.held_in_a_row = 0
        tokens = len(self.tokenizer.encode(prompt + completion, add_special_tokens=False)) + 1
        if tokens > self.max_tokens:
            draws.too_long += 1
            draws.unusable_in_a_row += 1
            if draws.exhausted and not self.quiet:
                log.warning(
                    "warm start: env %s gave %d tasks in a row longer than the context (%d tokens); "
                    "not drawing from it",
                    draws.name,
                    PROBE_LIMIT,
                    self.max_tokens,
                )
            return None
        draws.used += 1
        draws.unusable_in_a_row = 0
        return Row(i, task, prompt, completion, tokens)

    def _why_none(self) -> str:
        return why_no_demonstrations(self.envs, self.draws, self.max_tokens)


def why_no_demonstrations(envs: Sequence[Env], draws: Sequence[EnvDraws], max_tokens: int) -> str:
    """The message of :class:`NoDemonstrationsError`: what each env lacked, and what to set (an env's own
    ``demonstration_hint()`` when it has one, e.g. the dataset env's: which column to name)."""
    parts = []
    for env, d in zip(envs, draws, strict=True):
        hint = getattr(env, "demonstration_hint", None)
        lacked = f"{d.no_answer} of {d.asked} tasks without an answer, {d.too_long} longer than {max_tokens} tokens"
        parts.append(f"{d.name}: {lacked}" + (f"; {hint()}" if callable(hint) and d.no_answer else ""))
    return (
        "the builtin model 'tiny' is warm-started on the envs' answers (task.answer, or env.demonstration(task)) "
        f"and no env of spec.envs gives usable ones ({'; '.join(parts)}). Give the env answers, or use "
        "model.builtin: tiny-reverse or a model by name"
    )


def probe_demonstrations(
    envs: Sequence[tuple[str, Env]], tokenizer: Any, max_tokens: int, seed: int
) -> NoDemonstrationsError | None:
    """What the warm start would refuse, found before it starts (``rlrun validate``): None when some env gives a
    usable demonstration among its first :data:`PROBE_LIMIT` warm-start tasks, else the error it would raise.
    Draws silently, and each env only until its first usable row."""
    streams = [DemonstrationStream([e], [1.0], tokenizer, max_tokens, seed, quiet=True) for e in envs]
    for stream in streams:
        try:
            next(stream)
            return None
        except NoDemonstrationsError:
            continue
    draws = [s.draws[0] for s in streams]
    return NoDemonstrationsError(why_no_demonstrations([env for _, env in envs], draws, max_tokens))


def packed(rows: Iterator[Row], max_rows: int, max_tokens: int) -> Iterator[list[Row]]:
    """``rows`` in order, grouped into batches of up to ``max_rows`` rows and ``max_tokens`` tokens once padded to
    the batch's longest row (a batch holds at least one row, whatever its length); endless when ``rows`` is."""
    pending = next(rows, None)
    while pending is not None:
        batch, longest = [pending], pending.tokens
        pending = next(rows, None)
        while pending is not None and len(batch) < max_rows:
            if max(longest, pending.tokens) * (len(batch) + 1) > max_tokens:
                break
            batch.append(pending)
            longest = max(longest, pending.tokens)
            pending = next(rows, None)
        yield batch
