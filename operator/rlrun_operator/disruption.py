"""Pure classification: is one of a run's pods disrupted, and is that a preemption or a failure?

:func:`disruption` looks at one pod (:class:`~rlrun_operator.status.PodView`) and its node
(:class:`NodeView`, None when the Node object is gone) and returns a :class:`Disruption` or
None. Nothing here talks to Kubernetes; the reconciler (``reconcile.py``) acts on the answer.

Rules, first match wins (the exit-code cases are those other operators reported from real
clusters: Kubeflow's training-operator, JobSet, KubeRay):

| the pod | trigger | kind |
|---|---|---|
| deleted by the operator itself | — (not a disruption) | — |
| Failed, exit report ``permanent`` (exit 78) | PodFailed | failure, permanent |
| Failed with ``DisruptionTarget=True`` (137 ``Error``, 143 ``TerminationByKubelet``, …) | PodFailed | preemption |
| Failed, ``OOMKilled`` and no ``DisruptionTarget`` | PodFailed | failure |
| Failed with reason ``Evicted``/``Terminated``/``NodeLost``/``Shutdown``/``NodeShutdown`` | PodFailed | preemption |
| Failed, exit 137/143 on a node that is tainted, not ready or gone | PodFailed | preemption |
| Failed otherwise | PodFailed | failure |
| Succeeded but the run is not complete (it paused on a SIGTERM) | ExitedEarly | preemption |
| ``DisruptionTarget=True`` (any reason; ``False`` after a blocked eviction: nothing) | DisruptionTarget | preemption |
| a ``deletionTimestamp`` the operator did not cause | PodDeleted | preemption |
| its Node object is gone | NodeGone | preemption |
| its node has a taint of :data:`.settings.NODE_TAINTS` or of ``disruption_taints`` | NodeTainted | preemption |

A pod that exited 0 before the end counts as a preemption: something outside the run
stopped it, and it paused cleanly (its snapshot is on the volume), so nothing is lost.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from rlrun.api.status import RecoveryKind, Trigger

from rlrun_operator.settings import NODE_TAINTS
from rlrun_operator.status import PodView

#: ``status.reason`` of pods the kubelet or the node lifecycle stopped (not the pod's own fault).
NODE_STOP_REASONS = frozenset({"Evicted", "Terminated", "NodeLost", "Shutdown", "NodeShutdown", "Preempting"})
#: Exit codes of a process killed by a signal: 137 SIGKILL, 143 SIGTERM.
SIGNAL_EXIT_CODES = frozenset({137, 143})
#: ``DisruptionTarget`` reasons that say the node itself is going away (its pods should avoid it).
NODE_DISRUPTIONS = frozenset({"DeletionByTaintManager", "TerminationByKubelet", "DeletionByPodGC"})


@dataclass(frozen=True)
class NodeView:
    """What the operator needs to know of a Node (from the nodes index).

    Attributes:
        name: node name.
        taints: keys of its ``spec.taints``.
        ready: its ``Ready`` condition is True (False or Unknown: NotReady / unreachable).
    """

    name: str
    taints: frozenset[str]
    ready: bool = True


def node_view(body: dict[str, Any]) -> NodeView:
    """A :class:`NodeView` from a Node object (a node without a ``Ready`` condition yet counts as ready)."""
    spec, status = body.get("spec") or {}, body.get("status") or {}
    ready = next((c.get("status") for c in status.get("conditions") or [] if c.get("type") == "Ready"), "True")
    return NodeView(
        name=(body.get("metadata") or {}).get("name", ""),
        taints=frozenset(t.get("key", "") for t in spec.get("taints") or []),
        ready=ready == "True",
    )


@dataclass(frozen=True)
class Disruption:
    """One disrupted pod, classified.

    Attributes:
        trigger: a :class:`~rlrun.api.status.Trigger`.
        kind: ``preemption`` or ``failure`` (:class:`~rlrun.api.status.RecoveryKind`).
        reason: the trigger's own reason (a ``DisruptionTarget`` reason, a taint key, ``OOMKilled``, …).
        pod: the pod's name.
        component: orchestrator, trainer or rollout.
        node: the pod's node, if scheduled.
        node_lost: the node itself is going away (the next attempt avoids it).
        permanent: a failure retrying cannot heal (the process said so in its exit report).
    """

    trigger: str
    kind: str
    reason: str
    pod: str
    component: str
    node: str | None = None
    node_lost: bool = False
    permanent: bool = False

    @property
    def message(self) -> str:
        """One line for a condition or Event: what happened to which pod on which node."""
        where = f" on node {self.node}" if self.node else ""
        return f"pod {self.pod}{where}: {self.trigger} ({self.reason})"


def node_trouble(node: NodeView | None, scheduled: bool, taints: Iterable[str]) -> tuple[str, str] | None:
    """``(trigger, reason)`` when a pod's node is gone or tainted to go away, else None.

    Args:
        node: the pod's node, None when its Node object does not exist.
        scheduled: the pod has a ``spec.nodeName`` (an unscheduled pod has no node to lose).
        taints: the ``disruption_taints`` setting (Kubernetes' own :data:`NODE_TAINTS` always count).
    """
    if not scheduled:
        return None
    if node is None:
        return Trigger.NODE_GONE, "NodeDeleted"
    watched = set(NODE_TAINTS) | set(taints)
    hit = sorted(node.taints & watched)
    if hit:
        return Trigger.NODE_TAINTED, hit[0]
    if not node.ready:
        return Trigger.NODE_TAINTED, "NodeNotReady"
    return None


def disruption(
    pod: PodView,
    node: NodeView | None,
    *,
    deleted_by_operator: bool,
    run_complete: bool,
    taints: Iterable[str] = (),
) -> Disruption | None:
    """Classify ``pod`` (see the module's table); None when it is not disrupted.

    Args:
        pod: the pod as the index saw it.
        node: its node (None: no Node object of that name, or the pod is not scheduled).
        deleted_by_operator: the operator deleted this pod itself (``status.deletedPods``).
        run_complete: the orchestrator reported ``step == max_steps`` (an exit 0 is then the end, not a stop).
        taints: the operator's ``disruption_taints`` setting.
    """
    if deleted_by_operator:
        return None
    trouble = node_trouble(node, pod.node is not None, taints)

    def make(trigger: str, kind: str, reason: str, *, node_lost: bool = False, permanent: bool = False) -> Disruption:
        return Disruption(trigger, kind, reason, pod.name, pod.component, pod.node, node_lost, permanent)

    if pod.phase == "Failed":
        report = pod.exit_report
        if report is not None and report.permanent:
            return make(Trigger.POD_FAILED, RecoveryKind.FAILURE, report.reason or "PermanentError", permanent=True)
        if pod.disruption is not None:
            lost = pod.disruption in NODE_DISRUPTIONS or trouble is not None
            return make(Trigger.POD_FAILED, RecoveryKind.PREEMPTION, pod.disruption, node_lost=lost)
        if pod.reason == "OOMKilled":
            return make(Trigger.POD_FAILED, RecoveryKind.FAILURE, "OOMKilled")
        if pod.status_reason in NODE_STOP_REASONS:
            return make(Trigger.POD_FAILED, RecoveryKind.PREEMPTION, pod.status_reason, node_lost=True)
        # stopped by a signal: its exit code, or the exit report of a process that exits with its own code
        # after handling one (torchrun exits 1 once its ranks saved on SIGTERM; rank 0's report says so)
        stopped = pod.exit_code in SIGNAL_EXIT_CODES or (report is not None and report.outcome == "interrupted")
        if stopped and trouble is not None:
            return make(Trigger.POD_FAILED, RecoveryKind.PREEMPTION, trouble[1], node_lost=True)
        return make(Trigger.POD_FAILED, RecoveryKind.FAILURE, pod.reason or "Error")
    if pod.phase == "Succeeded":
        if run_complete or (pod.exit_report is not None and pod.exit_report.outcome == "complete"):
            return None
        reason = pod.disruption or (pod.exit_report.outcome if pod.exit_report else "Completed")
        return make(Trigger.EXITED_EARLY, RecoveryKind.PREEMPTION, reason, node_lost=trouble is not None)
    if pod.disruption is not None:
        lost = pod.disruption in NODE_DISRUPTIONS or trouble is not None
        return make(Trigger.DISRUPTION_TARGET, RecoveryKind.PREEMPTION, pod.disruption, node_lost=lost)
    if pod.deleting:
        return make(Trigger.POD_DELETED, RecoveryKind.PREEMPTION, "DeletedByOther", node_lost=trouble is not None)
    if trouble is not None:
        return make(trouble[0], RecoveryKind.PREEMPTION, trouble[1], node_lost=True)
    return None
