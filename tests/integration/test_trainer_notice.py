"""The trainer saves on notice: told to stop (SIGTERM), it checkpoints the step it has and the orchestrator
pairs it, so the next start recomputes no trainer step — whether only the trainer restarts (same attempt, the
orchestrator kept running) or everything does after a pause (the paused orchestrator pairs its pause snapshot
with the trainer's newer part). A trainer killed during that save falls back to retraining from the kept batch
files. Real trainer (tiny model) and real orchestrator, with instant fake rollout endpoints."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import psutil
from rlrun.checkpoint import latest_complete_checkpoint, load_orchestrator_progress
from rlrun.launcher.preemption import steps_recomputed
from rlrun.ledger import check_ledger, read_ledger
from rlrun.manifest import load_manifest
from rlrun.roles import trainer_command
from rlrun.rundir import RunDir, step_dirs
from rlrun.training.trainer import Trainer

from tests.support.manifests import SHORT_RUN, write_manifest
from tests.support.orchestrators import make_orchestrator
from tests.support.polling import wait_for_async
from tests.support.runs import RLRUN, metrics

MAX_STEPS = 6


def run_spec(tmp_path):
    """6 steps of 8 samples; periodic trainer parts only at steps 0 and 6, so a notice's part is its own."""
    path = write_manifest(
        tmp_path / "m.yaml",
        base=SHORT_RUN,
        batch_size=8,
        max_steps=MAX_STEPS,
        checkpoint={"interval": 10, "keep_last": 2},
    )
    return path, load_manifest(path).spec


async def train_until_notice(trainer: Trainer, at_step: int) -> int:
    """Run ``trainer`` in a thread, give it the notice once it has trained ``at_step``; the step it stopped at."""
    task = asyncio.create_task(asyncio.to_thread(trainer.run))
    await wait_for_async(lambda: trainer.step >= at_step or task.done(), 60, what=f"trainer step {at_step}")
    trainer.notice()
    return await asyncio.wait_for(task, 60)


def load_trainer_part(run_dir: RunDir, step: int) -> dict:
    return json.loads((run_dir.trainer_checkpoint(step) / "progress.json").read_text())


def trained_steps(run_dir: RunDir) -> list[int]:
    ledger = read_ledger(run_dir.root / "ledger")
    return sorted(
        e["step"] for (_, role), evs in ledger.items() if role == "trainer" for e in evs if e["e"] == "trained"
    )


async def test_trainer_only_restart_resumes_from_the_step_saved_on_notice_and_recomputes_no_step(tmp_path, tiny_model):
    _, spec = run_spec(tmp_path)
    run_dir = RunDir(tmp_path / "run")
    first = Trainer(spec, run_dir, str(tiny_model), attempt=1)
    orch = make_orchestrator(spec, run_dir, tiny_model)
    orch_task = asyncio.create_task(orch.run())
    saved = await train_until_notice(first, at_step=2)
    assert 2 <= saved < MAX_STEPS
    part = load_trainer_part(run_dir, saved)
    assert part["reason"] == "notice" and first.saved_on_notice == first.checkpointed_step == saved
    # The orchestrator keeps running; a trainer of the same attempt replaces the first. It waits until the
    # orchestrator has completed the part saved on notice, so it resumes exactly there.
    second = await asyncio.to_thread(Trainer, spec, run_dir, str(tiny_model), resume=True, attempt=1)
    assert second.step == saved and second.shipped_at_restore >= saved
    assert await asyncio.wait_for(asyncio.to_thread(second.run), 60) == MAX_STEPS
    assert await asyncio.wait_for(orch_task, 60) == MAX_STEPS
    assert steps_recomputed(run_dir.root / "ledger") == 0
    assert trained_steps(run_dir) == list(range(1, MAX_STEPS + 1))
    versions = [r["policy_version"] for r in metrics(run_dir.metrics)]
    assert versions == sorted(versions)  # the weight follower never went back to older weights
    report = check_ledger(run_dir.root / "ledger")
    assert report.ok and report.steps == MAX_STEPS and report.rolled_back == 0, report.problems


async def test_paused_orchestrator_pairs_its_pause_snapshot_with_the_part_the_trainer_saves_on_notice(
    tmp_path, tiny_model
):
    _, spec = run_spec(tmp_path)
    run_dir = RunDir(tmp_path / "run")
    trainer = Trainer(spec, run_dir, str(tiny_model), attempt=1)
    orch = make_orchestrator(spec, run_dir, tiny_model)
    orch_task = asyncio.create_task(orch.run())
    train = asyncio.create_task(asyncio.to_thread(trainer.run))
    await wait_for_async(lambda: trainer.step >= 2 or train.done(), 60, what="trainer step 2")
    pause = await orch.pause()
    trainer.notice()
    saved = await asyncio.wait_for(train, 60)
    assert pause.step is not None and pause.step <= saved <= orch.shipped
    done = run_dir.orchestrator_checkpoint(saved) / "progress.pt"
    await wait_for_async(done.is_file, 10, what=f"the paused orchestrator to pair step {saved}")
    paired = load_orchestrator_progress(run_dir, saved)
    at_pause = load_orchestrator_progress(run_dir, pause.step)
    # the same cut: the pause snapshot, only the step differs
    assert paired["step"] == saved and paired["shipped"] == at_pause["shipped"] == orch.shipped
    assert paired["ledger_line"] == at_pause["ledger_line"] and paired["source"] == at_pause["source"]
    orch.request_stop()
    assert await asyncio.wait_for(orch_task, 30) == paired["shipped"]
    # the next attempt (everything restarted) resumes from the step saved on notice
    assert latest_complete_checkpoint(run_dir).step == saved
    trainer2 = await asyncio.to_thread(Trainer, spec, run_dir, str(tiny_model), resume=True, attempt=2)
    assert trainer2.step == saved
    orch2 = make_orchestrator(spec, run_dir, tiny_model, attempt=2, resume=True)
    orch2_task = asyncio.create_task(orch2.run())
    assert await asyncio.wait_for(asyncio.to_thread(trainer2.run), 60) == MAX_STEPS
    assert await asyncio.wait_for(orch2_task, 60) == MAX_STEPS
    assert orch2.resume_report.from_step == saved
    assert steps_recomputed(run_dir.root / "ledger") == 0
    report = check_ledger(run_dir.root / "ledger")
    assert report.ok and report.steps == MAX_STEPS and report.rolled_back == 0, report.problems


async def start_real_trainer(manifest, run_dir: RunDir, cache_dir, **env: str) -> asyncio.subprocess.Process:
    """``rlrun trainer`` (attempt 1) as a process of its own, started once its step-0 part is written."""
    argv = trainer_command(str(manifest), str(run_dir.root), str(cache_dir), 1, resume=False, program=RLRUN)
    proc = await asyncio.create_subprocess_exec(
        *argv,
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    await wait_for_async(lambda: (run_dir.trainer_checkpoint(0) / "progress.json").is_file(), 60, what="trainer start")
    return proc


async def test_a_repeated_sigterm_does_not_skip_the_save_on_notice(tmp_path, tiny_model, cache_dir):
    # A runtime (or torchrun) sending the stop signal again: the trainer still finishes its step and saves it.
    # The second SIGTERM must land while the trainer saves, not after (then it only meets an exiting process):
    # the trainer stops itself inside the fill of its notice part (SIGSTOP at the crash-injection point), the
    # signal is sent then, and delivered there once it goes on (SIGCONT).
    manifest, spec = run_spec(tmp_path)
    run_dir = RunDir(tmp_path / "run")
    orch = make_orchestrator(spec, run_dir, tiny_model)
    stall = {"RLRUN_CRASH_AT": "trainer_notice_save", "RLRUN_CRASH_SIGNAL": "STOP"}
    proc = await start_real_trainer(manifest, run_dir, cache_dir, **stall)
    orch_task = asyncio.create_task(orch.run())
    await wait_for_async(lambda: len(metrics(run_dir.trainer_metrics)) >= 2, 60, what="trainer step 2")
    proc.send_signal(signal.SIGTERM)
    stopped = lambda: psutil.Process(proc.pid).status() == psutil.STATUS_STOPPED  # noqa: E731
    await wait_for_async(stopped, 60, what="the trainer inside its save on notice")
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGCONT)
    out = (await asyncio.wait_for(proc.communicate(), 60))[0].decode()
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert "SIGTERM again: still finishing the current step and saving" in out
    reached = metrics(run_dir.trainer_metrics)[-1]["step"]
    assert f"notice: saved trainer checkpoint step {reached}" in out and reached < MAX_STEPS
    # the running orchestrator pairs that part: a trainer of the same attempt resumes at it, nothing retrained
    await wait_for_async(
        lambda: latest_complete_checkpoint(run_dir).step == reached, 60, what=f"checkpoint step {reached}"
    )
    second = await asyncio.to_thread(Trainer, spec, run_dir, str(tiny_model), resume=True, attempt=1)
    assert second.step == reached
    assert await asyncio.wait_for(asyncio.to_thread(second.run), 60) == MAX_STEPS
    assert await asyncio.wait_for(orch_task, 60) == MAX_STEPS
    assert steps_recomputed(run_dir.root / "ledger") == 0


async def test_trainer_killed_while_saving_on_notice_leaves_the_previous_checkpoint_and_the_steps_are_retrained(
    tmp_path, tiny_model, cache_dir
):
    # A grace period too short for the save: the real `rlrun trainer` gets SIGTERM and is SIGKILLed inside
    # the fill of its notice part (before the rename that would publish it).
    manifest, spec = run_spec(tmp_path)
    run_dir = RunDir(tmp_path / "run")
    orch = make_orchestrator(spec, run_dir, tiny_model)
    proc = await start_real_trainer(manifest, run_dir, cache_dir, RLRUN_CRASH_AT="trainer_notice_save")
    orch_task = asyncio.create_task(orch.run())
    await wait_for_async(lambda: len(metrics(run_dir.trainer_metrics)) >= 2, 60, what="trainer step 2")
    proc.send_signal(signal.SIGTERM)
    out = (await asyncio.wait_for(proc.communicate(), 60))[0].decode()
    assert proc.returncode == -signal.SIGKILL, out[-3000:]
    reached = metrics(run_dir.trainer_metrics)[-1]["step"]
    assert "finishing the current step, then saving a checkpoint" in out
    assert 2 <= reached < MAX_STEPS and not run_dir.trainer_checkpoint(reached).exists()
    # The orchestrator, still running, has the previous complete checkpoint (step 0); a trainer of the same
    # attempt resumes from it and retrains the steps since from the kept batch files.
    before = latest_complete_checkpoint(run_dir).step
    assert before == 0
    served = max(step_dirs(run_dir.broadcasts))  # what the live orchestrator may have loaded into vLLM
    second = await asyncio.to_thread(Trainer, spec, run_dir, str(tiny_model), resume=True, attempt=1)
    assert second.step == before
    assert run_dir.broadcast(served).is_dir()  # kept for the orchestrator: same attempt, not a dead one's
    assert await asyncio.wait_for(asyncio.to_thread(second.run), 60) == MAX_STEPS
    assert await asyncio.wait_for(orch_task, 60) == MAX_STEPS
    assert steps_recomputed(run_dir.root / "ledger") == reached - before > 0
    report = check_ledger(run_dir.root / "ledger")
    assert report.ok and report.steps == MAX_STEPS, report.problems
