"""Scoring a group (``rlrun.rewards.scoring``): TRL's call convention, weights, ``None``, and every way a reward
fails — which fails the member, never scores it 0 — in worker threads with a timeout."""

from __future__ import annotations

import asyncio
import math
import threading
import time

import pytest
from rlrun.api.spec import EnvSpec, RewardSpec
from rlrun.envs.base import Task
from rlrun.envs.reverse_text import ReverseTextEnv
from rlrun.rewards.builtin import exact as exact_reward
from rlrun.rewards.scoring import (
    RewardContext,
    RewardFunction,
    RewardScorer,
    env_rewards,
    reward_kwargs,
    score_group,
)
from transformers import TrainerState

TASK = Task(env="e", index=3, prompt="ab=", answer="ba", info={"level": 2, "prompts": "shadowed"})
CHAT = Task(env="e", index=4, prompt=[{"role": "user", "content": "hi"}], answer="yo")


def fn(series, func, weight=1.0):
    return RewardFunction(series=series, weight=weight, func=func)


def test_a_reward_gets_trls_keyword_arguments_one_item_per_completion():
    kwargs = reward_kwargs(TASK, ["ba", "bb"], [[1, 2, 0], [1, 1]])
    assert kwargs == {
        "prompts": ["ab=", "ab="],
        "completions": ["ba", "bb"],
        "completion_ids": [[1, 2, 0], [1, 1]],
        "answer": ["ba", "ba"],
        "level": [2, 2],  # a task field; one named like a call argument ("prompts") is not passed
    }
    chat = reward_kwargs(CHAT, ["yo"], [[5]])
    assert not {"trainer_state", "log_extra", "log_metric"} & set(chat)  # TRL's trainer arguments: with a context
    assert chat["prompts"] == [[{"role": "user", "content": "hi"}]]
    assert chat["completions"] == [[{"role": "assistant", "content": "yo"}]]  # TRL's conversational form


def test_the_reward_is_the_weighted_sum_of_the_functions_that_apply():
    def exact(completions, answer, **kwargs):
        return [float(c == a) for c, a in zip(completions, answer, strict=True)]

    def short(completions, **kwargs):
        return [None if c == "ba" else 0.5 for c in completions]  # does not apply to the first

    scores = score_group([fn("exact", exact, 2.0), fn("short", short, -1.0)], TASK, ["ba", "xx"], [[1], [2]])
    assert scores.rewards == [2.0, -0.5]
    assert scores.parts == {"exact": [1.0, 0.0], "short": [None, 0.5]}
    assert scores.errors == [None, None]


@pytest.mark.parametrize(
    ("returned", "error"),
    [
        ([1.0, math.nan], "a score must be finite, got nan"),
        ([1.0, "1"], "a score must be a number or None, got str '1'"),
        ([1.0, math.inf], "a score must be finite, got inf"),
    ],
)
def test_a_score_that_is_no_finite_number_fails_its_member_only(returned, error):
    scores = score_group([fn("r", lambda **kw: returned)], TASK, ["a", "b"], [[1], [2]])
    assert scores.rewards == [1.0, None]
    assert scores.errors == [None, f"reward r: {error}"]


def test_a_reward_that_raises_or_answers_the_wrong_shape_fails_every_member():
    def boom(**kwargs):
        raise KeyError("solution")

    scores = score_group([fn("boom", boom)], TASK, ["a", "b"], [[1], [2]])
    assert scores.rewards == [None, None]
    assert scores.errors == ["reward boom: KeyError: 'solution'"] * 2
    short = score_group([fn("one", lambda **kw: [1.0])], TASK, ["a", "b"], [[1], [2]])
    assert short.errors == ["reward one: returned list [1.0], not a list of 2 scores"] * 2
    none = score_group([fn("none", lambda **kw: [None, 1.0])], TASK, ["a", "b"], [[1], [2]])
    assert none.rewards == [None, 1.0]
    assert none.errors[0] == "no reward applies to it (every reward function returned None)"


def test_an_async_reward_runs_in_the_worker_thread_not_on_the_callers_loop():
    seen = {}

    async def judge(completions, **kwargs):
        seen["thread"] = threading.current_thread().name
        await asyncio.sleep(0)
        return [0.25 for _ in completions]

    async def main():
        scorer = RewardScorer(threads=2)
        try:
            return await scorer.score([fn("judge", judge)], TASK, ["a"], [[1]], timeout_s=5)
        finally:
            scorer.close()

    scores = asyncio.run(main())
    assert scores.rewards == [0.25] and seen["thread"].startswith("reward")


def test_a_reward_over_its_timeout_fails_every_member_and_the_loop_goes_on():
    def slow(completions, **kwargs):
        time.sleep(1.0)
        return [1.0 for _ in completions]

    async def main():
        scorer = RewardScorer(threads=2)
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.create_task(tick())
        try:
            t0 = time.monotonic()
            scores = await scorer.score([fn("slow", slow)], TASK, ["a", "b"], [[1], [2]], timeout_s=0.2)
            return scores, time.monotonic() - t0, ticks
        finally:
            ticker.cancel()
            scorer.close()

    scores, waited, ticks = asyncio.run(main())
    assert scores.rewards == [None, None]
    assert scores.errors == ["rewards ran longer than 0.2 s (spec.envs[].reward_timeout_seconds)"] * 2
    assert waited < 0.9 and ticks >= 5  # the loop kept running while the reward slept in its thread


def test_an_env_without_rewards_is_scored_by_its_own_reward_named_after_it():
    env = ReverseTextEnv(reward="exact")
    [own] = env_rewards(EnvSpec(name="reverse-text"), env)
    assert own.series == "reverse-text" and own.own
    task = env.task(0, 0)
    assert score_group([own], task, [task.answer, "x"], [[1], [2]]).rewards == [1.0, 0.0]
    named = env_rewards(EnvSpec(name="reverse-text", rewards=[RewardSpec(name="lcs", weight=0.5, label="sim")]), env)
    assert [(r.series, r.weight, r.own) for r in named] == [("sim", 0.5, False)]


def test_a_rewards_timeout_counts_its_own_run_time_not_its_wait_for_a_thread():
    """Issue 36's run, 4× faster: 35 calls sleeping 4 s and every other call ≤ 8 ms, with a 1 s timeout,
    failed 164 requests ("took longer than 1 s") when the clock started as a call was queued. Here the 35 slow
    calls (1 s, timeout 0.25 s) fail, each on its own run time, and none of the 200 quick ones (≤ 0.8 ms)
    does, although they wait behind the slow ones for one of the 8 threads — the last ones ≈ 35 × 0.25 / 8 ≈
    1.1 s, four timeouts. (10× faster, with a 0.1 s timeout, a quick call once ran longer than that on a
    loaded machine: its wait for the GIL after its sleep is its own run time too; 0.25 s is 300 × 0.8 ms.)"""

    def judge(completions, answer, **kwargs):
        time.sleep(1.0 if answer[0] == "slow" else 0.0008)
        return [1.0 for _ in completions]

    slow = set(range(0, 6 * 35, 6))  # every 6th call
    tasks = [Task("e", i, "p", "slow" if i in slow else "quick") for i in range(235)]

    async def main():
        scorer = RewardScorer(threads=8)
        try:
            judged = [fn("judge", judge)]
            calls = [scorer.score(judged, t, ["a", "b"], [[1], [2]], timeout_s=0.25) for t in tasks]
            t0 = time.monotonic()
            return await asyncio.gather(*calls), time.monotonic() - t0
        finally:
            scorer.close()

    results, took = asyncio.run(main())
    failed = {t.index for t, s in zip(tasks, results, strict=True) if s.rewards != [1.0, 1.0]}
    assert failed == slow
    errors = {e for t, s in zip(tasks, results, strict=True) if t.index in slow for e in s.errors}
    assert errors == {"rewards ran longer than 0.25 s (spec.envs[].reward_timeout_seconds)"}
    assert took > 4 * 0.25  # the last quick calls waited four timeouts for a turn, and did not fail for it


def test_a_call_that_gets_no_thread_because_hung_rewards_hold_them_all_says_so():
    release = threading.Event()

    def hangs(completions, answer, **kwargs):
        if answer[0] == "hang":
            release.wait(5)
        return [1.0 for _ in completions]

    async def main():
        scorer = RewardScorer(threads=1, spare=1)  # two threads: the two hung calls hold both
        try:
            score = lambda answer: scorer.score([fn("r", hangs)], Task("e", 0, "p", answer), ["a"], [[1]], 0.1)  # noqa: E731
            hung = await asyncio.gather(score("hang"), score("hang"))
            return hung, await score("quick"), scorer.abandoned
        finally:
            release.set()
            scorer.close()

    hung, starved, abandoned = asyncio.run(main())
    assert [s.errors for s in hung] == [["rewards ran longer than 0.1 s (spec.envs[].reward_timeout_seconds)"]] * 2
    assert abandoned == 2
    [starved_error] = starved.errors  # rlrun.worker_threads.NoThreadFree's words
    assert starved_error.startswith("no reward thread was free within 0.1 s: 2 calls past their timeout")


def test_a_reward_gets_trls_trainer_state_log_metric_and_log_extra():
    """TRL passes ``trainer_state`` (a ``TrainerState``: curricula read ``global_step`` / ``max_steps``),
    ``log_metric(name, value)`` and ``log_extra(column, values)`` to every reward; so does rlrun."""
    logged = []

    def curriculum(completions, trainer_state, log_metric, log_extra, **kwargs):
        progress = trainer_state.global_step / trainer_state.max_steps
        log_metric("progress", progress)
        log_extra("lengths", [len(c) for c in completions])
        return [progress for _ in completions]

    context = RewardContext(step=3, max_steps=12, log_metric=lambda name, value: logged.append((name, value)))
    scores = score_group([fn("curriculum", curriculum)], TASK, ["ba", "b"], [[1], [2]], context)
    assert scores.rewards == [0.25, 0.25] and scores.errors == [None, None]
    assert logged == [("progress", 0.25)]
    state = reward_kwargs(TASK, ["ba"], [[1]], context)["trainer_state"]
    assert isinstance(state, TrainerState) and (state.global_step, state.max_steps) == (3, 12)
    quiet = score_group([fn("curriculum", curriculum)], TASK, ["ba"], [[1]], RewardContext(3, 12, None))
    assert quiet.rewards == [0.25]  # an evaluation's context drops the logged values, and the reward still runs


def test_a_task_field_named_like_a_trainer_argument_is_not_passed():
    task = Task("e", 0, "p", "a", {"trainer_state": "a column", "level": 1})
    kwargs = reward_kwargs(task, ["x"], [[1]], RewardContext(1, 2))
    assert isinstance(kwargs["trainer_state"], TrainerState) and kwargs["level"] == [1]


def test_the_builtin_math_runs_in_a_worker_process_and_every_other_reward_in_a_thread_unless_isolation_says():
    """Issue 47: math-verify held the GIL 126 s on one answer. ``isolation`` (``spec.envs[].rewards[]``)
    decides; unset, the builtin ``math`` runs in a process, the others (and user functions) in threads; an
    env's own reward always in a thread."""
    env = ReverseTextEnv(reward="exact")
    specs = [
        RewardSpec(name="math"),
        RewardSpec(name="math", label="math_in_thread", isolation="thread"),
        RewardSpec(name="lcs"),
        RewardSpec(name="regex", args={"pattern": "a"}, isolation="process"),
        RewardSpec(function="tests.support.rewards:pid"),
        RewardSpec(function="tests.support.rewards:boom", isolation="process"),
    ]
    rewards = env_rewards(EnvSpec(name="reverse-text", rewards=specs), env)
    assert [r.process for r in rewards] == [True, False, False, True, False, True]
    assert [r.spec for r in rewards] == specs  # what a worker loads them from
    [own] = env_rewards(EnvSpec(name="reverse-text"), env)
    assert not own.process and own.spec is None
    with pytest.raises(ValueError, match="isolation"):
        RewardSpec(name="math", isolation="fork")


def test_a_worker_call_gives_user_rewards_trls_arguments_and_hands_back_their_log_metric_calls():
    """What a worker process runs for one call (``rlrun.rewards.worker.score_call``), here in this process:
    each reward's checked outcome, a user function's ``trainer_state`` and ``log_metric`` (whose calls go back
    to the orchestrator as data), and a reward that raises or answers no number failing members, never
    scoring them 0."""
    from rlrun.rewards.worker import score_call

    def curriculum(completions, trainer_state, log_metric, **kwargs):
        log_metric("progress", trainer_state.global_step / trainer_state.max_steps)
        return [0.5, "high"]

    def boom(**kwargs):
        raise RuntimeError("down")

    funcs = {"c": curriculum, "b": boom, "e": exact_reward}
    calls = [("c", "curriculum", False), ("b", "boom", False), ("e", "exact", True)]
    outcomes, logged, run_s = score_call(funcs, calls, TASK, ["ba", "bb"], [[1], [2]], (3, 12, True))
    assert outcomes == [
        ([0.5, None], [None, "reward curriculum: a score must be a number or None, got str 'high'"]),
        ([None, None], ["reward boom: RuntimeError: down"] * 2),
        ([1.0, 0.0], [None, None]),
    ]
    assert logged == [("progress", 0.25)] and run_s >= 0
    quiet = score_call(funcs, calls[2:], TASK, ["ba"], [[1]], (3, 12, False))
    assert quiet[0] == [([1.0], [None])] and quiet[1] == []
