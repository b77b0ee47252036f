"""Helpers for tests that start real processes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import psutil
import yaml


def write_manifest(path: Path, **spec) -> Path:
    """A small reverse-text manifest (overrides in ``spec``) written to ``path``."""
    base = {
        "model": {"builtin": "tiny-reverse"},
        "envs": [{"name": "reverse-text"}],
        "group_size": 4,
        "batch_size": 16,
        "max_off_policy_steps": 1,
        "max_steps": 6,
        "seed": 3,
        "checkpoint": {"interval": 3, "keep_last": 1},
        "rollout": {"replicas": 1, "max_inflight": 64},
    }
    base.update(spec)
    doc = {"apiVersion": "rlrun.dev/v1alpha1", "kind": "RLRun", "metadata": {"name": "it"}, "spec": base}
    path.write_text(yaml.safe_dump(doc))
    return path


def write_preemption_manifest(path: Path, max_steps: int) -> Path:
    """The manifest of the preemption tests: batch 18 with groups of 4 leaves overflow in the queue, and
    2 members per request leaves half-finished groups, so a pause always has work to keep."""
    return write_manifest(
        path,
        group_size=4,
        batch_size=18,
        max_off_policy_steps=2,
        max_steps=max_steps,
        checkpoint={"interval": 4, "keep_last": 2},
        rollout={"max_inflight": 64, "members_per_request": 2},
    )


def descendants(pid: int) -> set[int]:
    """pids of every live descendant of ``pid``."""
    try:
        return {p.pid for p in psutil.Process(pid).children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()


def alive(pids: set[int]) -> list[str]:
    """``"pid cmdline"`` of each pid in ``pids`` that is still running (zombies count as gone)."""
    out = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{pid} {' '.join(p.cmdline())[:120]}")
        except psutil.Error:
            pass
    return out


def metrics(path: Path) -> list[dict]:
    """Lines of a metrics JSONL file (missing file: none)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def local_argv(manifest: Path, run_dir: Path, cache_dir: Path, *extra: str) -> list[str]:
    """argv of ``rlrun local`` on ``manifest`` with its own run dir and model cache."""
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
