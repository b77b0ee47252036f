"""Flow control: no work is dispatched that would be stale on arrival; max_off_policy_steps 0 is synchronous."""

from __future__ import annotations

import json
import time

import pytest
from rlrun.orchestrator.flow import FlowControl
from rlrun.orchestrator.staleness import min_fresh_version


def flow(k: int = 1, max_steps: int = 100, max_inflight: int = 256) -> FlowControl:
    return FlowControl(
        batch_size=8, group_size=4, max_off_policy_steps=k, max_inflight=max_inflight, max_steps=max_steps
    )


@pytest.mark.parametrize(
    ("k", "version", "shipped", "budget"),
    [
        (1, 0, 0, 16),  # batches 1 and 2 may hold version-0 samples
        (1, 0, 1, 8),
        (1, 0, 2, 0),  # batch 3 needs version ≥ 1: wait for the trainer
        (1, 3, 2, 24),
        (0, 0, 0, 8),  # synchronous: one batch per policy version
        (0, 0, 1, 0),
        (0, 1, 1, 8),
        (3, 0, 0, 32),
    ],
)
def test_budget_is_the_batches_the_current_policy_can_still_fill(k, version, shipped, budget):
    assert flow(k).budget(version, shipped) == budget


@pytest.mark.parametrize("k", [0, 1, 2, 5])
def test_everything_the_budget_allows_can_still_train_when_it_arrives(k):
    f = flow(k)
    for version in range(6):
        for shipped in range(version, version + k + 2):
            # the last batch the committed samples can fill, at most
            last = shipped + max(f.budget(version, shipped), 0) // f.batch_size
            assert last == shipped or version >= min_fresh_version(last, k)


def test_no_batch_past_max_steps_is_budgeted():
    assert flow(k=4, max_steps=3).budget(policy_version=0, shipped=1) == 16  # batches 2 and 3 only
    assert flow(k=4, max_steps=3).budget(policy_version=0, shipped=3) == 0


def test_dispatch_needs_budget_and_room_for_a_whole_group_in_flight():
    f = flow(k=1, max_inflight=10)
    assert f.may_dispatch(committed=15, inflight=6, policy_version=0, shipped=0)
    assert not f.may_dispatch(committed=16, inflight=0, policy_version=0, shipped=0)  # budget of 16 used
    assert not f.may_dispatch(committed=0, inflight=7, policy_version=0, shipped=0)  # 7 + 4 > 10


def test_the_rest_of_a_counted_group_needs_only_a_batch_left_and_room_in_flight():
    # the last step: one batch (18) left; the queue holds 16 and an open group keeps 2 finished members, so the
    # committed budget is used up, yet the batch needs that group whole: its other 2 members must be requested
    f = FlowControl(batch_size=18, group_size=4, max_off_policy_steps=2, max_inflight=64, max_steps=6)
    assert not f.may_dispatch(committed=16 + 2, inflight=0, policy_version=5, shipped=5)  # no new group
    assert f.may_complete(members=2, inflight=0, policy_version=5, shipped=5)
    assert not f.may_complete(members=2, inflight=63, policy_version=5, shipped=5)  # 63 + 2 > 64 in flight
    assert not f.may_complete(members=2, inflight=0, policy_version=5, shipped=6)  # no batch left: stale
    assert not f.may_complete(members=2, inflight=0, policy_version=0, shipped=3)  # needs version ≥ 1 (k = 2)


async def test_a_batch_being_written_counts_as_shipped_so_no_rollout_is_bought_that_cannot_train(
    tmp_path, tiny_model, monkeypatch
):
    """A weight update landing while a batch is written must not dispatch a batch more than can train."""
    from rlrun.orchestrator import loop
    from rlrun.rundir import RunDir

    from tests.support.manifests import parse
    from tests.support.orchestrators import make_orchestrator, run_to_the_end

    write = loop.write_batch

    def slow_write(*args, **kwargs):  # a slow disk: the write window is where the budget was miscounted
        time.sleep(0.3)
        return write(*args, **kwargs)

    monkeypatch.setattr(loop, "write_batch", slow_write)
    spec = parse("flow", group_size=4, batch_size=16, max_off_policy_steps=1, max_steps=6).spec
    run_dir = RunDir(tmp_path)
    orch = make_orchestrator(spec, run_dir, tiny_model)
    assert await run_to_the_end(orch, interval=1) == 6
    counters = orch.sink.counters
    assert counters.samples_shipped == 6 * 16
    assert counters.samples_dropped_stale + counters.members_left_out_stale == 0  # nothing made that could not train
    line = json.loads((run_dir.root / "metrics.jsonl").read_text().splitlines()[-1])
    assert line["episodes_wasted_stale"] == 0 and line["stale_wasted_fraction"] == 0.0
