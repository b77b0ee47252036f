"""``rlrun`` command line: the typer commands, the local launcher's and the ones pods run.

Every command is a declaration: its options, then a call to the module that does the work. The role commands
(``rlrun orchestrator``, ``rlrun trainer``) exit with what :func:`rlrun.orchestrator.main.run_orchestrator` and
:func:`rlrun.training.main.run_trainer` return (exit statuses and the exit report: :mod:`rlrun.role_exit`);
``--run-uid`` (``$RLRUN_RUN_UID``, the operator passes the RLRun's uid) numbers attempts per run directory: see
:func:`rlrun.rundir.run_dir_attempt`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
from enum import Enum
from pathlib import Path

import typer

from rlrun.api.spec import RLRun, RLRunSpec
from rlrun.manifest import Checks, ManifestError, curriculum_warnings, load_manifest
from rlrun.model.resolve import init_builtin_model  # no torch: the builds import it when they run
from rlrun.roles import FAKE_ROLLOUT_ENV

log = logging.getLogger("rlrun.cli")

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Preemption-safe asynchronous RL for LLMs.")
model_app = typer.Typer(no_args_is_help=True, help="Build and inspect policy models.")
app.add_typer(model_app, name="model")

ManifestArg = typer.Argument(..., exists=True, dir_okay=False, help="RLRun manifest (YAML).")
RunDirOpt = typer.Option(..., "--run-dir", help="Run directory shared by all processes.")
MaxStepsOpt = typer.Option(None, "--max-steps", min=1, help="Stop after this step (default: spec.max_steps).")
ResumeOpt = typer.Option(False, "--resume", help="Continue from the newest complete checkpoint.")
CacheOpt = typer.Option(None, "--cache-dir", help="Model cache (default $RLRUN_CACHE_DIR or ~/.cache/rlrun).")
AttemptOpt = typer.Option(0, "--attempt", min=0, help="Attempt number (the launcher or operator counts restarts).")
RunUidOpt = typer.Option(
    None,
    "--run-uid",
    envvar="RLRUN_RUN_UID",
    help="The run's uid: number attempts per run directory (a run re-created over it continues the count).",
)


class PreemptOnly(str, Enum):
    """What ``rlrun local --preempt-at-step`` loses (``--only``)."""

    all = "all"
    trainer = "trainer"


def _setup_logging(role: str) -> None:
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s",
        stream=sys.stdout,
        force=True,
    )
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _check_versions(role: str, vllm: bool) -> None:
    """Refuse to start role ``role`` on a torch (and, when ``vllm``, a vLLM) outside rlrun's pins, before anything
    else of substance (:func:`rlrun.versions.check_installed`): one line in the log, the exit report, exit 78
    (:func:`rlrun.role_exit.refuse`)."""
    from rlrun.role_exit import refuse
    from rlrun.versions import UnsupportedVersion, check_installed

    try:
        check_installed(vllm=vllm)
    except UnsupportedVersion as exc:
        raise typer.Exit(refuse(role, exc)) from None


def _load(manifest: Path, checks: Checks = "full") -> RLRun:
    try:
        run = load_manifest(manifest, checks)
    except ManifestError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from None
    notes = run.spec.deprecations + (curriculum_warnings(run.spec) if checks == "full" else [])
    for line in notes:  # rlrun validate and local say it; the orchestrator logs it
        typer.echo(f"warning: {line}", err=True)
    return run


@app.command()
def validate(manifest: Path = ManifestArg) -> None:
    """Check a manifest; print the resolved spec as JSON or every invalid field."""
    run = _load(manifest)
    typer.echo(json.dumps(run.model_dump(mode="json"), indent=2))


def _check_model(spec: RLRunSpec, model_path: str) -> None:
    """What ``rlrun local`` checks against the model before any process starts: the roles' own refusals, run early
    (a dataset's prompts: :func:`rlrun.orchestrator.prompts.check_prompts`; LoRA target modules:
    :func:`rlrun.training.lora_targets.check_targets`)."""
    from rlrun.orchestrator.prompts import check_prompts

    check_prompts(spec, model_path)
    if spec.model.lora is not None:  # torch and transformers are imported for a LoRA run only
        from rlrun.training.lora_targets import check_targets

        check_targets(spec, model_path)


@app.command()
def local(
    manifest: Path = ManifestArg,
    run_dir: Path = typer.Option(None, "--run-dir", help="Run directory (default runs/<metadata.name>)."),
    max_steps: int = MaxStepsOpt,
    resume: bool = ResumeOpt,
    cache_dir: Path = CacheOpt,
    preempt_at_step: int = typer.Option(
        None,
        "--preempt-at-step",
        min=1,
        help="Simulate a preemption at this step: pause, the trainer's notice (it saves), SIGKILL all, resume.",
    ),
    only: PreemptOnly = typer.Option(
        PreemptOnly.all,
        "--only",
        help="What --preempt-at-step loses: all (every process restarts) or trainer (SIGTERM to the trainer, "
        "which saves; only the trainer restarts with --resume; orchestrator and rollout servers stay up).",
    ),
) -> None:
    """Run a manifest on this machine: rollout server(s), trainer and orchestrator as local processes."""
    from rlrun.launcher.local import LocalLauncher

    run = _load(manifest)
    if only is not PreemptOnly.all and preempt_at_step is None:
        typer.echo("error: --only needs --preempt-at-step", err=True)
        raise typer.Exit(2)
    launcher = LocalLauncher(
        manifest,
        run,
        run_dir=run_dir or Path("runs") / run.metadata.name,
        max_steps=max_steps,
        resume=resume,
        cache_dir=cache_dir,
        preempt_at_step=preempt_at_step,
        preempt_only=only.value,
        check_model=_check_model,
    )
    raise typer.Exit(launcher.run())


@app.command()
def rollout(
    manifest: Path = ManifestArg,
    host: str = typer.Option("127.0.0.1", help="Address to listen on."),
    port: int = typer.Option(8000, help="Port to listen on."),
    cache_dir: Path = CacheOpt,
    fake: bool = typer.Option(
        False,
        "--fake",
        envvar=FAKE_ROLLOUT_ENV,
        help="Serve rlrun's stand-in for vLLM (rlrun.rollout.fake) instead: the same HTTP API, answers that do "
        "not come from the model (the reverse-text answer with random errors). For tests and dry runs of "
        "everything but inference.",
    ),
    fake_samples_per_s: float = typer.Option(
        None,
        "--fake-samples-per-s",
        envvar="RLRUN_FAKE_ROLLOUT_SAMPLES_PER_S",
        min=0.1,
        help="With --fake: completions per second over all requests (default: instant).",
    ),
) -> None:
    """Start a vLLM rollout server for the manifest's model (replaces this process).

    Exits 78 at once, before vLLM starts, when the installed vLLM or torch is outside rlrun's pins (not with
    ``--fake``; with ``$RLRUN_ALLOW_UNSUPPORTED_VERSIONS=1``, a warning), with an exit report in
    ``$RLRUN_TERMINATION_LOG``.
    """
    from rlrun.model.resolve import resolve_model

    _setup_logging("rollout")
    if not fake:
        _check_versions("rollout", vllm=True)
    run = _load(manifest, checks="static")
    model = resolve_model(run.spec.model, cache_dir, envs=run.spec.envs)
    if fake:
        from rlrun.rollout.fake import model_eos_id, serve_fake_vllm

        rate = f"{fake_samples_per_s:g} samples/s" if fake_samples_per_s else "instant"
        log.info("rollout server: the fake (%s) for %s on %s:%d", rate, model, host, port)
        serve_fake_vllm(host, port, samples_per_s=fake_samples_per_s, eos_id=model_eos_id(model), seed=run.spec.seed)
        return
    from rlrun.rollout.server import serve

    log.info("rollout server: vLLM for %s on %s:%d", model, host, port)
    serve(run.spec, model, host, port)


@app.command()
def trainer(
    manifest: Path = ManifestArg,
    run_dir: Path = RunDirOpt,
    max_steps: int = MaxStepsOpt,
    resume: bool = ResumeOpt,
    cache_dir: Path = CacheOpt,
    attempt: int = AttemptOpt,
    run_uid: str = RunUidOpt,
) -> None:
    """Run the trainer process.

    Exits 0 once ``max_steps`` is trained; 143 on SIGTERM (130 on SIGINT) after the **save on
    notice**: the step being computed is finished, or the wait for the next batch abandoned, and a
    trainer checkpoint of the step it has is written (:meth:`Trainer.notice`); a second signal
    exits at once (every part is published by rename, so the previous complete checkpoint
    stands). 78 on a permanent error (invalid manifest, checkpoint of other settings, weights
    that do not fit the model; a torch outside rlrun's pins, refused before anything else),
    1 on any other error; each exit writes an exit report to ``$RLRUN_TERMINATION_LOG`` (see
    the module docstring).

    A trainer-only restart (the orchestrator and rollout servers keep running) starts the same
    command with ``--resume`` and the **same** ``--attempt`` and ``--run-uid``: see
    :mod:`rlrun.training.trainer`.

    Under ``torchrun`` (``WORLD_SIZE > 1``) every rank runs this command with the same arguments
    and joins the data-parallel group (:func:`rlrun.training.distributed.init_from_env`); rank 0
    alone publishes and writes the exit report. A notice (SIGTERM, which torchrun forwards to
    every rank) seen by any rank stops all of them at the same step boundary.
    """
    _setup_logging("trainer")
    _check_versions("trainer", vllm=False)  # before torch is imported
    from rlrun.training.main import run_trainer

    raise typer.Exit(run_trainer(manifest, run_dir, max_steps, resume, cache_dir, attempt, run_uid))


@app.command()
def orchestrator(
    manifest: Path = ManifestArg,
    run_dir: Path = RunDirOpt,
    rollout_url: list[str] = typer.Option(
        [], "--rollout-url", help="Base URL of a rollout server (repeatable; none: wait for PUT /rollout-endpoints)."
    ),
    max_steps: int = MaxStepsOpt,
    resume: bool = ResumeOpt,
    cache_dir: Path = CacheOpt,
    attempt: int = AttemptOpt,
    run_uid: str = RunUidOpt,
    control_host: str = typer.Option("127.0.0.1", help="Address of the control server."),
    control_port: int = typer.Option(
        None, help="Port of the control server (its bearer token comes from $RLRUN_CONTROL_TOKEN)."
    ),
) -> None:
    """Run the orchestrator process.

    Exits 0 when done (``complete``) or after a pause once SIGTERM arrives (``paused``), 1 when
    SIGTERM came and the snapshot could not be written (``interrupted``), 78 on a permanent
    error (invalid manifest, checkpoint of other settings, weights that do not fit the model),
    1 on any other error, 2 on bad options; each exit but the last writes an exit report to
    ``$RLRUN_TERMINATION_LOG`` (see the module docstring).
    """
    import os

    from rlrun.orchestrator.main import run_orchestrator
    from rlrun.roles import CONTROL_TOKEN_ENV

    _setup_logging("orchestrator")
    token = os.environ.get(CONTROL_TOKEN_ENV)
    if control_port is not None and not token:
        typer.echo("error: --control-port needs $RLRUN_CONTROL_TOKEN (the bearer token)", err=True)
        raise typer.Exit(2)
    if not rollout_url and control_port is None:
        typer.echo("error: give --rollout-url, or --control-port so the operator can send the endpoints", err=True)
        raise typer.Exit(2)
    code = run_orchestrator(
        manifest,
        run_dir,
        rollout_url,
        max_steps,
        resume,
        cache_dir,
        attempt,
        run_uid,
        control_host,
        control_port,
        token,
    )
    raise typer.Exit(code)


@app.command("eval")
def eval_(
    run_dir: Path = typer.Argument(..., exists=True, file_okay=False, help="Run directory."),
    step: int = typer.Option(
        None, "--step", min=0, help="Checkpoint step (default: the newest complete; 0: the starting model)."
    ),
    cache_dir: Path = CacheOpt,
    tasks: int = typer.Option(None, "--tasks", min=1, help="Held-out tasks per env (default: spec.evaluation.tasks)."),
    samples: int = typer.Option(
        None, "--samples-per-task", min=1, help="Sampled completions per task, k of pass@k (default: the spec's)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the evaluation as one JSON line."),
) -> None:
    """Evaluate a saved checkpoint on each env's held-out tasks (greedy and sampled), on a rollout server of its own."""
    from rlrun.launcher.evaluate import EvalError, eval_table, evaluate_checkpoint
    from rlrun.orchestrator.evaluation import evaluate_weights
    from rlrun.rollout.client import RolloutError

    _setup_logging("eval")
    overrides = {k: v for k, v in (("tasks", tasks), ("samples_per_task", samples)) if v is not None}
    try:
        line = evaluate_checkpoint(run_dir, step, cache_dir, evaluate_weights, **overrides)
    except (EvalError, RolloutError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    if as_json:
        typer.echo(json.dumps(line))
        return
    from rich.console import Console

    Console().print(eval_table(run_dir, line))


@app.command("operator")
def operator_(
    namespace: list[str] = typer.Option([], "--namespace", "-n", help="Namespace to watch (repeatable; none: all)."),
    health_port: int = typer.Option(8080, help="Port of GET /healthz (liveness)."),
    metrics_port: int = typer.Option(9090, help="Port of the Prometheus /metrics endpoint."),
    log_level: str = typer.Option("info", help="debug, info, warning or error."),
) -> None:
    """Run the Kubernetes operator: reconcile RLRun objects into pods and report their status."""
    try:
        from rlrun_operator.main import run_operator
    except ImportError as exc:
        typer.echo(f"error: the operator needs the 'operator' extra (pip install 'rlrun[operator]'): {exc}", err=True)
        raise typer.Exit(2) from None
    run_operator(namespace, health_port, metrics_port, log_level)


@app.command()
def crd(
    root: Path = typer.Option(Path("."), "--root", file_okay=False, help="Repository root to write into."),
    check: bool = typer.Option(False, "--check", help="Write nothing; exit 1 if the files differ."),
    stdout: bool = typer.Option(False, "--stdout", help="Print the CRD instead of writing files."),
) -> None:
    """Generate the RLRun CRD from the spec into crds/ and the Helm chart's crds/."""
    from rlrun.api.crd import render_crd, stale_crds, write_crds

    if stdout:
        typer.echo(render_crd(), nl=False)
        return
    if check:
        stale = stale_crds(root)
        if stale:
            typer.echo(f"out of date (run `rlrun crd`): {', '.join(map(str, stale))}", err=True)
            raise typer.Exit(1)
        typer.echo("CRDs up to date")
        return
    for path in write_crds(root):
        typer.echo(f"wrote {path}")


@app.command("versions")
def versions_(as_json: bool = typer.Option(False, "--json", help="Print JSON instead of text.")) -> None:
    """Print rlrun's version and the installed torch and vLLM beside the versions rlrun supports (its package's pins).
    Exit 1 when an installed one is outside them (a missing one is fine: the trainer's image has no vLLM), whatever
    $RLRUN_ALLOW_UNSUPPORTED_VERSIONS says; the image builds run it as their last check."""
    from rlrun.versions import PinsError, report

    try:
        found = report()
    except PinsError as exc:  # a packaging bug: said in one line, as a version outside the pins is
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    if as_json:
        typer.echo(json.dumps(found.to_dict(), indent=2))
    else:
        for line in found.lines():
            typer.echo(line)
    for line in found.problems:
        typer.echo(f"error: {line}", err=True)
    raise typer.Exit(0 if found.ok else 1)


@app.command("envs")
def list_envs(as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table.")) -> None:
    """List the envs a manifest can name: builtin ones, and those installed packages register (entry point group
    rlrun.envs). A manifest may also name any env by import path, package.module:attr."""
    from rich.console import Console
    from rich.table import Table

    from rlrun.envs import installed_envs

    found = sorted(installed_envs().values(), key=lambda e: (e.source != "builtin", e.name))
    if as_json:
        typer.echo(json.dumps([dataclasses.asdict(e) for e in found], indent=2))
        return
    table = Table("env", "from", "import path")
    for e in found:
        table.add_row(e.name, e.source, e.target)
    Console().print(table)
    typer.echo("Or name any env by import path: name: package.module:attr (docs/envs.md).")


ledger_app = typer.Typer(no_args_is_help=True, help="Inspect a run's ledger of episode fates.")
app.add_typer(ledger_app, name="ledger")


@ledger_app.command("check")
def ledger_check(run_dir: Path = typer.Argument(..., exists=True, file_okay=False, help="Run directory.")) -> None:
    """Prove invariant 1 on a run: no finished episode lost, none trained twice. Exit 1 on a violation."""
    from rlrun.ledger import check_ledger

    report = check_ledger(run_dir / "ledger")
    typer.echo(json.dumps(report.to_dict(), indent=2))
    raise typer.Exit(0 if report.ok else 1)


@model_app.command("init")
def model_init(
    out_dir: Path = typer.Argument(None, help="Directory to create (empty or absent); none: the model cache."),
    manifest: Path = typer.Option(None, "--manifest", "-m", exists=True, dir_okay=False, help="Build its model."),
    sft_steps: int = typer.Option(None, min=0, help="Warm-start steps (tiny: the most). Needs OUT_DIR."),
    cache_dir: Path = CacheOpt,
) -> None:
    """Build tiny-reverse, or the manifest's builtin model (tiny: for its envs), into OUT_DIR or the model cache."""
    _setup_logging("model")
    spec = _load(manifest).spec if manifest is not None else None
    try:
        report = init_builtin_model(spec, out_dir, sft_steps, cache_dir)
    except (ValueError, FileExistsError) as exc:  # what to change, said once (no envs' answers, a non-builtin model…)
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(json.dumps(report, indent=2))


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
