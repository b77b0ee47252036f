"""Pure recovery state machine: the status patches that start, advance and finish a recovery.

A recovery lives in ``status.recovery`` (:class:`~rlrun.api.status.Recovery`). The reconciler
(``reconcile.py``) writes each patch *before* it takes the stage's action, and every action
is idempotent by name, so an operator killed between any two stages and restarted finishes
the recovery exactly once::

    trigger seen ──► Pausing ──► Stopping ──┬──► Starting ──► Resuming ──► (done: Resumed)
       (counted)    POST /pause  delete pods │   create the    wait for the new
                    (live orch-  and wait    │   next attempt  orchestrator's
                    estrator     until gone  │   (or a rollout resume report (trainer
                    only)        (force on a │   replacement:  scope: the replacement
                                 lost node)  │   done at once) trainer running)
                                             └──► Suspended ──(spec.suspend false)──► Starting

Scopes (:func:`scope_of`): ``attempt`` restarts every pod as the next attempt; ``rollout`` replaces
only lost rollout pods (no pause, no wait: a rollout server keeps no state); ``trainer`` replaces
the lost trainer (and any rollout pods lost with it) in the same attempt, with no pause: the old
trainer must be gone before its replacement starts (two trainers must never write the run
directory at once), and the recovery ends when the replacement runs. A multi-node trainer is one
trainer: losing any of its pods replaces **all** of them together (``recovery.pods`` lists the
whole group, so each gets a replacement name, and none is created before every old one is gone:
the ranks of one group rendezvous with each other only), and the recovery ends when every node's
replacement runs.

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

from rlrun_operator import naming
from rlrun_operator.disruption import Disruption
from rlrun_operator.status import PodView, now_rfc3339, resume_totals, set_condition

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


def scope_of(found: Sequence[Disruption], orchestrator_node: str | None = None) -> str:
    """Which pods a recovery from the disruptions ``found`` (non-empty) restarts.

    | pods hit | scope | what restarts |
    |---|---|---|
    | rollout pods only | ``rollout`` | those rollout pods, in the same attempt |
    | the trainer (and maybe rollout pods), not the orchestrator | ``trainer`` | those and the trainer's other pods¹ |
    | the orchestrator, or the trainer or a rollout pod on its lost node | ``attempt`` | all pods, as the next attempt |

    ¹ Every other pod of a multi-node trainer, in the same attempt.

    The last rule is "a pod on a node that is going away is lost": a node's notice may reach the
    trainer's pod (``DisruptionTarget``) before the orchestrator's, and that is one loss, not two.
    Preemption or failure does not change the scope: a crashed trainer is replaced alone too (its
    replacement resumes from the same checkpoint and batch files a full restart would give it).

    Args:
        found: the disruptions seen at once.
        orchestrator_node: the node of the attempt's orchestrator pod (None: not scheduled, or none).
    """
    components = {d.component for d in found}
    lost = {d.node for d in found if d.node_lost and d.node}
    if naming.ORCHESTRATOR in components or (orchestrator_node is not None and orchestrator_node in lost):
        return "attempt"
    if components == {naming.ROLLOUT}:
        return "rollout"
    return "trainer"


def begin(
    status: dict[str, Any],
    generation: int | None,
    found: Sequence[Disruption],
    *,
    orchestrator_alive: bool,
    backoff_limit: int,
    orchestrator_node: str | None = None,
    trainer_group: Sequence[str] = (),
    now: str | None = None,
) -> tuple[dict[str, Any], Recovery | None]:
    """The patch starting a recovery for the disruptions ``found`` (non-empty), counted once.

    Scope from :func:`scope_of` (``orchestrator_node``: the node of the attempt's orchestrator). Scope
    ``trainer`` widens ``recovery.pods`` to the whole ``trainer_group`` (the names of the attempt's trainer
    pods: every node of a multi-node trainer restarts together).
    Kind ``preemption`` when any disruption is one, else ``failure``. The first stage is
    ``Pausing`` when the attempt restarts and its orchestrator is alive (not hit itself,
    not terminating, not ended), else ``Stopping`` (a rollout or trainer replacement never
    pauses the orchestrator: it keeps running through it). Scopes ``attempt`` and ``trainer``
    make the run ``Recovering`` with ``Ready`` False (``Resuming``): without a trainer it trains nothing.

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
    scope = scope_of(found, orchestrator_node)
    lost = [d.node for d in found if d.node_lost and d.node]
    if lost:
        patch["failedNodes"] = remember(status.get("failedNodes") or [], lost, MAX_FAILED_NODES)
    recovery = Recovery(
        trigger=lead.trigger,
        kind=kind,
        reason=lead.reason,
        message="; ".join(d.message for d in found),
        scope=scope,
        pods=sorted({d.pod for d in found} | (set(trainer_group) if scope == "trainer" else set())),
        node=lead.node,
        stage=Stage.PAUSING if scope == "attempt" and orchestrator_alive else Stage.STOPPING,
        since=now,
        stageSince=now,
        attempt=status.get("attempt"),
    )
    patch["recovery"] = _dump(recovery)
    if scope != "rollout":
        patch["phase"] = Phase.RECOVERING
        what = "replacing the trainer of attempt" if scope == "trainer" else "recovering attempt"
        patch["message"] = f"{what} {recovery.attempt}: {recovery.message}"
    updates = (
        [(ConditionType.READY, False, Reason.RESUMING, f"recovering: {recovery.message}")] if scope != "rollout" else []
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
        trigger=Trigger.SUSPEND,
        kind=RecoveryKind.SUSPENSION,
        reason="CreatedSuspended",
        message="created with spec.suspend",
        stage=Stage.SUSPENDED,
        since=now,
        stageSince=now,
    )
    return {**suspended_patch(status, generation, "created suspended", now), "recovery": _dump(recovery)}


def following_attempt(attempt: int | None) -> int:
    """The number of the attempt after ``attempt`` (``status.attempt``; None: no attempt yet, so 0)."""
    return 0 if attempt is None else int(attempt) + 1


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
        "phase": Phase.FAILED,
        "observedGeneration": generation,
        "message": message,
        "conditions": conditions,
        "recovery": None,
    }


def succeeded(status: dict[str, Any], generation: int | None, now: str | None = None) -> dict[str, Any]:
    """The patch of a run that trained every step: ``Succeeded`` True (``Completed``; the message names
    ``status.maxSteps``), ``Ready``, ``Progressing``, ``Degraded`` and ``Failed`` False, ``Preempted`` cleared when a
    recovery was in progress, the recovery closed, ``step`` and ``progress`` at the end."""
    now = now or now_rfc3339()
    steps = status.get("maxSteps")
    message = f"all {steps} steps trained" if steps else "training finished"
    updates = [
        (ConditionType.SUCCEEDED, True, Reason.COMPLETED, message),
        (ConditionType.FAILED, False, Reason.COMPLETED, ""),
        (ConditionType.READY, False, Reason.COMPLETED, "the run has finished"),
        (ConditionType.PROGRESSING, False, Reason.COMPLETED, message),
        (ConditionType.DEGRADED, False, Reason.COMPLETED, ""),
    ]
    if status.get("recovery") and any(c.get("type") == ConditionType.PREEMPTED for c in status.get("conditions") or []):
        updates.append((ConditionType.PREEMPTED, False, Reason.COMPLETED, ""))
    patch = {
        "phase": Phase.SUCCEEDED,
        "message": message,
        "conditions": _conditions(status, generation, now, *updates),
        "observedGeneration": generation,
        "recovery": None,
    }
    if steps:
        patch["step"] = steps
        patch["progress"] = {"percent": 100, "text": "100%", "eta": "-", "etaSeconds": None}
    return patch


def held_by_finalizers(
    status: dict[str, Any], generation: int | None, held: Sequence[PodView], now: str | None = None
) -> tuple[dict[str, Any], str | None]:
    """``(patch, warning)``: the patch saying that a recovery waits for the pods ``held`` terminating by finalizers
    (``Degraded`` True, ``PodStuckTerminating``), or, none held, taking that back (``Degraded`` False, ``AsExpected``);
    empty when nothing is new. ``warning``: the message of the Warning Event due (None: none)."""
    degraded = next((c for c in status.get("conditions") or [] if c.get("type") == ConditionType.DEGRADED), {})
    if held:
        message = (
            "; ".join(f"pod {p.name} is held terminating by finalizers {', '.join(p.finalizers)}" for p in held)
            + ": the recovery goes on once it is gone (whatever owns a finalizer must remove it)"
        )
        if degraded.get("status") == "True" and degraded.get("message") == message:
            return {}, None
        update, warning = (ConditionType.DEGRADED, True, Reason.POD_STUCK_TERMINATING, message), message
    elif degraded.get("reason") == Reason.POD_STUCK_TERMINATING:
        update, warning = (ConditionType.DEGRADED, False, Reason.AS_EXPECTED, ""), None
    else:
        return {}, None
    return {"conditions": _conditions(status, generation, now, update)}, warning


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


def replaced(
    status: dict[str, Any], generation: int | None, recovery: Recovery, attempt: int, now: str | None = None
) -> dict[str, Any]:
    """The patch after a trainer-scope recovery created its replacement pods (``recovery.replacements``):
    ``Resuming`` until the replacement trainer runs, the run ``Recovering`` with ``Ready`` False (``Resuming``)."""
    now = now or now_rfc3339()
    message = f"attempt {attempt}: {', '.join(recovery.replacements)} created, waiting for the trainer to start"
    return {
        **to_stage(recovery, Stage.RESUMING, now),
        "phase": Phase.RECOVERING,
        "message": message,
        "conditions": _conditions(status, generation, now, (ConditionType.READY, False, Reason.RESUMING, message)),
    }


def trainer_replaced_message(recovery: Recovery, attempt: int) -> str:
    """``attempt N goes on: only the trainer was replaced (OLD by NEW, …)``: the ``Resumed`` message and Event
    of a trainer-scope recovery (``recovery.pods`` / ``replacements``, in the same order)."""
    pairs = ", ".join(f"{old} by {new}" for old, new in zip(recovery.pods, recovery.replacements, strict=False))
    rollouts = sum(1 for p in recovery.pods if naming.is_rollout_pod_name(p))
    also = f" and {rollouts} rollout server(s) were" if rollouts else " was"
    return (
        f"attempt {attempt} goes on: only the trainer{also} replaced ({pairs}); the trainer resumes with --resume "
        "from the newest complete checkpoint, the orchestrator and the other rollout servers kept running"
    )


def resume_message(report: ResumeReport) -> str:
    """``resumed at step S with Q queued traces and G open groups (E finished episodes kept)``, and ``; C multi-turn
    episodes resumed at turn > 1 (T turns kept)`` when any were."""
    message = (
        f"resumed at step {report.from_step} with {report.queued_traces} queued traces and "
        f"{report.resumed_groups} open groups ({report.finished_episodes_kept} finished episodes kept)"
    )
    if report.conversations_continued:
        message += (
            f"; {report.conversations_continued} multi-turn episodes resumed at turn > 1 "
            f"({report.turns_kept} turns kept)"
        )
    return message


def finished(
    status: dict[str, Any],
    generation: int | None,
    recovery: Recovery,
    report: ResumeReport | None,
    attempt: int,
    now: str | None = None,
) -> dict[str, Any]:
    """The patch ending ``recovery``: the resumed orchestrator of ``attempt`` answered (``report``: what it
    restored, None: it found no complete checkpoint and started over), a rollout replacement was created,
    or a trainer replacement runs.

    Sets ``Resumed`` (True with :func:`resume_message`, or False ``StartedOver``; for a trainer replacement
    True with :func:`trainer_replaced_message`), clears ``Preempted``, adds the report to the resume totals and
    ``lastResume`` once (scope ``attempt``: the only one whose orchestrator restores), and removes
    ``status.recovery``.
    """
    now = now or now_rfc3339()
    patch: dict[str, Any] = {"recovery": None}
    updates = []
    if any(c.get("type") == ConditionType.PREEMPTED for c in status.get("conditions") or []):
        updates.append((ConditionType.PREEMPTED, False, Reason.RECOVERED, f"recovered from: {recovery.message}"))
    if recovery.scope == "trainer":
        updates.append((ConditionType.RESUMED, True, Reason.RESUMED, trainer_replaced_message(recovery, attempt)))
    elif recovery.scope == "attempt":
        if report is not None:
            updates.append((ConditionType.RESUMED, True, Reason.RESUMED, f"attempt {attempt} {resume_message(report)}"))
            patch.update(resume_totals(status, report, attempt))
        else:
            message = f"attempt {attempt} found no complete checkpoint and started from step 0"
            updates.append((ConditionType.RESUMED, False, Reason.STARTED_OVER, message))
    patch["conditions"] = _conditions(status, generation, now, *updates)
    return patch
