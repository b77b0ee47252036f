"""``rlrun local`` with ``trainer.processes_per_node`` P > 1 starts the trainer under ``torchrun`` (P ranks on
this machine), shares the trainer's threads among the ranks, gives torchrun the trainer's grace period as its
shutdown timeout, restarts a lost trainer under torchrun again, and refuses ``trainer.nodes`` > 1 with a clear
error. (How it reads a notice's outcome from rank 0's exit report, torchrun itself exiting 1 on SIGTERM:
``tests/processes/test_launcher.py``.)"""

from __future__ import annotations

import sys

from tests.support.launcher import make_launcher


def test_one_process_per_node_starts_the_trainer_as_today(tmp_path):
    launcher, _ = make_launcher(tmp_path)
    argv = launcher._trainer_command(resume=False)
    assert argv[:4] == [sys.executable, "-m", "rlrun", "trainer"] and "--resume" not in argv


def test_processes_per_node_start_the_trainer_under_torchrun(tmp_path, monkeypatch):
    monkeypatch.setenv("RLRUN_TRAINER_THREADS", "4")
    launcher, _ = make_launcher(tmp_path, trainer={"processes_per_node": 2})
    argv = launcher._trainer_command(resume=True)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1"]
    assert argv[:6] == torchrun
    assert argv[6:11] == ["--nproc-per-node", "2", "--max-restarts", "0", "--no-python"]
    command = argv[11:]
    trainer = command[command.index("trainer") :]
    assert trainer[:4] == ["trainer", str(launcher.manifest_path), "--run-dir", str(launcher.run_dir.root)]
    assert trainer[-1] == "--resume"
    assert launcher._trainer_env()["OMP_NUM_THREADS"] == "2"  # 4 trainer threads shared by 2 ranks


def test_torchrun_waits_the_trainers_grace_period_before_killing_its_ranks(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    launcher, _ = make_launcher(tmp_path, trainer={"processes_per_node": 2})
    launcher.trainer_grace_s = 45.5
    # torchrun's own default (30 s) would SIGKILL the ranks mid-save before the launcher's grace is up
    assert launcher._trainer_env()["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "46"
    one, _ = make_launcher(tmp_path / "one")
    assert "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" not in one._trainer_env()  # no torchrun: nothing to tell


def test_a_trainer_only_restart_runs_the_same_ranks_under_torchrun(tmp_path):
    launcher, _ = make_launcher(tmp_path, trainer={"processes_per_node": 2})
    argv = launcher._trainer_command(resume=True)
    assert argv[:6] == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1"]
    assert argv[6:8] == ["--nproc-per-node", "2"]
    assert "--resume" in argv[argv.index("trainer") :]


def test_more_than_one_trainer_node_is_refused_locally(tmp_path):
    launcher, out = make_launcher(tmp_path, trainer={"nodes": 2})
    assert launcher.run() == 2
    assert "trainer.nodes is 2" in out.getvalue()
    assert not launcher.children  # nothing was started
