"""``rlrun orchestrator``: the orchestrator role, run to its end, its exit classified once (:mod:`rlrun.role_exit`).

:func:`run_orchestrator` returns the process's exit status; the ``rlrun orchestrator`` command (:mod:`rlrun.cli`)
declares its options, refuses contradictory ones (exit 2) and exits with it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from pathlib import Path

from rlrun.manifest import curriculum_warnings, load_manifest
from rlrun.model.resolve import resolve_model
from rlrun.orchestrator import loop
from rlrun.role_exit import RoleExit, reporting
from rlrun.rundir import RunDir

log = logging.getLogger(__name__)


def run_orchestrator(
    manifest: Path,
    run_dir: Path,
    rollout_urls: Sequence[str] = (),
    max_steps: int | None = None,
    resume: bool = False,
    cache_dir: Path | None = None,
    attempt: int = 0,
    run_uid: str | None = None,
    control_host: str = "127.0.0.1",
    control_port: int | None = None,
    control_token: str | None = None,
) -> int:
    """Orchestrate ``manifest``'s run in ``run_dir`` up to ``max_steps`` (None: the spec's) and return the exit status.

    0 when done (``complete``) or after a pause once SIGTERM arrived (``paused``) or a stop (``interrupted``); 1 when
    SIGTERM came and the pause snapshot could not be written (``interrupted``); 78 on a permanent error, 1 on any
    other (:func:`rlrun.role_exit.reporting`). Each exit writes an exit report to ``$RLRUN_TERMINATION_LOG``.

    Args:
        rollout_urls: the rollout servers' base URLs (none: wait for ``PUT /rollout-endpoints``).
        resume: continue from the newest complete checkpoint (start over from step 0 when there is none).
        attempt, run_uid: the attempt number, and the run's uid that numbers attempts per run directory.
        control_host, control_port, control_token: the control server's address, port (None: no server) and
            bearer token.
    """
    with reporting("orchestrator") as exit_:
        run = load_manifest(manifest)
        for line in run.spec.deprecations + curriculum_warnings(run.spec):
            log.warning("%s", line)
        exit_.max_steps = max_steps or run.spec.max_steps
        orch = loop.Orchestrator(
            run.spec,
            RunDir(run_dir),
            list(rollout_urls),
            resolve_model(run.spec.model, cache_dir, envs=run.spec.envs),
            max_steps,
            resume,
            attempt=attempt,
            control_port=control_port,
            control_host=control_host,
            control_token=control_token,
            run_uid=run_uid,
            name=run.metadata.name,
        )
        try:
            asyncio.run(orch.run())
        finally:
            exit_.step = orch.shipped
        return finish(exit_, orch)
    return exit_.code


def finish(exit_: RoleExit, orch: loop.Orchestrator) -> int:
    """Classify how ``orch`` ended (its ``run()`` returned) and finish ``exit_`` with it; returns the exit status."""
    if orch.termination.error is not None:  # SIGTERM came and the snapshot could not be written
        return exit_.finish(
            "interrupted", 1, f"SIGTERM: the pause snapshot could not be written: {orch.termination.error}"
        )
    if orch.phase == "done":
        return exit_.finish("complete", 0, f"shipped and checkpointed steps up to {orch.shipped}")
    if orch.paused:
        pause = orch.last_pause
        saved = f"snapshot of step {pause.step} written" if pause and pause.step is not None else "nothing to save"
        return exit_.finish("paused", 0, f"paused at step {orch.shipped}: {saved}")
    return exit_.finish("interrupted", 0, f"stopped at step {orch.shipped}")
