"""check_ledger proves invariant 1: every finished episode ends exactly once; rolled-back work is not counted."""

from __future__ import annotations

import pytest
from rlrun.ledger import Ledger, LedgerEvent, check_ledger, read_ledger


def write(root, attempt, role, *events):
    ledger = Ledger(root, attempt, role)
    for event, fields in events:
        ledger.write(event, **fields)
    ledger.close()


def finished(*ids):
    return [(LedgerEvent.FINISHED, {"id": i, "reward": 0.5, "v": 0}) for i in ids]


def trained(step, *ids):
    return (LedgerEvent.TRAINED, {"step": step, "ids": list(ids)})


def test_a_clean_run_accounts_for_every_episode(tmp_path):
    write(
        tmp_path,
        1,
        "orchestrator",
        *finished("1/0", "1/1", "2/0", "2/1", "3/0", "3/1"),
        (LedgerEvent.REJECTED, {"ids": ["2/0", "2/1"], "group": 2, "reason": "zero_advantage"}),
        (LedgerEvent.DROPPED_STALE, {"ids": ["3/0"], "step": 2}),
        (LedgerEvent.LEFTOVER, {"ids": ["3/1"]}),
    )
    write(tmp_path, 1, "trainer", trained(1, "1/0", "1/1"))
    report = check_ledger(tmp_path)
    assert report.ok, report.problems
    assert (report.finished, report.trained, report.rejected, report.dropped_stale, report.leftover) == (6, 2, 2, 1, 1)
    assert report.steps == 1 and report.rolled_back == 0


def test_the_report_says_what_the_generated_tokens_went_to(tmp_path):
    """Issue 48: completion tokens (``finished`` rows' ``n``) of the finished, the trained, and the groups rejected for
    zero spread, split into solved by every member and not; a group rejected for too few fresh members is neither."""
    rows = [("1/0", 1.0, 10), ("1/1", 0.0, 30), ("2/0", 1.0, 4), ("2/1", 1.0, 6), ("3/0", 0.0, 8), ("3/1", 0.0, 8)]
    rows += [("4/0", 0.5, 7), ("4/1", 0.5, 9), ("5/0", 1.0, 100)]
    write(
        tmp_path,
        1,
        "orchestrator",
        *[(LedgerEvent.FINISHED, {"id": i, "reward": r, "v": 0, "n": n}) for i, r, n in rows],
        (LedgerEvent.REJECTED, {"ids": ["2/0", "2/1"], "group": 2, "reason": "zero_advantage"}),
        (LedgerEvent.REJECTED, {"ids": ["3/0", "3/1"], "group": 3, "reason": "zero_advantage"}),
        (LedgerEvent.REJECTED, {"ids": ["4/0", "4/1"], "group": 4, "reason": "zero_advantage"}),
        (LedgerEvent.REJECTED, {"ids": ["5/0"], "group": 5, "reason": "too_few_fresh_members"}),
    )
    write(tmp_path, 1, "trainer", trained(1, "1/0", "1/1"))
    report = check_ledger(tmp_path)
    assert report.ok, report.problems
    assert (report.tokens_finished, report.tokens_trained) == (182, 40)
    assert (report.tokens_zero_spread_solved, report.tokens_zero_spread_unsolved) == (10, 32)
    from rlrun.launcher.progress import tokens_line

    assert tokens_line(report) == (
        "tokens: 182 generated, 22% trained (4.55 generated per trained token); 23% on groups with zero reward "
        "spread (5% solved by every member, 18% not)"
    )


def test_a_lost_episode_and_a_twice_trained_one_are_named(tmp_path):
    write(tmp_path, 1, "orchestrator", *finished("1/0", "1/1", "1/2"))
    write(tmp_path, 1, "trainer", trained(1, "1/0"), trained(2, "1/0", "1/1"))
    report = check_ledger(tmp_path)
    assert not report.ok
    assert "episode 1/2 finished but was never trained, rejected, dropped or left over" in report.problems
    assert any(p.startswith("episode 1/0 has 2 fates") for p in report.problems)


def test_a_step_never_trained_is_a_problem(tmp_path):
    write(tmp_path, 1, "orchestrator", *finished("1/0", "2/0"))
    write(tmp_path, 1, "trainer", trained(2, "1/0", "2/0"))
    assert check_ledger(tmp_path).problems == ["steps never trained: [1]"]


def test_work_after_the_snapshot_a_later_attempt_resumed_from_is_rolled_back(tmp_path):
    # attempt 1: 1/0 and 1/1 finish before its checkpoint (line 2), 9/0 after it; then it dies
    write(
        tmp_path,
        1,
        "orchestrator",
        *finished("1/0", "1/1"),
        (LedgerEvent.CHECKPOINT, {"step": 0, "reason": "periodic", "ledger_line": 1}),
        *finished("9/0"),
    )
    # attempt 2 resumes from that snapshot: 9/0 is regenerated as 9/1, and trains with the rest
    write(
        tmp_path,
        2,
        "orchestrator",
        (LedgerEvent.RESUMED, {"from_attempt": 1, "snapshot_line": 1, "step": 0}),
        *finished("9/1"),
    )
    write(tmp_path, 2, "trainer", trained(1, "1/0", "1/1", "9/1"))
    report = check_ledger(tmp_path)
    assert report.ok, report.problems
    assert report.rolled_back == 1 and report.finished == 3 and report.attempts == [1, 2]


def test_a_later_attempt_supersedes_the_steps_it_retrains(tmp_path):
    write(tmp_path, 1, "orchestrator", *finished("1/0", "2/0"))
    write(tmp_path, 1, "trainer", trained(1, "1/0"), trained(2, "2/0"))
    write(tmp_path, 2, "orchestrator", (LedgerEvent.RESUMED, {"from_attempt": 1, "snapshot_line": 1, "step": 1}))
    write(tmp_path, 2, "trainer", trained(2, "2/0"))  # step 2 trained again from the kept batch file
    report = check_ledger(tmp_path)
    assert report.ok and report.trained == 2, report.problems


def test_training_an_episode_whose_finish_was_rolled_back_is_a_problem(tmp_path):
    write(tmp_path, 1, "orchestrator", *finished("1/0", "5/0"))
    write(tmp_path, 2, "orchestrator", (LedgerEvent.RESUMED, {"from_attempt": 1, "snapshot_line": 0, "step": 0}))
    write(tmp_path, 2, "trainer", trained(1, "1/0", "5/0"))
    assert "episode 5/0 was trained but its finish was rolled back or never recorded" in check_ledger(tmp_path).problems


def test_an_empty_ledger_directory_is_a_problem(tmp_path):
    assert check_ledger(tmp_path).problems == [f"{tmp_path}: no ledger files"]


def test_a_resume_from_older_than_a_completed_checkpoint_is_a_loss(tmp_path):
    # attempt 1 completed checkpoint 4; attempt 2 started over from step 0 (the checkpoint had been pruned away)
    write(
        tmp_path,
        1,
        "orchestrator",
        *finished("1/0", "1/1"),
        (LedgerEvent.CHECKPOINT, {"step": 0, "reason": "periodic", "ledger_line": -1}),
        (LedgerEvent.CHECKPOINT, {"step": 4, "reason": "periodic", "ledger_line": 1}),
    )
    write(tmp_path, 1, "trainer", trained(1, "1/0", "1/1"))
    write(tmp_path, 2, "orchestrator", (LedgerEvent.RESUMED, {"from_attempt": 1, "snapshot_line": -1, "step": 0}))
    report = check_ledger(tmp_path)
    assert (
        "attempt 2 resumed from step 0 although attempt 1 had completed checkpoint 4: trained steps 1–4 were lost"
        in (report.problems)
    )


def test_resuming_from_the_newest_completed_checkpoint_is_no_loss(tmp_path):
    write(
        tmp_path,
        1,
        "orchestrator",
        *finished("1/0"),
        (LedgerEvent.CHECKPOINT, {"step": 2, "reason": "periodic", "ledger_line": 0}),
    )
    write(tmp_path, 1, "trainer", trained(1, "1/0"), trained(2))
    write(tmp_path, 2, "orchestrator", (LedgerEvent.RESUMED, {"from_attempt": 1, "snapshot_line": 0, "step": 2}))
    report = check_ledger(tmp_path)
    assert report.ok, report.problems


def test_episodes_of_an_abandoned_group_are_accounted_for(tmp_path):
    write(
        tmp_path,
        1,
        "orchestrator",
        *finished("1/0", "1/1", "5/0"),
        (LedgerEvent.ABANDONED, {"ids": ["5/0"], "group": 5, "reason": "requests_failed"}),
    )
    write(tmp_path, 1, "trainer", trained(1, "1/0", "1/1"))
    report = check_ledger(tmp_path)
    assert report.ok and report.abandoned == 1 and report.trained == 2, report.problems


def journaled(*pairs):
    """``finished`` events of journaled episodes: ``(id, record)`` pairs."""
    return [(LedgerEvent.FINISHED, {"id": i, "reward": 0.5, "v": 0, "j": j}) for i, j in pairs]


def crash_and_resume(tmp_path, replayed_ids):
    """Attempt 1 acknowledges 1/0 and 1/1 before its checkpoint and 9/0, 9/1 after it, then is killed;
    attempt 2 resumes from that checkpoint and replays ``replayed_ids``."""
    write(
        tmp_path,
        1,
        "orchestrator",
        *journaled(("1/0", 0), ("1/1", 0)),
        (LedgerEvent.CHECKPOINT, {"step": 0, "reason": "periodic", "ledger_line": 1}),
        *journaled(("9/0", 1), ("9/1", 1)),
    )
    events = [(LedgerEvent.RESUMED, {"from_attempt": 1, "snapshot_line": 1, "step": 0})]
    if replayed_ids:
        events.append((LedgerEvent.REPLAYED, {"ids": list(replayed_ids), "attempts": [1], "records": 1}))
    write(tmp_path, 2, "orchestrator", *events)
    write(tmp_path, 2, "trainer", trained(1, "1/0", "1/1", *dict.fromkeys(replayed_ids)))
    return check_ledger(tmp_path)


def test_journaled_episodes_finished_after_the_snapshot_and_replayed_end_exactly_once(tmp_path):
    report = crash_and_resume(tmp_path, ["9/0", "9/1"])
    assert report.ok, report.problems
    assert (report.journaled, report.replayed, report.rolled_back, report.trained) == (4, 2, 2, 4)
    assert report.journal_lost == 0 and report.doubled == 0


def test_a_journaled_episode_that_no_resume_replayed_is_lost(tmp_path):
    report = crash_and_resume(tmp_path, ["9/0"])
    assert not report.ok and report.journal_lost == 1
    assert report.problems == [
        "episode 9/1 was acknowledged by the journal (attempt 1, record 1) but lost: its finish was rolled back "
        "and no later attempt replayed it"
    ]


def test_a_journaled_episode_replayed_twice_is_doubled(tmp_path):
    report = crash_and_resume(tmp_path, ["9/0", "9/1", "9/1"])
    assert not report.ok and report.doubled == 1
    assert "episode 9/1 was finished or replayed 2 times in the final history" in report.problems


def test_an_episode_replayed_although_its_finish_stands_is_doubled(tmp_path):
    # 1/0 finished before the snapshot (so the snapshot holds it): replaying it too would train it twice
    report = crash_and_resume(tmp_path, ["9/0", "9/1", "1/0"])
    assert not report.ok and report.doubled == 1
    assert "episode 1/0 was finished or replayed 2 times in the final history" in report.problems


def test_an_attempt_between_the_checkpoint_and_the_resume_is_rolled_back_and_its_replay_does_not_count(tmp_path):
    # attempt 2 resumed from attempt 1's checkpoint, replayed 9/0, and died before a checkpoint of its own;
    # attempt 3 resumes from the same checkpoint, rolls attempt 2 back whole, and replays 9/0 again
    write(
        tmp_path,
        1,
        "orchestrator",
        *journaled(("1/0", 0), ("1/1", 0)),
        (LedgerEvent.CHECKPOINT, {"step": 0, "reason": "periodic", "ledger_line": 1}),
        *journaled(("9/0", 1)),
    )
    replay_9 = (LedgerEvent.REPLAYED, {"ids": ["9/0"], "attempts": [1], "records": 1})
    resume_1 = (LedgerEvent.RESUMED, {"from_attempt": 1, "snapshot_line": 1, "step": 0})
    write(tmp_path, 2, "orchestrator", resume_1, replay_9)
    write(
        tmp_path,
        3,
        "orchestrator",
        resume_1,
        (LedgerEvent.RESUMED, {"from_attempt": 2, "snapshot_line": -1, "step": 0}),
        replay_9,
    )
    write(tmp_path, 3, "trainer", trained(1, "1/0", "1/1", "9/0"))
    report = check_ledger(tmp_path)
    assert report.ok, report.problems
    assert report.replayed == 1 and report.trained == 3


def stopped_with_a_batch_the_trainer_never_trained(tmp_path, outcome: str | None):
    """A version-2 run: groups 0 and 1 (2 members each) ship in steps 1 and 2; the trainer trains step 1 only (it runs
    behind the orchestrator) and the orchestrator stops with ``outcome`` (None: killed, no ``stopped``)."""
    dispatched = [
        (LedgerEvent.DISPATCHED, {"group": g, "task": g, "env": "e", "first_member": 0, "members": 2, "v": 0})
        for g in (0, 1)
    ]
    stop = [] if outcome is None else [(LedgerEvent.STOPPED, {"outcome": outcome, "step": 2})]
    write(
        tmp_path,
        1,
        "orchestrator",
        (LedgerEvent.STARTED, {"role": "orchestrator", "ledger_version": 2}),
        *dispatched,
        *finished("0/0", "0/1", "1/0", "1/1"),
        (LedgerEvent.SHIPPED, {"step": 1, "ids": ["0/0", "0/1"]}),
        (LedgerEvent.SHIPPED, {"step": 2, "ids": ["1/0", "1/1"]}),
        *stop,
    )
    write(tmp_path, 1, "trainer", trained(1, "0/0", "0/1"))
    return check_ledger(tmp_path)


@pytest.mark.parametrize("outcome", ["error", "paused"])
def test_a_batch_shipped_and_never_trained_when_the_run_stopped_is_left_over(tmp_path, outcome):
    """Issue 35.8 after the merge: an error stop with the trainer a batch behind failed the check ("finished but was
    never trained, rejected, dropped or left over") for the batch's episodes and tasks."""
    report = stopped_with_a_batch_the_trainer_never_trained(tmp_path, outcome)
    assert report.ok, report.problems
    assert (report.finished, report.trained, report.shipped_untrained, report.leftover) == (4, 2, 2, 0)
    assert (report.tasks, report.tasks_trained, report.tasks_leftover) == (2, 1, 1)


def test_a_batch_shipped_and_never_trained_is_pending_when_the_run_was_killed(tmp_path):
    report = stopped_with_a_batch_the_trainer_never_trained(tmp_path, None)
    assert report.ok and report.interrupted, report.problems
    assert (report.pending, report.shipped_untrained, report.tasks_pending) == (2, 0, 1)


def test_a_batch_shipped_and_never_trained_in_a_complete_run_is_a_problem(tmp_path):
    report = stopped_with_a_batch_the_trainer_never_trained(tmp_path, "complete")
    assert "episode 1/0 finished but was never trained, rejected, dropped or left over" in report.problems
    assert "task 1 was dispatched but never trained, rejected, dropped or left over" in report.problems


def test_write_each_is_the_same_lines_as_one_write_per_row(tmp_path):
    rows = [{"id": f"4/{m}", "reward": 0.25 * m, "v": 2, "j": 9} for m in range(3)]
    one = Ledger(tmp_path / "a", 1, "orchestrator")
    assert [one.write(LedgerEvent.FINISHED, **row) for row in rows] == [0, 1, 2]
    one.close()
    each = Ledger(tmp_path / "b", 1, "orchestrator")
    assert each.write_each(LedgerEvent.FINISHED, rows) == 2 and each.lines == 3
    each.close()

    def lines(root):
        return [{k: v for k, v in e.items() if k != "t"} for e in read_ledger(root)[(1, "orchestrator")]]

    expected = [{"e": "finished", **row, "_line": n} for n, row in enumerate(rows)]
    assert lines(tmp_path / "b") == lines(tmp_path / "a") == expected
