"""The Kueue stand-in (``tests.support.kueue``) against the API emulator, without the operator: Kueue v0.13's
Workload transitions (admission with quota, pending, eviction, release by the job side, readmission,
deactivation, hold) and its CRDs' schema."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.support.kube import ApiError, KubeServer
from tests.support.kueue import WORKLOADS, KueueStandIn
from tests.support.kueue import conditions as c
from tests.support.polling import wait_for

NS = "team-a"
GPU = "nvidia.com/gpu"


@pytest.fixture
def kueue() -> Iterator[KueueStandIn]:
    """A running stand-in: flavors ``small`` (2 GPUs) then ``big`` (4 GPUs) in ClusterQueue ``cq``, LocalQueue ``q``."""
    with KubeServer() as kube:
        kube.create("namespaces", {"metadata": {"name": NS}})
        standin = KueueStandIn(kube, NS)
        standin.install()
        standin.flavor("small", node_labels={"example.com/gpu": "small"})
        standin.flavor(
            "big", node_labels={"example.com/gpu": "big"}, tolerations=[{"key": "big", "operator": "Exists"}]
        )
        standin.cluster_queue(
            "cq",
            {"small": {"cpu": "16", "memory": "64Gi", GPU: "2"}, "big": {"cpu": "16", "memory": "64Gi", GPU: "4"}},
        )
        standin.local_queue("q", "cq")
        with standin:
            yield standin


def submit(kueue: KueueStandIn, name: str, gpus: int, queue: str = "q", **spec: Any) -> dict[str, Any]:
    """A Workload of two pod sets, as rlrun's: an orchestrator (no GPU) and ``gpus`` trainers of one GPU each."""

    def pod_set(ps_name: str, count: int, requests: dict[str, str]) -> dict[str, Any]:
        container = {"name": ps_name, "image": "rlrun", "resources": {"requests": requests, "limits": requests}}
        return {"name": ps_name, "count": count, "template": {"spec": {"containers": [container]}}}

    pod_sets = [pod_set("orchestrator", 1, {"cpu": "1", "memory": "2Gi"})]
    if gpus:
        pod_sets.append(pod_set("trainer", gpus, {"cpu": "1", "memory": "4Gi", GPU: "1"}))
    body = {"metadata": {"name": name}, "spec": {"queueName": queue, "podSets": pod_sets, **spec}}
    return kueue.kube.create(WORKLOADS, body, NS)


def admission(kueue: KueueStandIn, name: str) -> dict[str, Any] | None:
    """The Workload's admission once Kueue admitted it (QuotaReserved and Admitted True), else None."""
    status = (kueue.workload(name) or {}).get("status") or {}
    admitted = c.is_true(status, c.QUOTA_RESERVED) and c.is_true(status, c.ADMITTED)
    return status.get("admission") if admitted else None


def wait_admitted(kueue: KueueStandIn, name: str) -> dict[str, Any]:
    return wait_for(lambda: admission(kueue, name), timeout=5, what=f"Workload {name} admitted")


def trainer_flavor(adm: dict[str, Any]) -> str:
    return next(psa for psa in adm["podSetAssignments"] if psa["name"] == "trainer")["flavors"][GPU]


def state(kueue: KueueStandIn, name: str, type_: str) -> tuple[str, str, str] | None:
    """A Workload condition's (status, reason, message), or None when it has no such condition."""
    cond = kueue.condition(name, type_)
    return (cond["status"], cond["reason"], cond["message"]) if cond else None


def pending_message(kueue: KueueStandIn, name: str) -> str | None:
    cond = kueue.condition(name, c.QUOTA_RESERVED)
    return cond["message"] if cond and cond["status"] == "False" and cond["reason"] == c.PENDING else None


def job_side(kueue: KueueStandIn, name: str, update) -> None:
    """Write the Workload's status as the job integration does: read it, change it, patch it whole (its
    ``conditions`` list is replaced by a merge patch) with a resourceVersion precondition."""
    wl = kueue.workload(name)
    status = copy.deepcopy(wl.get("status") or {})
    update(status, wl["metadata"]["generation"])
    patch = {"metadata": {"resourceVersion": wl["metadata"]["resourceVersion"]}, "status": status}
    kueue.kube.patch(WORKLOADS, name, patch, NS, subresource="status")


def release_quota(kueue: KueueStandIn, name: str) -> None:
    """The job side once the evicted workload's pods are gone: QuotaReserved False, no admission, Admitted False."""

    def release(status: dict[str, Any], generation: int) -> None:
        evicted = c.find(status, c.EVICTED)
        c.unset_quota_reservation(status, c.PENDING, evicted["message"], generation)
        requeued = evicted["reason"] != c.DEACTIVATED
        c.set_condition(status, c.REQUEUED, requeued, evicted["reason"], evicted["message"], generation)

    job_side(kueue, name, release)


def test_admission_assigns_flavors_in_order_and_counts_what_admitted_workloads_use(kueue):
    submit(kueue, "a", gpus=2)
    first = wait_admitted(kueue, "a")
    assert first == {
        "clusterQueue": "cq",
        "podSetAssignments": [
            {
                "name": "orchestrator",
                "flavors": {"cpu": "small", "memory": "small"},
                "resourceUsage": {"cpu": "1", "memory": "2Gi"},
                "count": 1,
            },
            {
                "name": "trainer",
                "flavors": {"cpu": "small", "memory": "small", GPU: "small"},
                "resourceUsage": {"cpu": "2", "memory": "8Gi", GPU: "2"},
                "count": 2,
            },
        ],
    }
    assert state(kueue, "a", c.QUOTA_RESERVED) == ("True", "QuotaReserved", "Quota reserved in ClusterQueue cq")
    assert state(kueue, "a", c.ADMITTED) == ("True", "Admitted", "The workload is admitted")

    submit(kueue, "b", gpus=2)  # small is full: big
    assert trainer_flavor(wait_admitted(kueue, "b")) == "big"
    submit(kueue, "c", gpus=4)  # more than small has at all, 2 more than big has left
    message = wait_for(lambda: pending_message(kueue, "c"), timeout=5, what="c pending")
    assert message == (
        "couldn't assign flavors to pod set trainer: "
        "insufficient quota for nvidia.com/gpu in flavor small, request > maximum capacity (4 > 2), "
        "insufficient unused quota for nvidia.com/gpu in flavor big, 2 more needed"
    )
    assert "admission" not in kueue.workload("c")["status"]

    # b finishes: Kueue counts a finished workload's quota as free
    job_side(kueue, "b", lambda status, gen: c.set_condition(status, c.FINISHED, True, "Succeeded", "done", gen))
    assert trainer_flavor(wait_admitted(kueue, "c")) == "big"


def test_an_eviction_keeps_the_quota_until_the_job_side_releases_it_then_readmits(kueue):
    submit(kueue, "a", gpus=2)
    assert trainer_flavor(wait_admitted(kueue, "a")) == "small"
    kueue.evict("a")
    preemption = (
        "Preempted to accommodate a workload (UID: UNKNOWN, JobUID: UNKNOWN) due to prioritization in the ClusterQueue"
    )
    assert state(kueue, "a", c.EVICTED) == ("True", "Preempted", preemption)
    assert state(kueue, "a", c.PREEMPTED) == ("True", "InClusterQueue", preemption)
    assert admission(kueue, "a")  # kept: the quota stays reserved until the job side releases it
    evicted = kueue.condition("a", c.EVICTED)
    kueue.evict("a")  # evicting an evicted workload changes nothing
    assert kueue.condition("a", c.EVICTED) == evicted

    submit(kueue, "b", gpus=4)  # fits big only (small has 2 GPUs at all)
    assert trainer_flavor(wait_admitted(kueue, "b")) == "big"
    submit(kueue, "c", gpus=1)  # small is still a's: nothing for c
    assert wait_for(lambda: pending_message(kueue, "c"), timeout=5, what="c pending") == (
        "couldn't assign flavors to pod set trainer: "
        "insufficient unused quota for nvidia.com/gpu in flavor big, 1 more needed, "
        "insufficient unused quota for nvidia.com/gpu in flavor small, 1 more needed"
    )
    kueue.kube.delete(WORKLOADS, "c", NS)

    kueue.hold("a")
    release_quota(kueue, "a")
    submit(kueue, "d", gpus=2)  # a released small: d gets it, a (held) does not
    assert trainer_flavor(wait_admitted(kueue, "d")) == "small"
    kueue.wait_settled()
    assert admission(kueue, "a") is None
    assert state(kueue, "a", c.ADMITTED) == ("False", "NoReservation", "The workload has no reservation")

    kueue.release("a")  # both flavors are full now
    expected = (
        "couldn't assign flavors to pod set trainer: "
        "insufficient unused quota for nvidia.com/gpu in flavor big, 2 more needed, "
        "insufficient unused quota for nvidia.com/gpu in flavor small, 2 more needed"
    )
    wait_for(lambda: pending_message(kueue, "a") == expected, timeout=5, what="a pending on full flavors")
    kueue.kube.delete(WORKLOADS, "b", NS)  # big is free again: a is readmitted there, on another flavor
    assert trainer_flavor(wait_admitted(kueue, "a")) == "big"
    assert state(kueue, "a", c.EVICTED) == ("False", "QuotaReserved", f"Previously: {preemption}")
    assert state(kueue, "a", c.PREEMPTED) == ("False", "QuotaReserved", f"Previously: {preemption}")


def test_an_eviction_names_kueues_reason_and_message(kueue):
    submit(kueue, "a", gpus=1)
    wait_admitted(kueue, "a")
    kueue.evict("a", reason=c.PODS_READY_TIMEOUT)
    assert state(kueue, "a", c.EVICTED) == ("True", "PodsReadyTimeout", "Exceeded the PodsReady timeout team-a/a")
    assert kueue.condition("a", c.PREEMPTED) is None
    with pytest.raises(LookupError):
        kueue.evict("nobody")
    submit(kueue, "big-one", gpus=8)
    wait_for(lambda: pending_message(kueue, "big-one"), timeout=5, what="big-one pending")
    with pytest.raises(ValueError, match="holds no quota"):
        kueue.evict("big-one")


def test_deactivation_evicts_and_reactivation_readmits(kueue):
    submit(kueue, "a", gpus=2)
    wait_admitted(kueue, "a")
    kueue.kube.patch(WORKLOADS, "a", {"spec": {"active": False}}, NS)
    deactivated = ("True", "Deactivated", "The workload is deactivated")
    assert wait_for(lambda: state(kueue, "a", c.EVICTED), timeout=5, what="a evicted") == deactivated
    assert admission(kueue, "a")  # still holding its quota until the job side lets go
    release_quota(kueue, "a")
    kueue.wait_settled()
    assert admission(kueue, "a") is None  # inactive: never readmitted

    kueue.kube.patch(WORKLOADS, "a", {"spec": {"active": True}}, NS)
    wait_admitted(kueue, "a")
    assert state(kueue, "a", c.EVICTED) == ("False", "QuotaReserved", "Previously: The workload is deactivated")
    assert state(kueue, "a", c.REQUEUED) == ("True", "Reactivated", "The workload was reactivated")

    submit(kueue, "b", gpus=1, active=False)  # inactive from the start: evicted at once, never admitted
    assert wait_for(lambda: state(kueue, "b", c.EVICTED), timeout=5, what="b evicted") == deactivated
    kueue.wait_settled()
    assert kueue.condition("b", c.QUOTA_RESERVED) is None


def test_a_held_workload_and_one_without_its_local_queue_wait(kueue):
    kueue.hold("a")
    submit(kueue, "a", gpus=1)
    submit(kueue, "b", gpus=1, queue="later")
    inadmissible = ("False", "Inadmissible", "LocalQueue later doesn't exist")
    assert wait_for(lambda: state(kueue, "b", c.QUOTA_RESERVED), timeout=5, what="b inadmissible") == inadmissible
    kueue.wait_settled()
    assert kueue.workload("a").get("status") is None
    kueue.release("a")
    wait_admitted(kueue, "a")
    kueue.local_queue("later", "cq")
    wait_admitted(kueue, "b")


def test_the_workload_schema_defaults_and_refuses_as_kueues(kueue: KueueStandIn):
    kueue.hold("w")
    created = submit(kueue, "w", gpus=0)
    assert created["spec"]["active"] is True
    assert created["spec"]["priorityClassSource"] == ""
    pod_set = created["spec"]["podSets"][0]
    with pytest.raises(ApiError) as refused:
        submit(kueue, "too-many", gpus=0, podSets=[{**pod_set, "name": f"p{i}"} for i in range(9)])
    assert refused.value.code == 422
    assert "spec.podSets" in str(refused.value)
    with pytest.raises(ApiError) as refused:
        job_side(kueue, "w", lambda status, gen: status.update(conditions=[{"type": "PodsReady", "status": "True"}]))
    assert refused.value.code == 422  # a condition is a whole metav1.Condition: reason, message, lastTransitionTime
    assert kueue.kube.list("wl", NS)[0]["metadata"]["name"] == "w"  # the short name is served


def test_kubectl_get_workloads_shows_kueues_columns(kueue: KueueStandIn):
    submit(kueue, "a", gpus=1)
    wait_admitted(kueue, "a")
    table = httpx.get(
        f"{kueue.kube.url}/apis/kueue.x-k8s.io/v1beta1/namespaces/{NS}/workloads",
        headers={"Accept": "application/json;as=Table;v=v1;g=meta.k8s.io"},
    ).json()
    columns = [col["name"] for col in table["columnDefinitions"]]
    assert columns == ["Name", "Queue", "Reserved in", "Admitted", "Finished", "Age"]
    assert table["rows"][0]["cells"][:5] == ["a", "q", "cq", "True", None]
