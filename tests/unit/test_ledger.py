"""check_ledger proves invariant 1: every finished episode ends exactly once; rolled-back work is not counted."""

from __future__ import annotations

from rlrun.ledger import Ledger, LedgerEvent, check_ledger


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
        tmp_path, 1, "orchestrator",
        *finished("1/0", "1/1", "2/0", "2/1", "3/0", "3/1"),
        (LedgerEvent.REJECTED, {"ids": ["2/0", "2/1"], "group": 2, "reason": "zero_advantage"}),
        (LedgerEvent.DROPPED_STALE, {"ids": ["3/0"], "step": 2}),
        (LedgerEvent.LEFTOVER, {"ids": ["3/1"]}),
    )  # fmt: skip
    write(tmp_path, 1, "trainer", trained(1, "1/0", "1/1"))
    report = check_ledger(tmp_path)
    assert report.ok, report.problems
    assert (report.finished, report.trained, report.rejected, report.dropped_stale, report.leftover) == (6, 2, 2, 1, 1)
    assert report.steps == 1 and report.rolled_back == 0


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
        tmp_path, 1, "orchestrator",
        *finished("1/0", "1/1"),
        (LedgerEvent.CHECKPOINT, {"step": 0, "reason": "periodic", "ledger_line": 1}),
        *finished("9/0"),
    )  # fmt: skip
    # attempt 2 resumes from that snapshot: 9/0 is regenerated as 9/1, and trains with the rest
    write(
        tmp_path, 2, "orchestrator",
        (LedgerEvent.RESUMED, {"from_attempt": 1, "snapshot_line": 1, "step": 0}),
        *finished("9/1"),
    )  # fmt: skip
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
        tmp_path, 1, "orchestrator",
        *finished("1/0", "1/1"),
        (LedgerEvent.CHECKPOINT, {"step": 0, "reason": "periodic", "ledger_line": -1}),
        (LedgerEvent.CHECKPOINT, {"step": 4, "reason": "periodic", "ledger_line": 1}),
    )  # fmt: skip
    write(tmp_path, 1, "trainer", trained(1, "1/0", "1/1"))
    write(tmp_path, 2, "orchestrator", (LedgerEvent.RESUMED, {"from_attempt": 1, "snapshot_line": -1, "step": 0}))
    report = check_ledger(tmp_path)
    assert (
        "attempt 2 resumed from step 0 although attempt 1 had completed checkpoint 4: trained steps 1–4 were lost"
        in (report.problems)
    )


def test_resuming_from_the_newest_completed_checkpoint_is_no_loss(tmp_path):
    write(
        tmp_path, 1, "orchestrator",
        *finished("1/0"),
        (LedgerEvent.CHECKPOINT, {"step": 2, "reason": "periodic", "ledger_line": 0}),
    )  # fmt: skip
    write(tmp_path, 1, "trainer", trained(1, "1/0"), trained(2))
    write(tmp_path, 2, "orchestrator", (LedgerEvent.RESUMED, {"from_attempt": 1, "snapshot_line": 0, "step": 2}))
    report = check_ledger(tmp_path)
    assert report.ok, report.problems


def test_episodes_of_an_abandoned_group_are_accounted_for(tmp_path):
    write(
        tmp_path, 1, "orchestrator",
        *finished("1/0", "1/1", "5/0"),
        (LedgerEvent.ABANDONED, {"ids": ["5/0"], "group": 5, "reason": "requests_failed"}),
    )  # fmt: skip
    write(tmp_path, 1, "trainer", trained(1, "1/0", "1/1"))
    report = check_ledger(tmp_path)
    assert report.ok and report.abandoned == 1 and report.trained == 2, report.problems
