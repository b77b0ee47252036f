"""The Kueue stand-in's pure parts (``tests.support.kueue``): its CRDs, and its flavor assignment with Kueue v0.13's
messages and quantities (the transitions against the API emulator: ``tests/kube/test_kueue_standin.py``)."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest

from tests.support.crd_validation import cel_violations
from tests.support.kueue import KUEUE_CRDS
from tests.support.kueue.crds import WORKLOAD_CRD
from tests.support.kueue.quota import amount, assign, pod_requests, quantity, reserved_usage

GPU = "nvidia.com/gpu"


def flavor(name: str, labels: dict[str, str] | None = None, taints: list[dict] | None = None) -> dict[str, Any]:
    return {"metadata": {"name": name}, "spec": {"nodeLabels": labels or {}, "nodeTaints": taints or []}}


FLAVORS = {"small": flavor("small", {"gpu": "small"}), "big": flavor("big", {"gpu": "big"})}


def cluster_queue(**quotas: dict[str, str]) -> dict[str, Any]:
    covered = ["cpu", "memory", GPU]
    flavors = [
        {"name": f, "resources": [{"name": r, "nominalQuota": q[r]} for r in covered]} for f, q in quotas.items()
    ]
    return {"metadata": {"name": "cq"}, "spec": {"resourceGroups": [{"coveredResources": covered, "flavors": flavors}]}}


CQ = cluster_queue(small={"cpu": "8", "memory": "32Gi", GPU: "2"}, big={"cpu": "16", "memory": "64Gi", GPU: "4"})


def pod_set(name: str, count: int = 1, gpus: int = 0, cpu: str = "1", **pod_spec: Any) -> dict[str, Any]:
    resources: dict[str, Any] = {"requests": {"cpu": cpu, "memory": "1Gi"}}
    if gpus:
        resources["limits"] = {GPU: str(gpus)}  # only a limit: it is the request too
    container = {"name": name, "resources": resources}
    return {"name": name, "count": count, "template": {"spec": {"containers": [container], **pod_spec}}}


def workload(*pod_sets: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"name": "w", "namespace": "ns"}, "spec": {"podSets": list(pod_sets)}}


@pytest.mark.parametrize(
    ("resource", "value", "text"),
    [
        ("cpu", 1500, "1500m"),
        ("cpu", 4000, "4"),
        ("cpu", 250, "250m"),
        ("cpu", 0, "0"),
        ("memory", 8 * 2**30, "8Gi"),
        ("memory", 512, "512"),
        ("memory", 1_500_000_000, "1500000000"),  # not a power of 1024: Go shows it whole, not in decimal SI
        (GPU, 8, "8"),
        (GPU, 1000, "1k"),
    ],
)
def test_quantities_are_written_in_kubernetes_canonical_form(resource, value, text):
    assert quantity(resource, value) == text
    assert amount(resource, text) == value


def test_a_pods_requests_take_limits_for_missing_requests_and_the_largest_init_container():
    template = {
        "spec": {
            "containers": [
                {"name": "a", "resources": {"requests": {"cpu": "500m"}, "limits": {"cpu": "2", GPU: "1"}}},
                {"name": "b", "resources": {"requests": {"cpu": "250m", "memory": "1Gi"}}},
            ],
            "initContainers": [{"name": "init", "resources": {"requests": {"cpu": "3", "memory": "512Mi"}}}],
            "overhead": {"memory": "128Mi"},
        }
    }
    assert pod_requests(template) == {"cpu": 3000, "memory": 2**30 + 128 * 2**20, GPU: 1}


def test_each_pod_set_gets_the_first_flavor_its_requests_times_count_fit():
    trainer = pod_set("trainer", count=2, gpus=1)
    result = assign(workload(pod_set("orchestrator"), trainer), CQ, FLAVORS, used={})
    assert result.message == ""
    assert result.pod_set_assignments == [
        {
            "name": "orchestrator",
            "flavors": {"cpu": "small", "memory": "small"},
            "resourceUsage": {"cpu": "1", "memory": "1Gi"},
            "count": 1,
        },
        {
            "name": "trainer",
            "flavors": {"cpu": "small", "memory": "small", GPU: "small"},
            "resourceUsage": {"cpu": "2", "memory": "2Gi", GPU: "2"},
            "count": 2,
        },
    ]
    assert result.usage == {("small", "cpu"): 3000, ("small", "memory"): 3 * 2**30, ("small", GPU): 2}
    assert reserved_usage({"status": {"admission": {"podSetAssignments": result.pod_set_assignments}}}) == result.usage


def test_quota_used_elsewhere_moves_a_pod_set_to_the_next_flavor():
    result = assign(workload(pod_set("trainer", count=2, gpus=1)), CQ, FLAVORS, used={("small", GPU): 1})
    assert result.pod_set_assignments[0]["flavors"][GPU] == "big"


def test_a_pod_set_no_flavor_holds_stays_pending_with_kueues_message():
    result = assign(workload(pod_set("trainer", count=4, gpus=1)), CQ, FLAVORS, used={("big", GPU): 2})
    assert result.pod_set_assignments is None
    assert result.message == (
        "couldn't assign flavors to pod set trainer: "
        "insufficient quota for nvidia.com/gpu in flavor small, request > maximum capacity (4 > 2), "
        "insufficient unused quota for nvidia.com/gpu in flavor big, 2 more needed"
    )


def test_earlier_pod_sets_of_the_same_workload_count_against_later_ones():
    # 2 GPUs each: the first takes small; the second would fit small alone, but not beside the first
    result = assign(workload(pod_set("a", gpus=2), pod_set("b", gpus=2)), CQ, FLAVORS, used={})
    assert [psa["flavors"][GPU] for psa in result.pod_set_assignments] == ["small", "big"]


def test_every_pod_set_that_would_need_preemption_is_named_in_the_message():
    # as Kueue: a pod set that fits only by preemption keeps its first flavor (small) and counts there for the next
    used = {("small", GPU): 2, ("big", GPU): 4}
    result = assign(workload(pod_set("a", gpus=1), pod_set("b", gpus=1)), CQ, FLAVORS, used)
    assert result.message == (
        "couldn't assign flavors to pod set a: "
        "insufficient unused quota for nvidia.com/gpu in flavor big, 1 more needed, "
        "insufficient unused quota for nvidia.com/gpu in flavor small, 1 more needed; "
        "couldn't assign flavors to pod set b: "
        "insufficient unused quota for nvidia.com/gpu in flavor big, 1 more needed, "
        "insufficient unused quota for nvidia.com/gpu in flavor small, 2 more needed"
    )


def test_a_resource_no_resource_group_covers_is_unavailable():
    ps = pod_set("trainer")
    ps["template"]["spec"]["containers"][0]["resources"]["requests"]["example.com/fpga"] = "1"
    result = assign(workload(ps), CQ, FLAVORS, used={})
    assert (
        result.message
        == "couldn't assign flavors to pod set trainer: resource example.com/fpga unavailable in ClusterQueue"
    )


def test_node_selectors_and_taints_rule_flavors_out():
    spot = {"key": "spot", "value": "true", "effect": "NoSchedule"}
    flavors = {"small": flavor("small", {"gpu": "small"}, taints=[spot]), "big": flavor("big", {"gpu": "big"})}
    # untolerated taint on small: big
    assert assign(workload(pod_set("t")), CQ, flavors, {}).pod_set_assignments[0]["flavors"]["cpu"] == "big"
    tolerant = pod_set("t", tolerations=[{"key": "spot", "operator": "Exists"}])
    assert assign(workload(tolerant), CQ, flavors, {}).pod_set_assignments[0]["flavors"]["cpu"] == "small"
    # a node selector on the flavors' label keys picks the flavor; other keys do not count
    pinned = pod_set("t", nodeSelector={"gpu": "big", "zone": "a"})
    assert assign(workload(pinned), CQ, FLAVORS, {}).pod_set_assignments[0]["flavors"]["cpu"] == "big"
    nowhere = pod_set("t", nodeSelector={"gpu": "h100"})
    assert assign(workload(nowhere), CQ, flavors, {}).message == (
        "couldn't assign flavors to pod set t: flavor big doesn't match node affinity, "
        "untolerated taint spot=true:NoSchedule in flavor small"
    )
    affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [{"key": "gpu", "operator": "NotIn", "values": ["small"]}]}]
            }
        }
    }
    assert assign(workload(pod_set("t", affinity=affinity)), CQ, FLAVORS, {}).pod_set_assignments[0]["flavors"] == {
        "cpu": "big",
        "memory": "big",
    }


@pytest.mark.parametrize("crd", KUEUE_CRDS, ids=lambda crd: crd["metadata"]["name"])
def test_the_crds_pass_kubernetes_own_schema(crd):
    kubernetes_validate.validate(crd, kubernetes_validate.utils.latest_version(), strict=True)


def test_the_workload_carries_kueues_cel_rules():
    """The API server (not the emulator) refuses a priority class without a priority, as Kueue's CRD says."""
    spec_schema = WORKLOAD_CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    spec = {"podSets": [{"name": "main", "count": 2, "minCount": 3, "template": {}}], "priorityClassName": "high"}
    assert cel_violations(spec_schema, spec) == [
        ": priority should not be nil when priorityClassName is set",
        ".podSets[0]: minCount should be positive and less or equal to count",
    ]
    assert cel_violations(spec_schema, {**spec, "priority": 100, "podSets": [{"count": 2, "template": {}}]}) == []
