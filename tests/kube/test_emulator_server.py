"""The Kubernetes API emulator as a server: what it serves (the core resources, CRDs from files or the API,
the project's own CRDs), schema validation and defaults, the request log in RBAC terms and kmock's reactions,
and its runner (``KubeServer``: fast start, thread-safe accessors, a loadable kubeconfig)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import kubernetes.client
import kubernetes.config
import kubernetes.watch
import pytest
import yaml

from tests.support.emulator_objects import PODS, ROOT, WIDGET_CRD, WIDGETS, merge, pod, rv, watch, widget
from tests.support.kube import ApiError, KubeServer

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
