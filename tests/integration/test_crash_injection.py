"""Kill the orchestrator at every save phase and at random instants; every resume must start
from a complete checkpoint, finish the run, and pass the ledger check (invariants 1, 2, 4).

Each trial runs a real trainer and a real orchestrator against the session's real vLLM
server: attempt 1 dies (SIGKILL, injected with ``$RLRUN_CRASH_AT`` or sent from here), its
trainer is killed too, and attempt 2 resumes and runs to ``max_steps``.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest
from rlrun.checkpoint import complete_steps, latest_complete_checkpoint
from rlrun.ledger import check_ledger
from rlrun.rundir import SAVE_PHASES, RunDir

from .helpers import metrics, write_manifest

pytestmark = pytest.mark.integration

MAX_STEPS = 8


def start(role, manifest, run_dir, cache_dir, url, attempt, resume, env_extra=None):
    argv = [
        sys.executable,
        "-m",
        "rlrun",
        role,
        str(manifest),
        "--run-dir",
        str(run_dir),
        "--cache-dir",
        str(cache_dir),
    ]
    argv += ["--attempt", str(attempt)]
    if role == "orchestrator":
        argv += ["--rollout-url", url]
    if resume:
        argv.append("--resume")
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    log = open(run_dir / f"{role}-{attempt}.log", "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)


def run_trial(
    tmp_path,
    cache_dir,
    url,
    crash_env=None,
    kill_after_s=None,
    sigterm_at_step=None,
    kill_at_step=None,
    first_trainer=True,
):
    manifest = write_manifest(
        tmp_path / "m.yaml",
        group_size=4,
        batch_size=10,
        max_steps=MAX_STEPS,
        checkpoint={"interval": 2, "keep_last": 2},
        sampling={"max_tokens": 12},
        rollout={"max_inflight": 32, "members_per_request": 2},
    )
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    trainer = start("trainer", manifest, run_dir, cache_dir, url, 1, False) if first_trainer else None
    orch = start("orchestrator", manifest, run_dir, cache_dir, url, 1, False, crash_env)
    try:
        if kill_after_s is not None:
            deadline = time.monotonic() + kill_after_s
            while time.monotonic() < deadline and orch.poll() is None:
                time.sleep(0.05)
            orch.send_signal(signal.SIGKILL)
        if sigterm_at_step is not None:
            while len(metrics(run_dir / "metrics.jsonl")) < sigterm_at_step and orch.poll() is None:
                time.sleep(0.05)
            orch.send_signal(signal.SIGTERM)
        if kill_at_step is not None:
            while len(metrics(run_dir / "metrics.jsonl")) < kill_at_step and orch.poll() is None:
                time.sleep(0.05)
            orch.send_signal(signal.SIGKILL)
        code = orch.wait(timeout=180)
    finally:
        if trainer is not None:
            trainer.send_signal(signal.SIGKILL)
            trainer.wait(timeout=30)
        orch.kill()
    if crash_env:
        assert code == -signal.SIGKILL, (run_dir / "orchestrator-1.log").read_text()[-3000:]
    if sigterm_at_step is not None:
        log1 = (run_dir / "orchestrator-1.log").read_text()
        assert code == 0, log1[-3000:]
        assert "SIGTERM: pausing" in log1 and ", pause)" in log1
    ckpt = latest_complete_checkpoint(RunDir(run_dir))  # what the resume will start from (may be none)
    trainer = start("trainer", manifest, run_dir, cache_dir, url, 2, True)
    orch = start("orchestrator", manifest, run_dir, cache_dir, url, 2, True)
    try:
        assert orch.wait(timeout=240) == 0, (run_dir / "orchestrator-2.log").read_text()[-3000:]
        assert trainer.wait(timeout=120) == 0, (run_dir / "trainer-2.log").read_text()[-3000:]
    finally:
        for p in (orch, trainer):
            p.kill()
    log2 = (run_dir / "orchestrator-2.log").read_text()
    if ckpt is not None:
        assert f"step {ckpt.step}," in log2 and "Resuming with" in log2
    report = check_ledger(run_dir / "ledger")
    assert report.ok, report.problems
    assert report.steps == MAX_STEPS and report.trained > 0
    assert complete_steps(RunDir(run_dir))[-1] == MAX_STEPS
    steps = sorted({r["step"] for r in metrics(run_dir / "metrics.jsonl")})
    assert steps == list(range(1, MAX_STEPS + 1))
    return ckpt, report


@pytest.mark.parametrize("hit", [2, 3])
@pytest.mark.parametrize("phase", SAVE_PHASES)
def test_kill_between_save_phases_resumes_from_a_complete_checkpoint(tmp_path, cache_dir, rollout_server, phase, hit):
    # hit 1 is the step-0 save; hits 2 and 3 are the saves of steps 2 and 4
    ckpt, _ = run_trial(tmp_path, cache_dir, rollout_server, {"RLRUN_CRASH_AT": phase, "RLRUN_CRASH_AT_HIT": str(hit)})
    saved_step = 2 * (hit - 1)
    # killed before the rename: the save of that step never happened; after it: it did
    expected = saved_step if phase in ("after_rename", "after_dir_fsync") else saved_step - 2
    assert ckpt is not None and ckpt.step >= expected


@pytest.mark.parametrize("seed", range(10))
def test_kill_at_a_random_instant_resumes_and_loses_nothing_finished_before_the_snapshot(
    tmp_path, cache_dir, rollout_server, seed
):
    kill_after = random.Random(seed).uniform(4.0, 9.0)
    run_trial(tmp_path, cache_dir, rollout_server, kill_after_s=kill_after)


def test_kill_before_any_complete_checkpoint_starts_over_and_loses_nothing(tmp_path, cache_dir, rollout_server):
    """A trainer too slow to publish anything (here: none at all) when the orchestrator dies after shipping a
    batch: ``--resume`` finds no complete checkpoint and starts over, discarding the dead attempt's batch."""
    ckpt, report = run_trial(tmp_path, cache_dir, rollout_server, kill_at_step=1, first_trainer=False)
    assert ckpt is None and report.rolled_back > 0
    assert "starting over from step 0; removed batches [1" in (tmp_path / "run" / "orchestrator-2.log").read_text()


def test_sigterm_pauses_writes_the_snapshot_and_exits_0_and_nothing_is_rolled_back(tmp_path, cache_dir, rollout_server):
    _, report = run_trial(tmp_path, cache_dir, rollout_server, sigterm_at_step=3)
    assert report.rolled_back == 0
