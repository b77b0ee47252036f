"""The run directory shared by all processes of a run (a persistent volume on a cluster).

Layout (see ARCHITECTURE.md)::

    <run_dir>/
      checkpoints/step_N/trainer/                   weights, optimizer, trainer progress
      checkpoints/step_N/orchestrator/progress.pt   orchestrator progress
      rollouts/step_N/                              batch N, shipped to the trainer
      broadcasts/step_N/                            weights after step N, for rollout servers
      metrics.jsonl                                 one line per step (orchestrator)
      trainer_metrics.jsonl                         one line per step (trainer)
      logs/                                         one log per process (rlrun local)

Every directory above that another process reads is published by renaming a fully
written, fsynced temporary directory into place (:func:`publish_dir`), so a reader
sees either nothing or the whole thing. Each published step directory (a batch, a
broadcast, a trainer part) holds ``meta.json`` with at least its ``step`` and the
``attempt`` that wrote it (:func:`write_meta`, :func:`read_attempt`): a resumed attempt
uses only what it wrote itself or what it resumed from.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

#: The file of a published step directory that says which step and attempt wrote it.
META_FILE = "meta.json"

_STEP_RE = re.compile(r"^step_(\d+)$")


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory so that renames and creations inside it are durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


#: Save phases of :func:`write_file_atomic`, in order (crash-injection points for tests).
SAVE_PHASES = ("before_write", "after_temp_write", "after_fsync", "after_rename", "after_dir_fsync")
_phase_hits: dict[str, int] = {}


def _fault_point(phase: str) -> None:
    """Test-only crash injection: SIGKILL this process at ``phase`` when ``$RLRUN_CRASH_AT`` names it
    (on its ``$RLRUN_CRASH_AT_HIT``-th occurrence, default 1). Costs one dict lookup otherwise."""
    if os.environ.get("RLRUN_CRASH_AT") != phase:
        return
    _phase_hits[phase] = _phase_hits.get(phase, 0) + 1
    if _phase_hits[phase] >= int(os.environ.get("RLRUN_CRASH_AT_HIT", "1")):
        os.kill(os.getpid(), signal.SIGKILL)


def write_file_atomic(path: str | os.PathLike, data: bytes | Callable[[BinaryIO], None]) -> None:
    """Write ``data`` (bytes, or a function that writes to a binary file) to ``path`` via a fsynced
    temporary file and a rename; fsync the parent after.

    A kill at any instant leaves either the old file or the new one at ``path`` (and at worst
    a stray ``.<name>.tmp-*`` file, which readers ignore).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _fault_point("before_write")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            if callable(data):
                data(fh)
            else:
                fh.write(data)
            fh.flush()
            _fault_point("after_temp_write")
            os.fsync(fh.fileno())
        _fault_point("after_fsync")
        os.replace(tmp, path)
        _fault_point("after_rename")
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    _fault_point("after_dir_fsync")


def publish_dir(final: str | os.PathLike, fill: Callable[[Path], None]) -> Path:
    """Create directory ``final`` atomically: ``fill(tmp)`` writes into a temporary sibling,
    every file is fsynced, then the directory is renamed into place.

    An existing ``final`` (left by an earlier attempt) is replaced: it is first moved
    aside, so ``final`` is never observed half-written.

    Raises:
        Whatever ``fill`` raises; the temporary directory is removed.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        fill(tmp)
        for f in tmp.rglob("*"):
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
        fsync_dir(tmp)
        if final.exists():
            trash = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
            os.replace(final, trash / final.name)
            shutil.rmtree(trash, ignore_errors=True)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(final.parent)
    return final


def write_meta(directory: Path, step: int, attempt: int, **fields: Any) -> None:
    """Write ``directory/meta.json``: ``{"step", "attempt", **fields}`` (call inside a :func:`publish_dir` fill)."""
    (directory / META_FILE).write_text(json.dumps({"step": step, "attempt": attempt, **fields}))


def read_attempt(directory: Path) -> int | None:
    """The attempt recorded in a published directory's ``meta.json``; None when missing or unreadable."""
    try:
        return int(json.loads((directory / META_FILE).read_text())["attempt"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def written_by(directory: Path, attempt: int) -> bool:
    """Whether ``attempt`` wrote the published ``directory``; every directory counts for attempt 0 (unnumbered)."""
    return attempt == 0 or read_attempt(directory) == attempt


def step_dirs(parent: Path) -> dict[int, Path]:
    """``{N: parent/step_N}`` for every published ``step_N`` directory under ``parent``."""
    if not parent.is_dir():
        return {}
    out = {}
    for p in parent.iterdir():
        m = _STEP_RE.match(p.name)
        if m and p.is_dir():
            out[int(m.group(1))] = p
    return out


class RunDir:
    """Paths of one run directory; creates nothing until asked."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root).absolute()

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def rollouts(self) -> Path:
        return self.root / "rollouts"

    @property
    def broadcasts(self) -> Path:
        return self.root / "broadcasts"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def trainer_metrics(self) -> Path:
        return self.root / "trainer_metrics.jsonl"

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / f"step_{step}"

    def trainer_checkpoint(self, step: int) -> Path:
        return self.checkpoint(step) / "trainer"

    def orchestrator_checkpoint(self, step: int) -> Path:
        return self.checkpoint(step) / "orchestrator"

    def rollout_batch(self, step: int) -> Path:
        return self.rollouts / f"step_{step}"

    def broadcast(self, step: int) -> Path:
        return self.broadcasts / f"step_{step}"

    def ensure(self) -> RunDir:
        """Create the top-level directories."""
        for p in (self.checkpoints, self.rollouts, self.broadcasts, self.logs):
            p.mkdir(parents=True, exist_ok=True)
        return self

    def remove_steps_after(self, parent: Path, step: int) -> list[int]:
        """Delete ``parent/step_N`` for every N > ``step`` (left by an attempt that crashed); returns the Ns."""
        removed = []
        for n, p in step_dirs(parent).items():
            if n > step:
                shutil.rmtree(p, ignore_errors=True)
                removed.append(n)
        return sorted(removed)
