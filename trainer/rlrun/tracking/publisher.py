"""TrackerPublisher: the orchestrator's thread that logs each final step to the run's experiment trackers.

One writer, one tracker run. The orchestrator is the one process that logs (a run has one orchestrator per
attempt), from a thread of its own, so its event loop never waits on a tracker: every ``poll_s`` the thread reads
what the metrics files gained and logs the steps the newest complete checkpoint holds (final values:
:mod:`rlrun.tracking.steps`), then records how far each tracker got **durably** in ``<run_dir>/tracking.json``,
which it alone writes: the tracker run's id, each tracker's last step and evaluated version logged, the attempts
that resumed, and where the run can be seen. TensorBoard's steps are durable once its writer is flushed (each
look); W&B's only once ``finish()`` returns (its own process buffers what it is given), so they are recorded when
the attempt closes. The next attempt logs again what a killed one had not recorded: TensorBoard hides the killed
attempt's copies (``purge_step``), and W&B drops a step that is not past its run's last (``wandb sync`` of the
offline files, or the server online), so every step is shown once.

The tracker run's id derives from the run's identity: the RLRun's uid (``--run-uid``, the operator's), else
(``rlrun local``) an id made once and kept in ``tracking.json``. Every attempt resumes that run, so charts
continue through preemptions. Each resume is marked at the first step logged after it: ``run/attempt`` is on
every step (it steps up at each resume), ``run/resumes`` counts the attempts that resumed so far, and
``run/resumed_groups``, ``run/resumed_samples`` and ``run/conversations_continued`` say what the resume put back
(the numbers ``kubectl get rlrun`` shows); TensorBoard also gets a ``run/events`` text.

Logging never fails or stalls the run: a tracker that cannot start or log is logged as a warning and left.
Steps reach the trackers at checkpoint time, so ``checkpoint.interval`` bounds how far the charts lag the
run; the live values are on ``/metrics`` and in ``metrics.jsonl``.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from rlrun.api.control import ResumeReport
from rlrun.api.spec import RLRunSpec
from rlrun.rundir import RunDir, write_file_atomic
from rlrun.tracking.backends import Tracker, configured, open_trackers, preload
from rlrun.tracking.steps import FinalSteps

log = logging.getLogger(__name__)

#: How often the thread looks for new final steps, seconds.
POLL_S = 1.0


def read_state(run_dir: RunDir) -> dict[str, Any]:
    """``tracking.json`` (empty when missing or unreadable): ``run_id``, ``logged`` (each tracker's last step and
    evaluated version logged durably: ``{"tensorboard": {"step": 10, "version": 10}}``), ``resumed_attempts``,
    ``locations``."""
    try:
        state = json.loads(run_dir.tracking.read_text())
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def tracker_run_id(run_uid: str | None, state: dict[str, Any]) -> str:
    """The tracker run's id: the run uid (W&B's id alphabet: letters, digits, ``-``, ``_``; at most 64), else the
    one ``state`` holds, else a new one."""
    if run_uid:
        return re.sub(r"[^A-Za-z0-9_-]", "-", run_uid)[:64]
    return state.get("run_id") or uuid.uuid4().hex[:16]


class TrackerPublisher:
    """Logs the run's final steps to ``spec.logging``'s trackers from a daemon thread.

    Args:
        spec: the run's spec (its ``logging`` section; the whole spec is the W&B config).
        run_dir: the run directory.
        name: the run's name (the RLRun's ``metadata.name``): the W&B display name unless the spec gives one.
        run_uid: the run's uid (``--run-uid``; None under ``rlrun local``).
        attempt: this attempt's run-directory number.
        committed: the newest complete checkpoint's step (−1: none), read from the thread.
        poll_s: seconds between looks.
    """

    def __init__(
        self,
        spec: RLRunSpec,
        run_dir: RunDir,
        name: str,
        run_uid: str | None,
        attempt: int,
        committed: Callable[[], int],
        poll_s: float = POLL_S,
    ) -> None:
        self.spec, self.run_dir, self.name, self.run_uid = spec, run_dir, name, run_uid
        self.attempt, self.committed, self.poll_s = attempt, committed, poll_s
        self.trackers: list[Tracker] = []
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        #: CPU time the thread spent reading and logging steps (not opening or closing trackers), seconds
        self.cpu_seconds = 0.0
        self._marker: dict[str, float] = {}  # what this attempt's resume put back: logged at the step after it
        self._marker_after = 0
        self._event = ""

    def start(self, resumed: ResumeReport | None) -> None:
        """Import the trackers' packages and start the thread (nothing when no tracker is configured; the
        orchestrator calls it in a thread of its own, before it dispatches); ``resumed``: what this attempt's
        resume put back (None: it started fresh), marked at the first step logged."""
        if not self.spec.logging.any:
            return
        state = read_state(self.run_dir)
        run_id = tracker_run_id(self.run_uid, state)
        if state.get("run_id") != run_id:  # a new run (a new RLRun over a retained volume): a new tracker run
            state = {"run_id": run_id}
        state.setdefault("resumed_attempts", [])
        logged = state.setdefault("logged", {})
        for name in configured(self.spec.logging):
            logged.setdefault(name, {"step": 0, "version": -1})
        if resumed is not None:
            if self.attempt not in state["resumed_attempts"]:
                state["resumed_attempts"] = sorted({*state["resumed_attempts"], self.attempt})
            self._marker = {
                "run/resumed_groups": float(resumed.resumed_groups),
                "run/resumed_samples": float(resumed.queued_traces),
                "run/conversations_continued": float(resumed.conversations_continued),
            }
            self._marker_after = resumed.from_step
            self._event = (
                f"attempt {self.attempt} resumed from the checkpoint of step {resumed.from_step}: "
                f"{resumed.resumed_groups} groups and {resumed.queued_traces} queued samples put back"
            )
        self.state = state
        self._write_state()  # the run id and the resume are recorded before anything is logged
        try:
            preload(self.spec.logging)
        except ImportError as exc:  # refused with the manifest already; a broken install costs only the logging
            log.warning("experiment trackers could not be imported (%s); this attempt logs to none", exc)
            return
        self._thread = threading.Thread(target=self._run, name="tracker-publisher", daemon=True)
        self._thread.start()

    def close(self, timeout_s: float = 30.0) -> None:
        """Log what is final now, close the trackers and stop the thread (waiting at most ``timeout_s``: a
        tracker still uploading then finishes in W&B's own process, and the next attempt logs what is left)."""
        if self._thread is None:
            return
        self._closing.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("experiment trackers still closing after %.0f s; left to finish", timeout_s)

    def _run(self) -> None:
        logged = {name: self.state["logged"][name] for name in configured(self.spec.logging)}
        final = FinalSteps(
            self.run_dir, min(c["step"] for c in logged.values()), min(c["version"] for c in logged.values())
        )
        self._sent = {name: dict(c) for name, c in logged.items()}  # what each was given, durable or not
        try:
            config = self.spec.model_dump(mode="json")
            steps = {name: c["step"] for name, c in logged.items()}
            self.trackers = open_trackers(
                self.spec.logging, self.run_dir, self.state["run_id"], steps, self.name, config
            )
        except Exception as exc:  # never fails the run: the metrics files keep everything
            log.warning(
                "experiment trackers could not start (%s: %s); this attempt logs to none", type(exc).__name__, exc
            )
            return
        self.state["locations"] = [t.location for t in self.trackers]
        for tracker in self.trackers:
            log.info("logging steps to %s", tracker.location)
        while True:
            closing = self._closing.wait(self.poll_s)
            cpu = time.thread_time()
            try:
                self._publish(final)
            except Exception as exc:
                log.warning("logging to the experiment trackers failed: %s: %s", type(exc).__name__, exc)
            self.cpu_seconds += time.thread_time() - cpu
            if closing:
                break
        for tracker in self.trackers:
            try:
                tracker.close()
            except Exception as exc:
                log.warning("closing %s failed: %s", tracker.location, exc)
                continue
            self.state["logged"][tracker.name] = dict(self._sent[tracker.name])  # all it was given is written
        self._write_state()

    def _publish(self, final: FinalSteps) -> None:
        steps, evaluations = final.take(self.committed())
        if not steps and not evaluations:
            return
        resumed, sent = self.state["resumed_attempts"], self._sent
        for version, values in evaluations:
            for tracker in self.trackers:
                if version > sent[tracker.name]["version"]:
                    tracker.evaluation(final.logged_step, version, values)
                    sent[tracker.name]["version"] = version
        for step, values in steps:
            attempt = values.get("run/attempt")
            if attempt is not None:
                values["run/resumes"] = float(sum(1 for a in resumed if a <= attempt))
            marked = bool(self._marker) and step > self._marker_after
            if marked:
                values.update(self._marker)
                self._marker = {}
            for tracker in self.trackers:
                if step > sent[tracker.name]["step"]:  # one that logged it durably already does not again
                    tracker.log(step, values)
                    if marked:
                        tracker.event(step, self._event)
                    sent[tracker.name]["step"] = step
        for tracker in self.trackers:
            if tracker.durable_on_flush:
                tracker.flush()
                self.state["logged"][tracker.name] = dict(sent[tracker.name])
        self._write_state()

    def _write_state(self) -> None:
        write_file_atomic(self.run_dir.tracking, json.dumps(self.state, indent=1).encode(), fault_points=False)
