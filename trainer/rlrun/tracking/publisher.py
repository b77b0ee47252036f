"""TrackerPublisher: the orchestrator's thread that logs each final step to the run's experiment trackers.

One writer, one tracker run. The orchestrator is the one process that logs (a run has one orchestrator per
attempt), from a thread of its own, so its event loop never waits on a tracker: every ``poll_s`` the thread reads
what the metrics files gained and logs the steps and evaluations the newest complete checkpoint holds (final
values: :mod:`rlrun.tracking.steps`), then records what each tracker holds **durably** in
``<run_dir>/tracking.json``, which it alone writes: the tracker run's id, each tracker's last step and evaluated
versions, the attempts that resumed, and this attempt's trackers (where each can be seen, or why it could not
log). TensorBoard's steps are durable once its writer is flushed (each look); W&B's only once ``finish()``
returns, so they are recorded when the attempt closes: at its end, or at its **pause** — the orchestrator closes
the trackers after writing the pause's snapshot and before it answers (at most :data:`AT_PAUSE_S`), so a pause
followed by a SIGKILL (a node lost with its pods, ``rlrun local --preempt-at-step``) leaves ``tracking.json``
saying what W&B holds, and the next attempt gives W&B no step twice (issue 36.5: its offline files held steps
1–7 twice). Steps that become final after the pause (the trainer's save on notice paired with it) are logged by
the next attempt. The next attempt logs again what a killed one had not recorded (killed without a pause, or a
W&B that took longer than :data:`AT_PAUSE_S` to finish): TensorBoard hides the killed attempt's copies
(``purge_step``), and W&B ignores a step less than its run's current one and merges one equal to it, so every
step shows once in the run W&B keeps — its offline files then hold those steps twice, the second copies ignored.

The tracker run's id derives from the run's identity: the RLRun's uid (``--run-uid``, the operator's), else
(``rlrun local``) an id made once and kept in ``tracking.json``. Every attempt resumes that run, so charts
continue through preemptions. ``tracking.json`` also records the run directory it was made in (``home``: its
path, device and inode). A run directory **copied** and resumed elsewhere holds the original's
``tracking.json``: without a run uid, a directory whose inode is not the recorded one is a copy (a move or a
mount elsewhere keeps the inode; a copy never does), and it logs to a tracker run of its own, its id derived
from the original's and the copy's location (:func:`tracker_run_id`), said in one warning — never into the
original's run, which the original may still be writing (issue 47.8: steps 15–16 logged twice, with
different values). The copy's new run gets every step its metrics files hold (the original's history up to
the copy included). With a run uid (the operator), the uid decides: a copy runs under another RLRun, so
another uid, and the pods of one run may see the volume under other device numbers on other nodes. Each
resume is marked at the first step logged after it: ``run/attempt`` is on
every step (it steps up at each resume), ``run/resumes`` counts the attempts that resumed so far, and
``run/resumed_groups``, ``run/resumed_samples`` and ``run/conversations_continued`` say what the resume put back
(the numbers ``kubectl get rlrun`` shows); TensorBoard also gets a ``run/events`` text.

Logging never fails or stalls the run: a tracker that cannot start or log is logged as a warning, recorded in
``tracking.json`` (``rlrun local`` prints it at the end) and left for the rest of the attempt, without touching
the other; a ``tracking.json`` that does not read as expected counts as new. Steps reach the trackers at
checkpoint time, so ``checkpoint.interval`` bounds how far the charts lag the run; the live values are on
``/metrics`` and in ``metrics.jsonl``.
"""

from __future__ import annotations

import hashlib
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
from rlrun.tracking.backends import Cursor, Tracker, open_tracker, preload
from rlrun.tracking.steps import FinalSteps

log = logging.getLogger(__name__)

#: How often the thread looks for new final steps, seconds.
POLL_S = 1.0
#: Most seconds a pause waits for the trackers to close (W&B's ``finish()``) before it answers.
AT_PAUSE_S = 10.0


def read_state(run_dir: RunDir) -> dict[str, Any]:
    """``tracking.json`` (empty when missing or not a JSON object): ``run_id``, ``home`` (the run directory
    it is in: :func:`location`), ``copy_of`` (a copy's original: ``{"path", "run_id"}``), ``logged`` (each
    tracker's :class:`~rlrun.tracking.backends.Cursor` as JSON: ``{"tensorboard": {"step": 10, "versions":
    [0, 10]}}``), ``resumed_attempts``, ``locations``, ``errors`` and ``notes`` (this attempt's trackers:
    where each can be seen; why one could not log; what it decided, e.g. that the directory is a copy)."""
    try:
        state = json.loads(run_dir.tracking.read_text())
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def location(run_dir: RunDir) -> dict[str, Any]:
    """Where ``run_dir`` is: ``{"path": its absolute path, "device": st_dev, "inode": st_ino}`` of its root.

    Raises:
        OSError: the directory cannot be read.
    """
    st = run_dir.root.stat()
    return {"path": str(run_dir.root.resolve()), "device": st.st_dev, "inode": st.st_ino}


def copied_from(state: dict[str, Any], here: dict[str, Any]) -> str | None:
    """The path of the run directory whose ``tracking.json`` (``state``) a directory at ``here``
    (:func:`location`) holds, when that is another directory — a copy: its inode is not the recorded one (a
    move or a mount elsewhere keeps it); None when it is the same one, or ``state`` records none (written
    before rlrun recorded it)."""
    home = state.get("home")
    if not isinstance(home, dict) or not isinstance(home.get("inode"), int) or home["inode"] == here["inode"]:
        return None
    return str(home.get("path"))


def tracker_run_id(run_uid: str | None, state: dict[str, Any], here: dict[str, Any] | None = None) -> str:
    """The tracker run's id: the run uid (W&B's id alphabet: letters, digits, ``-``, ``_``; at most 64),
    else the one ``state`` holds — unless the directory at ``here`` is a copy of the one that made it
    (:func:`copied_from`): then 16 hex digits of the SHA-256 of that id and ``here`` (the same at every
    attempt of the copy) —, else a new one."""
    if run_uid:
        return re.sub(r"[^A-Za-z0-9_-]", "-", run_uid)[:64]
    kept = state.get("run_id")
    if not isinstance(kept, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", kept):
        return uuid.uuid4().hex[:16]
    if here is not None and copied_from(state, here) is not None:
        where = f"{kept}:{here['path']}:{here['device']}:{here['inode']}"
        return hashlib.sha256(where.encode()).hexdigest()[:16]
    return kept


class TrackerPublisher:
    """Logs the run's final steps to ``spec.logging``'s trackers from a daemon thread.

    Args:
        spec: the run's spec (its ``logging`` section; the whole spec is the W&B config).
        run_dir: the run directory.
        name: the run's name (the RLRun's ``metadata.name``): the W&B display name unless the spec gives one.
        run_uid: the run's uid (``--run-uid``; None under ``rlrun local``).
        attempt: this attempt's run-directory number.
        committed: the newest complete checkpoint's step (−1: none), read from the thread.
        max_steps: the step the run ends at (a run whose checkpoint reached it is finished).
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
        max_steps: int | None = None,
        poll_s: float = POLL_S,
    ) -> None:
        self.spec, self.run_dir, self.name, self.run_uid = spec, run_dir, name, run_uid
        self.attempt, self.committed, self.poll_s = attempt, committed, poll_s
        self.max_steps = max_steps or spec.max_steps
        self.trackers: list[Tracker] = []
        self.state: dict[str, Any] = {}
        #: CPU time the thread spent reading and logging steps (not opening or closing trackers), seconds
        self.cpu_seconds = 0.0
        self._closing = threading.Event()
        self._lock = threading.Lock()  # a close while start() runs in its thread: the publisher never starts
        self._thread: threading.Thread | None = None
        self._marker: dict[str, float] = {}  # what this attempt's resume put back: logged at the step after it
        self._marker_after = 0
        self._event = ""

    def start(self, resumed: ResumeReport | None) -> None:
        """Import the trackers' packages and start the thread (nothing when no tracker is configured; the
        orchestrator calls it in a thread of its own, before it dispatches); ``resumed``: what this attempt's
        resume put back (None: it started fresh), marked at the first step logged. Never raises: a failure costs
        this attempt's logging only."""
        if not self.spec.logging.trackers:
            return
        try:
            self._begin(resumed)
            preload(self.spec.logging)
        except Exception as exc:
            log.warning(
                "experiment trackers could not start (%s: %s); this attempt logs to none", type(exc).__name__, exc
            )
            return
        with self._lock:
            if self._closing.is_set():
                return
            self._thread = threading.Thread(target=self._run, name="tracker-publisher", daemon=True)
            self._thread.start()

    def _begin(self, resumed: ResumeReport | None) -> None:
        state = read_state(self.run_dir)
        here = location(self.run_dir)
        run_id = tracker_run_id(self.run_uid, state, here)
        kept = state.get("run_id")
        copy_of = None if self.run_uid or tracker_run_id(None, state) != kept else copied_from(state, here)
        if state.get("run_id") != run_id:  # a new run (a new RLRun over a retained volume, a copy): a new one
            state = {"run_id": run_id}
        notes = []
        if copy_of is not None:
            notes.append(
                f"run directory {here['path']} is a copy of {copy_of} (not the directory its tracking.json "
                f"was made in): it logs to tracker run {run_id} of its own, not to {copy_of}'s run {kept}"
            )
            log.warning("%s", notes[-1])
            state["copy_of"] = {"path": copy_of, "run_id": kept}
        attempts = state.get("resumed_attempts")
        attempts = [a for a in attempts if isinstance(a, int)] if isinstance(attempts, list) else []
        logged = state.get("logged") if isinstance(state.get("logged"), dict) else {}
        self.state = {
            "run_id": run_id,
            "home": here,  # where it was made (a move keeps its inode: the new path is recorded)
            **({"copy_of": state["copy_of"]} if isinstance(state.get("copy_of"), dict) else {}),
            # every tracker's, configured or not: one left out for an attempt keeps what it holds
            "logged": {t: Cursor.from_json(logged.get(t)).to_json() for t in {*self.spec.logging.trackers, *logged}},
            "resumed_attempts": sorted({*attempts, self.attempt}) if resumed is not None else attempts,
            "locations": [],
            "errors": [],
            "notes": notes,
        }
        if resumed is not None:
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
        self._write_state()  # the run id and the resume are recorded before anything is logged

    def close(self, timeout_s: float = 30.0) -> None:
        """Log what is final now, close the trackers and stop the thread, waiting at most ``timeout_s`` (a tracker
        still closing then is abandoned: W&B's process dies with ours, and the next attempt logs again what it
        had not confirmed)."""
        with self._lock:
            self._closing.set()
            thread = self._thread
        if thread is None:
            return
        thread.join(timeout_s)
        if thread.is_alive():
            log.warning("experiment trackers still closing after %.0f s; left unfinished", timeout_s)

    def _run(self) -> None:
        cursors = {t: Cursor.from_json(self.state["logged"][t]) for t in self.spec.logging.trackers}
        config = self.spec.model_dump(mode="json")
        for tracker, cursor in cursors.items():
            try:
                opened = open_tracker(
                    tracker, self.spec.logging, self.run_dir, self.state["run_id"], cursor, self.name, config
                )
            except Exception as exc:  # never fails the run, nor the other tracker: the metrics files keep it all
                self._failed(tracker, "could not start", exc)
                continue
            self.trackers.append(opened)
            self.state["locations"].append(opened.location)
            log.info("logging steps to %s", opened.location)
        self._write_state()
        if not self.trackers:
            return
        final = FinalSteps(
            self.run_dir,
            min(t.logged.step for t in self.trackers),
            set.intersection(*(t.logged.versions for t in self.trackers)),
        )
        while True:
            closing = self._closing.wait(self.poll_s)
            cpu = time.thread_time()
            try:
                self._publish(final)
            except Exception as exc:  # reading the files: the next look tries again
                log.warning("reading the metrics for the experiment trackers failed: %s: %s", type(exc).__name__, exc)
            self.cpu_seconds += time.thread_time() - cpu
            if closing:
                break
        finished = self.committed() >= self.max_steps
        for tracker in self.trackers:
            try:
                tracker.close(finished)
            except Exception as exc:
                self._failed(tracker.name, "could not close", exc)
                continue
            self.state["logged"][tracker.name] = tracker.logged.to_json()  # all it was given is written
        self._write_state()

    def _publish(self, final: FinalSteps) -> None:
        steps, evaluations = final.take(self.committed())
        if not steps and not evaluations:
            return
        resumed, marked = self.state["resumed_attempts"], None
        for step, values in steps:
            attempt = values.get("run/attempt")
            if attempt is not None:
                values["run/resumes"] = float(sum(1 for a in resumed if a <= attempt))
            if self._marker and step > self._marker_after:
                values.update(self._marker)
                self._marker, marked = {}, step
        for tracker in list(self.trackers):
            try:
                for version, values in evaluations:  # each final already: its step is logged in this look or was
                    if version not in tracker.logged.versions:
                        tracker.evaluation(version, values)
                for step, values in steps:
                    if step > tracker.logged.step:  # a tracker that holds it durably already does not again
                        tracker.log(step, values)
                        if step == marked:
                            tracker.event(step, self._event)
                if tracker.durable_on_flush:
                    tracker.flush()
                    self.state["logged"][tracker.name] = tracker.logged.to_json()
                else:  # not durable yet: only the highest step it was given (W&B may ignore rows up to it)
                    self.state["logged"][tracker.name]["given"] = tracker.logged.given
            except Exception as exc:  # this tracker only: what it did not make durable is logged again next attempt
                self.trackers.remove(tracker)
                self._failed(tracker.name, "failed to log", exc)
        self._write_state()

    def _failed(self, tracker: str, what: str, exc: Exception) -> None:
        message = f"{tracker} {what} ({type(exc).__name__}: {exc}); this attempt logs nothing more to it"
        log.warning("experiment tracker %s", message)
        self.state["errors"].append(message)

    def _write_state(self) -> None:
        try:
            write_file_atomic(self.run_dir.tracking, json.dumps(self.state, indent=1).encode(), fault_points=False)
        except OSError as exc:  # what it would have recorded is logged again by the next attempt
            log.warning("could not write %s: %s", self.run_dir.tracking, exc)
