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

**Where it runs**: :class:`RewardScorer` runs each group's scoring in a worker thread (a sync
function in it directly, an async one in an event loop of that thread), never on the orchestrator's
loop. The timeout is the call's **own run time**, from the moment a worker thread starts it: waiting
for a thread is not the reward's time. :data:`REWARD_THREADS` calls run at once; a call past its
timeout gives its turn to the next one, and its thread (Python cannot stop a thread) is replaced by a
spare one while it finishes, up to :data:`SPARE_THREADS` such calls — so a slow reward fails only its own
calls. Past that many hung calls, a call that gets no thread within its timeout fails with a message that
says it waited for a thread (a reward that can hang should bound its own work).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from rlrun.api.spec import EnvSpec
from rlrun.envs.base import Env, Task

log = logging.getLogger(__name__)

#: Reward calls a :class:`RewardScorer` runs at once.
REWARD_THREADS = 8
#: Spare threads of a :class:`RewardScorer`: they stand in for those of calls past their timeout while these finish.
SPARE_THREADS = 56
#: Keyword arguments a reward function gets from the call itself; a task field of the same name is not passed.
CALL_ARGUMENTS = ("prompts", "completions", "completion_ids")
#: Keyword arguments TRL's trainer adds for every reward (:class:`RewardContext`); a task field of the same name
#: is not passed either.
TRAINER_ARGUMENTS = ("trainer_state", "log_extra", "log_metric")


@dataclass(frozen=True)
class RewardContext:
    """What TRL's ``GRPOTrainer`` tells a reward besides the data (:data:`TRAINER_ARGUMENTS`).

    Attributes:
        step: ``trainer_state.global_step``: the policy version that sampled the group (trainer steps behind its
            weights; TRL's ``global_step`` when it scores an on-policy batch).
        max_steps: ``trainer_state.max_steps``: the run's last step.
        log_metric: where ``log_metric(name, value)`` goes (None: dropped, e.g. in an evaluation).
    """

    step: int = 0
    max_steps: int = 0
    log_metric: Callable[[str, float], None] | None = None

    def kwargs(self, n: int) -> dict[str, Any]:
        """``trainer_state``, ``log_extra`` and ``log_metric`` for a call scoring ``n`` completions."""
        from transformers.trainer_callback import TrainerState  # imports torch: the orchestrator has it already

        def log_extra(column: str, values: list) -> None:  # rlrun keeps no completions table (module docstring)
            if not isinstance(column, str) or len(values) != n:
                raise ValueError(f"log_extra(column, values) takes a column name and {n} values, got {column!r}")

        def log_metric(name: str, value: float) -> None:
            if not isinstance(name, str) or not name:
                raise ValueError(f"log_metric(name, value): name must be a non-empty string, got {name!r}")
            number = float(value)  # ints, floats, NumPy and torch scalars
            if self.log_metric is not None and math.isfinite(number):
                self.log_metric(name, number)

        state = TrainerState(global_step=self.step, max_steps=self.max_steps)
        return {"trainer_state": state, "log_extra": log_extra, "log_metric": log_metric}


@dataclass(frozen=True)
class RewardFunction:
    """One reward of an env, ready to call.

    Attributes:
        series: its name in metrics (``reward/<series>``).
        weight: its weight in the episode's reward.
        func: a TRL-convention function (``own`` False), or the env's ``reward(task, text)`` (``own`` True).
        own: whether ``func`` is the env's own reward.
    """

    series: str
    weight: float
    func: Callable[..., Any]
    own: bool = False


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

    return [RewardFunction(series=r.series, weight=r.weight, func=load_reward(r)) for r in spec.rewards]


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


def score_group(
    rewards: list[RewardFunction],
    task: Task,
    texts: list[str],
    completion_ids: list[list[int]],
    context: RewardContext | None = None,
) -> GroupScores:
    """Score ``texts`` (the completions' decoded texts, ``completion_ids`` their token ids) of ``task`` with every
    reward (module docstring: weights, ``None``, failures; ``context``: TRL's trainer arguments). Blocking: run it in
    a worker thread."""
    n = len(texts)
    kwargs = reward_kwargs(task, texts, completion_ids, context)
    parts: dict[str, list[float | None]] = {}
    errors: list[str | None] = [None] * n
    for reward in rewards:
        scores: list[float | None] = [None] * n
        try:
            out = _call(reward, task, texts, kwargs)
        except Exception as exc:  # any error of user code fails the members, never the run
            out, failure = None, f"{type(exc).__name__}: {exc}"
        else:
            failure = None
            if not isinstance(out, (list, tuple)) or len(out) != n:
                failure = f"returned {type(out).__name__} {out!r:.60}, not a list of {n} scores"
        if failure is not None:
            errors = [e or f"reward {reward.series}: {failure}" for e in errors]
            parts[reward.series] = scores
            continue
        for k, value in enumerate(out):
            try:
                scores[k] = _number(value)
            except (TypeError, ValueError) as exc:
                errors[k] = errors[k] or f"reward {reward.series}: {exc}"
        parts[reward.series] = scores
    totals: list[float | None] = []
    for k in range(n):
        applied = [(r.weight, parts[r.series][k]) for r in rewards if parts[r.series][k] is not None]
        if errors[k] is None and not applied:
            errors[k] = "no reward applies to it (every reward function returned None)"
        totals.append(None if errors[k] is not None else sum(w * s for w, s in applied))
    return GroupScores(totals, parts, errors)


class _Call:
    """One scoring call handed to the worker threads: when a thread started it (its timeout's clock), or that the
    caller gave up waiting for a thread (then no thread runs it)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.started: asyncio.Future[float] = loop.create_future()  # set on the loop once a thread starts it
        self.t0: float | None = None  # when a thread started it (monotonic seconds)
        self.given_up = False
        self.run_s: float | None = None  # its run time, once it returned (seconds)
        self._lock = threading.Lock()

    def run(self, func: Callable[..., GroupScores], *args: Any) -> GroupScores | None:
        """In a worker thread: ``func(*args)``, unless the caller gave up (None)."""
        with self._lock:
            if self.given_up:
                return None
            self.t0 = time.monotonic()
        self.loop.call_soon_threadsafe(_set_result, self.started, self.t0)
        try:
            return func(*args)
        finally:
            self.run_s = time.monotonic() - self.t0

    def give_up(self) -> float | None:
        """Stop waiting for a thread: None, or when a thread started the call meanwhile (it runs)."""
        with self._lock:
            self.given_up = self.t0 is None
            return self.t0


def _set_result(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)


class RewardScorer:
    """Runs :func:`score_group` in worker threads: ``threads`` calls at once, each bounded by its own run time
    (module docstring).

    Args:
        threads: calls run at once.
        spare: threads that stand in for those of abandoned calls while they finish.

    Attributes:
        abandoned: calls still running that nobody waits for any more (past their timeout, or their request
            cancelled): each holds a thread.
    """

    def __init__(self, threads: int = REWARD_THREADS, spare: int = SPARE_THREADS) -> None:
        self.threads = threads
        self.pool = ThreadPoolExecutor(max_workers=threads + spare, thread_name_prefix="reward")
        self.abandoned = 0
        self._turns: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None

    def _running(self, loop: asyncio.AbstractEventLoop) -> asyncio.Semaphore:
        """The turns to run (``threads`` at once) on ``loop`` (one per loop: a semaphore belongs to one)."""
        if self._turns is None or self._turns[0] is not loop:
            self._turns = (loop, asyncio.Semaphore(self.threads))
        return self._turns[1]

    async def score(
        self,
        rewards: list[RewardFunction],
        task: Task,
        texts: list[str],
        completion_ids: list[list[int]],
        timeout_s: float,
        context: RewardContext | None = None,
    ) -> GroupScores:
        """:func:`score_group` off the event loop. Every member fails when the call runs longer than ``timeout_s``
        (seconds of its own run time, from when a thread starts it; the thread is left to finish on its own), or
        when no thread starts it within ``timeout_s`` because :attr:`abandoned` calls hold every spare thread."""
        loop = asyncio.get_running_loop()
        async with self._running(loop):  # an abandoned call gives up its turn: waiting for one is not its time
            call = _Call(loop)
            future = loop.run_in_executor(
                self.pool, call.run, score_group, rewards, task, texts, completion_ids, context
            )
            try:
                try:
                    started = await asyncio.wait_for(asyncio.shield(call.started), timeout_s)
                except asyncio.TimeoutError:
                    started = call.give_up()
                    if started is None:
                        return _failed(rewards, texts, self._no_thread(timeout_s))
                left = max(0.0, started + timeout_s - time.monotonic())
                scores = await asyncio.wait_for(asyncio.shield(future), left)
                if (
                    call.run_s is not None and call.run_s > timeout_s
                ):  # done, but past its time (a busy loop saw it late)
                    raise asyncio.TimeoutError
            except (asyncio.TimeoutError, asyncio.CancelledError) as exc:
                if call.give_up() is not None and not future.done():
                    self.abandoned += 1
                    future.add_done_callback(self._finished_abandoned)
                if isinstance(exc, asyncio.CancelledError):
                    raise
                error = f"rewards ran longer than {timeout_s:g} s (spec.envs[].reward_timeout_seconds)"
                return _failed(rewards, texts, error)
            assert scores is not None  # a call a thread started is never skipped
            return scores

    def _finished_abandoned(self, future: asyncio.Future) -> None:
        self.abandoned -= 1
        if not future.cancelled() and future.exception() is not None:
            log.debug("an abandoned reward call raised: %s", future.exception())

    def _no_thread(self, timeout_s: float) -> str:
        return (
            f"no reward thread was free within {timeout_s:g} s: {self.abandoned} reward calls past their timeout "
            "(spec.envs[].reward_timeout_seconds) are still running and hold every spare thread; a reward that can "
            "hang should bound its own work"
        )

    def close(self) -> None:
        """Stop the workers (without waiting for a hung one)."""
        self.pool.shutdown(wait=False, cancel_futures=True)


def _failed(rewards: list[RewardFunction], texts: list[str], error: str) -> GroupScores:
    """Every member of a group failed with ``error``."""
    n = len(texts)
    return GroupScores([None] * n, {r.series: [None] * n for r in rewards}, [error] * n)
