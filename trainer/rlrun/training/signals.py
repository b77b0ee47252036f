"""The trainer's stop signals: the first SIGTERM or SIGINT is its notice (finish the step, save it).

Until the trainer exists a signal ends the process at once (:func:`rlrun.role_exit.raise_terminated`:
there is nothing to save). From then on :class:`Notice` handles them: the first one calls
:meth:`rlrun.training.trainer.Trainer.notice` (the step being computed is finished, or the wait for
the next batch abandoned, and a checkpoint of the step it has is written). A second SIGINT (Ctrl-C
twice) exits now, what is on disk staying consistent; a second SIGTERM does not: it comes from a
runtime or torchrun sending the stop signal again, and exiting would skip the save, which for a
multi-rank trainer also breaks the other ranks' joint save. The grace period's SIGKILL bounds the
wait either way.
"""

from __future__ import annotations

import logging
import signal

from rlrun.role_exit import Terminated, raise_terminated

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def stop_at_once() -> None:
    """Before the trainer exists: a stop signal ends the process (exit 128 + the signal, report ``interrupted``)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, raise_terminated)


class Notice:
    """The stop signals of a running trainer (see the module docstring).

    Args:
        trainer: what :meth:`notice` is passed on to (``Trainer.notice``; its ``noticed`` event and
            ``saved_on_notice`` tell whether another rank's notice stopped it).
    """

    def __init__(self, trainer) -> None:
        self.trainer = trainer
        #: the first stop signal this process got, if any
        self.signum: int | None = None

    def install(self) -> None:
        """Handle SIGTERM and SIGINT from now on (main thread)."""
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise Terminated(signum)
        if self.signum is not None:
            log.info("SIGTERM again: still finishing the current step and saving")
            return
        self.signum = signum
        log.info("%s: finishing the current step, then saving a checkpoint", signal.Signals(signum).name)
        self.trainer.notice()

    def stopped_by(self) -> int | None:
        """The signal that stopped the trainer: its own, or SIGTERM when another rank's notice stopped it
        (the ranks agree at a step boundary), or None when nothing did."""
        if self.signum is not None:
            return self.signum
        stopped = self.trainer.saved_on_notice is not None or self.trainer.noticed.is_set()
        return signal.SIGTERM if stopped else None
