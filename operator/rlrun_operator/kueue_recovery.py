"""Pure: the run's status patches of Kueue's stages — queueing, admission, eviction — and the rule that counts an
eviction once. :mod:`.kueue_stages` writes them; the Workload's own status patches are :mod:`.kueue`'s.

A queued run's recovery (trigger ``KueueAdmission``, stage ``Queued``) is not counted; an eviction is an
attempt-scope preemption (trigger ``KueueEviction``), counted in ``status.preemptions`` in the patch that records
it, once: not again when the run was already recovering from the same loss (:func:`same_interruption`).
"""

from __future__ import annotations

from typing import Any

from rlrun.api.status import ConditionType, EventReason, Phase, Reason, Recovery, RecoveryKind, Stage, Trigger

from rlrun_operator import kueue
from rlrun_operator.recovery import to_stage
from rlrun_operator.status import now_rfc3339, rfc3339_seconds, set_condition

#: Stages of its own eviction that another eviction does not take over (it would only count it twice).
OWN_STAGES = (Stage.PAUSING, Stage.STOPPING, Stage.STARTING)


def queue_record(name: str | None, workload: str, adm: kueue.Admission | None = None) -> dict[str, Any]:
    """``status.queue``: the LocalQueue ``name``, the Workload's name, and the admission ``adm`` (None: none)."""
    return {
        "name": name,
        "workload": workload,
        "admitted": adm is not None,
        "clusterQueue": adm.cluster_queue if adm else None,
        "flavors": adm.flavors if adm else None,
    }


def _admitted(status: dict[str, Any], generation: int | None, value: bool, reason: str, message: str) -> list:
    return set_condition(
        list(status.get("conditions") or []), ConditionType.ADMITTED, value, reason, message, generation
    )


def begin_queueing(generation: int | None, now: str | None = None) -> tuple[dict[str, Any], Recovery]:
    """The patch of a new run with the queue label: phase ``Queued``, its recovery at stage ``Queued`` (not counted)
    for attempt 0."""
    now = now or now_rfc3339()
    rec = Recovery(
        trigger=Trigger.KUEUE_ADMISSION,
        kind=RecoveryKind.SUSPENSION,
        reason="Created",
        message="waiting for Kueue",
        stage=Stage.QUEUED,
        since=now,
        stageSince=now,
        nextAttempt=0,
    )
    return {"recovery": rec.model_dump(mode="json"), "observedGeneration": generation, "phase": Phase.QUEUED}, rec


def queued(
    status: dict[str, Any],
    generation: int | None,
    queue: dict[str, Any],
    reason: str,
    message: str,
    extra: dict[str, Any] | None = None,
) -> tuple[dict[str, Any] | None, str | None]:
    """Phase ``Queued`` with ``Admitted`` False (``reason``: ``Queued``, ``FlavorConflict`` or ``KueueDisabled``) and
    the ``extra`` patch, in LocalQueue and Workload ``queue`` (:func:`queue_record`; not written when held).

    Returns:
        ``(patch, event)``: the patch (None: nothing new to write: the same reason and message, no ``extra``) and the
        :class:`~rlrun.api.status.EventReason` of the Event due when the run enters the phase or the reason
        changes (None: Kueue's message changed, the condition follows it without an Event); its message is the
        patch's.
    """
    old = next((c for c in status.get("conditions") or [] if c.get("type") == ConditionType.ADMITTED), {})
    text = f"queued in LocalQueue {queue['name']} (Workload {queue['workload']}): {message}"
    if reason == Reason.KUEUE_DISABLED:
        text = message
    patch = {"phase": Phase.QUEUED, "message": text, "conditions": _admitted(status, generation, False, reason, text)}
    if reason != Reason.KUEUE_DISABLED:
        patch["queue"] = queue
    entering = status.get("phase") != Phase.QUEUED or old.get("reason") != reason
    if not extra and not entering and old.get("message") == text:
        return None, None
    events = {Reason.QUEUED: EventReason.QUEUED, Reason.KUEUE_DISABLED: EventReason.KUEUE_DISABLED}
    return {**patch, **(extra or {})}, (events.get(reason, EventReason.FLAVOR_CONFLICT) if entering else None)


def unqueued(status: dict[str, Any], rec: Recovery, next_attempt: int, now: str | None = None) -> dict[str, Any]:
    """The patch of a queued run whose label was removed: ``Starting`` attempt ``next_attempt`` without Kueue (no
    ``Admitted`` condition, no ``status.queue``)."""
    conditions = [c for c in status.get("conditions") or [] if c.get("type") != ConditionType.ADMITTED]
    return {**to_stage(rec, Stage.STARTING, now, nextAttempt=next_attempt), "conditions": conditions, "queue": None}


def admitted(
    status: dict[str, Any],
    generation: int | None,
    rec: Recovery,
    next_attempt: int,
    queue: dict[str, Any],
    message: str,
    now: str | None = None,
) -> dict[str, Any]:
    """The patch of a queued run Kueue admitted (``message``: ``admitted by Kueue: …``): ``Starting`` attempt
    ``next_attempt``, ``Admitted`` True, ``status.queue`` the admission's ``queue`` (:func:`queue_record`)."""
    return {
        **to_stage(rec, Stage.STARTING, now, nextAttempt=next_attempt),
        "queue": queue,
        "conditions": _admitted(status, generation, True, Reason.ADMITTED, message),
        "message": message,
    }


def may_take_over(rec: Recovery | None) -> bool:
    """Whether an eviction takes over the recovery ``rec`` in progress: not a suspension's, not a queued run's, not
    its own eviction's up to ``Starting``."""
    if rec is None:
        return True
    if rec.kind == RecoveryKind.SUSPENSION or rec.stage == Stage.QUEUED:
        return False
    return not (rec.trigger == Trigger.KUEUE_EVICTION and rec.stage in OWN_STAGES)


def same_interruption(rec: Recovery | None, workload: dict[str, Any] | None) -> bool:
    """Whether Kueue's eviction of ``workload`` is the preemption the run is already recovering from
    (``rec``), made known late: ``rec`` is a preemption other than Kueue's own eviction (pods deleted,
    disrupted or gone), begun while the admission Kueue now takes back held (``QuotaReserved`` True since no
    later than ``rec.since``). Its pods were lost before Kueue's word arrived (something else deleted them
    first, or Kueue wrote ``Evicted`` after the operator had seen them go): one interruption, counted once.
    An eviction without a reservation (``QuotaLost``, ``WorkloadDeleted``), of a later admission, or during a
    failure's or a suspension's recovery is not."""
    if rec is None or rec.kind != RecoveryKind.PREEMPTION or rec.trigger == Trigger.KUEUE_EVICTION:
        return False
    reserved = kueue.reserved_since(workload)
    try:
        return reserved is not None and rfc3339_seconds(reserved) <= rfc3339_seconds(rec.since)
    except ValueError:  # a time that does not parse: counted, as before
        return False


def evicted(
    status: dict[str, Any],
    generation: int | None,
    ev: kueue.Eviction,
    queue_name: str | None,
    workload_name: str,
    *,
    taken: Recovery | None,
    same: bool,
    orchestrator_alive: bool,
    now: str | None = None,
) -> tuple[dict[str, Any], Recovery]:
    """The patch of Kueue's eviction ``ev`` of the run's Workload ``workload_name``: an attempt-scope preemption at
    ``Pausing`` (``Stopping`` without a live orchestrator), phase ``Evicted``, ``Ready`` and ``Admitted`` False
    (``Evicted``), ``Preempted`` True, ``status.queue`` not admitted (the run's record, or :func:`queue_record` of
    LocalQueue ``queue_name`` when it has none). It takes over ``taken`` (the recovery in progress, or None); ``same``:
    ``taken`` is this very loss (:func:`same_interruption`): not counted again, ``taken``'s start time kept.

    Returns:
        ``(patch, recovery)``; the patch's ``recovery.message`` is the Event's.
    """
    now = now or now_rfc3339()
    message = ev.describe(workload_name)
    if same and taken is not None:
        message += f"; the run was recovering from its pods' loss ({taken.trigger}): counted once"
    rec = Recovery(
        trigger=Trigger.KUEUE_EVICTION,
        kind=RecoveryKind.PREEMPTION,
        reason=ev.reason,
        message=message,
        stage=Stage.PAUSING if orchestrator_alive else Stage.STOPPING,  # no pod "hit": the orchestrator is paused first
        since=taken.since if same and taken is not None else now,
        stageSince=now,
        attempt=status.get("attempt"),
    )
    conditions = list(status.get("conditions") or [])
    for type_, value, reason in (
        (ConditionType.READY, False, Reason.EVICTED),
        (ConditionType.PREEMPTED, True, Trigger.KUEUE_EVICTION),
        (ConditionType.ADMITTED, False, Reason.EVICTED),
    ):
        conditions = set_condition(conditions, type_, value, reason, message, generation, now)
    patch = {
        "preemptions": (status.get("preemptions") or 0) + (0 if same else 1),
        "recovery": rec.model_dump(mode="json"),
        "phase": Phase.EVICTED,
        "message": f"evicted: {message}; pausing, then stopping the pods",
        "conditions": conditions,
        "queue": {**(status.get("queue") or queue_record(queue_name, workload_name)), "admitted": False},
    }
    return patch, rec
