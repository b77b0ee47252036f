"""A read-only view of the orchestrator: the numbers its status report, its Prometheus metrics and its stall report
read, taken at one instant.

The orchestrator builds it (:meth:`~rlrun.orchestrator.loop.Orchestrator.view`, through :func:`view_of`) in one go,
with no ``await`` in between, so its numbers agree with each other; the readers — :func:`.control.status_report`
(``GET /status``), :class:`.prometheus.OrchestratorCollector` (``GET /metrics``) and :func:`.liveness.stall_accounting`
— read its fields and never the orchestrator's stages. A number a reader needs is a field here, given its value in
:func:`view_of`, which alone reads the orchestrator (typed by :class:`Viewed`, the part of it a view is made of).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from rlrun.api.control import CheckpointWritten, OrchestratorPhase, PauseResult, ResumeReport
from rlrun.orchestrator.admission import Admission
from rlrun.orchestrator.checkpointing import CheckpointManager
from rlrun.orchestrator.conversations import KeptConversations
from rlrun.orchestrator.dispatcher import Dispatcher
from rlrun.orchestrator.evaluation import EvalRounds
from rlrun.orchestrator.flow import FlowControl
from rlrun.orchestrator.follower import WeightFollower
from rlrun.orchestrator.journal import Journal
from rlrun.orchestrator.metrics import StepMetrics
from rlrun.orchestrator.sink import SinkCounters, TrainSink
from rlrun.orchestrator.source import TrainSource


@dataclass(frozen=True)
class WorkDetail:
    """Where the work is, item by item: what the stall report lists (built only for it, listing costs time).

    Attributes:
        finished: ``{group id: finished members kept}`` of each open group, in the sink's order.
        out: ``{group id: [(first member, members, server or None between tries), …]}`` of the requests in flight.
        delivered_not_taken: ``(group id, first member)`` of each result in the queue the loop has not taken, sorted.
        requested: ``(group id, first member, members)`` of each request waiting to be dispatched, in order.
        newest_broadcast: the newest policy this attempt's trainer published (None: none is there).
        max_off_policy_steps: the staleness bound, steps (``spec.max_off_policy_steps``).
        weights_held: an evaluation round holds the weight pushes.
    """

    finished: dict[int, int]
    out: dict[int, list[tuple[int, int, str | None]]]
    delivered_not_taken: list[tuple[int, int]]
    requested: list[tuple[int, int, int]]
    newest_broadcast: int | None
    max_off_policy_steps: int
    weights_held: bool


@dataclass(frozen=True)
class OrchestratorView:
    """The orchestrator at one instant (module docstring). Counts are samples unless named otherwise.

    Attributes:
        phase: the orchestrator's phase.
        attempt_number: its attempt number as given (``--attempt``: the operator's count), not the run
            directory's.
        run_dir_attempt: the run-directory attempt its files are stamped with.
        step: batches shipped.
        cut: the last batch cut from the queue, shipped or being written (flow control counts it shipped).
        max_steps: the step the run ends at.
        policy_version: the policy the rollout servers hold (trainer steps).
        hold_below: nothing is dispatched while the servers hold an older policy (after a resume).
        last_checkpoint_step: the newest complete checkpoint (−1: none yet).
        last_checkpoint: the newest orchestrator part written (None: none yet).
        last_pause: the last pause's answer (None: none yet).
        resume: how this attempt resumed (None: it started fresh).
        rollout_endpoints: the rollout servers in use, sorted (before the dispatcher exists: those given).
        queued: samples queued for a batch.
        open_groups: groups with members finished and others still to come.
        finished_episodes_kept: finished members kept in open groups.
        inflight_samples: completions requested from the rollout servers and not yet returned.
        requested_groups: requests waiting to be dispatched (resume requests).
        conversations_kept: multi-turn episodes kept at a durable turn.
        journaled_not_admitted: requests journaled and not yet admitted (waiting for their group commit).
        committed: samples committed to the next batches (:meth:`.flow.FlowControl.committed`).
        budget: samples that may be committed now (:meth:`.flow.FlowControl.budget`; may be ≤ 0).
        counters: a copy of the sink's cumulative counters.
        requests_cancelled: rollout requests cancelled (stale, failed, lost).
        rewards_failed: members whose reward failed in this attempt.
        tasks_skipped: tasks the curriculum passed over, over the run (restored by a resume).
        journal_records: records appended to this attempt's episode journal.
        journal_fsyncs: group commits of the journal.
        journal_bytes: bytes written to the journal.
        weight_update_seconds: the last weight update's time (None: none yet).
        served_mismatch_kl: the trainer–sampler mismatch of the newest version probed, nats/token (None:
            none).
        updates_unverified: server updates whose weights were not the published ones, in this attempt.
        eval_rounds_dropped: held-out evaluation rounds dropped in this attempt.
        eval_hold_seconds: seconds evaluation rounds held the weight pushes in this attempt.
        last_step_metrics: the last ``metrics.jsonl`` line (None before the first step).
        weight_transfer: the servers' weight updates in this attempt by path, and the fallbacks from memory to the
            files (:meth:`.weight_transfer.TransferTotals.line`).
        work: the stall report's lists (None unless asked for).
    """

    phase: OrchestratorPhase
    attempt_number: int
    run_dir_attempt: int
    step: int
    cut: int
    max_steps: int
    policy_version: int
    hold_below: int
    last_checkpoint_step: int
    last_checkpoint: CheckpointWritten | None
    last_pause: PauseResult | None
    resume: ResumeReport | None
    rollout_endpoints: list[str]
    queued: int
    open_groups: int
    finished_episodes_kept: int
    inflight_samples: int
    requested_groups: int
    conversations_kept: int
    journaled_not_admitted: int
    committed: int
    budget: int
    counters: SinkCounters
    requests_cancelled: int
    rewards_failed: int
    tasks_skipped: int
    journal_records: int
    journal_fsyncs: int
    journal_bytes: int
    weight_update_seconds: float | None
    served_mismatch_kl: float | None
    updates_unverified: int
    eval_rounds_dropped: int
    eval_hold_seconds: float
    last_step_metrics: Mapping[str, Any] | None
    weight_transfer: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    work: WorkDetail | None = None


class Viewed(Protocol):
    """The part of the orchestrator (:class:`~rlrun.orchestrator.loop.Orchestrator`) a view is made of: its position
    in the run and the stages whose numbers it reads."""

    phase: OrchestratorPhase
    attempt_number: int
    attempt: int
    shipped: int
    cut: int
    max_steps: int
    hold_below: int
    last_pause: PauseResult | None
    resume_report: ResumeReport | None
    rollout_urls: list[str]
    sink: TrainSink
    source: TrainSource
    dispatcher: Dispatcher | None
    flow: FlowControl
    checkpoints: CheckpointManager
    weights: WeightFollower
    metrics: StepMetrics
    journal: Journal | None
    admission: Admission
    kept: KeptConversations
    evaluation: EvalRounds


def view_of(orch: Viewed, detail: bool = False) -> OrchestratorView:
    """``orch`` now (no awaits: the numbers agree); ``detail``: with the stall report's lists (:class:`WorkDetail`),
    which cost time with much work out, and a look at the run directory (the newest broadcast)."""
    d = orch.dispatcher
    sink = orch.sink
    journal = orch.journal
    push = orch.weights.last_push
    version = orch.weights.version
    return OrchestratorView(
        phase=orch.phase,
        attempt_number=orch.attempt_number,
        run_dir_attempt=orch.attempt,
        step=orch.shipped,
        cut=orch.cut,
        max_steps=orch.max_steps,
        policy_version=version,
        hold_below=orch.hold_below,
        last_checkpoint_step=orch.checkpoints.last_step,
        last_checkpoint=orch.checkpoints.last_written,
        last_pause=orch.last_pause,
        resume=orch.resume_report,
        rollout_endpoints=sorted(d.pool.clients if d is not None else orch.rollout_urls),
        queued=len(sink.queue),
        open_groups=len(sink.open_groups),
        finished_episodes_kept=sink.finished_episodes_kept,
        inflight_samples=d.inflight_samples if d is not None else 0,
        requested_groups=len(orch.source.resume_requests),
        conversations_kept=len(orch.kept),
        journaled_not_admitted=orch.admission.unadmitted,
        committed=orch.flow.committed(sink, d),
        budget=orch.flow.budget(version, orch.cut),
        counters=dataclasses.replace(sink.counters),
        requests_cancelled=d.cancelled_groups if d is not None else 0,
        rewards_failed=orch.metrics.reward_failed,
        tasks_skipped=orch.metrics.curriculum.skipped if orch.metrics.curriculum is not None else 0,
        journal_records=journal.next_seq if journal is not None else 0,
        journal_fsyncs=journal.fsyncs if journal is not None else 0,
        journal_bytes=journal.bytes_written if journal is not None else 0,
        weight_update_seconds=push.seconds if push is not None else None,
        served_mismatch_kl=orch.weights.mismatch.last,
        updates_unverified=orch.weights.unverified.total,
        eval_rounds_dropped=orch.metrics.eval_rounds_dropped,
        eval_hold_seconds=orch.metrics.eval_hold_seconds,
        last_step_metrics=orch.metrics.last_line,
        weight_transfer=orch.weights.transfers.line(),
        work=_work(orch) if detail else None,
    )


def _work(orch: Viewed) -> WorkDetail:
    inflight = orch.dispatcher.inflight if orch.dispatcher is not None else {}
    out: dict[int, list[tuple[int, int, str | None]]] = {}
    for (group, first), entry in inflight.items():
        out.setdefault(group, []).append((first, entry.request.members, entry.url))
    return WorkDetail(
        finished={g: len(o.episodes) for g, o in orch.sink.open_groups.items()},
        out=out,
        delivered_not_taken=sorted(orch.dispatcher.undelivered) if orch.dispatcher is not None else [],
        requested=[(r.group_id, r.first_member, r.members) for r in orch.source.resume_requests],
        newest_broadcast=orch.weights.newest_broadcast(),
        max_off_policy_steps=orch.flow.max_off_policy_steps,
        weights_held=orch.evaluation.holding,
    )
