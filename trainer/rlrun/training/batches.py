"""Which shipped batch the trainer takes for a step, and waiting for it (with every rank, and a notice).

A batch ``rollouts/step_s/`` counts once it is published (an atomic rename) and is this run's:
:func:`batch_accepted` (the resume rule of :mod:`rlrun.training.trainer`). The wait polls every
``poll_s``; with several ranks each poll is one short collective (an all-reduce of "I have a notice"
and "not visible to me yet"), so the batch is read only once every rank sees it, the wait is abandoned
as soon as any rank has a notice while some rank still waits (:class:`Noticed`), and no rank sits in
one collective longer than a poll (a long wait never hits the process group's timeout).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from rlrun.rundir import read_attempt

log = logging.getLogger(__name__)


class Noticed(Exception):
    """Raised by :func:`wait_for_batch` to abandon the wait once a notice came (nothing half-done to finish)."""


def batch_accepted(path: Path, step: int, attempt: int, shipped_at_restore: int) -> bool:
    """Whether the published batch directory ``path`` is batch ``step`` for the trainer of ``attempt``.

    Args:
        path: ``rollouts/step_<step>/``.
        step: the step to train.
        attempt: this attempt's run-directory number (0: unnumbered, every batch counts).
        shipped_at_restore: batches shipped when the checkpoint resumed from was taken: those
            (written by an earlier attempt) are trained as they are.

    Returns:
        False while it is not published; True for a batch the checkpoint counts as shipped;
        else True only when its ``meta.json`` carries ``attempt`` or a later number.
    """
    if not path.is_dir():
        return False
    if step <= shipped_at_restore or attempt == 0:
        return True
    written = read_attempt(path)
    return written is not None and written >= attempt


def wait_for_batch(
    path: Path,
    step: int,
    ready: Callable[[], bool],
    agree: Callable[[bool, bool], tuple[bool, bool]],
    noticed: threading.Event,
    poll_s: float,
    log_waits: bool = True,
) -> Path:
    """Wait until batch ``step`` at ``path`` is ``ready`` for every rank; returns ``path``.

    Args:
        ready: whether this rank sees it (:func:`batch_accepted`).
        agree: ``(noticed, waiting) → (any rank noticed, any rank waiting)``; the flags themselves in one process.
        noticed: set by the trainer's notice.
        poll_s: seconds between polls.
        log_waits: log a long wait (every 30, 60, 120 … seconds); rank 0 alone does.

    Raises:
        Noticed: a rank got its notice while the batch was not there for every rank.
    """
    t0 = time.monotonic()
    next_note = 30.0
    while True:
        any_noticed, waiting = agree(noticed.is_set(), not ready())
        if not waiting:  # there for every rank: taken, a notice stops the trainer at the next step boundary
            return path
        if any_noticed:
            raise Noticed
        time.sleep(poll_s)
        waited = time.monotonic() - t0
        if waited > next_note and log_waits:
            log.info("still waiting for batch %d after %.0f s", step, waited)
            next_note *= 2
