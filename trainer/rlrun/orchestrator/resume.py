"""How an orchestrator attempt begins — a fresh run, a resume, or a start-over — and what it records as it stops.

- **Fresh** (no ``--resume``): the run directory must hold no run yet.
- **Resume** (:func:`restore`): from the newest complete checkpoint (both parts verify;
  a torn or corrupt one is skipped for the previous). Batches a dead attempt shipped after
  the snapshot are deleted (their samples are queued again in the snapshot); the queue is
  swept against the next step to ship; every saved group is completed with its same task
  and group id before any new task (invariants 2 and 3).
- **Start-over** (``--resume`` with no complete checkpoint, :func:`start_over`): what dead
  attempts left past step 0 is discarded and their ledger events rolled back, so the
  operator can pass ``--resume`` to every attempt.

**Stop** (:func:`record_stop`): every way an attempt stops but a kill — done, paused, an error — ends its ledger
with ``leftover`` (the episodes it still holds, and the tasks with work out or requested) and ``stopped`` (the
outcome), so ``rlrun ledger check`` finds a fate for every episode and task; a later resume from an earlier snapshot
rolls them back with the rest. A killed attempt writes neither: the check then counts what it held as pending.

Both put back the episode journal's records after the cut of what they start from
(:func:`rlrun.orchestrator.journal_files.replay`) before the staleness sweep and group completion, so
no episode a dead attempt acknowledged is lost; the ledger gets a ``replayed`` event with their
ids, and every attempt between the checkpoint's and this one is rolled back whole (its work is
either replayed from its journal or regenerated).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from dataclasses import dataclass, field

from rlrun.api.control import ResumeReport
from rlrun.api.spec import RLRunSpec
from rlrun.checkpoint import latest_complete_checkpoint
from rlrun.envs.base import Task
from rlrun.errors import OrchestratorError
from rlrun.identity import check_compatible
from rlrun.ledger import Ledger, LedgerEvent, ledger_attempts
from rlrun.orchestrator.conversations import KeptConversations
from rlrun.orchestrator.groups import GroupRequest
from rlrun.orchestrator.journal_files import FRESH_BASE, JournalRecord, journal_root, replay
from rlrun.orchestrator.sink import TrainSink
from rlrun.orchestrator.snapshot import RestorePlan, SinkSnapshot, restore_plan, unpack
from rlrun.orchestrator.source import TrainSource
from rlrun.rundir import RunDir, holds_a_run, step_dirs
from rlrun.samples import Episode

log = logging.getLogger(__name__)


def check_fresh_run_dir(run_dir: RunDir) -> None:
    """Refuse a run directory that already holds a run (:func:`rlrun.rundir.holds_a_run`: checkpoints or batches
    past step 0; step 0 may be the trainer's start-up checkpoint of this very run).

    Raises:
        OrchestratorError: naming what is there and what to do.
    """
    leftovers = holds_a_run(run_dir)
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
    event from no snapshot (line −1), so the ledger check does not count them. (The journals of
    the attempts that also began from nothing are then replayed by :func:`begin_attempt`.)
    Returns the batch steps removed.
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


@dataclass(frozen=True)
class Stages:
    """The stages an attempt's beginning restores (as the orchestrator holds them).

    Attributes:
        source: the train source (its state, task cursor and member numbering).
        sink: the train sink (its queue, open groups and counters).
        ledger: where the resume's events go (its ``attempt`` is this attempt's).
        kept: where the multi-turn episodes a resume continues are kept (None: nowhere).
    """

    source: TrainSource
    sink: TrainSink
    ledger: Ledger
    kept: KeptConversations | None = None


@dataclass(frozen=True)
class ResumePlan:
    """What a resume puts back, worked out once (for its report, then to apply it).

    Attributes:
        snapshot: the checkpoint's sink snapshot with the journal's records added.
        replayed: the journaled episodes the snapshot did not have (:func:`with_journal`).
        records: the journal records read after the cut.
        plan: the staleness rule of the next step applied, every group's missing members
            (:func:`~rlrun.orchestrator.snapshot.restore_plan`).
        unjournaled: tasks drawn after the snapshot with nothing journaled (:func:`unjournaled_tasks`), requested
            again whole.
    """

    snapshot: SinkSnapshot
    replayed: list[Episode]
    records: list[JournalRecord]
    plan: RestorePlan
    unjournaled: list[int] = field(default_factory=list)


def unjournaled_tasks(cursor: int, records: list[JournalRecord]) -> list[int]:
    """Tasks a dead attempt drew after the snapshot (``cursor``: the snapshot's task cursor) that the journal
    ``records`` hold nothing of, below the newest task they hold: the cursor moves past them with the replay, so they
    must be requested again (their requests were in flight, or their episodes not yet durable, when the attempt
    died)."""
    drawn = {r.group_id for r in records if r.group_id >= cursor}
    return sorted(set(range(cursor, max(drawn) + 1)) - drawn) if drawn else []


def with_journal(snap: SinkSnapshot, records: list[JournalRecord]) -> tuple[SinkSnapshot, list[Episode]]:
    """The snapshot as it would have been with the journal ``records`` (after its cut) added to the sink.

    Each record's episodes join their group's saved open group (a new open group when it has none):
    they finished after the snapshot was taken, so neither its queue nor its open groups hold them.
    An episode id the snapshot already holds is skipped and logged (the cut rules it out; a duplicate
    would train twice). A turn record replaces the snapshot's conversation of its episode when it has more
    turns; a conversation whose episode finished is not kept. Returns the new snapshot (``snap`` is not
    changed) and the episodes added, in order.
    """
    held = {s.trace.episode_id for s in snap.pending_batch}
    groups: dict[int, tuple[int, Task, list[Episode]]] = {}
    for g, task, eps in snap.open_groups:
        groups[g] = (g, task, list(eps))
        held.update(e.episode_id for e in eps)
    conversations = {c.episode_id: c for c in snap.conversations}
    added: list[Episode] = []
    for rec in records:
        if rec.conversation is not None:
            c, before = rec.conversation, conversations.get(rec.conversation.episode_id)
            if before is None or c.turns >= before.turns:
                conversations[c.episode_id] = c
            continue
        group = groups.setdefault(rec.group_id, (rec.group_id, rec.task, []))
        for e in rec.episodes:
            if e.episode_id in held:
                skipped = "journal record %d of attempt %d: episode %s is in the snapshot already; skipped"
                log.warning(skipped, rec.seq, rec.attempt, e.episode_id)
                continue
            held.add(e.episode_id)
            group[2].append(e)
            added.append(e)
    kept = [c for eid, c in sorted(conversations.items()) if eid not in held]
    merged = SinkSnapshot(
        snap.pending_batch, list(groups.values()), snap.emitted_train_groups, dict(snap.counters), kept
    )
    return merged, added


def plan_resume(
    snap: SinkSnapshot, records: list[JournalRecord], spec: RLRunSpec, source: TrainSource, shipped: int
) -> ResumePlan:
    """``snap`` plus the journal ``records``, with the staleness rule of step ``shipped + 1`` applied and every
    group completed against ``source``'s pending requests (its state already loaded), and every task the replay moves
    the cursor past with nothing journaled (:func:`unjournaled_tasks`) requested again whole. Changes nothing."""
    merged, added = with_journal(snap, records)
    unjournaled = unjournaled_tasks(source.cursor, records)
    pending = [*source.resume_requests, *(GroupRequest(g, source.task_at(g), spec.group_size) for g in unjournaled)]
    plan = restore_plan(merged, pending, shipped + 1, spec.max_off_policy_steps, spec.group_size)
    return ResumePlan(merged, added, records, plan, unjournaled)


def put_back(resume: ResumePlan, stages: Stages, shipped: int) -> None:
    """Apply ``resume`` to the ``stages``' source and sink (and ``kept``: the conversations continued).

    Writes the ``replayed`` ledger event, moves the task cursor past every group the records name
    (a group a dead attempt opened after the snapshot must not be drawn again as a new task), then
    restores the sink and the source's member numbering; writes ``continued`` for the multi-turn episodes
    continued at their last durable turn and ``turns_dropped`` for the others.
    """
    source, sink, ledger, kept = stages.source, stages.sink, stages.ledger, stages.kept
    if resume.replayed:
        records = resume.records
        attempts = sorted({r.attempt for r in records})
        ids = [e.episode_id for e in resume.replayed]
        ledger.write(LedgerEvent.REPLAYED, ids=ids, attempts=attempts, records=len(records))
        source.cursor = max(source.cursor, max(r.group_id for r in records) + 1)
    if resume.unjournaled:  # passed by the cursor above: requested again whole (restore_plan's to_complete)
        log.info(
            "resume: tasks %s were drawn after the snapshot and nothing of them was journaled: requested again",
            resume.unjournaled,
        )
    sink.restore(resume.plan, resume.snapshot.counters, shipped + 1)
    plan = resume.plan
    source.restore(list(resume.snapshot.taken_members()), plan.to_complete, plan.continued)
    if plan.continued:
        c = plan.continued
        ledger.write(
            LedgerEvent.CONTINUED,
            ids=[x.episode_id for x in c],
            turns=[x.turns for x in c],
            v=[x.policy_version for x in c],
            floor=plan.floor,
        )
        if kept is not None:
            kept.carry(c)
    for why in sorted({why for _, why in plan.dropped_conversations}):
        ids = sorted(c.episode_id for c, w in plan.dropped_conversations if w == why)
        ledger.write(LedgerEvent.TURNS_DROPPED, ids=ids, reason=why)


async def begin_attempt(resume: bool, run_dir: RunDir, spec: RLRunSpec, stages: Stages) -> Restored | None:
    """Begin an attempt: :func:`restore` with ``resume`` (:func:`start_over` when nothing is complete),
    else :func:`check_fresh_run_dir`. Returns what was restored, or None for a start from step 0.

    Raises:
        OrchestratorError: a fresh start in a run directory that holds a run.
        CheckpointMismatch: the newest complete checkpoint belongs to a run with other settings.
    """
    if not resume:
        check_fresh_run_dir(run_dir)
        return None
    restored = await restore(run_dir, spec, stages)
    if restored is None:
        source, sink, ledger = stages.source, stages.sink, stages.ledger
        start_over(run_dir, ledger, ledger.attempt)
        records = await asyncio.to_thread(replay, journal_root(run_dir), FRESH_BASE, ledger.attempt)
        if records:
            resume_plan = plan_resume(SinkSnapshot([], [], []), records, spec, source, 0)
            put_back(resume_plan, stages, 0)
            log.info(
                "resume: starting over with %d journaled episodes replayed (%d open groups, %d queued traces)",
                sum(len(r.episodes) for r in records),
                len(resume_plan.plan.open_groups),
                len(sink.queue),
            )
    return restored


@dataclass(frozen=True)
class Restored:
    """What :func:`restore` restored.

    Attributes:
        step: the complete checkpoint resumed from (the policy version the servers must load).
        shipped: batches shipped when its snapshot was taken (the next batch is ``shipped + 1``).
        report: the resume report (``GET /status``'s ``resume``).
        journal_base: where this attempt's journal begins (``base.json``,
            :func:`~rlrun.orchestrator.journal_files.replay`).
        replayed: journaled episodes put back.
        policy_version: the policy the rollout servers held when the snapshot was taken (≥ ``step`` when the
            trainer had trained past its checkpoint; the step itself for a checkpoint written before it was kept).
    """

    step: int
    shipped: int
    report: ResumeReport
    journal_base: dict | None = None
    replayed: int = 0
    policy_version: int = 0


async def restore(run_dir: RunDir, spec: RLRunSpec, stages: Stages) -> Restored | None:
    """Restore the ``stages`` (source, sink, kept conversations) from the newest complete checkpoint; None when there
    is none.

    Raises:
        CheckpointMismatch: the checkpoint belongs to a run with other settings (names the fields), or an env's
            data changed since it was written.
    """
    ckpt = await asyncio.to_thread(latest_complete_checkpoint, run_dir)
    if ckpt is None:
        log.info("resume: no complete checkpoint in %s; starting from step 0", run_dir.root)
        return None
    source, ledger = stages.source, stages.ledger
    state = ckpt.orchestrator
    envs = {env.name: env for env in source.envs}  # their data's fingerprints: a resume over changed data is refused
    check_compatible(state.get("identity"), spec, str(run_dir.orchestrator_checkpoint(ckpt.step)), envs)
    source.load_state(state["source"], state.get("tensors", {}))
    shipped = int(state.get("shipped", ckpt.step))
    # Batches shipped after the snapshot hold samples the snapshot still has queued: drop them.
    removed = run_dir.remove_steps_after(run_dir.rollouts, shipped)
    snap = unpack(state.get("sink"), state.get("tensors", {}))
    cut = state.get("journal") or {}
    base = {"step": ckpt.step, "attempt": cut.get("attempt", state.get("attempt")), "seq": cut.get("seq")}
    records = await asyncio.to_thread(replay, journal_root(run_dir), base, ledger.attempt)
    replayed = sum(len(r.episodes) for r in records)
    resume_plan = plan_resume(snap, records, spec, source, shipped)
    plan = resume_plan.plan
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
        conversations_continued=len(plan.continued),
        turns_kept=sum(c.turns for c in plan.continued),
        time=time.time(),
    )
    ledger.write(
        LedgerEvent.RESUMED,
        from_attempt=report.from_attempt,
        snapshot_line=state.get("ledger_line"),
        step=ckpt.step,
        report=report.model_dump(mode="json"),
        journal_replayed=replayed,
    )
    # Attempts after the checkpoint's died without completing one of their own: their events are rolled
    # back whole (their journaled episodes come back through the replay, the rest is regenerated).
    for between in ledger_attempts(ledger.path.parent, "orchestrator"):
        if report.from_attempt is not None and report.from_attempt < between < ledger.attempt:
            ledger.write(LedgerEvent.RESUMED, from_attempt=between, snapshot_line=-1, step=ckpt.step)
    put_back(resume_plan, stages, shipped)
    for r in source.resume_requests:
        ledger.write(LedgerEvent.REDISPATCH_REQUESTED, group=r.group_id, members=r.members, first_member=r.first_member)
    log.info(
        "Resuming with %d queued traces, %d open groups (%d finished episodes kept) and %d requested groups; "
        "step %d, %d batches shipped, %d stale dropped, %d members requested again, task cursor %d",
        report.queued_traces,
        report.open_groups,
        report.finished_episodes_kept,
        report.requested_groups,
        ckpt.step,
        shipped,
        report.dropped_stale,
        report.members_requested,
        source.cursor,
    )
    if plan.continued or plan.dropped_conversations:
        log.info(
            "resume: %d multi-turn episodes continued at their last durable turn (%d turns kept, none sampled "
            "again); %d started over (%s)",
            report.conversations_continued,
            report.turns_kept,
            len(plan.dropped_conversations),
            ", ".join(sorted({w for _, w in plan.dropped_conversations})) or "-",
        )
    if records:
        log.info(
            "resume: replayed %d journaled episodes (%d records of attempts %s after the cut %s)",
            replayed,
            len(records),
            sorted({r.attempt for r in records}),
            base,
        )
    policy = min(int(state.get("policy_version", ckpt.step)), shipped)  # a policy is never newer than its batches
    return Restored(ckpt.step, shipped, report, base, replayed, policy)


def record_stop(
    stages: Stages, out: list[GroupRequest], step: int, outcome: str | None, error: BaseException | None
) -> None:
    """The attempt's last ledger lines (module docstring): its kept conversations end (``turns_dropped``, reason
    ``done`` or the outcome), ``leftover`` names the episodes queued or in open groups and the groups of the requests
    ``out`` (in flight, delivered not taken) or requested again, and ``stopped`` says the outcome at ``step`` batches
    shipped: ``outcome`` (``complete``, ``paused``) or, when None, ``error`` (with it) or ``interrupted`` (cancelled,
    or stopped without a pause)."""
    outcome = outcome or ("error" if isinstance(error, Exception) else "interrupted")
    if stages.kept is not None:
        stages.kept.drop_all("done" if outcome == "complete" else outcome)
    ids = stages.sink.unfinished_episode_ids()
    groups = sorted({r.group_id for r in [*stages.source.resume_requests, *out]})
    if ids or groups:
        stages.ledger.write(LedgerEvent.LEFTOVER, ids=ids, groups=groups, reason=outcome)
    fields = {"error": f"{type(error).__name__}: {error}"[:500]} if outcome == "error" and error is not None else {}
    stages.ledger.write(LedgerEvent.STOPPED, outcome=outcome, step=step, **fields)
