"""``rlrun local`` with ``trainer.processes_per_node`` P > 1 starts the trainer under ``torchrun`` (P ranks on
this machine), shares the trainer's threads among the ranks, and refuses ``trainer.nodes`` > 1 with a clear error."""

from __future__ import annotations

import io
import sys

from rich.console import Console
from rlrun.launcher.local import LocalLauncher
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


def test_more_than_one_trainer_node_is_refused_locally(tmp_path):
    launcher, out = make_launcher(tmp_path, nodes=2)
    assert launcher.run() == 2
    assert "trainer.nodes is 2" in out.getvalue()
    assert not launcher.children  # nothing was started
