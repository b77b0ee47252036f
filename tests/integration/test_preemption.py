"""``rlrun local --preempt-at-step K``: pause → snapshot → the trainer saves on notice → SIGKILL everything →
resume, on the real stack."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from rlrun.ledger import check_ledger
from rlrun.rundir import RunDir

from tests.support.manifests import PREEMPTION_RUN, write_manifest
from tests.support.runs import local_argv, metrics
from tests.support.trackers import LOGGING, tensorboard_scalars, wandb_history, wandb_offline_runs

# The one launcher run on real vLLM: the weights it publishes are reloaded by the real worker extension
# in the middle of a run, before and after a preemption.
pytestmark = pytest.mark.vllm

MAX_STEPS = 14


def test_preempt_at_step_resumes_queued_samples_and_open_groups(tmp_path, cache_dir, tiny_model):
    # batch 18 with groups of 4 leaves overflow in the queue; 2 members per request leaves half-finished groups
    # The pause lands a moment after trainer step 5 (the launcher's poll, PREEMPT_DELAY_S, the pause itself), and
    # the orchestrator ships at most max_off_policy_steps + 1 = 3 batches past the trainer. With 10 steps, a trainer
    # that reached step 7 before the pause landed let attempt 1 ship all 10 (seen once on a loaded machine): attempt 2
    # then had nothing to generate. 14 steps leave 6 trainer steps (≥ 3 s here) between the trigger and the end.
    manifest = write_manifest(tmp_path / "m.yaml", base=PREEMPTION_RUN, max_steps=MAX_STEPS, logging=LOGGING)
    run_dir = tmp_path / "run"
    argv = local_argv(manifest, run_dir, cache_dir, "--preempt-at-step", "5")
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    m = re.search(
        r"Resuming with (\d+) queued traces, (\d+) open groups \((\d+) finished episodes kept\) "
        r"and (\d+) requested groups",
        out,
    )
    assert m, out[-3000:]
    queued, open_groups, kept, requested = map(int, m.groups())
    # What the pause snapshot kept comes back (less what the staleness sweep drops; the journal may turn a
    # requested group into an open one). Whether it kept anything depends on timing: an orchestrator that had
    # filled its staleness budget sits idle, and its queue can be empty at a batch boundary.
    log = (run_dir / "logs" / "orchestrator.log").read_text()
    pause = re.search(
        r", pause\): (\d+) queued traces, (\d+) open groups \(\d+ finished episodes kept\), (\d+) requested", log
    )
    dropped = int(re.search(r"Resuming with .* (\d+) stale dropped", log).group(1))
    assert pause, log[-3000:]
    if sum(map(int, pause.groups())) > 0:
        assert queued + open_groups + requested + dropped > 0
    lost = int(re.search(r"progress-only checkpoint would have lost (\d+) finished episodes", out).group(1))
    assert (
        lost == queued + kept or lost >= queued
    )  # stale ones dropped at resume still count as work a bare cursor loses
    assert "1 preemption(s)" in out and "ledger: ok" in out
    # the trainer's notice: it saved the step it had, the paused orchestrator paired it, nothing recomputed
    assert "trainer steps recomputed: 0; rollout server restarts: 1" in out, out[-3000:]
    [record] = [json.loads(line) for line in (run_dir / "preemptions.jsonl").read_text().splitlines()]
    assert (record["only"], record["trainer_exit"], record["steps_recomputed"]) == ("all", 143, 0)
    saved = record["trainer_saved_step"]
    assert saved >= 5 and record["next_step"] == saved + 1 and saved >= record["pause_step"]
    if saved > record["pause_step"]:  # usual: the trainer trained past the pause's step, then saved
        assert f"trainer saved checkpoint step {saved} on notice" in out and "paired with the pause snapshot" in out
    rows = metrics(run_dir / "metrics.jsonl")
    assert sorted({r["step"] for r in rows}) == list(range(1, MAX_STEPS + 1))
    assert {r["attempt"] for r in rows} == {1, 2}
    report = check_ledger(run_dir / "ledger")
    assert report.ok and report.rolled_back == 0 and report.steps == MAX_STEPS, report.problems
    check = subprocess.run(
        [sys.executable, "-m", "rlrun", "ledger", "check", str(run_dir)], capture_output=True, text=True
    )
    assert check.returncode == 0 and json.loads(check.stdout)["ok"] is True
    # The experiment trackers: one W&B run across both attempts, each step once, steps only growing. The drill
    # SIGKILLs attempt 1 after its pause, and the pause closed its trackers first (W&B's finish() confirmed what it
    # holds): attempt 2 logs from there, so the offline files themselves hold each step once (issue 36.5).
    runs = wandb_offline_runs(RunDir(run_dir))
    assert len(runs) == 2 and runs[0][0] == runs[1][0] == json.loads((run_dir / "tracking.json").read_text())["run_id"]
    assert [step for _, rows in runs for step, _ in rows] == list(range(1, MAX_STEPS + 1))
    history = wandb_history(RunDir(run_dir))
    assert [step for step, _ in history] == list(range(1, MAX_STEPS + 1)), [s for s, _ in history]
    by_step = dict(history)
    assert by_step[MAX_STEPS]["run/attempt"] == 2 and by_step[MAX_STEPS]["run/resumes"] == 1
    assert "run/resumed_groups" in by_step[record["next_step"]]  # the resume, marked at the step after it
    assert "train/mismatch_kl" in by_step[1]
    # a step's reward_mean is null when no episode was scored since the line before (a busy machine: any step,
    # the last included) and a null is not logged: every step that has one logs it, and attempt 2 has some
    last = {r["step"]: r for r in rows}
    scored = [step for step, r in last.items() if r["reward_mean"] is not None]
    assert [s for s in scored if "rollout/reward_mean" not in by_step[s]] == []
    assert any(last[s]["attempt"] == 2 for s in scored)
    tb = tensorboard_scalars(RunDir(run_dir))  # flushed at each look: durable, never logged twice
    assert [step for step, _ in tb["train/loss"]] == list(range(1, MAX_STEPS + 1))
    assert "experiment tracker: " in out and "tensorboard --logdir" in out
