"""The Kubernetes API emulator's pods and nodes: graceful pod deletion by kube-apiserver's rules
(``tests/support/kube/graceful.py``; the tests play the kubelet) and cluster-scoped nodes with taints and
conditions, as kopf indexes and watches them."""

from __future__ import annotations

import datetime
import re

import kopf
import kubernetes.client
import kubernetes.config
import kubernetes.watch
import pytest

from tests.support.emulator_objects import PODS, pod, rv, watch, widget
from tests.support.kube import ApiError, KopfThread
from tests.support.polling import wait_for

# --- graceful pod deletion ------------------------------------------------------------------------
# kube-apiserver's rules (tests/support/kube/graceful.py): a scheduled, non-terminal pod is marked
# for its grace period and removed by the kubelet's grace-0 DELETE; the tests play the kubelet.


def scheduled(name: str, node: str = "node-1", grace: int | None = None, **metadata) -> dict:
    body = pod(name, **metadata)
    body["spec"]["nodeName"] = node
    if grace is not None:
        body["spec"]["terminationGracePeriodSeconds"] = grace
    return body


def seconds_from_now(timestamp: str) -> float:
    return (
        datetime.datetime.strptime(timestamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC) - now()
    ).total_seconds()


def now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def test_a_scheduled_pod_deleted_with_a_grace_period_is_marked_and_kept(kube, http):
    created = http.post(PODS, json=scheduled("p")).json()
    marked = http.delete(f"{PODS}/p", params={"gracePeriodSeconds": "20"})
    meta = marked.json()["metadata"]
    assert marked.status_code == 200 and meta["deletionGracePeriodSeconds"] == 20
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", meta["deletionTimestamp"])
    assert 18 <= seconds_from_now(meta["deletionTimestamp"]) <= 20
    assert meta["generation"] == created["metadata"]["generation"] + 1  # as BeforeDelete bumps it
    assert http.get(f"{PODS}/p").json()["metadata"] == meta  # still served, terminating
    events, _ = watch(http, PODS, 1, resourceVersion=created["metadata"]["resourceVersion"])
    assert [(e["type"], e["object"]["metadata"]["deletionGracePeriodSeconds"]) for e in events] == [("MODIFIED", 20)]


@pytest.mark.parametrize(
    ("spec_grace", "options", "expected"),
    [
        (None, {}, 30),  # the API server's default terminationGracePeriodSeconds
        (45, {}, 45),  # the pod's own
        (45, {"gracePeriodSeconds": 5}, 5),  # the request's
        (45, {"gracePeriodSeconds": -3}, 1),  # negative counts as 1
    ],
)
def test_the_grace_period_is_the_requests_else_the_pods_else_30_seconds(kube, spec_grace, options, expected):
    kube.create("pods", scheduled("p", grace=spec_grace), "ns")
    assert kube.delete("pods", "p", "ns", options)["metadata"]["deletionGracePeriodSeconds"] == expected


@pytest.mark.parametrize(
    ("body", "status"),
    [
        (pod("p"), None),  # not scheduled: nothing runs that needs time to stop
        (scheduled("p"), {"phase": "Succeeded"}),  # terminal: its containers already stopped
        (scheduled("p"), {"phase": "Failed"}),
    ],
    ids=["unscheduled", "succeeded", "failed"],
)
def test_an_unscheduled_or_terminal_pod_is_removed_at_once_whatever_the_grace_period(kube, http, body, status):
    kube.create("pods", body | ({"status": status} if status else {}), "ns", keep_status=True)
    assert http.delete(f"{PODS}/p", params={"gracePeriodSeconds": "30"}).status_code == 200
    assert kube.get("pods", "p", "ns") is None


def test_a_grace_period_of_zero_removes_a_running_pod_at_once(kube, http):
    kube.create("pods", scheduled("p", grace=60) | {"status": {"phase": "Running"}}, "ns", keep_status=True)
    deleted = http.delete(f"{PODS}/p", params={"gracePeriodSeconds": "0"})  # kubectl delete --force --grace-period=0
    assert deleted.status_code == 200 and kube.get("pods", "p", "ns") is None


def test_a_second_delete_may_only_shorten_the_grace_period(kube, http):
    kube.create("pods", scheduled("p"), "ns")
    first = kube.delete("pods", "p", "ns", {"gracePeriodSeconds": 60})["metadata"]
    for unchanged in ({}, {"gracePeriodSeconds": 60}, {"gracePeriodSeconds": 90}):
        assert kube.delete("pods", "p", "ns", unchanged)["metadata"] == first  # no write: same resourceVersion
    shortened = http.delete(f"{PODS}/p", params={"gracePeriodSeconds": "10"}).json()["metadata"]
    moved = datetime.datetime.strptime(first["deletionTimestamp"], "%Y-%m-%dT%H:%M:%SZ") - datetime.datetime.strptime(
        shortened["deletionTimestamp"], "%Y-%m-%dT%H:%M:%SZ"
    )
    assert shortened["deletionGracePeriodSeconds"] == 10 and moved == datetime.timedelta(seconds=50)
    assert int(shortened["resourceVersion"]) > int(first["resourceVersion"])
    assert shortened["generation"] == first["generation"]
    assert kube.delete("pods", "p", "ns", {"gracePeriodSeconds": 0})["metadata"]["name"] == "p"
    assert kube.get("pods", "p", "ns") is None  # shortened to 0: removed


def test_the_kubelet_stand_ins_finish_a_graceful_deletion(kube, http):
    kube.create("pods", scheduled("p"), "ns")
    with pytest.raises(ValueError, match="not being deleted"):
        kube.finish_pod_deletion("p", "ns")
    marked = kube.delete("pods", "p", "ns", {"gracePeriodSeconds": 30})
    final = kube.finish_pod_deletion("p", "ns")
    assert final["metadata"]["uid"] == marked["metadata"]["uid"] and kube.get("pods", "p", "ns") is None
    assert final["metadata"]["deletionGracePeriodSeconds"] == 0  # the kubelet's grace-0 mark
    assert seconds_from_now(final["metadata"]["deletionTimestamp"]) <= 0
    events, _ = watch(http, PODS, 1, resourceVersion=marked["metadata"]["resourceVersion"])
    assert events[0]["type"] == "DELETED" and rv(events[0]["object"]) == rv(final)
    with pytest.raises(ApiError) as missing:
        kube.finish_pod_deletion("p", "ns")
    assert missing.value.code == 404


def test_expire_pod_deletions_finishes_only_the_deletions_that_are_due(kube):
    for name, grace in (("short", 5), ("long", 100), ("held", 5)):
        kube.create("pods", scheduled(name, grace=grace), "ns")
        kube.delete("pods", name, "ns")
    kube.create("pods", scheduled("alive"), "ns")
    kube.patch("pods", "held", {"metadata": {"finalizers": ["keep/me"]}}, "ns")
    assert kube.expire_pod_deletions() == []  # nothing is due yet: no kubelet acts on its own
    later = now() + datetime.timedelta(seconds=10)
    assert kube.expire_pod_deletions(later) == [("ns", "held"), ("ns", "short")]
    assert [p["metadata"]["name"] for p in kube.list("pods")] == ["alive", "held", "long"]
    held = kube.get("pods", "held", "ns")["metadata"]
    assert held["deletionGracePeriodSeconds"] == 0 and seconds_from_now(held["deletionTimestamp"]) <= 0
    assert (
        kube.expire_pod_deletions(later.strftime("%Y-%m-%dT%H:%M:%SZ")) == []
    )  # grace 0 now: only its finalizer holds it
    kube.patch("pods", "held", {"metadata": {"finalizers": None}}, "ns")
    assert kube.expire_pod_deletions(now() + datetime.timedelta(seconds=200)) == [("ns", "long")]
    assert [p["metadata"]["name"] for p in kube.list("pods")] == ["alive"]


def test_a_pod_in_its_grace_period_outlives_its_last_finalizer_until_the_kubelet_is_done(kube):
    kube.create("pods", scheduled("p", finalizers=["keep/me"]), "ns")
    kube.delete("pods", "p", "ns", {"gracePeriodSeconds": 30})
    kube.patch("pods", "p", {"metadata": {"finalizers": None}}, "ns")
    assert kube.get("pods", "p", "ns")["metadata"]["deletionGracePeriodSeconds"] == 30  # ShouldDeleteDuringUpdate: no
    kube.finish_pod_deletion("p", "ns")
    assert kube.get("pods", "p", "ns") is None


def test_a_pod_with_finalizers_deleted_without_grace_waits_for_them_as_before(kube):
    kube.create("pods", scheduled("p", finalizers=["keep/me"]), "ns")
    marked = kube.delete("pods", "p", "ns", {"gracePeriodSeconds": 0})["metadata"]
    assert marked["deletionGracePeriodSeconds"] == 0 and marked["finalizers"] == ["keep/me"]
    assert kube.delete("pods", "p", "ns", {"gracePeriodSeconds": 0})["metadata"] == marked  # pending: no change
    kube.patch("pods", "p", {"metadata": {"finalizers": []}}, "ns")
    assert kube.get("pods", "p", "ns") is None


def test_a_dry_run_graceful_delete_changes_nothing(kube, http):
    created = kube.create("pods", scheduled("p"), "ns")
    answer = http.delete(f"{PODS}/p", params={"gracePeriodSeconds": "10", "dryRun": "All"}).json()
    assert answer["metadata"]["deletionGracePeriodSeconds"] == 10
    assert kube.get("pods", "p", "ns") == created


def test_the_kubernetes_client_deletes_gracefully_with_a_query_parameter_or_a_delete_options_body(kube, api):
    core = kubernetes.client.CoreV1Api(api)
    for name in ("by-query", "by-body", "both"):
        core.create_namespaced_pod("ns", scheduled(name, grace=60))
    by_query = core.delete_namespaced_pod("by-query", "ns", grace_period_seconds=7)
    by_body = core.delete_namespaced_pod(
        "by-body", "ns", body=kubernetes.client.V1DeleteOptions(grace_period_seconds=8)
    )
    # A body is the DeleteOptions; the query is read only without one (as the API server decodes them).
    both = core.delete_namespaced_pod(
        "both", "ns", grace_period_seconds=1, body=kubernetes.client.V1DeleteOptions(grace_period_seconds=9)
    )
    assert [p.metadata.deletion_grace_period_seconds for p in (by_query, by_body, both)] == [7, 8, 9]
    terminating = {p.metadata.name: p.metadata.deletion_timestamp for p in core.list_namespaced_pod("ns").items}
    assert set(terminating) == {"by-query", "by-body", "both"} and all(terminating.values())
    assert kube.requests[-2].param("gracePeriodSeconds") == "1"
    core.delete_namespaced_pod("by-query", "ns", grace_period_seconds=0)
    assert kube.get("pods", "by-query", "ns") is None


def test_a_malformed_grace_period_is_400(kube, http):
    kube.create("pods", scheduled("p"), "ns")
    assert http.delete(f"{PODS}/p", params={"gracePeriodSeconds": "soon"}).status_code == 400
    assert http.request("DELETE", f"{PODS}/p", json={"gracePeriodSeconds": "5"}).status_code == 400
    assert "deletionTimestamp" not in kube.get("pods", "p", "ns")["metadata"]


def test_garbage_collection_and_namespace_deletion_delete_scheduled_pods_gracefully(kube):
    owner = kube.create("widgets", widget("owner"), "ns")
    ref = {"apiVersion": "example.com/v1", "kind": "Widget", "name": "owner", "uid": owner["metadata"]["uid"]}
    kube.create("pods", scheduled("running", grace=45, ownerReferences=[ref]), "ns")
    kube.create("pods", pod("pending", ownerReferences=[ref]), "ns")
    kube.delete("widgets", "owner", "ns")
    # background propagation: the GC's DELETE names no grace period, the pod's own applies
    assert [p["metadata"]["name"] for p in kube.list("pods")] == ["running"]
    assert kube.get("pods", "running", "ns")["metadata"]["deletionGracePeriodSeconds"] == 45
    kube.create("pods", scheduled("in-ns"), "gone")
    kube.create("namespaces", {"metadata": {"name": "gone"}})
    kube.delete("namespaces", "gone")
    assert kube.get("pods", "in-ns", "gone")["metadata"]["deletionGracePeriodSeconds"] == 30
    assert sorted(kube.expire_pod_deletions(now() + datetime.timedelta(minutes=1))) == [
        ("gone", "in-ns"),
        ("ns", "running"),
    ]


def test_kopf_sees_a_pod_terminate_then_go(kube):
    registry = kopf.OperatorRegistry()
    seen: list[tuple[str | None, int | None]] = []

    @kopf.on.event("", "v1", "pods", registry=registry)
    def on_pod(type, body, **_):
        seen.append((type, body["metadata"].get("deletionGracePeriodSeconds")))

    kube.create("pods", scheduled("p"), "ns")
    with KopfThread(registry, kube):
        wait_for(lambda: seen)
        kube.delete("pods", "p", "ns", {"gracePeriodSeconds": 15})
        wait_for(lambda: ("MODIFIED", 15) in seen)
        kube.finish_pod_deletion("p", "ns")
        wait_for(lambda: seen[-1][0] == "DELETED")
    assert seen[0] == (None, None)  # the initial listing


# --- nodes ----------------------------------------------------------------------------------------


def node(name: str, **spec) -> dict:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": {"pool": "gpu"}}, "spec": spec}


def test_nodes_are_cluster_scoped_with_taints_and_status_conditions(kube, api):
    core = kubernetes.client.CoreV1Api(api)
    created = core.create_node(node("n1"))
    assert created.metadata.namespace is None and created.spec.taints is None
    taint = {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}
    core.patch_node("n1", {"spec": {"taints": [taint]}})
    ready = {"type": "Ready", "status": "False", "reason": "KubeletNotReady"}
    core.patch_node_status("n1", {"status": {"conditions": [ready]}})
    read = core.read_node("n1")
    assert [(t.key, t.effect) for t in read.spec.taints] == [("node.kubernetes.io/unschedulable", "NoSchedule")]
    assert [(c.type, c.status, c.reason) for c in read.status.conditions] == [("Ready", "False", "KubeletNotReady")]
    core.patch_node("n1", {"spec": {"taints": None}})
    assert core.read_node("n1").spec.taints is None and core.read_node("n1").status.conditions
    assert [n.metadata.name for n in core.list_node(label_selector="pool=gpu").items] == ["n1"]
    core.delete_node("n1", grace_period_seconds=30)  # not a pod: no graceful deletion
    assert core.list_node().items == []
    assert {("", "nodes", "create"), ("", "nodes/status", "patch"), ("", "nodes", "delete")} <= kube.rbac_usage()


@pytest.mark.parametrize("namespaces", [[], ["ns"]], ids=["cluster-wide", "listed-namespaces"])
def test_kopf_indexes_and_watches_nodes_cluster_wide_even_when_it_watches_listed_namespaces(kube, namespaces):
    registry = kopf.OperatorRegistry()
    snapshots: list[tuple[str | None, dict]] = []

    @kopf.index("", "v1", "nodes", id="node_taints", registry=registry)  # handlers get it as node_taints=
    def node_taints(name, spec, **_):
        return {name: sorted(t["key"] for t in spec.get("taints") or [])}

    @kopf.on.event("", "v1", "nodes", registry=registry)
    def on_node(type, node_taints: kopf.Index, **_):
        snapshots.append((type, {key: list(store) for key, store in node_taints.items()}))

    kube.create("nodes", node("before"))
    # kopf watches each resource in each observed namespace, a cluster-scoped one once, cluster-wide;
    # with listed namespaces it watches nothing at all, nodes included, until one of them exists.
    for namespace in namespaces:
        kube.create("namespaces", {"metadata": {"name": namespace}})
    with KopfThread(registry, kube, namespaces=namespaces):
        wait_for(lambda: snapshots)
        kube.create("nodes", node("during"))
        kube.patch("nodes", "during", {"spec": {"taints": [{"key": "example.com/going-away", "effect": "NoExecute"}]}})
        wait_for(lambda: snapshots[-1][1].get("during") == [["example.com/going-away"]])
        kube.patch(
            "nodes",
            "during",
            {"status": {"conditions": [{"type": "Ready", "status": "Unknown"}]}},
            subresource="status",
        )
        kube.delete("nodes", "before")
        wait_for(lambda: ("DELETED", {"during": [["example.com/going-away"]]}) in snapshots)
    assert snapshots[0] == (None, {"before": [[]]})
    assert {"ADDED", "MODIFIED", "DELETED"} <= {t for t, _ in snapshots}
    watches = [r for r in kube.requests if r.verb == "watch" and r.resource == "nodes"]
    assert watches and {r.namespace for r in watches} == {None}  # a cluster-scoped resource: watched cluster-wide
    assert {r.rbac for r in kube.requests if r.resource == "nodes"} == {("", "nodes", "list"), ("", "nodes", "watch")}
