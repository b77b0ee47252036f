"""``rlrun eval RUN_DIR [--step N]``: evaluate a saved checkpoint on held-out tasks, on a rollout server of its own.

The launcher's part: which spec and checkpoint (:func:`run_spec`, :func:`checkpoint_step`) and a rollout server
of its own (:func:`eval_server`: vLLM, or the fake with ``$RLRUN_FAKE_ROLLOUT``). The evaluation itself is the one
a run makes while it trains (:func:`rlrun.orchestrator.evaluation.evaluate_weights`);
:func:`evaluate_checkpoint` joins the two. The spec is the one the run's last attempt started with
(``<run_dir>/spec.json``, written by the orchestrator), the weights those of the checkpoint's trainer part (step 0: the
model the run started from). Nothing is written into the run directory but the server's log (``logs/eval-rollout.log``):
``eval.jsonl`` has one writer, the orchestrator.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from rich.table import Table

from rlrun import roles
from rlrun.adapter_format import ADAPTER_WEIGHTS_FILE
from rlrun.api.spec import RLRunSpec
from rlrun.checkpoint import WEIGHTS_FILE, latest_complete_checkpoint
from rlrun.launcher.processes import Child, wait_http_ok
from rlrun.net import free_port
from rlrun.rundir import RunDir, step_dirs


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


def weights_file(spec: RLRunSpec) -> str:
    """The file a trainer part of ``spec``'s run holds its weights in: the adapter's in a LoRA run
    (``spec.model.lora``), the model's otherwise."""
    return ADAPTER_WEIGHTS_FILE if spec.model.lora is not None else WEIGHTS_FILE


def checkpoint_step(run_dir: RunDir, step: int | None, weights: str = WEIGHTS_FILE) -> int:
    """``step`` when its checkpoint is complete (0 is always there: the starting model), else the newest complete.
    ``weights``: the file a trainer part holds its weights in (:func:`weights_file`).

    Raises:
        EvalError: ``step`` has no complete checkpoint, or the run has none.
    """
    newest = latest_complete_checkpoint(run_dir)
    if step is None:
        if newest is None:
            raise EvalError(f"{run_dir.root} holds no complete checkpoint; --step 0 evaluates the starting model")
        return newest.step
    if step > 0 and step not in evaluable_steps(run_dir, weights):
        steps = ", ".join(str(s) for s in evaluable_steps(run_dir, weights))
        raise EvalError(
            f"no checkpoint of step {step} in {run_dir.checkpoints}; --step can be {steps} (0: the starting model)"
        )
    return step


def evaluable_steps(run_dir: RunDir, weights: str = WEIGHTS_FILE) -> list[int]:
    """The steps ``rlrun eval --step`` can evaluate, ascending: 0 (the starting model) and every step whose trainer
    part holds its weights (``weights``: ``model.safetensors``, or a LoRA run's ``adapter_model.safetensors``)."""
    return [0] + [
        n
        for n in sorted(step_dirs(run_dir.checkpoints))
        if n > 0 and (run_dir.trainer_checkpoint(n) / weights).is_file()
    ]


def evaluate_checkpoint(
    run_dir: Path, step: int | None, cache_dir: Path | None, evaluate: Callable[..., Any], **overrides: int
) -> dict:
    """What ``rlrun eval RUN_DIR [--step N]`` does: the run's spec (:func:`run_spec`), the checkpoint
    (:func:`checkpoint_step`), a rollout server of its own (:func:`eval_server`), and ``evaluate`` — the evaluation
    a run makes, :func:`rlrun.orchestrator.evaluation.evaluate_weights`, which the command passes (a process
    package imports no other) — with ``overrides`` (``tasks``, ``samples_per_task``); returns its ``eval.jsonl`` line.

    Raises:
        EvalError: no spec or checkpoint, the server failed or timed out, weights that do not fit, an HTTP error.
        whatever ``evaluate`` raises of its own (``RolloutError``).
    """
    import asyncio

    import httpx

    from rlrun.errors import WeightsError
    from rlrun.launcher.processes import ChildDied
    from rlrun.model.resolve import resolve_model

    try:
        rd = RunDir(run_dir)
        spec = run_spec(rd)
        step = checkpoint_step(rd, step, weights_file(spec))
        model_path = resolve_model(spec.model, cache_dir, envs=spec.envs)
        weights = rd.trainer_checkpoint(step) if step > 0 else None
        with eval_server(spec, rd, cache_dir) as url, tempfile.TemporaryDirectory() as tmp:
            return asyncio.run(evaluate(url, spec, model_path, weights, step, Path(tmp) / "eval.jsonl", **overrides))
    except (ChildDied, TimeoutError, WeightsError, httpx.HTTPError) as exc:
        raise EvalError(str(exc)) from exc


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


def eval_table(run_dir: Path, line: dict[str, Any]) -> Table:
    """``rlrun eval``'s table of an evaluation ``line`` (one line of ``eval.jsonl``,
    :func:`rlrun.orchestrator.evaluation.evaluate_weights`): greedy solved, greedy reward, sampled reward and
    pass@k (k: its ``samples_per_task``) per env, then over all envs; each a fraction or mean reward, 3 decimals."""
    table = Table(title=f"{run_dir}: policy {line['policy_version']}, {line['tasks']} held-out tasks")
    for col in ("env", "greedy solved", "greedy reward", "sampled reward", f"pass@{line['samples_per_task']}"):
        table.add_column(col, justify="right")
    for name, e in [*line["per_env"].items(), ("all", line)]:
        cells = (e["greedy_solved"], e["greedy_reward"], e["sampled_reward"], e["pass_at_k"])
        table.add_row(name, *(f"{v:.3f}" for v in cells))
    return table
