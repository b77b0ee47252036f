"""What ``rlrun local`` refuses before it starts any process, beyond the manifest's own checks (:mod:`rlrun.manifest`).

A refusal a user can cause is one message naming what to change, printed before a rollout server, trainer or
orchestrator starts — not a traceback in a role's log minutes later: a trainer of several nodes
(:func:`trainer_shape_problem`), a fresh start in a run directory that holds a run (:func:`run_dir_problem`), a
``--resume`` of a run that is already complete (:func:`already_complete`: said, not refused). The other checks are
the roles' own, run early: a torch or vLLM outside rlrun's pins (:func:`versions_problem`, ``rlrun trainer``'s and
``rlrun rollout``'s :func:`~rlrun.versions.check_installed`), a resume whose checkpoint belongs to other settings or
data (:func:`resume_mismatch`, the orchestrator's :func:`~rlrun.identity.check_compatible`). A check that is another
process package's code (a dataset's prompts, :func:`rlrun.orchestrator.prompts.check_prompts`) is handed to the launcher
by ``rlrun local`` (``LocalLauncher.check_model``): process packages import none of each other.
"""

from __future__ import annotations

from rlrun.api.spec import RLRunSpec
from rlrun.checkpoint import latest_complete_checkpoint, load_orchestrator_progress
from rlrun.errors import CheckpointError, CheckpointMismatch
from rlrun.identity import check_compatible
from rlrun.rundir import RunDir, holds_a_run
from rlrun.versions import UnsupportedVersion, check_installed


def versions_problem(fake_rollouts: bool) -> str | None:
    """Why the roles ``rlrun local`` would start refuse this machine's torch or vLLM (outside rlrun's pins, or
    missing: :func:`rlrun.versions.check_installed`, as ``rlrun trainer`` and ``rlrun rollout`` check them), or
    None. The trainer needs torch; the rollout servers need vLLM too, unless they are rlrun's fake
    (``fake_rollouts``: ``$RLRUN_FAKE_ROLLOUT``). ``$RLRUN_ALLOW_UNSUPPORTED_VERSIONS=1``: warned, None.

    Raises:
        PinsError: rlrun's package metadata pins vLLM inconsistently (a packaging bug).
    """
    try:
        check_installed(vllm=not fake_rollouts)
    except UnsupportedVersion as exc:
        return str(exc)
    return None


def trainer_shape_problem(spec: RLRunSpec) -> str | None:
    """Why the spec's trainer cannot run on this one machine (``trainer.nodes > 1``), or None."""
    nodes = spec.trainer.nodes
    if nodes > 1:
        return (
            f"trainer.nodes is {nodes}: rlrun local runs the trainer on this one machine; set trainer.nodes "
            "to 1 (trainer.processes_per_node ranks still run here) or run the manifest with the operator"
        )
    return None


def run_dir_problem(run_dir: RunDir) -> str | None:
    """Without ``--resume``: why ``run_dir`` cannot hold a new run (it holds one: :func:`rlrun.rundir.holds_a_run`,
    checkpoints or batches past step 0, the rule the orchestrator and trainer apply as they start), or None."""
    if holds_a_run(run_dir):
        return f"{run_dir.root} already holds a run; pass --resume to continue it, or --run-dir to start a new one"
    return None


def resume_step(run_dir: RunDir) -> int | None:
    """The step of the newest complete checkpoint, the one a ``--resume`` starts from (None: none)."""
    ckpt = latest_complete_checkpoint(run_dir)
    return ckpt.step if ckpt is not None else None


def already_complete(run_dir: RunDir, step: int | None, max_steps: int) -> str | None:
    """The sentence saying the run is already complete when checkpoint ``step`` (the one a ``--resume`` starts from)
    holds the last step, ``max_steps`` (nothing to start); else None."""
    if step is None or step < max_steps:
        return None
    return (
        f"{run_dir.root} is already complete: its newest complete checkpoint, step {step} "
        f"({run_dir.checkpoint(step)}), holds {step} trained steps and the run's last step is "
        f"{max_steps}; nothing to resume, no process started (a larger --max-steps trains further)"
    )


def resume_mismatch(run_dir: RunDir, spec: RLRunSpec, step: int | None) -> str | None:
    """Why checkpoint ``step`` (the newest complete one; None: none) cannot be resumed with ``spec``: other settings,
    or an env's data changed since it was written (:func:`~rlrun.identity.check_compatible`, as the orchestrator
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
