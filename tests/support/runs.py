"""What tests read from a run directory, and the command line of ``rlrun local`` they start."""

from __future__ import annotations

import sys
from pathlib import Path

from rlrun.rundir import read_metrics


def metrics(path: Path) -> list[dict]:
    """The complete lines of a JSONL metrics file (``metrics.jsonl``, ``trainer_metrics.jsonl``); none when missing."""
    return read_metrics(path)[0]


def local_argv(manifest: Path, run_dir: Path, cache_dir: Path, *extra: str) -> list[str]:
    """argv of ``rlrun local`` on ``manifest`` with its own run directory and model cache."""
    return [
        sys.executable,
        "-m",
        "rlrun",
        "local",
        str(manifest),
        "--run-dir",
        str(run_dir),
        "--cache-dir",
        str(cache_dir),
        *extra,
    ]
