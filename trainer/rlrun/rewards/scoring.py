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
group's retry budget (``rollout.max_group_retries``). A group's scoring that takes longer than
``reward_timeout_seconds`` fails every member of it.

**Where it runs**: :class:`RewardScorer` runs each group's scoring in a worker thread (a sync
function in it directly, an async one in an event loop of that thread), never on the orchestrator's
loop. A reward that hangs keeps its worker: the scorer stops waiting at the timeout, but Python
cannot stop a thread, so a reward that can hang should bound its own work; :data:`REWARD_THREADS`
workers bound how many may hang before scoring queues.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from rlrun.api.spec import EnvSpec
from rlrun.envs.base import Env, Task

#: Worker threads of a :class:`RewardScorer`.
REWARD_THREADS = 8
#: Keyword arguments a reward function gets from the call itself; a task field of the same name is not passed.
CALL_ARGUMENTS = ("prompts", "completions", "completion_ids")


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


def reward_kwargs(task: Task, texts: list[str], completion_ids: list[list[int]]) -> dict[str, Any]:
    """TRL's keyword arguments for one group: ``prompts``, ``completions`` (the texts; for a chat prompt, each
    ``[{"role": "assistant", "content": text}]``), ``completion_ids``, then ``answer`` and every field of
    ``task.info``, each a list with one item per completion."""
    n = len(texts)
    completions: list[Any] = [[{"role": "assistant", "content": t}] for t in texts] if task.is_chat else list(texts)
    kwargs: dict[str, Any] = {"prompts": [task.prompt] * n, "completions": completions}
    kwargs["completion_ids"] = [list(ids) for ids in completion_ids]
    fields = {"answer": task.answer, **task.info}
    kwargs.update({k: [v] * n for k, v in fields.items() if k not in CALL_ARGUMENTS})
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
    rewards: list[RewardFunction], task: Task, texts: list[str], completion_ids: list[list[int]]
) -> GroupScores:
    """Score ``texts`` (the completions' decoded texts, ``completion_ids`` their token ids) of ``task`` with every
    reward (module docstring: weights, ``None``, failures). Blocking: run it in a worker thread."""
    n = len(texts)
    kwargs = reward_kwargs(task, texts, completion_ids)
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


class RewardScorer:
    """Runs :func:`score_group` in :data:`REWARD_THREADS` worker threads, with a timeout per group.

    Args:
        threads: worker threads.
    """

    def __init__(self, threads: int = REWARD_THREADS) -> None:
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="reward")

    async def score(
        self,
        rewards: list[RewardFunction],
        task: Task,
        texts: list[str],
        completion_ids: list[list[int]],
        timeout_s: float,
    ) -> GroupScores:
        """:func:`score_group` off the event loop; every member fails when it takes longer than ``timeout_s``
        (seconds; the thread is left to finish on its own)."""
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self.pool, score_group, rewards, task, texts, completion_ids)
        try:
            return await asyncio.wait_for(future, timeout_s)
        except asyncio.TimeoutError:
            error = f"rewards took longer than {timeout_s:g} s (spec.envs[].reward_timeout_seconds)"
            return GroupScores(
                [None] * len(texts), {r.series: [None] * len(texts) for r in rewards}, [error] * len(texts)
            )

    def close(self) -> None:
        """Stop the workers (without waiting for a hung one)."""
        self.pool.shutdown(wait=False, cancel_futures=True)
