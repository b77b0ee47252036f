"""``spec.advantage``: each baseline and the std normalisation with its floor against hand-computed values
(:mod:`rlrun.orchestrator.advantages`), and the sink using them on the members that train only (invariant 3),
counting the groups the floor touched (``groups_std_floored``)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from rlrun.api.algorithm import AdvantageSpec
from rlrun.orchestrator.advantages import group_advantages
from rlrun.orchestrator.metrics import StepMetrics
from rlrun.orchestrator.sink import TrainSink

from tests.support.manifests import parse
from tests.support.samples import episode, task

STD = AdvantageSpec(std_normalize=True)


def test_group_mean_is_grpos_reward_minus_the_group_mean():
    rewards = [1.0, 0.5, 0.0, 0.5]  # mean 0.5, population std sqrt(0.125) = 0.35355
    assert group_advantages(rewards).values == pytest.approx([0.5, 0.0, -0.5, 0.0])
    scored = group_advantages(rewards, STD)
    assert scored.values == pytest.approx([1.41421, 0.0, -1.41421, 0.0], rel=1e-5) and not scored.floored


def test_leave_one_out_subtracts_the_mean_of_the_other_members():
    rewards = [1.0, 0.0, 0.0, 0.0]
    # RLOO: A_0 = 1 − mean(0, 0, 0) = 1; A_1 = 0 − mean(1, 0, 0) = −1/3
    loo = AdvantageSpec(baseline="leave_one_out")
    assert group_advantages(rewards, loo).values == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3])
    # = n/(n − 1) times the group-mean advantages (0.75, −0.25): 4/3 · 0.75 = 1
    rewards = [0.9, 0.2, 0.4]  # A_0 = 0.9 − 0.3 = 0.6, A_1 = 0.2 − 0.65 = −0.45, A_2 = 0.4 − 0.55 = −0.15
    assert group_advantages(rewards, loo).values == pytest.approx([0.6, -0.45, -0.15])
    # with std normalisation: the same over the population std of [1, 0, 0, 0], sqrt(3/16) = 0.43301
    both = AdvantageSpec(baseline="leave_one_out", std_normalize=True)
    assert group_advantages([1.0, 0.0, 0.0, 0.0], both).values == pytest.approx(
        [2.30940, -0.76980, -0.76980, -0.76980], rel=1e-5
    )


def test_a_spread_of_001_is_not_blown_up_to_unit_size_by_std_normalisation():
    # reasoning-gym: two wrong non-empty answers (0.01) and six empty ones (0); mean 0.0025, std 0.0043301
    rewards = [0.01, 0.01] + [0.0] * 6
    unfloored = group_advantages(rewards, AdvantageSpec(std_normalize=True, min_std=1e-9))  # ≈ the old std + 1e-6
    assert unfloored.values[0] == pytest.approx(1.7320, rel=1e-4) and not unfloored.floored
    floored = group_advantages(rewards, STD)  # min_std 0.1: divided by 0.1
    assert floored.values == pytest.approx([0.075, 0.075] + [-0.025] * 6) and floored.floored
    # a group with a real spread (std 0.433 ≥ 0.1) is untouched by the floor
    assert not group_advantages([1.0, 0.0, 0.0, 0.0], STD).floored


def test_a_group_with_no_spread_has_zero_advantages_under_every_rule():
    for spec in (AdvantageSpec(), STD, AdvantageSpec(baseline="leave_one_out", std_normalize=True)):
        scored = group_advantages([0.3] * 4, spec)
        assert scored.values == pytest.approx([0.0] * 4) and not scored.floored
    assert group_advantages([1.0], STD).values == [0.0] and group_advantages([]).values == []


def test_the_sink_scores_only_the_members_that_train_with_the_leave_one_out_baseline():
    # group_size 3, batch 2 needs version ≥ 1: member 2 (version 0) is stale and left out of the baseline
    sink = TrainSink(
        group_size=3, batch_size=8, max_off_policy_steps=0, advantage=AdvantageSpec(baseline="leave_one_out")
    )
    eps = [episode(5, 0, 1.0, 1), episode(5, 1, 0.0, 1), episode(5, 2, 0.5, 0)]
    queued = sink.add_episodes(5, task(5), eps, next_step=2)
    # the fresh two: A_0 = 1 − 0, A_1 = 0 − 1 (with the stale member: 1 − 0.25 = 0.75)
    assert [s.trace.episode_id for s in queued] == ["5/0", "5/1"]
    assert [s.advantage for s in queued] == pytest.approx([1.0, -1.0])


def test_the_sink_counts_the_groups_the_floor_touched_in_the_metrics_line(tmp_path):
    sink = TrainSink(group_size=4, batch_size=4, max_off_policy_steps=1, advantage=STD)
    metrics = StepMetrics(tmp_path / "metrics.jsonl", attempt=1)
    metrics.start()
    dispatcher = SimpleNamespace(inflight_samples=0, cancelled_groups=0)

    def group(gid, rewards):
        return sink.add_episodes(gid, task(gid), [episode(gid, m, r, 0) for m, r in enumerate(rewards)], next_step=1)

    assert [s.advantage for s in group(1, [0.01, 0.0, 0.01, 0.0])] == pytest.approx([0.05, -0.05, 0.05, -0.05])
    assert group(2, [0.0] * 4) == []  # zero spread: rejected and counted as such, not floored
    group(3, [1.0, 0.0, 1.0, 0.0])  # std 0.5: not floored
    first = metrics.shipped(1, sink.take_batch(1), 0, sink, dispatcher)
    second = metrics.shipped(2, sink.take_batch(2), 0, sink, dispatcher)
    metrics.close()
    assert (first["groups_std_floored"], second["groups_std_floored"]) == (1, 0)
    assert sink.counters.groups_rejected_zero_spread == 1
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["groups_std_floored"] for line in lines] == [1, 0]


def test_the_sink_of_a_run_takes_spec_advantage_and_the_deprecated_alias():
    sink = TrainSink.from_spec(parse(advantage={"baseline": "leave_one_out", "min_std": 0.2}).spec)
    assert sink.advantage == AdvantageSpec(baseline="leave_one_out", min_std=0.2)
    assert TrainSink.from_spec(parse(loss={"std_normalize_advantages": True}).spec).advantage.std_normalize
