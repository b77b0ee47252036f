"""``rlrun local``: run a manifest's rollout server(s), trainer and orchestrator on this machine.

The launcher builds (or finds cached) the model, starts ``rollout.replicas`` vLLM
servers and waits until they are healthy, then starts the trainer and the
orchestrator — each the same ``rlrun`` command a pod runs — with their logs in
``<run_dir>/logs/``. It shows live progress from ``metrics.jsonl`` and ends with a
table of reward per step and the ledger check. If any child dies, or on Ctrl-C,
every child is stopped and the launcher exits non-zero, naming the dead child and
showing its last log lines.

``--preempt-at-step K`` exercises the preemption protocol: just after the trainer
finishes step K, while new rollouts are in flight, the launcher asks the orchestrator
to pause (``POST /pause``: snapshot written), gives the trainer its notice (SIGTERM: it
finishes its step and saves a checkpoint of the step it has, which the paused orchestrator
completes with its pause snapshot; :data:`TRAINER_GRACE_S`, then SIGKILL), SIGKILLs every
process, restarts them all with ``--resume`` as the next attempt, prints what the resumed
orchestrator restored, and carries on. No trainer step is recomputed unless the save missed
the grace period.

``--preempt-at-step K --only trainer`` loses only the trainer: SIGTERM to the trainer (it
saves on notice), then the same ``rlrun trainer … --resume`` with the **same** ``--attempt``
is started while the orchestrator and the rollout servers keep running (no pause: the
orchestrator keeps generating within ``max_off_policy_steps`` and ships again once the new
trainer trains). Every preemption is printed and recorded in ``<run_dir>/preemptions.jsonl``:
seconds from the notice to the next optimizer step, rollout server restarts, and (at the end)
the trainer steps recomputed over the run.

A K the run never reaches is told and ignored: K at or past the last
step, or at or before the step a ``--resume`` starts from, before anything starts; a run
that finishes before the pause lands, when it does. The orchestrator may exit at any
moment near the end, so no control-server call assumes it is still there: an exit 0
counts as finished (a resumed attempt's report is then read from its ledger), any other
exit as a dead child.

``--resume`` of a run whose newest complete checkpoint already holds the last step
says so and starts nothing.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import signal
import sys
import time
from pathlib import Path
from typing import Literal

import httpx
from rich.console import Console
from rich.live import Live
from rich.table import Table

from rlrun.api.control import TERMINATION_LOG_ENV, ExitReport, PauseResult, ResumeReport, StatusReport
from rlrun.api.spec import RLRun
from rlrun.checkpoint import latest_complete_checkpoint
from rlrun.launcher.preemption import (
    preemption_skip_reason,
    resume_line,
    resume_report_from_ledger,
    steps_recomputed,
)
from rlrun.launcher.processes import Child, ChildDied, free_port, wait_http_ok
from rlrun.launcher.progress import label_restored, progress_cells, read_metrics, reward_gain, summary_table
from rlrun.ledger import check_ledger
from rlrun.model.resolve import resolve_model
from rlrun.rundir import RunDir, read_attempt, step_dirs

#: Seconds between the trainer finishing step K and a simulated preemption (see ``_preempt_due``).
PREEMPT_DELAY_S = 0.3
#: Seconds an orchestrator whose control server stopped answering gets to exit before that counts as a failure.
EXIT_GRACE_S = 10.0
#: Grace period of the trainer's save on notice (SIGTERM → exit), seconds; then SIGKILL (a pod's default is 30).
TRAINER_GRACE_S = 30.0
#: Seconds a paused orchestrator gets to pair its snapshot with the part the trainer saved on notice.
PAIR_WAIT_S = 10.0
#: torchrun's wait between forwarding SIGTERM to its ranks and killing them (seconds; default 30; torch ≥ 2.12).
TORCHRUN_SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
#: Where a trainer under torchrun writes its exit report (in ``<run_dir>/logs/``; see ``_trainer_exit_code``).
TRAINER_EXIT_REPORT = "trainer-exit.json"


class LaunchError(RuntimeError):
    """The launcher cannot go on (the message says what failed and where to look); exit 1."""


class LocalLauncher:
    """Runs one manifest locally; :meth:`run` returns the process exit code."""

    #: Seconds an orchestrator whose control server stopped answering gets to exit (see ``EXIT_GRACE_S``).
    exit_grace_s = EXIT_GRACE_S

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
    ) -> None:
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
        self.preempt_at_step = preempt_at_step
        self.preempt_only = preempt_only
        self.trainer_grace_s = TRAINER_GRACE_S
        self.preemptions: list[PauseResult] = []
        #: one record per simulated preemption (both kinds), written to ``<run_dir>/preemptions.jsonl``
        self.preemption_records: list[dict] = []
        self.rollout_starts = 0
        self._next_step_watch: tuple[dict, int] | None = None  # (record, trainer_metrics offset) until it trains
        self.resume_reports: list[ResumeReport] = []
        self.control_token = secrets.token_urlsafe(24)
        self.control_url = ""
        self.attempt = 0
        self._last_step = 0
        self._trainer_done_at: float | None = None
        self._trainer_metrics_start = 0  # bytes of trainer_metrics.jsonl written before this launcher
        self._resumed_from: int | None = None  # the checkpoint step a --resume starts from
        self._preempt_skipped: str | None = None  # why --preempt-at-step did not happen
        self._generating: set[int] = set()  # attempts seen generating (see label_restored)

    def _rlrun(self, *args: str) -> list[str]:
        argv = [sys.executable, "-m", "rlrun", *args, str(self.manifest_path)]
        if self.cache_dir:
            argv += ["--cache-dir", str(self.cache_dir)]
        return argv

    def _start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Child:
        child = Child(name, argv, self.run_dir.logs / f"{name}.log", env=env)
        self.children.append(child)
        return child

    def _trainer_shape_problem(self) -> str | None:
        """Why the spec's trainer cannot run on this one machine (``trainer.nodes > 1``), or None."""
        nodes = self.spec.trainer.nodes
        if nodes > 1:
            return (
                f"trainer.nodes is {nodes}: rlrun local runs the trainer on this one machine; set trainer.nodes "
                "to 1 (trainer.processes_per_node ranks still run here) or run the manifest with the operator"
            )
        return None

    def _trainer_argv(self, *args: str) -> list[str]:
        """``rlrun trainer <args>``; with ``trainer.processes_per_node`` P > 1, under
        ``torchrun --standalone --nnodes 1 --nproc-per-node P --max-restarts 0 --no-python``: P
        data-parallel ranks on this machine (a failed rank fails the trainer; the launcher restarts
        nothing by itself)."""
        argv = self._rlrun("trainer", *args)
        procs = self.spec.trainer.processes_per_node
        if procs == 1:
            return argv
        rlrun = Path(sys.executable).parent / "rlrun"
        torchrun = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
            "--nproc-per-node", str(procs), "--max-restarts", "0", "--no-python",
        ]  # fmt: skip
        if rlrun.is_file():
            return [*torchrun, str(rlrun), *argv[3:]]  # argv[:3] is [python, -m, rlrun]
        return [*torchrun, *argv]  # no console script: torchrun runs "python -m rlrun …" as the command

    def _signal_trainer(self, trainer: Child, sig: int) -> None:
        """Give the trainer ``sig`` once. Under torchrun only torchrun gets it and forwards it to each
        rank (its ranks sit in sessions of their own); signalling the ranks as well would be their
        second signal, which means "exit now, skip the save"."""
        if self.spec.trainer.processes_per_node > 1:
            with contextlib.suppress(ProcessLookupError):
                os.kill(trainer.pid, sig)
        else:
            trainer.signal_group(sig)

    def _check_run_dir(self) -> str | None:
        if self.resume:
            return None
        if step_dirs(self.run_dir.checkpoints) or step_dirs(self.run_dir.rollouts):
            return (
                f"{self.run_dir.root} already holds a run; pass --resume to continue it, "
                "or --run-dir to start a new one"
            )
        return None

    def trainer_threads(self) -> int:
        """Torch threads for the trainer: ``$RLRUN_TRAINER_THREADS``, else the cores left after one per
        rollout server and one for the orchestrator (at least 1). Oversubscribing cores is costly:
        on 2 cores a training step took 2.0 s with 2 threads beside vLLM and 0.55 s with 1."""
        if os.environ.get("RLRUN_TRAINER_THREADS"):
            return int(os.environ["RLRUN_TRAINER_THREADS"])
        return max(1, (os.cpu_count() or 1) - self.spec.rollout.replicas - 1)

    def stop_all(self) -> None:
        """Stop every child (orchestrator first, rollout servers last)."""
        for child in reversed(self.children):
            child.stop()

    def _next_attempt(self, resume: bool) -> int:
        """Record and return the next attempt number (``<run_dir>/attempts.jsonl``, one line per start)."""
        path = self.run_dir.root / "attempts.jsonl"
        n = len(path.read_text().splitlines()) if path.exists() else 0
        with open(path, "a") as fh:
            fh.write(json.dumps({"attempt": n + 1, "resume": resume, "time": time.time()}) + "\n")
        return n + 1

    def _start_all(self, model_path: str, resume: bool) -> tuple[Child, Child]:
        """Start rollout servers (waiting until healthy), then the trainer and the orchestrator."""
        console = self.console
        self.attempt = self._next_attempt(resume)
        env = dict(os.environ)
        urls = []
        for i in range(self.spec.rollout.replicas):
            port = free_port()
            self._start(f"rollout-{i}", self._rlrun("rollout", "--port", str(port)), env)
            self.rollout_starts += 1
            urls.append(f"http://127.0.0.1:{port}")
        with console.status(f"starting {len(urls)} vLLM rollout server(s) (≈30 s on CPU)…"):
            for child, url in zip(self.children, urls, strict=True):
                waited = wait_http_ok(f"{url}/health", child, self.health_timeout_s)
                console.print(f"{child.name} healthy at {url} after {waited:.0f} s")
        common = self._common_args(resume)
        trainer = self._start_trainer(resume)
        self.children.append(trainer)
        rollout_args = [a for u in urls for a in ("--rollout-url", u)]
        self.control_url = f"http://127.0.0.1:{free_port()}"
        orch_env = {**env, "RLRUN_CONTROL_TOKEN": self.control_token}
        control = ["--control-port", self.control_url.rsplit(":", 1)[1]]
        orch = self._start("orchestrator", self._rlrun("orchestrator", *common, *rollout_args, *control), orch_env)
        return trainer, orch

    def _start_trainer(self, resume: bool) -> Child:
        """Start this attempt's trainer (:meth:`_trainer_command`, :meth:`_trainer_env`), its exit report
        cleared first: a report found there later is this process's own (:meth:`_trainer_exit_code`)."""
        self._trainer_exit_report_path().unlink(missing_ok=True)
        return Child("trainer", self._trainer_command(resume), self.run_dir.logs / "trainer.log", self._trainer_env())

    def _trainer_command(self, resume: bool) -> list[str]:
        """This attempt's trainer command, the same at its start and for a trainer-only restart: under
        torchrun with ``processes_per_node`` > 1 (:meth:`_trainer_argv`), so a restarted trainer keeps
        its rank count."""
        return self._trainer_argv(*self._common_args(resume))

    def _common_args(self, resume: bool) -> list[str]:
        """Options the trainer and orchestrator of this attempt share."""
        args = ["--run-dir", str(self.run_dir.root), "--max-steps", str(self.max_steps), "--attempt", str(self.attempt)]
        return [*args, "--resume"] if resume else args

    def _trainer_env(self) -> dict[str, str]:
        """The trainer's environment: its threads (:meth:`trainer_threads`) shared among its ranks, and,
        under torchrun, :data:`TORCHRUN_SHUTDOWN_TIMEOUT_ENV` set to :attr:`trainer_grace_s` (rounded up).

        torchrun forwards the notice (SIGTERM) to its ranks, waits its shutdown timeout for them to exit,
        then SIGKILLs them: 30 s by default, read from ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` since torch 2.12
        (``LaunchConfig.shutdown_timeout``; older versions always wait 30 s). Given the grace period, the
        ranks' save on notice is never cut short by torchrun before this launcher's own SIGKILL
        (:meth:`_notice_trainer`) — the same rule as the operator's trainer pods, whose timeout is the
        pod's ``terminationGracePeriodSeconds``."""
        procs = self.spec.trainer.processes_per_node
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, self.trainer_threads() // procs))}
        env[TERMINATION_LOG_ENV] = str(self._trainer_exit_report_path())  # see _trainer_exit_code
        if procs > 1:
            env[TORCHRUN_SHUTDOWN_TIMEOUT_ENV] = str(math.ceil(self.trainer_grace_s))
        return env

    def _trainer_exit_report_path(self) -> Path:
        return self.run_dir.logs / TRAINER_EXIT_REPORT

    def _trainer_exit_code(self, code: int | None) -> int | None:
        """The trainer's exit status as ``rlrun trainer`` gives it (see :mod:`rlrun.cli`).

        Under torchrun the status is torchrun's own, and torchrun exits 1 whenever it got SIGTERM
        (its ``SignalException``), after its ranks saved on notice and exited 143 as well; so there the
        outcome rank 0 wrote to its exit report (:data:`TRAINER_EXIT_REPORT`, ``$RLRUN_TERMINATION_LOG``,
        as the operator reads a pod's termination message) decides: ``interrupted`` is 143 (saved on
        notice), ``complete`` 0. One process: a trainer that wrote ``complete`` and was then killed by
        the notice (status −15: the signal landed before it could ignore SIGTERM to exit, see
        ``rlrun.cli._exiting``) finished the run, so that is 0 too. None (killed) and a status without
        a report stay as they are.
        """
        if code in (None, 0):
            return code
        try:
            report = ExitReport.model_validate_json(self._trainer_exit_report_path().read_text())
        except (OSError, ValueError):
            return code
        if report.outcome == "complete":
            return 0
        if report.outcome == "interrupted" and self.spec.trainer.processes_per_node > 1:
            return 128 + signal.SIGTERM
        return code

    def _newest_trainer_part(self) -> int | None:
        """The newest trainer part this attempt published (a save on notice, or a periodic one)."""
        parts = [
            n
            for n, p in step_dirs(self.run_dir.checkpoints).items()
            if (p / "trainer" / "progress.json").is_file() and read_attempt(p / "trainer") == self.attempt
        ]
        return max(parts, default=None)

    def _notice_trainer(self, trainer: Child) -> tuple[int | None, float]:
        """SIGTERM the trainer (its notice: it finishes its step and saves) and wait up to
        :attr:`trainer_grace_s` for it to exit, then SIGKILL it (the save missed its grace period).
        Returns its exit status as ``rlrun trainer`` gives it (:meth:`_trainer_exit_code`; None: killed)
        and the seconds it took."""
        t0 = time.monotonic()
        self._signal_trainer(trainer, signal.SIGTERM)
        deadline = t0 + self.trainer_grace_s
        while trainer.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        code = self._trainer_exit_code(trainer.poll())
        if code is None:
            self.console.print(
                f"[yellow]the trainer did not save within its {self.trainer_grace_s:.0f} s grace period: killed; "
                "the steps since its last checkpoint are retrained[/yellow]"
            )
        trainer.kill()  # reaps it (and anything it left)
        return code, time.monotonic() - t0

    def _control(self, method: str, path: str, timeout_s: float = 120.0) -> dict:
        """One request to the orchestrator's control server; the decoded JSON answer.

        Raises:
            httpx.HTTPError: unreachable, or an error status.
            ValueError: an answer that is not JSON.
        """
        headers = {"Authorization": f"Bearer {self.control_token}"}
        resp = httpx.request(method, f"{self.control_url}{path}", headers=headers, timeout=timeout_s)
        resp.raise_for_status()
        return resp.json()

    @staticmethod
    def _exits_cleanly(child: Child, within_s: float) -> bool:
        """True once ``child`` has exited 0, waiting up to ``within_s`` seconds; False while it runs on.

        Raises:
            ChildDied: it exited with another code.
        """
        deadline = time.monotonic() + within_s
        while True:
            code = child.poll()
            if code == 0:
                return True
            if code is not None:
                raise ChildDied(child, code)
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)

    def _preempt_due(self) -> bool:
        """True once the trainer has finished step ``preempt_at_step``, plus ``PREEMPT_DELAY_S``.

        Right after a trainer step the orchestrator loads the new weights and rolls out the
        batches they unlock, so groups are in flight and partly queued: the moment a node loss
        costs the most finished work, which is what the simulation is for. (Pausing right after
        a batch ships would often find an idle orchestrator waiting for the trainer.) Only steps
        trained since this launcher started count, not those of a run it resumes.
        """
        if self._trainer_done_at is None:
            rows, _ = read_metrics(self.run_dir.trainer_metrics, self._trainer_metrics_start)
            if any(r["step"] >= self.preempt_at_step for r in rows):
                self._trainer_done_at = time.monotonic()
            return False
        return time.monotonic() - self._trainer_done_at >= PREEMPT_DELAY_S

    def _pause(self, orch: Child) -> PauseResult | None:
        """``POST /pause``; None when the run finished before the pause landed (the orchestrator said
        ``done``, or exited 0 instead of answering).

        Raises:
            ChildDied: the orchestrator exited with an error.
            LaunchError: the pause failed while the orchestrator runs on.
        """
        with contextlib.suppress(httpx.HTTPError, ValueError):  # not answering: the pause below tells why
            if StatusReport.model_validate(self._control("GET", "/status", timeout_s=5)).phase == "done":
                return None
        try:
            return PauseResult.model_validate(self._control("POST", "/pause"))
        except (httpx.HTTPError, ValueError) as exc:
            if self._exits_cleanly(orch, self.exit_grace_s):
                return None
            raise LaunchError(
                f"the pause after trainer step {self.preempt_at_step} failed ({type(exc).__name__}: {exc}) "
                f"and the orchestrator runs on; see {orch.log_path}"
            ) from None

    def _await_resume_report(self, trainer: Child, orch: Child) -> tuple[ResumeReport | None, bool]:
        """What the resumed orchestrator restored (None: it resumed nothing, starting from step 0), and
        whether it had already exited 0 (the report then comes from its ledger).

        Raises:
            ChildDied: the trainer or the orchestrator exited with an error.
            LaunchError: no report within ``health_timeout_s``.
        """
        ledger = self.run_dir.root / "ledger"
        deadline = time.monotonic() + self.health_timeout_s
        while True:
            for child in (trainer, orch):
                if child.poll() not in (None, 0):
                    raise ChildDied(child, child.poll())
            if orch.poll() == 0:  # done before answering: its resume is in its ledger
                return resume_report_from_ledger(ledger, self.attempt), True
            try:
                status = StatusReport.model_validate(self._control("GET", "/status", timeout_s=5))
            except (httpx.HTTPError, ValueError):
                status = None  # not listening yet, or closing: the next turn tells
            if status is not None and (status.resume is not None or status.phase in ("running", "done")):
                return status.resume, False
            if time.monotonic() > deadline:
                raise LaunchError(
                    f"the resumed orchestrator did not report its resume within {self.health_timeout_s:.0f} s; "
                    f"see {orch.log_path}"
                )
            time.sleep(0.5)

    def _preempt(self, model_path: str, trainer: Child, orch: Child) -> tuple[Child, Child] | None:
        """Simulated preemption: pause through the control server, the trainer's notice (it saves, the
        paused orchestrator pairs), SIGKILL everything, restart with --resume; the new trainer and
        orchestrator, or None when the run finished before the pause."""
        console = self.console
        noticed_at = time.time()
        snap = self._pause(orch)
        finished = f"the run finished before the preemption after trainer step {self.preempt_at_step} landed"
        if snap is None or snap.run_complete:
            self._preempt_skipped = finished
            return None
        if snap.step is not None and snap.step >= self.max_steps and self._exits_cleanly(orch, self.exit_grace_s):
            # The pause completed the last checkpoint: nothing is left to preempt, and the orchestrator,
            # done, exits by itself.
            self._preempt_skipped = f"{finished} (the pause completed the last checkpoint, step {snap.step})"
            return None
        saved = (
            f"snapshot of step {snap.step} with {snap.queued_traces} queued traces, {snap.open_groups} open groups "
            f"({snap.finished_episodes_kept} finished episodes kept) and {snap.requested_groups} requested groups "
            f"at {snap.path}"
            if snap.step is not None
            else snap.note
        )
        console.print(f"[yellow]preemption after trainer step {self.preempt_at_step}:[/yellow] {saved}")
        code, took = self._notice_trainer(trainer)
        part = self._newest_trainer_part()
        if part is not None and snap.step is not None and part > snap.step:
            done = self.run_dir.orchestrator_checkpoint(part) / "progress.pt"
            deadline = time.monotonic() + PAIR_WAIT_S
            while not done.is_file() and time.monotonic() < deadline and orch.poll() is None:
                time.sleep(0.05)
            paired = (
                "paired with the pause snapshot" if done.is_file() else "NOT paired (the steps after are retrained)"
            )
            console.print(f"trainer saved checkpoint step {part} on notice in {took:.1f} s (exit {code}); {paired}")
        else:
            console.print(
                f"trainer stopped on notice in {took:.1f} s (exit {code}); its newest part is the pause's step"
            )
        console.print("killing every process")
        for child in self.children:
            child.kill()
        self.children = []
        self.preemptions.append(snap)
        record = {
            "only": "all", "at_step": self.preempt_at_step, "notice_time": noticed_at, "pause_step": snap.step,
            "trainer_exit": code, "trainer_saved_step": part, "from_attempt": self.attempt,
        }  # fmt: skip
        self.preemption_records.append(record)
        trainer, orch = self._start_all(model_path, resume=True)
        self._watch_next_step(record)
        report, finished = self._await_resume_report(trainer, orch)
        if report is None:
            console.print(f"attempt {self.attempt} resumed nothing (no complete checkpoint): it started from step 0")
            return trainer, orch
        self.resume_reports.append(report)
        console.print(resume_line(report))
        if finished:
            console.print(f"attempt {self.attempt} finished the run right after resuming (report read from its ledger)")
        return trainer, orch

    def _preempt_trainer(self, trainer: Child) -> Child | None:
        """Simulated loss of the trainer alone: its notice (SIGTERM: it saves the step it has), then
        the same trainer command with ``--resume`` and the same attempt; the orchestrator and the
        rollout servers keep running. Returns the new trainer, or None when the old one had
        already finished the run (exit 0)."""
        noticed_at = time.time()
        index = self.children.index(trainer)
        code, took = self._notice_trainer(trainer)
        if code == 0:
            self._preempt_skipped = (
                f"the run finished before the trainer-only preemption after step {self.preempt_at_step}"
            )
            return None
        if code not in (None, 128 + signal.SIGTERM):
            raise ChildDied(trainer, code)
        part = self._newest_trainer_part()
        self.console.print(
            f"[yellow]trainer-only preemption after trainer step {self.preempt_at_step}:[/yellow] SIGTERM → the "
            f"trainer exited ({code}) in {took:.1f} s, its newest checkpoint step {part}; restarting only the trainer "
            f"with --resume (attempt {self.attempt}); the orchestrator and "
            f"{self.spec.rollout.replicas} rollout server(s) keep running"
        )
        new = self._start_trainer(resume=True)
        self.children[index] = new
        record = {
            "only": "trainer", "at_step": self.preempt_at_step, "notice_time": noticed_at, "pause_step": None,
            "trainer_exit": code, "trainer_saved_step": part, "from_attempt": self.attempt,
        }  # fmt: skip
        self.preemption_records.append(record)
        self._watch_next_step(record)
        return new

    def _watch_next_step(self, record: dict) -> None:
        """Note the time of the first optimizer step after this point into ``record`` (``_check_next_step``)."""
        try:
            offset = self.run_dir.trainer_metrics.stat().st_size
        except FileNotFoundError:
            offset = 0
        self._next_step_watch = (record, offset)

    def _check_next_step(self) -> None:
        if self._next_step_watch is None:
            return
        record, offset = self._next_step_watch
        rows, _ = read_metrics(self.run_dir.trainer_metrics, offset)
        if not rows:
            return
        self._next_step_watch = None
        record["next_step"] = rows[0]["step"]
        record["notice_to_next_step_s"] = round(rows[0]["time"] - record["notice_time"], 2)
        how = "only the trainer restarted" if record["only"] == "trainer" else "every process restarted"
        self.console.print(
            f"{how}: notice → next optimizer step (step {rows[0]['step']}) in {record['notice_to_next_step_s']:.1f} s"
        )

    def _already_complete(self) -> str | None:
        """With ``--resume``: the sentence saying the run is already complete, when the newest complete
        checkpoint holds the last step (nothing to start); else None, and the checkpoint a resume
        starts from is noted for :func:`preemption_skip_reason`."""
        if not self.resume:
            return None
        ckpt = latest_complete_checkpoint(self.run_dir)
        self._resumed_from = ckpt.step if ckpt is not None else None
        if ckpt is None or ckpt.step < self.max_steps:
            return None
        return (
            f"{self.run_dir.root} is already complete: its newest complete checkpoint, step {ckpt.step} "
            f"({self.run_dir.checkpoint(ckpt.step)}), holds {ckpt.step} trained steps and the run's last step is "
            f"{self.max_steps}; nothing to resume, no process started (a larger --max-steps trains further)"
        )

    def run(self) -> int:
        """Start everything, show progress, stop everything; returns 0 on success."""
        console = self.console
        problem = self._trainer_shape_problem() or self._check_run_dir()
        if problem:
            console.print(f"[red]error:[/red] {problem}")
            return 2
        complete = self._already_complete()
        if complete:
            console.print(complete)
            return 0
        if self.preempt_at_step:
            skip = preemption_skip_reason(self.preempt_at_step, self.max_steps, self._resumed_from)
            if skip:
                console.print(f"[yellow]{skip}; running without a preemption[/yellow]")
                self._preempt_skipped = skip
        self.run_dir.ensure()
        with contextlib.suppress(FileNotFoundError):
            self._trainer_metrics_start = self.run_dir.trainer_metrics.stat().st_size
        t_start = time.monotonic()
        try:
            with console.status("preparing the model (built once, then cached)…"):
                model_path = resolve_model(self.spec.model, self.cache_dir)
            console.print(f"model: {model_path}")
            trainer, orch = self._start_all(model_path, self.resume)
            rows = self._follow(trainer, orch, model_path)
        except ChildDied as exc:
            console.print(f"[red]error:[/red] {exc}; last lines of {exc.child.log_path}:")
            for line in exc.child.tail(20):
                console.print(f"  {line}", markup=False, highlight=False)
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
        console.print(summary_table(rows))
        gain = reward_gain(rows)
        if gain:
            console.print(
                f"mean reward, first 10 steps {gain[0]:.3f} → last 10 steps {gain[1]:.3f} ({gain[1] - gain[0]:+.3f})"
            )
        report = check_ledger(self.run_dir.root / "ledger")
        console.print(
            f"ledger: {'ok' if report.ok else 'VIOLATED'} — {report.finished} finished episodes: {report.trained} trained, "
            f"{report.rejected} rejected, {report.dropped_stale} dropped stale, {report.abandoned} abandoned, "
            f"{report.leftover} left over; "
            f"{report.rolled_back} rolled back"
        )
        for problem in report.problems[:5]:
            console.print(f"  [red]{problem}[/red]")
        if self.preemption_records:
            self._record_preemptions()
        console.print(
            f"done: {len(rows)} steps in {time.monotonic() - t_start:.0f} s, {len(self.preemption_records)} "
            f"preemption(s); run directory {self.run_dir.root}"
        )
        return 0 if report.ok else 1

    def _record_preemptions(self) -> None:
        """Print and append to ``<run_dir>/preemptions.jsonl`` what the preemptions cost."""
        recomputed = steps_recomputed(self.run_dir.root / "ledger")
        restarts = self.rollout_starts - self.spec.rollout.replicas
        with open(self.run_dir.root / "preemptions.jsonl", "a") as fh:
            for record in self.preemption_records:
                record.update(steps_recomputed=recomputed, rollout_restarts=restarts)
                fh.write(json.dumps(record) + "\n")
        self.console.print(f"trainer steps recomputed: {recomputed}; rollout server restarts: {restarts}")

    def _progress(self, rows: list[dict], t0: float) -> Table:
        table = Table.grid(padding=(0, 2))
        table.add_row(*progress_cells(rows[-1] if rows else {}, self.max_steps, time.monotonic() - t0))
        return table

    def _follow(self, trainer: Child, orch: Child, model_path: str) -> list[dict]:
        rows: list[dict] = []
        offset = 0
        t0 = time.monotonic()
        # On a terminal the progress line updates in place; in a log (CI), one line every ~5% of the run.
        every = max(1, self.max_steps // 20)
        live = Live(self._progress(rows, t0), console=self.console, refresh_per_second=4, transient=False)

        def take_new() -> None:
            nonlocal offset
            new, offset = read_metrics(self.run_dir.metrics, offset)
            label_restored(new, self._generating)
            rows.extend(new)
            if rows:
                self._last_step = rows[-1]["step"]
            if self.console.is_terminal:
                live.update(self._progress(rows, t0))
                return
            for row in new:
                if row["step"] % every == 0 or row["step"] == self.max_steps or row["restored"]:
                    cells = progress_cells(row, self.max_steps, time.monotonic() - t0)
                    self.console.print("  ".join(cells), markup=False)

        with live if self.console.is_terminal else contextlib.nullcontext():
            while True:
                take_new()
                self._check_next_step()
                pending = self.preempt_at_step and not self.preemption_records and not self._preempt_skipped
                if pending and self.preempt_only == "trainer" and self._preempt_due():
                    new_trainer = self._preempt_trainer(trainer)
                    if new_trainer is not None:
                        trainer = new_trainer
                    else:
                        take_new()
                        self.console.print(f"[yellow]{self._preempt_skipped}: no preemption[/yellow]")
                    continue
                if pending and self._preempt_due():
                    restarted = self._preempt(model_path, trainer, orch)
                    if restarted is not None:
                        trainer, orch = restarted
                    else:  # its last steps first, then why there was no preemption
                        take_new()
                        self.console.print(f"[yellow]{self._preempt_skipped}: no preemption[/yellow]")
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
                    self._check_next_step()
                    if self.preempt_at_step and not self.preemption_records and not self._preempt_skipped:
                        self._preempt_skipped = (
                            f"the run finished before the preemption after trainer step {self.preempt_at_step}"
                        )
                        self.console.print(f"[yellow]{self._preempt_skipped}: no preemption[/yellow]")
                    latest = {r["step"]: r for r in rows}  # a step re-shipped after a resume: keep the last
                    return [latest[s] for s in sorted(latest)]
                time.sleep(0.25)
