"""Cancellation bookkeeping: a cancelled request never orphans its group; every outcome is in the ledger."""

from __future__ import annotations

import json

import pytest
from rlrun.envs import ReverseTextEnv
from rlrun.ledger import Ledger
from rlrun.orchestrator.cancellation import settle
from rlrun.orchestrator.groups import GroupCancellation, GroupRequest
from rlrun.orchestrator.sink import TrainSink
from rlrun.orchestrator.source import TrainSource

from tests.support.samples import episode, task


class Dispatcher:
    """The dispatcher's part in settling: cancelling an abandoned group's other requests."""

    def __init__(self) -> None:
        self.cancelled_groups: list[int] = []

    def cancel_group(self, group_id: int) -> int:
        self.cancelled_groups.append(group_id)
        return 0


@pytest.fixture
def stages(tmp_path):
    ledger = Ledger(tmp_path, attempt=1, role="orchestrator")
    sink = TrainSink(group_size=4, batch_size=8, max_off_policy_steps=1, record=ledger.record)
    source = TrainSource([(ReverseTextEnv(), 1.0)], seed=0, cursor=100)
    yield sink, source, ledger
    ledger.close()


def settle_all(cancellations, sink, source, ledger, max_group_retries=2, dispatcher=None):
    return settle(cancellations, sink, source, dispatcher or Dispatcher(), ledger, max_group_retries)


def events(ledger: Ledger) -> list[dict]:
    ledger.flush()
    return [json.loads(line) for line in ledger.path.read_text().splitlines()]


def test_group_with_fresh_members_gets_its_cancelled_members_requested_again(stages):
    sink, source, ledger = stages
    source.note_members(7, 4)  # members 0–3 were requested (two requests of 2)
    sink.add_episodes(7, task(7), [episode(7, 0, 0.5, 3), episode(7, 1, 0.2, 3)], next_step=4)
    cancelled = GroupCancellation(GroupRequest(7, task(7), 2, first_member=2), min_fresh_version=3, others_out=False)
    assert settle_all([cancelled], sink, source, ledger) == 1
    assert list(source.resume_requests) == [GroupRequest(7, task(7), 2, first_member=4)]
    assert [e.member for e in sink.open_groups[7].episodes] == [0, 1]
    assert events(ledger)[-1] | {"t": 0} == {
        "e": "cancelled",
        "t": 0,
        "group": 7,
        "first_member": 2,
        "members": 2,
        "reason": "stale",
    }


def test_group_whose_members_all_aged_out_is_abandoned_and_the_stale_ones_counted(stages):
    sink, source, ledger = stages
    source.note_members(7, 4)
    sink.add_episodes(7, task(7), [episode(7, 0, 0.5, 1), episode(7, 1, 0.2, 1)], next_step=2)
    cancelled = GroupCancellation(GroupRequest(7, task(7), 2, first_member=2), min_fresh_version=2, others_out=False)
    assert settle_all([cancelled], sink, source, ledger) == 0
    assert 7 not in sink.open_groups and list(source.resume_requests) == []
    assert sink.counters.members_left_out_stale == 2 and sink.counters.groups_abandoned == 1
    dropped = [e for e in events(ledger) if e["e"] == "dropped_stale"]
    assert dropped[0]["ids"] == ["7/0", "7/1"] and dropped[0]["at"] == "cancel"
    [abandoned] = [e for e in events(ledger) if e["e"] == "abandoned"]
    assert abandoned["ids"] == [] and abandoned["reason"] == "stale"  # its members were dropped stale already
    assert source.request_again(7, task(7), 1).first_member == 0  # its numbering was forgotten too


def test_group_with_other_requests_out_goes_on_even_without_finished_members(stages):
    sink, source, ledger = stages
    source.note_members(9, 4)
    cancelled = GroupCancellation(GroupRequest(9, task(9), 2, first_member=0), min_fresh_version=2, others_out=True)
    assert settle_all([cancelled], sink, source, ledger) == 1
    assert list(source.resume_requests) == [GroupRequest(9, task(9), 2, first_member=4)]
    assert 9 not in sink.open_groups  # nothing finished yet: no open group to keep


def test_a_group_going_on_after_a_stale_cancel_is_asked_again_for_the_members_dropped_too(stages):
    """Found by a DAPO run (group_size 16, 4 requests): one request cancelled stale, two finished and dropped stale,
    one already answered. Asking again for the cancelled request's members only left the group 8 short for ever:
    nothing out, nothing asked for, its members holding flow-control budget — the run stopped one batch short."""
    sink, source, ledger = stages  # group_size 4: requests of one member, 0–3
    source.note_members(7, 4)
    sink.add_episodes(7, task(7), [episode(7, 0, 0.5, 1), episode(7, 1, 0.2, 1)], next_step=2)
    cancelled = GroupCancellation(GroupRequest(7, task(7), 1, first_member=2), min_fresh_version=2, others_out=True)
    assert settle_all([cancelled], sink, source, ledger) == 1
    # member 2 cancelled, members 0 and 1 dropped stale: three asked again, member 3 still out
    assert list(source.resume_requests) == [GroupRequest(7, task(7), 3, first_member=4)]
    assert sink.open_groups[7].episodes == [] and sink.counters.members_left_out_stale == 2
    # the answered member 3 (stale) and the three asked again complete the group: it is scored, not left open
    sink.add_episodes(7, task(7), [episode(7, 3, 0.0, 1)], next_step=4)  # floor 2, as the cancel's
    queued = sink.add_episodes(7, task(7), [episode(7, m, m / 10, 2) for m in (4, 5, 6)], next_step=4)
    assert 7 not in sink.open_groups and [s.trace.episode_id for s in queued] == ["7/4", "7/5", "7/6"]


def test_abandoning_a_group_drops_a_request_of_it_still_waiting_in_the_source(stages):
    sink, source, ledger = stages
    source.note_members(5, 2)
    source.request_again(5, task(5), 2)  # e.g. from an earlier cancellation, not dispatched yet
    cancelled = GroupCancellation(GroupRequest(5, task(5), 2, first_member=0), min_fresh_version=2, others_out=False)
    settle_all([cancelled], sink, source, ledger)
    assert list(source.resume_requests) == []  # otherwise its members would open a group nobody completes


def failed(group_id, first_member, members, others_out=False):
    request = GroupRequest(group_id, task(group_id), members, first_member)
    return GroupCancellation(request, None, others_out, reason="failed", error="no answer within 300 s")


def test_a_failed_request_is_requested_again_up_to_max_group_retries_then_its_group_abandoned(stages):
    sink, source, ledger = stages
    dispatcher = Dispatcher()
    source.note_members(3, 4)  # members 0-1 and 2-3 requested
    sink.add_episodes(3, task(3), [episode(3, 0, 0.5, 1), episode(3, 1, 0.1, 1)], next_step=2)
    assert settle_all([failed(3, 2, 2)], sink, source, ledger, dispatcher=dispatcher) == 1
    assert source.resume_requests.popleft() == GroupRequest(3, task(3), 2, first_member=4)
    assert settle_all([failed(3, 4, 2)], sink, source, ledger, dispatcher=dispatcher) == 1
    assert source.resume_requests.popleft() == GroupRequest(3, task(3), 2, first_member=6)
    assert source.retries(3) == 2
    assert settle_all([failed(3, 6, 2, others_out=True)], sink, source, ledger, dispatcher=dispatcher) == 0
    assert 3 not in sink.open_groups and list(source.resume_requests) == [] and dispatcher.cancelled_groups == [3]
    assert sink.counters.groups_abandoned == 1
    [abandoned] = [e for e in events(ledger) if e["e"] == "abandoned"]
    assert abandoned["ids"] == ["3/0", "3/1"] and abandoned["reason"] == "requests_failed"
    reasons = [(e["reason"], e.get("error")) for e in events(ledger) if e["e"] == "cancelled"]
    assert reasons == [("failed", "no answer within 300 s")] * 3
    # a result of the group that was already queued when it was given up is accounted for, not reopened
    assert sink.add_episodes(3, task(3), [episode(3, 8, 0.9, 1)], next_step=2) == []
    assert 3 not in sink.open_groups
    assert [e["ids"] for e in events(ledger) if e["e"] == "abandoned"][-1] == ["3/8"]


def test_with_no_retries_allowed_a_failed_group_is_abandoned_at_once(stages):
    sink, source, ledger = stages
    assert settle_all([failed(4, 0, 4)], sink, source, ledger, max_group_retries=0) == 0
    assert sink.counters.groups_abandoned == 1 and list(source.resume_requests) == []


def test_retry_counts_survive_a_checkpoint_of_the_source(stages):
    sink, source, ledger = stages
    settle_all([failed(6, 0, 4)], sink, source, ledger)
    restored = TrainSource([(ReverseTextEnv(), 1.0)], seed=0)
    restored.load_state(source.state())
    assert restored.retries(6) == 1


@pytest.mark.parametrize("second", ["stale", "lost", "failed"])
def test_a_group_whose_two_requests_are_cancelled_together_is_abandoned_once(stages, second):
    sink, source, ledger = stages
    source.note_members(7, 4)  # two requests of 2 members each, both out
    sink.add_episodes(7, task(7), [episode(7, 0, 0.5, 1)], next_step=2)
    first = GroupCancellation(GroupRequest(7, task(7), 2, first_member=0), min_fresh_version=2, others_out=False)
    other = GroupCancellation(
        GroupRequest(7, task(7), 2, first_member=2), min_fresh_version=2, others_out=False, reason=second
    )
    dispatcher = Dispatcher()
    assert settle_all([first, other], sink, source, ledger, dispatcher=dispatcher) == 0
    assert sink.counters.groups_abandoned == 1 and dispatcher.cancelled_groups == [7]
    assert [e["e"] for e in events(ledger)].count("abandoned") == 1
    assert [e["first_member"] for e in events(ledger) if e["e"] == "cancelled"] == [0, 2]  # each request recorded
    assert list(source.resume_requests) == []  # an abandoned group is not brought back by its other request
    sink.abandon(7, reason="stale")  # and abandoning it again changes nothing
    assert sink.counters.groups_abandoned == 1
