"""The run directory shared by all processes of a run (a persistent volume on a cluster).

Layout (see ARCHITECTURE.md)::

    <run_dir>/
      checkpoints/step_N/trainer/                   weights, optimizer, trainer progress
      checkpoints/step_N/orchestrator/progress.pt   orchestrator progress
      rollouts/step_N/                              batch N, shipped to the trainer
      broadcasts/step_N/                            weights after step N, for rollout servers
      metrics.jsonl                                 one line per step (orchestrator)
      trainer_metrics.jsonl                         one line per step (trainer)
      eval.jsonl                                    one line per evaluation (orchestrator)
      spec.json                                     the spec each attempt started with (orchestrator)
      tracking.json, tensorboard/, wandb/           the experiment trackers' record and files (orchestrator)
      logs/                                         one log per process (rlrun local)
      attempt_offsets.json                          run uid → attempt offset (:func:`run_dir_attempt`)

Every directory above that another process reads is published by renaming a fully
written, fsynced temporary directory into place (:func:`publish_dir`), so a reader
sees either nothing or the whole thing. Each published step directory (a batch, a
broadcast, a trainer part) holds ``meta.json`` with at least its ``step`` and the
``attempt`` that wrote it (:func:`write_meta`, :func:`read_attempt`): a resumed attempt
uses only what it wrote itself or what it resumed from.

Attempts are numbered per run directory. The operator counts the attempts of one RLRun
object (``--attempt N``); a run re-created over a retained volume (a new RLRun object, a new
uid) counts from 0 again. With ``--run-uid`` the **run-directory attempt** is
``offset(uid) + N`` (:func:`run_dir_attempt`), the offset assigned when the uid is first seen
as one past the highest attempt the directory recorded, so no two runs' attempts share a
number: every ``meta.json``, ledger file and batch check uses it. Without a run uid it is
``N`` (``rlrun local``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import shutil
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from rlrun.errors import CheckpointError
from rlrun.file_modes import open_to_readers, temp_sibling_dir, temp_sibling_file
from rlrun.ledger import ledger_attempts

log = logging.getLogger(__name__)

#: The file of a published step directory that says which step and attempt wrote it.
META_FILE = "meta.json"

#: The run directory's map of run uids to attempt offsets (:func:`run_dir_attempt`).
ATTEMPT_OFFSETS_FILE = "attempt_offsets.json"

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
    (on its ``$RLRUN_CRASH_AT_HIT``-th occurrence, default 1). Costs one dict lookup otherwise.

    ``$RLRUN_CRASH_SIGNAL=STOP`` sends SIGSTOP instead: the process halts there until the test sends
    SIGCONT (and whatever it wants delivered at that exact point first), then goes on."""
    if os.environ.get("RLRUN_CRASH_AT") != phase:
        return
    _phase_hits[phase] = _phase_hits.get(phase, 0) + 1
    if _phase_hits[phase] >= int(os.environ.get("RLRUN_CRASH_AT_HIT", "1")):
        os.kill(os.getpid(), getattr(signal, "SIG" + os.environ.get("RLRUN_CRASH_SIGNAL", "KILL")))


def fault_point(phase: str) -> None:
    """Test-only crash injection for other modules (:func:`_fault_point`): the trainer's
    ``trainer_notice_save`` and ``trainer_periodic_save``, inside the fill of its part, and
    ``trainer_announced``, between a version's announcement and its broadcast's write."""
    _fault_point(phase)


def write_file_atomic(
    path: str | os.PathLike, data: bytes | Callable[[BinaryIO], None], fault_points: bool = True
) -> None:
    """Write ``data`` (bytes, or a function that writes to a binary file) to ``path`` via a fsynced
    temporary file and a rename; fsync the parent after.

    A kill at any instant leaves either the old file or the new one at ``path`` (and at worst
    a stray ``.<name>.tmp-*`` file, which readers ignore). ``fault_points=False``: not one of the
    checkpoint writes the crash-injection tests count (:func:`_fault_point`), e.g. ``spec.json``.
    """
    fault = _fault_point if fault_points else (lambda phase: None)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fault("before_write")
    fd, tmp = temp_sibling_file(path)
    try:
        with os.fdopen(fd, "wb") as fh:
            if callable(data):
                data(fh)
            else:
                fh.write(data)
            fh.flush()
            fault("after_temp_write")
            os.fsync(fh.fileno())
        fault("after_fsync")
        os.replace(tmp, path)
        fault("after_rename")
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    fault("after_dir_fsync")


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
    tmp = temp_sibling_dir(final, "tmp")
    try:
        fill(tmp)
        open_to_readers(tmp)
        for f in tmp.rglob("*"):
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
        fsync_dir(tmp)
        if final.exists():
            trash = temp_sibling_dir(final, "old")
            os.replace(final, trash / final.name)
            shutil.rmtree(trash, ignore_errors=True)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(final.parent)
    return final


def publish_broadcast(
    final: str | os.PathLike,
    fill: Callable[[Path], None],
    attempt: int,
) -> tuple[Path, bool]:
    """Publish the broadcast ``final`` (``broadcasts/step_N/``) as :func:`publish_dir` does, unless
    ``attempt`` published it already; returns it and whether it was written now.

    A broadcast is never replaced by the attempt that wrote it: a rollout server may be serving it, and vLLM
    reads a LoRA adapter's directory again when its cache evicted it (ARCHITECTURE.md, invariant 8: no file a
    server still reads is replaced or removed under it; :func:`publish_dir` removes the old directory before
    renaming the new one in). A trainer that retrains a step after a trainer-only loss thus keeps the
    broadcast its predecessor published, the version every server holds, and trains on from weights that
    differ from it only by floating-point order. One an earlier attempt left is replaced (its orchestrator,
    and the servers it loaded, are gone).
    """
    if broadcast_kept(final, attempt):
        return Path(final), False
    return publish_dir(final, fill), True


def broadcast_kept(final: str | os.PathLike, attempt: int) -> bool:
    """Whether :func:`publish_broadcast` keeps ``final``: ``attempt`` (numbered) published it already."""
    return Path(final).is_dir() and attempt != 0 and read_attempt(Path(final)) == attempt


def write_meta(directory: Path, step: int, attempt: int, **fields: Any) -> None:
    """Write ``directory/meta.json``: ``{"step", "attempt", **fields}`` (call inside a :func:`publish_dir` fill)."""
    (directory / META_FILE).write_text(json.dumps({"step": step, "attempt": attempt, **fields}))


def read_meta(directory: Path) -> dict[str, Any] | None:
    """A published directory's ``meta.json`` (:func:`write_meta`); None when missing or unreadable."""
    try:
        meta = json.loads((directory / META_FILE).read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def read_attempt(directory: Path) -> int | None:
    """The attempt recorded in a published directory's ``meta.json``; None when missing or unreadable."""
    attempt = (read_meta(directory) or {}).get("attempt")
    return attempt if isinstance(attempt, int) else None


def written_by(directory: Path, attempt: int) -> bool:
    """Whether ``attempt`` wrote the published ``directory``; every directory counts for attempt 0 (unnumbered).

    ``attempt`` is the run-directory attempt (:func:`run_dir_attempt`): only the first attempt of
    the first run in a directory (or ``rlrun local`` without ``--attempt``) can be 0.
    """
    return attempt == 0 or read_attempt(directory) == attempt


_offsets_lock = threading.Lock()  # lockf excludes other processes only


def run_dir_attempt(run_dir: RunDir, run_uid: str | None, attempt: int) -> int:
    """The run-directory attempt of attempt ``attempt`` of the run ``run_uid``: ``offset + attempt``.

    Without a run uid it is ``attempt`` and nothing is written. Otherwise the offset is read
    from ``<run_dir>/attempt_offsets.json`` (``{"runs": {uid: offset}, "highest": int}``) or,
    the first time the uid is seen, assigned as one past the highest run-directory attempt
    recorded so far (that file's ``highest`` and every attempt that left a ledger file; −1 in
    a new directory, so the first run's offset is 0). ``highest`` is raised to the result.
    The file is read and rewritten under an exclusive ``lockf`` lock on
    ``.attempt_offsets.lock`` and written atomically and fsynced, so an attempt's orchestrator
    and trainer, starting at once, get the same number. An unreadable file is logged and
    rebuilt from the ledger (offsets only grow, so no number is used twice).

    Raises:
        OSError: the run directory or the file cannot be written.
    """
    if not run_uid:
        return attempt
    run_dir.root.mkdir(parents=True, exist_ok=True)
    path = run_dir.root / ATTEMPT_OFFSETS_FILE
    with _offsets_lock, open(run_dir.root / ".attempt_offsets.lock", "a+") as lock:
        fcntl.lockf(lock, fcntl.LOCK_EX)
        try:
            data = _read_offsets(path)
            runs, highest = data["runs"], data["highest"]
            changed = run_uid not in runs
            if changed:
                ledger = run_dir.ledger
                recorded = [*ledger_attempts(ledger, "orchestrator"), *ledger_attempts(ledger, "trainer")]
                runs[run_uid] = max(highest, *recorded, -1) + 1
                log.info("run uid %s: attempts numbered from %d in %s", run_uid, runs[run_uid], run_dir.root)
            effective = runs[run_uid] + attempt
            if changed or effective > highest:
                update = {"runs": runs, "highest": max(highest, effective)}
                write_file_atomic(path, json.dumps(update, indent=1, sort_keys=True).encode())
        finally:
            fcntl.lockf(lock, fcntl.LOCK_UN)
    return effective


def _read_offsets(path: Path) -> dict[str, Any]:
    """``attempt_offsets.json`` as ``{"runs": {uid: offset}, "highest": int}`` (empty when missing or unreadable)."""
    try:
        raw = json.loads(path.read_text())
        return {"runs": {str(u): int(o) for u, o in raw["runs"].items()}, "highest": int(raw["highest"])}
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        log.warning("%s is unreadable (%s); assigning offsets anew past every attempt on record", path, exc)
    return {"runs": {}, "highest": -1}


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
    def ledger(self) -> Path:
        """The ledger's folder (:mod:`rlrun.ledger`: one file per attempt and role)."""
        return self.root / "ledger"

    @property
    def trainer_metrics(self) -> Path:
        return self.root / "trainer_metrics.jsonl"

    @property
    def evaluations(self) -> Path:
        return self.root / "eval.jsonl"

    @property
    def tracking(self) -> Path:
        """``tracking.json``: the experiment tracker run's id and the last step logged to it (:mod:`rlrun.tracking`)."""
        return self.root / "tracking.json"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    @property
    def wandb(self) -> Path:
        """Where W&B keeps its files (``offline-run-*`` to ``wandb sync``): ``wandb.init(dir=root)`` adds ``wandb/``."""
        return self.root / "wandb"

    @property
    def spec_file(self) -> Path:
        """``spec.json``: the run's spec as the orchestrator last started with it (``rlrun eval`` reads it)."""
        return self.root / "spec.json"

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


def read_json_part(path: Path) -> Any:
    """The parsed JSON file ``path`` of a checkpoint part (``progress.json``, ``meta.json``).

    Raises:
        CheckpointError: the file is missing, unreadable or not JSON (message names it).
    """
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except OSError as exc:  # its message repeats the path: the reason alone
        raise CheckpointError(f"{path}: unreadable ({exc.strerror or type(exc).__name__})") from None
    except ValueError as exc:
        raise CheckpointError(f"{path}: unreadable ({exc})") from None


def end_torn_line(path: Path) -> None:
    """Terminate a last line cut short by a kill, so the next writer's first line is not glued to it (a process
    restarted appends to its predecessor's ledger and metrics: the trainer, the orchestrator's ``metrics.jsonl``
    and ``eval.jsonl``)."""
    try:
        with open(path, "rb+") as fh:
            if fh.seek(0, os.SEEK_END) == 0:
                return
            fh.seek(-1, os.SEEK_END)
            if fh.read(1) != b"\n":
                fh.write(b"\n")
    except FileNotFoundError:
        pass


def read_metrics(path: Path, offset: int = 0) -> tuple[list[dict], int]:
    """Complete JSON lines of ``path`` from byte ``offset``; returns them and the new offset.

    A line that does not parse (torn by a process killed mid-write, then appended to) is skipped.
    """
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            data = fh.read()
    except FileNotFoundError:
        return [], offset
    end = data.rfind(b"\n") + 1
    lines = []
    for line in data[:end].splitlines():
        with contextlib.suppress(ValueError):
            if line.strip():
                lines.append(json.loads(line))
    return lines, offset + end


def read_jsonl(path: Path) -> list[dict]:
    """Every complete JSON line of ``path`` (:func:`read_metrics` from the start; none when it does not exist)."""
    return read_metrics(path)[0]


def holds_a_run(run_dir: RunDir, *, count_batches: bool = True) -> list[Path]:
    """What shows that ``run_dir`` already holds a run a fresh start (no ``--resume``) must not write over: those of
    ``checkpoints/`` and ``rollouts/`` holding a step past 0; empty (false) when it holds none.

    The threshold is **past step 0**, for every caller (``rlrun local`` before any process starts, the orchestrator
    and the trainer as they start). Step 0 is what a fresh start writes itself: the trainer's start-up checkpoint of
    the starting weights, before any batch (batches are numbered from 1) — no trained step, no episode, nothing a
    fresh start would lose, and a new one writes it again. So a run killed before its first step can be started again
    without ``--resume``, by the launcher and the operator alike, and the orchestrator and trainer, which start
    together, never take each other's step 0 for an earlier run's.

    Args:
        count_batches: False for the trainer, the one caller that must not count batches: its own orchestrator, started
            with it, may already be shipping this run's first ones (the orchestrator counts them, by this same rule).
    """
    parents = (run_dir.checkpoints, run_dir.rollouts) if count_batches else (run_dir.checkpoints,)
    return [p for p in parents if any(n > 0 for n in step_dirs(p))]
