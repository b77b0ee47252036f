"""Pure recovery state machine: the status patches that start, advance and finish a recovery.

A recovery lives in ``status.recovery`` (:class:`~rlrun.api.status.Recovery`). The reconciler
(``reconcile.py``) writes each patch *before* it takes the stage's action, and every action
is idempotent by name, so an operator killed between any two stages and restarted finishes
the recovery exactly once::

    trigger seen ──► Pausing ──► Stopping ──┬──► Starting ──► Resuming ──► (done: Resumed)
       (counted)    POST /pause  delete pods │   create the    wait for the new
                    (live orch-  and wait    │   next attempt  orchestrator's
                    estrator     until gone  │   (or a rollout resume report
                    only)        (force on a │   replacement:
                                 lost node)  │   done at once)
                                             └──► Suspended ──(spec.suspend false)──► Starting

Counts: ``preemptions``, ``suspensions`` and ``failures`` are added when the recovery starts
(in the same patch that records it), never again for the same recovery. Only failures use
``spec.failure_policy.backoff_limit``; a failure past it, or a permanent one, ends the run
``Failed`` instead of starting a recovery.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rlrun.api.control import ResumeReport
from rlrun.api.status import ConditionType, Phase, Reason, Recovery, RecoveryKind, Stage, Trigger

from rlrun_operator.disruption import Disruption
from rlrun_operator.status import now_rfc3339, resume_totals, set_condition

#: Most nodes remembered in ``status.failedNodes`` (the oldest are forgotten: a run kept off every
#: node of a small cluster would never be scheduled again).
MAX_FAILED_NODES = 16
#: Most pod names remembered in ``status.deletedPods``.
MAX_DELETED_PODS = 128

COUNTS = {
    RecoveryKind.PREEMPTION: "preemptions",
    RecoveryKind.SUSPENSION: "suspensions",
    RecoveryKind.FAILURE: "failures",
}


def recovery_of(status: dict[str, Any]) -> Recovery | None:
    """The recovery in progress, parsed (None: none)."""
    raw = status.get("recovery")
    return Recovery.model_validate(raw) if raw else None


def _dump(recovery: Recovery | None) -> dict[str, Any] | None:
    # every field is written (None included), so a merge patch replaces the whole record
    return recovery.model_dump(mode="json") if recovery is not None else None


def remember(names: Sequence[str], more: Sequence[str], limit: int) -> list[str]:
    """``names`` with ``more`` appended (no duplicates; the oldest dropped past ``limit``)."""
    out = [n for n in names if n not in more] + list(dict.fromkeys(more))
    return out[-limit:]


def deleting(status: dict[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """The patch recording that the operator is about to delete pods ``names`` (before it does)."""
    return {"deletedPods": remember(status.get("deletedPods") or [], names, MAX_DELETED_PODS)}


def _conditions(status: dict[str, Any], generation: int | None, now: str, *updates) -> list[dict[str, Any]]:
    conditions = list(status.get("conditions") or [])
    for type_, value, reason, message in updates:
        conditions = set_condition(conditions, type_, value, reason, message, generation, now)
    return conditions


def begin(
    status: dict[str, Any],
    generation: int | None,
    found: Sequence[Disruption],
    *,
    orchestrator_alive: bool,
    backoff_limit: int,
    now: str | None = None,
) -> tuple[dict[str, Any], Recovery | None]:
    """The patch starting a recovery for the disruptions ``found`` (non-empty), counted once.

    Scope ``rollout`` when only rollout pods were hit (the attempt goes on), else ``attempt``.
    Kind ``preemption`` when any disruption is one, else ``failure``. The first stage is
    ``Pausing`` when the attempt restarts and its orchestrator is alive (not hit itself,
    not terminating, not ended), else ``Stopping``.

    Returns:
        ``(patch, recovery)``; ``recovery`` is None when the run fails instead (a permanent
        failure, or more failures than ``backoff_limit``): the patch then marks it ``Failed``.
    """
    now = now or now_rfc3339()
    first = found[0]
    permanent = next((d for d in found if d.permanent), None)
    if permanent is not None:
        message = f"{permanent.message}: an error retrying cannot heal"
        return failed_patch(status, generation, permanent.reason, message, now), None
    preempted = [d for d in found if d.kind == RecoveryKind.PREEMPTION]
    kind = RecoveryKind.PREEMPTION if preempted else RecoveryKind.FAILURE
    lead = preempted[0] if preempted else first
    count = (status.get(COUNTS[kind]) or 0) + 1
    patch: dict[str, Any] = {COUNTS[kind]: count}
    if kind == RecoveryKind.FAILURE and count > backoff_limit:
        message = f"{lead.message}: failure {count}, more than spec.failure_policy.backoff_limit ({backoff_limit})"
        return {**patch, **failed_patch(status, generation, Reason.BACKOFF_LIMIT_EXCEEDED, message, now)}, None
    scope = "rollout" if all(d.component == "rollout" for d in found) else "attempt"
    lost = [d.node for d in found if d.node_lost and d.node]
    if lost:
        patch["failedNodes"] = remember(status.get("failedNodes") or [], lost, MAX_FAILED_NODES)
    recovery = Recovery(
        trigger=lead.trigger,
        kind=kind,
        reason=lead.reason,
        message="; ".join(d.message for d in found),
        scope=scope,
        pods=sorted({d.pod for d in found}),
        node=lead.node,
        stage=Stage.PAUSING if scope == "attempt" and orchestrator_alive else Stage.STOPPING,
        since=now,
        stageSince=now,
        attempt=status.get("attempt"),
    )
    patch["recovery"] = _dump(recovery)
    if scope == "attempt":
        patch["phase"] = Phase.RECOVERING
        patch["message"] = f"recovering attempt {recovery.attempt}: {recovery.message}"
    updates = (
        [(ConditionType.READY, False, Reason.RESUMING, f"recovering: {recovery.message}")] if scope == "attempt" else []
    )
    if kind == RecoveryKind.PREEMPTION:
        updates.append((ConditionType.PREEMPTED, True, lead.trigger, recovery.message))
    else:
        updates.append((ConditionType.DEGRADED, True, Reason.POD_FAILED, f"failure {count}: {recovery.message}"))
    patch["conditions"] = _conditions(status, generation, now, *updates)
    return patch, recovery


def begin_suspension(
    status: dict[str, Any], generation: int | None, *, orchestrator_alive: bool, now: str | None = None
) -> tuple[dict[str, Any], Recovery]:
    """The patch starting a suspension (``spec.suspend`` set on a running, pending or failed run), counted once."""
    now = now or now_rfc3339()
    recovery = Recovery(
        trigger=Trigger.SUSPEND,
        kind=RecoveryKind.SUSPENSION,
        reason="SpecSuspend",
        message="spec.suspend is true",
        stage=Stage.PAUSING if orchestrator_alive else Stage.STOPPING,
        since=now,
        stageSince=now,
        attempt=status.get("attempt"),
    )
    patch = {
        "suspensions": (status.get("suspensions") or 0) + 1,
        "recovery": _dump(recovery),
        "message": "suspending: pausing the orchestrator, then removing the pods",
        "conditions": _conditions(
            status, generation, now, (ConditionType.READY, False, Reason.SUSPENDED, "suspending")
        ),
    }
    return patch, recovery


def created_suspended(status: dict[str, Any], generation: int | None, now: str | None = None) -> dict[str, Any]:
    """The patch of a run created with ``spec.suspend``: no pods, waiting (not counted as a suspension)."""
    now = now or now_rfc3339()
    recovery = Recovery(
        trigger=Trigger.SUSPEND, kind=RecoveryKind.SUSPENSION, reason="CreatedSuspended",
        message="created with spec.suspend", stage=Stage.SUSPENDED, since=now, stageSince=now,
    )  # fmt: skip
    return {**suspended_patch(status, generation, "created suspended", now), "recovery": _dump(recovery)}


def to_stage(recovery: Recovery, stage: str, now: str | None = None, **fields: Any) -> dict[str, Any]:
    """The patch moving ``recovery`` to ``stage`` (with other Recovery ``fields`` changed)."""
    now = now or now_rfc3339()
    return {"recovery": _dump(recovery.model_copy(update={"stage": stage, "stageSince": now, **fields}))}


def suspended_patch(
    status: dict[str, Any], generation: int | None, message: str, now: str | None = None
) -> dict[str, Any]:
    """The patch of a suspended run (pods gone; ``Failed`` cleared: unsuspending retries)."""
    now = now or now_rfc3339()
    updates = [
        (t, False, Reason.SUSPENDED, message)
        for t in (ConditionType.READY, ConditionType.PROGRESSING, ConditionType.DEGRADED, ConditionType.FAILED)
    ]
    conditions = _conditions(status, generation, now, *updates)
    return {"phase": Phase.SUSPENDED, "observedGeneration": generation, "message": message, "conditions": conditions}


def failed_patch(
    status: dict[str, Any], generation: int | None, reason: str, message: str, now: str | None = None
) -> dict[str, Any]:
    """The patch of a run that cannot go on (``Failed`` True with ``reason``; no recovery left in progress)."""
    now = now or now_rfc3339()
    updates = [(ConditionType.FAILED, True, reason, message)]
    updates += [
        (t, False, reason, message) for t in (ConditionType.READY, ConditionType.PROGRESSING, ConditionType.SUCCEEDED)
    ]
    if any(c.get("type") == ConditionType.PREEMPTED for c in status.get("conditions") or []):
        updates.append((ConditionType.PREEMPTED, False, reason, ""))
    conditions = _conditions(status, generation, now, *updates)
    return {
        "phase": Phase.FAILED, "observedGeneration": generation, "message": message, "conditions": conditions,
        "recovery": None,
    }  # fmt: skip


def started(
    status: dict[str, Any],
    generation: int | None,
    recovery: Recovery | None,
    attempt: int,
    rollout_replicas: int | None = None,
    now: str | None = None,
) -> dict[str, Any]:
    """The patch after attempt ``attempt``'s pods were created: ``Pending``, or ``Recovering`` at ``Resuming``
    until its orchestrator confirms what it restored (no recovery: a first start, nothing to confirm)."""
    now = now or now_rfc3339()
    message = f"attempt {attempt}: pods created, waiting for the orchestrator to start"
    updates = [
        (ConditionType.READY, False, Reason.RESUMING if recovery else Reason.STARTING, message),
        (ConditionType.PROGRESSING, True, Reason.STARTING, message),
        (ConditionType.DEGRADED, False, Reason.AS_EXPECTED, ""),
        (ConditionType.SUCCEEDED, False, Reason.STARTING, ""),
        (ConditionType.FAILED, False, Reason.STARTING, ""),
    ]
    patch = {
        "phase": Phase.RECOVERING if recovery and recovery.kind != RecoveryKind.SUSPENSION else Phase.PENDING,
        "observedGeneration": generation,
        "attempt": attempt,
        "rolloutReplicas": rollout_replicas,
        "message": message,
        "conditions": _conditions(status, generation, now, *updates),
        # printer columns show 0, not blank
        **{
            k: status.get(k) or 0
            for k in (
                "preemptions",
                "suspensions",
                "failures",
                "step",
                "resumedGroups",
                "resumedTraces",
                "resumedEpisodes",
            )
        },
    }
    if recovery is not None:
        patch.update(to_stage(recovery, Stage.RESUMING, now, nextAttempt=attempt))
    return patch


def resume_message(report: ResumeReport) -> str:
    """``resumed at step S with Q queued traces and G open groups (E finished episodes kept)``."""
    return (
        f"resumed at step {report.from_step} with {report.queued_traces} queued traces and "
        f"{report.resumed_groups} open groups ({report.finished_episodes_kept} finished episodes kept)"
    )


def finished(
    status: dict[str, Any],
    generation: int | None,
    recovery: Recovery,
    report: ResumeReport | None,
    attempt: int,
    now: str | None = None,
) -> dict[str, Any]:
    """The patch ending ``recovery``: the resumed orchestrator of ``attempt`` answered (``report``: what it
    restored, None: it found no complete checkpoint and started over), or a rollout replacement was created.

    Sets ``Resumed`` (True with :func:`resume_message`, or False ``StartedOver``), clears ``Preempted``,
    adds the report to the resume totals and ``lastResume`` once, and removes ``status.recovery``.
    """
    now = now or now_rfc3339()
    patch: dict[str, Any] = {"recovery": None}
    updates = []
    if any(c.get("type") == ConditionType.PREEMPTED for c in status.get("conditions") or []):
        updates.append((ConditionType.PREEMPTED, False, Reason.RECOVERED, f"recovered from: {recovery.message}"))
    if recovery.scope == "attempt":
        if report is not None:
            updates.append((ConditionType.RESUMED, True, Reason.RESUMED, f"attempt {attempt} {resume_message(report)}"))
            patch.update(resume_totals(status, report, attempt))
        else:
            message = f"attempt {attempt} found no complete checkpoint and started from step 0"
            updates.append((ConditionType.RESUMED, False, Reason.STARTED_OVER, message))
    patch["conditions"] = _conditions(status, generation, now, *updates)
    return patch
