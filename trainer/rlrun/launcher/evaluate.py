"""``rlrun eval RUN_DIR [--step N]``: evaluate a saved checkpoint on held-out tasks, on a rollout server of its own.

The launcher's part: which spec and checkpoint (:func:`run_spec`, :func:`checkpoint_step`) and a rollout server
of its own (:func:`eval_server`: vLLM, or the fake with ``$RLRUN_FAKE_ROLLOUT``). The evaluation itself is the one
a run makes while it trains (:func:`rlrun.orchestrator.evaluation.evaluate_weights`); the ``rlrun eval``
command joins the two. The spec is the one the run's last attempt started with (``<run_dir>/spec.json``, written
by the orchestrator), the weights those of the checkpoint's trainer part (step 0: the model the run started
from). Nothing is written into the run directory but the server's log (``logs/eval-rollout.log``):
``eval.jsonl`` has one writer, the orchestrator.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from pathlib import Path

import yaml

from rlrun import roles
from rlrun.api.spec import RLRunSpec
from rlrun.checkpoint import latest_complete_checkpoint
from rlrun.launcher.processes import Child, free_port, wait_http_ok
from rlrun.rundir import RunDir


class EvalError(RuntimeError):
    """``rlrun eval`` cannot evaluate (the message says why and what to do)."""


def run_spec(run_dir: RunDir) -> RLRunSpec:
    """The spec the run's last attempt started with.

    Raises:
        EvalError: no ``spec.json`` (the run never started, or predates it).
    """
    if not run_dir.spec_file.is_file():
        raise EvalError(f"{run_dir.spec_file} does not exist: the run never started an orchestrator here")
    return RLRunSpec.model_validate_json(run_dir.spec_file.read_text())


def checkpoint_step(run_dir: RunDir, step: int | None) -> int:
    """``step`` when its checkpoint is complete (0 is always there: the starting model), else the newest complete.

    Raises:
        EvalError: ``step`` has no complete checkpoint, or the run has none.
    """
    newest = latest_complete_checkpoint(run_dir)
    if step is None:
        if newest is None:
            raise EvalError(f"{run_dir.root} holds no complete checkpoint; --step 0 evaluates the starting model")
        return newest.step
    if step > 0 and not (run_dir.trainer_checkpoint(step) / "model.safetensors").is_file():
        raise EvalError(
            f"no checkpoint of step {step} in {run_dir.checkpoints} (newest complete: {newest and newest.step})"
        )
    return step


@contextlib.contextmanager
def eval_server(spec: RLRunSpec, run_dir: RunDir, cache_dir: Path | None, health_timeout_s: float = 300.0):
    """A rollout server for ``spec``'s model on a free port, for the duration of the ``with`` (yields its URL;
    its log: ``logs/eval-rollout.log``). ``$RLRUN_FAKE_ROLLOUT`` makes it the fake, as for ``rlrun local``.

    Raises:
        ChildDied, TimeoutError: the server exited or did not answer ``/health`` within ``health_timeout_s``.
    """
    with tempfile.TemporaryDirectory(prefix="rlrun-eval-") as tmp:
        manifest = Path(tmp) / "manifest.yaml"
        document = {"apiVersion": "rlrun.dev/v1alpha1", "kind": "RLRun", "metadata": {"name": "eval"}}
        manifest.write_text(yaml.safe_dump({**document, "spec": spec.model_dump(mode="json")}))
        port = free_port()
        run_dir.logs.mkdir(parents=True, exist_ok=True)
        cache = str(cache_dir) if cache_dir else None
        argv = roles.rollout_command(str(manifest), cache, "127.0.0.1", port, program=(sys.executable, "-m", "rlrun"))
        server = Child("eval-rollout", argv, run_dir.logs / "eval-rollout.log", env=dict(os.environ))
        try:
            wait_http_ok(f"http://127.0.0.1:{port}/health", server, health_timeout_s)
            yield f"http://127.0.0.1:{port}"
        finally:
            server.stop()
