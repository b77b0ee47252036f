"""The LR schedule across a preemption, on the real trainer and orchestrator (``rlrun local --preempt-at-step``,
the fake rollout server): every step trains at the rate of the uninterrupted run, because the scheduler's state
travels in the trainer's checkpoint; and a resume with another schedule is refused before any process starts."""

from __future__ import annotations

import subprocess

import pytest
from rlrun.training.schedule import lr_factor

from tests.support.manifests import PREEMPTION_RUN, write_manifest
from tests.support.runs import local_argv, metrics

MAX_STEPS = 10
OPTIMIZER = {"lr": 1e-3, "lr_schedule": "cosine", "warmup_steps": 2, "min_lr_ratio": 0.1}


def test_a_preempted_run_trains_every_step_at_the_rate_of_the_uninterrupted_one(tmp_path, cache_dir, tiny_model):
    manifest = write_manifest(tmp_path / "m.yaml", base=PREEMPTION_RUN, max_steps=MAX_STEPS, optimizer=OPTIMIZER)
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        local_argv(manifest, run_dir, cache_dir, "--preempt-at-step", "3"), capture_output=True, text=True, timeout=600
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    assert "1 preemption(s)" in out and "ledger: ok" in out, out[-3000:]
    # the uninterrupted run's rates (step s trains with lr · λ(s − 1)): 0, 0.5e-3, 1e-3, then the cosine to 1e-4
    expected = {
        s: 1e-3 * lr_factor(s - 1, schedule="cosine", warmup_steps=2, horizon=MAX_STEPS, min_lr_ratio=0.1)
        for s in range(1, MAX_STEPS + 1)
    }
    rows = metrics(run_dir / "trainer_metrics.jsonl")
    assert {r["step"] for r in rows} == set(expected)
    assert {r["attempt"] for r in rows} == {1, 2}  # both attempts trained steps
    for row in rows:  # every line, of either attempt (a step trained again after the resume logs again)
        assert row["lr"] == pytest.approx(expected[row["step"]], rel=1e-9, abs=1e-15), row
    resumed = min(r["step"] for r in rows if r["attempt"] == 2)
    assert resumed > 1 and expected[resumed] > 0  # attempt 2 began past the warmup's first step: restored, not reset

    # the schedule is not safe to change: a resume with another one is refused, naming the field, before any start
    other = write_manifest(
        tmp_path / "other.yaml", base=PREEMPTION_RUN, max_steps=MAX_STEPS, optimizer={**OPTIMIZER, "warmup_steps": 4}
    )
    again = subprocess.run(
        local_argv(other, run_dir, cache_dir, "--resume", "--max-steps", str(MAX_STEPS + 2)),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert again.returncode == 2, again.stdout[-3000:]
    assert "spec.optimizer.warmup_steps: checkpoint has 2, manifest has 4" in again.stdout
    assert "no process" not in again.stdout and "model:" not in again.stdout
