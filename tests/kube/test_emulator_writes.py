"""The Kubernetes API emulator's writes behave as an API server's: one global resource version, the metadata
the server fills in, the status subresource, deletion with finalizers, garbage collection and namespaces.

Each test names one API-server guarantee the operator's tests lean on and checks it through a real client (raw
HTTP or the sync ``kubernetes`` client); the objects and helpers are ``tests/support/emulator_objects.py``.
"""

from __future__ import annotations

import re
import uuid

import kubernetes.client
import kubernetes.config
import kubernetes.watch

from tests.support.emulator_objects import PODS, WIDGETS, merge, pod, rv, watch, widget

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
