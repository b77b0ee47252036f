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

Each line of ``<run_dir>/eval.jsonl`` holds them overall and ``per_env`` (and, for an env whose tasks name
their family — a reasoning-gym mixture's member: :data:`rlrun.envs.base.FAMILY` —, per family in its
``per_family``), with the ``policy_version`` evaluated (trainer steps: the weights after that step; 0 is the
model the run started from).

How it runs without stalling training: the eval requests go to the rollout servers beside the training
requests (vLLM batches them together), and the weights are held for their duration — the next weight push
waits until the round is answered, so every eval completion comes from the version it is labelled with
(a push pauses a server once the requests out are answered, at most :data:`rlrun.rollout.client.DRAIN_S`;
one answered after the pause is refused, and the round fails). Training goes on meanwhile: the trainer trains on what is
queued, and the rollout servers keep generating with the held version, within ``max_off_policy_steps``. The cost is
the servers' time on ``tasks × (1 + k)`` completions per round (``benchmarks/learning.py`` measures the
step time with evaluation on and off). Eval work never enters the dispatcher, the sink, the journal or the
ledger: it is never trained and never in a training fate.

A round begins once no weight update is under way on the servers (it waits for a reload to end: a round sent
into a reload window would be refused), and a completion refused because a reload began meanwhile is asked
again once the server serves. The **final** round (the last step's policy) is held like any other — the
follower pushes nothing while it runs — and always runs: it waits for an update under way, loads the last
step's weights where no server holds them, then evaluates (issue 47.10: it was skipped when the follower's
push of the same weights began while it was loading them, in 2 of 6 runs).

A round that fails (a server error, no server holding the version, no answer within
``evaluation.timeout_seconds``) is **dropped**: never raised, but counted (``eval_rounds_dropped`` in
``metrics.jsonl``, ``rlrun_eval_rounds_dropped_total``) and said (a warning naming the policy and why).
Evaluation never fails the run, and never stalls it for long: the hold lasts at most :data:`MAX_HOLD_S` (a
server that stops answering must not keep the weights back until ``evaluation.timeout_seconds``), and a round
still unanswered then says so in a warning; the seconds rounds held the weight pushes are counted
(``eval_hold_s``, ``rlrun_eval_hold_seconds_total``). A round whose weights moved before it was answered is
discarded (dropped), not written with the wrong label.
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
from rlrun.envs.base import FAMILY, MAX_FAMILIES, SOLVED_REWARD, Env, Task
from rlrun.orchestrator.episodes import EpisodeBuilder
from rlrun.orchestrator.metrics import StepMetrics
from rlrun.orchestrator.prompts import Overlong, fitting_eval_tasks
from rlrun.orchestrator.turns import Conversation, play_all
from rlrun.rollout.client import Completion, RolloutClient, RolloutError, ServerReloading
from rlrun.rundir import end_torn_line, read_jsonl

log = logging.getLogger(__name__)

#: What a task's request came to: its completions and, for a multi-turn env, their conversations (:mod:`.turns`).
Answers = tuple[list[Completion], list[Conversation] | None]

#: Longest hold of the weight pushes by one round, seconds (the round goes on; if the weights move before it
#: is answered, it is discarded).
MAX_HOLD_S = 60.0
#: Seconds between looks at the servers while a round waits for a weight update under way to end.
SETTLE_POLL_S = 0.05


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
    def from_spec(
        cls,
        spec: RLRunSpec,
        envs: dict[str, Env],
        tokenizer: Any,
        path: Path,
        attempt: int,
        episodes: EpisodeBuilder | None = None,
    ) -> Evaluator | None:
        """The evaluator of a run (None when ``spec.evaluation`` is off), with a Hugging Face ``tokenizer``;
        ``episodes``: the run's own builder (the dispatcher's: its rendered prompts and reward threads), else one of its
        own."""
        if not spec.evaluation.enabled:
            return None
        episodes = episodes or EpisodeBuilder.from_spec(tokenizer, envs, spec)
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
            completions = await _complete(client, prompt, sampling, n)
            if not self.episodes.multi_turn(task):
                return completions, None
            io = self.episodes.turn_io(task, lambda ids: _one(_complete(client, ids, sampling, 1)))
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
        per_family: dict[str, dict[str, dict[str, list[float]]]] = {name: {} for name in self.envs}
        for task, (gc, gt), (sc, st) in zip(self.tasks, greedy_answers, sampled_answers, strict=True):
            reward, *sampled = await self._score(task, [*gc, *sc], None if gt is None else [*gt, *st], version)
            family, families = task.info.get(FAMILY), per_family[task.env]
            named = isinstance(family, str) and family != ""
            named = named and (family in families or len(families) < MAX_FAMILIES)
            length = len(gc[0].token_ids if gt is None else gt[0].completion_ids)
            for stats in (per_env[task.env], *([families.setdefault(family, {})] if named else [])):
                for key, value in (
                    ("greedy_reward", reward),
                    ("greedy_solved", float(reward >= SOLVED_REWARD)),
                    ("sampled_reward", sum(sampled) / len(sampled)),
                    ("pass_at_k", float(any(r >= SOLVED_REWARD for r in sampled))),
                    ("completion_len_mean", float(length)),
                ):
                    stats.setdefault(key, []).append(value)
        envs: dict[str, dict[str, Any]] = {name: _means(stats) for name, stats in per_env.items()}
        for name, families in per_family.items():
            if families:
                envs[name]["per_family"] = {f: _means(stats) for f, stats in sorted(families.items())}
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
            version,
            line["greedy_solved"],
            line["greedy_reward"],
            line["sampled_reward"],
            k,
            line["pass_at_k"],
            len(self.tasks),
            line["seconds"],
        )
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


def _means(stats: dict[str, list[float]]) -> dict[str, Any]:
    return {key: sum(v) / len(v) for key, v in stats.items()}


async def _one(request: Awaitable[list[Completion]]) -> Completion:  # a multi-turn episode's next turn
    return (await request)[0]


async def _complete(client: RolloutClient, ids: list[int], spec: SamplingSpec, n: int) -> list[Completion]:
    """``client``'s completions of the prompt ``ids``; one refused because a weight update of the server
    began (nothing generated, or answered after its pause) is asked again once the server serves: the
    round's end checks that its weights did not move (:meth:`Evaluator.evaluate`), and its timeout bounds
    the waits."""
    while True:
        try:
            return await client.complete(ids, spec, n=n)
        except ServerReloading:
            await client.wait_serving()


class EvalRounds:
    """When the orchestrator evaluates, and the hold on weight pushes meanwhile (module docstring).

    A policy object like :mod:`.liveness`: :meth:`bind` wires it; the loop calls :meth:`start` once the attempt
    has begun, :meth:`updated` after each weight push (and checks :attr:`holding` before the next one), and
    :meth:`finish` at the end of the run. What it drops and holds is counted on the bound
    :class:`~rlrun.orchestrator.metrics.StepMetrics` (``eval_rounds_dropped``, ``eval_hold_s``).
    """

    def __init__(self) -> None:
        self.evaluator: Evaluator | None = None
        self.metrics: StepMetrics | None = None
        self._round: asyncio.Task | None = None
        self._since = 0.0  # when the round began (monotonic seconds)

    def bind(
        self,
        evaluator: Evaluator | None,
        clients: Callable[[], list[RolloutClient]],
        max_steps: int,
        metrics: StepMetrics | None = None,
    ) -> None:
        """``evaluator`` (None: evaluation off), ``clients()`` the rollout servers in use, the run's last
        step, and the ``metrics`` that count dropped rounds and hold seconds (None: not counted)."""
        self.evaluator, self.clients, self.max_steps, self.metrics = evaluator, clients, max_steps, metrics

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
            self._begin(self.run(version), version)

    def updated(self, before: int, after: int) -> None:
        """The servers went from policy ``before`` to ``after``: evaluate ``after`` if that passed a point."""
        if self.evaluator is not None and not self.running and self.evaluator.crossed(before, after, self.max_steps):
            self._begin(self.run(after), after)

    def _begin(self, work: Awaitable[dict | None], version: int) -> asyncio.Task:
        """Run ``work`` (the round of ``version``) as the round under way: it holds the weight pushes from
        now."""
        loop = asyncio.get_running_loop()
        self._since = since = time.monotonic()
        self._round = task = loop.create_task(work)
        late = loop.call_later(MAX_HOLD_S, self._unanswered, task, version)

        def ended(_: asyncio.Task) -> None:
            late.cancel()
            if self.metrics is not None:  # the pushes were held from its start until its end or MAX_HOLD_S
                self.metrics.eval_hold_seconds += min(time.monotonic() - since, MAX_HOLD_S)

        task.add_done_callback(ended)
        return task

    def _unanswered(self, task: asyncio.Task, version: int) -> None:
        if not task.done():
            assert self.evaluator is not None
            timeout = self.evaluator.spec.timeout_seconds
            log.warning(
                "evaluation of policy %d unanswered after %.0f s: the weight pushes it held go on; it is "
                "dropped if the weights move before it is answered, or at evaluation.timeout_seconds "
                "(%.0f s)",
                *(version, MAX_HOLD_S, timeout),
            )

    async def _settled(self, deadline: float) -> None:
        """Return once no weight update is under way on a server in use (or at monotonic ``deadline``)."""
        while any(c.updating for c in self.clients() if not c.closed) and time.monotonic() < deadline:
            await asyncio.sleep(SETTLE_POLL_S)

    def _dropped(self, version: int, why: str) -> None:
        dropped = 1
        if self.metrics is not None:
            self.metrics.eval_rounds_dropped += 1
            dropped = self.metrics.eval_rounds_dropped
        log.warning("evaluation of policy %d dropped (%d this attempt): %s", version, dropped, why)

    async def run(self, version: int) -> dict | None:
        """One round on the servers holding ``version``, begun once no weight update is under way; None when
        it was dropped (counted and logged, never raised)."""
        assert self.evaluator is not None
        timeout = self.evaluator.spec.timeout_seconds

        async def round_() -> dict:
            await self._settled(time.monotonic() + timeout)
            clients = [c for c in self.clients() if c.loaded_version == version and not c.closed]
            return await self.evaluator.evaluate(clients, version)

        try:
            return await asyncio.wait_for(round_(), timeout)
        except Exception as exc:  # evaluation never fails the run (a timeout included)
            why = f"no answer within {timeout:.0f} s" if isinstance(exc, TimeoutError) else exc
            self._dropped(version, f"{type(exc).__name__}: {why}")
            return None

    async def finish(self, load_last: Callable[[], Awaitable[object]]) -> None:
        """At the end of the run: wait for a round under way, then evaluate the last step's policy unless done
        (:meth:`_final`: it always runs, held like any round)."""
        if self._round is not None:
            await asyncio.gather(self._round, return_exceptions=True)
        if self.evaluator is None or self.max_steps in self.evaluator.evaluated:
            return
        await asyncio.gather(self._begin(self._final(load_last), self.max_steps), return_exceptions=True)

    async def _final(self, load_last: Callable[[], Awaitable[object]]) -> dict | None:
        """The final round: once a weight update under way has ended (the follower's push of the last weights,
        begun before this round held the pushes), ``await load_last()`` gives the last step's weights to the
        servers if none holds them, then :meth:`run`."""
        assert self.evaluator is not None
        await self._settled(time.monotonic() + self.evaluator.spec.timeout_seconds)
        if not any(c.loaded_version == self.max_steps for c in self.clients() if not c.closed):
            try:
                await load_last()
            except Exception as exc:  # evaluation never fails the run
                why = f"the weights of step {self.max_steps} could not be loaded: {exc}"
                self._dropped(self.max_steps, why)
                return None
        return await self.run(self.max_steps)

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
    from rlrun.envs import make_env
    from rlrun.model.resolve import load_tokenizer
    from rlrun.orchestrator.weights import push_weights, weights_reference

    evaluation = spec.evaluation.model_validate({**spec.evaluation.model_dump(), **overrides, "enabled": True})
    client = RolloutClient(url)
    try:
        if weights is not None:
            reference = weights_reference(spec, model_path)
            push = await push_weights([client], weights, version, reference)
            if push.unreachable:
                raise RolloutError(f"{url} went away while loading {weights}: {push.unreachable[url]}")
        tokenizer = await asyncio.to_thread(load_tokenizer, model_path, spec.model)
        envs = {e.name: make_env(e) for e in spec.envs}
        evaluator = Evaluator.from_spec(spec.model_copy(update={"evaluation": evaluation}), envs, tokenizer, out, 0)
        return await evaluator.evaluate([client], version)
    finally:
        await client.aclose()
