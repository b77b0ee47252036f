"""RBAC is least privilege, and proven: the chart grants exactly the API calls the operator makes.

The emulator logs every request as (apiGroup, resource[/subresource], verb). A whole
run lifecycle (create, rollout ready, status, spec change, suspend, resume, success,
deletion) plus every other operator test of the session (``RBAC_USAGE``) is compared
with the rules the Helm chart renders — in both of its modes, and with ``kueue.enabled`` (a Kueue lifecycle against
the Kueue stand-in, plus every Kueue test's calls: ``KUEUE_RBAC_USAGE``). The grants admission needs rather
than a call (``ADMISSION_REQUIRED``: ``rlruns/finalizers`` update, for ``blockOwnerDeletion``
owner references) are never used, so they must be granted but are not expected in the log.
"""

from __future__ import annotations

import kopf
from rlrun_operator.naming import PRIORITY_LABEL, QUEUE_LABEL

from tests.kube.conftest import KUEUE_RBAC_USAGE, LOCAL_QUEUE, NAMESPACE, RBAC_USAGE
from tests.kube.test_preemption import attempt_pods, finish_old_pods
from tests.support.chart import ADMISSION_REQUIRED, WATCHED, of_kind, only, permissions, render
from tests.support.kube import KopfThread
from tests.support.manifests import manifest
from tests.support.polling import wait_for


def lifecycle(cluster) -> None:
    """Drive one run through every operator path that touches the API."""
    cluster.kube.create("rlruns", manifest(), NAMESPACE)
    wait_for(lambda: len(cluster.pods()) == 3, what="pods")
    cluster.set_pod_status(cluster.pod("rollout"), ip="10.0.0.9")
    cluster.run_orchestrator()
    wait_for(lambda: cluster.status().get("phase") == "Running", what="Running")
    cluster.kube.patch("rlruns", "demo", {"spec": {"max_steps": 50}}, NAMESPACE)
    cluster.kube.patch("rlruns", "demo", {"spec": {"suspend": True}}, NAMESPACE)
    wait_for(lambda: cluster.status().get("phase") == "Suspended", what="Suspended")
    cluster.kube.patch("rlruns", "demo", {"spec": {"suspend": False}}, NAMESPACE)
    wait_for(lambda: cluster.status().get("attempt") == 1 and len(cluster.pods()) == 3, what="attempt 1")
    # a preemption: the orchestrator is disrupted, attempt 2 resumes (nodes are watched all along)
    fake = cluster.orchestrators.run(NAMESPACE, "demo")
    fake.status.update(attempt=1, phase="running")
    cluster.run_orchestrator()
    wait_for(lambda: "recovery" not in cluster.status(), what="attempt 1 confirmed")
    disruption = [{"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler"}]
    cluster.set_pod_status(cluster.pod("orchestrator"), conditions=disruption)
    wait_for(lambda: cluster.status().get("attempt") == 2 and len(cluster.pods()) == 3, what="attempt 2")
    fake.status.update(attempt=2)
    cluster.exit_pod(cluster.pod("orchestrator"))
    wait_for(lambda: cluster.status().get("phase") == "Succeeded", what="Succeeded")
    cluster.kube.delete("rlruns", "demo", NAMESPACE)
    wait_for(lambda: cluster.rlrun() is None, what="deleted")


def test_cluster_role_grants_exactly_what_the_operator_uses(cluster):
    lifecycle(cluster)
    used = cluster.kube.rbac_usage() | RBAC_USAGE
    granted = permissions(only(render(), "ClusterRole")["rules"])
    assert used - granted == set(), "the operator calls what the ClusterRole does not grant"
    assert granted - used - ADMISSION_REQUIRED == set(), "the ClusterRole grants what the operator never uses"
    assert granted >= ADMISSION_REQUIRED, "the ClusterRole lacks what admission requires"


def test_namespaced_roles_suffice_when_watching_listed_namespaces(cluster):
    cluster.operator.stop()
    cluster.kube.clear_requests()
    cluster.operator = KopfThread(kopf.get_default_registry(), cluster.kube, namespaces=[NAMESPACE]).start()
    lifecycle(cluster)
    used = cluster.kube.rbac_usage()
    objects = render(f"watchNamespaces={{{','.join(WATCHED)}}}")
    role = next(r for r in of_kind(objects, "Role") if r["metadata"]["namespace"] == NAMESPACE)
    granted = permissions(role["rules"]) | permissions(only(objects, "ClusterRole")["rules"])
    assert used - granted == set(), "the operator calls what the Role and ClusterRole do not grant"
    assert granted - used - ADMISSION_REQUIRED == set(), "the Role and ClusterRole grant what the operator never uses"
    assert permissions(role["rules"]) >= ADMISSION_REQUIRED, "the Role lacks what admission requires"
    namespaced_requests = {(r.namespace, r.resource) for r in cluster.kube.requests if r.namespace}
    assert {ns for ns, _ in namespaced_requests} == {NAMESPACE}  # nothing outside the watched namespace


def kueue_lifecycle(cluster, kueue) -> None:
    """Drive one labelled run through every Kueue path that touches the API (and another whose label is removed
    while queued: its Workload deleted): a priority class, queued, admitted on a
    flavor, running (PodsReady), a spec change, evicted (quota released) and readmitted, suspended (the Workload
    deactivated) and resumed, succeeded (Finished), deleted."""
    # a labelled run whose label is removed while it waits in a queue that does not exist: its Workload is deleted
    other = manifest(name="other")
    other["metadata"]["labels"] = {QUEUE_LABEL: "nowhere"}
    cluster.kube.create("rlruns", other, NAMESPACE)
    wait_for(lambda: kueue.workload("rlrun-other"), what="other's Workload")
    cluster.kube.patch("rlruns", "other", {"metadata": {"labels": {QUEUE_LABEL: None}}}, NAMESPACE)
    wait_for(lambda: kueue.workload("rlrun-other") is None, what="other's Workload deleted")
    cluster.kube.delete("rlruns", "other", NAMESPACE)
    priority = {"apiVersion": "kueue.x-k8s.io/v1beta1", "kind": "WorkloadPriorityClass", "metadata": {"name": "high"}}
    cluster.kube.create("workloadpriorityclasses", {**priority, "value": 100})
    doc = manifest()
    doc["metadata"]["labels"] = {QUEUE_LABEL: LOCAL_QUEUE, PRIORITY_LABEL: "high"}
    cluster.kube.create("rlruns", doc, NAMESPACE)
    wait_for(lambda: len(cluster.pods()) == 3, what="pods")
    fake = cluster.orchestrators.run(NAMESPACE, "demo")
    cluster.set_pod_status(cluster.pod("rollout"), ip="10.0.0.9")
    cluster.set_pod_status(cluster.pod("trainer"), ip="10.0.0.8")
    cluster.run_orchestrator()
    wait_for(lambda: cluster.status().get("phase") == "Running", what="Running")
    cluster.kube.patch("rlruns", "demo", {"spec": {"max_steps": 50}}, NAMESPACE)
    kueue.evict("rlrun-demo")
    finish_old_pods(cluster, 0)
    wait_for(lambda: len(attempt_pods(cluster, 1)) == 3, what="attempt 1, readmitted")
    fake.status.update(attempt=1, phase="running")
    cluster.run_orchestrator()
    wait_for(lambda: "recovery" not in cluster.status(), what="attempt 1 confirmed")
    cluster.kube.patch("rlruns", "demo", {"spec": {"suspend": True}}, NAMESPACE)
    finish_old_pods(cluster, 1)
    wait_for(lambda: (kueue.workload("rlrun-demo") or {}).get("spec", {}).get("active") is False, what="inactive")
    cluster.kube.patch("rlruns", "demo", {"spec": {"suspend": False}}, NAMESPACE)
    wait_for(lambda: len(attempt_pods(cluster, 2)) == 3, what="attempt 2")
    fake.status.update(attempt=2, phase="running")
    cluster.run_orchestrator()
    cluster.exit_pod(cluster.pod("orchestrator"))
    wait_for(lambda: cluster.status().get("phase") == "Succeeded", what="Succeeded")
    cluster.kube.delete("rlruns", "demo", NAMESPACE)
    wait_for(lambda: cluster.rlrun() is None, what="deleted")


def test_the_kueue_modes_grants_are_exactly_what_the_operator_uses(kueue, cluster):
    kueue_lifecycle(cluster, kueue)
    used = cluster.kube.rbac_usage() | KUEUE_RBAC_USAGE
    granted = permissions(only(render("kueue.enabled=true"), "ClusterRole")["rules"])
    assert {p for p in used if p[0] == "kueue.x-k8s.io"}, "the lifecycle called nothing of Kueue's"
    assert used - granted == set(), "the operator calls what the Kueue mode's ClusterRole does not grant"
    assert granted - used - ADMISSION_REQUIRED == set(), (
        "the Kueue mode's ClusterRole grants what the operator never uses"
    )
