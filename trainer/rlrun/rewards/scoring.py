"""Scoring a group's completions with its env's rewards, off the orchestrator's event loop.

An env's rewards are the reward functions its spec names (``spec.envs[].rewards``: builtin ones or
import paths, TRL ``GRPOTrainer``'s convention) or, when it names none, the env's own
``reward(task, completion)``. The episode's reward is ``Σ weight · score`` over the functions that
apply to it (a function may answer ``None`` for a sample it does not apply to, as in TRL, where
such a score is a NaN left out of the sum); each function's scores are also reported on their own
(``reward/<series>`` in ``metrics.jsonl``).

**A reward never scores a failure as 0.** A function that raises, returns something other than one
number (or ``None``) per completion, or a NaN or infinite score, and a member to which no function
applies, marks that member *failed*: its episode is not made; the orchestrator records the failure
(ledger ``reward_failed``, with the task and the error) and requests the member again, under the
group's retry budget (``rollout.max_group_retries``). A group's scoring that **runs** longer than
``reward_timeout_seconds`` fails every member of it.

**TRL's trainer arguments**: besides the data, TRL's ``GRPOTrainer`` passes ``trainer_state``, ``log_extra``
and ``log_metric`` (:data:`TRAINER_ARGUMENTS`); so does the scorer (:class:`RewardContext`): a
``transformers.TrainerState`` whose ``global_step`` is the policy version that sampled the group (what TRL's is
when it scores: the optimizer steps behind the weights that generated) and ``max_steps`` the run's, and
``log_metric(name, value)`` into ``metrics.jsonl`` (``reward_metrics``, the mean per step). rlrun keeps no
completions table: ``log_extra(column, values)`` is accepted and its values are dropped.

**Where it runs** (:class:`RewardScorer`), never on the orchestrator's loop: a reward whose spec says
``isolation: process`` — the builtin ``math`` unless told otherwise (:data:`rlrun.api.spec.PROCESS_REWARDS`)
— in a worker process (:mod:`rlrun.rewards.workers`), killed and replaced when its call runs past the
timeout, so a reward that computes (holding the GIL, as math-verify does for seconds on a giant exponent)
cannot stall the loop; the others, and an env's own reward, in a worker thread (:mod:`rlrun.worker_threads`:
a sync function in it directly, an async one in an event loop of that thread). A group whose rewards run in
both is scored in both at once. The timeout is each call's **own run time**, from the moment a worker has
it: waiting for one is not the reward's time. :data:`REWARD_THREADS` thread calls run at once; one past its
timeout gives its turn to the next one, and its thread (Python cannot stop a thread) is replaced by a spare
one while it finishes, up to :data:`SPARE_THREADS` such calls; past that many, a call that gets no thread
within its timeout fails saying it waited for a thread.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
from dataclasses import dataclass
from typing import Any

from rlrun.api.spec import EnvSpec
from rlrun.envs.base import Env, Task
from rlrun.rewards.calls import CALL_ARGUMENTS, TRAINER_ARGUMENTS, RewardContext, RewardFunction
from rlrun.rewards.workers import REWARD_PROCESSES, Outcome, RewardWorkers, WorkerFailure, timed_out
from rlrun.worker_threads import NoThreadFree, RanTooLong, WorkerThreads

log = logging.getLogger(__name__)

#: Reward calls a :class:`RewardScorer` runs at once.
REWARD_THREADS = 8
#: Spare threads of a :class:`RewardScorer`: they stand in for those of calls past their timeout while these finish.
SPARE_THREADS = 56


@dataclass
class GroupScores:
    """A group's scores, one item per completion.

    Attributes:
        rewards: the episode's reward, ``Σ weight · score`` (None: the member failed).
        parts: each function's score by series (None: it did not apply, or failed).
        errors: why the member failed (None: it did not).
    """

    rewards: list[float | None]
    parts: dict[str, list[float | None]]
    errors: list[str | None]


def env_rewards(spec: EnvSpec, env: Env) -> list[RewardFunction]:
    """The rewards of the env of ``spec``: those the spec names, else the env's own (series: the env's name).

    Raises:
        the errors of :func:`rlrun.rewards.loading.load_reward` (an unknown builtin, a path that does not
        import, args a builtin refuses).
    """
    if not spec.rewards:
        return [own_reward(spec.name, env)]
    from rlrun.rewards.loading import load_reward

    return [RewardFunction(r.series, r.weight, load_reward(r), spec=r) for r in spec.rewards]


def own_reward(name: str, env: Env) -> RewardFunction:
    """The env's own ``reward(task, completion)`` as the env's one reward (series: the env's ``name`` in the run)."""
    return RewardFunction(series=name, weight=1.0, func=env.reward, own=True)


def task_fields(task: Task) -> dict[str, Any]:
    """The task's fields a reward gets, by name: ``answer`` and every field of ``task.info`` but those named like a
    call argument (:data:`CALL_ARGUMENTS`, :data:`TRAINER_ARGUMENTS`)."""
    fields = {"answer": task.answer, **task.info}
    return {k: v for k, v in fields.items() if k not in CALL_ARGUMENTS and k not in TRAINER_ARGUMENTS}


def env_fields(env: Env, seed: int, tasks: int = 16) -> list[str]:
    """The task fields ``env`` hands its rewards (:func:`task_fields`: ``answer`` and its ``info``), sorted: the union
    over its first ``tasks`` train tasks of ``seed`` (a dataset's tasks all have the same fields: its columns).

    Raises:
        whatever the env's ``task`` raises.
    """
    names = {"answer"}
    for i in range(tasks):
        names.update(task_fields(env.task(seed, i, "train")))
    return sorted(names)


def reward_kwargs(
    task: Task, texts: list[str], completion_ids: list[list[int]], context: RewardContext | None = None
) -> dict[str, Any]:
    """TRL's keyword arguments for one group: ``prompts``, ``completions`` (the texts; for a chat prompt, each
    ``[{"role": "assistant", "content": text}]``), ``completion_ids``, then ``answer`` and every field of
    ``task.info`` (:func:`task_fields`), each a list with one item per completion; with a ``context``, TRL's
    ``trainer_state``, ``log_extra`` and ``log_metric`` (:class:`RewardContext`)."""
    n = len(texts)
    completions: list[Any] = [[{"role": "assistant", "content": t}] for t in texts] if task.is_chat else list(texts)
    kwargs: dict[str, Any] = {"prompts": [task.prompt] * n, "completions": completions}
    kwargs["completion_ids"] = [list(ids) for ids in completion_ids]
    kwargs.update({k: [v] * n for k, v in task_fields(task).items()})
    if context is not None:
        kwargs.update(context.kwargs(n))
    return kwargs


def _call(reward: RewardFunction, task: Task, texts: list[str], kwargs: dict[str, Any]) -> list[Any]:
    if reward.own:
        return [reward.func(task, t) for t in texts]
    out = reward.func(**kwargs)
    if inspect.isawaitable(out):  # an async reward: run in this worker thread's own loop
        out = asyncio.run(_await(out))
    return out


async def _await(awaitable: Any) -> Any:
    return await awaitable


def _number(value: Any) -> float | None:
    """``value`` as a finite float, None for None; ``ValueError`` for anything else."""
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not hasattr(value, "__float__"):  # ints, floats, NumPy and torch scalars
        raise ValueError(f"a score must be a number or None, got {type(value).__name__} {value!r:.40}")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"a score must be finite, got {number}")
    return number


def reward_outcome(reward: RewardFunction, task: Task, texts: list[str], kwargs: dict[str, Any]) -> Outcome:
    """One reward's call on a group of n completions (``kwargs``: :func:`reward_kwargs`), checked.

    Returns:
        Its n scores (None: it does not apply, or failed) and n member errors (``"reward <series>: …"``;
        None: the member does not fail for it). Plain data: a worker process answers with it
        (:mod:`rlrun.rewards.worker`). Blocking.
    """
    n = len(texts)
    scores: list[float | None] = [None] * n
    try:
        out = _call(reward, task, texts, kwargs)
    except Exception as exc:  # any error of user code fails the members, never the run
        return scores, [f"reward {reward.series}: {type(exc).__name__}: {exc}"] * n
    if not isinstance(out, (list, tuple)) or len(out) != n:
        wrong = f"returned {type(out).__name__} {out!r:.60}, not a list of {n} scores"
        return scores, [f"reward {reward.series}: {wrong}"] * n
    errors: list[str | None] = [None] * n
    for k, value in enumerate(out):
        try:
            scores[k] = _number(value)
        except (TypeError, ValueError) as exc:
            errors[k] = f"reward {reward.series}: {exc}"
    return scores, errors


def combine(rewards: list[RewardFunction], found: list[Outcome]) -> GroupScores:
    """A group's scores from each reward's outcome (``found``: :func:`reward_outcome`, in the order of
    ``rewards``): a member fails with the first error a reward gave it, or when no reward applies to it; else
    its reward is ``Σ weight · score`` over those that apply."""
    n = len(found[0][0]) if found else 0
    parts = {r.series: scores for r, (scores, _) in zip(rewards, found, strict=True)}
    errors: list[str | None] = [None] * n
    for _, reward_errors in found:
        errors = [e or r for e, r in zip(errors, reward_errors, strict=True)]
    totals: list[float | None] = []
    for k in range(n):
        applied = [(r.weight, parts[r.series][k]) for r in rewards if parts[r.series][k] is not None]
        if errors[k] is None and not applied:
            errors[k] = "no reward applies to it (every reward function returned None)"
        totals.append(None if errors[k] is not None else sum(w * s for w, s in applied))
    return GroupScores(totals, parts, errors)


def outcomes(
    rewards: list[RewardFunction],
    task: Task,
    texts: list[str],
    completion_ids: list[list[int]],
    context: RewardContext | None = None,
) -> list[Outcome]:
    """Each of ``rewards``' outcome (:func:`reward_outcome`) on ``texts`` of ``task``. Blocking."""
    kwargs = reward_kwargs(task, texts, completion_ids, context)
    return [reward_outcome(reward, task, texts, kwargs) for reward in rewards]


def score_group(
    rewards: list[RewardFunction],
    task: Task,
    texts: list[str],
    completion_ids: list[list[int]],
    context: RewardContext | None = None,
) -> GroupScores:
    """Score ``texts`` (the completions' decoded texts, ``completion_ids`` their token ids) of ``task`` with
    every reward, in this thread (module docstring: weights, ``None``, failures; ``context``: TRL's trainer
    arguments). Blocking: :class:`RewardScorer` scores off the event loop."""
    return combine(rewards, outcomes(rewards, task, texts, completion_ids, context))


class RewardScorer:
    """Scores groups off the event loop: the rewards that run in processes (:attr:`RewardFunction.process`)
    in :class:`~rlrun.rewards.workers.RewardWorkers`, the others in worker threads
    (:class:`~rlrun.worker_threads.WorkerThreads`, ``threads`` calls at once); each call bounded by its own
    run time (module docstring).

    Args:
        threads: calls run at once in threads.
        spare: threads that stand in for those of abandoned calls while they finish.
        processes: worker processes at most (started on the first call that needs one).

    Attributes:
        threads: the worker threads.
        workers: the worker processes.
    """

    def __init__(
        self, threads: int = REWARD_THREADS, spare: int = SPARE_THREADS, processes: int = REWARD_PROCESSES
    ) -> None:
        self.threads = WorkerThreads("reward", threads, spare)
        self.workers = RewardWorkers(processes)

    @property
    def abandoned(self) -> int:
        """Thread calls still running that nobody waits for any more: each holds a thread."""
        return self.threads.abandoned

    async def score(
        self,
        rewards: list[RewardFunction],
        task: Task,
        texts: list[str],
        completion_ids: list[list[int]],
        timeout_s: float,
        context: RewardContext | None = None,
    ) -> GroupScores:
        """:func:`score_group` off the event loop: the rewards that run in processes in a worker process, the
        others in a worker thread, both at once. Every member fails when either call runs longer than
        ``timeout_s`` (seconds of its own run time, from when a worker has it: a process is killed then, a
        thread left to finish on its own), when its worker process dies, or when no thread starts the call
        within ``timeout_s`` because abandoned calls hold every spare thread."""
        in_process = [r for r in rewards if r.process]
        in_threads = [r for r in rewards if not r.process]
        calls = []
        if in_threads:
            calls.append(self._in_thread(in_threads, task, texts, completion_ids, timeout_s, context))
        if in_process:
            calls.append(self.workers.score(in_process, task, texts, completion_ids, timeout_s, context))
        try:
            results = await asyncio.gather(*calls)
        except WorkerFailure as exc:
            return _failed(rewards, texts, str(exc))
        found = dict(zip(map(id, in_threads + in_process), [o for out in results for o in out], strict=True))
        return combine(rewards, [found[id(r)] for r in rewards])

    async def _in_thread(
        self,
        rewards: list[RewardFunction],
        task: Task,
        texts: list[str],
        completion_ids: list[list[int]],
        timeout_s: float,
        context: RewardContext | None,
    ) -> list[Outcome]:
        """:func:`outcomes` in a worker thread, within ``timeout_s`` of its own run time.

        Raises:
            WorkerFailure: past its time, or no thread free within it.
        """
        args = (rewards, task, texts, completion_ids, context)
        try:
            return await self.threads.run(outcomes, *args, timeout_s=timeout_s)
        except RanTooLong:
            raise WorkerFailure(timed_out(timeout_s)) from None
        except NoThreadFree as exc:
            raise WorkerFailure(str(exc)) from None

    def close(self) -> None:
        """Stop the workers: the processes killed (none is left running), the threads not waited for."""
        self.workers.close()
        self.threads.close()


def _failed(rewards: list[RewardFunction], texts: list[str], error: str) -> GroupScores:
    """Every member of a group failed with ``error``."""
    n = len(texts)
    return GroupScores([None] * n, {r.series: [None] * n for r in rewards}, [error] * n)
