"""``rlrun trainer``: the trainer role, run to its end, its exit described once (:mod:`rlrun.role_exit`).

:func:`run_trainer` returns the process's exit status; the ``rlrun trainer`` command (:mod:`rlrun.cli`) declares its
options, sets up logging and exits with it.
"""

from __future__ import annotations

import signal
from pathlib import Path

from rlrun.manifest import load_manifest
from rlrun.model.resolve import resolve_model
from rlrun.role_exit import reporting
from rlrun.rundir import RunDir
from rlrun.training.distributed import init_from_env, teardown
from rlrun.training.signals import Notice, stop_at_once
from rlrun.training.trainer import Trainer


def run_trainer(
    manifest: Path,
    run_dir: Path,
    max_steps: int | None = None,
    resume: bool = False,
    cache_dir: Path | None = None,
    attempt: int = 0,
    run_uid: str | None = None,
) -> int:
    """Train ``manifest``'s run in ``run_dir`` up to ``max_steps`` (None: the spec's) and return the exit status.

    0 once ``max_steps`` is trained (``complete``); 128 + the signal (143 on SIGTERM, 130 on SIGINT) after the
    **save on notice** (``interrupted``: the step being computed is finished, or the wait for the next batch
    abandoned, and a trainer checkpoint of the step it has is written, :meth:`Trainer.notice`; a second signal exits
    at once); 78 on a permanent error, 1 on any other (:func:`rlrun.role_exit.reporting`). Each exit writes an exit
    report to ``$RLRUN_TERMINATION_LOG`` — on rank 0 only under torchrun, where every rank runs this with the same
    arguments and joins the data-parallel group (:func:`rlrun.training.distributed.init_from_env`).

    Args:
        resume: continue from the newest complete checkpoint (start over from step 0 when there is none).
        attempt: the attempt number; a trainer-only restart keeps it (and ``run_uid``): :mod:`rlrun.training.trainer`.
        run_uid: the run's uid: attempts numbered per run directory (:func:`rlrun.rundir.run_dir_attempt`).
    """
    with reporting("trainer") as exit_:
        stop_at_once()
        dp = init_from_env()
        exit_.writes_report = dp.is_main
        run = load_manifest(manifest, checks="static")  # the trainer needs no env code or data
        exit_.max_steps = max_steps or run.spec.max_steps
        model = resolve_model(run.spec.model, cache_dir, envs=run.spec.envs)
        dp_group = dp if dp.distributed else None
        t = Trainer(run.spec, RunDir(run_dir), model, max_steps, resume, attempt, run_uid=run_uid, dp=dp_group)
        exit_.step = t.step
        notice = Notice(t)
        notice.install()
        try:
            exit_.step = t.run()
        finally:
            exit_.step = t.step
        teardown(dp)  # every rank got here together (a no-op in one process)
        stopped_by = notice.stopped_by()
        if stopped_by is not None and t.step < exit_.max_steps:
            name = signal.Signals(stopped_by).name
            saved = (
                f"saved trainer checkpoint step {t.saved_on_notice}"
                if t.saved_on_notice is not None
                else f"the trainer part of step {t.step} was already written"
            )
            return exit_.finish("interrupted", 128 + stopped_by, f"stopped by {name} at step {t.step}: {saved}")
        return exit_.finish("complete", 0, f"trained steps up to {t.step}")
    return exit_.code
