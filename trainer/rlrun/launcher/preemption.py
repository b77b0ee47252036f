"""The simulated preemption of ``rlrun local --preempt-at-step K``: when it is due, the two drills, and
what they cost (``<run_dir>/preemptions.jsonl``).

``--preempt-at-step K`` (:meth:`PreemptionDrill.preempt`): just after the trainer finishes step K,
while new rollouts are in flight, the orchestrator is asked to pause (``POST /pause``: snapshot
written), the trainer gets its notice (SIGTERM: it finishes its step and saves a checkpoint of the
step it has, which the paused orchestrator completes with its pause snapshot; the spec's
``preemption.termination_grace_period_seconds``, then SIGKILL), every process is SIGKILLed and all
restart with ``--resume`` as the next attempt, which reports what it restored. No trainer step is
recomputed unless the save missed the grace period.

``--only trainer`` (:meth:`PreemptionDrill.preempt_trainer`) loses only the trainer: its notice, then
the same ``rlrun trainer … --resume`` with the **same** ``--attempt``, while the orchestrator and the
rollout servers keep running.

A K the run never reaches is told and ignored (:func:`preemption_skip_reason`, and a run that
finishes before the pause lands). A resumed orchestrator reports what it restored in ``GET /status``;
one that finishes at once exits before it is asked, and its report is read from the ``resumed`` event
of its ledger (:func:`resume_report_from_ledger`).
"""

from __future__ import annotations

import contextlib
import json
import signal
import time
from pathlib import Path
from typing import Literal, Protocol

from rich.console import Console

from rlrun.api.control import PauseResult, ResumeReport, StatusReport
from rlrun.api.control_client import ControlError, call_control
from rlrun.api.spec import RLRunSpec
from rlrun.launcher.processes import Child, ChildDied, exits_cleanly
from rlrun.ledger import LedgerEvent, ledger_file, read_ledger
from rlrun.rundir import RunDir, read_attempt, read_metrics, step_dirs

#: Seconds between the trainer finishing step K and a simulated preemption (see :meth:`PreemptionDrill.due`).
PREEMPT_DELAY_S = 0.3
#: Seconds an orchestrator whose control server stopped answering gets to exit 0 (the run finished)
#: before that counts as a failure.
EXIT_GRACE_S = 10.0
#: Seconds a paused orchestrator gets to pair its snapshot with the part the trainer saved on notice.
PAIR_WAIT_S = 10.0
#: Seconds ``POST /pause`` may take (the snapshot's write included).
PAUSE_TIMEOUT_S = 120.0


class LaunchError(RuntimeError):
    """The launcher cannot go on (the message says what failed and where to look); exit 1."""


def preemption_skip_reason(preempt_at_step: int, last_step: int, resumed_from: int | None) -> str | None:
    """Why a preemption at trainer step ``preempt_at_step`` cannot happen in a run that trains up to
    ``last_step`` starting after checkpoint ``resumed_from`` (None: from step 0); None when it can.

    After the last step there is nothing left to preempt; a step at or before the checkpoint a
    resume starts from is never trained again.
    """
    if preempt_at_step >= last_step:
        return (
            f"--preempt-at-step {preempt_at_step} is not before the run's last step {last_step}: "
            "nothing would be left to preempt"
        )
    if resumed_from is not None and preempt_at_step <= resumed_from:
        return (
            f"--preempt-at-step {preempt_at_step} is not after step {resumed_from}, "
            "the checkpoint this run resumes from: that step is not trained again"
        )
    return None


def steps_recomputed(ledger_root: Path) -> int:
    """Trainer steps trained more than once over every attempt (``trained`` events of the trainer
    ledgers, a torn line ignored): ``Σ_step (times trained − 1)``. A preemption noticed by the trainer
    recomputes none; an abrupt one recomputes the steps after the checkpoint resumed from."""
    counts: dict[int, int] = {}
    for (_, role), events in read_ledger(ledger_root).items():
        for ev in events:
            if role == "trainer" and ev.get("e") == LedgerEvent.TRAINED.value:
                counts[ev["step"]] = counts.get(ev["step"], 0) + 1
    return sum(n - 1 for n in counts.values())


def resume_report_from_ledger(ledger_root: Path, attempt: int) -> ResumeReport | None:
    """The resume report attempt ``attempt``'s orchestrator wrote into its ledger (the ``report`` of
    its ``resumed`` event), or None: it started from step 0 or wrote none (a torn last line is ignored).

    Raises:
        pydantic.ValidationError: a ``report`` that is not a :class:`ResumeReport`.
    """
    path = ledger_file(ledger_root, attempt, "orchestrator")
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return None
    for line in lines:
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if ev.get("e") == LedgerEvent.RESUMED.value and ev.get("report") is not None:
            return ResumeReport.model_validate(ev["report"])
    return None


def resume_line(report: ResumeReport) -> str:
    """What the launcher prints about a resume report (multi-turn episodes continued at turn > 1, when any)."""
    line = (
        f"Resuming with {report.queued_traces} queued traces, {report.open_groups} open groups "
        f"({report.finished_episodes_kept} finished episodes kept) and {report.requested_groups} requested groups; "
        f"a progress-only checkpoint would have lost {report.progress_only_would_lose} finished episodes"
    )
    if report.conversations_continued:
        line += (
            f"; {report.conversations_continued} multi-turn episodes resumed at turn > 1 "
            f"({report.turns_kept} turns kept)"
        )
    return line


class Launcher(Protocol):
    """What a drill needs of the launcher whose processes it stops and starts again
    (:class:`rlrun.launcher.local.LocalLauncher`)."""

    spec: RLRunSpec
    run_dir: RunDir
    console: Console
    max_steps: int
    attempt: int
    children: list[Child]
    control_url: str
    control_token: str
    health_timeout_s: float
    trainer_metrics_start: int

    def start_all(self, resume: bool) -> tuple[Child, Child]:
        """Start every process of the next attempt; its trainer and orchestrator."""
        ...

    def start_trainer(self, resume: bool) -> Child:
        """Start this attempt's trainer."""
        ...

    def notice_trainer(self, trainer: Child) -> tuple[int | None, float]:
        """SIGTERM the trainer and wait for it; its exit status and the seconds it took."""
        ...


class PreemptionDrill:
    """``--preempt-at-step K`` of one launcher (see the module docstring).

    Args:
        launcher: the launcher whose processes it stops and starts again.
        at_step: K, the trainer step after which the preemption comes.
        only: what it loses: ``all`` (every process restarts) or ``trainer``.

    Attributes:
        pauses: the pause snapshots of the ``all`` drill.
        records: one per preemption, written to ``<run_dir>/preemptions.jsonl`` at the end (:meth:`record`).
        resume_reports: what each resumed attempt restored.
        skipped: why the preemption did not happen, once it is known.
    """

    #: Seconds an orchestrator whose control server stopped answering gets to exit (:data:`EXIT_GRACE_S`).
    exit_grace_s = EXIT_GRACE_S

    def __init__(self, launcher: Launcher, at_step: int, only: Literal["all", "trainer"] = "all") -> None:
        self.launcher = launcher
        self.at_step = at_step
        self.only = only
        self.pauses: list[PauseResult] = []
        self.records: list[dict] = []
        self.resume_reports: list[ResumeReport] = []
        self.skipped: str | None = None
        self._trainer_done_at: float | None = None
        self._next_step_watch: tuple[dict, int] | None = None  # (record, trainer_metrics offset) until it trains

    @property
    def pending(self) -> bool:
        """Neither done nor skipped."""
        return not self.records and self.skipped is None

    def due(self) -> bool:
        """True once the trainer has finished step K, plus :data:`PREEMPT_DELAY_S`.

        Right after a trainer step the orchestrator loads the new weights and rolls out the
        batches they unlock, so groups are in flight and partly queued: the moment a node loss
        costs the most finished work, which is what the simulation is for. (Pausing right after
        a batch ships would often find an idle orchestrator waiting for the trainer.) Only steps
        trained since the launcher started count, not those of a run it resumes.
        """
        if self._trainer_done_at is None:
            launcher = self.launcher
            rows, _ = read_metrics(launcher.run_dir.trainer_metrics, launcher.trainer_metrics_start)
            if any(r["step"] >= self.at_step for r in rows):
                self._trainer_done_at = time.monotonic()
            return False
        return time.monotonic() - self._trainer_done_at >= PREEMPT_DELAY_S

    # -- the orchestrator's control server --------------------------------------------------------

    def _status(self) -> StatusReport:
        launcher = self.launcher
        return call_control(launcher.control_url, launcher.control_token, lambda c: c.status())

    def pause(self, orch: Child) -> PauseResult | None:
        """``POST /pause``; None when the run finished before the pause landed (the orchestrator said
        ``done``, or exited 0 instead of answering).

        Raises:
            ChildDied: the orchestrator exited with an error.
            LaunchError: the pause failed while the orchestrator runs on.
        """
        launcher = self.launcher
        with contextlib.suppress(ControlError):  # not answering: the pause below tells why
            if self._status().phase == "done":
                return None
        try:
            return call_control(
                launcher.control_url, launcher.control_token, lambda c: c.pause(timeout_s=PAUSE_TIMEOUT_S)
            )
        except ControlError as exc:
            if exits_cleanly(orch, self.exit_grace_s):
                return None
            raise LaunchError(
                f"the pause after trainer step {self.at_step} failed ({type(exc).__name__}: {exc}) "
                f"and the orchestrator runs on; see {orch.log_path}"
            ) from None

    def await_resume_report(self, trainer: Child, orch: Child) -> tuple[ResumeReport | None, bool]:
        """What the resumed orchestrator restored (None: it resumed nothing, starting from step 0), and
        whether it had already exited 0 (the report then comes from its ledger).

        Raises:
            ChildDied: the trainer or the orchestrator exited with an error.
            LaunchError: no report within the launcher's ``health_timeout_s``.
        """
        launcher = self.launcher
        ledger = launcher.run_dir.ledger
        deadline = time.monotonic() + launcher.health_timeout_s
        while True:
            for child in (trainer, orch):
                if child.poll() not in (None, 0):
                    raise ChildDied(child, child.poll())
            if orch.poll() == 0:  # done before answering: its resume is in its ledger
                return resume_report_from_ledger(ledger, launcher.attempt), True
            try:
                status = self._status()
            except ControlError:
                status = None  # not listening yet, or closing: the next turn tells
            if status is not None and (status.resume is not None or status.phase in ("running", "done")):
                return status.resume, False
            if time.monotonic() > deadline:
                raise LaunchError(
                    f"the resumed orchestrator did not report its resume within {launcher.health_timeout_s:.0f} s; "
                    f"see {orch.log_path}"
                )
            time.sleep(0.5)

    # -- the drills -----------------------------------------------------------------------------------

    def newest_trainer_part(self) -> int | None:
        """The newest trainer part this attempt published (a save on notice, or a periodic one)."""
        launcher = self.launcher
        parts = [
            n
            for n, p in step_dirs(launcher.run_dir.checkpoints).items()
            if (p / "trainer" / "progress.json").is_file() and read_attempt(p / "trainer") == launcher.attempt
        ]
        return max(parts, default=None)

    def preempt(self, trainer: Child, orch: Child) -> tuple[Child, Child] | None:
        """The ``all`` drill: pause through the control server, the trainer's notice (it saves, the paused
        orchestrator pairs), SIGKILL everything, restart with ``--resume``; the new trainer and
        orchestrator, or None when the run finished before the pause (:attr:`skipped` says so)."""
        launcher = self.launcher
        console = launcher.console
        noticed_at = time.time()
        snap = self.pause(orch)
        finished = f"the run finished before the preemption after trainer step {self.at_step} landed"
        if snap is None or snap.run_complete:
            self.skipped = finished
            return None
        if snap.step is not None and snap.step >= launcher.max_steps and exits_cleanly(orch, self.exit_grace_s):
            # The pause completed the last checkpoint: nothing is left to preempt, and the orchestrator,
            # done, exits by itself.
            self.skipped = f"{finished} (the pause completed the last checkpoint, step {snap.step})"
            return None
        saved = snap.describe() + (f" ({snap.path})" if snap.path else "")
        console.print(f"[yellow]preemption after trainer step {self.at_step}:[/yellow] {saved}")
        code, took = launcher.notice_trainer(trainer)
        part = self.newest_trainer_part()
        if part is not None and snap.step is not None and part > snap.step:
            done = launcher.run_dir.orchestrator_checkpoint(part) / "progress.pt"
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
        for child in launcher.children:
            child.kill()
        launcher.children = []
        self.pauses.append(snap)
        record = {
            "only": "all",
            "at_step": self.at_step,
            "notice_time": noticed_at,
            "pause_step": snap.step,
            "trainer_exit": code,
            "trainer_saved_step": part,
            "from_attempt": launcher.attempt,
        }
        self.records.append(record)
        trainer, orch = launcher.start_all(resume=True)
        self._watch_next_step(record)
        report, finished_at_once = self.await_resume_report(trainer, orch)
        if report is None:
            console.print(
                f"attempt {launcher.attempt} resumed nothing (no complete checkpoint): it started from step 0"
            )
            return trainer, orch
        self.resume_reports.append(report)
        console.print(resume_line(report))
        if finished_at_once:
            console.print(
                f"attempt {launcher.attempt} finished the run right after resuming (report read from its ledger)"
            )
        return trainer, orch

    def preempt_trainer(self, trainer: Child) -> Child | None:
        """The ``trainer`` drill: its notice (SIGTERM: it saves the step it has), then the same trainer
        command with ``--resume`` and the same attempt; the orchestrator and the rollout servers keep
        running. Returns the new trainer, or None when the old one had already finished the run (exit 0).

        Raises:
            ChildDied: the trainer exited with an error instead.
        """
        launcher = self.launcher
        noticed_at = time.time()
        index = launcher.children.index(trainer)
        code, took = launcher.notice_trainer(trainer)
        if code == 0:
            self.skipped = f"the run finished before the trainer-only preemption after step {self.at_step}"
            return None
        if code not in (None, 128 + signal.SIGTERM):
            raise ChildDied(trainer, code)
        part = self.newest_trainer_part()
        launcher.console.print(
            f"[yellow]trainer-only preemption after trainer step {self.at_step}:[/yellow] SIGTERM → the "
            f"trainer exited ({code}) in {took:.1f} s, its newest checkpoint step {part}; restarting only the trainer "
            f"with --resume (attempt {launcher.attempt}); the orchestrator and "
            f"{launcher.spec.rollout.replicas} rollout server(s) keep running"
        )
        new = launcher.start_trainer(resume=True)
        launcher.children[index] = new
        record = {
            "only": "trainer",
            "at_step": self.at_step,
            "notice_time": noticed_at,
            "pause_step": None,
            "trainer_exit": code,
            "trainer_saved_step": part,
            "from_attempt": launcher.attempt,
        }
        self.records.append(record)
        self._watch_next_step(record)
        return new

    # -- what they cost -------------------------------------------------------------------------------

    def _watch_next_step(self, record: dict) -> None:
        """Note the time of the first optimizer step after this point into ``record`` (:meth:`check_next_step`)."""
        try:
            offset = self.launcher.run_dir.trainer_metrics.stat().st_size
        except FileNotFoundError:
            offset = 0
        self._next_step_watch = (record, offset)

    def check_next_step(self) -> None:
        """Once the trainer has taken its first step after a preemption: its time into that preemption's record."""
        if self._next_step_watch is None:
            return
        record, offset = self._next_step_watch
        rows, _ = read_metrics(self.launcher.run_dir.trainer_metrics, offset)
        if not rows:
            return
        self._next_step_watch = None
        record["next_step"] = rows[0]["step"]
        record["notice_to_next_step_s"] = round(rows[0]["time"] - record["notice_time"], 2)
        how = "only the trainer restarted" if record["only"] == "trainer" else "every process restarted"
        self.launcher.console.print(
            f"{how}: notice → next optimizer step (step {rows[0]['step']}) in {record['notice_to_next_step_s']:.1f} s"
        )

    def record(self, rollout_restarts: int) -> None:
        """Print and append to ``<run_dir>/preemptions.jsonl`` what the preemptions cost (call at the end)."""
        root = self.launcher.run_dir.root
        recomputed = steps_recomputed(self.launcher.run_dir.ledger)
        with open(root / "preemptions.jsonl", "a") as fh:
            for record in self.records:
                record.update(steps_recomputed=recomputed, rollout_restarts=rollout_restarts)
                fh.write(json.dumps(record) + "\n")
        self.launcher.console.print(
            f"trainer steps recomputed: {recomputed}; rollout server restarts: {rollout_restarts}"
        )
