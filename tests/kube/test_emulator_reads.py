"""The Kubernetes API emulator's reads behave as an API server's: watches resumed from a resource version,
label and field selectors on lists and watches, lists and discovery as kubectl and kopf read them.

Each test names one API-server guarantee and checks it through a real client (raw HTTP or the sync
``kubernetes`` client).
"""

from __future__ import annotations

import threading
import time

import httpx
import kubernetes.client
import kubernetes.config
import kubernetes.watch
import pytest

from tests.support.emulator_objects import PODS, WIDGETS, merge, pod, watch, widget
from tests.support.kube import ApiError, KubeEmulator, KubeServer, label_matcher

# --- watches --------------------------------------------------------------------------------------


def test_a_watch_from_a_resource_version_streams_only_the_later_events(http):
    http.post(WIDGETS, json=widget("old"))
    since = http.get(WIDGETS).json()["metadata"]["resourceVersion"]
    http.post(WIDGETS, json=widget("new"))
    merge(http, f"{WIDGETS}/old", {"spec": {"size": 7}})
    events, headers = watch(http, WIDGETS, 2, resourceVersion=since)
    assert headers["Content-Type"].startswith("application/json")
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [("ADDED", "new"), ("MODIFIED", "old")]
    assert events[1]["object"]["spec"]["size"] == 7 and events[1]["object"]["kind"] == "Widget"


def test_a_watch_without_a_resource_version_starts_with_the_existing_objects_as_added(http):
    http.post(WIDGETS, json=widget("a"))
    http.post(WIDGETS, json=widget("b"))
    for since in (None, "0"):
        params = {} if since is None else {"resourceVersion": since}
        events, _ = watch(http, WIDGETS, 2, **params)
        assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [("ADDED", "a"), ("ADDED", "b")]


def test_the_kubernetes_client_lists_then_watches_only_what_happens_after_the_list(kube, api):
    core = kubernetes.client.CoreV1Api(api)
    kube.create("pods", pod("before"), "ns")
    listed = core.list_namespaced_pod("ns")
    assert listed.kind == "PodList" and [p.metadata.name for p in listed.items] == ["before"]
    threading.Timer(0.2, lambda: kube.create("pods", pod("after"), "ns")).start()
    stream = kubernetes.watch.Watch().stream(
        core.list_namespaced_pod, "ns", resource_version=listed.metadata.resource_version, timeout_seconds=2
    )
    event = next(stream)
    stream.close()
    assert (event["type"], event["object"].metadata.name) == ("ADDED", "after")


def test_a_watch_from_a_compacted_resource_version_gets_410_gone():
    with KubeServer(emulator=KubeEmulator(history_size=2)) as kube, httpx.Client(base_url=kube.url) as http:
        for name in "abcd":  # events 3 and 4 are kept: a watch from 1 would miss 2
            kube.create("configmaps", {"metadata": {"name": name}}, "ns")
        events, _ = watch(http, "/api/v1/namespaces/ns/configmaps", 1, resourceVersion="1")
        assert events[0]["type"] == "ERROR" and events[0]["object"]["code"] == 410


def test_a_selector_watch_sees_objects_enter_as_added_and_leave_as_deleted(kube, http):
    kube.create("widgets", widget("a"), "ns")
    since = http.get(WIDGETS).json()["metadata"]["resourceVersion"]
    kube.patch("widgets", "a", {"metadata": {"labels": {"team": "x"}}}, "ns")
    kube.patch("widgets", "a", {"spec": {"size": 2}}, "ns")
    kube.patch("widgets", "a", {"metadata": {"labels": {"team": "y"}}}, "ns")
    events, _ = watch(http, WIDGETS, 3, resourceVersion=since, labelSelector="team=x")
    assert [e["type"] for e in events] == ["ADDED", "MODIFIED", "DELETED"]


def test_a_watch_sees_changes_made_while_it_is_open(kube, http):
    threading.Timer(0.2, lambda: kube.create("widgets", widget("late"), "ns")).start()
    events, _ = watch(http, WIDGETS, 1, resourceVersion=str(kube.emulator.resource_version))
    assert events[0]["type"] == "ADDED" and events[0]["object"]["metadata"]["name"] == "late"


def test_a_watch_ends_after_its_timeout_seconds(http):
    started = time.monotonic()
    events, _ = watch(http, WIDGETS, 1, resourceVersion="1", timeoutSeconds="1")
    assert events == [] and 0.9 < time.monotonic() - started < 2


# --- selectors ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("selector", "names"),
    [
        ("tier=web", ["a", "b"]),
        ("tier==web,env=prod", ["a"]),
        ("tier!=web", ["c", "d"]),  # also objects without the label
        ("env", ["a", "b", "c"]),
        ("!env", ["d"]),
        ("env in (prod, dev)", ["a", "b"]),
        ("env notin (prod),tier", ["b", "c"]),
        ("", ["a", "b", "c", "d"]),
    ],
)
def test_label_selectors_filter_lists(kube, api, selector, names):
    for name, labels in {
        "a": {"tier": "web", "env": "prod"},
        "b": {"tier": "web", "env": "dev"},
        "c": {"tier": "db", "env": "test"},
        "d": {},
    }.items():
        kube.create("pods", pod(name, labels=labels), "ns")
    listed = kubernetes.client.CoreV1Api(api).list_pod_for_all_namespaces(label_selector=selector)
    assert [p.metadata.name for p in listed.items] == names


def test_a_malformed_label_selector_is_400(http):
    assert http.get(PODS, params={"labelSelector": "a in b"}).status_code == 400
    with pytest.raises(ApiError):
        label_matcher("!a=b")


def test_field_selectors_filter_lists_and_watches(kube, http):
    for namespace, name, phase in [("ns", "a", "Running"), ("ns", "b", "Pending"), ("other", "a", "Running")]:
        kube.create("pods", pod(name) | {"status": {"phase": phase}}, namespace, keep_status=True)

    def names(**params) -> list[str]:
        return [
            f"{p['metadata']['namespace']}/{p['metadata']['name']}"
            for p in http.get("/api/v1/pods", params=params).json()["items"]
        ]

    assert names(fieldSelector="metadata.name=a") == ["ns/a", "other/a"]
    assert names(fieldSelector="metadata.namespace=ns,status.phase!=Running") == ["ns/b"]
    assert names(fieldSelector="status.phase==Running", labelSelector="!x") == ["ns/a", "other/a"]
    events, _ = watch(http, "/api/v1/pods", 1, fieldSelector="metadata.namespace=other")
    assert events[0]["object"]["metadata"]["namespace"] == "other"


# --- lists and discovery --------------------------------------------------------------------------


def test_lists_carry_kind_api_version_and_the_collection_resource_version(kube, http):
    kube.create("widgets", widget("a"), "ns")
    widgets = http.get("/apis/example.com/v1/widgets").json()
    assert (widgets["kind"], widgets["apiVersion"]) == ("WidgetList", "example.com/v1")
    assert widgets["metadata"]["resourceVersion"] == str(kube.emulator.resource_version)
    assert (widgets["items"][0]["kind"], widgets["items"][0]["apiVersion"]) == ("Widget", "example.com/v1")
    pods = http.get("/api/v1/pods").json()
    assert (pods["kind"], pods["apiVersion"], pods["items"]) == ("PodList", "v1", [])


def test_discovery_serves_core_groups_and_versions(http):
    assert http.get("/api").json()["versions"] == ["v1"]
    core = http.get("/api/v1").json()
    assert core["groupVersion"] == "v1"
    by_name = {r["name"]: r for r in core["resources"]}
    assert {
        "namespaces",
        "pods",
        "pods/status",
        "services",
        "persistentvolumeclaims",
        "secrets",
        "configmaps",
        "events",
    } <= set(by_name)
    assert by_name["pods"]["namespaced"] and not by_name["namespaces"]["namespaced"]
    assert "watch" in by_name["pods"]["verbs"] and by_name["pods/status"]["verbs"] == ["get", "patch", "update"]
    groups = {g["name"]: g for g in http.get("/apis").json()["groups"]}
    assert {"example.com", "events.k8s.io", "apiextensions.k8s.io"} <= set(groups)
    assert groups["example.com"]["preferredVersion"] == {"groupVersion": "example.com/v1", "version": "v1"}
    assert http.get("/apis/example.com").json()["kind"] == "APIGroup"
    widgets = {r["name"]: r for r in http.get("/apis/example.com/v1").json()["resources"]}
    assert widgets["widgets"] | {"verbs": ...} == {
        "name": "widgets",
        "singularName": "widget",
        "namespaced": True,
        "kind": "Widget",
        "shortNames": ["wd"],
        "verbs": ...,
    }
    assert "widgets/status" in widgets and "gadgets/status" not in widgets
    assert http.get("/apis/nowhere.io/v1").status_code == 404
    assert http.get("/apis/example.com/v1/nothings").status_code == 404


def test_an_aggregated_discovery_request_is_answered_with_legacy_json(http):
    accept = "application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList,application/json"
    response = http.get("/apis", headers={"Accept": accept})
    assert response.headers["Content-Type"].startswith("application/json")
    assert response.json()["kind"] == "APIGroupList"
