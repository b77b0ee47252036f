"""The errors that cross module and process boundaries, and which of them retrying cannot heal.

Several processes meet only through the run directory (the trainer, the orchestrator, the rollout
servers), so the errors about what lies there — checkpoints, weights — are named here, apart from
any one process: each raises and catches them without importing another. An error is
**permanent** when its class says ``permanent = True`` with a ``reason``; :func:`classify_error`
turns any exception into the ``(permanent, reason)`` an exit report carries
(:class:`rlrun.api.control.ExitReport`; exit status 78 for permanent ones, ``rlrun.role_exit``).

Errors that belong to one component stay with it: :class:`rlrun.manifest.ManifestError`
(permanent, ``InvalidManifest``), :class:`rlrun.versions.UnsupportedVersion` (permanent,
``UnsupportedVersion``), :class:`rlrun.rollout.client.RolloutError`,
:class:`rlrun.launcher.processes.ChildDied`. The orchestrator's stops are :class:`OrchestratorError`
subclasses with their own reasons (``rlrun.orchestrator.no_signal``; ``rlrun.orchestrator.failing``:
requests that keep failing, permanent or not by the last failure's kind).
"""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint part that is missing, torn, corrupt or from another run (message names the file)."""


class CheckpointMismatch(CheckpointError):
    """The checkpoint was written by a run with different settings; resuming would be wrong.

    Retrying cannot heal it (``permanent``; the processes exit with status 78 and ``reason`` in
    their exit report, :class:`rlrun.api.control.ExitReport`).
    """

    permanent = True
    reason = "CheckpointMismatch"


class WeightsError(RuntimeError):
    """Weights that must not be sent to a rollout server (message names the file and tensor)."""


class WeightsMismatch(WeightsError):
    """Weights whose tensors do not fit the model (names, dtypes or shapes differ): a run with
    another model wrote them, and retrying cannot heal that (``permanent``; exit reason ``reason``)."""

    permanent = True
    reason = "WeightsMismatch"


class OrchestratorError(RuntimeError):
    """The orchestrator cannot go on (the message says why and what to do)."""


def classify_error(exc: BaseException) -> tuple[bool, str]:
    """``(permanent, reason)`` of an exception that ended a role process.

    Permanent: every exception whose class says ``permanent = True``, with its ``reason``
    (:class:`rlrun.manifest.ManifestError` ``InvalidManifest``, :class:`CheckpointMismatch`,
    :class:`WeightsMismatch`, :class:`rlrun.versions.UnsupportedVersion`); anything else is ``(False, "Error")``.
    """
    if getattr(exc, "permanent", False) is True:
        return True, str(getattr(exc, "reason", None) or type(exc).__name__)
    return False, "Error"
