"""Rewards in a run, on the real Orchestrator with fake rollouts and a fake trainer: a member whose reward fails is
recorded (ledger ``reward_failed``, with the task and the error), never scored, and requested again; a group whose
rewards keep failing is abandoned under ``rollout.max_group_retries``; the named rewards are logged per series, and
a TRL-style reward gets the dataset's other columns."""

from __future__ import annotations

import json
import math
import threading
from collections import Counter

import pytest
from rlrun.ledger import check_ledger
from rlrun.orchestrator.failing import RewardsFailing
from rlrun.rundir import RunDir

from tests.support.manifests import parse
from tests.support.orchestrators import make_orchestrator, run_to_the_end
from tests.unit.test_rollout_faults import Faults, events

_lock = threading.Lock()
_calls: list[dict] = []


def flaky(completions, answer, **kwargs):
    """Exact match, except that its 2nd call raises and its 3rd answers NaN for the last member."""
    with _lock:
        _calls.append(kwargs)
        n = len(_calls)
    if n == 2:
        raise RuntimeError("the judge is down")
    scores = [float(c == a) for c, a in zip(completions, answer, strict=True)]
    return [*scores[:-1], math.nan] if n == 3 else scores


def always_fails(completions, **kwargs):
    raise TimeoutError("no judge")


async def columns(completions, answer, level, **kwargs):
    """A TRL-style async reward reading a dataset column."""
    return [
        float(c.strip() == a) * (1.0 if lvl == "easy" else 0.5)
        for c, a, lvl in zip(completions, answer, level, strict=True)
    ]


def curriculum(completions, answer, trainer_state, log_metric, **kwargs):
    """A TRL curriculum reward: what it reads of ``trainer_state``, and one ``log_metric`` per call."""
    log_metric("max_steps", trainer_state.max_steps)
    log_metric("global_step", trainer_state.global_step)
    return [float(c == a) for c, a in zip(completions, answer, strict=True)]


def spec(**overrides):
    base = dict(
        group_size=4, batch_size=8, max_off_policy_steps=1, max_steps=2, checkpoint={"interval": 1, "keep_last": 2}
    )
    return parse("rewards", **{**base, **overrides}).spec


async def test_a_failed_reward_is_recorded_never_scored_and_its_member_requested_again(tmp_path, tiny_model):
    _calls.clear()
    run_dir = RunDir(tmp_path)
    envs = [
        {"name": "reverse-text", "rewards": [{"function": "tests.unit.test_rewards_in_a_run:flaky", "label": "judge"}]}
    ]
    orch = make_orchestrator(spec(envs=envs), run_dir, tiny_model, Faults())
    assert await run_to_the_end(orch) == 2
    # the whole 2nd group (its call raised), the last member of the 3rd; in the order their requests ended, which
    # concurrent reward calls (spare threads, rlrun.rewards.scoring) do not tie to the order the calls began
    failed = sorted(events(run_dir, "reward_failed"), key=lambda e: -len(e["ids"]))
    assert [len(e["ids"]) for e in failed] == [4, 1]
    assert failed[0]["error"] == "reward judge: RuntimeError: the judge is down"
    assert failed[1]["error"] == "reward judge: a score must be finite, got nan"
    assert all(e["env"] == "reverse-text" and isinstance(e["task"], int) for e in failed)
    finished = {e["id"] for e in events(run_dir, "finished")}
    assert not finished & {i for e in failed for i in e["ids"]}  # never scored
    again = events(run_dir, "dispatched")
    for e in failed:  # each failed group was asked again, for as many members, numbered after the failed ones
        group, members = e["group"], [int(i.split("/")[1]) for i in e["ids"]]
        assert any(d["group"] == group and d["first_member"] > max(members) for d in again), (e, again)
    report = check_ledger(run_dir.root / "ledger")
    assert report.ok and report.steps == 2 and report.trained == 16, report.problems
    rows = [json.loads(line) for line in run_dir.metrics.read_text().splitlines()]
    assert rows[-1]["episodes_reward_failed"] == 5
    assert all("reward/judge" in r and "reward/reverse-text" in r for r in rows)


async def test_a_group_whose_rewards_keep_failing_is_abandoned_and_a_reward_failing_on_everything_stops_the_run(
    tmp_path, tiny_model
):
    run_dir = RunDir(tmp_path)
    envs = [{"name": "reverse-text", "rewards": [{"function": "tests.unit.test_rewards_in_a_run:always_fails"}]}]
    orch = make_orchestrator(spec(envs=envs, rollout={"max_group_retries": 1}), run_dir, tiny_model, Faults())
    with pytest.raises(
        RewardsFailing,
        match=r"64 requests in a row failed for every member \(env reverse-text\); the last error: reward "
        r"always_fails: TimeoutError: no judge",
    ):
        await run_to_the_end(orch)
    per_group = Counter(e["group"] for e in events(run_dir, "reward_failed"))
    abandoned = events(run_dir, "abandoned")
    assert abandoned and all(e["reason"] == "rewards_failed" and e["ids"] == [] for e in abandoned)
    assert {per_group[e["group"]] for e in abandoned} == {2}  # the first request and 1 retry, then abandoned
    assert events(run_dir, "finished") == []


async def test_a_trl_style_async_reward_gets_the_datasets_other_columns(tmp_path, tiny_model):
    data = tmp_path / "tasks.jsonl"
    rows = [
        {"prompt": f"{w}=", "answer": w[::-1], "level": "easy" if i % 2 else "hard"}
        for i, w in enumerate(
            ["flat", "is", "better", "than", "nested", "simple", "complex", "sparse", "dense", "ugly"]
        )
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = RunDir(tmp_path / "run")
    envs = [
        {
            "name": "dataset",
            "args": {"path": str(data)},
            "rewards": [{"function": "tests.unit.test_rewards_in_a_run:columns", "label": "graded"}],
        }
    ]
    orch = make_orchestrator(spec(envs=envs), run_dir, tiny_model, Faults())
    assert await run_to_the_end(orch) == 2
    finished = events(run_dir, "finished")
    assert {e["reward"] for e in finished} <= {0.0, 0.5, 1.0} and len({e["reward"] for e in finished}) > 1
    metrics = [json.loads(line) for line in run_dir.metrics.read_text().splitlines()]
    assert all("reward/graded" in r and "reward/dataset" in r for r in metrics)
    assert check_ledger(run_dir.root / "ledger").ok


async def test_a_trl_reward_reads_trainer_state_and_its_log_metric_lands_in_metrics(tmp_path, tiny_model):
    run_dir = RunDir(tmp_path)
    envs = [{"name": "reverse-text", "rewards": [{"function": "tests.unit.test_rewards_in_a_run:curriculum"}]}]
    orch = make_orchestrator(spec(envs=envs, max_steps=3), run_dir, tiny_model, Faults())
    assert await run_to_the_end(orch) == 3
    assert events(run_dir, "reward_failed") == []
    rows = [json.loads(line) for line in run_dir.metrics.read_text().splitlines()]
    assert [r["reward_metrics"]["max_steps"] for r in rows] == [3.0, 3.0, 3.0]
    # global_step: the policy version that sampled the group (≤ max_off_policy_steps behind the step trained)
    assert all(r["step"] - 2 <= r["reward_metrics"]["global_step"] <= r["step"] - 1 for r in rows), rows
    assert check_ledger(run_dir.root / "ledger").ok
