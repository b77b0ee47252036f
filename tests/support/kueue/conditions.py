"""The Workload status transitions Kueue writes, as pure functions on a Workload's ``status`` dict.

Each mirrors the Kueue v0.13 function of the same name in ``pkg/workload`` (``SetQuotaReservation``,
``UnsetQuotaReservationWithCondition``, ``SyncAdmittedCondition``, ``SetEvictedCondition``,
``SetPreemptedCondition``) and ``apimeta.SetStatusCondition`` (a condition's ``lastTransitionTime`` moves
only when its status changes). Each returns whether it changed anything, so the stand-in writes only changes.
"""

from __future__ import annotations

from typing import Any

from ..kube.timestamps import now

# Condition types (kueue.Workload*)
QUOTA_RESERVED = "QuotaReserved"
ADMITTED = "Admitted"
EVICTED = "Evicted"
PREEMPTED = "Preempted"
REQUEUED = "Requeued"
FINISHED = "Finished"
PODS_READY = "PodsReady"
# QuotaReserved False: waiting for quota (the scheduler), or no queue to wait in (the workload controller)
PENDING = "Pending"
INADMISSIBLE = "Inadmissible"
# Evicted True: the reasons (kueue.WorkloadEvictedBy*, kueue.WorkloadDeactivated)
EVICTED_BY_PREEMPTION = "Preempted"
PODS_READY_TIMEOUT = "PodsReadyTimeout"
ADMISSION_CHECK = "AdmissionCheck"
CLUSTER_QUEUE_STOPPED = "ClusterQueueStopped"
LOCAL_QUEUE_STOPPED = "LocalQueueStopped"
NODE_FAILURES = "NodeFailures"
#: ``spec.active: false``. Kueue writes ``Deactivated`` since v0.10; before, ``InactiveWorkload`` (kept in
#: v1beta1 as a deprecated constant for workloads deactivated by older versions).
DEACTIVATED = "Deactivated"
INACTIVE_WORKLOAD_LEGACY = "InactiveWorkload"
DEACTIVATED_MESSAGE = "The workload is deactivated"
#: the Preempted condition's reasons, and the words Kueue's preemption message uses for each
PREEMPTION_REASONS = {
    "InClusterQueue": "prioritization in the ClusterQueue",
    "InCohortReclamation": "reclamation within the cohort",
    "InCohortFairSharing": "Fair Sharing within the cohort",
    "InCohortReclaimWhileBorrowing": "reclamation within the cohort while borrowing",
}
#: the messages Kueue writes with each eviction reason (``{name}``: the workload's namespace/name)
EVICTION_MESSAGES = {
    PODS_READY_TIMEOUT: "Exceeded the PodsReady timeout {name}",
    ADMISSION_CHECK: "At least one admission check is false",
    CLUSTER_QUEUE_STOPPED: "The ClusterQueue is stopped",
    LOCAL_QUEUE_STOPPED: "The LocalQueue is stopped",
    DEACTIVATED: DEACTIVATED_MESSAGE,
    NODE_FAILURES: "Workload was evicted as there was no replacement for a failed node",
}
#: api.TruncateConditionMessage
_MAX_MESSAGE = 32768


def preemption_message(reason: str, preemptor_uid: str = "UNKNOWN", preemptor_job_uid: str = "UNKNOWN") -> str:
    """The message of a preemption's Evicted and Preempted conditions (Kueue's ``preemptionMessage``)."""
    why = PREEMPTION_REASONS.get(reason, "UNKNOWN")
    return f"Preempted to accommodate a workload (UID: {preemptor_uid}, JobUID: {preemptor_job_uid}) due to {why}"


def find(status: dict[str, Any], type_: str) -> dict[str, Any] | None:
    """The condition of ``type_`` in ``status.conditions``, or None."""
    return next((c for c in status.get("conditions") or [] if c.get("type") == type_), None)


def is_true(status: dict[str, Any], type_: str) -> bool:
    """Whether the Workload status ``status`` has condition ``type_`` True (Kueue's
    ``apimeta.IsStatusConditionTrue``)."""
    return (find(status, type_) or {}).get("status") == "True"


def set_condition(status: dict[str, Any], type_: str, value: bool, reason: str, message: str, generation: int) -> bool:
    """``apimeta.SetStatusCondition``: add or update a condition in place; True when anything changed."""
    conditions = status.setdefault("conditions", [])
    wanted = {
        "type": type_,
        "status": "True" if value else "False",
        "reason": reason,
        "message": message[:_MAX_MESSAGE],
        "observedGeneration": generation,
    }
    current = find(status, type_)
    if current is None:
        conditions.append({**wanted, "lastTransitionTime": now()})
        return True
    if all(current.get(k) == v for k, v in wanted.items()):
        return False
    if current.get("status") != wanted["status"]:
        current["lastTransitionTime"] = now()
    current.update(wanted)
    return True


def set_quota_reservation(status: dict[str, Any], admission: dict[str, Any], generation: int) -> bool:
    """``SetQuotaReservation``: the admission, QuotaReserved True, and an active Evicted / Preempted reset to
    False (reason ``QuotaReserved``, "Previously: <its message>")."""
    status["admission"] = admission
    message = f"Quota reserved in ClusterQueue {admission['clusterQueue']}"
    set_condition(status, QUOTA_RESERVED, True, "QuotaReserved", message, generation)
    for type_ in (EVICTED, PREEMPTED):
        previous = find(status, type_)
        if previous is not None and previous.get("status") == "True":
            set_condition(status, type_, False, "QuotaReserved", f"Previously: {previous['message']}", generation)
    return True


def unset_quota_reservation(status: dict[str, Any], reason: str, message: str, generation: int) -> bool:
    """``UnsetQuotaReservationWithCondition``: QuotaReserved False (reason, message), no admission, Admitted synced."""
    changed = set_condition(status, QUOTA_RESERVED, False, reason, message, generation)
    if status.get("admission") is not None:
        status["admission"] = None
        changed = True
    return sync_admitted(status, generation) or changed


def sync_admitted(status: dict[str, Any], generation: int) -> bool:
    """``SyncAdmittedCondition`` (no admission checks): Admitted follows QuotaReserved."""
    reserved = is_true(status, QUOTA_RESERVED)
    if is_true(status, ADMITTED) == reserved:
        return False
    if reserved:
        return set_condition(status, ADMITTED, True, "Admitted", "The workload is admitted", generation)
    return set_condition(status, ADMITTED, False, "NoReservation", "The workload has no reservation", generation)
