"""What ``rlrun local`` refuses before it starts any process, beyond the manifest's own checks (:mod:`rlrun.manifest`).

A refusal a user can cause is one message naming what to change, printed before a rollout server, trainer or
orchestrator starts — not a traceback in a role's log minutes later. These checks are the roles' own, run early:
a resume whose checkpoint belongs to other settings or data (:func:`resume_mismatch`, the orchestrator's
:func:`~rlrun.checkpoint.check_compatible`). A check that is another process package's code (a dataset's prompts,
:func:`rlrun.orchestrator.prompts.check_prompts`) is handed to the launcher by ``rlrun local``
(``LocalLauncher.check_model``): process packages import none of each other.
"""

from __future__ import annotations

from rlrun.api.spec import RLRunSpec
from rlrun.checkpoint import check_compatible, load_orchestrator_progress
from rlrun.errors import CheckpointError, CheckpointMismatch
from rlrun.rundir import RunDir


def resume_mismatch(run_dir: RunDir, spec: RLRunSpec, step: int | None) -> str | None:
    """Why checkpoint ``step`` (the newest complete one; None: none) cannot be resumed with ``spec``: other settings,
    or an env's data changed since it was written (:func:`~rlrun.checkpoint.check_compatible`, as the orchestrator
    checks it, every env built for its fingerprint); None when it can, or when its part cannot be read (the
    orchestrator then falls back to an older checkpoint and says so)."""
    if step is None:
        return None
    from rlrun.envs import make_env

    try:
        state = load_orchestrator_progress(run_dir, step)
        envs = {e.name: make_env(e) for e in spec.envs}
        check_compatible(state.get("identity"), spec, str(run_dir.orchestrator_checkpoint(step)), envs)
    except CheckpointMismatch as exc:
        return str(exc)
    except CheckpointError:
        return None
    return None
