"""What tests read from a run directory, and the command lines they start: ``rlrun local``'s here, a role's from
:mod:`rlrun.roles` (as both launchers build them) with :data:`RLRUN` as its program."""

from __future__ import annotations

import sys
from pathlib import Path

from rlrun.rundir import read_metrics

#: ``rlrun`` as this interpreter runs it: the ``program`` of a role's command (:mod:`rlrun.roles`) in tests
RLRUN = (sys.executable, "-m", "rlrun")


def metrics(path: Path) -> list[dict]:
    """The complete lines of a JSONL metrics file (``metrics.jsonl``, ``trainer_metrics.jsonl``); none when missing."""
    return read_metrics(path)[0]


def local_argv(manifest: Path, run_dir: Path, cache_dir: Path, *extra: str) -> list[str]:
    """argv of ``rlrun local`` on ``manifest`` with its own run directory and model cache."""
    return [
        *RLRUN,
        "local",
        str(manifest),
        "--run-dir",
        str(run_dir),
        "--cache-dir",
        str(cache_dir),
        *extra,
    ]
