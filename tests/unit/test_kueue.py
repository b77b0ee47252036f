"""Kueue's side of a run, pure (``rlrun_operator.kueue``): the Workload built from an attempt's pods, admission and
eviction read from the Workload's conditions, the admission's placement on the pods, the job side's status patches."""

from __future__ import annotations

import pytest
from rlrun.manifest import parse_manifest
from rlrun_operator import kueue, naming
from rlrun_operator.pods import build_pods
from rlrun_operator.settings import OperatorSettings

from tests.support.manifests import manifest

SETTINGS = OperatorSettings()
NOW = "2026-12-04T12:00:00Z"


def make(labels=None, **spec):
    doc = manifest("demo", **spec)
    meta = {"name": "demo", "namespace": "team-a", "uid": "u-1", "generation": 1, "labels": labels or {}}
    body = {**doc, "metadata": meta}
    return body, parse_manifest(doc)


def cond(type_, status, reason="R", message=""):
    return {"type": type_, "status": status, "reason": reason, "message": message, "lastTransitionTime": NOW}


def workload(*conditions, admission=None):
    wl = {"metadata": {"name": "rlrun-demo", "generation": 1}, "spec": {}, "status": {"conditions": list(conditions)}}
    if admission is not None:
        wl["status"]["admission"] = admission
    return wl


ADMISSION = {
    "clusterQueue": "cq",
    "podSetAssignments": [
        {"name": "orchestrator", "flavors": {"cpu": "cpu-pool"}, "count": 1},
        {"name": "trainer", "flavors": {"cpu": "gpu-a", "nvidia.com/gpu": "gpu-a", "memory": "gpu-b"}, "count": 2},
    ],
}
ADMITTED = (cond("QuotaReserved", "True"), cond("Admitted", "True"))


def test_the_workload_has_one_pod_set_per_component_with_the_attempts_pods_as_templates():
    body, run = make(
        labels={naming.QUEUE_LABEL: "team-q"},
        trainer={"nodes": 2, "gpus": 1},
        rollout={"replicas": 3, "gpus": 1, "resources": {"requests": {"cpu": "4"}}},
    )
    pods = build_pods(body, run, SETTINGS, 0)
    wl = kueue.build_workload(body, pods, kueue.queue_name(body), ("high", 1000))
    assert wl["apiVersion"] == "kueue.x-k8s.io/v1beta1" and wl["kind"] == "Workload"
    meta = wl["metadata"]
    assert (meta["name"], meta["namespace"]) == ("rlrun-demo", "team-a")
    assert meta["labels"][naming.MANAGED_BY] == "rlrun-operator" and meta["labels"][naming.INSTANCE] == "demo"
    owner = meta["ownerReferences"][0]
    assert (owner["kind"], owner["uid"], owner["controller"]) == ("RLRun", "u-1", True)
    spec = wl["spec"]
    assert (spec["queueName"], spec["active"]) == ("team-q", True)
    assert [(s["name"], s["count"]) for s in spec["podSets"]] == [("orchestrator", 1), ("trainer", 2), ("rollout", 3)]
    rollout = spec["podSets"][2]["template"]["spec"]["containers"][0]["resources"]
    assert rollout["requests"] == {"cpu": "4", "nvidia.com/gpu": "1"}  # what Kueue counts against the quota
    assert (spec["priorityClassName"], spec["priorityClassSource"], spec["priority"]) == (
        "high",
        "kueue.x-k8s.io/workloadpriorityclass",
        1000,
    )
    # the pods never carry the queue label: Kueue's pod integration must not gate them
    assert all(naming.QUEUE_LABEL not in s["template"]["metadata"]["labels"] for s in spec["podSets"])
    assert not kueue.pod_sets_differ(wl, kueue.pod_sets(pods))
    more = build_pods(*make(trainer={"nodes": 2, "gpus": 1}, rollout={"replicas": 1, "gpus": 1}), SETTINGS, 0)
    assert kueue.pod_sets_differ(wl, kueue.pod_sets(more))


def test_no_label_no_queue_and_no_priority_without_its_label():
    body, _ = make()
    assert kueue.queue_name(body) is None and kueue.priority_class(body) is None
    body, run = make(labels={naming.QUEUE_LABEL: "q", naming.PRIORITY_LABEL: "p"})
    assert (kueue.queue_name(body), kueue.priority_class(body)) == ("q", "p")
    assert "priority" not in kueue.build_workload(body, build_pods(body, run, SETTINGS, 0), "q")["spec"]


def test_admission_needs_quota_reserved_admitted_and_an_admission_and_no_eviction():
    adm = kueue.admission(workload(*ADMITTED, admission=ADMISSION))
    assert adm == kueue.Admission("cq", {"orchestrator": ["cpu-pool"], "trainer": ["gpu-a", "gpu-b"]})
    assert adm.describe() == "ClusterQueue cq, flavors orchestrator: cpu-pool; trainer: gpu-a, gpu-b"
    assert kueue.admission(workload(cond("QuotaReserved", "True"), admission=ADMISSION)) is None
    assert kueue.admission(workload(*ADMITTED)) is None
    assert kueue.admission(workload(*ADMITTED, cond("Evicted", "True"), admission=ADMISSION)) is None
    assert kueue.admission(None) is None


def test_pending_message_is_kueues_own():
    message = "couldn't assign flavors to pod set trainer: insufficient quota for nvidia.com/gpu in flavor f"
    assert kueue.pending_message(workload(cond("QuotaReserved", "False", "Pending", message))) == message
    assert kueue.pending_message(workload()) == "waiting for Kueue to look at the Workload"


@pytest.mark.parametrize(
    ("conditions", "has_pods", "expected"),
    [
        # evicted while holding quota: Kueue's reason, and why it was preempted
        (
            (
                *ADMITTED,
                cond("Evicted", "True", "Preempted", "Preempted to accommodate a workload"),
                cond("Preempted", "True", "InClusterQueue"),
            ),
            True,
            kueue.Eviction("Preempted", "Preempted to accommodate a workload", "InClusterQueue"),
        ),
        ((*ADMITTED, cond("Evicted", "True", "PodsReadyTimeout", "t")), False, kueue.Eviction("PodsReadyTimeout", "t")),
        # quota released already (the job side did it): nothing more to do without pods
        ((cond("QuotaReserved", "False", "Pending", "m"), cond("Evicted", "True", "Preempted")), False, None),
        # no quota while pods run: they must stop
        ((cond("QuotaReserved", "False", "Pending", "m"),), True, kueue.Eviction("QuotaLost", "m")),
        (ADMITTED, True, None),
    ],
)
def test_eviction(conditions, has_pods, expected):
    admission = ADMISSION if conditions[:2] == ADMITTED else None
    assert kueue.eviction(workload(*conditions, admission=admission), has_pods) == expected


def test_a_deleted_workload_is_an_eviction_only_while_pods_run():
    assert kueue.eviction(None, True) == kueue.Eviction("WorkloadDeleted", "the Workload was deleted")
    assert kueue.eviction(None, False) is None
    ev = kueue.Eviction("Preempted", "to make room", "InCohortReclamation")
    assert (
        ev.describe("rlrun-demo") == "Kueue evicted Workload rlrun-demo (Preempted, InCohortReclamation): to make room"
    )


FLAVORS = {
    "cpu-pool": {"spec": {"nodeLabels": {"pool": "cpu"}}},
    "gpu-a": {
        "spec": {
            "nodeLabels": {"pool": "gpu", "zone": "a"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        }
    },
    "gpu-b": {"spec": {"nodeLabels": {"pool": "gpu"}, "tolerations": [{"key": "spot", "operator": "Exists"}]}},
}


def test_placement_merges_each_pod_sets_flavors_node_labels_and_tolerations():
    adm = kueue.admission(workload(*ADMITTED, admission=ADMISSION))
    placements = kueue.placement(adm, FLAVORS)
    assert placements["orchestrator"] == kueue.Placement({"pool": "cpu"}, [])
    assert placements["trainer"].node_selector == {"pool": "gpu", "zone": "a"}
    assert [t["key"] for t in placements["trainer"].tolerations] == ["nvidia.com/gpu", "spot"]
    body, run = make(
        scheduling={"node_selector": {"team": "ml"}, "tolerations": [{"key": "own", "operator": "Exists"}]}
    )
    pods = kueue.place(build_pods(body, run, SETTINGS, 0), placements)
    by = {p["metadata"]["labels"][naming.COMPONENT]: p["spec"] for p in pods}
    assert by["trainer"]["nodeSelector"] == {"team": "ml", "pool": "gpu", "zone": "a"}
    assert [t["key"] for t in by["trainer"]["tolerations"]] == ["own", "nvidia.com/gpu", "spot"]
    assert by["orchestrator"]["nodeSelector"] == {"team": "ml", "pool": "cpu"}
    assert by["rollout"]["nodeSelector"] == {"team": "ml"}  # no assignment, nothing added
    assert kueue.place(pods, None) == pods


def test_placement_refuses_a_missing_flavor_and_flavors_that_disagree_and_names_a_node_selector_conflict():
    adm = kueue.Admission("cq", {"trainer": ["gpu-a", "gone"]})
    with pytest.raises(ValueError, match="ResourceFlavor gone of pod set trainer does not exist"):
        kueue.placement(adm, FLAVORS)
    clash = {"x": {"spec": {"nodeLabels": {"pool": "cpu"}}}, "y": {"spec": {"nodeLabels": {"pool": "gpu"}}}}
    with pytest.raises(ValueError, match="flavors want pool=cpu and pool=gpu"):
        kueue.placement(kueue.Admission("cq", {"trainer": ["x", "y"]}), clash)
    placements = kueue.placement(kueue.Admission("cq", {"trainer": ["gpu-a"]}), FLAVORS)
    assert kueue.conflicts({"zone": "b"}, placements) == [
        "pod set trainer: its flavor wants zone=a, spec.scheduling.node_selector has zone=b"
    ]
    assert kueue.conflicts({"zone": "a"}, placements) == []


def test_releasing_the_quota_unsets_the_reservation_as_kueues_job_reconciler_does():
    wl = workload(*ADMITTED, cond("Evicted", "True", "Preempted", "m"), admission=ADMISSION)
    patch = kueue.release_quota(wl, kueue.Eviction("Preempted", "Preempted to accommodate"), now=NOW)
    assert patch["admission"] is None  # a merge patch removes it
    by = {c["type"]: c for c in patch["conditions"]}
    assert (by["QuotaReserved"]["status"], by["QuotaReserved"]["reason"]) == ("False", "Pending")
    assert by["QuotaReserved"]["message"] == "Preempted to accommodate"
    assert by["Admitted"]["status"] == "False" and by["Evicted"]["status"] == "True"
    assert (by["Requeued"]["status"], by["Requeued"]["reason"]) == ("True", "Preempted")
    assert by["QuotaReserved"]["observedGeneration"] == 1
    assert "PodsReady" not in by  # never set: not added
    other = kueue.release_quota(wl, kueue.Eviction("Deactivated", ""), now=NOW)
    assert "Requeued" not in {c["type"] for c in other["conditions"]}
    ran = workload(*ADMITTED, cond("Evicted", "True", "Preempted", "m"), cond("PodsReady", "True"), admission=ADMISSION)
    stopped = {c["type"]: c for c in kueue.release_quota(ran, kueue.Eviction("Preempted", "m"), now=NOW)["conditions"]}
    assert (stopped["PodsReady"]["status"], stopped["PodsReady"]["reason"]) == ("False", "WaitForStart")


def test_pods_ready_and_finished_are_patched_only_when_they_change():
    wl = workload(*ADMITTED)
    ready = kueue.pods_ready(wl, True, now=NOW)
    assert {c["type"]: c["status"] for c in ready["conditions"]}["PodsReady"] == "True"
    assert kueue.pods_ready(workload(*ADMITTED, cond("PodsReady", "True")), True) is None
    waiting = kueue.pods_ready(workload(*ADMITTED, cond("PodsReady", "True")), False, now=NOW)
    assert [(c["status"], c["reason"]) for c in waiting["conditions"] if c["type"] == "PodsReady"] == [
        ("False", "WaitForStart")
    ]
    done = kueue.finished(wl, "Succeeded", "all 100 steps trained", now=NOW)
    assert [(c["status"], c["reason"]) for c in done["conditions"] if c["type"] == "Finished"] == [
        ("True", "Succeeded")
    ]
    assert kueue.finished(workload(cond("Finished", "True")), "Failed", "x") is None


def test_the_setting_reads_its_variable():
    assert OperatorSettings.from_env({}).kueue_enabled is False
    assert OperatorSettings.from_env({"RLRUN_OPERATOR_KUEUE_ENABLED": "true"}).kueue_enabled is True


def test_status_writes_are_guarded_by_the_resource_version_they_were_computed_from():
    wl = workload(*ADMITTED, admission=ADMISSION)
    wl["metadata"]["resourceVersion"] = "42"
    patch = kueue.release_quota(wl, kueue.Eviction("Preempted", "m"), now=NOW)
    ops = kueue.status_ops(wl, patch)
    assert ops[0] == {"op": "test", "path": "/metadata/resourceVersion", "value": "42"}
    assert {"op": "remove", "path": "/status/admission"} in ops
    assert {"op": "add", "path": "/status/conditions", "value": patch["conditions"]} in ops
    # nothing to remove when there is no admission; a Workload without status gets one first
    bare = {"metadata": {"name": "rlrun-demo", "resourceVersion": "7"}, "spec": {}}
    assert kueue.status_ops(bare, {"admission": None, "conditions": []}) == [
        {"op": "test", "path": "/metadata/resourceVersion", "value": "7"},
        {"op": "add", "path": "/status", "value": {}},
        {"op": "add", "path": "/status/conditions", "value": []},
    ]


def test_reserved_since_is_when_quota_reserved_became_true():
    assert kueue.reserved_since(workload(cond("QuotaReserved", "True"), cond("Evicted", "True", "Preempted"))) == NOW
    assert kueue.reserved_since(workload(cond("QuotaReserved", "False"))) is None
