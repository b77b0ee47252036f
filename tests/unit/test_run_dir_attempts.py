"""Attempts numbered per run directory: a run re-created over the same directory (a new run uid) continues
the count, so nothing it checks by attempt can take the earlier run's files for its own."""

from __future__ import annotations

import json

from rlrun.api.control import StatusReport
from rlrun.ledger import Ledger
from rlrun.rundir import ATTEMPT_OFFSETS_FILE, RunDir, publish_dir, run_dir_attempt, write_meta
from rlrun.training.batches import batch_accepted
from rlrun.training.trainer import Trainer

from tests.support.manifests import parse
from tests.support.orchestrators import make_orchestrator

SPEC = parse("attempts", max_steps=4).spec


def stale_batch(run_dir: RunDir, step: int, attempt: int):
    return publish_dir(run_dir.rollout_batch(step), lambda tmp: write_meta(tmp, step, attempt, traces=[]))


def test_a_new_run_uid_continues_after_the_highest_attempt_and_each_uid_keeps_its_offset(tmp_path):
    run_dir = RunDir(tmp_path)
    assert run_dir_attempt(run_dir, None, 3) == 3 and not (tmp_path / ATTEMPT_OFFSETS_FILE).exists()  # rlrun local
    assert [run_dir_attempt(run_dir, "uid-a", n) for n in (0, 1, 1)] == [0, 1, 1]  # the first run: unchanged
    assert [run_dir_attempt(run_dir, "uid-b", n) for n in (0, 1)] == [2, 3]  # re-created over the same directory
    assert run_dir_attempt(run_dir, "uid-a", 1) == 1  # looked up, not assigned again
    saved = json.loads((tmp_path / ATTEMPT_OFFSETS_FILE).read_text())
    assert saved == {"runs": {"uid-a": 0, "uid-b": 2}, "highest": 3}


def test_a_directory_used_before_run_uids_counts_its_ledger_attempts(tmp_path):
    run_dir = RunDir(tmp_path)
    for attempt in (1, 4):  # e.g. rlrun local's attempts
        Ledger(tmp_path / "ledger", attempt, "trainer").close()
    assert run_dir_attempt(run_dir, "uid-a", 0) == 5
    (tmp_path / ATTEMPT_OFFSETS_FILE).write_text("{torn")  # unreadable: offsets are assigned past the ledger
    assert run_dir_attempt(run_dir, "uid-b", 0) == 5


def test_a_batch_stamped_by_the_earlier_run_is_not_accepted_by_the_re_created_one(tmp_path):
    run_dir = RunDir(tmp_path)
    assert [run_dir_attempt(run_dir, "uid-a", n) for n in (0, 1)] == [0, 1]
    stale = stale_batch(run_dir, 1, attempt=1)  # uid-a's attempt 1 shipped batch 1, then the RLRun was deleted
    attempt = run_dir_attempt(run_dir, "uid-b", 0)
    assert attempt == 2
    assert not batch_accepted(stale, 1, attempt, shipped_at_restore=0)
    assert batch_accepted(stale, 1, attempt, shipped_at_restore=1)  # counted as shipped by the checkpoint resumed
    assert batch_accepted(stale_batch(run_dir, 2, attempt=2), 2, attempt, shipped_at_restore=0)


def test_the_trainer_and_orchestrator_stamp_the_run_dir_attempt_and_status_echoes_the_operators(tmp_path, tiny_model):
    run_dir = RunDir(tmp_path)
    run_dir_attempt(run_dir, "uid-a", 1)
    stale = stale_batch(run_dir, 1, attempt=1)
    trainer = Trainer(SPEC, run_dir, str(tiny_model), resume=True, attempt=0, run_uid="uid-b")
    trainer.ledger.close()
    assert trainer.attempt == 2 and trainer.ledger.path.name == "attempt-2.trainer.jsonl"
    assert not batch_accepted(stale, 1, trainer.attempt, trainer.shipped_at_restore)
    orch = make_orchestrator(SPEC, run_dir, tiny_model, attempt=0, run_uid="uid-b")
    orch.ledger.close()
    assert orch.attempt == 2 and orch.ledger.path.name == "attempt-2.orchestrator.jsonl"
    report = StatusReport.model_validate_json(orch.status().model_dump_json())
    assert report.attempt == 0 and report.run_dir_attempt == 2  # the operator compares `attempt` with its count
