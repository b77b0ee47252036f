import pytest
from rlrun.orchestrator.sink import TrainSink
from rlrun.orchestrator.staleness import min_fresh_version

from tests.support.samples import episode, sample, task


def test_complete_group_is_scored_and_queued_in_member_order():
    sink = TrainSink(group_size=4, batch_size=8, max_off_policy_steps=1)
    rewards = [1.0, 0.5, 0.0, 0.5]
    assert sink.add_episodes(7, task(7), [episode(7, i, r, 0) for i, r in enumerate(rewards[:2])], next_step=1) == []
    assert 7 in sink.open_groups and sink.finished_episodes_kept == 2
    queued = sink.add_episodes(7, task(7), [episode(7, i + 2, r, 0) for i, r in enumerate(rewards[2:])], next_step=1)
    assert [s.advantage for s in queued] == pytest.approx([0.5, 0.0, -0.5, 0.0])
    assert [s.trace.episode_id for s in queued] == ["7/0", "7/1", "7/2", "7/3"]
    assert sink.open_groups == {}
    assert sink.drain_recent_rewards() == rewards


def test_group_with_equal_rewards_is_rejected_and_counted():
    sink = TrainSink(group_size=2, batch_size=2, max_off_policy_steps=1)
    assert sink.add_episodes(1, task(1), [episode(1, 0, 1.0, 0), episode(1, 1, 1.0, 0)], next_step=1) == []
    assert sink.counters.groups_rejected == 1 and sink.queue == []
    assert sink.drain_recent_rewards() == [1.0, 1.0]  # still counted in the reward metric


def _group(sink: TrainSink, gid: int, rewards: list[float], completions: list[tuple] | None = None) -> list:
    completions = completions or [(5, 6, 0)] * len(rewards)
    eps = [episode(gid, m, r, 0, completion=c) for m, (r, c) in enumerate(zip(rewards, completions, strict=True))]
    return sink.add_episodes(gid, task(gid), eps, next_step=1)


def test_zero_spread_rejections_are_split_into_solved_and_same_wrong():
    sink = TrainSink(group_size=8, batch_size=8, max_off_policy_steps=1)
    assert _group(sink, 1, [1.0] * 8, [(m, 0) for m in range(8)]) == []  # solved by all, however it was said
    assert (sink.counters.groups_rejected, sink.counters.groups_rejected_solved) == (1, 1)
    assert _group(sink, 2, [0.0] * 8) == []  # the very same wrong answer, 8 times
    assert (sink.counters.groups_rejected, sink.counters.groups_rejected_same_wrong) == (2, 1)
    assert _group(sink, 3, [0.5] * 8, [(m, 0) for m in range(8)]) == []  # equal partial credit, different answers
    counters = sink.counters
    assert (counters.groups_rejected, counters.groups_rejected_solved, counters.groups_rejected_same_wrong) == (3, 1, 1)
    assert _group(sink, 4, [0.5] * 7 + [0.25]) != []  # same completions but a spread: trains, counts in neither
    assert (counters.groups_rejected, counters.groups_rejected_solved, counters.groups_rejected_same_wrong) == (3, 1, 1)
    # scored 4: zero std 3, solved by all 1 (group 1), scored 0 by all 1 (group 2), none cut at max_tokens
    assert (counters.groups_scored, sink.drain_recent_groups()) == (4, (4, 3, 1, 1, 0))
    assert sink.drain_recent_groups() == (0, 0, 0, 0, 0)  # drained


def test_a_group_with_a_stale_member_counts_zero_std_by_all_its_rewards():
    sink = TrainSink(group_size=3, batch_size=8, max_off_policy_steps=0)
    eps = [episode(5, 0, 1.0, 1), episode(5, 1, 1.0, 1), episode(5, 2, 0.0, 0)]  # version 0 is stale for batch 2
    assert sink.add_episodes(5, task(5), eps, next_step=2) == []  # the fresh two alone have zero spread: rejected
    assert (sink.counters.groups_rejected, sink.counters.groups_rejected_solved) == (1, 1)
    assert sink.drain_recent_groups() == (1, 0, 0, 0, 0)  # the policy's rewards for the task did have a spread


def test_frac_reward_zero_std_in_the_metrics_line(tmp_path):
    import json
    from types import SimpleNamespace

    from rlrun.orchestrator.metrics import StepMetrics

    sink = TrainSink(group_size=4, batch_size=4, max_off_policy_steps=1)
    metrics = StepMetrics(tmp_path / "metrics.jsonl", attempt=1)
    metrics.start()
    dispatcher = SimpleNamespace(inflight_samples=0, cancelled_groups=0)
    _group(sink, 1, [1.0] * 4)  # solved
    _group(sink, 2, [0.0] * 4)  # same wrong
    _group(sink, 3, [0.0, 1.0, 0.0, 1.0])  # trains
    _group(sink, 4, [0.5] * 4, [(m,) for m in range(4)])  # zero std, neither
    _group(sink, 5, [0.0, 0.0, 0.0, 1.0])  # trains
    first = metrics.shipped(1, sink.take_batch(1), 0, sink, dispatcher)
    second = metrics.shipped(2, [sink.queue[0]], 0, sink, dispatcher)  # nothing scored in between
    metrics.close()
    assert first["frac_reward_zero_std"] == pytest.approx(3 / 5) and second["frac_reward_zero_std"] is None
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    keys = ("groups_rejected", "groups_rejected_solved", "groups_rejected_same_wrong")
    assert [[line[k] for k in keys] for line in lines] == [[3, 1, 1]] * 2  # the split counts are cumulative
    assert [line["frac_reward_zero_std"] for line in lines] == [pytest.approx(0.6), None]
    # prime-rl's solved_all / solved_none over the 5 groups scored: group 1 all solved; group 2 all 0
    assert (first["solved_all"], first["solved_none"], second["solved_all"]) == (0.2, 0.2, None)
    rewards = [1.0] * 4 + [0.0] * 4 + [0.0, 1.0, 0.0, 1.0] + [0.5] * 4 + [0.0, 0.0, 0.0, 1.0]
    mean = sum(rewards) / 20
    assert first["reward_mean"] == pytest.approx(mean)
    assert first["reward_std"] == pytest.approx((sum((r - mean) ** 2 for r in rewards) / 20) ** 0.5)
    assert (first["completion_len_max"], first["truncated_fraction"]) == (3, 0.0)  # the episodes all stopped
    # the 4 samples left queued (version 0) would train 1 step off-policy in step 2, 2 in step 3
    assert (first["queue"], first["queue_staleness_max"], second["queue_staleness_mean"]) == (4, 1, 2)


def test_the_truncated_fraction_counts_episodes_cut_at_max_tokens():
    import dataclasses

    sink = TrainSink(group_size=4, batch_size=4, max_off_policy_steps=1)
    eps = [episode(1, m, m / 4, 0) for m in range(4)]
    eps[1] = dataclasses.replace(eps[1], finish_reason="length")
    sink.add_episodes(1, task(1), eps, next_step=1)
    assert sink.drain_recent_groups() == (1, 0, 0, 0, 1)


@pytest.mark.parametrize(("step", "k", "expected"), [(1, 0, 0), (5, 0, 4), (5, 1, 3), (5, 2, 2), (1, 2, -2)])
def test_min_fresh_version(step, k, expected):
    assert min_fresh_version(step, k) == expected


@pytest.mark.parametrize(
    ("k", "kept_versions"),
    [
        (0, [4]),  # batch 5 is trained by version 4: only version-4 samples are on-policy
        (1, [3, 4]),
        (2, [2, 3, 4]),
    ],
)
def test_staleness_sweep_boundaries(k, kept_versions):
    sink = TrainSink(group_size=2, batch_size=2, max_off_policy_steps=k)
    sink.queue = [sample(v, 0, v) for v in range(5)]  # versions 0..4
    dropped = sink.sweep(step=5)
    assert sorted(s.trace.policy_version for s in sink.queue) == kept_versions
    assert sorted(s.trace.policy_version for s in dropped) == [v for v in range(5) if v not in kept_versions]
    assert sink.counters.samples_dropped_stale == 5 - len(kept_versions)


def test_batch_cut_is_oldest_first_stable_and_keeps_groups_together():
    sink = TrainSink(group_size=3, batch_size=6, max_off_policy_steps=2)
    # queued in arrival order: group 10 (v2), group 11 (v1), group 12 (v2), group 13 (v1)
    for gid, v in [(10, 2), (11, 1), (12, 2), (13, 1)]:
        sink.queue.extend(sample(gid, m, v) for m in range(3))
    batch = sink.take_batch(step=3)
    assert [s.trace.episode_id for s in batch] == ["11/0", "11/1", "11/2", "13/0", "13/1", "13/2"]
    # the overflow is the youngest, still in arrival order
    assert [s.trace.episode_id for s in sink.queue] == ["10/0", "10/1", "10/2", "12/0", "12/1", "12/2"]


def test_batch_cut_with_a_group_spanning_the_cut():
    sink = TrainSink(group_size=4, batch_size=6, max_off_policy_steps=1)
    for gid, v in [(1, 0), (2, 1)]:
        sink.queue.extend(sample(gid, m, v) for m in range(4))
    batch = sink.take_batch(step=1)
    assert [s.trace.episode_id for s in batch] == ["1/0", "1/1", "1/2", "1/3", "2/0", "2/1"]
    assert [s.trace.episode_id for s in sink.queue] == ["2/2", "2/3"]


def test_take_batch_waits_for_enough_fresh_samples():
    sink = TrainSink(group_size=2, batch_size=4, max_off_policy_steps=0)
    sink.queue = [sample(1, 0, 0), sample(1, 1, 0), sample(2, 0, 1), sample(2, 1, 1)]
    assert sink.take_batch(step=2) is None  # version-0 samples are stale for batch 2 when k = 0
    assert len(sink.queue) == 2 and sink.counters.samples_dropped_stale == 2


def test_stale_members_are_left_out_of_scoring():
    sink = TrainSink(group_size=4, batch_size=4, max_off_policy_steps=0)
    eps = [episode(3, 0, 1.0, 1), episode(3, 1, 0.0, 1), episode(3, 2, 0.9, 0), episode(3, 3, 0.2, 0)]
    queued = sink.add_episodes(3, task(3), eps, next_step=2)  # version 0 is stale for batch 2 when k = 0
    assert [s.trace.episode_id for s in queued] == ["3/0", "3/1"]
    assert [s.advantage for s in queued] == pytest.approx([0.5, -0.5])
    assert sink.counters.members_left_out_stale == 2


def test_waste_is_counted_per_env_and_a_starved_env_is_warned_about_once(tmp_path, caplog):
    import dataclasses
    import json
    import logging
    from types import SimpleNamespace

    from rlrun.orchestrator.metrics import StepMetrics, starved_envs

    sink = TrainSink(group_size=4, batch_size=8, max_off_policy_steps=1)

    def group(gid: int, env: str, version: int) -> None:
        eps = [dataclasses.replace(episode(gid, m, 0.25 * m, version), task=task(gid)) for m in range(4)]
        eps = [dataclasses.replace(e, task=dataclasses.replace(e.task, env=env)) for e in eps]
        sink.add_episodes(gid, eps[0].task, eps, next_step=5)

    # at step 5 with k = 1 members must be of version ≥ 3: the long tasks' groups finish too late
    for gid in range(20):
        group(gid, "short", version=4)
    for gid in range(20, 40):
        group(gid, "long", version=2 if gid % 4 else 4)  # 3 of 4 long groups aged out before they finished
    per_env = sink.counters.per_env
    assert per_env["short"] == {"finished": 80, "wasted_stale": 0, "abandoned": 0}
    assert per_env["long"] == {"finished": 80, "wasted_stale": 60, "abandoned": 0}
    assert starved_envs(per_env) == {"long": (0.75, 0.0)}
    assert starved_envs({"long": per_env["long"]}) == {}  # an env alone is never starved: nothing to compare
    sink.abandon(99, reason="stale", env="long")  # a group given up with none of its members open
    assert per_env["long"]["abandoned"] == 1

    metrics = StepMetrics(tmp_path / "metrics.jsonl", attempt=1)
    metrics.start()
    dispatcher = SimpleNamespace(inflight_samples=0, cancelled_groups=0)
    with caplog.at_level(logging.WARNING, logger="rlrun.orchestrator.metrics"):
        for step in (1, 2):
            metrics.shipped(step, sink.take_batch(step) or [], 4, sink, dispatcher)
    metrics.close()
    [warning] = [r.getMessage() for r in caplog.records if "starved" in r.getMessage()]
    assert warning.startswith("env long is starved: 75% of its finished episodes were wasted as stale (other envs: 0%)")
    line = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert line["per_env"]["long"]["stale_wasted_fraction"] == 0.75 and line["per_env"]["short"]["wasted_stale"] == 0
