"""Modes of the files rlrun publishes: what ``mkdir`` and ``open`` give (0777 and 0666 less the umask), never the
private modes of ``tempfile`` (0700 directories, 0600 files) or of safetensors (0600 files).

A model, a broadcast, a checkpoint or a batch is read by processes that may run as another user: a rollout pod
beside the trainer's, a pod's ``fsGroup``, an image's non-root user reading a cache a volume mounts (CI of issue 46:
the CPU image could not read the builtin model its tests' cache held). Temporary names are ``.<name>.<tag>-<hex>``
beside the final path, as :func:`rlrun.rundir.publish_dir` and :func:`rlrun.rundir.write_file_atomic` rename them.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path


def umask() -> int:
    """This process's umask (read from ``/proc/self/status``, where setting it to read it back would race threads)."""
    with contextlib.suppress(OSError, StopIteration, ValueError), open("/proc/self/status") as fh:
        return int(next(line for line in fh if line.startswith("Umask:")).split()[1], 8)
    previous = os.umask(0o022)
    os.umask(previous)
    return previous


def open_to_readers(tree: Path) -> None:
    """Give every file under ``tree`` the mode ``open`` gives (0666 less the umask).

    Libraries write some files private (safetensors' ``save_file`` makes them 0600); a model, a broadcast or a
    checkpoint is read by processes of other users (a rollout pod, a pod's fsGroup, an image's non-root user reading
    a mounted cache), as a file the process wrote with ``open`` would be.
    """
    mode = 0o666 & ~umask()
    for f in tree.rglob("*"):
        if f.is_file() and not f.is_symlink() and f.stat().st_mode & 0o777 != mode:
            f.chmod(mode)


def temp_sibling_dir(path: Path, tag: str) -> Path:
    """Create and return an empty directory ``.<name>.<tag>-<random>`` beside ``path``.

    Its mode is what ``mkdir`` gives (0777 less the umask), not ``tempfile.mkdtemp``'s 0700: the directory is
    renamed into place as a model, a broadcast or a checkpoint that processes of another user read (a rollout
    pod, a pod's fsGroup, an image's non-root user reading a mounted cache).
    """
    while True:
        candidate = path.parent / f".{path.name}.{tag}-{secrets.token_hex(4)}"
        try:
            candidate.mkdir()
        except FileExistsError:
            continue
        return candidate


def temp_sibling_file(path: Path) -> tuple[int, str]:
    """Create ``.<name>.tmp-<random>`` beside ``path`` for writing; returns its descriptor and path.

    Mode 0666 less the umask, as ``open`` gives (``tempfile.mkstemp`` gives 0600): the file is renamed into
    place for other processes, of other users perhaps, to read (:func:`temp_sibling_dir`).
    """
    while True:
        candidate = path.parent / f".{path.name}.tmp-{secrets.token_hex(4)}"
        try:
            return os.open(candidate, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666), str(candidate)
        except FileExistsError:
            continue
