"""Attempts numbered per run directory, across processes: the processes of one attempt (trainer,
orchestrator, ranks), starting at once, agree on its number (the file lock of ``run_dir_attempt``)."""

from __future__ import annotations

import subprocess
import sys

from rlrun.rundir import RunDir, run_dir_attempt


def test_an_attempts_processes_starting_at_once_agree_on_its_number(tmp_path):
    run_dir = RunDir(tmp_path)
    run_dir_attempt(run_dir, "uid-a", 2)
    code = (
        "from rlrun.rundir import RunDir, run_dir_attempt; "
        f"print(run_dir_attempt(RunDir({str(tmp_path)!r}), 'uid-b', 0))"
    )
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for _ in range(4)]
    assert [p.communicate(timeout=30)[0].strip() for p in procs] == ["3"] * 4
