"""CheckpointManager: the orchestrator's part of every checkpoint — capture, write, prune.

Consistent cut with the trainer. The trainer publishes ``checkpoints/step_N/trainer/``
(step 0 at a fresh start); the orchestrator then writes ``progress.pt`` for N — its
progress, train-source state and sink snapshot taken at that moment, with
``shipped = M ≥ N`` batches out. Batch files ``N+1 … M`` stay on disk until a complete
checkpoint past them exists; their samples are no longer in the snapshot's queue. A
resume from N therefore has the trainer train ``N+1 … M`` from those files and the
orchestrator ship ``M+1 …`` from the restored queue and groups: every episode finished
before the snapshot is trained exactly once. Files past ``M`` (shipped after the
snapshot by an attempt that then died) are deleted, and the trainer only accepts
batches past ``M`` that carry the current attempt number, so it can never train one of
them. A pause (``POST /pause`` or SIGTERM) stops dispatching and shipping and rewrites
the orchestrator part of the newest trainer checkpoint with the current snapshot — the
same cut, losing nothing.

Pause, then the trainer's save on notice. The trainer, told to stop (SIGTERM), checkpoints
the step ``S`` it has — often newer than the part the pause paired with, as it trains on
batches the orchestrator had already shipped. A paused orchestrator therefore keeps
completing every new trainer part of its attempt with **the same pause snapshot** (same
progress, queue, groups and ``ledger_line``; only ``step`` differs) until it is stopped:
valid because the snapshot's ``shipped = M ≥ S`` (nothing ships after a pause), so a resume
from ``S`` trains ``S+1 … M`` from the kept files and recomputes no trainer step. A part with
``S > M`` cannot be paired and is left alone. Each pairing is its own atomic write, so a kill
at any moment leaves the previous complete checkpoint (at worst the pause's own step) usable;
writing the same pairing twice writes the same content (idempotent). ``rlrun local`` stops the
orchestrator after the trainer has exited, and the orchestrator pairs what is there once more as it
stops (``Orchestrator.run``); the operator deletes every pod at once, so a paused orchestrator told
to stop (SIGTERM) first waits, within its deadline, for the trainer to stop and pairs the part it
saved (:meth:`CheckpointManager.pair_notice_save`).

Guarantees:

- **A state that existed.** The orchestrator's progress, the train-source state and the
  sink snapshot are captured on the event loop with no ``await`` in between; packing,
  checksumming and writing run in a thread (invariant 7).
- **Durable in order.** The ledger lines the snapshot refers to are fsynced before
  ``progress.pt`` is written, and ``progress.pt`` is written atomically (temporary file,
  fsync, rename, directory fsync) by :func:`rlrun.checkpoint.save_orchestrator_progress`;
  its presence completes step N (invariant 4).
- **Paired with the right trainer part.** Only a trainer part this attempt may use is
  completed: the one it resumed from, or one its own trainer published (``meta.json``).
- **Nothing cut half-way.** Saves take :attr:`CheckpointManager.lock`, which the loop also
  holds from cutting a batch to counting it shipped, so no snapshot falls in between.
- **Journal cut.** The capture includes the episode journal's cut (``progress["journal"]``,
  :meth:`rlrun.orchestrator.journal.Journal.cut`); once ``progress.pt`` is durable the journal
  is compacted to it (segments and earlier attempts' journals it covers are deleted).
- **Retention.** After each save, all but the ``checkpoint.keep_last`` newest usable steps
  (both parts verify) are deleted, and batch files no usable checkpoint can need any more.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import threading
import time
from collections.abc import Callable
from typing import Any, Literal, Protocol

from rlrun.api.control import CheckpointWritten, SnapshotCounts
from rlrun.api.spec import RLRunSpec
from rlrun.checkpoint import (
    TRAINER_PROGRESS_FILE,
    mark_verified,
    prune_checkpoints,
    save_orchestrator_progress,
    usable_steps,
)
from rlrun.envs.base import Env
from rlrun.errors import OrchestratorError
from rlrun.identity import run_identity
from rlrun.ledger import Ledger, LedgerEvent, has_stopped
from rlrun.orchestrator import snapshot as sink_snapshot
from rlrun.orchestrator.conversations import KeptConversations
from rlrun.orchestrator.dispatcher import Dispatcher
from rlrun.orchestrator.follower import WeightFollower
from rlrun.orchestrator.journal import Journal
from rlrun.orchestrator.sink import TrainSink
from rlrun.orchestrator.source import TrainSource
from rlrun.rundir import RunDir, step_dirs, written_by

log = logging.getLogger(__name__)

#: ``capture(step) -> (progress, snapshot, counts)``, called on the event loop: the orchestrator's
#: JSON-compatible progress for checkpoint ``step`` (``ledger_line`` is added here), its
#: :class:`~rlrun.orchestrator.snapshot.SinkSnapshot`, and the snapshot's contract counts.
Capture = Callable[[int], tuple[dict[str, Any], sink_snapshot.SinkSnapshot, SnapshotCounts]]


class Captured(Protocol):
    """The part of the orchestrator (:class:`~rlrun.orchestrator.loop.Orchestrator`) its checkpoint part is made of."""

    spec: RLRunSpec
    envs: dict[str, Env]
    attempt: int
    shipped: int
    weights: WeightFollower
    source: TrainSource
    sink: TrainSink
    dispatcher: Dispatcher | None
    kept: KeptConversations
    journal: Journal | None


def capture_of(orch: Captured, step: int) -> tuple[dict[str, Any], sink_snapshot.SinkSnapshot, SnapshotCounts]:
    """``orch``'s part of checkpoint ``step`` (a :data:`Capture`; no awaits): its progress (the batches shipped, the
    policy the servers hold, the source's state, the run's identity, the journal's cut), the sink snapshot with the
    requests out (in flight, delivered not taken) and the kept conversations, and the snapshot's counts."""
    progress = {
        "step": step,
        "shipped": orch.shipped,
        "policy_version": orch.weights.version,
        "attempt": orch.attempt,
        "source": orch.source.state(),
        "identity": run_identity(orch.spec, orch.envs),
        "time": time.time(),
    }
    snap = orch.sink.snapshot(orch.dispatcher.emitted_requests() if orch.dispatcher is not None else [])
    snap.conversations = orch.kept.current()
    snap.source_tensors = orch.source.tensors()  # the same cut as progress["source"]
    if orch.journal is not None:  # the same step as the snapshot: records after this cut are replayed
        progress["journal"] = orch.journal.cut()
    return progress, snap, snap.counts(list(orch.source.resume_requests))


class CheckpointManager:
    """Writes the orchestrator part of checkpoints for one attempt.

    Args:
        run_dir: the run directory.
        attempt: this attempt's number (0: unnumbered, every trainer part is usable).
        keep_last: complete checkpoints to keep (``checkpoint.keep_last``).
        ledger: this attempt's orchestrator ledger.
        capture: see :data:`Capture`.

    Attributes:
        lock: held by each save; the loop holds it while it ships a batch.
        base_step: the checkpoint this attempt resumed from (0 for a fresh start).
        last_step: the newest step this attempt completed or resumed from (−1: none yet).
        last_written: the newest part written, as the control server reports it.
        paused_capture: the pause snapshot (what :data:`Capture` returned, with ``ledger_line``),
            reused for every trainer part completed after the pause; None before a pause.
    """

    def __init__(self, run_dir: RunDir, attempt: int, keep_last: int, ledger: Ledger, capture: Capture) -> None:
        self.run_dir = run_dir
        self.attempt = attempt
        self.keep_last = keep_last
        self.ledger = ledger
        self.capture = capture
        self.lock = asyncio.Lock()
        # One prune at a time: a cancelled await (the run ending mid-save) leaves its thread running, and
        # the final prune would otherwise verify steps that thread is deleting.
        self._prune_lock = threading.Lock()
        self.base_step = 0
        self.last_step = -1
        self.last_written: CheckpointWritten | None = None
        self.paused_capture: tuple[dict[str, Any], sink_snapshot.SinkSnapshot, SnapshotCounts] | None = None
        self.journal: Journal | None = None  # the episode journal, compacted after each save (set by the loop)

    def resumed_from(self, step: int) -> None:
        """This attempt resumed from complete checkpoint ``step``."""
        self.base_step = self.last_step = step

    def pairable(self, step: int) -> bool:
        """Whether the trainer part of ``step`` exists and this attempt may complete it."""
        part = self.run_dir.trainer_checkpoint(step)
        if not (part / TRAINER_PROGRESS_FILE).is_file():
            return False
        return step == self.base_step or written_by(part, self.attempt)

    def newest_pairable(self) -> int | None:
        """The newest trainer part a pause snapshot may complete, or None."""
        steps = [n for n in step_dirs(self.run_dir.checkpoints) if n >= self.base_step and self.pairable(n)]
        return max(steps, default=None)

    async def save_pause(self) -> CheckpointWritten:
        """Write the pause snapshot into the newest trainer part this attempt may complete.

        Raises:
            OrchestratorError: no such trainer part yet.
            OSError: the file could not be written.
        """
        step = self.newest_pairable()
        if step is None:
            raise OrchestratorError("no trainer checkpoint to pair a snapshot with yet")
        return await self.save(step, "pause")

    async def complete_new_trainer_parts(self) -> None:
        """Write our part for every trainer part newer than :attr:`last_step`: a periodic checkpoint,
        or, once paused, the pause snapshot again (module docstring) for a part with ``step ≤ shipped``."""
        for step in sorted(step_dirs(self.run_dir.checkpoints)):
            if step <= self.last_step or not self.pairable(step):
                continue
            if self.paused_capture is None:
                await self.save(step, "periodic")
            elif step <= self.paused_capture[0]["shipped"]:
                await self.save(step, "pause")

    async def pair_notice_save(self, within_s: float, poll_s: float = 0.05) -> int | None:
        """Paused and told to stop (SIGTERM): wait up to ``within_s`` seconds for this attempt's trainer to stop — it
        got its notice with this process, finishes its step and saves it — pairing each new part it writes with the
        pause snapshot, so the next attempt resumes from the step saved on notice and recomputes none.

        The trainer has stopped when its ledger's last line is ``stopped`` (:func:`rlrun.ledger.has_stopped`): a
        trainer that has none (never started) or stopped already is not waited for; one killed without a save is
        waited for until ``within_s``, then the pause's own step stands. Returns the newest step this attempt has
        completed, or None when not paused.
        """
        if self.paused_capture is None:
            return None
        loop = asyncio.get_running_loop()
        until, waited = loop.time() + within_s, False
        while True:
            await self.complete_new_trainer_parts()
            stopped = has_stopped(self.ledger.path.parent, self.attempt, "trainer")
            if stopped is not False:
                break
            if loop.time() >= until:
                log.warning(
                    "SIGTERM: the trainer did not stop within %.0f s; the snapshot stays paired with step %d "
                    "(the next attempt retrains the steps after it)",
                    within_s,
                    self.last_step,
                )
                break
            if not waited:
                log.info(
                    "SIGTERM: waiting up to %.0f s for the trainer's save on notice, to pair it with the pause "
                    "snapshot",
                    within_s,
                )
                waited = True
            await asyncio.sleep(poll_s)
        await self.complete_new_trainer_parts()  # a part published just before its stopped line
        return self.last_step

    async def save(self, step: int, reason: Literal["periodic", "pause"]) -> CheckpointWritten:
        """Capture now and write ``checkpoints/step_N/orchestrator/progress.pt``, then prune.

        Raises:
            OSError: the file could not be written (the previous complete checkpoint stands).
        """
        async with self.lock:
            self.ledger.flush()
            if reason == "pause" and self.paused_capture is not None:
                progress, snap, counts = self.paused_capture  # the same cut, paired with a newer trainer part
                progress = {**progress, "step": step}
            else:
                progress, snap, counts = self.capture(step)
                progress["ledger_line"] = self.ledger.lines - 1
                if reason == "pause":
                    self.paused_capture = (progress, snap, counts)

            def write():
                self.ledger.sync()  # the ledger lines the snapshot refers to are durable first
                sink_state, tensors = sink_snapshot.pack(snap)
                path = save_orchestrator_progress(self.run_dir, step, {**progress, "sink": sink_state}, tensors)
                mark_verified(path)  # just written and fsynced: pruning need not read it back
                return path

            t0 = time.perf_counter()
            path = await asyncio.to_thread(write)
            # recorded once durable: the ledger check counts step N complete from here on
            self.ledger.write(LedgerEvent.CHECKPOINT, step=step, reason=reason, ledger_line=progress["ledger_line"])
            self.last_step = max(self.last_step, step)
            written = CheckpointWritten(
                step=step,
                reason=reason,
                path=str(path),
                seconds=round(time.perf_counter() - t0, 4),
                time=time.time(),
                **counts.model_dump(),
            )
            self.last_written = written
            removed = await self.prune()
            if self.journal is not None and progress.get("journal"):  # progress.pt is durable: drop what it covers
                await asyncio.to_thread(self.journal.compact, progress["journal"])
            log.info(
                "checkpoint step %d complete (%s, %s): %d queued traces, %d open groups (%d finished episodes kept), "
                "%d requested groups; pruned %s",
                step,
                path,
                reason,
                written.queued_traces,
                written.open_groups,
                written.finished_episodes_kept,
                written.requested_groups,
                removed or "nothing",
            )
            return written

    async def finish(self, done: bool) -> None:
        """The attempt's last look, at its teardown: with the run ``done``, prune again (the last save's prune may
        have been cut short by a cancel: retention holds); paused, complete a trainer part saved on notice since
        the last look with the pause snapshot (a failure is logged: the pause's own checkpoint stands)."""
        if done:
            await self.prune()
        elif self.paused_capture is not None:
            try:
                await self.complete_new_trainer_parts()
            except Exception as exc:
                log.warning("could not pair the pause snapshot with a newer trainer part: %s", exc)

    async def prune(self) -> list[int]:
        """Apply retention (module docstring); returns the checkpoint steps deleted."""

        def prune() -> list[int]:
            with self._prune_lock:
                removed = prune_checkpoints(self.run_dir, self.keep_last)
                kept = usable_steps(self.run_dir)
                if kept:  # a resume starts at the oldest kept step at the earliest: batches up to it are trained
                    for n, p in step_dirs(self.run_dir.rollouts).items():
                        if n <= kept[0]:
                            shutil.rmtree(p, ignore_errors=True)
                return removed

        return await asyncio.to_thread(prune)
