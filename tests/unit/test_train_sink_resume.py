"""The sink snapshot and what a resume restores (ARCHITECTURE.md invariants 1–3, 6, 7)."""

import asyncio
import copy
import random

import pytest
from rlrun.envs import ReverseTextEnv
from rlrun.orchestrator.groups import GroupRequest
from rlrun.orchestrator.sink import TrainSink
from rlrun.orchestrator.snapshot import SinkSnapshot, pack, restore_plan, unpack
from rlrun.orchestrator.source import TrainSource

from tests.support.samples import episode, sample, task


def test_snapshot_round_trip_is_exact():
    snap = SinkSnapshot(
        pending_batch=[sample(1, m, 3, advantage=0.1 * m) for m in range(3)],
        open_groups=[(5, task(5), [episode(5, 0, 0.25, 2, completion=(7, 8, 9, 0)), episode(5, 2, 0.5, 3)])],
        emitted_train_groups=[GroupRequest(5, task(5), 2, 4), GroupRequest(6, task(6), 4, 0)],
        counters={"groups_scored": 3},
    )
    state, tensors = pack(snap)
    back = unpack(state, tensors)
    assert back == snap


def test_a_version_1_sink_state_loads_the_same():
    """Invariant 6: checkpoints written before members were fields (ids parsed once) and requests had ``n``."""
    snap = SinkSnapshot(
        pending_batch=[sample(1, 2, 3)],
        open_groups=[(5, task(5), [episode(5, 3, 0.25, 2)])],
        emitted_train_groups=[GroupRequest(5, task(5), 2, 4)],
    )
    state, tensors = pack(snap)
    state["version"] = 1
    for g in state["open_groups"]:
        for rec in g["episodes"]:
            rec["episode_id"] = f"{g['group_id']}/{rec.pop('member')}"
    for r in state["emitted_train_groups"]:
        r["n"] = r.pop("members")
    assert unpack(state, tensors) == snap


def test_empty_and_old_format_snapshots_restore_nothing():
    assert unpack(None, {}) == SinkSnapshot([], [], [])
    state, tensors = pack(SinkSnapshot([], [], []))
    assert unpack(state, tensors) == SinkSnapshot([], [], [], {})
    source = TrainSource([(ReverseTextEnv(), 1.0)], seed=0)
    source.load_state({"cursor": 17})  # an issue-2 checkpoint: cursor only
    assert source.cursor == 17 and list(source.resume_requests) == []


@pytest.mark.parametrize(
    ("k", "next_step", "kept"),
    [
        (0, 5, [4]),  # boundary: only the version that trains batch 5 survives
        (1, 5, [3, 4]),  # boundary: one step off-policy allowed
        (2, 5, [2, 3, 4]),
        (1, 2, [0, 1, 2, 3, 4]),  # min_fresh_version(2, 1) = 0
    ],
)
def test_resume_drops_queued_traces_older_than_min_fresh_version(k, next_step, kept):
    snap = SinkSnapshot([sample(v, 0, v) for v in range(5)], [], [])
    plan = restore_plan(snap, [], next_step=next_step, max_off_policy_steps=k, group_size=4)
    assert [s.trace.policy_version for s in plan.queue] == kept
    assert sorted(s.trace.policy_version for s in plan.dropped_samples) == [v for v in range(5) if v not in kept]


def test_resumed_group_scores_only_members_within_max_off_policy_steps():
    # group 7 (size 4): members 0 (v1), 1 (v2), 2 (v3) finished; member 3 was in flight.
    snap = SinkSnapshot(
        pending_batch=[],
        open_groups=[(7, task(7), [episode(7, 0, 0.9, 1), episode(7, 1, 0.1, 2), episode(7, 2, 0.6, 3)])],
        emitted_train_groups=[GroupRequest(7, task(7), 1, 3)],
    )
    # resumed with 3 batches shipped: next batch 4, k = 1 → min_fresh_version = 2: member 0 (v1) is dropped
    plan = restore_plan(snap, [], next_step=4, max_off_policy_steps=1, group_size=4)
    assert [e.episode_id for e in plan.dropped_episodes] == ["7/0"]
    [(gid, _, kept)] = plan.open_groups
    assert gid == 7 and [e.episode_id for e in kept] == ["7/1", "7/2"]
    # the missing members come back as one request: same task and group id, numbered after every member dispatched
    assert plan.to_complete == [(7, task(7), 2)]
    assert plan.requested_groups == 0 and plan.episodes_kept == 2 and plan.members_requested == 2
    source = TrainSource([(ReverseTextEnv(), 1.0)], seed=0)
    source.restore(list(snap.taken_members()), plan.to_complete)
    assert list(source.resume_requests) == [GroupRequest(7, task(7), 2, 4)]

    def completed(next_step):
        sink = TrainSink(group_size=4, batch_size=4, max_off_policy_steps=1)
        sink.add_episodes(7, task(7), kept, next_step=4)
        new = [episode(7, 4, 0.2, 3), episode(7, 5, 0.8, 3)]
        return sink.add_episodes(7, task(7), new, next_step=next_step)

    # completed while batch 4 is next: all four members are fresh; mean 0.425
    assert [s.trace.episode_id for s in completed(4)] == ["7/1", "7/2", "7/4", "7/5"]
    assert [s.advantage for s in completed(4)] == pytest.approx([-0.325, 0.175, -0.225, 0.375])
    # completed only once batch 5 is next: member 1 (v2) has aged out and is left out; mean of 0.6, 0.2, 0.8
    samples = completed(5)
    assert [s.trace.episode_id for s in samples] == ["7/2", "7/4", "7/5"]
    assert [s.advantage for s in samples] == pytest.approx([0.6 - 1.6 / 3, 0.2 - 1.6 / 3, 0.8 - 1.6 / 3])


def test_emitted_groups_and_pending_requests_are_requested_again_before_new_tasks():
    snap = SinkSnapshot([], [], emitted_train_groups=[GroupRequest(12, task(12), 8, 0)])
    pending = [GroupRequest(9, task(9), 3, 5)]
    source = TrainSource([(ReverseTextEnv(), 1.0)], seed=0)
    source.load_state({"cursor": 40, "resume_requests": [r.to_dict() for r in pending]})
    plan = restore_plan(snap, list(source.resume_requests), next_step=3, max_off_policy_steps=1, group_size=8)
    assert plan.to_complete == [(9, task(9), 8), (12, task(12), 8)] and plan.requested_groups == 2
    source.restore(list(snap.taken_members()), plan.to_complete)
    assert list(source.resume_requests) == [GroupRequest(9, task(9), 8, 8), GroupRequest(12, task(12), 8, 8)]
    order = [source.next_group(8).group_id for _ in range(3)]
    assert order == [9, 12, 40]  # resumed groups first, then the next new task
    # pending requests survive a second snapshot
    source2 = TrainSource([(ReverseTextEnv(), 1.0)], seed=0)
    source2.load_state(
        TrainSource([(ReverseTextEnv(), 1.0)], 0, 41).state() | {"resume_requests": [pending[0].to_dict()]}
    )
    assert list(source2.resume_requests) == pending


class _FakeDispatcher:
    def __init__(self):
        self.requests = []

    def emitted_requests(self):
        return list(self.requests)


async def test_snapshot_taken_while_the_loop_mutates_state_is_a_state_that_existed():
    """Capture on the loop, pack in a thread while the loop keeps mutating: no torn snapshot."""
    rng = random.Random(0)
    sink = TrainSink(group_size=4, batch_size=16, max_off_policy_steps=3)
    dispatcher = _FakeDispatcher()
    stop = asyncio.Event()

    async def mutate():
        gid = 0
        while not stop.is_set():
            gid += 1
            dispatcher.requests.append(GroupRequest(gid, task(gid), 4, 0))
            members = [episode(gid, m, rng.random(), rng.randint(0, 3)) for m in range(4)]
            sink.add_episodes(gid, task(gid), members[:2], next_step=2)
            await asyncio.sleep(0)
            sink.add_episodes(gid, task(gid), members[2:], next_step=2)
            dispatcher.requests.pop(0)
            if len(sink.queue) > 40:
                sink.take_batch(step=2)
            await asyncio.sleep(0)

    mutator = asyncio.create_task(mutate())
    try:
        for _ in range(20):
            await asyncio.sleep(rng.random() * 0.002)
            snap = sink.snapshot(dispatcher.emitted_requests())  # on the loop
            expected = copy.deepcopy(snap)  # the state at that instant
            state, tensors = await asyncio.to_thread(pack, snap)  # the loop keeps mutating meanwhile
            assert unpack(state, tensors) == expected
    finally:
        stop.set()
        await mutator


def test_restored_sink_holds_the_fresh_work_and_records_what_aged_out():
    snap = SinkSnapshot(
        pending_batch=[sample(1, 0, 1), sample(2, 0, 3)],
        open_groups=[(7, task(7), [episode(7, 0, 0.9, 1), episode(7, 1, 0.1, 3)])],
        emitted_train_groups=[GroupRequest(8, task(8), 4, 0)],
        counters={"groups_scored": 5, "samples_dropped_stale": 2},
    )
    recorded = []
    sink = TrainSink(
        group_size=4, batch_size=4, max_off_policy_steps=1, record=lambda e, ids, **f: recorded.append((e, ids, f))
    )
    plan = restore_plan(snap, [], next_step=4, max_off_policy_steps=1, group_size=4)  # floor 2
    sink.restore(plan, snap.counters, next_step=4)
    assert [s.trace.episode_id for s in sink.queue] == ["2/0"]
    assert [e.episode_id for e in sink.open_groups[7].episodes] == ["7/1"]
    assert sink.counters.groups_scored == 5 and sink.counters.samples_dropped_stale == 3
    assert sink.counters.members_left_out_stale == 1
    # each too old by the policy that generated it: v below the floor of the resumed step, said in the ledger
    assert recorded == [("dropped_stale", ["1/0", "7/0"], {"step": 4, "at": "resume", "floor": 2, "v": [1, 1]})]
    with pytest.raises(RuntimeError, match="empty sink"):
        sink.restore(plan, {}, next_step=4)


def test_snapshot_counts_name_open_and_requested_groups_apart():
    snap = SinkSnapshot(
        pending_batch=[sample(1, 0, 3), sample(1, 1, 3)],
        open_groups=[(7, task(7), [episode(7, 0, 0.9, 3), episode(7, 1, 0.1, 3)])],
        emitted_train_groups=[GroupRequest(7, task(7), 2, 2), GroupRequest(8, task(8), 4, 0)],
    )
    counts = snap.counts(pending_requests=[GroupRequest(9, task(9), 4, 4)])
    assert counts.model_dump() == {
        "queued_traces": 2,
        "open_groups": 1,  # group 7: two finished, two out
        "requested_groups": 2,  # group 8 in flight, group 9 waiting in the source: nothing finished
        "finished_episodes_kept": 2,
        "conversations_kept": 0,  # no multi-turn env
        "turns_kept": 0,
    }
