"""How an orchestrator attempt begins: a fresh run, a resume, or a start-over.

- **Fresh** (no ``--resume``): the run directory must hold no run yet.
- **Resume** (:func:`restore`): from the newest complete checkpoint (both parts verify;
  a torn or corrupt one is skipped for the previous). Batches a dead attempt shipped after
  the snapshot are deleted (their samples are queued again in the snapshot); the queue is
  swept against the next step to ship; every saved group is completed with its same task
  and group id before any new task (invariants 2 and 3).
- **Start-over** (``--resume`` with no complete checkpoint, :func:`start_over`): what dead
  attempts left past step 0 is discarded and their ledger events rolled back, so the
  operator can pass ``--resume`` to every attempt.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from dataclasses import dataclass

from rlrun.api.control import ResumeReport
from rlrun.api.spec import RLRunSpec
from rlrun.checkpoint import check_compatible, latest_complete_checkpoint
from rlrun.ledger import Ledger, LedgerEvent, ledger_attempts
from rlrun.orchestrator.errors import OrchestratorError
from rlrun.orchestrator.sink import TrainSink
from rlrun.orchestrator.snapshot import restore_plan, unpack
from rlrun.orchestrator.source import TrainSource
from rlrun.rundir import RunDir, step_dirs

log = logging.getLogger(__name__)


def check_fresh_run_dir(run_dir: RunDir) -> None:
    """Refuse a run directory that already holds a run (checkpoints or batches past step 0).

    Step 0 is the trainer's start-up checkpoint of this very run, so it does not count.

    Raises:
        OrchestratorError: naming what is there and what to do.
    """
    leftovers = [p for p in (run_dir.checkpoints, run_dir.rollouts) if any(n > 0 for n in step_dirs(p))]
    if leftovers:
        raise OrchestratorError(
            f"{run_dir.root} already holds a run ({', '.join(str(p) for p in leftovers)}); "
            "resume it with --resume or choose another --run-dir"
        )


def start_over(run_dir: RunDir, ledger: Ledger, attempt: int) -> list[int]:
    """``--resume`` with no complete checkpoint: start from step 0, discarding what dead attempts left.

    An attempt killed before its first complete checkpoint leaves batches (and orchestrator
    parts) past step 0 that nothing can resume from; they go (the trainer removes its own parts
    and broadcasts), and every earlier attempt's ledger events are rolled back by a ``resumed``
    event from no snapshot (line −1), so the ledger check does not count them. Returns the
    batch steps removed.
    """
    removed = run_dir.remove_steps_after(run_dir.rollouts, 0)
    for n in step_dirs(run_dir.checkpoints):
        if n > 0:
            shutil.rmtree(run_dir.orchestrator_checkpoint(n), ignore_errors=True)
    for earlier in ledger_attempts(ledger.path.parent, "orchestrator"):
        if earlier < attempt:
            ledger.write(LedgerEvent.RESUMED, from_attempt=earlier, snapshot_line=-1, step=0, removed_batches=removed)
    if removed:
        log.info("resume: starting over from step 0; removed batches %s left by an earlier attempt", removed)
    return removed


async def begin_attempt(
    resume: bool, run_dir: RunDir, spec: RLRunSpec, source: TrainSource, sink: TrainSink, ledger: Ledger
) -> Restored | None:
    """Begin an attempt: :func:`restore` with ``resume`` (:func:`start_over` when nothing is complete),
    else :func:`check_fresh_run_dir`. Returns what was restored, or None for a start from step 0.

    Raises:
        OrchestratorError: a fresh start in a run directory that holds a run.
        CheckpointMismatch: the newest complete checkpoint belongs to a run with other settings.
    """
    if not resume:
        check_fresh_run_dir(run_dir)
        return None
    restored = await restore(run_dir, spec, source, sink, ledger)
    if restored is None:
        start_over(run_dir, ledger, ledger.attempt)
    return restored


@dataclass(frozen=True)
class Restored:
    """What :func:`restore` restored.

    Attributes:
        step: the complete checkpoint resumed from (the policy version the servers must load).
        shipped: batches shipped when its snapshot was taken (the next batch is ``shipped + 1``).
        report: the resume report (``GET /status``'s ``resume``).
    """

    step: int
    shipped: int
    report: ResumeReport


async def restore(
    run_dir: RunDir, spec: RLRunSpec, source: TrainSource, sink: TrainSink, ledger: Ledger
) -> Restored | None:
    """Restore the source and the sink from the newest complete checkpoint; None when there is none.

    Raises:
        CheckpointMismatch: the checkpoint belongs to a run with other settings (names the fields).
    """
    ckpt = await asyncio.to_thread(latest_complete_checkpoint, run_dir)
    if ckpt is None:
        log.info("resume: no complete checkpoint in %s; starting from step 0", run_dir.root)
        return None
    state = ckpt.orchestrator
    check_compatible(state.get("identity"), spec, str(run_dir.orchestrator_checkpoint(ckpt.step)))
    source.load_state(state["source"])
    shipped = int(state.get("shipped", ckpt.step))
    # Batches shipped after the snapshot hold samples the snapshot still has queued: drop them.
    removed = run_dir.remove_steps_after(run_dir.rollouts, shipped)
    snap = unpack(state.get("sink"), state.get("tensors", {}))
    plan = restore_plan(snap, list(source.resume_requests), shipped + 1, spec.max_off_policy_steps, spec.group_size)
    report = ResumeReport(
        from_step=ckpt.step,
        from_attempt=state.get("attempt"),
        shipped=shipped,
        queued_traces=len(plan.queue),
        open_groups=len(plan.open_groups),
        requested_groups=plan.requested_groups,
        finished_episodes_kept=plan.episodes_kept,
        dropped_stale=len(plan.dropped_samples) + len(plan.dropped_episodes),
        members_requested=plan.members_requested,
        progress_only_would_lose=len(snap.pending_batch) + sum(len(eps) for _, _, eps in snap.open_groups),
        removed_batches=removed,
        time=time.time(),
    )
    ledger.write(
        LedgerEvent.RESUMED,
        from_attempt=report.from_attempt,
        snapshot_line=state.get("ledger_line"),
        step=ckpt.step,
        report=report.model_dump(mode="json"),
    )
    sink.restore(plan, snap.counters, shipped + 1)
    source.restore(list(snap.taken_members()), plan.to_complete)
    for r in source.resume_requests:
        ledger.write(LedgerEvent.REDISPATCH_REQUESTED, group=r.group_id, members=r.members, first_member=r.first_member)
    log.info(
        "Resuming with %d queued traces, %d open groups (%d finished episodes kept) and %d requested groups; "
        "step %d, %d batches shipped, %d stale dropped, %d members requested again, task cursor %d",
        report.queued_traces, report.open_groups, report.finished_episodes_kept, report.requested_groups,
        ckpt.step, shipped, report.dropped_stale, report.members_requested, source.cursor,
    )  # fmt: skip
    return Restored(ckpt.step, shipped, report)
