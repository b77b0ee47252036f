"""``rlrun local``: run a manifest's rollout server(s), trainer and orchestrator as processes on this machine.

The launcher builds (or finds cached) the model, starts ``rollout.replicas`` rollout
servers and waits until they are healthy, then starts the trainer and the
orchestrator — each the same ``rlrun`` command a pod runs (:mod:`rlrun.roles`) — with their
logs in ``<run_dir>/logs/``. It shows live progress from ``metrics.jsonl`` and ends with a
table of reward per step and the ledger check. If any child dies, or on Ctrl-C,
every child is stopped and the launcher exits non-zero, naming the dead child and
showing its last log lines.

``--preempt-at-step K [--only trainer]`` runs a preemption drill (:mod:`.preemption`). The
orchestrator may exit at any moment near the end, so no control-server call assumes it is still
there: an exit 0 counts as finished, any other exit as a dead child.

``--resume`` of a run whose newest complete checkpoint already holds the last step
says so and starts nothing.

The trainer's grace period (SIGTERM → SIGKILL) is the spec's
``preemption.termination_grace_period_seconds``, as its pod's would be.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.table import Table

from rlrun import roles
from rlrun.api.control import TERMINATION_LOG_ENV
from rlrun.api.spec import RLRun, RLRunSpec
from rlrun.errors import classify_error
from rlrun.launcher import processes
from rlrun.launcher.preemption import LaunchError, PreemptionDrill, preemption_skip_reason
from rlrun.launcher.preflight import (
    already_complete,
    resume_mismatch,
    resume_step,
    run_dir_problem,
    trainer_shape_problem,
    versions_problem,
)
from rlrun.launcher.processes import Child, ChildDied, death_report, role_exit_code, wait_http_ok
from rlrun.launcher.progress import (
    Waiting,
    done_line,
    eval_cell,
    eval_dropped_line,
    label_restored,
    model_line,
    print_summary,
    progress_cells,
    tracker_plan,
)
from rlrun.model.build_progress import build_progress
from rlrun.model.resolve import resolve_model
from rlrun.net import free_port
from rlrun.rundir import RunDir, read_metrics

#: ``python -m rlrun``: each role runs with this launcher's interpreter.
RLRUN = (sys.executable, "-m", "rlrun")
#: ``python -m torch.distributed.run``: torchrun with this launcher's interpreter.
TORCHRUN = (sys.executable, "-m", "torch.distributed.run")
#: Seconds without a progress line after which a log (not a terminal) gets one anyway.
HEARTBEAT_S = 10.0
#: Where a trainer under torchrun writes its exit report (in ``<run_dir>/logs/``; see
#: :meth:`LocalLauncher.notice_trainer`).
TRAINER_EXIT_REPORT = "trainer-exit.json"


class LocalLauncher:
    """Runs one manifest locally; :meth:`run` returns the process exit code.

    Attributes:
        drill: the ``--preempt-at-step`` drill (None without one).
        trainer_grace_s: seconds the trainer gets from its notice (SIGTERM) to its exit before SIGKILL.
        trainer_metrics_start: bytes of ``trainer_metrics.jsonl`` written before this launcher started.
        check_model: ``check_model(spec, model_path)``, before any process starts: a permanent error refuses the run.
    """

    def __init__(
        self,
        manifest_path: Path,
        run: RLRun,
        run_dir: Path,
        max_steps: int | None = None,
        resume: bool = False,
        cache_dir: Path | None = None,
        console: Console | None = None,
        health_timeout_s: float = 600.0,
        preempt_at_step: int | None = None,
        preempt_only: Literal["all", "trainer"] = "all",
        check_model: Callable[[RLRunSpec, str], None] = lambda spec, model_path: None,
    ) -> None:
        self.check_model = check_model
        self.manifest_path = Path(manifest_path).absolute()
        self.manifest = run
        self.spec = run.spec
        self.run_dir = RunDir(run_dir)
        self.max_steps = max_steps or self.spec.max_steps
        self.resume = resume
        self.cache_dir = cache_dir
        self.console = console or Console(soft_wrap=True)  # long paths stay on one line in logs
        self.health_timeout_s = health_timeout_s
        self.children: list[Child] = []
        self.drill = PreemptionDrill(self, preempt_at_step, preempt_only) if preempt_at_step else None
        self.trainer_grace_s = float(self.spec.preemption.termination_grace_period_seconds)
        self.rollout_starts = 0
        self.control_token = secrets.token_urlsafe(24)
        self.control_url = ""
        self.trainer_metrics_url = ""
        self.attempt = 0
        self.trainer_metrics_start = 0
        self._resumed_from: int | None = None  # the checkpoint step a --resume starts from
        self._generating: set[int] = set()  # attempts seen generating (see label_restored)

    # -- what each role runs (rlrun.roles), with this machine's paths and ports ------------------------

    def _paths(self) -> tuple[str, str, str | None]:
        return str(self.manifest_path), str(self.run_dir.root), str(self.cache_dir) if self.cache_dir else None

    def _rollout_command(self, port: int) -> list[str]:
        manifest, _, cache = self._paths()
        return roles.rollout_command(manifest, cache, "127.0.0.1", port, program=RLRUN)

    def _orchestrator_command(self, resume: bool, rollout_urls: list[str], control_port: int) -> list[str]:
        manifest, run_dir, cache = self._paths()
        return roles.orchestrator_command(
            manifest,
            run_dir,
            cache,
            self.attempt,
            resume=resume,
            max_steps=self.max_steps,
            rollout_urls=rollout_urls,
            control_port=control_port,
            program=RLRUN,
        )

    def _trainer_command(self, resume: bool) -> list[str]:
        """This attempt's trainer command, the same at its start and for a trainer-only restart. With
        ``trainer.processes_per_node`` P > 1, under ``torchrun --standalone --nnodes 1 --nproc-per-node P
        --max-restarts 0 --no-python``: P data-parallel ranks on this machine (a failed rank fails the
        trainer; the launcher restarts nothing by itself), each running the ``rlrun`` console script of
        this interpreter's environment (``python -m rlrun`` without one)."""
        manifest, run_dir, cache = self._paths()
        procs = self.spec.trainer.processes_per_node
        script = Path(sys.executable).parent / "rlrun"  # torchrun's --no-python runs a script
        program = (str(script),) if self._under_torchrun and script.is_file() else RLRUN
        command = roles.trainer_command(
            manifest, run_dir, cache, self.attempt, resume=resume, max_steps=self.max_steps, program=program
        )
        return roles.trainer_argv(command, procs, launcher=TORCHRUN)

    @property
    def _under_torchrun(self) -> bool:
        """Whether the trainer runs under torchrun (:func:`rlrun.roles.under_torchrun`; one node here)."""
        return roles.under_torchrun(self.spec.trainer.processes_per_node)

    def _trainer_env(self) -> dict[str, str]:
        """The trainer's environment: its threads (:meth:`trainer_threads`) shared among its ranks, its exit
        report's path, and under torchrun :func:`rlrun.roles.trainer_env` (torchrun waits the trainer's
        grace period before it SIGKILLs the ranks, as for the operator's trainer pods)."""
        procs = self.spec.trainer.processes_per_node
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, self.trainer_threads() // procs))}
        env[TERMINATION_LOG_ENV] = str(self._trainer_exit_report_path())  # see notice_trainer
        port = free_port()  # the trainer's /metrics and /healthz (rlrun.training.prometheus)
        env[roles.METRICS_PORT_ENV], self.trainer_metrics_url = str(port), f"http://127.0.0.1:{port}"
        return {**env, **roles.trainer_env(procs, self.trainer_grace_s)}

    def _trainer_exit_report_path(self) -> Path:
        return self.run_dir.logs / TRAINER_EXIT_REPORT

    def trainer_threads(self) -> int:
        """Torch threads for the trainer: ``$RLRUN_TRAINER_THREADS``, else the cores left after one per
        rollout server and one for the orchestrator (at least 1). Oversubscribing cores is costly:
        on 2 cores a training step took 2.0 s with 2 threads beside vLLM and 0.55 s with 1."""
        if os.environ.get("RLRUN_TRAINER_THREADS"):
            return int(os.environ["RLRUN_TRAINER_THREADS"])
        return max(1, (os.cpu_count() or 1) - self.spec.rollout.replicas - 1)

    # -- starting and stopping ------------------------------------------------------------------------

    def _start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Child:
        child = Child(name, argv, self.run_dir.logs / f"{name}.log", env, self.run_dir.logs / f"{name}-exit.json")
        self.children.append(child)
        return child

    def _next_attempt(self, resume: bool) -> int:
        """Record and return the next attempt number (``<run_dir>/attempts.jsonl``, one line per start)."""
        path = self.run_dir.root / "attempts.jsonl"
        n = len(path.read_text().splitlines()) if path.exists() else 0
        with open(path, "a") as fh:
            fh.write(json.dumps({"attempt": n + 1, "resume": resume, "time": time.time()}) + "\n")
        return n + 1

    def start_all(self, resume: bool) -> tuple[Child, Child]:
        """Start rollout servers (waiting until healthy), then the trainer and the orchestrator."""
        console = self.console
        self.attempt = self._next_attempt(resume)
        env = dict(os.environ)
        urls = []
        for i in range(self.spec.rollout.replicas):
            port = free_port()
            self._start(f"rollout-{i}", self._rollout_command(port), env)
            self.rollout_starts += 1
            urls.append(f"http://127.0.0.1:{port}")
        with Waiting(console, f"starting {len(urls)} rollout server(s) (vLLM: 30–60 s on 2 cores)") as waiting:
            for child, url in zip(self.children, urls, strict=True):
                waited = wait_http_ok(f"{url}/health", child, self.health_timeout_s, tick=waiting.tick)
                console.print(f"{child.name} healthy at {url} after {waited:.0f} s")
        trainer = self.start_trainer(resume)
        self.children.append(trainer)
        port = free_port()
        self.control_url = f"http://127.0.0.1:{port}"
        orch_env = {**env, roles.CONTROL_TOKEN_ENV: self.control_token}
        orch = self._start("orchestrator", self._orchestrator_command(resume, urls, port), orch_env)
        console.print(f"metrics (Prometheus): {self.control_url}/metrics, {self.trainer_metrics_url}/metrics")
        for line in tracker_plan(self.spec.logging, self.run_dir):
            console.print(line, markup=False)
        return trainer, orch

    def start_trainer(self, resume: bool) -> Child:
        """Start this attempt's trainer (:meth:`_trainer_command`, :meth:`_trainer_env`), its exit report
        cleared first: a report found there later is this process's own (:meth:`notice_trainer`)."""
        self._trainer_exit_report_path().unlink(missing_ok=True)
        return Child("trainer", self._trainer_command(resume), self.run_dir.logs / "trainer.log", self._trainer_env())

    def _signal_trainer(self, trainer: Child, sig: int) -> None:
        """Give the trainer ``sig`` once. Under torchrun only torchrun gets it and forwards it to each
        rank (its ranks sit in sessions of their own); signalling the ranks as well would be their
        second signal, which means "exit now, skip the save"."""
        if self._under_torchrun:
            with contextlib.suppress(ProcessLookupError):
                os.kill(trainer.pid, sig)
        else:
            trainer.signal_group(sig)

    def notice_trainer(self, trainer: Child) -> tuple[int | None, float]:
        """SIGTERM the trainer (its notice: it finishes its step and saves) and wait up to
        :attr:`trainer_grace_s` for it to exit, then SIGKILL it (the save missed its grace period).
        Returns its exit status as ``rlrun trainer`` gives it (:func:`~rlrun.launcher.processes.role_exit_code`;
        None: killed) and the seconds it took."""
        t0 = time.monotonic()
        self._signal_trainer(trainer, signal.SIGTERM)
        deadline = t0 + self.trainer_grace_s
        while trainer.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        code = role_exit_code(trainer.poll(), self._trainer_exit_report_path(), self._under_torchrun)
        if code is None:
            self.console.print(
                f"[yellow]the trainer did not save within its {self.trainer_grace_s:.0f} s grace period: killed; "
                "the steps since its last checkpoint are retrained[/yellow]"
            )
        trainer.kill()  # reaps it (and anything it left)
        return code, time.monotonic() - t0

    def stop_all(self) -> None:
        """Stop every child together (:func:`~rlrun.launcher.processes.stop_together`): a paused orchestrator pairs the
        trainer's save on notice before it exits."""
        processes.stop_together(self.children)

    # -- the run --------------------------------------------------------------------------------------

    def run(self) -> int:
        """Start everything, show progress, stop everything; returns 0 on success."""
        console = self.console
        # first: the checkpoint a --resume starts from (the preemption drill and the resume check need it)
        self._resumed_from = resume_step(self.run_dir) if self.resume else None
        complete = self.resume and already_complete(self.run_dir, self._resumed_from, self.max_steps)
        problem = versions_problem(roles.fake_rollout(os.environ)) or trainer_shape_problem(self.spec)
        problem = problem or (not self.resume and run_dir_problem(self.run_dir))
        problem = problem or (not complete and resume_mismatch(self.run_dir, self.spec, self._resumed_from))
        if problem:
            console.print(f"[red]error:[/red] {escape(problem)}")
            return 2
        if complete:
            console.print(complete)
            return 0
        if self.drill is not None:
            skip = preemption_skip_reason(self.drill.at_step, self.max_steps, self._resumed_from)
            if skip:
                console.print(f"[yellow]{skip}; running without a preemption[/yellow]")
                self.drill.skipped = skip
        self.run_dir.ensure()
        with contextlib.suppress(FileNotFoundError):
            self.trainer_metrics_start = self.run_dir.trainer_metrics.stat().st_size
        t_start = time.monotonic()
        try:
            try:
                progress = build_progress(console)  # a build shows its steps; a cached model is found at once
                model_path = resolve_model(self.spec.model, self.cache_dir, envs=self.spec.envs, progress=progress)
                self.check_model(self.spec, model_path)
            except Exception as exc:  # what this manifest cannot have (permanent): said once, before any process
                if not classify_error(exc)[0]:
                    raise
                console.print(f"[red]error:[/red] {escape(str(exc))}")
                return 2
            console.print(model_line(model_path, self.spec.model.lora), markup=False)
            trainer, orch = self.start_all(self.resume)
            rows = self._follow(trainer, orch)
        except ChildDied as exc:
            for line in death_report(exc):  # a permanent error: its message alone; else the log's last lines
                console.print(line)
            self.stop_all()
            return 1
        except (LaunchError, TimeoutError) as exc:
            console.print(f"[red]error:[/red] {exc}")
            self.stop_all()
            return 1
        except KeyboardInterrupt:
            console.print("[yellow]interrupted; stopping every process…[/yellow]")
            self.stop_all()
            return 130
        except BaseException:
            self.stop_all()
            raise
        self.stop_all()
        report = print_summary(console, self.run_dir, rows, self.spec.model.lora)
        preemptions = self.drill.records if self.drill is not None else []
        if preemptions:
            self.drill.record(rollout_restarts=self.rollout_starts - self.spec.rollout.replicas)
        console.print(done_line(len(rows), time.monotonic() - t_start, len(preemptions), self.run_dir))
        return 0 if report.ok else 1

    def _progress(self, rows: list[dict], evaluations: list[dict], t0: float, trained: list[dict]) -> Table:
        table = Table.grid(padding=(0, 2))
        cells = progress_cells(
            rows[-1] if rows else {}, self.max_steps, time.monotonic() - t0, trained[-1] if trained else None
        )
        evaluated = eval_cell(evaluations, rows[-1] if rows else None)
        table.add_row(*cells, *([evaluated] if evaluated else []))
        return table

    def _follow(self, trainer: Child, orch: Child) -> list[dict]:
        """Show progress until the trainer and the orchestrator have both exited 0 (running the drill when it
        is due); every step's last metrics line, in step order.

        Raises:
            ChildDied: a child exited with an error (or any rollout server exited).
        """
        rows: list[dict] = []
        offset = 0
        evaluations, eval_offset = read_metrics(self.run_dir.evaluations)  # an earlier attempt's: not shown again
        trained, trained_offset = read_metrics(self.run_dir.trainer_metrics)
        t0 = time.monotonic()
        drill = self.drill
        # On a terminal the progress line updates in place; in a log (CI), one line every ~5% of the run, and one
        # after HEARTBEAT_S without any (the start, an evaluation round, a slow step: never a silent minute).
        every = max(1, self.max_steps // 20)
        last_line = time.monotonic()
        live = Live(self._progress(rows, evaluations, t0, trained), console=self.console, refresh_per_second=4)

        def take_new() -> None:
            nonlocal offset, eval_offset, trained_offset, last_line
            new, offset = read_metrics(self.run_dir.metrics, offset)
            lines, trained_offset = read_metrics(self.run_dir.trainer_metrics, trained_offset)
            trained[:] = trained[-1:] + lines  # the newest, and the lines read now (a resume reads its history)
            label_restored(new, self._generating)
            dropped = [eval_dropped_line(a, b) for a, b in zip((rows or [{}])[-1:] + new, new, strict=False)]
            rows.extend(new)
            landed, eval_offset = read_metrics(self.run_dir.evaluations, eval_offset)
            evaluations.extend(landed)
            if self.console.is_terminal:
                live.update(self._progress(rows, evaluations, t0, trained))
                return
            for e in landed:  # each evaluation once, as it lands
                self.console.print(eval_cell([e]), markup=False)
                last_line = time.monotonic()
            for line in filter(None, dropped):  # a dropped round, as the step after it lands
                self.console.print(line, markup=False)
            latest = trained[-1] if trained else None
            by_step = {t["step"]: t for t in trained if "step" in t}
            for row in new:
                if row["step"] % every == 0 or row["step"] == self.max_steps or row["restored"]:
                    cells = progress_cells(row, self.max_steps, time.monotonic() - t0, by_step.get(row["step"], latest))
                    self.console.print("  ".join(cells), markup=False)
                    last_line = time.monotonic()
            if time.monotonic() - last_line >= HEARTBEAT_S:
                cells = progress_cells(rows[-1] if rows else {}, self.max_steps, time.monotonic() - t0, latest)
                self.console.print("  ".join(cells), markup=False)
                last_line = time.monotonic()

        with live if self.console.is_terminal else contextlib.nullcontext():
            while True:
                take_new()
                if drill is not None:
                    drill.check_next_step()
                if drill is not None and drill.pending and drill.due():
                    if drill.only == "trainer":
                        new_trainer = drill.preempt_trainer(trainer)
                        if new_trainer is not None:
                            trainer = new_trainer
                    else:
                        restarted = drill.preempt(trainer, orch)
                        if restarted is not None:
                            trainer, orch = restarted
                    if drill.skipped is not None:  # its last steps first, then why there was no preemption
                        take_new()
                        self.console.print(f"[yellow]{drill.skipped}: no preemption[/yellow]")
                    continue
                for child in self.children:
                    code = child.poll()
                    if code is None:
                        continue
                    if child in (trainer, orch) and code == 0:
                        continue
                    raise ChildDied(child, code)
                if trainer.poll() == 0 and orch.poll() == 0:
                    take_new()
                    if drill is not None:
                        drill.check_next_step()
                        if drill.pending:
                            drill.skipped = f"the run finished before the preemption after trainer step {drill.at_step}"
                            self.console.print(f"[yellow]{drill.skipped}: no preemption[/yellow]")
                    latest = {r["step"]: r for r in rows}  # a step re-shipped after a resume: keep the last
                    return [latest[s] for s in sorted(latest)]
                time.sleep(0.25)
