"""Pure status logic: observations of a run (its pods, its orchestrator's ``/status``) → ``RLRun.status``.

Nothing here talks to Kubernetes. :func:`observe` is the one place that decides the
phase and the conditions, so the timer, the suspend handler and the tests agree:

| phase | when | Ready | Progressing | Degraded | Succeeded | Failed |
|---|---|---|---|---|---|---|
| Pending | pods created, orchestrator not running yet | False | True | False | False | False |
| Running | orchestrator running (Ready once ≥ 1 rollout server is) | endpoints? | True | pods failed/missing? | False | False |
| Suspended | ``spec.suspend: true`` | False | False | False | False | False |
| Succeeded | orchestrator pod exited 0 | False | False | False | True | False |
| Failed | bad spec, or the orchestrator pod failed | False | False | True | False | True |

Conditions follow ``metav1.Condition``: ``lastTransitionTime`` changes only when a
condition's ``status`` does. Phases, condition types and reasons are the constants of
:mod:`rlrun.api.status`; the orchestrator's answers are the contract's models
(:mod:`rlrun.api.control`).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from rlrun.api.control import ResumeReport, StatusReport
from rlrun.api.status import ConditionType, Phase, Reason

from rlrun_operator import naming


def now_rfc3339() -> str:
    """The current UTC time as Kubernetes writes it (``2026-11-29T12:00:00Z``)."""
    return dt.datetime.now(dt.timezone.utc).replace(microsecond=0).strftime("%Y-%m-%dT%H:%M:%SZ")


def set_condition(
    conditions: list[dict[str, Any]],
    type_: str,
    status: bool | str,
    reason: str,
    message: str,
    generation: int | None,
    now: str | None = None,
) -> list[dict[str, Any]]:
    """A new conditions list with ``type_`` set; its transition time is kept when its status is unchanged.

    Args:
        type_: a :class:`~rlrun.api.status.ConditionType`.
        status: True / False, or ``"True"``, ``"False"``, ``"Unknown"``.
        reason: a :class:`~rlrun.api.status.Reason`.

    Returns:
        the conditions as ``metav1.Condition`` dicts (``type``, ``status``, ``reason``, ``message``,
        ``lastTransitionTime``, ``observedGeneration``), ``type_``'s last.
    """
    value = status if isinstance(status, str) else ("True" if status else "False")
    old = next((c for c in conditions if c.get("type") == type_), None)
    changed = old is None or old.get("status") != value
    cond = {
        "type": type_,
        "status": value,
        "reason": reason,
        "message": message,
        "lastTransitionTime": (now or now_rfc3339()) if changed else old["lastTransitionTime"],
        "observedGeneration": generation,
    }
    return [c for c in conditions if c.get("type") != type_] + [cond]


@dataclass(frozen=True)
class PodView:
    """What the operator needs to know of one of a run's pods (from the pods index).

    Attributes:
        name: pod name.
        component: orchestrator, trainer or rollout.
        attempt: the attempt the pod belongs to.
        phase: ``status.phase`` (Pending, Running, Succeeded, Failed, Unknown).
        ready: the ``Ready`` condition is True.
        ip: ``status.podIP`` or None.
        reason: why it ended (the container's terminated reason or the pod's), if it did.
        deleting: it has a ``deletionTimestamp``.
    """

    name: str
    component: str
    attempt: int
    phase: str
    ready: bool
    ip: str | None
    reason: str | None = None
    deleting: bool = False


def pod_view(body: dict[str, Any]) -> PodView:
    """A :class:`PodView` from a Pod object."""
    meta, status = body.get("metadata", {}), body.get("status") or {}
    labels = meta.get("labels") or {}
    # the pod's own Ready condition (Kubernetes' PodConditionType), not an RLRun condition
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
    reason = status.get("reason")
    for cs in status.get("containerStatuses") or []:
        term = (cs.get("state") or {}).get("terminated")
        if term:
            reason = term.get("reason") or f"exit code {term.get('exitCode')}"
    return PodView(
        name=meta.get("name", ""),
        component=labels.get(naming.COMPONENT, ""),
        attempt=int(labels.get(naming.ATTEMPT, "0")),
        phase=status.get("phase") or "Pending",
        ready=ready,
        ip=status.get("podIP"),
        reason=reason,
        deleting=bool(meta.get("deletionTimestamp")),
    )


def rollout_endpoints(pods: list[PodView], attempt: int) -> list[str]:
    """URLs of the attempt's ready rollout servers, sorted (what ``PUT /rollout-endpoints`` sends)."""
    return sorted(
        f"http://{p.ip}:{naming.ROLLOUT_PORT}"
        for p in pods
        if p.component == naming.ROLLOUT and p.attempt == attempt and p.ready and p.ip and not p.deleting
    )


def resume_totals(status: dict[str, Any], report: ResumeReport | None, attempt: int) -> dict[str, Any]:
    """Status fields adding ``report`` (attempt ``attempt``'s resume report) to the totals, once per attempt.

    Returns:
        ``resumedGroups``, ``resumedTraces``, ``resumedEpisodes`` (the totals, unchanged when
        ``report`` is None or this attempt's report was added already) and, when ``report`` is
        added now, ``lastResume`` (a :class:`~rlrun.api.status.LastResume` dict).
    """
    last = status.get("lastResume") or {}
    totals = {
        "resumedGroups": status.get("resumedGroups") or 0,
        "resumedTraces": status.get("resumedTraces") or 0,
        "resumedEpisodes": status.get("resumedEpisodes") or 0,
    }
    if report is None or last.get("attempt") == attempt:
        return totals
    return {
        "resumedGroups": totals["resumedGroups"] + report.resumed_groups,
        "resumedTraces": totals["resumedTraces"] + report.queued_traces,
        "resumedEpisodes": totals["resumedEpisodes"] + report.finished_episodes_kept,
        "lastResume": {
            "attempt": attempt,
            "fromStep": report.from_step,
            "groups": report.resumed_groups,
            "queuedTraces": report.queued_traces,
            "finishedEpisodes": report.finished_episodes_kept,
        },
    }


def observe(
    status: dict[str, Any],
    generation: int | None,
    pods: list[PodView],
    orchestrator: StatusReport | None,
    orchestrator_error: str | None = None,
    now: str | None = None,
    rollout_replicas: int | None = None,
) -> dict[str, Any]:
    """The status patch for a running (not suspended) run.

    Args:
        status: the RLRun's current ``status`` (conditions and totals are carried over).
        generation: ``metadata.generation``.
        pods: the run's pods (every attempt; only ``status.attempt``'s count).
        orchestrator: the orchestrator's ``/status`` answer, or None when it could not be reached.
        orchestrator_error: why it could not be reached (for the message).
        now: the time to stamp transitions with (tests pass one).
        rollout_replicas: rollout pods the attempt should have (None: not checked).

    Returns:
        status fields to merge into ``status``: always ``phase``, ``observedGeneration``,
        ``rolloutEndpoints``, ``message`` and ``conditions`` (the whole new list); with an answer
        also ``step``, ``maxSteps``, ``policyVersion``, ``lastCheckpointStep`` (once there is one)
        and the resume totals of :func:`resume_totals`.
    """
    attempt = int(status.get("attempt") or 0)
    current = [p for p in pods if p.attempt == attempt and not p.deleting]
    by_component = {c: [p for p in current if p.component == c] for c in naming.COMPONENTS}
    orch_pod = by_component[naming.ORCHESTRATOR][0] if by_component[naming.ORCHESTRATOR] else None
    failed = [p for p in current if p.phase == "Failed"]
    endpoints = rollout_endpoints(pods, attempt)
    conditions = list(status.get("conditions") or [])
    out: dict[str, Any] = {"observedGeneration": generation, "rolloutEndpoints": len(endpoints)}

    def cond(type_, value, reason, message):
        nonlocal conditions
        conditions = set_condition(conditions, type_, value, reason, message, generation, now)

    if orchestrator is not None:
        out["step"] = orchestrator.step
        out["maxSteps"] = orchestrator.max_steps
        out["policyVersion"] = orchestrator.policy_version
        if orchestrator.last_checkpoint_step is not None:
            out["lastCheckpointStep"] = orchestrator.last_checkpoint_step
        out.update(resume_totals(status, orchestrator.resume, attempt))

    if orch_pod is not None and orch_pod.phase == "Succeeded":
        phase = Phase.SUCCEEDED
        steps = out.get("maxSteps") or status.get("maxSteps")
        message = f"all {steps} steps trained" if steps else "training finished"
        cond(ConditionType.SUCCEEDED, True, Reason.COMPLETED, message)
        cond(ConditionType.FAILED, False, Reason.COMPLETED, "")
        cond(ConditionType.READY, False, Reason.COMPLETED, "the run has finished")
        cond(ConditionType.PROGRESSING, False, Reason.COMPLETED, message)
        cond(ConditionType.DEGRADED, False, Reason.COMPLETED, "")
    elif orch_pod is not None and orch_pod.phase == "Failed":
        phase = Phase.FAILED
        message = f"orchestrator pod {orch_pod.name} failed ({orch_pod.reason or 'unknown reason'})"
        cond(ConditionType.FAILED, True, Reason.ORCHESTRATOR_FAILED, message)
        cond(ConditionType.SUCCEEDED, False, Reason.ORCHESTRATOR_FAILED, "")
        cond(ConditionType.READY, False, Reason.ORCHESTRATOR_FAILED, message)
        cond(ConditionType.PROGRESSING, False, Reason.ORCHESTRATOR_FAILED, message)
        cond(ConditionType.DEGRADED, True, Reason.POD_FAILED, message)
    else:
        running = orchestrator is not None and orchestrator.phase in ("running", "done")
        # one unanswered poll (a busy orchestrator) does not make a running run Pending again
        was_running = orchestrator is None and status.get("phase") == Phase.RUNNING
        phase = Phase.RUNNING if running or was_running else Phase.PENDING
        missing = [c for c in (naming.ORCHESTRATOR, naming.TRAINER) if not by_component[c]]
        if rollout_replicas is not None and len(by_component[naming.ROLLOUT]) < rollout_replicas:
            missing.append(f"{rollout_replicas - len(by_component[naming.ROLLOUT])} rollout")
        if failed:
            failures = "; ".join(f"{p.name}: {p.reason or 'failed'}" for p in failed)
            cond(ConditionType.DEGRADED, True, Reason.POD_FAILED, failures)
        elif missing:
            cond(
                ConditionType.DEGRADED, True, Reason.PODS_MISSING, f"attempt {attempt} lacks pods: {', '.join(missing)}"
            )
        elif running and not endpoints:
            cond(ConditionType.DEGRADED, True, Reason.NO_ROLLOUT_ENDPOINTS, "no rollout server is ready")
        else:
            cond(ConditionType.DEGRADED, False, Reason.AS_EXPECTED, "")
        if running and endpoints:
            message = f"step {out['step']}, {len(endpoints)} rollout server(s) ready"
            cond(ConditionType.READY, True, Reason.RUNNING, message)
        elif orchestrator is None:
            message = orchestrator_error or "orchestrator not reachable yet"
            cond(ConditionType.READY, False, Reason.ORCHESTRATOR_UNREACHABLE, message)
        else:
            waiting = "waiting for ready rollout servers" if not endpoints else f"orchestrator {orchestrator.phase}"
            cond(ConditionType.READY, False, Reason.STARTING, waiting)
        cond(ConditionType.PROGRESSING, True, Reason.TRAINING if running else Reason.STARTING, f"attempt {attempt}")
        cond(ConditionType.SUCCEEDED, False, Reason.RUNNING, "")
        cond(ConditionType.FAILED, False, Reason.RUNNING, "")
    out["phase"] = phase
    out["conditions"] = conditions
    ready = next(c for c in conditions if c["type"] == ConditionType.READY)
    out["message"] = ready["message"] or phase
    return out


def starting(status: dict[str, Any], generation: int | None, attempt: int, now: str | None = None) -> dict[str, Any]:
    """The status patch of an attempt whose pods were just created (``Pending``, nothing known yet).

    Returns:
        ``phase``, ``observedGeneration``, ``attempt``, ``message``, ``conditions`` and the counters
        the printer columns show (``preemptions``, ``step``, ``resumed*``: 0 rather than blank).
    """
    conditions = list(status.get("conditions") or [])
    message = f"attempt {attempt}: pods created, waiting for the orchestrator to start"
    for type_, value, reason in (
        (ConditionType.READY, False, Reason.STARTING),
        (ConditionType.PROGRESSING, True, Reason.STARTING),
        (ConditionType.DEGRADED, False, Reason.AS_EXPECTED),
        (ConditionType.SUCCEEDED, False, Reason.STARTING),
        (ConditionType.FAILED, False, Reason.STARTING),
    ):
        shown = message if value or type_ == ConditionType.READY else ""
        conditions = set_condition(conditions, type_, value, reason, shown, generation, now)
    return {
        "phase": Phase.PENDING,
        "observedGeneration": generation,
        "attempt": attempt,
        "message": message,
        "conditions": conditions,
        "preemptions": status.get("preemptions") or 0,
        "step": status.get("step") or 0,
        # printer columns show 0, not blank
        **{k: status.get(k) or 0 for k in ("resumedGroups", "resumedTraces", "resumedEpisodes")},
    }


def suspended(status: dict[str, Any], generation: int | None, message: str, now: str | None = None) -> dict[str, Any]:
    """The status patch of a suspended run (pods removed; ``Failed`` cleared: unsuspending retries).

    Returns:
        ``phase``, ``observedGeneration``, ``message`` and ``conditions``.
    """
    conditions = list(status.get("conditions") or [])
    for type_ in (ConditionType.READY, ConditionType.PROGRESSING, ConditionType.DEGRADED, ConditionType.FAILED):
        conditions = set_condition(conditions, type_, False, Reason.SUSPENDED, message, generation, now)
    return {"phase": Phase.SUSPENDED, "observedGeneration": generation, "message": message, "conditions": conditions}


def failed(
    status: dict[str, Any], generation: int | None, reason: str, message: str, now: str | None = None
) -> dict[str, Any]:
    """The status patch of a run that cannot go on (``Failed`` condition True with ``reason``, a :class:`Reason`).

    Returns:
        ``phase``, ``observedGeneration``, ``message`` and ``conditions``.
    """
    conditions = list(status.get("conditions") or [])
    conditions = set_condition(conditions, ConditionType.FAILED, True, reason, message, generation, now)
    for type_ in (ConditionType.READY, ConditionType.PROGRESSING, ConditionType.SUCCEEDED):
        conditions = set_condition(conditions, type_, False, reason, message, generation, now)
    return {"phase": Phase.FAILED, "observedGeneration": generation, "message": message, "conditions": conditions}
