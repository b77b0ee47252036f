"""``rlrun`` command line: the local launcher and the per-role commands that pods run."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from pathlib import Path

import typer

from rlrun.api.spec import RLRun
from rlrun.manifest import ManifestError, load_manifest

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Preemption-safe asynchronous RL for LLMs.")
model_app = typer.Typer(no_args_is_help=True, help="Build and inspect policy models.")
app.add_typer(model_app, name="model")

ManifestArg = typer.Argument(..., exists=True, dir_okay=False, help="RLRun manifest (YAML).")
RunDirOpt = typer.Option(..., "--run-dir", help="Run directory shared by all processes.")
MaxStepsOpt = typer.Option(None, "--max-steps", min=1, help="Stop after this step (default: spec.max_steps).")
ResumeOpt = typer.Option(False, "--resume", help="Continue from the newest complete checkpoint.")
CacheOpt = typer.Option(None, "--cache-dir", help="Model cache (default $RLRUN_CACHE_DIR or ~/.cache/rlrun).")
AttemptOpt = typer.Option(0, "--attempt", min=0, help="Attempt number (the launcher or operator counts restarts).")


def _setup_logging(role: str) -> None:
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s",
        stream=sys.stdout,
        force=True,
    )
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _load(manifest: Path) -> RLRun:
    try:
        return load_manifest(manifest)
    except ManifestError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from None


@app.command()
def validate(manifest: Path = ManifestArg) -> None:
    """Check a manifest; print the resolved spec as JSON or every invalid field."""
    run = _load(manifest)
    typer.echo(json.dumps(run.model_dump(mode="json"), indent=2))


@app.command()
def local(
    manifest: Path = ManifestArg,
    run_dir: Path = typer.Option(None, "--run-dir", help="Run directory (default runs/<metadata.name>)."),
    max_steps: int = MaxStepsOpt,
    resume: bool = ResumeOpt,
    cache_dir: Path = CacheOpt,
    preempt_at_step: int = typer.Option(
        None, "--preempt-at-step", min=1, help="Simulate a preemption at this step: pause, SIGKILL all, resume."
    ),
) -> None:
    """Run a manifest on this machine: rollout server(s), trainer and orchestrator as local processes."""
    from rlrun.launcher.local import LocalLauncher

    run = _load(manifest)
    launcher = LocalLauncher(
        manifest, run, run_dir=run_dir or Path("runs") / run.metadata.name, max_steps=max_steps,
        resume=resume, cache_dir=cache_dir, preempt_at_step=preempt_at_step,
    )  # fmt: skip
    raise typer.Exit(launcher.run())


@app.command()
def rollout(
    manifest: Path = ManifestArg,
    host: str = typer.Option("127.0.0.1", help="Address to listen on."),
    port: int = typer.Option(8000, help="Port to listen on."),
    cache_dir: Path = CacheOpt,
) -> None:
    """Start a vLLM rollout server for the manifest's model (replaces this process)."""
    from rlrun.model.resolve import resolve_model
    from rlrun.rollout.server import serve

    _setup_logging("rollout")
    run = _load(manifest)
    serve(run.spec, resolve_model(run.spec.model, cache_dir), host, port)


@app.command()
def trainer(
    manifest: Path = ManifestArg,
    run_dir: Path = RunDirOpt,
    max_steps: int = MaxStepsOpt,
    resume: bool = ResumeOpt,
    cache_dir: Path = CacheOpt,
    attempt: int = AttemptOpt,
) -> None:
    """Run the trainer process."""
    from rlrun.model.resolve import resolve_model
    from rlrun.rundir import RunDir
    from rlrun.training.trainer import Trainer

    _setup_logging("trainer")
    run = _load(manifest)
    t = Trainer(run.spec, RunDir(run_dir), resolve_model(run.spec.model, cache_dir), max_steps, resume, attempt)
    t.run()


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
    control_host: str = typer.Option("127.0.0.1", help="Address of the control server."),
    control_port: int = typer.Option(
        None, help="Port of the control server (its bearer token comes from $RLRUN_CONTROL_TOKEN)."
    ),
) -> None:
    """Run the orchestrator process. Exits 0 when done, or after a pause once SIGTERM arrives."""
    import os

    from rlrun.model.resolve import resolve_model
    from rlrun.orchestrator.loop import Orchestrator
    from rlrun.rundir import RunDir

    _setup_logging("orchestrator")
    run = _load(manifest)
    token = os.environ.get("RLRUN_CONTROL_TOKEN")
    if control_port is not None and not token:
        typer.echo("error: --control-port needs $RLRUN_CONTROL_TOKEN (the bearer token)", err=True)
        raise typer.Exit(2)
    if not rollout_url and control_port is None:
        typer.echo("error: give --rollout-url, or --control-port so the operator can send the endpoints", err=True)
        raise typer.Exit(2)
    orch = Orchestrator(
        run.spec,
        RunDir(run_dir),
        rollout_url,
        resolve_model(run.spec.model, cache_dir),
        max_steps,
        resume,
        attempt=attempt,
        control_port=control_port,
        control_host=control_host,
        control_token=token,
    )
    asyncio.run(orch.run())
    if orch.termination.error is not None:  # SIGTERM came and the snapshot could not be written
        raise typer.Exit(1)


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
    from rlrun.api.crd import CHART_CRD_FILE, CRD_FILE, render_crd, write_crds

    if stdout:
        typer.echo(render_crd(), nl=False)
        return
    if check:
        text = render_crd()
        stale = [
            str(p) for p in (CRD_FILE, CHART_CRD_FILE) if not (root / p).is_file() or (root / p).read_text() != text
        ]
        if stale:
            typer.echo(f"out of date (run `rlrun crd`): {', '.join(stale)}", err=True)
            raise typer.Exit(1)
        typer.echo("CRDs up to date")
        return
    for path in write_crds(root):
        typer.echo(f"wrote {path}")


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
    out_dir: Path = typer.Argument(..., help="Directory to create (must not exist or be empty)."),
    sft_steps: int = typer.Option(None, min=0, help="Warm-start steps (default: the builtin recipe's)."),
) -> None:
    """Build the builtin tiny-reverse model (Qwen3, char tokenizer, SFT warm start) into OUT_DIR."""
    import dataclasses

    from rlrun.model.tiny import TinyModelRecipe, init_tiny_model

    _setup_logging("model")
    recipe = TinyModelRecipe() if sft_steps is None else dataclasses.replace(TinyModelRecipe(), sft_steps=sft_steps)
    report = init_tiny_model(out_dir, recipe)
    typer.echo(json.dumps(report, indent=2))


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
