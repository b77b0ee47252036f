"""The orchestrator's main loop: dispatch, collect, ship, follow the trainer, snapshot, resume.

Flow control. A rollout dispatched at policy version ``v`` can train at most in
batch ``v + 1 + max_off_policy_steps``, so at version ``v`` with ``shipped``
batches out, rollouts can still fill ``v + 1 + max_off_policy_steps − shipped``
batches. New groups are dispatched only while queued + open + outstanding samples
stay below that many batches (and in-flight samples below ``rollout.max_inflight``):
no work is generated stale, and ``max_off_policy_steps = 0`` is synchronous RL.

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
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import sys
import time
from collections import deque
from pathlib import Path

from transformers import AutoTokenizer

from rlrun.batch import write_batch
from rlrun.checkpoint import (
    TRAINER_PROGRESS_FILE,
    check_compatible,
    complete_steps,
    latest_complete_checkpoint,
    prune_checkpoints,
    run_identity,
    write_progress,
)
from rlrun.envs import make_env
from rlrun.ledger import Ledger, ledger_attempts
from rlrun.orchestrator import snapshot as sink_snapshot
from rlrun.orchestrator.control import ControlServer
from rlrun.orchestrator.dispatcher import Dispatcher, GroupResult
from rlrun.orchestrator.sink import OpenGroup, SinkCounters, TrainSink
from rlrun.orchestrator.source import TrainSource
from rlrun.orchestrator.types import GroupRequest
from rlrun.orchestrator.weights import Signature, push_weights, weights_signature
from rlrun.rollout.client import RolloutClient
from rlrun.rundir import RunDir, step_dirs, write_file_atomic
from rlrun.spec import RLRunSpec

log = logging.getLogger(__name__)

#: GIL switch interval of the orchestrator process, seconds. Snapshots are serialized in a
#: thread; with Python's default 5 ms the event loop can wait that long for the GIL at each
#: switch (measured p99 7.2 ms at 10k queued traces), with 1 ms it waited 3.4 ms at p99.
LOOP_SWITCH_INTERVAL_S = 0.001


class OrchestratorError(RuntimeError):
    """The orchestrator cannot go on (message says why and what to do)."""


def part_attempt(path: Path) -> int | None:
    """The attempt recorded in a published trainer part or broadcast (``None`` when unreadable)."""
    for name in (TRAINER_PROGRESS_FILE, "meta.json"):
        try:
            return int(json.loads((path / name).read_text()).get("attempt", 0))
        except (OSError, ValueError):
            continue
    return None


class Orchestrator:
    """One run's orchestrator.

    Args:
        spec: the run's spec.
        run_dir: shared run directory.
        rollout_urls: base URLs of the rollout servers.
        model_path: the initial model (tokenizer and reference weight shapes come from it).
        max_steps: last step to ship (default ``spec.max_steps``).
        resume: continue from the newest complete checkpoint.
        attempt: this attempt's number (the launcher or operator counts them; 0 = unnumbered).
        control_port: port of the control server (None: no server).
        control_token: its bearer token.
        health_timeout_s: how long to wait for every rollout server to answer ``/health``.
        poll_s: how often to look for trainer output, seconds.
        client_factory: makes a rollout client from a URL (benchmarks pass an instant fake).
    """

    def __init__(
        self,
        spec: RLRunSpec,
        run_dir: RunDir,
        rollout_urls: list[str],
        model_path: str,
        max_steps: int | None = None,
        resume: bool = False,
        attempt: int = 0,
        control_port: int | None = None,
        control_host: str = "127.0.0.1",
        control_token: str | None = None,
        health_timeout_s: float = 600.0,
        poll_s: float = 0.05,
        client_factory=RolloutClient,
    ) -> None:
        self.spec = spec
        self.run_dir = run_dir.ensure()
        self.rollout_urls = rollout_urls
        self.model_path = model_path
        self.max_steps = max_steps or spec.max_steps
        self.resume = resume
        self.attempt = attempt
        self.health_timeout_s = health_timeout_s
        self.poll_s = poll_s
        self.client_factory = client_factory
        self.ledger = Ledger(self.run_dir.root / "ledger", attempt, "orchestrator")
        self.envs = {e.name: make_env(e) for e in spec.envs}
        self.source = TrainSource([(self.envs[e.name], e.weight) for e in spec.envs], spec.seed)
        self.sink = TrainSink(
            spec.group_size,
            spec.batch_size,
            spec.max_off_policy_steps,
            spec.loss.std_normalize_advantages,
            record=self._record,
        )
        self.results: asyncio.Queue[GroupResult] = asyncio.Queue()
        self.shipped = 0
        self.policy_version = 0
        self.base_step = 0  # the checkpoint this attempt started from
        self.last_saved_checkpoint = -1
        self.reference: Signature | None = None
        self.phase = "starting"
        self.paused = False
        self.last_snapshot: dict | None = None
        self.resume_report: dict | None = None
        self.control = (
            ControlServer(self, control_host, control_port, control_token or "") if control_port is not None else None
        )
        self.dispatcher: Dispatcher | None = None
        self._pause_result: asyncio.Future | None = None
        self.pause_error: BaseException | None = None  # a SIGTERM pause that failed (the process exits 1)
        self._save_lock = asyncio.Lock()
        self._stop = asyncio.Event()
        self._tokens_since_ship = 0
        self._last_ship_time = time.monotonic()
        self._metrics_file = None
        self._next_member: dict[int, int] = {}  # next member number of each group with work out

    def _record(self, event: str, ids: list[str], **fields) -> None:
        self.ledger.write(event, ids=ids, **fields)

    # -- status and control -------------------------------------------------------------------

    def status(self) -> dict:
        """What ``GET /status`` answers."""
        return {
            "phase": self.phase,
            "attempt": self.attempt,
            "step": self.shipped,
            "policy_version": self.policy_version,
            "max_steps": self.max_steps,
            "last_checkpoint_step": self.last_saved_checkpoint if self.last_saved_checkpoint >= 0 else None,
            "queued_traces": len(self.sink.queue),
            "open_groups": len(self.sink.open_groups),
            "finished_episodes_in_open_groups": self.sink.open_members,
            "inflight_samples": self.dispatcher.inflight_samples if self.dispatcher else 0,
            "resume_requests": len(self.source.resume_requests),
            "last_snapshot": self.last_snapshot,
            "resume": self.resume_report,
            "rollout_endpoints": sorted(self.dispatcher.clients) if self.dispatcher else list(self.rollout_urls),
        }

    async def set_endpoints(self, endpoints: list[str]) -> None:
        """Replace the rollout endpoints; new ones get the current weights first."""
        self.rollout_urls = [e.rstrip("/") for e in endpoints]
        if self.dispatcher is None:  # still starting: the dispatcher is created with these
            log.info("rollout endpoints now %s", sorted(self.rollout_urls))
            return
        new = [e.rstrip("/") for e in endpoints if e.rstrip("/") not in self.dispatcher.clients]
        self.dispatcher.set_endpoints(endpoints)
        if new and self.policy_version > 0:
            weights = self._weights_dir(self.policy_version)
            if weights is not None:
                await push_weights(
                    [self.dispatcher.clients[u] for u in new], weights, self.policy_version, self.reference
                )
        log.info("rollout endpoints now %s", sorted(self.dispatcher.clients))

    def _weights_dir(self, version: int) -> Path | None:
        for p in (self.run_dir.broadcast(version), self.run_dir.trainer_checkpoint(version)):
            if p.is_dir():
                return p
        return None

    async def pause(self) -> dict:
        """Stop dispatching and shipping, write the snapshot, and return its counts (idempotent).

        Before the orchestrator has started (still waiting for rollout servers, or restoring), this
        attempt holds no work of its own: nothing is written (a snapshot would pair an empty sink
        with some trainer checkpoint), the newest complete checkpoint stays what the next attempt
        resumes from, and the answer says so (``step`` None).
        """
        if self._pause_result is None:
            self.paused = True
            starting = self.phase == "starting"
            self.phase = "pausing"
            self._pause_result = asyncio.get_running_loop().create_future()
            try:
                if starting:
                    result = {"step": None, "queued_traces": 0, "open_groups": 0, "finished_episodes_kept": 0}
                    result |= {"path": None, "note": "paused before starting: nothing to save"}
                    self.last_snapshot = result
                    log.info("paused before starting: no snapshot needed")
                else:
                    step = self._newest_trainer_part()
                    if step is None:
                        raise OrchestratorError("no trainer checkpoint to pair a snapshot with yet")
                    result = await self._save_checkpoint(step, reason="pause")
                self.phase = "paused"
                self._pause_result.set_result(result)
            except BaseException as exc:
                self._pause_result.set_exception(exc)
                self._pause_result.exception()  # mark retrieved
                self.phase = "failed"
                raise
        return await asyncio.shield(self._pause_result)

    def _trainer_part_ok(self, step: int) -> bool:
        """A trainer part this attempt may pair a snapshot with: the restored one, or one of ours."""
        root = self.run_dir.trainer_checkpoint(step)
        if not (root / TRAINER_PROGRESS_FILE).is_file():
            return False
        return step == self.base_step or self._ours(root)

    def _ours(self, part: Path) -> bool:
        """Whether a trainer part or broadcast was written by this attempt (always, when unnumbered)."""
        return self.attempt == 0 or part_attempt(part) == self.attempt

    def _newest_trainer_part(self) -> int | None:
        steps = [n for n in step_dirs(self.run_dir.checkpoints) if n >= self.base_step and self._trainer_part_ok(n)]
        return max(steps, default=None)

    # -- set-up -------------------------------------------------------------------------------

    async def _wait_healthy(self) -> None:
        """Wait for every rollout server to answer; with none yet, wait for ``PUT /rollout-endpoints``.

        On Kubernetes the operator sends the endpoints once rollout pods are ready, which may take
        as long as scheduling a GPU node: that wait has no deadline (the operator reports it).
        """
        waited = time.monotonic()
        while not self.dispatcher.clients and not self._stop.is_set():
            if time.monotonic() - waited > 30:
                log.info("waiting for rollout endpoints (PUT /rollout-endpoints on the control server)")
                waited = time.monotonic()
            await asyncio.sleep(0.2)
        deadline = time.monotonic() + self.health_timeout_s
        pending = set(self.dispatcher.clients)
        while pending and not self._stop.is_set():
            pending &= set(self.dispatcher.clients)  # endpoints removed meanwhile are not waited for
            for url in list(pending):
                if await self.dispatcher.clients[url].healthy():
                    pending.discard(url)
            if pending:
                if time.monotonic() > deadline:
                    raise OrchestratorError(
                        f"rollout servers not healthy after {self.health_timeout_s:.0f} s: {sorted(pending)}"
                    )
                await asyncio.sleep(1.0)

    def _start_over(self) -> None:
        """``--resume`` with no complete checkpoint: start from step 0, discarding what dead attempts left.

        An attempt killed before its first complete checkpoint leaves batches (and orchestrator parts)
        past step 0 that nothing can resume from; they go (the trainer removes its own parts and
        broadcasts), and every earlier attempt's ledger events are rolled back by a ``resumed`` event
        from no snapshot (line −1), so the ledger check does not count them.
        """
        removed = self.run_dir.remove_steps_after(self.run_dir.rollouts, 0)
        parts = [n for n in step_dirs(self.run_dir.checkpoints) if n > 0]
        for n in parts:
            shutil.rmtree(self.run_dir.orchestrator_checkpoint(n), ignore_errors=True)
        for earlier in ledger_attempts(self.ledger.path.parent, "orchestrator"):
            if earlier < self.attempt:
                self.ledger.write("resumed", from_attempt=earlier, snapshot_line=-1, step=0, removed_batches=removed)
        if removed:
            log.info("resume: starting over from step 0; removed batches %s left by an earlier attempt", removed)

    def _check_fresh_run_dir(self) -> None:
        # step 0 is the trainer's start-up checkpoint of this very run
        leftovers = [p for p in (self.run_dir.checkpoints, self.run_dir.rollouts) if any(n > 0 for n in step_dirs(p))]
        if leftovers:
            raise OrchestratorError(
                f"{self.run_dir.root} already holds a run ({', '.join(str(p) for p in leftovers)}); "
                "resume it with --resume or choose another --run-dir"
            )

    async def _restore(self) -> bool:
        """Restore from the newest complete checkpoint; False when there is none."""
        ckpt = await asyncio.to_thread(latest_complete_checkpoint, self.run_dir)
        if ckpt is None:
            log.info("resume: no complete checkpoint in %s; starting from step 0", self.run_dir.root)
            return False
        state = ckpt.orchestrator
        check_compatible(state.get("identity"), self.spec, str(self.run_dir.orchestrator_checkpoint(ckpt.step)))
        self.source.load_state(state["source"])
        self.policy_version = self.base_step = self.last_saved_checkpoint = ckpt.step
        self.shipped = int(state.get("shipped", ckpt.step))
        # Batches shipped after the snapshot hold samples the snapshot still has queued: drop them.
        removed = self.run_dir.remove_steps_after(self.run_dir.rollouts, self.shipped)
        snap = sink_snapshot.unpack(state.get("sink"), state.get("tensors", {}))
        plan = sink_snapshot.restore_plan(
            snap,
            list(self.source.resume_requests),
            self.shipped + 1,
            self.spec.max_off_policy_steps,
            self.spec.group_size,
        )
        if snap.counters:
            self.sink.counters = SinkCounters(**snap.counters)
        self.sink.queue = plan.queue
        for group_id, task, episodes in plan.open_groups:
            self.sink.open_groups[group_id] = OpenGroup(group_id, task, list(episodes))
        self.source.resume_requests = deque(plan.resume_requests)
        self._next_member = {r.group_id: r.next_member for r in plan.resume_requests}
        self.sink.counters.samples_dropped_stale += len(plan.dropped_samples)
        self.sink.counters.members_left_out_stale += len(plan.dropped_episodes)
        dropped = [s.trace.episode_id for s in plan.dropped_samples] + [e.episode_id for e in plan.dropped_episodes]
        lost_without_snapshot = len(snap.pending_batch) + sum(len(eps) for _, _, eps in snap.open_groups)
        self.resume_report = {
            "from_step": ckpt.step,
            "from_attempt": state.get("attempt"),
            "shipped": self.shipped,
            "queued_traces": len(plan.queue),
            "open_groups": plan.groups,
            "finished_episodes_kept": plan.episodes_kept,
            "dropped_stale": len(dropped),
            "resume_requests": len(plan.resume_requests),
            "members_requested": sum(r.n for r in plan.resume_requests),
            "progress_only_would_lose": lost_without_snapshot,
            "removed_batches": removed,
            "time": time.time(),
        }
        self.ledger.write(
            "resumed",
            from_attempt=state.get("attempt"),
            snapshot_line=state.get("ledger_line"),
            step=ckpt.step,
            **{k: v for k, v in self.resume_report.items() if k not in ("from_step", "from_attempt", "time")},
        )
        if dropped:
            self._record("dropped_stale", dropped, step=self.shipped + 1, at="resume")
        for r in plan.resume_requests:
            self.ledger.write("redispatch_requested", group=r.group_id, n=r.n, first_member=r.first_member)
        weights = self.run_dir.trainer_checkpoint(ckpt.step)
        await push_weights(list(self.dispatcher.clients.values()), weights, ckpt.step, self.reference)
        log.info(
            "Resuming with %d queued traces and %d open groups (%d finished episodes kept); "
            "step %d, %d batches shipped, %d stale dropped, %d members to re-dispatch, task cursor %d",
            len(plan.queue), plan.groups, plan.episodes_kept, ckpt.step, self.shipped, len(dropped),
            self.resume_report["members_requested"], self.source.cursor,
        )  # fmt: skip
        return True

    # -- the loop ------------------------------------------------------------------------------

    def _fill(self) -> None:
        """Dispatch new groups while the flow-control budget (module docstring) allows."""
        if self.paused:
            return
        k = self.spec.max_off_policy_steps
        g = self.spec.group_size
        last_useful_step = min(self.policy_version + 1 + k, self.max_steps)
        budget = self.spec.batch_size * (last_useful_step - self.shipped)
        committed = len(self.sink.queue) + self.sink.open_members + self.dispatcher.outstanding_samples
        while committed < budget and self.dispatcher.inflight_samples + g <= self.spec.rollout.max_inflight:
            request = self.source.next_group(g)
            self.ledger.write(
                "dispatched",
                group=request.group_id,
                task=request.task.index,
                env=request.task.env,
                first_member=request.first_member,
                n=request.n,
                v=self.policy_version,
            )
            self.dispatcher.dispatch(request, self.policy_version)
            self._next_member[request.group_id] = max(self._next_member.get(request.group_id, 0), request.next_member)
            committed += request.n

    async def _maybe_ship(self) -> None:
        while self.shipped < self.max_steps and not self.paused:
            # Cutting a batch and counting it shipped straddle an await (the file write): a snapshot
            # taken in between would hold the batch neither in its queue nor as shipped, and a resume
            # would lose it. The save lock keeps snapshots out of that window.
            async with self._save_lock:
                if self.paused:
                    return
                step = self.shipped + 1
                batch = self.sink.take_batch(step)
                if batch is None:
                    return
                await asyncio.to_thread(
                    write_batch, self.run_dir.rollout_batch(step), step, batch, self.pad_id, self.attempt
                )
                self.shipped = step
                self.ledger.write("shipped", step=step, ids=[s.trace.episode_id for s in batch])
            self._write_metrics(step, batch)
            floor = self.sink.min_fresh(step + 1)
            cancelled = self.dispatcher.cancel_stale(floor)
            for r in cancelled:
                self.ledger.write("cancelled", group=r.group_id, first_member=r.first_member, n=r.n)
                self._after_cancel(r, floor)
            if cancelled:
                log.info("cancelled %d in-flight groups that can no longer train", len(cancelled))

    def _after_cancel(self, request: GroupRequest, floor: int) -> None:
        """A stale request of a group was cancelled: finish or abandon the group, never orphan it.

        The group's finished members older than ``floor`` are dropped (they could not train);
        if fresh members remain, or other requests of the group are still out, the cancelled
        members are requested again (same task and group id, new member numbers) before any
        new task; otherwise the group is abandoned. Without this, a half-finished group would
        wait forever for members that were cancelled, and hold flow-control budget.
        """
        g = request.group_id
        group = self.sink.open_groups.get(g)
        fresh = []
        if group is not None:
            stale = [e for e in group.episodes if e.policy_version < floor]
            fresh = [e for e in group.episodes if e.policy_version >= floor]
            if stale:
                self.sink.counters.members_left_out_stale += len(stale)
                self._record("dropped_stale", [e.episode_id for e in stale], group=g, at="cancel")
            group.episodes = fresh
        still_out = any(r.group_id == g for r in self.dispatcher.emitted_requests())
        if fresh or still_out:
            first = self._next_member.get(g, request.next_member)
            self.source.add_resume_request(GroupRequest(g, request.task, request.n, first))
            self._next_member[g] = first + request.n
        elif group is not None:
            del self.sink.open_groups[g]

    def _write_metrics(self, step: int, batch) -> None:
        now = time.monotonic()
        elapsed = max(now - self._last_ship_time, 1e-9)
        rewards = self.sink.drain_recent_rewards()
        staleness = [(step - 1) - s.trace.policy_version for s in batch]
        c = self.sink.counters
        line = {
            "step": step,
            "attempt": self.attempt,
            "policy_version": self.policy_version,
            "reward_mean": sum(rewards) / len(rewards) if rewards else None,
            "episodes_scored": len(rewards),
            "batch_reward_mean": sum(s.reward for s in batch) / len(batch),
            "completion_len_mean": sum(len(s.completion_ids) for s in batch) / len(batch),
            "staleness_mean": sum(staleness) / len(staleness),
            "staleness_max": max(staleness),
            "queue": len(self.sink.queue),
            "open_groups": len(self.sink.open_groups),
            "inflight": self.dispatcher.inflight_samples,
            "groups_rejected": c.groups_rejected,
            "samples_dropped_stale": c.samples_dropped_stale,
            "groups_cancelled": self.dispatcher.cancelled_groups,
            "rollout_tokens_per_s": self._tokens_since_ship / elapsed,
            "step_time_s": elapsed,
            "time": time.time(),
        }
        self._tokens_since_ship = 0
        self._last_ship_time = now
        self._metrics_file.write(json.dumps(line) + "\n")
        self._metrics_file.flush()
        log.info(
            "shipped step %d: reward %.3f, staleness %.2f (max %d), queue %d, %.0f tok/s, %.2f s",
            step, line["reward_mean"] or 0.0, line["staleness_mean"], line["staleness_max"],
            line["queue"], line["rollout_tokens_per_s"], elapsed,
        )  # fmt: skip

    async def _follow_trainer(self) -> None:
        """Load new broadcasts into the rollout servers; complete trainer checkpoints with our part."""
        while True:
            broadcasts = {
                n: p for n, p in step_dirs(self.run_dir.broadcasts).items() if n > self.policy_version and self._ours(p)
            }
            newest = max(broadcasts, default=0)
            if newest > self.policy_version and not self.paused:
                seconds = await push_weights(
                    list(self.dispatcher.clients.values()), broadcasts[newest], newest, self.reference
                )
                log.info("policy version %d -> %d (weight update %.3f s)", self.policy_version, newest, seconds)
                self.policy_version = newest
                for n, p in step_dirs(self.run_dir.broadcasts).items():
                    if n < newest:
                        shutil.rmtree(p, ignore_errors=True)
                self._fill()
            if not self.paused:
                for n in sorted(step_dirs(self.run_dir.checkpoints)):
                    if n > self.last_saved_checkpoint and self._trainer_part_ok(n):
                        await self._save_checkpoint(n, reason="periodic")
            await asyncio.sleep(self.poll_s)

    def capture(self, step: int) -> tuple[dict, sink_snapshot.SinkSnapshot]:
        """The orchestrator's part of checkpoint ``step``, copied on the event loop (no awaits)."""
        self.ledger._fh.flush()
        state = {
            "step": step,
            "shipped": self.shipped,
            "policy_version": self.policy_version,
            "attempt": self.attempt,
            "ledger_line": self.ledger.lines - 1,
            "source": self.source.state(),
            "identity": run_identity(self.spec),
            "time": time.time(),
        }
        return state, sink_snapshot.capture(self.sink, self.dispatcher)

    async def _save_checkpoint(self, step: int, reason: str) -> dict:
        async with self._save_lock:
            state, snap = self.capture(step)
            self.ledger.write("snapshot", step=step, reason=reason, ledger_line=state["ledger_line"])
            path = self.run_dir.orchestrator_checkpoint(step) / "progress.pt"

            def write() -> None:
                os.fsync(self.ledger._fh.fileno())  # the ledger lines the snapshot refers to are durable first
                sink_state, tensors = sink_snapshot.pack(snap)
                write_file_atomic(path, lambda fh: write_progress(fh, {**state, "sink": sink_state}, tensors))

            t0 = time.perf_counter()
            await asyncio.to_thread(write)
            self.last_saved_checkpoint = max(self.last_saved_checkpoint, step)
            result = {
                "step": step,
                "queued_traces": len(snap.pending_batch),
                "open_groups": len(
                    {g for g, _, _ in snap.open_groups} | {r.group_id for r in snap.emitted_train_groups}
                ),
                "finished_episodes_kept": sum(len(eps) for _, _, eps in snap.open_groups),
                "path": str(path),
                "reason": reason,
                "seconds": round(time.perf_counter() - t0, 4),
                "time": time.time(),
            }
            self.last_snapshot = result
            removed = await asyncio.to_thread(prune_checkpoints, self.run_dir, self.spec.checkpoint.keep_last)
            kept = complete_steps(self.run_dir)
            if kept:
                for n, p in step_dirs(self.run_dir.rollouts).items():
                    if n <= kept[0]:
                        shutil.rmtree(p, ignore_errors=True)
            log.info(
                "checkpoint step %d complete (%s, %s): %d queued traces, %d open groups, %d finished episodes kept; pruned %s",
                step, path, reason, result["queued_traces"], result["open_groups"],
                result["finished_episodes_kept"], removed or "nothing",
            )  # fmt: skip
            return result

    def _done(self) -> bool:
        return self.shipped >= self.max_steps and self.last_saved_checkpoint >= self.max_steps

    def request_stop(self) -> None:
        """Make :meth:`run` return (after a pause, the process then exits)."""
        self._stop.set()

    def _install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        state: dict = {"signals": 0}

        def on_term() -> None:
            state["signals"] += 1
            if state["signals"] > 1:
                log.warning("second termination signal: exiting now (files on disk stay consistent)")
                os._exit(143)
            timeout = self.spec.preemption.snapshot_timeout_seconds
            log.info("SIGTERM: pausing and writing the snapshot (deadline %d s)", timeout)
            loop.call_later(timeout, lambda: (log.error("snapshot deadline passed; exiting"), os._exit(1)))

            async def graceful() -> None:
                try:
                    await self.pause()
                except Exception as exc:
                    self.pause_error = exc
                    log.error("SIGTERM: could not write the snapshot (%s); exiting without one", exc)
                finally:
                    self.request_stop()

            state["task"] = loop.create_task(graceful())

        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, on_term)

    async def run(self) -> int:
        """Run until batch ``max_steps`` is shipped and checkpointed, or a pause then stop; returns the step.

        Raises:
            OrchestratorError: unusable run dir or rollout servers that never get healthy.
            CheckpointMismatch: ``--resume`` against a checkpoint of a different run.
        """
        sys.setswitchinterval(LOOP_SWITCH_INTERVAL_S)
        self._install_signal_handlers()
        if self.control is not None:
            await self.control.start()
        tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, self.model_path)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if Path(self.model_path).is_dir():
            self.reference = await asyncio.to_thread(weights_signature, self.model_path)
        self.dispatcher = Dispatcher(
            self.rollout_urls,
            encode=lambda text: tokenizer.encode(text, add_special_tokens=False),
            decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
            eos_id=tokenizer.eos_token_id,
            envs=self.envs,
            sampling=self.spec.sampling,
            results=self.results,
            client_factory=self.client_factory,
            members_per_request=self.spec.rollout.members_per_request,
        )
        follower = None
        try:
            await self._wait_healthy()
            if self._stop.is_set():  # stopped (SIGTERM after a pause) before it started
                log.info("stopped before starting")
                return self.shipped
            if not (self.resume and await self._restore()):
                if self.resume:
                    self._start_over()
                else:
                    self._check_fresh_run_dir()
                if self.reference is not None:  # servers may hold another run's weights: start from ours
                    await push_weights(list(self.dispatcher.clients.values()), self.model_path, 0, self.reference)
            self._metrics_file = open(self.run_dir.metrics, "a")  # noqa: SIM115 - open for the run
            if not self.paused:  # a pause during set-up stands
                self.phase = "running"
            follower = asyncio.create_task(self._follow_trainer())
            self._last_ship_time = time.monotonic()
            log.info(
                "orchestrator running (attempt %d): step %d of %d, endpoints %s",
                self.attempt, self.shipped, self.max_steps, self.rollout_urls,
            )  # fmt: skip
            await self._maybe_ship()  # a restored full batch ships at once
            self._fill()
            while not self._done() and not self._stop.is_set():
                if follower.done():
                    follower.result()  # re-raises its error
                if self.dispatcher.failures:
                    raise self.dispatcher.failures[0]
                if self.paused:  # wait to be stopped; results are regenerated after resume
                    await asyncio.sleep(self.poll_s)
                    continue
                try:
                    results = [await asyncio.wait_for(self.results.get(), timeout=self.poll_s)]
                except asyncio.TimeoutError:
                    results = []
                if self.paused:  # a snapshot was taken meanwhile and lists these as emitted: they are re-run
                    continue
                while not self.results.empty():
                    results.append(self.results.get_nowait())
                for result in results:
                    self.dispatcher.take(result)
                    self._consume(result)
                await self._maybe_ship()
                self._fill()
            if self._done():
                self.phase = "done"
                leftover = [s.trace.episode_id for s in self.sink.queue]
                leftover += [e.episode_id for g in self.sink.open_groups.values() for e in g.episodes]
                if leftover:
                    self._record("leftover", leftover)
                log.info("orchestrator done: %d steps shipped and checkpointed", self.shipped)
            return self.shipped
        finally:
            if follower is not None:
                follower.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await follower
            if self._done():  # the last save's prune may have been cut short by the cancel: retention holds
                await asyncio.to_thread(prune_checkpoints, self.run_dir, self.spec.checkpoint.keep_last)
            await self.dispatcher.aclose()
            if self.control is not None:
                await self.control.stop()
            if self._metrics_file is not None:
                self._metrics_file.close()
            self.ledger.close()

    def _consume(self, result: GroupResult) -> None:
        self._tokens_since_ship += result.tokens
        for e in result.episodes:
            self.ledger.write("finished", id=e.episode_id, reward=round(e.reward, 6), v=e.policy_version)
        g = result.request.group_id
        self.sink.add_episodes(g, result.request.task, result.episodes, self.shipped + 1)
        if g not in self.sink.open_groups and not any(r.group_id == g for r in self.dispatcher.emitted_requests()):
            self._next_member.pop(g, None)  # the group is scored: forget its numbering


__all__ = ["GroupRequest", "Orchestrator", "OrchestratorError"]
