"""The LR schedule across a preemption, on the real trainer and orchestrator (``rlrun local --preempt-at-step``,
the fake rollout server): every step trains at the rate of the uninterrupted run, because the scheduler's state
travels in the trainer's checkpoint; and a resume with another schedule is refused before any process starts.

The run is the tier's :func:`~tests.integration.conftest.trainer_preempted_run` (its trainer preempted after step 2,
restarted with ``--resume`` from the part it saved on notice), which ``test_local_launcher.py`` reads too: one run
of 10 steps for both files' claims."""

from __future__ import annotations

import json
import subprocess

import pytest
from rlrun.training.schedule import lr_factor

from tests.integration.conftest import PREEMPTED_RUN_OPTIMIZER, PREEMPTED_RUN_STEPS
from tests.support.manifests import PREEMPTION_RUN, write_manifest
from tests.support.runs import local_argv, metrics


def files(root):
    """Every file under ``root`` with its size and modification time: what a refused command must leave as it was."""
    return {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


def test_a_preempted_run_trains_every_step_at_the_rate_of_the_uninterrupted_one(trainer_preempted_run, cache_dir):
    run_dir, out = trainer_preempted_run.run_dir, trainer_preempted_run.out
    assert trainer_preempted_run.returncode == 0, out[-5000:]
    assert "1 preemption(s)" in out and "ledger: ok" in out, out[-3000:]
    # the uninterrupted run's rates (step s trains with lr · λ(s − 1)): 0, 0.5e-3, 1e-3, then the cosine to 1e-4
    expected = {
        s: 1e-3 * lr_factor(s - 1, schedule="cosine", warmup_steps=2, horizon=PREEMPTED_RUN_STEPS, min_lr_ratio=0.1)
        for s in range(1, PREEMPTED_RUN_STEPS + 1)
    }
    rows = metrics(run_dir / "trainer_metrics.jsonl")
    assert {r["step"] for r in rows} == set(expected)
    for row in rows:  # every line, of either trainer process (a step trained again after a resume logs again)
        assert row["lr"] == pytest.approx(expected[row["step"]], rel=1e-9, abs=1e-15), row
    # the restarted trainer (same attempt) trained from the step after the part it saved on notice and restored
    [record] = [json.loads(line) for line in (run_dir / "preemptions.jsonl").read_text().splitlines()]
    resumed = record["next_step"]  # the restarted trainer's first step
    assert (record["only"], record["steps_recomputed"]) == ("trainer", 0)
    assert resumed == record["trainer_saved_step"] + 1 and 2 < resumed <= PREEMPTED_RUN_STEPS
    assert expected[resumed] > 0  # past the warmup's first step: a scheduler reset would train it at 0

    # the schedule is not safe to change: a resume with another one is refused, naming the field, before any start
    other = write_manifest(
        trainer_preempted_run.manifest.parent / "other.yaml",
        base=PREEMPTION_RUN,
        max_steps=PREEMPTED_RUN_STEPS,
        optimizer={**PREEMPTED_RUN_OPTIMIZER, "warmup_steps": 4},
    )
    before = files(run_dir)
    again = subprocess.run(
        local_argv(other, run_dir, cache_dir, "--resume", "--max-steps", str(PREEMPTED_RUN_STEPS + 2)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert again.returncode == 2, again.stdout[-3000:]
    assert "spec.optimizer.warmup_steps: checkpoint has 2, manifest has 4" in again.stdout
    assert "no process" not in again.stdout and "model:" not in again.stdout
    assert files(run_dir) == before  # the run directory the other tests read is left as it was
