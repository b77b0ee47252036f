"""The Kubernetes API emulator behaves as kopf, kubectl and the kubernetes client expect of an API server.

Each test names one API-server guarantee the operator's tests will lean on (resource versions,
watch resumption, the status subresource, finalizers, selectors, discovery, ...) and checks it
through a real client: raw HTTP, the sync ``kubernetes`` client, the kubectl binary, or kopf.
"""

from __future__ import annotations

import datetime
import json
import re
import subprocess
import threading
import time
import uuid
from pathlib import Path

import httpx
import kopf
import kubernetes.client
import kubernetes.config
import kubernetes.watch
import pytest
import yaml

from tests.kube.conftest import WIDGET_CRD
from tests.support.kube import ApiError, KopfThread, KubeEmulator, KubeServer, label_matcher
from tests.support.polling import wait_for

ROOT = Path(__file__).resolve().parents[2]
WIDGETS = "/apis/example.com/v1/namespaces/ns/widgets"
PODS = "/api/v1/namespaces/ns/pods"


def widget(name: str, size: int = 1, **metadata) -> dict:
    return {
        "apiVersion": "example.com/v1",
        "kind": "Widget",
        "metadata": {"name": name, **metadata},
        "spec": {"size": size},
    }


def pod(name: str, **metadata) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, **metadata}, "spec": {"containers": []}}


def watch(http: httpx.Client, path: str, count: int, **params) -> tuple[list[dict], httpx.Headers]:
    """The first ``count`` events of a watch (2 s server timeout as a safety net), and the response headers."""
    params = {"watch": "true", "timeoutSeconds": "2", **params}
    events = []
    with http.stream("GET", path, params=params) as response:
        for line in response.iter_lines():
            if line:
                events.append(json.loads(line))
            if len(events) >= count:
                break
    return events, response.headers


def rv(obj: dict) -> int:
    return int(obj["metadata"]["resourceVersion"])


def merge(http: httpx.Client, path: str, patch: dict) -> httpx.Response:
    return http.patch(path, json=patch, headers={"Content-Type": "application/merge-patch+json"})


# --- resourceVersion ------------------------------------------------------------------------------


def test_every_write_takes_the_next_value_of_one_global_resource_version(kube, http):
    versions = [rv(http.post(WIDGETS, json=widget("a", finalizers=["x/y"])).json())]
    versions.append(rv(http.post(PODS, json=pod("p")).json()))  # another resource, same counter
    versions.append(rv(merge(http, f"{WIDGETS}/a", {"spec": {"size": 2}}).json()))
    json_ops = [{"op": "add", "path": "/metadata/labels", "value": {"k": "v"}}]
    versions.append(
        rv(http.patch(f"{WIDGETS}/a", json=json_ops, headers={"Content-Type": "application/json-patch+json"}).json())
    )
    versions.append(rv(http.put(f"{WIDGETS}/a", json=http.get(f"{WIDGETS}/a").json() | {"spec": {"size": 3}}).json()))
    versions.append(rv(merge(http, f"{WIDGETS}/a/status", {"status": {"phase": "Up"}}).json()))
    versions.append(rv(http.delete(f"{WIDGETS}/a").json()))  # marked for deletion (finalizer)
    versions.append(rv(merge(http, f"{WIDGETS}/a", {"metadata": {"finalizers": None}}).json()))  # removed
    assert versions == list(range(versions[0], versions[0] + 8))
    assert isinstance(http.get(PODS + "/p").json()["metadata"]["resourceVersion"], str)
    assert http.get("/api/v1/pods").json()["metadata"]["resourceVersion"] == str(versions[-1])


def test_a_patch_that_changes_nothing_keeps_the_resource_version(http):
    created = http.post(WIDGETS, json=widget("a", size=2)).json()
    assert rv(merge(http, f"{WIDGETS}/a", {"spec": {"size": 2}}).json()) == rv(created)


def test_a_failed_json_patch_test_is_a_422_status_and_changes_nothing(http):
    created = http.post(WIDGETS, json=widget("a")).json()
    headers = {"Content-Type": "application/json-patch+json"}
    stale = [
        {"op": "test", "path": "/metadata/resourceVersion", "value": "999"},
        {"op": "add", "path": "/metadata/finalizers", "value": ["kopf.zalando.org/KopfFinalizerMarker"]},
    ]
    response = http.patch(f"{WIDGETS}/a", json=stale, headers=headers)
    assert response.status_code == 422
    assert response.json() | {"message": ...} == {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "reason": "Invalid",
        "code": 422,
        "details": {"name": "a", "group": "example.com", "kind": "widgets"},
        "message": ...,
    }
    assert "testing value /metadata/resourceVersion failed" in response.json()["message"]
    assert "finalizers" not in http.get(f"{WIDGETS}/a").json()["metadata"]

    fresh = [dict(stale[0], value=created["metadata"]["resourceVersion"]), stale[1]]
    patched = http.patch(f"{WIDGETS}/a", json=fresh, headers=headers)
    assert patched.status_code == 200 and patched.json()["metadata"]["finalizers"] == stale[1]["value"]


def test_a_stale_resource_version_in_a_merge_patch_or_put_is_a_409_conflict(http):
    created = http.post(WIDGETS, json=widget("a")).json()
    merge(http, f"{WIDGETS}/a", {"spec": {"size": 5}})
    stale_patch = merge(
        http,
        f"{WIDGETS}/a",
        {"metadata": {"resourceVersion": created["metadata"]["resourceVersion"]}, "spec": {"size": 6}},
    )
    stale_strategic = http.patch(
        f"{WIDGETS}/a",
        json={"metadata": {"resourceVersion": created["metadata"]["resourceVersion"]}},
        headers={"Content-Type": "application/strategic-merge-patch+json"},
    )
    stale_put = http.put(f"{WIDGETS}/a", json=created)
    for response in (stale_patch, stale_strategic, stale_put):
        assert response.status_code == 409
        assert response.json()["reason"] == "Conflict" and "the object has been modified" in response.json()["message"]
    assert http.get(f"{WIDGETS}/a").json()["spec"]["size"] == 5


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


# --- object metadata ------------------------------------------------------------------------------


def test_create_fills_uid_timestamp_generation_namespace_and_a_generated_name(http):
    body = widget("")
    body["metadata"] = {"generateName": "w-"}
    response = http.post(WIDGETS, json=body)
    assert response.status_code == 201
    meta = response.json()["metadata"]
    assert uuid.UUID(meta["uid"]).version == 4
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", meta["creationTimestamp"])
    assert meta["generation"] == 1 and meta["namespace"] == "ns"
    assert re.fullmatch(r"w-[a-z0-9]{5}", meta["name"])
    assert http.get(f"{WIDGETS}/{meta['name']}").json()["metadata"]["uid"] == meta["uid"]


def test_creating_an_existing_name_is_409_already_exists(http):
    http.post(WIDGETS, json=widget("a"))
    response = http.post(WIDGETS, json=widget("a"))
    assert response.status_code == 409
    assert (
        response.json()["reason"] == "AlreadyExists"
        and response.json()["message"] == 'widgets.example.com "a" already exists'
    )


def test_a_namespace_in_the_body_that_differs_from_the_url_is_400(http):
    assert http.post(WIDGETS, json=widget("a", namespace="other")).status_code == 400


def test_generation_counts_changes_outside_metadata_and_status(http):
    http.post(WIDGETS, json=widget("a"))
    assert merge(http, f"{WIDGETS}/a", {"metadata": {"labels": {"k": "v"}}}).json()["metadata"]["generation"] == 1
    assert merge(http, f"{WIDGETS}/a/status", {"status": {"phase": "Up"}}).json()["metadata"]["generation"] == 1
    assert merge(http, f"{WIDGETS}/a", {"spec": {"size": 9}}).json()["metadata"]["generation"] == 2


# --- the status subresource -----------------------------------------------------------------------


def test_writes_to_status_change_only_status_and_writes_to_the_object_ignore_status(http):
    http.post(WIDGETS, json=widget("a") | {"status": {"phase": "Ignored"}})
    assert "status" not in http.get(f"{WIDGETS}/a").json()  # dropped on create, as the API server does
    via_status = merge(http, f"{WIDGETS}/a/status", {"spec": {"size": 99}, "status": {"phase": "Up"}}).json()
    assert via_status["spec"]["size"] == 1 and via_status["status"] == {"phase": "Up"}
    via_object = merge(http, f"{WIDGETS}/a", {"spec": {"size": 2}, "status": {"phase": "Down"}}).json()
    assert via_object["spec"]["size"] == 2 and via_object["status"] == {"phase": "Up"}
    put_status = http.put(f"{WIDGETS}/a/status", json=via_object | {"status": {"phase": "Put"}, "spec": {"size": 3}})
    assert put_status.json()["status"] == {"phase": "Put"} and put_status.json()["spec"]["size"] == 2


def test_pods_have_a_status_subresource_too(kube, http):
    http.post(PODS, json=pod("p"))
    merge(http, f"{PODS}/p", {"status": {"phase": "Running"}})
    assert "status" not in http.get(f"{PODS}/p").json()
    merge(http, f"{PODS}/p/status", {"status": {"phase": "Running"}})
    assert http.get(f"{PODS}/p").json()["status"]["phase"] == "Running"


def test_a_resource_without_a_status_subresource_keeps_status_written_with_the_object(http):
    created = http.post("/apis/example.com/v1/gadgets", json={"metadata": {"name": "g"}, "status": {"ok": True}})
    assert created.json()["status"] == {"ok": True} and "namespace" not in created.json()["metadata"]
    assert http.patch("/apis/example.com/v1/gadgets/g/status", json={}).status_code == 404


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


# --- deletion -------------------------------------------------------------------------------------


def test_deleting_an_object_with_finalizers_marks_it_until_the_last_finalizer_goes(kube, http):
    created = http.post(WIDGETS, json=widget("a", finalizers=["a/b", "c/d"])).json()
    marked = http.delete(f"{WIDGETS}/a")
    assert marked.status_code == 200 and marked.json()["metadata"]["deletionTimestamp"]
    merge(http, f"{WIDGETS}/a", {"metadata": {"finalizers": ["c/d"]}})
    assert http.get(f"{WIDGETS}/a").status_code == 200
    merge(http, f"{WIDGETS}/a", {"metadata": {"finalizers": []}})
    assert http.get(f"{WIDGETS}/a").status_code == 404
    events, _ = watch(http, WIDGETS, 3, resourceVersion=created["metadata"]["resourceVersion"])
    assert [e["type"] for e in events] == ["MODIFIED", "MODIFIED", "DELETED"]
    assert events[0]["object"]["metadata"]["deletionTimestamp"]


def test_deleting_an_object_without_finalizers_removes_it_at_once(kube, http):
    created = http.post(WIDGETS, json=widget("a")).json()
    deleted = http.delete(f"{WIDGETS}/a")
    assert deleted.status_code == 200 and deleted.json()["metadata"]["uid"] == created["metadata"]["uid"]
    assert http.get(f"{WIDGETS}/a").status_code == 404
    events, _ = watch(http, WIDGETS, 1, resourceVersion=created["metadata"]["resourceVersion"])
    assert events[0]["type"] == "DELETED" and rv(events[0]["object"]) == rv(deleted.json())
    assert http.delete(f"{WIDGETS}/a").json()["reason"] == "NotFound"


def test_pods_are_deleted_with_delete_options(kube, api):
    core = kubernetes.client.CoreV1Api(api)
    core.create_namespaced_pod("ns", pod("p"))
    options = kubernetes.client.V1DeleteOptions(grace_period_seconds=30, propagation_policy="Foreground")
    deleted = core.delete_namespaced_pod("p", "ns", body=options)
    assert deleted.metadata.name == "p" and kube.get("pods", "p", "ns") is None


def test_a_delete_precondition_on_a_stale_uid_is_a_409_conflict(kube, http):
    kube.create("pods", pod("p"), "ns")
    response = http.request("DELETE", f"{PODS}/p", json={"preconditions": {"uid": "not-it"}})
    assert response.status_code == 409 and kube.get("pods", "p", "ns") is not None


def test_deletecollection_deletes_what_the_selector_matches(kube, http):
    for name, labels in (("a", {"run": "x"}), ("b", {"run": "x"}), ("c", {})):
        kube.create("pods", pod(name, labels=labels), "ns")
    assert http.delete(PODS, params={"labelSelector": "run=x"}).status_code == 200
    assert [p["metadata"]["name"] for p in kube.list("pods")] == ["c"]


def test_dependents_are_garbage_collected_when_their_owner_is_removed(kube):
    owner = kube.create("widgets", widget("owner"), "ns")
    ref = {"apiVersion": "example.com/v1", "kind": "Widget", "name": "owner", "uid": owner["metadata"]["uid"]}
    kube.create("pods", pod("owned", ownerReferences=[ref]), "ns")
    kube.create("pods", pod("held", ownerReferences=[ref], finalizers=["keep/me"]), "ns")
    kube.create("pods", pod("free"), "ns")
    kube.delete("widgets", "owner", "ns")
    assert [p["metadata"]["name"] for p in kube.list("pods")] == ["free", "held"]
    assert kube.get("pods", "held", "ns")["metadata"]["deletionTimestamp"]


def test_deleting_a_namespace_deletes_what_is_in_it(kube):
    kube.create("namespaces", {"metadata": {"name": "gone"}})
    kube.create("configmaps", {"metadata": {"name": "c"}}, "gone")
    kube.create("configmaps", {"metadata": {"name": "c"}}, "kept")
    kube.delete("namespaces", "gone")
    assert [(c["metadata"]["namespace"], c["metadata"]["name"]) for c in kube.list("configmaps")] == [("kept", "c")]


# --- served resources -----------------------------------------------------------------------------


def test_the_core_resources_an_operator_uses_are_served(kube, api, http):
    core = kubernetes.client.CoreV1Api(api)
    core.create_namespace({"metadata": {"name": "ns"}})
    core.create_namespaced_service("ns", {"metadata": {"name": "svc"}, "spec": {"ports": [{"port": 80}]}})
    claim = {
        "metadata": {"name": "pvc"},
        "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Gi"}}},
    }
    core.create_namespaced_persistent_volume_claim("ns", claim)
    core.create_namespaced_secret("ns", {"metadata": {"name": "s"}, "stringData": {"token": "t"}})
    core.create_namespaced_config_map("ns", {"metadata": {"name": "cm"}, "data": {"k": "v"}})
    event = {
        "metadata": {"generateName": "e-"},
        "involvedObject": {"kind": "Pod", "name": "p"},
        "reason": "R",
        "message": "m",
    }
    core.create_namespaced_event("ns", event)
    events_api = kubernetes.client.EventsV1Api(api)
    events_api.create_namespaced_event(
        "ns", {"metadata": {"name": "e2"}, "eventTime": "2025-01-01T00:00:00.000000Z", "reason": "R"}
    )
    assert [n.metadata.name for n in core.list_namespace().items] == ["ns"]
    assert core.read_namespaced_service("svc", "ns").spec.ports[0].port == 80
    assert core.read_namespaced_persistent_volume_claim("pvc", "ns").spec.access_modes == ["ReadWriteMany"]
    assert core.read_namespaced_secret("s", "ns").string_data == {"token": "t"}
    assert core.read_namespaced_config_map("cm", "ns").data == {"k": "v"}
    assert core.list_namespaced_event("ns").items[0].reason == "R"
    assert events_api.read_namespaced_event("e2", "ns").reason == "R"
    crds = kubernetes.client.ApiextensionsV1Api(api).list_custom_resource_definition()
    assert sorted(c.metadata.name for c in crds.items) == ["gadgets.example.com", "widgets.example.com"]


def test_register_crds_stores_the_crd_and_serves_its_resource(kube, crd_dir, http):
    crd = kube.get("customresourcedefinitions", "widgets.example.com")
    assert crd["spec"]["names"]["kind"] == "Widget"
    assert {c["type"]: c["status"] for c in crd["status"]["conditions"]} == {
        "NamesAccepted": "True",
        "Established": "True",
    }
    assert kube.emulator.spec("wd").plural == "widgets" and kube.emulator.spec("Gadget").namespaced is False
    again = kube.register_crds(crd_dir)  # idempotent: replaces, keeps serving
    assert sorted(s.plural for s in again) == ["gadgets", "widgets"]
    assert http.post(WIDGETS, json=widget("a")).status_code == 201


@pytest.mark.skipif(not (ROOT / "crds").is_dir(), reason="the project's CRDs are not generated yet")
def test_the_projects_crds_are_served_and_accept_the_example_manifest(tmp_path):
    with KubeServer(crds=ROOT / "crds") as kube:
        spec = kube.emulator.spec("rlr")
        assert (spec.group, spec.version, spec.kind, spec.namespaced, spec.status_subresource) == (
            "rlrun.dev",
            "v1alpha1",
            "RLRun",
            True,
            True,
        )
        manifest = yaml.safe_load((ROOT / "examples" / "reverse-text.yaml").read_text())
        created = kube.create("rlruns", manifest, "default")
        assert created["spec"]["model"] == manifest["spec"]["model"]


def test_a_crd_created_through_the_api_is_served_until_deleted(http):
    crd = json.loads(json.dumps(WIDGET_CRD).replace("widget", "sprocket").replace("Widget", "Sprocket"))
    assert http.post("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", json=crd).status_code == 201
    assert (
        http.post(
            "/apis/example.com/v1/namespaces/ns/sprockets", json={"metadata": {"name": "s"}, "spec": {"size": 1}}
        ).status_code
        == 201
    )
    assert (
        http.delete("/apis/apiextensions.k8s.io/v1/customresourcedefinitions/sprockets.example.com").status_code == 200
    )
    assert http.get("/apis/example.com/v1/namespaces/ns/sprockets").status_code == 404


# --- schemas --------------------------------------------------------------------------------------


def test_the_crd_schema_rejects_invalid_objects_with_422_naming_the_field(http):
    response = http.post(WIDGETS, json=widget("a", size=0))  # exclusiveMinimum: 0
    assert response.status_code == 422 and response.json()["reason"] == "Invalid"
    assert response.json()["details"]["causes"][0]["field"] == "spec.size"
    assert 'Widget.example.com "a" is invalid: spec.size' in response.json()["message"]
    missing = http.post(WIDGETS, json=widget("b") | {"spec": {"color": "red"}})
    assert missing.status_code == 422 and "'size' is a required property" in missing.json()["message"]
    http.post(WIDGETS, json=widget("c"))
    bad_patch = merge(http, f"{WIDGETS}/c", {"spec": {"color": "green"}})
    assert bad_patch.status_code == 422 and bad_patch.json()["details"]["causes"][0]["field"] == "spec.color"


def test_the_crd_schema_applies_defaults_and_prunes_unknown_fields(http):
    body = widget("a") | {"spec": {"size": 1, "bogus": 1, "extra": {"anything": [1]}}}
    response = http.post(WIDGETS, json=body)
    assert response.json()["spec"] == {"size": 1, "color": "red", "extra": {"anything": [1]}}
    assert 'unknown field \\"spec.bogus\\"' in response.headers["Warning"]
    strict = http.post(WIDGETS, params={"fieldValidation": "Strict"}, json=body | {"metadata": {"name": "b"}})
    assert strict.status_code == 400 and 'unknown field "spec.bogus"' in strict.json()["message"]


# --- the request log and user reactions -----------------------------------------------------------


def test_the_request_log_records_each_request_with_its_rbac_verb_and_status(kube, http):
    http.post(PODS, json=pod("p"))
    http.get(f"{PODS}/p")
    http.get(PODS)
    watch(http, PODS, 1)
    http.put(f"{PODS}/p", json=pod("p"))
    merge(http, f"{PODS}/p/status", {"status": {"phase": "Running"}})
    http.delete(f"{PODS}/p", params={"gracePeriodSeconds": "30"})
    http.delete(PODS)
    http.get(f"{PODS}/p")
    http.get("/apis")
    log = kube.requests
    assert [(r.verb, r.resource, r.subresource, r.namespace, r.name, r.status) for r in log[:-1]] == [
        ("create", "pods", None, "ns", None, 201),
        ("get", "pods", None, "ns", "p", 200),
        ("list", "pods", None, "ns", None, 200),
        ("watch", "pods", None, "ns", None, 200),
        ("update", "pods", None, "ns", "p", 200),
        ("patch", "pods", "status", "ns", "p", 200),
        ("delete", "pods", None, "ns", "p", 200),
        ("deletecollection", "pods", None, "ns", None, 200),
        ("get", "pods", None, "ns", "p", 404),
    ]
    assert (log[-1].verb, log[-1].resource, log[-1].path, log[-1].rbac) == ("get", None, "/apis", None)
    assert log[6].param("gracePeriodSeconds") == "30" and log[7].param("gracePeriodSeconds") is None
    assert ("", "pods/status", "patch") in kube.rbac_usage() and ("", "pods", "deletecollection") in kube.rbac_usage()
    assert all(r.group == "" and r.version == "v1" for r in log[:-1])


def test_kmock_reactions_still_take_precedence_over_the_emulation(kube, http):
    kube.emulator["post /api/v1/namespaces/ns/configmaps"] << 503
    assert http.post("/api/v1/namespaces/ns/configmaps", json={"metadata": {"name": "c"}}).status_code == 503
    assert kube.list("configmaps") == [] and kube.requests[-1].status == 503


# --- the runner -----------------------------------------------------------------------------------


def test_the_server_starts_fast_and_its_accessors_are_thread_safe():
    started = time.monotonic()
    with KubeServer() as kube:
        assert time.monotonic() - started < 0.5
        threads = [
            threading.Thread(
                target=lambda i=i: [
                    kube.create("configmaps", {"metadata": {"name": f"c{i}-{j}"}}, "ns") for j in range(20)
                ]
            )
            for i in range(5)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        versions = sorted(rv(c) for c in kube.list("configmaps"))
        assert versions == list(range(1, 101))
        with pytest.raises(ApiError) as error:
            kube.create("configmaps", {"metadata": {"name": "c0-0"}}, "ns")
        assert error.value.code == 409
    with pytest.raises(RuntimeError):
        kube.get("configmaps", "c0-0", "ns")


def test_stopping_the_server_ends_open_watches_at_once():
    kube = KubeServer().start()
    ended = threading.Event()

    def watch_forever() -> None:
        with httpx.Client(base_url=kube.url, timeout=5) as http:
            watch(http, "/api/v1/pods", 1, timeoutSeconds="60")
        ended.set()

    threading.Thread(target=watch_forever, daemon=True).start()
    while not any(r.verb == "watch" for r in kube.requests):
        time.sleep(0.01)
    started = time.monotonic()
    kube.stop()
    assert ended.wait(1) and time.monotonic() - started < 0.5


def test_the_kubeconfig_is_loadable_by_the_kubernetes_client(kube, tmp_path):
    config = kubernetes.client.Configuration()
    kubernetes.config.load_kube_config(
        config_file=str(kube.write_kubeconfig(tmp_path / "kc")), client_configuration=config
    )
    assert config.host == kube.url
    with kubernetes.client.ApiClient(config) as client:
        assert kubernetes.client.CoreV1Api(client).list_namespaced_pod("default").items == []


# --- kubectl --------------------------------------------------------------------------------------


def test_kubectl_applies_gets_watches_patches_status_and_deletes_a_custom_resource(kube, run_kubectl, tmp_path):
    manifest = tmp_path / "widget.yaml"
    manifest.write_text(yaml.safe_dump(widget("w1", size=3)))
    assert "widget.example.com/w1 created" in run_kubectl("apply", "--validate=false", "-f", str(manifest)).stdout
    assert "widget.example.com/w1 unchanged" in run_kubectl("apply", "--validate=false", "-f", str(manifest)).stdout
    assert re.search(r"^w1\s+\d+s$", run_kubectl("get", "widgets").stdout, re.M)
    listed = json.loads(run_kubectl("get", "wd", "-o", "json").stdout)
    assert [(i["kind"], i["metadata"]["name"], i["spec"]["size"]) for i in listed["items"]] == [("Widget", "w1", 3)]

    watcher = subprocess.Popen(
        run_kubectl.argv("get", "widgets", "-w", "--output-watch-events"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=run_kubectl.env,
    )
    guard = threading.Timer(15, watcher.kill)  # a line that never comes ends readline() instead of hanging
    guard.start()
    try:
        assert re.match(r"EVENT\s+NAME", watcher.stdout.readline())
        assert re.match(r"ADDED\s+w1", watcher.stdout.readline())
        patched = run_kubectl(
            "patch", "widget", "w1", "--subresource=status", "--type=merge", "-p", '{"status":{"phase":"Up"}}'
        )
        assert "widget.example.com/w1 patched" in patched.stdout
        assert re.match(r"MODIFIED\s+w1", watcher.stdout.readline())
        assert kube.get("widgets", "w1", "default")["status"] == {"phase": "Up"}
        assert 'widget.example.com "w1" deleted' in run_kubectl("delete", "widget", "w1").stdout
        assert re.match(r"DELETED\s+w1", watcher.stdout.readline())
    finally:
        guard.cancel()
        watcher.kill()
        watcher.wait()
    assert "No resources found" in run_kubectl("get", "widgets").stderr
    assert {r.status for r in kube.requests} <= {200, 201, 404}


def test_kubectl_discovers_every_served_resource(run_kubectl):
    resources = run_kubectl("api-resources", "--no-headers").stdout
    for line in (
        "widgets  wd  example.com/v1  true  Widget",
        "gadgets  example.com/v1  false  Gadget",
        "pods  po  v1  true  Pod",
    ):
        assert re.search(r"\s+".join(map(re.escape, line.split("  "))), resources), line


# --- kopf -----------------------------------------------------------------------------------------


def test_kopf_handles_a_created_object_once_and_not_again_after_a_restart(kube):
    registry = kopf.OperatorRegistry()
    created: list[str] = []
    deleted: list[str] = []

    @kopf.on.create("example.com", "v1", "widgets", registry=registry)
    def on_create(name, body, **_):
        created.append(name)
        kopf.info(body, reason="Seen", message=f"created {name}")

    @kopf.on.delete("example.com", "v1", "widgets", registry=registry)
    def on_delete(name, **_):
        deleted.append(name)

    kube.create("widgets", widget("before"), "ns")  # exists before the operator starts
    with KopfThread(registry, kube):
        wait_for(lambda: kube.get("widgets", "before", "ns")["metadata"].get("finalizers"))
        wait_for(
            lambda: (
                "kopf.zalando.org/last-handled-configuration"
                in kube.get("widgets", "before", "ns")["metadata"].get("annotations", {})
            )
        )
    assert created == ["before"]

    with KopfThread(registry, kube):
        kube.create("widgets", widget("during"), "ns")
        wait_for(lambda: created == ["before", "during"])
        kube.delete("widgets", "before", "ns")
        wait_for(lambda: kube.get("widgets", "before", "ns") is None)
    assert created == ["before", "during"] and deleted == ["before"]
    assert sorted(e["message"] for e in kube.list("events", "ns")) == ["created before", "created during"]
    assert [r for r in kube.requests if r.status >= 500] == []
    json_patches = [r.data for r in kube.emulator if r.headers.get("Content-Type") == "application/json-patch+json"]
    assert json_patches and all(ops[0]["op"] == "test" for ops in json_patches)  # kopf's finalizer add/remove
    assert {
        ("example.com", "widgets", "patch"),
        ("example.com", "widgets", "watch"),
        ("", "events", "create"),
    } <= kube.rbac_usage()


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
