"""W&B, for real in offline mode (its ``wandb-core`` service is a child process): two attempts make one W&B run
whose steps only grow, each step once with its final values (rlrun.tracking)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from rlrun.rundir import RunDir
from rlrun.tracking.publisher import read_state

from tests.support.fake_orchestrator import resume_report
from tests.support.polling import wait_for
from tests.support.trackers import (
    LOGGING,
    PUT_BACK,
    attempt_lines,
    publisher,
    tensorboard_scalars,
    two_attempts,
    wandb_offline_runs,
)

# An attempt as the orchestrator runs it: one step logged to W&B run "run-1", then killed or closed.
ATTEMPT = """
import os, sys
from rlrun.api.tracking import WandbSpec
from rlrun.rundir import RunDir
from rlrun.tracking.backends import Cursor, WandbTracker
step, end = int(sys.argv[2]), sys.argv[3]
tracker = WandbTracker(WandbSpec(project="p", mode="offline"), RunDir(sys.argv[1]), "run-1", "n", {}, Cursor())
tracker.log(step, {"x": float(step)})
if end == "killed":
    os._exit(9)
tracker.close(finished=True)
"""


@pytest.fixture
def detached_wandb_service():
    """A detached ``wandb-core`` (``wandb beta core start``): a service that outlives the processes using it."""
    wandb = [sys.executable, "-m", "wandb", "beta", "core"]
    token = subprocess.run([*wandb, "start", "--idle-timeout", "60s"], capture_output=True, text=True, check=True)
    env = os.environ | {"WANDB_SERVICE": token.stdout.strip()}
    yield env
    subprocess.run([*wandb, "stop"], env=env, capture_output=True, check=True)


def test_an_attempt_resumes_the_wandb_run_that_an_inherited_service_still_holds(tmp_path, detached_wandb_service):
    # The killed attempt's stream stays open in the shared service, which refuses the run's id to anyone else
    # ("run ID ... is in use"): each attempt starts a wandb-core of its own, so the next one resumes the run.
    run_dir = RunDir(tmp_path).ensure()
    for step, end in [(1, "killed"), (2, "closed")]:
        attempt = [sys.executable, "-c", ATTEMPT, str(run_dir.root), str(step), end]
        proc = subprocess.run(attempt, env=detached_wandb_service, capture_output=True, text=True, timeout=120)
        assert proc.returncode == (9 if end == "killed" else 0), proc.stderr[-3000:]
    run_id, rows = wandb_offline_runs(run_dir)[-1]
    assert run_id == "run-1" and [step for step, _ in rows] == [2]


def test_two_attempts_make_one_wandb_run_whose_steps_only_grow(tmp_path):
    run_dir = RunDir(tmp_path).ensure()
    two_attempts(run_dir, LOGGING)
    [(id1, rows1), (id2, rows2)] = wandb_offline_runs(run_dir)  # one offline run file per attempt…
    assert id1 == id2 == read_state(run_dir)["run_id"]  # …of one W&B run, resumed (`wandb sync` joins them)
    rows = rows1 + rows2
    assert [s for s, _ in rows] == list(range(1, 11))  # strictly increasing, every step once
    by_step = dict(rows)
    assert by_step[5]["rollout/reward_mean"] == 2.05 and by_step[7]["train/loss"] == -2.07  # the final values
    assert [by_step[s]["run/attempt"] for s in (4, 5)] == [1, 2] and by_step[5]["run/resumes"] == 1
    assert by_step[5]["run/resumed_groups"] == 3 and by_step[5]["run/resumed_samples"] == 7
    assert "run/resumed_groups" not in by_step[6]
    evals = [(r["eval/policy_version"], r["eval/greedy_solved"]) for _, r in rows if "eval/greedy_solved" in r]
    # each with a later row, one per row; W&B plots them against eval/policy_version. 6: the weights the run kept
    assert evals == [(0, 1.0), (2, 1.02), (6, 2.06), (10, 2.1)]
    assert [s for s, _ in tensorboard_scalars(run_dir)["rollout/reward_mean"]] == list(range(1, 11))
    state = read_state(run_dir)
    assert any("wandb sync" in where for where in state["locations"])


def test_the_last_evaluations_of_a_finished_run_get_rows_after_its_last_step(tmp_path):
    run_dir = RunDir(tmp_path).ensure()
    p = publisher(run_dir, [4], 1, logging={"wandb": LOGGING["wandb"]}, max_steps=4)
    p.start(None)
    attempt_lines(run_dir, 1, range(1, 5))
    wait_for(lambda: read_state(run_dir)["logged"]["wandb"].get("given") == 4, timeout=30)
    attempt_lines(run_dir, 1, range(0), evaluations=[2, 4])  # after the last checkpoint, as the final evaluation
    p.close()
    [(_, rows)] = wandb_offline_runs(run_dir)
    assert [s for s, _ in rows] == [1, 2, 3, 4, 5, 6]
    assert [(s, r["eval/policy_version"]) for s, r in rows if "eval/policy_version" in r] == [(5, 2), (6, 4)]
    assert read_state(run_dir)["logged"]["wandb"] == {"step": 4, "versions": [2, 4], "given": 6}


# An orchestrator attempt (fake rollouts, the fake trainer) logging to W&B offline that pauses once W&B was given 2
# steps, then is SIGKILLed with its wandb-core, as `rlrun local --preempt-at-step` kills a paused attempt's processes.
PAUSED_THEN_KILLED = """
import asyncio, json, os, signal, sys
from pathlib import Path
import psutil
from rlrun.rollout.fake import fake_vllm_transport
from rlrun.rundir import RunDir
from rlrun.training.fake import start_fake_trainer
from rlrun.tracking.publisher import read_state
from tests.support.manifests import parse
from tests.support.orchestrators import make_orchestrator
from tests.support.trackers import LOGGING
run_dir, model = RunDir(sys.argv[1]), Path(sys.argv[2])
spec = parse("paused", group_size=4, batch_size=8, max_steps=8, logging={"wandb": LOGGING["wandb"]},
             checkpoint={"interval": 1, "keep_last": 2}).spec
orch = make_orchestrator(spec, run_dir, model, fake_vllm_transport(samples_per_s=8))
stop = start_fake_trainer(run_dir, model, 8, 1, attempt=1)

async def main():
    run = asyncio.create_task(orch.run())
    while read_state(run_dir).get("logged", {}).get("wandb", {}).get("given", 0) < 2:
        assert not run.done(), run.exception() if run.done() else None
        await asyncio.sleep(0.05)
    paused = await orch.pause()
    print(json.dumps({"pause_step": paused.step}), flush=True)
    for p in psutil.Process().children(recursive=True):
        p.kill()
    os.kill(os.getpid(), signal.SIGKILL)

asyncio.run(main())
"""


def test_an_attempt_killed_after_its_pause_leaves_each_step_once_in_the_wandb_files(tmp_path, tiny_model):
    # issue 36.5: the pause did not record what W&B held, so the next attempt gave it steps 1–7 again
    run_dir = RunDir(tmp_path).ensure()
    attempt = [sys.executable, "-c", PAUSED_THEN_KILLED, str(run_dir.root), str(tiny_model)]
    proc = subprocess.run(attempt, capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[2])
    assert proc.returncode == -9, proc.stderr[-3000:]
    pause_step = json.loads(proc.stdout.strip().splitlines()[-1])["pause_step"]
    assert read_state(run_dir)["logged"]["wandb"]["step"] == pause_step >= 2  # the pause recorded what W&B holds
    committed = [pause_step]
    second = publisher(run_dir, committed, attempt=2, logging={"wandb": LOGGING["wandb"]}, max_steps=8)
    second.start(resume_report(pause_step, **PUT_BACK))
    attempt_lines(run_dir, 2, range(pause_step + 1, 9))
    committed[0] = 8
    second.close()
    rows = [step for _, history in wandb_offline_runs(run_dir) for step, _ in history]
    assert rows == list(range(1, 9))  # in the files, across both attempts: each step once
