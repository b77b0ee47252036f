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
condition's ``status`` does.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from rlrun_operator import naming as n


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
    """A new conditions list with ``type_`` set; its transition time is kept when its status is unchanged."""
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
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
    reason = status.get("reason")
    for cs in status.get("containerStatuses") or []:
        term = (cs.get("state") or {}).get("terminated")
        if term:
            reason = term.get("reason") or f"exit code {term.get('exitCode')}"
    return PodView(
        name=meta.get("name", ""),
        component=labels.get(n.COMPONENT, ""),
        attempt=int(labels.get(n.ATTEMPT, "0")),
        phase=status.get("phase") or "Pending",
        ready=ready,
        ip=status.get("podIP"),
        reason=reason,
        deleting=bool(meta.get("deletionTimestamp")),
    )


def rollout_endpoints(pods: list[PodView], attempt: int) -> list[str]:
    """URLs of the attempt's ready rollout servers, sorted (what ``PUT /rollout-endpoints`` sends)."""
    return sorted(
        f"http://{p.ip}:{n.ROLLOUT_PORT}"
        for p in pods
        if p.component == n.ROLLOUT and p.attempt == attempt and p.ready and p.ip and not p.deleting
    )


def resume_totals(status: dict[str, Any], report: dict[str, Any] | None, attempt: int) -> dict[str, Any]:
    """Status fields adding ``report`` (an orchestrator resume report) to the totals, once per attempt."""
    last = status.get("lastResume") or {}
    totals = {
        "resumedGroups": status.get("resumedGroups") or 0,
        "resumedTraces": status.get("resumedTraces") or 0,
        "resumedEpisodes": status.get("resumedEpisodes") or 0,
    }
    if not report or last.get("attempt") == attempt:
        return totals
    groups = int(report.get("open_groups", 0))
    traces = int(report.get("queued_traces", 0))
    episodes = int(report.get("finished_episodes_kept", 0))
    return {
        "resumedGroups": totals["resumedGroups"] + groups,
        "resumedTraces": totals["resumedTraces"] + traces,
        "resumedEpisodes": totals["resumedEpisodes"] + episodes,
        "lastResume": {
            "attempt": attempt,
            "fromStep": int(report.get("from_step", 0)),
            "groups": groups,
            "queuedTraces": traces,
            "finishedEpisodes": episodes,
        },
    }


def observe(
    status: dict[str, Any],
    generation: int | None,
    pods: list[PodView],
    orchestrator: dict[str, Any] | None,
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
        a dict of status fields to merge into ``status`` (``conditions`` is the whole new list).
    """
    attempt = int(status.get("attempt") or 0)
    current = [p for p in pods if p.attempt == attempt and not p.deleting]
    by_component = {c: [p for p in current if p.component == c] for c in n.COMPONENTS}
    orch_pod = by_component[n.ORCHESTRATOR][0] if by_component[n.ORCHESTRATOR] else None
    failed = [p for p in current if p.phase == "Failed"]
    endpoints = rollout_endpoints(pods, attempt)
    conditions = list(status.get("conditions") or [])
    out: dict[str, Any] = {"observedGeneration": generation, "rolloutEndpoints": len(endpoints)}

    def cond(type_, value, reason, message):
        nonlocal conditions
        conditions = set_condition(conditions, type_, value, reason, message, generation, now)

    if orchestrator is not None:
        out["step"] = int(orchestrator.get("step") or 0)
        out["maxSteps"] = int(orchestrator.get("max_steps") or 0)
        out["policyVersion"] = int(orchestrator.get("policy_version") or 0)
        if orchestrator.get("last_checkpoint_step") is not None:
            out["lastCheckpointStep"] = int(orchestrator["last_checkpoint_step"])
        out.update(resume_totals(status, orchestrator.get("resume"), attempt))

    if orch_pod is not None and orch_pod.phase == "Succeeded":
        phase = "Succeeded"
        steps = out.get("maxSteps") or status.get("maxSteps")
        message = f"all {steps} steps trained" if steps else "training finished"
        cond("Succeeded", True, "Completed", message)
        cond("Failed", False, "Completed", "")
        cond("Ready", False, "Completed", "the run has finished")
        cond("Progressing", False, "Completed", message)
        cond("Degraded", False, "Completed", "")
    elif orch_pod is not None and orch_pod.phase == "Failed":
        phase = "Failed"
        message = f"orchestrator pod {orch_pod.name} failed ({orch_pod.reason or 'unknown reason'})"
        cond("Failed", True, "OrchestratorFailed", message)
        cond("Succeeded", False, "OrchestratorFailed", "")
        cond("Ready", False, "OrchestratorFailed", message)
        cond("Progressing", False, "OrchestratorFailed", message)
        cond("Degraded", True, "PodFailed", message)
    else:
        running = orchestrator is not None and orchestrator.get("phase") in ("running", "done")
        # one unanswered poll (a busy orchestrator) does not make a running run Pending again
        phase = "Running" if running or (orchestrator is None and status.get("phase") == "Running") else "Pending"
        missing = [c for c in (n.ORCHESTRATOR, n.TRAINER) if not by_component[c]]
        if rollout_replicas is not None and len(by_component[n.ROLLOUT]) < rollout_replicas:
            missing.append(f"{rollout_replicas - len(by_component[n.ROLLOUT])} rollout")
        if failed:
            cond("Degraded", True, "PodFailed", "; ".join(f"{p.name}: {p.reason or 'failed'}" for p in failed))
        elif missing:
            cond("Degraded", True, "PodsMissing", f"attempt {attempt} lacks pods: {', '.join(missing)}")
        elif running and not endpoints:
            cond("Degraded", True, "NoRolloutEndpoints", "no rollout server is ready")
        else:
            cond("Degraded", False, "AsExpected", "")
        if running and endpoints:
            cond("Ready", True, "Running", f"step {out['step']}, {len(endpoints)} rollout server(s) ready")
        elif orchestrator is None:
            cond("Ready", False, "OrchestratorUnreachable", orchestrator_error or "orchestrator not reachable yet")
        else:
            waiting = (
                "waiting for ready rollout servers" if not endpoints else f"orchestrator {orchestrator.get('phase')}"
            )
            cond("Ready", False, "Starting", waiting)
        cond("Progressing", True, "Training" if running else "Starting", f"attempt {attempt}")
        cond("Succeeded", False, "Running", "")
        cond("Failed", False, "Running", "")
    out["phase"] = phase
    out["conditions"] = conditions
    ready = next(c for c in conditions if c["type"] == "Ready")
    out["message"] = ready["message"] or phase
    return out


def starting(status: dict[str, Any], generation: int | None, attempt: int, now: str | None = None):
    """The status patch of an attempt whose pods were just created (``Pending``, nothing known yet)."""
    conditions = list(status.get("conditions") or [])
    message = f"attempt {attempt}: pods created, waiting for the orchestrator to start"
    for type_, value, reason in (
        ("Ready", False, "Starting"),
        ("Progressing", True, "Starting"),
        ("Degraded", False, "AsExpected"),
        ("Succeeded", False, "Starting"),
        ("Failed", False, "Starting"),
    ):
        conditions = set_condition(
            conditions, type_, value, reason, message if value or type_ == "Ready" else "", generation, now
        )
    return {
        "phase": "Pending",
        "observedGeneration": generation,
        "attempt": attempt,
        "message": message,
        "conditions": conditions,
        "preemptions": status.get("preemptions") or 0,
        "step": status.get("step") or 0,
        # printer columns show 0, not blank
        **{k: status.get(k) or 0 for k in ("resumedGroups", "resumedTraces", "resumedEpisodes")},
    }


def suspended(status: dict[str, Any], generation: int | None, message: str, now: str | None = None):
    """The status patch of a suspended run (pods removed; ``Failed`` cleared: unsuspending retries)."""
    conditions = list(status.get("conditions") or [])
    for type_ in ("Ready", "Progressing", "Degraded", "Failed"):
        conditions = set_condition(conditions, type_, False, "Suspended", message, generation, now)
    return {"phase": "Suspended", "observedGeneration": generation, "message": message, "conditions": conditions}


def failed(status: dict[str, Any], generation: int | None, reason: str, message: str, now: str | None = None):
    """The status patch of a run that cannot go on (``Failed`` condition True with ``reason``)."""
    conditions = list(status.get("conditions") or [])
    conditions = set_condition(conditions, "Failed", True, reason, message, generation, now)
    for type_ in ("Ready", "Progressing", "Succeeded"):
        conditions = set_condition(conditions, type_, False, reason, message, generation, now)
    return {"phase": "Failed", "observedGeneration": generation, "message": message, "conditions": conditions}
