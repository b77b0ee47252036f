"""Prompts that do not fit: filtered out of the run, or the run refused at its start
(``spec.rollout.overlong_prompts``).

A prompt fits when it leaves room for ``sampling.max_tokens`` within the context
(:attr:`~rlrun.orchestrator.episodes.EpisodeBuilder.max_prompt_tokens`). One that does not would fail every request
of its group at vLLM, so it is never sent:

* ``filter`` (the default, verl's ``filter_overlong_prompts``): the train source passes its task over; the ledger
  records it (``task_dropped``, reason ``prompt_too_long``: every task index the cursor passes is trained or
  recorded), ``metrics.jsonl`` counts it (``prompts_too_long``, and per env), and each env is warned about once per
  attempt — with how many of its rows do not fit, for a dataset, whose rows are all scanned at the start.
* ``refuse``: a dataset whose rows do not all fit refuses the run at its start, naming how many and the longest, so
  no run dies at task N of a long dataset; a procedural env's first overlong prompt stops the run when it is drawn
  (:class:`~rlrun.orchestrator.episodes.PromptTooLongError`, permanent).

Held-out (``eval``) tasks follow the same rule when the evaluator takes them (:func:`fitting_eval_tasks`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from rlrun.api.spec import RLRunSpec
from rlrun.envs.base import Env, Split, Task
from rlrun.ledger import Ledger, LedgerEvent
from rlrun.orchestrator.episodes import EpisodeBuilder, PromptTooLongError
from rlrun.orchestrator.metrics import StepMetrics
from rlrun.orchestrator.source import TrainSource

log = logging.getLogger(__name__)

#: ``spec.rollout.overlong_prompts``.
Overlong = Literal["filter", "refuse"]
#: The ledger's reason for a task dropped because its prompt does not fit.
PROMPT_TOO_LONG = "prompt_too_long"
#: What a message lists: the first so many tasks whose prompts do not fit.
SHOWN = 3


@dataclass
class Scan:
    """One env's split, every row's prompt measured (:func:`scan`).

    Attributes:
        env: the env's name.
        split: ``train`` or ``eval``.
        rows: prompts measured (one epoch: each row once).
        overlong: ``(tokens, task)`` of each prompt that does not fit, longest first.
        seconds: how long the scan took.
    """

    env: str
    split: Split
    rows: int
    overlong: list[tuple[int, Task]] = field(default_factory=list)
    seconds: float = 0.0

    def describe(self, limit: int | None) -> str:
        """``"3 of 1000 train prompts of env dataset are longer than 488 tokens …"``, naming the longest."""
        tokens, task = self.overlong[0]
        tasks = ", ".join(str(i) for i in sorted(t.index for _, t in self.overlong)[:SHOWN])
        return (
            f"{len(self.overlong)} of {self.rows} {self.split} prompts of env {self.env} are longer than "
            f"{limit} tokens (the model's context less sampling.max_tokens): the longest is {tokens} tokens "
            f"(task {task.index}, starting {str(_text(task))[:60]!r}); tasks {tasks}"
            f"{' …' if len(self.overlong) > SHOWN else ''}"
        )


def _text(task: Task) -> Any:
    return task.prompt if isinstance(task.prompt, str) else task.prompt[-1]["content"]


def finite_rows(env: Env, split: Split) -> int | None:
    """How many rows ``env``'s ``split`` has when it is a finite dataset (``num_rows``), else None (procedural, or
    no such split)."""
    num_rows = getattr(env, "num_rows", None)
    if not callable(num_rows):
        return None
    try:
        return int(num_rows(split))
    except ValueError:  # no eval split
        return None


def scan(episodes: EpisodeBuilder, seed: int, split: Split = "train") -> list[Scan]:
    """Every row's prompt of each finite env of ``episodes`` (:func:`finite_rows`) measured: its tasks ``0 …
    rows − 1`` of ``seed`` (one epoch: each row once). Blocking (a 10⁵-row dataset takes seconds): run it in a
    thread before anything else uses ``episodes``.

    Raises:
        PromptError: a chat prompt and no chat template.
    """
    scans = []
    if episodes.max_prompt_tokens is None:
        return scans
    for name, env in episodes.envs.items():
        rows = finite_rows(env, split)
        if rows is None:
            continue
        t0 = time.perf_counter()
        found = Scan(name, split, rows)
        for i in range(rows):
            task = env.task(seed, i, split)
            tokens = episodes.prompt_overflow(task)
            if tokens is not None:
                found.overlong.append((tokens, task))
        found.overlong.sort(key=lambda x: -x[0])
        found.seconds = time.perf_counter() - t0
        scans.append(found)
    return scans


def refusal(scans: list[Scan], limit: int | None) -> str | None:
    """Why ``refuse`` refuses the run after ``scans`` (:func:`scan`): each env's prompts that do not fit, and what
    to change; None when every prompt fits."""
    found = [f.describe(limit) for f in scans if f.overlong]
    if not found:
        return None
    return (
        f"{'; '.join(found)}. Shorten them, lower sampling.max_tokens, raise rollout.max_model_len, or set "
        "rollout.overlong_prompts: filter to train without them"
    )


class PromptLimit:
    """The train source's admission of tasks by prompt length (module docstring).

    Args:
        spec: the run's spec: ``rollout.overlong_prompts`` (``filter`` or ``refuse``), ``seed``.
        ledger: where dropped tasks are recorded.
        metrics: where they are counted.
    """

    def __init__(self, spec: RLRunSpec, ledger: Ledger, metrics: StepMetrics) -> None:
        self.mode: Overlong = spec.rollout.overlong_prompts
        self.seed, self.ledger, self.metrics = spec.seed, ledger, metrics
        self.episodes: EpisodeBuilder | None = None
        self.warned: set[str] = set()  # envs warned about (once per attempt)

    async def start(self, episodes: EpisodeBuilder, source: TrainSource) -> None:
        """Scan each dataset's train prompts (:func:`scan`): ``refuse`` raises when one does not fit, ``filter`` warns
        once per env with the count; then admit the source's tasks through :meth:`admit`.

        Raises:
            PromptTooLongError: ``refuse``, and a dataset prompt does not fit.
        """
        import asyncio

        self.episodes = episodes
        scans = await asyncio.to_thread(scan, episodes, self.seed)
        for found in scans:
            log.info("prompts: %d rows of env %s measured in %.1f s", found.rows, found.env, found.seconds)
        if self.mode == "refuse" and (problem := refusal(scans, episodes.max_prompt_tokens)) is not None:
            raise PromptTooLongError(problem)
        for found in (f for f in scans if f.overlong):
            what = found.describe(episodes.max_prompt_tokens)
            self.warned.add(found.env)
            log.warning(
                "%s: their tasks are skipped (ledger task_dropped, metrics prompts_too_long); "
                "rollout.overlong_prompts: refuse stops the run instead",
                what,
            )
        source.admit = self.admit

    def admit(self, task: Task) -> bool:
        """Whether ``task``'s prompt fits; one that does not is recorded and counted (``filter``).

        Raises:
            PromptTooLongError: ``refuse``, and it does not fit.
        """
        assert self.episodes is not None
        tokens = self.episodes.prompt_overflow(task)
        if tokens is None:
            return True
        if self.mode == "refuse":
            raise self.episodes.too_long(task, tokens)
        self.ledger.write(LedgerEvent.TASK_DROPPED, env=task.env, index=task.index, reason=PROMPT_TOO_LONG)
        self.metrics.prompt_too_long(task.env)
        if task.env not in self.warned:
            self.warned.add(task.env)
            log.warning(
                "%s: skipped, as is every other prompt of env %s that does not fit (ledger task_dropped, metrics "
                "prompts_too_long); rollout.overlong_prompts: refuse stops the run instead",
                self.episodes.too_long(task, tokens),
                task.env,
            )
        return False


def fitting_eval_tasks(episodes: EpisodeBuilder, tasks: list[Task], mode: Overlong) -> list[Task]:
    """The held-out ``tasks`` whose prompts fit (``filter``: the others left out, with one warning per env).

    Raises:
        PromptTooLongError: ``refuse``, and one does not fit.
    """
    kept, left_out = [], {}
    for task in tasks:
        tokens = episodes.prompt_overflow(task)
        if tokens is None:
            kept.append(task)
        elif mode == "refuse":
            raise episodes.too_long(task, tokens)
        else:
            left_out[task.env] = left_out.get(task.env, 0) + 1
    for env, n in left_out.items():
        log.warning(
            "evaluation: %d held-out prompts of env %s are longer than %s tokens: left out",
            n,
            env,
            episodes.max_prompt_tokens,
        )
    return kept


def check_prompts(spec: RLRunSpec, model_path: str) -> None:
    """With ``rollout.overlong_prompts: refuse``, the orchestrator's refusal at its start, made before any process
    starts (``rlrun local``): every dataset prompt measured with the model's tokenizer (:func:`scan`). ``filter`` (the
    default) checks nothing here: the orchestrator says how many it passes over.

    Raises:
        PromptTooLongError: a prompt does not fit (how many, the longest, what to change).
    """
    if spec.rollout.overlong_prompts != "refuse":
        return
    from rlrun.envs import make_env
    from rlrun.model.resolve import load_tokenizer

    envs = {e.name: make_env(e) for e in spec.envs}
    episodes = EpisodeBuilder.from_spec(load_tokenizer(model_path, spec.model), envs, spec)
    try:
        problem = refusal(scan(episodes, spec.seed), episodes.max_prompt_tokens)
    finally:
        episodes.close()
    if problem is not None:
        raise PromptTooLongError(problem)
