"""Pure status logic: observations of a run (its pods, its orchestrator's ``/status``) → ``RLRun.status``.

Nothing here talks to Kubernetes. :func:`observe` is the one place that decides the
phase and the conditions, so the timer, the suspend handler and the tests agree:

| phase | when | Ready | Progressing | Degraded | Succeeded | Failed |
|---|---|---|---|---|---|---|
| Pending | pods created, orchestrator not running yet | False | True | False | False | False |
| Running | orchestrator pod running and answering¹ | endpoints? | True | pods failed/missing? | False | False |
| Recovering | a recovery (``recovery.py``) is under way | False (``Resuming``) | — | — | False | False |
| Suspended | ``spec.suspend: true`` | False | False | False | False | False |
| Succeeded | the orchestrator reported every step trained and exited 0 | False | False | False | True | False |
| Failed | bad spec, an error retrying cannot heal, or the failure budget spent | False | False | — | False | True |

¹ Ready once ≥ 1 rollout server is.

:func:`observe` decides Pending and Running (and the conditions of a live run); the
reconciler (``reconcile.py``) decides the other phases.

Conditions follow ``metav1.Condition``: ``lastTransitionTime`` changes only when a
condition's ``status`` does. Phases, condition types and reasons are the constants of
:mod:`rlrun.api.status`; the orchestrator's answers are the contract's models
(:mod:`rlrun.api.control`).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from rlrun.api.control import ExitReport, ResumeReport, StatusReport
from rlrun.api.status import ConditionType, Phase, Reason

from rlrun_operator import naming


def now_rfc3339() -> str:
    """The current UTC time as Kubernetes writes it (``2026-11-29T12:00:00Z``)."""
    return dt.datetime.now(dt.timezone.utc).replace(microsecond=0).strftime("%Y-%m-%dT%H:%M:%SZ")


def rfc3339_seconds(stamp: str) -> float:
    """Seconds since the epoch of an RFC 3339 time: as Kubernetes and :func:`now_rfc3339` write it
    (``2026-11-29T12:00:00Z``), or with fractional seconds or an offset (``+02:00``); one without a zone is UTC.
    The operator's one parser of the times it reads back (status stamps, ``deletionTimestamp``).

    Raises:
        ValueError: not such a time.
    """
    when = dt.datetime.fromisoformat(stamp.replace("Z", "+00:00").replace("z", "+00:00"))
    return (when if when.tzinfo else when.replace(tzinfo=dt.timezone.utc)).timestamp()


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
        owner_uid: uid of its controller owner reference (the RLRun that owns it), or None.
        node: ``spec.nodeName`` (None: not scheduled yet).
        disruption: reason of its ``DisruptionTarget`` condition when that is True, else None.
        exit_code: the container's exit code, once terminated.
        exit_report: the container's termination message as the contract's
            :class:`~rlrun.api.control.ExitReport`, when it is one.
        deletion_deadline: ``metadata.deletionTimestamp`` (RFC 3339: when its grace period ends).
        status_reason: ``status.reason`` (``Evicted``, ``Terminated``, ``NodeLost``, …).
        rollout_index: ``rlrun.dev/rollout-index`` of a rollout pod.
        trainer_node: ``rlrun.dev/trainer-node`` of a multi-node trainer's pod (None: a single-node trainer).
        trainer_nodes: ``rlrun.dev/trainer-nodes``, the size of that pod's trainer group (1 without the label).
        grace_period_s: ``spec.terminationGracePeriodSeconds``, the grace period it was created with (None: unset).
        deletion_grace_s: ``metadata.deletionGracePeriodSeconds`` of a pod being deleted (0: force-deleted).
        finalizers: ``metadata.finalizers``: while any is left, the pod stays in the API after it stopped.
    """

    name: str
    component: str
    attempt: int
    phase: str
    ready: bool
    ip: str | None
    reason: str | None = None
    deleting: bool = False
    owner_uid: str | None = None
    node: str | None = None
    disruption: str | None = None
    exit_code: int | None = None
    exit_report: ExitReport | None = None
    deletion_deadline: str | None = None
    status_reason: str | None = None
    rollout_index: int | None = None
    trainer_node: int | None = None
    trainer_nodes: int = 1
    grace_period_s: int | None = None
    deletion_grace_s: int | None = None
    finalizers: tuple[str, ...] = ()

    @property
    def ended(self) -> bool:
        """The pod is Succeeded or Failed."""
        return self.phase in ("Succeeded", "Failed")


def _exit_report(message: str | None) -> ExitReport | None:
    if not message:
        return None
    try:
        return ExitReport.model_validate_json(message)
    except ValidationError:  # a crash's last log lines, or no report at all
        return None


def pod_view(body: dict[str, Any]) -> PodView:
    """A :class:`PodView` from a Pod object."""
    meta, status = body.get("metadata", {}), body.get("status") or {}
    labels = meta.get("labels") or {}
    conditions = status.get("conditions") or []
    # the pod's own Ready condition (Kubernetes' PodConditionType), not an RLRun condition
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    disruption = next(
        (
            c.get("reason") or "DisruptionTarget"
            for c in conditions
            if c.get("type") == "DisruptionTarget" and c.get("status") == "True"
        ),
        None,
    )
    reason, exit_code, report = status.get("reason"), None, None
    for cs in status.get("containerStatuses") or []:
        term = (cs.get("state") or {}).get("terminated")
        if term:
            exit_code = term.get("exitCode")
            reason = term.get("reason") or f"exit code {exit_code}"
            report = _exit_report(term.get("message"))
    owner = next((o.get("uid") for o in meta.get("ownerReferences") or [] if o.get("controller")), None)
    index = labels.get(naming.ROLLOUT_INDEX)
    node, nodes = labels.get(naming.TRAINER_NODE, ""), labels.get(naming.TRAINER_NODES, "")
    return PodView(
        name=meta.get("name", ""),
        component=labels.get(naming.COMPONENT, ""),
        attempt=int(labels.get(naming.ATTEMPT, "0")),
        phase=status.get("phase") or "Pending",
        ready=ready,
        ip=status.get("podIP"),
        reason=reason,
        deleting=bool(meta.get("deletionTimestamp")),
        owner_uid=owner,
        node=(body.get("spec") or {}).get("nodeName"),
        disruption=disruption,
        exit_code=exit_code,
        exit_report=report,
        deletion_deadline=meta.get("deletionTimestamp"),
        grace_period_s=(body.get("spec") or {}).get("terminationGracePeriodSeconds"),
        deletion_grace_s=meta.get("deletionGracePeriodSeconds"),
        finalizers=tuple(meta.get("finalizers") or ()),
        status_reason=status.get("reason"),
        rollout_index=int(index) if index is not None and index.isdigit() else None,
        trainer_node=int(node) if node.isdigit() else None,
        trainer_nodes=int(nodes) if nodes.isdigit() and int(nodes) > 0 else 1,
    )


def rollout_endpoints(pods: list[PodView], attempt: int) -> list[str]:
    """URLs of the attempt's ready rollout servers, sorted (what ``PUT /rollout-endpoints`` sends)."""
    return sorted(
        f"http://{p.ip}:{naming.ROLLOUT_PORT}"
        for p in pods
        if p.component == naming.ROLLOUT and p.attempt == attempt and p.ready and p.ip and not p.deleting
    )


#: Fewest seconds between the two looks a step rate is measured over (the operator looks more often).
RATE_WINDOW_S = 30.0


def _duration(seconds: float) -> str:
    """``45s``, ``12m``, ``3h05m``."""
    if seconds < 60:
        return f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{seconds / 60:.0f}m"
    return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"


def progress(previous: dict[str, Any] | None, step: int, max_steps: int, now: str) -> dict[str, Any]:
    """``status.progress`` (:class:`~rlrun.api.status.Progress`) at ``step`` of ``max_steps`` at time ``now``
    (RFC 3339), from the ``previous`` one: a new rate is measured once :data:`RATE_WINDOW_S` have passed since its
    sample, and averaged with the previous rate (½ each); a step lower than the sample's (an abrupt loss retrains
    steps) starts the measure again, keeping the rate."""
    previous = previous or {}
    rate, sampled_step, sampled_at = (
        previous.get("stepsPerMinute"),
        previous.get("sampledStep"),
        previous.get("sampledAt"),
    )
    if sampled_step is None or sampled_at is None or step < sampled_step:
        sampled_step, sampled_at = step, now
    elif (elapsed := rfc3339_seconds(now) - rfc3339_seconds(sampled_at)) >= RATE_WINDOW_S:
        measured = (step - sampled_step) / (elapsed / 60)
        rate = measured if rate is None else (rate + measured) / 2
        sampled_step, sampled_at = step, now
    percent = min(100, int(100 * step / max_steps)) if max_steps else 0
    eta = int((max_steps - step) / rate * 60) if rate and step < max_steps else None
    return {
        "percent": percent,
        "text": f"{percent}%",
        "eta": "-" if eta is None else _duration(eta),
        "stepsPerMinute": None if rate is None else round(rate, 3),
        "etaSeconds": eta,
        "sampledStep": sampled_step,
        "sampledAt": sampled_at,
    }


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
            "conversations": report.conversations_continued,
            "turnsKept": report.turns_kept,
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
        also ``step``, ``maxSteps``, ``progress`` (:func:`progress`), ``policyVersion``, ``lastCheckpointStep``
        (once there is one) and the resume totals of :func:`resume_totals`.
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
        out["progress"] = progress(
            status.get("progress"), orchestrator.step, orchestrator.max_steps, now or now_rfc3339()
        )
        out["policyVersion"] = orchestrator.policy_version
        if orchestrator.last_checkpoint_step is not None:
            out["lastCheckpointStep"] = orchestrator.last_checkpoint_step
        out.update(resume_totals(status, orchestrator.resume, attempt))

    # never Ready without a live orchestrator pod (a stale endpoint may still answer)
    alive = orch_pod is not None and orch_pod.phase == "Running"
    running = alive and orchestrator is not None and orchestrator.phase in ("running", "done")
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
        cond(ConditionType.DEGRADED, True, Reason.PODS_MISSING, f"attempt {attempt} lacks pods: {', '.join(missing)}")
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
