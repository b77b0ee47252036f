"""Kueue (issue 41) end to end against the API emulator: the real operator with its integration on, Kueue's
stand-in (``tests/support/kueue.py``) playing Kueue's Workload transitions, fake orchestrators.

A run labelled ``kueue.x-k8s.io/queue-name`` gets a Workload and no pod until Kueue admits it; its pods carry the
admitted flavor's node labels and tolerations; an eviction is a preemption (pause → snapshot → stop), after which the
operator gives the quota back and the run waits, queued, for readmission and resumes with ``--resume``.
"""

from __future__ import annotations

import time
from pathlib import Path

import yaml
from rlrun_operator.naming import PRIORITY_LABEL, QUEUE_LABEL

from tests.kube.conftest import GPU_POOL, GPU_TOLERATION, LOCAL_QUEUE, NAMESPACE
from tests.kube.test_preemption import (
    LATER,
    add_node,
    attempt_pods,
    command_of,
    confirm_resume,
    disrupt,
    finish_old_pods,
)
from tests.support.manifests import manifest
from tests.support.polling import wait_for

ROOT = Path(__file__).resolve().parents[2]
WORKLOAD = "rlrun-demo"
WORKLOADS = "kueue.x-k8s.io/v1beta1/workloads"


def queued_manifest(queue: str = LOCAL_QUEUE, **spec) -> dict:
    doc = manifest(**spec)
    doc["metadata"]["labels"] = {QUEUE_LABEL: queue}
    return doc


def workload_condition(kueue, type_: str) -> dict:
    return next(
        (c for c in ((kueue.workload(WORKLOAD) or {}).get("status") or {}).get("conditions", []) if c["type"] == type_),
        {},
    )


def pod_creates(cluster) -> int:
    return sum(1 for r in cluster.kube.requests if r.rbac == ("", "pods", "create") and r.status == 201)


def recovery_of(cluster) -> dict:
    return cluster.status().get("recovery") or {}


def phase(cluster) -> str | None:
    return cluster.status().get("phase")


def admitted_run(cluster, kueue, **spec):
    """A labelled run, admitted and Running (every pod Running and Ready); returns its fake orchestrator."""
    cluster.kube.create("rlruns", queued_manifest(**spec), NAMESPACE)
    wait_for(lambda: len(cluster.pods()) == 3, what="pods")
    fake = cluster.orchestrators.run(NAMESPACE, "demo")
    for component in ("rollout", "trainer", "orchestrator"):
        cluster.set_pod_status(cluster.pod(component), ip="10.0.0.2" if component == "orchestrator" else "10.0.1.1")
    wait_for(lambda: phase(cluster) == "Running", what="Running")
    return fake


def test_no_pod_before_admission_then_pods_on_the_admitted_flavor(kueue, cluster):
    kueue.hold(WORKLOAD)
    cluster.kube.create("rlruns", queued_manifest(), NAMESPACE)
    wait_for(lambda: phase(cluster) == "Queued" and "queue" in cluster.status(), what="Queued")
    workload = wait_for(lambda: kueue.workload(WORKLOAD), what="the Workload")
    assert workload["spec"]["queueName"] == LOCAL_QUEUE
    assert [(s["name"], s["count"]) for s in workload["spec"]["podSets"]] == [
        ("orchestrator", 1),
        ("trainer", 1),
        ("rollout", 1),
    ]
    owner = workload["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["controller"]) == ("RLRun", "demo", True)
    status = cluster.status()
    assert status["recovery"]["stage"] == "Queued" and status["queue"]["name"] == LOCAL_QUEUE
    assert status["queue"]["workload"] == WORKLOAD and status["queue"]["admitted"] is False
    admitted = cluster.condition("Admitted")
    assert (admitted["status"], admitted["reason"]) == ("False", "Queued")
    time.sleep(0.5)
    assert cluster.pods() == [] and pod_creates(cluster) == 0
    kueue.release(WORKLOAD)
    wait_for(lambda: len(cluster.pods()) == 3, what="pods")
    for pod in cluster.pods():
        assert pod["spec"]["nodeSelector"] == GPU_POOL and GPU_TOLERATION in pod["spec"]["tolerations"]
        assert QUEUE_LABEL not in pod["metadata"]["labels"]  # Kueue's pod integration must not gate them
    status = wait_for(lambda: (s := cluster.status()).get("attempt") == 0 and s, what="attempt 0 recorded")
    admitted = cluster.condition("Admitted")
    assert (admitted["status"], admitted["reason"]) == ("True", "Admitted") and "cq" in admitted["message"]
    assert status["attempt"] == 0 and "recovery" not in status and status["preemptions"] == 0
    assert status["queue"] == {
        "name": LOCAL_QUEUE,
        "workload": WORKLOAD,
        "admitted": True,
        "clusterQueue": "cq",
        "flavors": {"orchestrator": ["gpu-a"], "trainer": ["gpu-a"], "rollout": ["gpu-a"]},
    }
    cluster.orchestrators.run(NAMESPACE, "demo")
    for component in ("rollout", "trainer", "orchestrator"):
        cluster.set_pod_status(cluster.pod(component), ip="10.0.0.2" if component == "orchestrator" else "10.0.1.1")
    wait_for(lambda: phase(cluster) == "Running", what="Running")
    wait_for(lambda: workload_condition(kueue, "PodsReady").get("status") == "True", what="PodsReady")
    cluster.wait_for_events("Queued", "Admitted", "Created")


def test_an_eviction_mid_run_pauses_stops_releases_the_quota_and_resumes_when_readmitted(kueue, cluster):
    fake = admitted_run(cluster, kueue)
    kueue.hold(WORKLOAD)  # it stays queued after the eviction until released
    kueue.evict(WORKLOAD, reason="Preempted", message="Preempted to accommodate a higher priority workload")
    wait_for(lambda: phase(cluster) == "Evicted", what="Evicted")
    status = cluster.status()
    assert (status["recovery"]["trigger"], status["recovery"]["reason"]) == ("KueueEviction", "Preempted")
    assert status["preemptions"] == 1 and cluster.condition("Admitted")["reason"] == "Evicted"
    finish_old_pods(cluster)
    assert fake.pauses == 1  # the snapshot was written before the pods were stopped
    wait_for(lambda: phase(cluster) == "Queued", what="Queued again")
    reserved = wait_for(
        lambda: (c := workload_condition(kueue, "QuotaReserved")) and c["status"] == "False" and c,
        what="quota released",
    )
    assert reserved["reason"] == "Pending"
    assert (
        workload_condition(kueue, "Requeued")["status"] == "True"
        and "admission" not in kueue.workload(WORKLOAD)["status"]
    )
    time.sleep(0.3)
    assert attempt_pods(cluster, 1) == []  # no pod while not admitted
    kueue.release(WORKLOAD)
    wait_for(lambda: len(attempt_pods(cluster, 1)) == 3, what="attempt 1 pods")
    for pod in attempt_pods(cluster, 1):
        if "--attempt" in command_of(pod):
            assert "--resume" in command_of(pod)
        assert pod["spec"]["nodeSelector"] == GPU_POOL
    confirm_resume(fake)
    wait_for(lambda: (c := cluster.condition("Resumed")) and c["status"] == "True", what="Resumed")
    status = cluster.status()
    assert status["preemptions"] == 1 and status["resumedGroups"] == 4 and status["lastResume"]["attempt"] == 1
    assert cluster.condition("Admitted")["status"] == "True" and cluster.condition("Preempted")["status"] == "False"
    events = cluster.wait_for_events("Evicted", "Paused", "QuotaReleased", "Admitted", "Resumed")
    evicted = [e for e in events if e["reason"] == "Evicted"]
    assert len(evicted) == 1 and evicted[0]["type"] == "Warning"
    assert "Kueue" in evicted[0]["message"] and "Preempted" in evicted[0]["message"]


def test_an_eviction_before_the_orchestrator_runs_stops_without_a_pause(kueue, cluster):
    cluster.kube.create("rlruns", queued_manifest(), NAMESPACE)
    wait_for(lambda: len(cluster.pods()) == 3, what="pods")
    fake = cluster.orchestrators.run(NAMESPACE, "demo")
    kueue.evict(WORKLOAD, reason="PodsReadyTimeout", message="Exceeded the PodsReady timeout")
    finish_old_pods(cluster)
    wait_for(lambda: len(attempt_pods(cluster, 1)) == 3, what="attempt 1 pods")  # readmitted at once
    assert fake.pauses == 0 and cluster.status()["preemptions"] == 1
    assert cluster.status()["recovery"]["reason"] == "PodsReadyTimeout"


def test_an_eviction_during_a_pod_loss_recovery_takes_it_over_as_the_same_preemption(kueue, cluster):
    fake = admitted_run(cluster, kueue)
    disrupt(cluster, cluster.pod("orchestrator"), reason="PreemptionByScheduler")
    finish_old_pods(cluster)
    wait_for(lambda: len(attempt_pods(cluster, 1)) == 3, what="attempt 1 pods")  # still admitted: it goes on
    wait_for(lambda: (cluster.status().get("recovery") or {}).get("stage") == "Resuming", what="Resuming")
    assert cluster.status()["preemptions"] == 1
    since = cluster.status()["recovery"]["since"]
    kueue.hold(WORKLOAD)
    kueue.evict(WORKLOAD)
    wait_for(lambda: (cluster.status().get("recovery") or {}).get("trigger") == "KueueEviction", what="taken over")
    # Kueue takes back the admission the lost pods ran under, before the run resumed: one interruption
    assert cluster.status()["preemptions"] == 1 and cluster.status()["recovery"]["since"] == since
    finish_old_pods(cluster, attempt=1)  # attempt 1 runs on quota Kueue took back: it stops too
    wait_for(lambda: phase(cluster) == "Queued", what="Queued")
    time.sleep(0.3)
    assert attempt_pods(cluster, 2) == [] and pod_creates(cluster) == 6
    kueue.release(WORKLOAD)
    wait_for(lambda: len(attempt_pods(cluster, 2)) == 3, what="attempt 2 pods")
    assert fake.pauses == 0 and cluster.status()["preemptions"] == 1


def test_an_eviction_seen_after_its_pods_were_deleted_is_one_preemption_and_one_new_attempt(kueue, cluster):
    fake = admitted_run(cluster, kueue)
    kueue.hold(WORKLOAD)
    add_node(cluster, "gpu-node")
    for pod in cluster.pods():  # on a node: a deletion waits for the kubelet (its grace period)
        cluster.kube.patch("pods", pod["metadata"]["name"], {"spec": {"nodeName": "gpu-node"}}, NAMESPACE)
    for pod in cluster.pods():  # something else deletes them first (a drain, a user): a pod loss
        cluster.kube.delete("pods", pod["metadata"]["name"], NAMESPACE)
    wait_for(lambda: recovery_of(cluster).get("trigger") == "PodDeleted", what="a pod loss")
    assert cluster.status()["preemptions"] == 1
    kueue.evict(WORKLOAD, reason="Preempted")  # Kueue's word arrives while the pods are still terminating
    wait_for(lambda: recovery_of(cluster).get("trigger") == "KueueEviction", what="taken over")
    status = cluster.status()
    assert status["preemptions"] == 1 and status["phase"] == "Evicted"  # the same interruption, counted once
    cluster.kube.expire_pod_deletions(at=LATER)
    wait_for(lambda: phase(cluster) == "Queued", what="Queued")
    wait_for(lambda: workload_condition(kueue, "QuotaReserved").get("status") == "False", what="released")
    kueue.release(WORKLOAD)
    wait_for(lambda: len(attempt_pods(cluster, 1)) == 3, what="attempt 1 pods")
    confirm_resume(fake)
    wait_for(lambda: (c := cluster.condition("Resumed")) and c["status"] == "True", what="Resumed")
    assert cluster.status()["preemptions"] == 1 and pod_creates(cluster) == 6 and fake.pauses == 0
    (evicted,) = [e for e in cluster.wait_for_events("Evicted") if e["reason"] == "Evicted"]
    assert "counted once" in evicted["message"]


def test_a_run_deleted_while_queued_never_had_a_pod_and_its_workload_goes_with_it(kueue, cluster):
    kueue.hold(WORKLOAD)
    cluster.kube.create("rlruns", queued_manifest(), NAMESPACE)
    wait_for(lambda: phase(cluster) == "Queued" and kueue.workload(WORKLOAD), what="Queued")
    cluster.kube.delete("rlruns", "demo", NAMESPACE)
    wait_for(lambda: cluster.rlrun() is None, what="deleted")
    assert kueue.workload(WORKLOAD) is None and pod_creates(cluster) == 0


def test_requests_no_flavor_can_hold_stay_queued_with_kueues_message(kueue, cluster):
    cluster.kube.create("rlruns", queued_manifest(trainer={"gpus": 16}), NAMESPACE)
    admitted = wait_for(
        lambda: (c := cluster.condition("Admitted")) and "insufficient" in c["message"] and c, what="Kueue's message"
    )
    assert (admitted["status"], admitted["reason"]) == ("False", "Queued")
    assert admitted["message"] == (
        "queued in LocalQueue team-q (Workload rlrun-demo): couldn't assign flavors to pod set trainer: insufficient "
        "quota for nvidia.com/gpu in flavor gpu-a, request > maximum capacity (16 > 8)"
    )
    time.sleep(0.3)
    assert phase(cluster) == "Queued" and cluster.pods() == []


def test_a_run_that_succeeds_finishes_its_workload(kueue, cluster):
    fake = admitted_run(cluster, kueue)
    fake.status.update(step=100, max_steps=100)
    cluster.exit_pod(cluster.pod("orchestrator"))
    wait_for(lambda: phase(cluster) == "Succeeded", what="Succeeded")
    finished = wait_for(
        lambda: (c := workload_condition(kueue, "Finished")) and c["status"] == "True" and c, what="Finished"
    )
    assert finished["reason"] == "Succeeded"


def test_a_failed_run_retried_is_queued_on_a_new_workload_never_run_on_its_finished_one(kueue, cluster):
    admitted_run(cluster, kueue, failure_policy={"backoff_limit": 0})
    cluster.set_pod_status(cluster.pod("orchestrator"), phase="Failed", ready=False)
    wait_for(lambda: phase(cluster) == "Failed", what="Failed")
    finished = wait_for(
        lambda: (c := workload_condition(kueue, "Finished")) and c["status"] == "True" and c, what="Finished"
    )
    assert finished["reason"] == "Failed"  # Kueue frees the quota of a failed run
    old_uid = kueue.workload(WORKLOAD)["metadata"]["uid"]
    kueue.hold(WORKLOAD)  # the retry must wait for a new admission
    cluster.kube.patch("rlruns", "demo", {"spec": {"suspend": True}}, NAMESPACE)
    wait_for(lambda: phase(cluster) == "Suspended", what="Suspended")
    cluster.kube.patch("rlruns", "demo", {"spec": {"suspend": False}}, NAMESPACE)
    # a finished Workload is never admitted again: a new one replaces it, and no pod runs before its admission
    wait_for(lambda: (w := kueue.workload(WORKLOAD)) and w["metadata"]["uid"] != old_uid, what="a new Workload")
    wait_for(lambda: phase(cluster) == "Queued", what="Queued")
    time.sleep(0.3)
    assert [p for p in cluster.pods() if "-a1" in p["metadata"]["name"]] == []
    kueue.release(WORKLOAD)
    wait_for(lambda: len(attempt_pods(cluster, 1)) == 3, what="attempt 1 pods")
    assert workload_condition(kueue, "Finished") == {} and workload_condition(kueue, "Admitted")["status"] == "True"


def test_suspending_deactivates_the_workload_and_is_not_counted_as_a_preemption(kueue, cluster):
    admitted_run(cluster, kueue)
    cluster.kube.patch("rlruns", "demo", {"spec": {"suspend": True}}, NAMESPACE)
    finish_old_pods(cluster)
    wait_for(lambda: phase(cluster) == "Suspended", what="Suspended")
    wait_for(lambda: kueue.workload(WORKLOAD)["spec"]["active"] is False, what="inactive")
    wait_for(lambda: workload_condition(kueue, "QuotaReserved").get("status") == "False", what="quota released")
    cluster.kube.patch("rlruns", "demo", {"spec": {"suspend": False}}, NAMESPACE)
    wait_for(lambda: len(attempt_pods(cluster, 1)) == 3, what="attempt 1 pods")
    assert kueue.workload(WORKLOAD)["spec"]["active"] is True
    status = cluster.status()
    assert (status["suspensions"], status["preemptions"]) == (1, 0)


def test_the_queue_label_without_the_integration_holds_the_run(cluster):
    cluster.kube.create("rlruns", queued_manifest(), NAMESPACE)
    held = wait_for(lambda: (c := cluster.condition("Admitted")) and c, what="Admitted")
    assert (held["status"], held["reason"]) == ("False", "KueueDisabled")
    assert "kueue.enabled" in held["message"] and "remove the label" in held["message"]
    assert phase(cluster) == "Queued"
    (event,) = [e for e in cluster.wait_for_events("KueueDisabled") if e["reason"] == "KueueDisabled"]
    assert event["type"] == "Warning"
    time.sleep(0.5)
    assert cluster.pods() == [] and not [r for r in cluster.kube.requests if r.rbac and r.rbac[0] == "kueue.x-k8s.io"]
    assert len([e for e in cluster.kube.list("events", NAMESPACE) if e["reason"] == "KueueDisabled"]) == 1
    # the label removed: the run starts, without Kueue
    cluster.kube.patch("rlruns", "demo", {"metadata": {"labels": {QUEUE_LABEL: None}}}, NAMESPACE)
    wait_for(lambda: len(cluster.pods()) == 3 and cluster.status().get("attempt") == 0, what="attempt 0")
    assert cluster.condition("Admitted") is None and "queue" not in cluster.status()
    assert not [r for r in cluster.kube.requests if r.rbac and r.rbac[0] == "kueue.x-k8s.io"]


def test_the_kueue_example_admits_the_example_run(kueue, cluster):
    """examples/kueue/: its objects pass Kueue's schemas, and its run would be admitted on its flavors."""
    docs = [d for d in yaml.safe_load_all((ROOT / "examples" / "kueue" / "queues.yaml").read_text()) if d]
    plural = {
        "ResourceFlavor": "resourceflavors",
        "ClusterQueue": "clusterqueues",
        "LocalQueue": "localqueues",
        "WorkloadPriorityClass": "workloadpriorityclasses",
    }
    for doc in docs:
        cluster.kube.create(plural[doc["kind"]], doc, doc["metadata"].get("namespace"))
    run = yaml.safe_load((ROOT / "examples" / "kueue" / "reverse-text.yaml").read_text())
    assert (
        run["metadata"]["labels"][QUEUE_LABEL] == next(d for d in docs if d["kind"] == "LocalQueue")["metadata"]["name"]
    )
    cluster.kube.create("rlruns", run, NAMESPACE)
    wait_for(lambda: len(cluster.pods("reverse-text")) == 3, what="the example's pods")
    workload = kueue.workload("rlrun-reverse-text")
    assert workload["spec"]["priority"] == 1000 and workload["spec"]["priorityClassName"] == "research-high"
    assert cluster.status("reverse-text")["queue"]["clusterQueue"] == "ml-research"


def test_the_queue_label_on_a_cluster_without_kueue_holds_the_run_and_says_so(kueue_operator, cluster):
    cluster.kueue = True  # the operator runs in the Kueue mode: its calls are that mode's (RBAC proof)
    cluster.kube.create("rlruns", queued_manifest(), NAMESPACE)
    held = wait_for(lambda: (c := cluster.condition("Admitted")) and c, what="Admitted")
    assert (held["status"], held["reason"], phase(cluster)) == ("False", "Queued", "Queued")
    assert "does not serve Kueue's Workloads (kueue.x-k8s.io/v1beta1): install Kueue" in held["message"]
    time.sleep(0.3)
    assert cluster.pods() == [] and cluster.condition("Degraded") is None


def test_a_missing_priority_class_queues_the_run_without_priority_and_says_so(kueue, cluster):
    doc = queued_manifest()
    doc["metadata"]["labels"][PRIORITY_LABEL] = "urgent"
    cluster.kube.create("rlruns", doc, NAMESPACE)
    wait_for(lambda: len(cluster.pods()) == 3, what="pods")  # admitted all the same
    assert "priority" not in kueue.workload(WORKLOAD)["spec"]
    (event,) = [e for e in cluster.wait_for_events("NoPriorityClass") if e["reason"] == "NoPriorityClass"]
    assert event["type"] == "Warning" and "WorkloadPriorityClass urgent" in event["message"]


def test_a_queue_label_changed_while_queued_moves_the_workload_to_the_new_queue(kueue, cluster):
    cluster.kube.create("rlruns", queued_manifest(queue="no-such-q"), NAMESPACE)
    wait_for(lambda: "doesn't exist" in ((cluster.condition("Admitted") or {}).get("message") or ""), what="pending")
    cluster.kube.patch("rlruns", "demo", {"metadata": {"labels": {QUEUE_LABEL: LOCAL_QUEUE}}}, NAMESPACE)
    wait_for(lambda: len(cluster.pods()) == 3, what="admitted from the new queue")
    assert kueue.workload(WORKLOAD)["spec"]["queueName"] == LOCAL_QUEUE


def test_a_workload_deactivated_by_hand_stays_inactive_until_reactivated(kueue, cluster):
    admitted_run(cluster, kueue)
    cluster.kube.patch(WORKLOADS, WORKLOAD, {"spec": {"active": False}}, NAMESPACE)
    wait_for(lambda: phase(cluster) == "Evicted", what="Evicted")
    finish_old_pods(cluster)
    wait_for(lambda: phase(cluster) == "Queued", what="Queued")
    time.sleep(0.5)  # a user's (or Kueue's) deactivation is theirs to undo, not the operator's
    assert kueue.workload(WORKLOAD)["spec"]["active"] is False and attempt_pods(cluster, 1) == []
    assert cluster.status()["preemptions"] == 1 and "deactivated" in cluster.condition("Admitted")["message"]
    cluster.kube.patch(WORKLOADS, WORKLOAD, {"spec": {"active": True}}, NAMESPACE)
    wait_for(lambda: len(attempt_pods(cluster, 1)) == 3, what="attempt 1 pods after reactivation")


def test_a_run_whose_label_is_removed_while_running_still_yields_to_kueues_eviction(kueue, cluster):
    fake = admitted_run(cluster, kueue)
    cluster.kube.patch("rlruns", "demo", {"metadata": {"labels": {QUEUE_LABEL: None}}}, NAMESPACE)
    time.sleep(0.3)
    kueue.evict(WORKLOAD)  # its quota went to another workload: its pods must not run on
    wait_for(lambda: phase(cluster) == "Evicted", what="Evicted")
    finish_old_pods(cluster)
    assert fake.pauses == 1 and cluster.status()["preemptions"] == 1


def test_a_run_whose_label_is_removed_while_queued_starts_without_kueue_and_leaves_no_workload(kueue, cluster):
    kueue.hold(WORKLOAD)
    cluster.kube.create("rlruns", queued_manifest(), NAMESPACE)
    wait_for(lambda: phase(cluster) == "Queued" and kueue.workload(WORKLOAD), what="Queued")
    cluster.kube.patch("rlruns", "demo", {"metadata": {"labels": {QUEUE_LABEL: None}}}, NAMESPACE)
    wait_for(lambda: len(cluster.pods()) == 3, what="attempt 0, without Kueue")
    kueue.release(WORKLOAD)  # a Workload left behind would be admitted: quota held for pods Kueue does not own
    wait_for(lambda: kueue.workload(WORKLOAD) is None, what="the Workload deleted")
    assert "queue" not in cluster.status() and cluster.condition("Admitted") is None
