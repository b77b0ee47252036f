"""Kueue's side of a run, pure: the Workload the operator owns for it, what that Workload says now, the placement
its admission gives the pods, and the job side's status patches. Nothing here talks to Kubernetes
(``kueue_stages.py`` acts on the answers).

rlrun speaks Kueue's Workload API, ``kueue.x-k8s.io/v1beta1``, the way Kueue's own job integrations do
(``pkg/controller/jobframework/reconciler.go`` and ``pkg/workload`` in kubernetes-sigs/kueue, v0.10–v0.13): one
Workload per RLRun labelled ``kueue.x-k8s.io/queue-name``, owned by it, whose pod sets are the attempt's pods
(``orchestrator`` ×1, ``trainer`` × ``trainer.nodes``, ``rollout`` × ``rollout.replicas``; each template the
attempt's pod of that kind, so its containers' requests are what Kueue counts).

| the Workload | :func:`admission` / :func:`eviction` | the run |
|---|---|---|
| ``QuotaReserved``, ``Admitted`` True, ``status.admission`` set, not ``Evicted`` | :class:`Admission` | may run pods¹ |
| ``Evicted`` True while ``QuotaReserved`` is True | an :class:`Eviction` (Kueue's reason) | pause → snapshot → stop² |
| not admitted (or gone) while the run has pods | :class:`Eviction` (``QuotaLost`` / ``WorkloadDeleted``) | the same |
| neither | :func:`pending_message`: Kueue's own words | queued, no pods |

¹ Placed by :func:`placement`. ² Then :func:`release_quota`.

The job side of the contract (what Kueue's job reconciler writes, and so the operator too): once an evicted run's
pods are gone, :func:`release_quota` (``QuotaReserved`` False ``Pending``, ``admission`` removed, ``Admitted``
False, ``Requeued`` True for a preemption: ``workload.UnsetQuotaReservationWithCondition``); :func:`pods_ready`
(Kueue's ``waitForPodsReady`` evicts a Workload whose pods stay unready); :func:`finished` when the run ends.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlrun_operator import naming
from rlrun_operator.builders import object_meta
from rlrun_operator.status import now_rfc3339, set_condition

GROUP = "kueue.x-k8s.io"
VERSION = "v1beta1"
WORKLOADS = "workloads"
RESOURCE_FLAVORS = "resourceflavors"
PRIORITY_CLASSES = "workloadpriorityclasses"
#: ``spec.priorityClassSource`` of a Workload whose priority is a WorkloadPriorityClass's.
PRIORITY_SOURCE = "kueue.x-k8s.io/workloadpriorityclass"

#: The Workload's condition types (Kueue's ``kueue.WorkloadQuotaReserved`` and so on).
QUOTA_RESERVED = "QuotaReserved"
ADMITTED = "Admitted"
EVICTED = "Evicted"
PREEMPTED = "Preempted"
REQUEUED = "Requeued"
PODS_READY = "PodsReady"
FINISHED = "Finished"
#: The eviction reason after which the job side's release also says ``Requeued`` (Kueue's
#: ``WorkloadEvictedByPreemption``).
PREEMPTED_REASON = "Preempted"


def queue_name(body: dict[str, Any]) -> str | None:
    """The run's LocalQueue: its ``kueue.x-k8s.io/queue-name`` label (None: not managed by Kueue)."""
    return ((body.get("metadata") or {}).get("labels") or {}).get(naming.QUEUE_LABEL) or None


def priority_class(body: dict[str, Any]) -> str | None:
    """The run's WorkloadPriorityClass: its ``kueue.x-k8s.io/priority-class`` label, if any."""
    return ((body.get("metadata") or {}).get("labels") or {}).get(naming.PRIORITY_LABEL) or None


def pod_sets(pods: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The Workload's ``spec.podSets`` for one attempt's ``pods`` (:func:`rlrun_operator.pods.build_pods`): one per
    component that has pods, in the order orchestrator, trainer, rollout; ``count`` its pods, ``template`` its
    first pod's labels and spec (a multi-node trainer's pods differ only in hostname and node rank)."""
    out = []
    for component in (naming.ORCHESTRATOR, naming.TRAINER, naming.ROLLOUT):
        mine = [p for p in pods if p["metadata"]["labels"].get(naming.COMPONENT) == component]
        if mine:
            template = {
                "metadata": {"labels": dict(mine[0]["metadata"]["labels"])},
                "spec": copy.deepcopy(mine[0]["spec"]),
            }
            out.append({"name": component, "count": len(mine), "template": template})
    return out


def build_workload(
    body: dict[str, Any],
    pods: Sequence[dict[str, Any]],
    queue: str,
    priority: tuple[str, int] | None = None,
    active: bool = True,
) -> dict[str, Any]:
    """The run's Workload (``naming.workload_name``, the run's namespace and labels, owned by the RLRun).

    Args:
        body: the RLRun.
        pods: the pods of the attempt it is queued for (:func:`pod_sets`).
        queue: the LocalQueue.
        priority: ``(WorkloadPriorityClass name, its value)``, or None.
        active: ``spec.active`` (false while the run is suspended).
    """
    spec: dict[str, Any] = {"queueName": queue, "podSets": pod_sets(pods), "active": active}
    if priority is not None:
        spec.update(priorityClassName=priority[0], priorityClassSource=PRIORITY_SOURCE, priority=int(priority[1]))
    meta = object_meta(body, naming.workload_name(body["metadata"]["name"]))
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "Workload", "metadata": meta, "spec": spec}


def pod_sets_differ(workload: dict[str, Any], wanted: Sequence[dict[str, Any]]) -> bool:
    """Whether the Workload's pod sets count other pods or other requests than ``wanted`` (:func:`pod_sets`)."""

    def key(sets) -> list:
        return [
            (s.get("name"), s.get("count"), [c.get("resources") for c in s["template"]["spec"].get("containers", [])])
            for s in sets or []
        ]

    return key((workload.get("spec") or {}).get("podSets")) != key(wanted)


def condition(workload: dict[str, Any] | None, type_: str) -> dict[str, Any] | None:
    """The Workload's condition ``type_`` (None: it has none)."""
    conditions = ((workload or {}).get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c.get("type") == type_), None)


def is_true(workload: dict[str, Any] | None, type_: str) -> bool:
    """Whether the Workload's condition ``type_`` is True."""
    return (condition(workload, type_) or {}).get("status") == "True"


@dataclass(frozen=True)
class Admission:
    """An admitted Workload's admission.

    Attributes:
        cluster_queue: the ClusterQueue that admitted it.
        flavors: each pod set's distinct ResourceFlavors, in the order its resources name them.
    """

    cluster_queue: str
    flavors: dict[str, list[str]] = field(default_factory=dict)

    def describe(self) -> str:
        """``ClusterQueue cq, flavors trainer: gpu-a; rollout: gpu-a``."""
        flavors = "; ".join(f"{name}: {', '.join(fl) or '-'}" for name, fl in self.flavors.items())
        return f"ClusterQueue {self.cluster_queue}, flavors {flavors or '-'}"


def admission(workload: dict[str, Any] | None) -> Admission | None:
    """The Workload's admission when it is admitted now: ``QuotaReserved`` and ``Admitted`` True,
    ``status.admission`` set, not ``Evicted`` (Kueue's ``workload.IsAdmitted``), not ``Finished`` (its quota is
    Kueue's again: a finished Workload is never admitted again); else None."""
    if not (is_true(workload, QUOTA_RESERVED) and is_true(workload, ADMITTED)) or is_true(workload, EVICTED):
        return None
    if is_true(workload, FINISHED):
        return None
    found = ((workload or {}).get("status") or {}).get("admission")
    if not found:
        return None
    flavors = {
        a["name"]: list(dict.fromkeys((a.get("flavors") or {}).values())) for a in found.get("podSetAssignments") or []
    }
    return Admission(found.get("clusterQueue", ""), flavors)


def pending_message(workload: dict[str, Any] | None) -> str:
    """Why the Workload is not admitted, in Kueue's own words (its ``QuotaReserved`` or ``Admitted`` condition's
    message, e.g. ``couldn't assign flavors to pod set trainer: insufficient quota …``); a deactivated Workload's
    own reason (Kueue does not look at it: its message would be stale)."""
    if ((workload or {}).get("spec") or {}).get("active", True) is False:
        return "the Workload is deactivated (spec.active: false): Kueue admits it again once it is set true"
    for type_ in (QUOTA_RESERVED, ADMITTED):
        message = (condition(workload, type_) or {}).get("message")
        if message:
            return message
    return "waiting for Kueue to look at the Workload"


@dataclass(frozen=True)
class Eviction:
    """Kueue took the run's admission back.

    Attributes:
        reason: Kueue's ``Evicted`` reason (``Preempted``, ``PodsReadyTimeout``, ``Deactivated``, ``AdmissionCheck``,
            ``ClusterQueueStopped``, …), or ``QuotaLost`` / ``WorkloadDeleted`` when the run has pods and the Workload
            holds no quota or is gone.
        message: Kueue's message.
        preempted: the ``Preempted`` condition's reason when it is True (``InClusterQueue``,
            ``InCohortReclamation``, …).
    """

    reason: str
    message: str = ""
    preempted: str | None = None

    def describe(self, workload: str) -> str:
        """``Kueue evicted Workload W (Preempted, InClusterQueue): <Kueue's message>``."""
        why = f"{self.reason}, {self.preempted}" if self.preempted else self.reason
        return f"Kueue evicted Workload {workload} ({why})" + (f": {self.message}" if self.message else "")


def reserved_since(workload: dict[str, Any] | None) -> str | None:
    """When the Workload's current quota reservation began (``QuotaReserved``'s ``lastTransitionTime``, RFC
    3339), or None when it holds none (or Kueue wrote no time)."""
    reserved = condition(workload, QUOTA_RESERVED) or {}
    if reserved.get("status") != "True":
        return None
    return reserved.get("lastTransitionTime") or None


def eviction(workload: dict[str, Any] | None, has_pods: bool) -> Eviction | None:
    """Whether the run must stop for Kueue (see the module table); ``has_pods``: the run has live pods."""
    if workload is None:
        return Eviction("WorkloadDeleted", "the Workload was deleted") if has_pods else None
    evicted = condition(workload, EVICTED) or {}
    if evicted.get("status") == "True" and is_true(workload, QUOTA_RESERVED):
        preempted = condition(workload, PREEMPTED) or {}
        return Eviction(
            evicted.get("reason") or EVICTED,
            evicted.get("message") or "",
            preempted.get("reason") if preempted.get("status") == "True" else None,
        )
    if has_pods and admission(workload) is None:
        reserved = condition(workload, QUOTA_RESERVED) or {}
        return Eviction("QuotaLost", reserved.get("message") or "the Workload holds no quota reservation")
    return None


@dataclass(frozen=True)
class Placement:
    """What an admission adds to one pod set's pods (Kueue's ``podset.FromAssignment``).

    Attributes:
        node_selector: the flavors' ``spec.nodeLabels``, merged.
        tolerations: the flavors' ``spec.tolerations``, in order.
    """

    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)


def placement(adm: Admission, flavors: Mapping[str, dict[str, Any]]) -> dict[str, Placement]:
    """Each pod set's :class:`Placement` from the ResourceFlavors ``flavors`` (by name) its admission names.

    Raises:
        ValueError: a flavor the admission names is not in ``flavors`` (deleted meanwhile), or two flavors of one
            pod set want different values of one node label.
    """
    out = {}
    for pod_set, names in adm.flavors.items():
        selector: dict[str, str] = {}
        tolerations: list[dict[str, Any]] = []
        for name in names:
            if name not in flavors:
                raise ValueError(f"ResourceFlavor {name} of pod set {pod_set} does not exist")
            spec = flavors[name].get("spec") or {}
            for key, value in (spec.get("nodeLabels") or {}).items():
                if selector.get(key, value) != value:
                    raise ValueError(f"pod set {pod_set}: flavors want {key}={selector[key]} and {key}={value}")
                selector[key] = value
            tolerations += [t for t in spec.get("tolerations") or [] if t not in tolerations]
        out[pod_set] = Placement(selector, tolerations)
    return out


def conflicts(node_selector: Mapping[str, str], placements: Mapping[str, Placement]) -> list[str]:
    """``pod set trainer: flavor wants k=v, spec.scheduling.node_selector has k=w`` for each flavor node label the
    run's own ``node_selector`` contradicts (the pods could never be scheduled: the run stays queued)."""
    return [
        f"pod set {name}: its flavor wants {k}={v}, spec.scheduling.node_selector has {k}={node_selector[k]}"
        for name, p in placements.items()
        for k, v in p.node_selector.items()
        if k in node_selector and node_selector[k] != v
    ]


def place(pods: Sequence[dict[str, Any]], placements: Mapping[str, Placement] | None) -> list[dict[str, Any]]:
    """``pods`` with their pod set's placement: node labels merged into ``nodeSelector``, tolerations appended
    (the pods are changed in place and returned; None: as they are)."""
    for pod in pods:
        found = (placements or {}).get(pod["metadata"]["labels"].get(naming.COMPONENT, ""))
        if found is None:
            continue
        spec = pod["spec"]
        if found.node_selector:
            spec["nodeSelector"] = {**(spec.get("nodeSelector") or {}), **found.node_selector}
        extra = [t for t in found.tolerations if t not in (spec.get("tolerations") or [])]
        if extra:
            spec["tolerations"] = [*(spec.get("tolerations") or []), *extra]
    return list(pods)


# -- the job side's status patches (of the Workload's status subresource) -----------------------------------------


def status_ops(workload: dict[str, Any], patch: dict[str, Any]) -> list[dict[str, Any]]:
    """``patch`` (status fields; None removes one) as a JSON patch guarded by the Workload's ``resourceVersion``
    (a ``test`` op): Kueue writes the same conditions list, so a write computed from an older read must fail
    (422 / 409) rather than erase what Kueue wrote meanwhile (an eviction); the next reconcile reads again."""
    status = workload.get("status") or {}
    ops: list[dict[str, Any]] = [
        {"op": "test", "path": "/metadata/resourceVersion", "value": workload["metadata"]["resourceVersion"]}
    ]
    if "status" not in workload:
        ops.append({"op": "add", "path": "/status", "value": {}})
    for key, value in patch.items():
        if value is None:
            if key in status:
                ops.append({"op": "remove", "path": f"/status/{key}"})
        else:
            ops.append({"op": "add", "path": f"/status/{key}", "value": value})
    return ops


def _conditions(workload: dict[str, Any], now: str, *updates: tuple[str, bool, str, str]) -> list[dict[str, Any]]:
    conditions = list((workload.get("status") or {}).get("conditions") or [])
    generation = (workload.get("metadata") or {}).get("generation")
    for type_, value, reason, message in updates:
        conditions = set_condition(conditions, type_, value, reason, message, generation, now)
    return conditions


def release_quota(workload: dict[str, Any], ev: Eviction, now: str | None = None) -> dict[str, Any]:
    """The status patch giving an evicted Workload's quota back once the run's pods are gone (Kueue's
    ``workload.UnsetQuotaReservationWithCondition(wl, "Pending", message)``, ``PodsReady`` False if it was set, and
    ``Requeued`` True with the eviction's reason for a preemption): Kueue queues it again and may readmit it, on other
    flavors too."""
    now = now or now_rfc3339()
    message = ev.message or f"evicted: {ev.reason}"
    updates = [
        (QUOTA_RESERVED, False, "Pending", message),
        (ADMITTED, False, "NoReservation", "The workload has no reservation"),
    ]
    if ev.reason == PREEMPTED_REASON:
        updates.append((REQUEUED, True, ev.reason, message))
    if condition(workload, PODS_READY) is not None:  # the pods are gone (Kueue's job side resets it with the quota)
        updates.append((PODS_READY, False, "WaitForStart", "The pods were stopped: the workload is queued again"))
    return {"admission": None, "conditions": _conditions(workload, now, *updates)}


def pods_ready(workload: dict[str, Any], ready: bool, now: str | None = None) -> dict[str, Any] | None:
    """The status patch setting ``PodsReady`` (True: every pod of the attempt is ready; False ``WaitForStart``),
    or None when it says so already."""
    found = condition(workload, PODS_READY) or {}
    if found.get("status") == ("True" if ready else "False"):
        return None
    reason, message = (
        ("PodsReady", "All pods reached readiness") if ready else ("WaitForStart", "Not all pods are ready")
    )
    return {"conditions": _conditions(workload, now or now_rfc3339(), (PODS_READY, ready, reason, message))}


def finished(workload: dict[str, Any], reason: str, message: str, now: str | None = None) -> dict[str, Any] | None:
    """The status patch setting ``Finished`` True (``reason`` ``Succeeded`` or ``Failed``: Kueue frees the quota),
    or None when it is set already."""
    if is_true(workload, FINISHED):
        return None
    return {"conditions": _conditions(workload, now or now_rfc3339(), (FINISHED, True, reason, message))}
