"""Exit reports: `rlrun orchestrator` and `rlrun trainer` leave an ExitReport in $RLRUN_TERMINATION_LOG on every
exit (complete, paused, interrupted, error), and a permanent error exits 78 (the real CLI, in-process, with
instant fake rollout endpoints and the fake trainer)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import threading
import time

import pytest
from rlrun import cli, role_exit
from rlrun.api.control import EXIT_PERMANENT, TERMINATION_LOG_ENV, ExitReport, write_exit_report
from rlrun.checkpoint import save_orchestrator_progress
from rlrun.identity import run_identity
from rlrun.manifest import load_manifest
from rlrun.orchestrator.loop import Orchestrator
from rlrun.rollout.fake import fake_client_factory
from rlrun.rundir import RunDir, publish_dir, run_dir_attempt
from rlrun.training.fake import start_fake_trainer
from typer.testing import CliRunner

from tests.support import manifests


def write_manifest(path, **spec):
    """A short run of 2 steps of 8 samples, a checkpoint every step."""
    settings = {"batch_size": 8, "max_steps": 2, "checkpoint": {"interval": 1, "keep_last": 2}}
    return manifests.write_manifest(path, base=manifests.SHORT_RUN, **(settings | spec))


@pytest.fixture
def term_log(tmp_path, monkeypatch):
    path = tmp_path / "termination-log"
    monkeypatch.setenv(TERMINATION_LOG_ENV, str(path))
    monkeypatch.setattr(cli, "_setup_logging", lambda role: None)  # keep pytest's log capture
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield path
    for s, h in handlers.items():  # the trainer command installs its own
        signal.signal(s, h)


@pytest.fixture
def fake_rollouts(monkeypatch):
    """`rlrun orchestrator` with instant fake rollout endpoints; the instances it made."""
    made: list[Orchestrator] = []

    class WithFakeRollouts(Orchestrator):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs, client_factory=fake_client_factory(error_rate=0.3), poll_s=0.01)
            made.append(self)

    monkeypatch.setattr("rlrun.orchestrator.loop.Orchestrator", WithFakeRollouts)
    return made


def run_cli(*args: str):
    return CliRunner().invoke(cli.app, [str(a) for a in args], catch_exceptions=False)


def read_report(path) -> ExitReport:
    return ExitReport.model_validate_json(path.read_text())


def test_write_exit_report_is_a_no_op_without_the_variable_and_never_raises(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv(TERMINATION_LOG_ENV, raising=False)
    report = ExitReport(role="trainer", outcome="error", reason="Error", message="x" * 10_000)
    assert write_exit_report(report) is False
    with caplog.at_level(logging.WARNING):
        assert write_exit_report(report, tmp_path / "missing-dir" / "log") is False
    assert "could not write the exit report" in caplog.text
    assert write_exit_report(report, tmp_path / "log") is True
    written = read_report(tmp_path / "log")
    assert len(written.message) <= 3000 and len((tmp_path / "log").read_bytes()) < 4096
    assert written.message.startswith("xxx") and written.message.endswith("xxx")


def test_orchestrator_that_ships_every_step_reports_complete(tmp_path, tiny_model, cache_dir, term_log, fake_rollouts):
    manifest = write_manifest(tmp_path / "m.yaml")
    run_dir = RunDir(tmp_path / "run")
    attempt = run_dir_attempt(run_dir, "uid-a", 0)  # the trainer of the attempt looks it up too
    stop = start_fake_trainer(run_dir, tiny_model, 2, 1, attempt=attempt)
    try:
        result = run_cli(
            "orchestrator",
            manifest,
            "--run-dir",
            run_dir.root,
            "--cache-dir",
            cache_dir,
            "--rollout-url",
            "http://fake-rollout:1",
            "--attempt",
            "0",
            "--run-uid",
            "uid-a",
        )
    finally:
        stop.set()
    assert result.exit_code == 0, result.output
    assert read_report(term_log) == ExitReport(
        role="orchestrator", outcome="complete", step=2, max_steps=2, message="shipped and checkpointed steps up to 2"
    )
    # reported: it only exits now, and a stop signal arriving meanwhile must not turn exit 0 into "killed"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN


def test_orchestrator_paused_by_sigterm_reports_paused(tmp_path, tiny_model, cache_dir, term_log, fake_rollouts):
    manifest = write_manifest(tmp_path / "m.yaml", max_steps=6)
    run_dir = RunDir(tmp_path / "run")
    stop = start_fake_trainer(run_dir, tiny_model, 1, 1, attempt=1)  # trains step 1 only: the run cannot end

    def preempt() -> None:  # SIGTERM once the orchestrator runs and has completed checkpoint 1
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            running = fake_rollouts and fake_rollouts[0].phase == "running"
            if running and (run_dir.orchestrator_checkpoint(1) / "progress.pt").is_file():
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(0.01)

    threading.Thread(target=preempt, daemon=True).start()
    try:
        result = run_cli(
            "orchestrator",
            manifest,
            "--run-dir",
            run_dir.root,
            "--cache-dir",
            cache_dir,
            "--rollout-url",
            "http://fake-rollout:1",
            "--attempt",
            "1",
        )
    finally:
        stop.set()
    assert result.exit_code == 0, result.output
    report = read_report(term_log)
    assert (report.role, report.outcome, report.max_steps, report.permanent) == ("orchestrator", "paused", 6, False)
    assert report.step == fake_rollouts[0].shipped >= 1 and "snapshot of step 1 written" in report.message


def test_an_orchestrator_whose_rollout_server_serves_another_vllm_exits_78_in_one_line_before_it_begins(
    tmp_path, tiny_model, cache_dir, term_log, monkeypatch, caplog
):
    class WithAnOldVllm(Orchestrator):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs, client_factory=fake_client_factory(vllm_version="0.11.0"), poll_s=0.01)

    monkeypatch.setattr("rlrun.orchestrator.loop.Orchestrator", WithAnOldVllm)
    run_dir = RunDir(tmp_path / "run")
    manifest = write_manifest(tmp_path / "m.yaml")
    argv = ["--run-dir", run_dir.root, "--cache-dir", cache_dir, "--rollout-url", "http://fake-rollout:1"]
    result = run_cli("orchestrator", manifest, *argv)
    assert result.exit_code == 78
    report = read_report(term_log)
    outcome = (report.role, report.outcome, report.permanent, report.reason, report.step)
    assert outcome == ("orchestrator", "error", True, "UnsupportedVersion", 0)
    line = "UnsupportedVersion: rollout server http://fake-rollout:1 serves vLLM 0.11.0; rlrun "
    assert report.message.startswith(line) and "\n" not in report.message
    [error] = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert error.exc_info is None and error.getMessage().endswith(report.message)
    assert not run_dir.rollout_batch(1).exists()


def test_trainer_resuming_a_checkpoint_of_other_settings_reports_a_permanent_error_and_exits_78(
    tmp_path, tiny_model, cache_dir, term_log
):
    manifest = write_manifest(tmp_path / "m.yaml")
    run_dir = RunDir(tmp_path / "run")
    other = run_identity(load_manifest(manifest).spec) | {"group_size": 8}

    def trainer_part(tmp):
        shutil.copy(tiny_model / "model.safetensors", tmp / "model.safetensors")
        (tmp / "progress.json").write_text(json.dumps({"step": 1, "identity": other}))

    run_dir.checkpoint(1).mkdir(parents=True)
    publish_dir(run_dir.trainer_checkpoint(1), trainer_part)
    save_orchestrator_progress(run_dir, 1, {"step": 1, "shipped": 1, "identity": other})
    result = run_cli("trainer", manifest, "--run-dir", run_dir.root, "--cache-dir", cache_dir, "--resume")
    assert result.exit_code == EXIT_PERMANENT == 78
    report = read_report(term_log)
    assert (report.role, report.outcome, report.permanent, report.reason) == (
        "trainer",
        "error",
        True,
        "CheckpointMismatch",
    )
    assert report.max_steps == 2 and "spec.group_size: checkpoint has 8, manifest has 4" in report.message


def test_an_invalid_manifest_is_permanent(tmp_path, term_log):
    manifest = write_manifest(tmp_path / "m.yaml", group_size=0)
    result = run_cli("orchestrator", manifest, "--run-dir", tmp_path / "run", "--rollout-url", "http://x:1")
    assert result.exit_code == 78
    report = read_report(term_log)
    assert (report.outcome, report.permanent, report.reason, report.max_steps) == (
        "error",
        True,
        "InvalidManifest",
        None,
    )


def test_a_trainer_stopped_by_sigterm_reports_interrupted_at_its_step(term_log):
    with role_exit.reporting("trainer") as exit_:
        exit_.step, exit_.max_steps = 3, 10
        raise role_exit.Terminated(signal.SIGTERM)
    assert exit_.code == 143
    report = read_report(term_log)
    assert (report.outcome, report.step, report.max_steps, report.permanent) == ("interrupted", 3, 10, False)


def test_a_transient_error_is_not_permanent_and_exits_1(term_log):
    with role_exit.reporting("orchestrator") as exit_:
        raise OSError("No space left on device")
    assert exit_.code == 1
    report = read_report(term_log)
    assert (report.outcome, report.permanent, report.reason) == ("error", False, "Error")
    assert report.message == "OSError: No space left on device"
