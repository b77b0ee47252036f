"""``KueueStandIn``: Kueue's scheduler and workload controller, reduced to the Workload transitions a job integration
sees.

Invariant: a Workload holds quota (QuotaReserved True, ``status.admission``) only while its pod sets fit
what its ClusterQueue has left, and keeps it, once reserved, until the job side releases it (QuotaReserved
False, admission removed) or it finishes; eviction (``evict``, ``spec.active: false``) only marks it
(``Evicted`` True), as Kueue does, and the quota stays reserved until the release.

It runs in a thread of its own and acts on the API emulator's objects on the emulator's loop, so each pass
(read every queue, flavor and workload; write each change) is atomic: no write of the job side falls
between its reads and its writes. A pass runs when anything in the emulator changed (its
``resourceVersion`` moved) or a test called ``hold``/``release``, at most every ``interval`` seconds.
Its writes are not in the request log: they are Kueue's, not the operator's (RBAC proof).

Differences from Kueue: one ClusterQueue's own quota (no cohorts, borrowing, preemption, fair sharing,
admission checks, topology, partial admission, ``waitForPodsReady``); no Events; no ClusterQueue or
LocalQueue status. Preemption is played by a test (``evict``) instead of a higher-priority workload.
"""

from __future__ import annotations

import copy
import logging
import threading
from typing import Any

from ..kube import ApiError, KubeServer
from ..polling import wait_for
from . import conditions as c
from .crds import GROUP, KUEUE_CRDS, VERSION
from .quota import Usage, assign, expression_matches, reserved_usage

log = logging.getLogger(__name__)

WORKLOADS = f"{GROUP}/{VERSION}/workloads"
FLAVORS = f"{GROUP}/{VERSION}/resourceflavors"
CLUSTER_QUEUES = f"{GROUP}/{VERSION}/clusterqueues"
LOCAL_QUEUES = f"{GROUP}/{VERSION}/localqueues"
PRIORITY_CLASSES = f"{GROUP}/{VERSION}/workloadpriorityclasses"


def _queue_order(workload: dict[str, Any]) -> tuple[int, str, str]:
    """Kueue's queue order: higher ``spec.priority`` first, then the older (``creationTimestamp``, then name)."""
    meta = workload["metadata"]
    return -(workload["spec"].get("priority") or 0), meta["creationTimestamp"], meta["name"]


class KueueStandIn:
    """Kueue for tests against a ``KubeServer``: admits, keeps pending and evicts Workloads as Kueue v0.13 does.

    Usage::

        kueue = KueueStandIn(kube, "team-a")
        kueue.install()                                   # the CRDs (before an operator watches Workloads)
        kueue.flavor("a100", node_labels={"gpu": "a100"})
        kueue.cluster_queue("cq", {"a100": {"cpu": "8", "memory": "64Gi", "nvidia.com/gpu": "4"}})
        kueue.local_queue("q", "cq")
        with kueue:                                       # start() ... stop()
            ...                                           # Workloads in "q" are admitted within ~interval s
            kueue.evict("rlrun-demo")                     # Evicted True (Preempted), quota still reserved

    Names (``evict``, ``hold``, ``workload``) are Workload names in ``namespace``.

    Attributes:
        interval: the longest wait between two passes, in seconds.
        passes: how many passes changed something (for tests of the stand-in).
    """

    def __init__(self, kube: KubeServer, namespace: str, interval: float = 0.05) -> None:
        self.kube = kube
        self.namespace = namespace
        self.interval = interval
        self.passes = 0
        self._held: set[tuple[str, str]] = set()
        self._seen_rv = -1
        self._dirty = threading.Event()  # a hold was released: pass even if no object changed
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    # -- set-up: the CRDs and the queues --------------------------------------------------------------------

    def install(self) -> None:
        """Create (or replace) :data:`KUEUE_CRDS` in the emulator; their resources are served at once."""
        for crd in KUEUE_CRDS:
            current = self.kube.get("customresourcedefinitions", crd["metadata"]["name"])
            if current is None:
                self.kube.create("customresourcedefinitions", copy.deepcopy(crd))
            else:
                body = copy.deepcopy(crd)
                body["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
                self.kube.replace("customresourcedefinitions", crd["metadata"]["name"], body)

    def _apply(self, resource: str, name: str, body: dict[str, Any], namespace: str | None = None) -> dict[str, Any]:
        """Create the object, or merge its fields into the existing one (what ``kubectl apply`` would leave)."""
        try:
            return self.kube.create(resource, {"metadata": {"name": name}, **body}, namespace)
        except ApiError as e:
            if e.code != 409:
                raise
            return self.kube.patch(resource, name, body, namespace)

    def flavor(
        self,
        name: str,
        node_labels: dict[str, str] | None = None,
        tolerations: list[dict[str, Any]] | None = None,
        node_taints: list[dict[str, Any]] | None = None,
    ) -> None:
        """A ResourceFlavor: its pods get ``node_labels`` as node selector and ``tolerations`` (the job side adds them);
        pod sets that do not tolerate ``node_taints`` (NoSchedule/NoExecute) are not assigned to it."""
        spec = {"nodeLabels": node_labels or {}, "tolerations": tolerations or [], "nodeTaints": node_taints or []}
        self._apply(FLAVORS, name, {"spec": spec})

    def cluster_queue(
        self, name: str, quotas: dict[str, dict[str, str]], namespace_selector: dict | None = None
    ) -> None:
        """A ClusterQueue with one resource group: ``quotas`` {flavor: {resource: nominalQuota}}, flavors tried in
        this order; the group covers every resource named. ``namespace_selector``: a LabelSelector (default
        ``{}``: every namespace; Kueue's null would admit none)."""
        covered = list(dict.fromkeys(r for resources in quotas.values() for r in resources))
        flavors = [
            {"name": flavor, "resources": [{"name": r, "nominalQuota": resources.get(r, "0")} for r in covered]}
            for flavor, resources in quotas.items()
        ]
        spec = {
            "namespaceSelector": namespace_selector if namespace_selector is not None else {},
            "resourceGroups": [{"coveredResources": covered, "flavors": flavors}],
        }
        self._apply(CLUSTER_QUEUES, name, {"spec": spec})

    def local_queue(self, name: str, cluster_queue: str, namespace: str | None = None) -> None:
        """A LocalQueue in ``namespace`` (default: the stand-in's) pointing at ``cluster_queue``."""
        self._apply(LOCAL_QUEUES, name, {"spec": {"clusterQueue": cluster_queue}}, namespace or self.namespace)

    def priority_class(self, name: str, value: int, description: str = "") -> None:
        """A WorkloadPriorityClass (cluster-scoped; its ``value`` is what a Workload's ``spec.priority`` copies)."""
        self._apply(PRIORITY_CLASSES, name, {"value": value, "description": description})

    # -- the controller thread ------------------------------------------------------------------------------

    def start(self) -> KueueStandIn:
        """Start the controller thread (after :meth:`install`).

        Raises:
            RuntimeError: already started.
        """
        if self._thread is not None:
            raise RuntimeError("the Kueue stand-in is already started")
        self._stopping.clear()
        self._thread = threading.Thread(target=self._run, name="kueue-standin", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop and join the thread (idempotent).

        Raises:
            RuntimeError: a pass failed while it ran (the test should not pass on a broken Kueue).
        """
        if self._thread is not None:
            self._stopping.set()
            self._wake.set()
            self._thread.join(timeout)
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"the Kueue stand-in failed: {error!r}") from error

    def __enter__(self) -> KueueStandIn:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                if self.kube.call(self._pass):
                    self.passes += 1
            except Exception as e:  # kept for stop(): a silent Kueue would hang the test instead of failing it
                log.exception("Kueue stand-in: a pass failed")
                self._error = e
                return
            self._wake.wait(self.interval)
            self._wake.clear()

    # -- what tests ask of Kueue ----------------------------------------------------------------------------

    def evict(
        self, name: str, reason: str = "Preempted", message: str | None = None, preempted_reason: str = "InClusterQueue"
    ) -> None:
        """Evict a Workload holding quota, as Kueue does: ``Evicted`` True (``reason``, ``message``), and for
        ``Preempted`` also the ``Preempted`` condition True (``preempted_reason``, e.g. ``InCohortReclamation``).

        The quota stays reserved (admission kept) until the job side releases it; then the workload is
        readmitted when it fits, unless held. Default messages are Kueue's for the reason. Evicting an
        evicted workload changes nothing (Kueue's preemptor skips it).

        Raises:
            LookupError: no such Workload.
            ValueError: it holds no quota (Kueue evicts only workloads with QuotaReserved True).
        """
        self.kube.call(self._evict, self.namespace, name, reason, message, preempted_reason)

    def hold(self, name: str) -> None:
        """Never (re)admit this Workload (it may not exist yet) until :meth:`release`; what it holds, it keeps."""
        self._held.add((self.namespace, name))

    def release(self, name: str) -> None:
        """Let a held Workload be admitted again (at the next pass)."""
        self._held.discard((self.namespace, name))
        self._dirty.set()
        self._wake.set()

    def settled(self) -> bool:
        """Whether a pass has seen every change made so far (and a released hold): Kueue has nothing left to do."""
        return self.kube.call(lambda: self.kube.emulator.resource_version == self._seen_rv and not self._dirty.is_set())

    def wait_settled(self, timeout: float = 5.0) -> None:
        """Wait until :meth:`settled`: how a test shows that Kueue did *not* admit something.

        Raises:
            AssertionError: not settled within ``timeout`` seconds (something keeps changing, or a pass failed).
        """
        wait_for(self.settled, timeout, what="the Kueue stand-in to act on every change")

    def workload(self, name: str) -> dict[str, Any] | None:
        """The Workload as stored now, or None."""
        return self.kube.get(WORKLOADS, name, self.namespace)

    def condition(self, name: str, type_: str) -> dict[str, Any] | None:
        """A condition of the Workload (None: no such condition or workload)."""
        return c.find((self.workload(name) or {}).get("status") or {}, type_)

    # -- a pass, on the emulator's loop ---------------------------------------------------------------------

    def _evict(self, namespace: str, name: str, reason: str, message: str | None, preempted_reason: str) -> None:
        em = self.kube.emulator
        wl = em.get_object(WORKLOADS, name, namespace)
        if wl is None:
            raise LookupError(f"no Workload {namespace}/{name}")
        status = copy.deepcopy(wl.get("status") or {})
        if not c.is_true(status, c.QUOTA_RESERVED):
            raise ValueError(f"Workload {namespace}/{name} holds no quota: Kueue evicts only admitted workloads")
        if c.is_true(status, c.EVICTED):
            return
        if message is None:
            if reason == c.EVICTED_BY_PREEMPTION:
                message = c.preemption_message(preempted_reason)
            else:
                message = c.EVICTION_MESSAGES.get(reason, reason).format(name=f"{namespace}/{name}")
        generation = wl["metadata"].get("generation", 1)
        c.set_condition(status, c.EVICTED, True, reason, message, generation)
        if reason == c.EVICTED_BY_PREEMPTION:
            c.set_condition(status, c.PREEMPTED, True, preempted_reason, message, generation)
        self._write(wl, status)

    def _pass(self) -> bool:
        """One scheduling and workload-controller pass over every Workload; True when it wrote anything."""
        em = self.kube.emulator
        if em.resource_version == self._seen_rv and not self._dirty.is_set():
            return False
        self._dirty.clear()
        flavors = {f["metadata"]["name"]: f for f in em.list_objects(FLAVORS)}
        cluster_queues = {q["metadata"]["name"]: q for q in em.list_objects(CLUSTER_QUEUES)}
        local_queues = {(q["metadata"]["namespace"], q["metadata"]["name"]): q for q in em.list_objects(LOCAL_QUEUES)}
        workloads = [w for w in em.list_objects(WORKLOADS) if (w.get("spec") or {}).get("queueName")]
        used: dict[str, Usage] = {}
        for wl in workloads:
            status = wl.get("status") or {}
            if c.is_true(status, c.QUOTA_RESERVED) and not c.is_true(status, c.FINISHED) and status.get("admission"):
                cq_usage = used.setdefault(status["admission"]["clusterQueue"], {})
                for key, value in reserved_usage(wl).items():
                    cq_usage[key] = cq_usage.get(key, 0) + value
        wrote = False
        # BestEffortFIFO: a workload that does not fit does not block the ones behind it
        for wl in sorted(workloads, key=_queue_order):
            wrote |= self._reconcile(wl, flavors, cluster_queues, local_queues, used)
        self._seen_rv = em.resource_version
        return wrote

    def _reconcile(
        self,
        wl: dict[str, Any],
        flavors: dict[str, dict],
        cluster_queues: dict[str, dict],
        local_queues: dict[tuple[str, str], dict],
        used: dict[str, Usage],
    ) -> bool:
        meta, spec = wl["metadata"], wl["spec"]
        status = copy.deepcopy(wl.get("status") or {})
        generation = meta.get("generation", 1)
        if c.is_true(status, c.FINISHED):
            return False
        if not spec.get("active", True):
            # The workload controller evicts a deactivated workload (with or without quota), once.
            if c.is_true(status, c.EVICTED):
                return False
            c.set_condition(status, c.EVICTED, True, c.DEACTIVATED, c.DEACTIVATED_MESSAGE, generation)
            return self._write(wl, status)
        requeued = c.find(status, c.REQUEUED) or {}
        if requeued.get("status") == "False" and requeued.get("reason") == c.DEACTIVATED:
            c.set_condition(status, c.REQUEUED, True, "Reactivated", "The workload was reactivated", generation)
        if c.is_true(status, c.QUOTA_RESERVED):
            # Reserved (admitted, or evicted and waiting for the job side's release): nothing to decide.
            c.sync_admitted(status, generation)
            return self._write(wl, status)
        if (meta["namespace"], meta["name"]) in self._held:
            return self._write(wl, status)
        queue_name = spec["queueName"]
        local_queue = local_queues.get((meta["namespace"], queue_name))
        cq_name = ((local_queue or {}).get("spec") or {}).get("clusterQueue", "")
        cluster_queue = cluster_queues.get(cq_name)
        if local_queue is None:
            reason, message = c.INADMISSIBLE, f"LocalQueue {queue_name} doesn't exist"
        elif cluster_queue is None:
            reason, message = c.INADMISSIBLE, f"ClusterQueue {cq_name} doesn't exist"
        elif not self._active(cluster_queue, flavors):
            reason, message = c.INADMISSIBLE, f"ClusterQueue {cq_name} is inactive"
        elif not self._namespace_matches(cluster_queue, meta["namespace"]):
            reason, message = c.PENDING, "Workload namespace doesn't match ClusterQueue selector"
        else:
            cq_usage = used.setdefault(cq_name, {})
            assignment = assign(wl, cluster_queue, flavors, cq_usage)
            if assignment.pod_set_assignments is None:
                reason, message = c.PENDING, assignment.message
            else:
                admission = {"clusterQueue": cq_name, "podSetAssignments": assignment.pod_set_assignments}
                c.set_quota_reservation(status, admission, generation)
                c.sync_admitted(status, generation)
                for key, value in assignment.usage.items():  # the next workloads of this pass see it taken
                    cq_usage[key] = cq_usage.get(key, 0) + value
                return self._write(wl, status)
        c.unset_quota_reservation(status, reason, message, generation)
        return self._write(wl, status)

    @staticmethod
    def _active(cluster_queue: dict[str, Any], flavors: dict[str, dict]) -> bool:
        """Kueue's ClusterQueue ``Active`` condition: not stopped, and every flavor it names exists."""
        spec = cluster_queue.get("spec") or {}
        names = {f["name"] for g in spec.get("resourceGroups") or [] for f in g["flavors"]}
        return spec.get("stopPolicy", "None") == "None" and names <= set(flavors)

    def _namespace_matches(self, cluster_queue: dict[str, Any], namespace: str) -> bool:
        """``spec.namespaceSelector`` against the namespace's labels (null selects nothing, ``{}`` everything)."""
        selector = (cluster_queue.get("spec") or {}).get("namespaceSelector")
        if selector is None:
            return False
        ns = self.kube.emulator.get_object("v1/namespaces", namespace) or {}
        labels = {**((ns.get("metadata") or {}).get("labels") or {}), "kubernetes.io/metadata.name": namespace}
        return all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items()) and all(
            expression_matches(e, labels) for e in selector.get("matchExpressions") or []
        )

    def _write(self, wl: dict[str, Any], status: dict[str, Any]) -> bool:
        """Write ``status`` as the Workload's status (a merge patch of the status subresource; None deletes)."""
        meta = wl["metadata"]
        old = wl.get("status") or {}
        patch = {k: v for k, v in status.items() if old.get(k) != v}
        patch.update({k: None for k in old if k not in status})
        if not patch:
            return False
        self.kube.emulator.patch_object(
            WORKLOADS, meta["name"], {"status": patch}, meta["namespace"], subresource="status"
        )
        return True
