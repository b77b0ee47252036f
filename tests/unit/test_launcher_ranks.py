"""``rlrun local`` with ``trainer.processes_per_node`` P > 1 starts the trainer under ``torchrun`` (P ranks on
this machine), shares the trainer's threads among the ranks, gives torchrun the trainer's grace period as its
shutdown timeout, restarts a lost trainer under torchrun again, reads a notice's outcome from rank 0's exit
report (torchrun itself exits 1 on SIGTERM), and refuses ``trainer.nodes`` > 1 with a clear error."""

from __future__ import annotations

import io
import sys
import time

from rich.console import Console
from rlrun.launcher.local import LocalLauncher
from rlrun.launcher.processes import Child
from rlrun.manifest import parse_manifest


def make_launcher(tmp_path, **trainer) -> tuple[LocalLauncher, io.StringIO]:
    spec = {"model": {"builtin": "tiny-reverse"}, "envs": [{"name": "reverse-text"}], "max_steps": 6}
    if trainer:
        spec["trainer"] = trainer
    doc = {"apiVersion": "rlrun.dev/v1alpha1", "kind": "RLRun", "metadata": {"name": "t"}, "spec": spec}
    out = io.StringIO()
    launcher = LocalLauncher(tmp_path / "m.yaml", parse_manifest(doc), tmp_path / "run", console=Console(file=out))
    return launcher, out


def test_one_process_per_node_starts_the_trainer_as_today(tmp_path):
    launcher, _ = make_launcher(tmp_path)
    assert launcher._trainer_argv("--run-dir", "r") == launcher._rlrun("trainer", "--run-dir", "r")


def test_processes_per_node_start_the_trainer_under_torchrun(tmp_path, monkeypatch):
    monkeypatch.setenv("RLRUN_TRAINER_THREADS", "4")
    launcher, _ = make_launcher(tmp_path, processes_per_node=2)
    argv = launcher._trainer_argv("--run-dir", "r", "--resume")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1"]
    assert argv[:6] == torchrun
    assert argv[6:11] == ["--nproc-per-node", "2", "--max-restarts", "0", "--no-python"]
    command = argv[11:]
    assert command[command.index("trainer") :][:4] == ["trainer", "--run-dir", "r", "--resume"]
    assert str(launcher.manifest_path) in command
    assert launcher._trainer_env()["OMP_NUM_THREADS"] == "2"  # 4 trainer threads shared by 2 ranks


def test_torchrun_waits_the_trainers_grace_period_before_killing_its_ranks(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    launcher, _ = make_launcher(tmp_path, processes_per_node=2)
    launcher.trainer_grace_s = 45.5
    # torchrun's own default (30 s) would SIGKILL the ranks mid-save before the launcher's grace is up
    assert launcher._trainer_env()["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "46"
    one, _ = make_launcher(tmp_path / "one")
    assert "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" not in one._trainer_env()  # no torchrun: nothing to tell


#: Stands in for torchrun after it forwarded SIGTERM to ranks that saved on notice: rank 0's exit report says
#: ``interrupted`` (what ``rlrun trainer`` writes before exiting 143), and torchrun itself exits 1 (its
#: ``SignalException``), as the real one does.
TORCHRUN_AFTER_A_NOTICE = """
import os, pathlib, signal, sys, time
from rlrun.api.control import ExitReport, write_exit_report

def notice(*_):
    if sys.argv[2] == "saved":
        write_exit_report(ExitReport(role="trainer", outcome="interrupted", step=3, max_steps=6, message="saved"))
    os._exit(1)

signal.signal(signal.SIGTERM, notice)
pathlib.Path(sys.argv[1]).touch()
time.sleep(60)
"""


def _torchrun_stand_in(launcher: LocalLauncher, tmp_path, ranks: str) -> Child:
    """``ranks``: ``saved`` (rank 0 wrote its exit report) or ``died`` (no report)."""
    ready = tmp_path / f"ready-{ranks}"
    script = tmp_path / "torchrun.py"
    script.write_text(TORCHRUN_AFTER_A_NOTICE)
    argv = [sys.executable, str(script), str(ready), ranks]
    child = Child("trainer", argv, launcher.run_dir.logs / "trainer.log", launcher._trainer_env())
    deadline = time.monotonic() + 30
    while not ready.exists():
        assert time.monotonic() < deadline and child.poll() is None, child.log_path.read_text()
        time.sleep(0.05)
    return child


def test_a_trainer_under_torchrun_that_saved_on_notice_counts_as_exit_143_not_torchruns_1(tmp_path):
    launcher, _ = make_launcher(tmp_path, processes_per_node=2)
    code, _ = launcher._notice_trainer(_torchrun_stand_in(launcher, tmp_path, "saved"))
    assert code == 143  # the trainer-only restart goes on instead of calling the trainer dead


def test_a_trainer_under_torchrun_without_this_exits_report_keeps_torchruns_status(tmp_path):
    launcher, _ = make_launcher(tmp_path, processes_per_node=2)
    stale = launcher._trainer_exit_report_path()
    stale.parent.mkdir(parents=True, exist_ok=True)
    stale.write_text('{"role": "trainer", "outcome": "interrupted", "step": 2, "max_steps": 6}')  # an earlier exit's
    code, _ = launcher._notice_trainer(_torchrun_stand_in(launcher, tmp_path, "died"))
    assert code == 1  # a failure stays a failure: the earlier exit's report is not read as this one's
    assert launcher._trainer_exit_code(None) is None  # killed
    one, _ = make_launcher(tmp_path / "one")
    assert one._trainer_exit_code(1) == 1  # one process: its own status is the trainer's


def test_a_trainer_only_restart_runs_the_same_ranks_under_torchrun(tmp_path):
    launcher, _ = make_launcher(tmp_path, processes_per_node=2)
    argv = launcher._trainer_command(resume=True)
    assert argv[:6] == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1"]
    assert argv[6:8] == ["--nproc-per-node", "2"]
    assert "--resume" in argv[argv.index("trainer") :]


def test_more_than_one_trainer_node_is_refused_locally(tmp_path):
    launcher, out = make_launcher(tmp_path, nodes=2)
    assert launcher.run() == 2
    assert "trainer.nodes is 2" in out.getvalue()
    assert not launcher.children  # nothing was started
