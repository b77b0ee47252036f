"""What a role process reports when it exits: the exit report protocol of ``rlrun orchestrator`` and ``rlrun trainer``.

The operator reads both the container's status and, from ``$RLRUN_TERMINATION_LOG`` (the
container's termination message), an :class:`~rlrun.api.control.ExitReport` JSON written on every
exit (:func:`~rlrun.api.control.write_exit_report`):

| status | outcome | when |
|---|---|---|
| 0 | ``complete`` | every step done (``step == max_steps``) |
| 0 | ``paused`` | the orchestrator paused (``POST /pause`` or SIGTERM), wrote its snapshot, and stopped |
| 1 | ``interrupted`` | SIGTERM came and the orchestrator's snapshot could not be written |
| 143 | ``interrupted`` | the trainer got SIGTERM (or SIGINT: 130) and saved a checkpoint¹ |
| 1 | ``error`` | it raised; retrying may heal it (a lost server, a full disk, …) |
| 78 | ``error``, ``permanent`` | retrying cannot heal it (``sysexits.h`` ``EX_CONFIG``): reason² |

¹ It finished the step it was computing and saved a checkpoint of the step it has (a second signal exits at once);
the next start trains on from the newest complete checkpoint. ² ``InvalidManifest``, ``CheckpointMismatch`` (the
manifest's settings differ from the checkpoint's), ``WeightsMismatch`` (weights that do not fit the model) or
``UnsupportedVersion`` (a torch or vLLM outside rlrun's pins: :mod:`rlrun.versions`);
:func:`rlrun.errors.classify_error`.

The orchestrator's stops that the same spec would meet again are permanent too: ``NoLearningSignal``,
``ServerContextTooSmall``, ``PromptTooLong``, and of requests that keep failing ``RequestsRejected``,
``RewardsFailing``, ``EnvFailing`` (:mod:`rlrun.orchestrator.failing`; ``RequestsFailing`` is not).

A role (:func:`rlrun.training.main.run_trainer`, :func:`rlrun.orchestrator.main.run_orchestrator`) runs its body
inside :func:`reporting`, ends with :meth:`RoleExit.finish` and returns the exit status it chose
(:attr:`RoleExit.code`); the ``rlrun`` command exits with it. A role that refuses to start before its body runs
(``rlrun trainer`` and ``rlrun rollout`` on a torch or vLLM outside the pins) ends through :func:`refuse`: the same
report, 78.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from collections.abc import Iterator
from typing import Literal

from rlrun.api.control import EXIT_PERMANENT, ExitOutcome, ExitReport, write_exit_report
from rlrun.errors import classify_error
from rlrun.manifest import ManifestError

log = logging.getLogger(__name__)


class Terminated(BaseException):
    """SIGTERM or SIGINT reached a role process that has no pause of its own (the trainer)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def raise_terminated(signum: int, frame: object) -> None:
    raise Terminated(signum)


class RoleExit:
    """What a role process reports when it exits (:class:`~rlrun.api.control.ExitReport`).

    The role sets :attr:`step` and :attr:`max_steps` as it learns them and ends with
    :meth:`finish`; :func:`reporting` turns an exception into an ``error`` report instead. Either way
    :attr:`code` is then the process's exit status.
    """

    def __init__(self, role: Literal["orchestrator", "trainer"]) -> None:
        self.role = role
        self.step: int | None = None
        self.max_steps: int | None = None
        #: False on trainer ranks other than 0: rank 0 alone writes the exit report.
        self.writes_report = True
        #: The exit status, once :meth:`finish` or :func:`reporting` decided it (1 until then: an exit no one
        #: decided is an error).
        self.code = 1

    def report(self, outcome: ExitOutcome, message: str = "", permanent: bool = False, reason: str | None = None):
        """Write the exit report (a no-op without ``$RLRUN_TERMINATION_LOG``, or when not :attr:`writes_report`)."""
        if not self.writes_report:
            return
        report = ExitReport(
            role=self.role,
            outcome=outcome,
            step=self.step,
            max_steps=self.max_steps,
            permanent=permanent,
            reason=reason,
            message=message,
        )
        write_exit_report(report)

    def finish(self, outcome: ExitOutcome, code: int = 0, message: str = "") -> int:
        """Report ``outcome``, decide the exit status ``code`` and ignore SIGTERM from here on (:func:`exiting`);
        returns ``code`` (the role returns it, and its process exits with it)."""
        self.report(outcome, message)
        exiting()
        self.code = code
        return code


def exiting() -> None:
    """Ignore SIGTERM from here on: the process has written its exit report and only exits now.

    Python restores a signal's default action while it shuts down, so a stop signal arriving then (a
    runtime or torchrun sending it again, a notice that meets a trainer that has just finished) would
    kill the process, and its status (−15) would contradict the report. SIGKILL still ends it.
    """
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


@contextlib.contextmanager
def reporting(role: Literal["orchestrator", "trainer"]) -> Iterator[RoleExit]:
    """Run a role's body: on an exception write an ``error`` exit report and set :attr:`RoleExit.code` to 1, or
    :data:`~rlrun.api.control.EXIT_PERMANENT` (78) when :func:`classify_error` says permanent; on
    SIGTERM/SIGINT (:class:`Terminated`) report ``interrupted`` with 128 + the signal. The exception ends there
    (the report says it all): the code after the ``with`` returns :attr:`RoleExit.code`. ``SystemExit`` passes."""
    exit_ = RoleExit(role)
    try:
        yield exit_
    except Terminated as sig:
        log.warning("%s: stopping without finishing (%s)", role, sig)
        exit_.finish("interrupted", 128 + sig.signum, f"stopped by {sig} at step {exit_.step}")
    except KeyboardInterrupt:
        exit_.finish("interrupted", 128 + signal.SIGINT, f"stopped by SIGINT at step {exit_.step}")
    except Exception as exc:
        permanent, reason = classify_error(exc)
        if isinstance(exc, ManifestError):
            print(exc, file=sys.stderr)
        elif permanent:  # a refusal the user can act on (the message says what): a traceback adds nothing
            log.error("%s failed (permanent: retrying cannot heal it): %s: %s", role, reason, exc)
        else:
            log.exception("%s failed", role)
        exit_.report("error", f"{type(exc).__name__}: {exc}", permanent, reason)
        exiting()
        exit_.code = EXIT_PERMANENT if permanent else 1


def refuse(role: Literal["orchestrator", "trainer", "rollout"], exc: Exception) -> int:
    """End a role process that refuses to start, before its body runs, with permanent error ``exc`` (an installed
    torch or vLLM outside rlrun's pins: :class:`rlrun.versions.UnsupportedVersion`): log its message as one error line
    (no traceback), write an ``error`` exit report, ``permanent``, with its ``reason`` (rank 0 alone under torchrun,
    ``$RANK``) and return :data:`~rlrun.api.control.EXIT_PERMANENT` (78), the status to exit with."""
    _, reason = classify_error(exc)
    log.error("%s cannot start (permanent: retrying cannot heal it): %s: %s", role, reason, exc)
    if os.environ.get("RANK", "0") == "0":
        message = f"{type(exc).__name__}: {exc}"
        write_exit_report(ExitReport(role=role, outcome="error", permanent=True, reason=reason, message=message))
    exiting()
    return EXIT_PERMANENT
