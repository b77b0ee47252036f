"""``rlrun local``: run a manifest's rollout server(s), trainer and orchestrator on this machine.

The launcher builds (or finds cached) the model, starts ``rollout.replicas`` vLLM
servers and waits until they are healthy, then starts the trainer and the
orchestrator — each the same ``rlrun`` command a pod runs — with their logs in
``<run_dir>/logs/``. It shows live progress from ``metrics.jsonl`` and ends with a
table of reward per step and the ledger check. If any child dies, or on Ctrl-C,
every child is stopped and the launcher exits non-zero, naming the dead child and
showing its last log lines.

``--preempt-at-step K`` exercises the preemption protocol: just after the trainer
finishes step K, while new rollouts are in flight, the launcher asks the orchestrator to pause (``POST /pause``: snapshot written), SIGKILLs every
process, restarts them all with ``--resume`` as the next attempt, prints what the
resumed orchestrator restored, and carries on.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import sys
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.live import Live
from rich.table import Table

from rlrun.api.control import PauseResult, ResumeReport, StatusReport
from rlrun.api.spec import RLRun
from rlrun.launcher.processes import Child, ChildDied, free_port, wait_http_ok
from rlrun.ledger import check_ledger
from rlrun.model.resolve import resolve_model
from rlrun.rundir import RunDir, step_dirs

#: Seconds between the trainer finishing step K and a simulated preemption (see ``_preempt_due``).
PREEMPT_DELAY_S = 0.3


def read_metrics(path: Path, offset: int = 0) -> tuple[list[dict], int]:
    """Complete JSON lines of ``path`` from byte ``offset``; returns them and the new offset."""
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            data = fh.read()
    except FileNotFoundError:
        return [], offset
    end = data.rfind(b"\n") + 1
    lines = [json.loads(line) for line in data[:end].splitlines() if line.strip()]
    return lines, offset + end


def summary_table(rows: list[dict], max_rows: int = 20) -> Table:
    """Reward per step; consecutive steps are averaged into at most ``max_rows`` rows."""
    table = Table(title="reward per step")
    for col in ("steps", "reward", "completion len", "staleness", "tokens/s"):
        table.add_column(col, justify="right")
    if not rows:
        return table
    size = max(1, -(-len(rows) // max_rows))
    for i in range(0, len(rows), size):
        chunk = rows[i : i + size]

        def mean(key, chunk=chunk):
            vals = [r[key] for r in chunk if r.get(key) is not None]
            return sum(vals) / len(vals) if vals else float("nan")

        steps = f"{chunk[0]['step']}" if len(chunk) == 1 else f"{chunk[0]['step']}–{chunk[-1]['step']}"
        table.add_row(
            steps,
            f"{mean('reward_mean'):.3f}",
            f"{mean('completion_len_mean'):.1f}",
            f"{mean('staleness_mean'):.2f}",
            f"{mean('rollout_tokens_per_s'):.0f}",
        )
    return table


def reward_gain(rows: list[dict], window: int = 10) -> tuple[float, float] | None:
    """Mean reward of the first and last ``window`` steps (None with fewer than 2·window steps)."""
    rewards = [r["reward_mean"] for r in rows if r.get("reward_mean") is not None]
    if len(rewards) < 2 * window:
        return None
    return sum(rewards[:window]) / window, sum(rewards[-window:]) / window


class LocalLauncher:
    """Runs one manifest locally; :meth:`run` returns the process exit code."""

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
        self.preemptions: list[PauseResult] = []
        self.resume_reports: list[ResumeReport] = []
        self.control_token = secrets.token_urlsafe(24)
        self.control_url = ""
        self.attempt = 0
        self._last_step = 0
        self._trainer_done_at: float | None = None

    def _rlrun(self, *args: str) -> list[str]:
        argv = [sys.executable, "-m", "rlrun", *args, str(self.manifest_path)]
        if self.cache_dir:
            argv += ["--cache-dir", str(self.cache_dir)]
        return argv

    def _start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Child:
        child = Child(name, argv, self.run_dir.logs / f"{name}.log", env=env)
        self.children.append(child)
        return child

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
            urls.append(f"http://127.0.0.1:{port}")
        with console.status(f"starting {len(urls)} vLLM rollout server(s) (≈30 s on CPU)…"):
            for child, url in zip(self.children, urls, strict=True):
                waited = wait_http_ok(f"{url}/health", child, self.health_timeout_s)
                console.print(f"{child.name} healthy at {url} after {waited:.0f} s")
        common = [
            "--run-dir",
            str(self.run_dir.root),
            "--max-steps",
            str(self.max_steps),
            "--attempt",
            str(self.attempt),
        ]
        if resume:
            common.append("--resume")
        trainer_env = {**env, "OMP_NUM_THREADS": str(self.trainer_threads())}
        trainer = self._start("trainer", self._rlrun("trainer", *common), trainer_env)
        rollout_args = [a for u in urls for a in ("--rollout-url", u)]
        self.control_url = f"http://127.0.0.1:{free_port()}"
        orch_env = {**env, "RLRUN_CONTROL_TOKEN": self.control_token}
        control = ["--control-port", self.control_url.rsplit(":", 1)[1]]
        orch = self._start("orchestrator", self._rlrun("orchestrator", *common, *rollout_args, *control), orch_env)
        return trainer, orch

    def _control(self, method: str, path: str, timeout_s: float = 120.0) -> dict:
        """One request to the orchestrator's control server; the decoded JSON answer.

        Raises:
            httpx.HTTPError: unreachable, or an error status.
        """
        headers = {"Authorization": f"Bearer {self.control_token}"}
        resp = httpx.request(method, f"{self.control_url}{path}", headers=headers, timeout=timeout_s)
        resp.raise_for_status()
        return resp.json()

    def _preempt_due(self) -> bool:
        """True once the trainer has finished step ``preempt_at_step``, plus ``PREEMPT_DELAY_S``.

        Right after a trainer step the orchestrator loads the new weights and rolls out the
        batches they unlock, so groups are in flight and partly queued: the moment a node loss
        costs the most finished work, which is what the simulation is for. (Pausing right after
        a batch ships would often find an idle orchestrator waiting for the trainer.)
        """
        if self._trainer_done_at is None:
            rows, _ = read_metrics(self.run_dir.trainer_metrics)
            if any(r["step"] >= self.preempt_at_step for r in rows):
                self._trainer_done_at = time.monotonic()
            return False
        return time.monotonic() - self._trainer_done_at >= PREEMPT_DELAY_S

    def _preempt(self, model_path: str) -> tuple[Child, Child]:
        """Simulated preemption: pause through the control server, SIGKILL everything, restart with --resume."""
        console = self.console
        snap = PauseResult.model_validate(self._control("POST", "/pause"))
        console.print(
            f"[yellow]preemption after trainer step {self.preempt_at_step}:[/yellow] snapshot of step {snap.step} with "
            f"{snap.queued_traces} queued traces, {snap.open_groups} open groups ({snap.finished_episodes_kept} "
            f"finished episodes kept) and {snap.requested_groups} requested groups at {snap.path}; killing every process"
        )
        for child in self.children:
            child.kill()
        self.children = []
        self.preemptions.append(snap)
        trainer, orch = self._start_all(model_path, resume=True)
        deadline = time.monotonic() + self.health_timeout_s
        while True:  # wait for the resumed orchestrator to report what it restored
            for child in (trainer, orch):
                if child.poll() not in (None, 0):
                    raise ChildDied(child, child.poll())
            try:
                report = StatusReport.model_validate(self._control("GET", "/status", timeout_s=5)).resume
                if report is not None:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("the resumed orchestrator did not report its resume")
            time.sleep(0.5)
        self.resume_reports.append(report)
        console.print(
            f"Resuming with {report.queued_traces} queued traces, {report.open_groups} open groups "
            f"({report.finished_episodes_kept} finished episodes kept) and {report.requested_groups} requested groups; "
            f"a progress-only checkpoint would have lost {report.progress_only_would_lose} finished episodes"
        )
        return trainer, orch

    def run(self) -> int:
        """Start everything, show progress, stop everything; returns 0 on success."""
        console = self.console
        problem = self._check_run_dir()
        if problem:
            console.print(f"[red]error:[/red] {problem}")
            return 2
        self.run_dir.ensure()
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
            f"{report.rejected} rejected, {report.dropped_stale} dropped stale, {report.leftover} left over; "
            f"{report.rolled_back} rolled back"
        )
        for problem in report.problems[:5]:
            console.print(f"  [red]{problem}[/red]")
        console.print(
            f"done: {len(rows)} steps in {time.monotonic() - t_start:.0f} s, {len(self.preemptions)} preemption(s); "
            f"run directory {self.run_dir.root}"
        )
        return 0 if report.ok else 1

    def _progress_cells(self, rows: list[dict], t0: float) -> list[str]:
        last = rows[-1] if rows else {}
        return [
            f"step {last.get('step', 0)}/{self.max_steps}",
            f"reward {last.get('reward_mean') or 0:.3f}",
            f"{last.get('rollout_tokens_per_s', 0):.0f} tok/s",
            f"queue {last.get('queue', 0)}",
            f"staleness {last.get('staleness_mean', 0):.2f} (max {last.get('staleness_max', 0)})",
            f"policy v{last.get('policy_version', 0)}",
            f"{time.monotonic() - t0:.0f} s",
        ]

    def _progress(self, rows: list[dict], t0: float) -> Table:
        table = Table.grid(padding=(0, 2))
        table.add_row(*self._progress_cells(rows, t0))
        return table

    def _follow(self, trainer: Child, orch: Child, model_path: str) -> list[dict]:
        rows: list[dict] = []
        offset = 0
        t0 = time.monotonic()
        # On a terminal the progress line updates in place; in a log (CI), one line every ~5% of the run.
        every = max(1, self.max_steps // 20)
        live = Live(self._progress(rows, t0), console=self.console, refresh_per_second=4, transient=False)
        with live if self.console.is_terminal else contextlib.nullcontext():
            while True:
                new, offset = read_metrics(self.run_dir.metrics, offset)
                rows.extend(new)
                if rows:
                    self._last_step = rows[-1]["step"]
                if self.preempt_at_step and not self.preemptions and self._preempt_due():
                    trainer, orch = self._preempt(model_path)
                    continue
                if self.console.is_terminal:
                    live.update(self._progress(rows, t0))
                else:
                    for row in new:
                        if row["step"] % every == 0 or row["step"] == self.max_steps:
                            self.console.print("  ".join(self._progress_cells([row], t0)), markup=False)
                for child in self.children:
                    code = child.poll()
                    if code is None:
                        continue
                    if child in (trainer, orch) and code == 0:
                        continue
                    raise ChildDied(child, code)
                if trainer.poll() == 0 and orch.poll() == 0:
                    rows.extend(read_metrics(self.run_dir.metrics, offset)[0])
                    latest = {r["step"]: r for r in rows}  # a step re-shipped after a resume: keep the last
                    return [latest[s] for s in sorted(latest)]
                time.sleep(0.25)
