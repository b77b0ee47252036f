"""Evaluation on held-out tasks: does the policy get better at the task, or only surer of itself?

A rising training reward does not say the model learned (issue 27: the default example's reward rose
by 0.15 while its held-out greedy exact match fell from 0.445 to 0.185 — the policy became certain,
not correct). So every ``evaluation.interval`` steps, at the start and at the end, the orchestrator
scores the policy on ``evaluation.tasks`` tasks of each env's **eval split** (never a training task:
:mod:`rlrun.envs.base`), the same tasks each time:

- **greedy** (temperature 0, one completion per task): ``greedy_reward`` (mean reward) and
  ``greedy_solved`` (share of tasks whose reward is the top one, 1: exact match for reverse-text);
- **sampled** (the run's own sampling, ``k = evaluation.samples_per_task`` completions per task):
  ``sampled_reward`` (mean over the ``k·tasks`` completions) and ``pass_at_k`` (share of tasks with at
  least one solved completion: the unbiased pass@k estimator of Chen et al. 2021, "Evaluating Large
  Language Models Trained on Code", eq. 1, with ``n = k`` samples);
- ``completion_len_mean`` of the greedy completions (tokens).

Each line of ``<run_dir>/eval.jsonl`` holds them overall and ``per_env``, with the ``policy_version``
evaluated (trainer steps: the weights after that step; 0 is the model the run started from).

How it runs without stalling training: the eval requests go to the rollout servers beside the training
requests (vLLM batches them together), and the weights are held for their duration — the next weight push
waits until the round is answered, so every eval completion comes from the version it is labelled with
(a push pauses a server once the requests out are answered, at most :data:`rlrun.rollout.client.DRAIN_S`;
one answered after the pause is refused, and the round fails). Training goes on meanwhile: the trainer trains on what is queued,
and the rollout servers keep generating with the held version, within ``max_off_policy_steps``. The cost is
the servers' time on ``tasks × (1 + k)`` completions per round (``benchmarks/learning.py`` measures the
step time with evaluation on and off). Eval work never enters the dispatcher, the sink, the journal or the
ledger: it is never trained and never in a training fate.

A round that fails (a server error, no server holding the version) is logged and skipped; evaluation
never fails the run, and never stalls it for long: the hold lasts at most :data:`MAX_HOLD_S` (a server that
stops answering must not keep the weights back until ``evaluation.timeout_seconds``); a round whose weights
moved before it was answered is discarded, not written with the wrong label.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from rlrun.api.spec import EvaluationSpec, RLRunSpec, SamplingSpec
from rlrun.envs.base import SOLVED_REWARD, Env, Task
from rlrun.orchestrator.episodes import EpisodeBuilder
from rlrun.orchestrator.prompts import Overlong, fitting_eval_tasks
from rlrun.orchestrator.turns import Conversation, play_all
from rlrun.rollout.client import Completion, RolloutClient, RolloutError
from rlrun.rundir import end_torn_line, read_jsonl

log = logging.getLogger(__name__)

#: What a task's request came to: its completions and, for a multi-turn env, their conversations (:mod:`.turns`).
Answers = tuple[list[Completion], list[Conversation] | None]

#: Longest hold of the weight pushes by one round, seconds (the round goes on; if the weights move before it
#: is answered, it is discarded).
MAX_HOLD_S = 60.0


def greedy(sampling: SamplingSpec) -> SamplingSpec:
    """``sampling`` at temperature 0 (vLLM's greedy decoding; the spec's own bounds forbid 0)."""
    return sampling.model_copy(update={"temperature": 0.0, "top_p": 1.0})


class Evaluator:
    """Evaluates a policy version on the rollout servers (module docstring).

    Args:
        spec: the ``evaluation`` section.
        sampling: the run's sampling (the sampled half; greedy is it at temperature 0).
        episodes: the run's prompts (chat template included) and rewards (:class:`EpisodeBuilder`); its ``envs``
            (the order of the run's ``envs``) are evaluated.
        seed: the run's seed (the eval split's stream).
        path: ``eval.jsonl`` (appended to).
        attempt: written on each line.
        overlong_prompts: ``spec.rollout.overlong_prompts``: a held-out task whose prompt does not fit is left out
            (``filter``), or refused (``refuse``: :func:`~rlrun.orchestrator.prompts.fitting_eval_tasks`).
    """

    def __init__(
        self,
        spec: EvaluationSpec,
        sampling: SamplingSpec,
        episodes: EpisodeBuilder,
        seed: int,
        path: Path,
        attempt: int = 0,
        overlong_prompts: Overlong = "filter",
    ) -> None:
        self.spec, self.sampling, self.episodes, self.envs = spec, sampling, episodes, episodes.envs
        self.path, self.attempt = path, attempt
        tasks = [env.task(seed, i, "eval") for env in self.envs.values() for i in range(spec.tasks)]
        self.tasks: list[Task] = fitting_eval_tasks(episodes, tasks, overlong_prompts)
        end_torn_line(path)  # a line cut short by a kill would glue this attempt's first one to it
        self.evaluated = {row["policy_version"] for row in read_jsonl(path) if "policy_version" in row}

    @classmethod
    def for_run(
        cls,
        spec: RLRunSpec,
        envs: dict[str, Env],
        tokenizer: Any,
        path: Path,
        attempt: int,
        episodes: EpisodeBuilder | None = None,
    ) -> Evaluator | None:
        """The evaluator of a run (None when ``spec.evaluation`` is off), with a Hugging Face ``tokenizer``; ``episodes``:
        the run's own builder (the dispatcher's: its rendered prompts and reward threads), else one of its own."""
        if not spec.evaluation.enabled:
            return None
        episodes = episodes or EpisodeBuilder.for_run(tokenizer, envs, spec)
        return cls(spec.evaluation, spec.sampling, episodes, spec.seed, path, attempt, spec.rollout.overlong_prompts)

    def resumed_at(self, version: int) -> None:
        """An attempt resumed from the checkpoint of step ``version``: the versions past it that an earlier attempt
        evaluated are evaluated again when reached (their weights are trained again, with other samples; the last
        line of each version is the one the trackers keep, :mod:`rlrun.tracking.steps`)."""
        self.evaluated = {v for v in self.evaluated if v <= version}

    def due(self, version: int, max_steps: int) -> bool:
        """Whether ``version`` should be evaluated: the start (0), each ``interval``-th step and the last one,
        unless it was (by this attempt or one before it)."""
        if version in self.evaluated:
            return False
        return version == 0 or version == max_steps or version % self.spec.interval == 0

    def due_at_start(self, version: int, max_steps: int) -> bool:
        """Whether an attempt starting on ``version`` should evaluate it: when :meth:`due`, or when the last
        evaluation point it passed has no evaluation from it to ``version`` (a round cut short by a preemption:
        the resumed version stands in for it)."""
        last_point = version // self.spec.interval * self.spec.interval
        return self.due(version, max_steps) or not any(last_point <= v <= version for v in self.evaluated)

    def crossed(self, before: int, after: int, max_steps: int) -> bool:
        """Whether a weight update from ``before`` to ``after`` passed an evaluation point (updates can skip
        versions: the newest broadcast is loaded)."""
        if after in self.evaluated or after <= before:
            return False
        return after == max_steps or after // self.spec.interval > before // self.spec.interval

    async def evaluate(self, clients: list[RolloutClient], version: int) -> dict:
        """Evaluate ``version`` on ``clients`` (each must hold it and keep it until this returns) and append
        the line to ``eval.jsonl``; returns it.

        Raises:
            RolloutError, httpx.HTTPError: a request failed (nothing is written).
            ValueError: no client.
        """
        if not clients:
            raise ValueError("no rollout server to evaluate on")
        t0 = time.monotonic()
        k = self.spec.samples_per_task
        plain = greedy(self.sampling)

        async def ask(i: int, task: Task, sampling: SamplingSpec, n: int) -> Answers:
            client, prompt = clients[i % len(clients)], list(self.episodes.prompt_ids(task))
            completions = await client.complete(prompt, sampling, n=n)
            if not self.episodes.multi_turn(task):
                return completions, None
            io = self.episodes.turn_io(task, lambda ids: _one(client.complete(ids, sampling, n=1)))
            return completions, await play_all(self.envs[task.env], task, prompt, completions, io)

        answers = await asyncio.gather(
            *(ask(i, t, plain, 1) for i, t in enumerate(self.tasks)),
            *(ask(i + 1, t, self.sampling, k) for i, t in enumerate(self.tasks)),
        )
        moved = [c.base_url for c in clients if c.loaded_version != version]
        if moved:  # the hold ran out and a push went ahead: some completions may come from newer weights
            raise RolloutError(f"the weights of {moved} moved past policy {version} before the round was answered")
        greedy_answers, sampled_answers = answers[: len(self.tasks)], answers[len(self.tasks) :]
        per_env: dict[str, dict[str, list[float]]] = {name: {} for name in self.envs}
        for task, (gc, gt), (sc, st) in zip(self.tasks, greedy_answers, sampled_answers, strict=True):
            stats = per_env[task.env]
            reward, *sampled = await self._score(task, [*gc, *sc], None if gt is None else [*gt, *st], version)
            for key, value in (
                ("greedy_reward", reward),
                ("greedy_solved", float(reward >= SOLVED_REWARD)),
                ("sampled_reward", sum(sampled) / len(sampled)),
                ("pass_at_k", float(any(r >= SOLVED_REWARD for r in sampled))),
                ("completion_len_mean", float(len(gc[0].token_ids if gt is None else gt[0].completion_ids))),
            ):
                stats.setdefault(key, []).append(value)
        envs = {name: {key: sum(v) / len(v) for key, v in stats.items()} for name, stats in per_env.items()}
        keys = ("greedy_reward", "greedy_solved", "sampled_reward", "pass_at_k", "completion_len_mean")
        line = {
            "policy_version": version,
            "attempt": self.attempt,
            **{key: sum(e[key] for e in envs.values()) / len(envs) for key in keys},
            "tasks": len(self.tasks),
            "samples_per_task": k,
            "per_env": envs,
            "seconds": round(time.monotonic() - t0, 3),
            "time": time.time(),
        }
        with open(self.path, "a") as fh:
            fh.write(json.dumps(line) + "\n")
        self.evaluated.add(version)
        log.info(
            "evaluation of policy %d: greedy solved %.3f (reward %.3f), sampled reward %.3f, pass@%d %.3f; "
            "%d held-out tasks in %.1f s",
            version, line["greedy_solved"], line["greedy_reward"], line["sampled_reward"], k, line["pass_at_k"],
            len(self.tasks), line["seconds"],
        )  # fmt: skip
        return line

    async def _score(
        self, task: Task, completions: list[Completion], conversations: list[Conversation] | None, version: int
    ) -> list[float]:
        """The rewards of ``completions`` of ``task`` (a multi-turn env's: of its ``conversations``) sampled by policy
        ``version``, as training scores them (their ``log_metric`` calls dropped); a failed reward counts 0 here (an
        evaluation has no member to ask again) and is logged."""
        scores = await self.episodes.score(task, completions, conversations, version, training=False)
        for error in {e for e in scores.errors if e is not None}:
            log.warning("evaluation: env %s task %d: %s (scored 0)", task.env, task.index, error)
        return [0.0 if r is None else r for r in scores.rewards]


async def _one(request: Awaitable[list[Completion]]) -> Completion:  # a multi-turn episode's next turn
    return (await request)[0]


class EvalRounds:
    """When the orchestrator evaluates, and the hold on weight pushes meanwhile (module docstring).

    A policy object like :mod:`.liveness`: :meth:`bind` wires it; the loop calls :meth:`start` once the attempt
    has begun, :meth:`updated` after each weight push (and checks :attr:`holding` before the next one), and
    :meth:`finish` at the end of the run.
    """

    def __init__(self) -> None:
        self.evaluator: Evaluator | None = None
        self._round: asyncio.Task | None = None
        self._since = 0.0  # when the round began (monotonic seconds)

    def bind(self, evaluator: Evaluator | None, clients: Callable[[], list[RolloutClient]], max_steps: int) -> None:
        """``evaluator`` (None: evaluation off), ``clients()`` the rollout servers in use, the run's last step."""
        self.evaluator, self.clients, self.max_steps = evaluator, clients, max_steps

    @property
    def holding(self) -> bool:
        """True while a round runs, for at most :data:`MAX_HOLD_S`: the weights it scores stay on the servers."""
        return self.running and time.monotonic() - self._since < MAX_HOLD_S

    @property
    def running(self) -> bool:
        """Whether a round is under way."""
        return self._round is not None and not self._round.done()

    def start(self, version: int) -> None:
        """At an attempt's start on ``version`` (the servers hold it now; the step resumed from): forget the
        evaluations past it (:meth:`Evaluator.resumed_at`), and evaluate it if due (:meth:`Evaluator.due_at_start`)."""
        if self.evaluator is None:
            return
        self.evaluator.resumed_at(version)
        if not self.running and self.evaluator.due_at_start(version, self.max_steps):
            self._begin(version)

    def updated(self, before: int, after: int) -> None:
        """The servers went from policy ``before`` to ``after``: evaluate ``after`` if that passed a point."""
        if self.evaluator is not None and not self.running and self.evaluator.crossed(before, after, self.max_steps):
            self._begin(after)

    def _begin(self, version: int) -> None:
        self._since = time.monotonic()
        self._round = asyncio.get_running_loop().create_task(self.run(version))

    async def run(self, version: int) -> dict | None:
        """One round on the servers holding ``version``; None when it failed (logged, never raised)."""
        assert self.evaluator is not None
        clients = [c for c in self.clients() if c.loaded_version == version and not c.closed]
        try:
            return await asyncio.wait_for(
                self.evaluator.evaluate(clients, version), self.evaluator.spec.timeout_seconds
            )
        except Exception as exc:  # evaluation never fails the run (a timeout included)
            why = (
                f"no answer within {self.evaluator.spec.timeout_seconds:.0f} s"
                if isinstance(exc, TimeoutError)
                else exc
            )
            log.warning("evaluation of policy %d skipped: %s: %s", version, type(exc).__name__, why)
            return None

    async def finish(self, version: int, load_last: Callable[[], Awaitable[object]]) -> None:
        """At the end of the run (the servers hold ``version``): wait for a round under way, then evaluate the
        last step's policy unless done — after ``await load_last()`` gives it to the servers, when they hold an
        older one."""
        if self._round is not None:
            await asyncio.gather(self._round, return_exceptions=True)
        if self.evaluator is None or self.max_steps in self.evaluator.evaluated:
            return
        if version < self.max_steps:
            try:
                await load_last()
            except Exception as exc:  # evaluation never fails the run
                log.warning(
                    "final evaluation skipped: the weights of step %d could not be loaded: %s", self.max_steps, exc
                )
                return
        await self.run(self.max_steps)

    def cancel(self) -> None:
        """Stop a round under way (the attempt ends)."""
        if self._round is not None:
            self._round.cancel()


async def evaluate_weights(
    url: str, spec: RLRunSpec, model_path: str, weights: Path | None, version: int, out: Path, **overrides: int
) -> dict:
    """Evaluate the weights in ``weights`` (None: the model as loaded) as policy ``version`` on the rollout server
    at ``url``, with ``spec``'s envs, sampling, seed and ``evaluation`` (``overrides``: ``tasks``,
    ``samples_per_task``); the line is appended to ``out``. What ``rlrun eval`` runs.

    Raises:
        WeightsError: the weights do not fit the model (the server is not touched).
        RolloutError, httpx.HTTPError: the server failed to load them or to answer.
    """
    from transformers import AutoTokenizer

    from rlrun.envs import make_env
    from rlrun.model.resolve import pretrained_kwargs
    from rlrun.orchestrator.weights import push_weights, weights_reference

    evaluation = spec.evaluation.model_validate({**spec.evaluation.model_dump(), **overrides, "enabled": True})
    client = RolloutClient(url)
    try:
        if weights is not None:
            reference = weights_reference(spec, model_path)
            push = await push_weights([client], weights, version, reference)
            if push.unreachable:
                raise RolloutError(f"{url} went away while loading {weights}: {push.unreachable[url]}")
        tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, model_path, **pretrained_kwargs(spec.model))
        envs = {e.name: make_env(e) for e in spec.envs}
        evaluator = Evaluator.for_run(spec.model_copy(update={"evaluation": evaluation}), envs, tokenizer, out, 0)
        return await evaluator.evaluate([client], version)
    finally:
        await client.aclose()
