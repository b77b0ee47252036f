"""The run directory's rule for "this directory already holds a run" (:func:`rlrun.rundir.holds_a_run`): one
threshold, past step 0, for ``rlrun local``, the orchestrator and the trainer."""

from __future__ import annotations

from rlrun.launcher.preflight import run_dir_problem
from rlrun.rundir import RunDir, holds_a_run


def test_a_run_dir_holds_a_run_once_a_checkpoint_or_batch_is_past_step_0(tmp_path):
    run_dir = RunDir(tmp_path / "run")
    assert holds_a_run(run_dir) == []  # no directory at all
    (run_dir.checkpoints / "step_0").mkdir(parents=True)  # a fresh start's own start-up checkpoint
    assert holds_a_run(run_dir) == [] and run_dir_problem(run_dir) is None
    run_dir.rollout_batch(1).mkdir(parents=True)
    assert holds_a_run(run_dir) == [run_dir.rollouts]
    assert holds_a_run(run_dir, count_batches=False) == []  # the trainer: its own orchestrator's batch 1
    run_dir.checkpoint(2).mkdir(parents=True)
    assert holds_a_run(run_dir) == [run_dir.checkpoints, run_dir.rollouts]
    assert holds_a_run(run_dir, count_batches=False) == [run_dir.checkpoints]
    assert "already holds a run" in run_dir_problem(run_dir)
