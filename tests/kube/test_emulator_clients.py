"""The Kubernetes API emulator driven by the real clients of the operator's world: the kubectl binary (apply,
get, watch, patch, delete, discovery) and kopf (an object handled once, not again after a restart)."""

from __future__ import annotations

import json
import re
import subprocess
import threading

import kopf
import yaml

from tests.support.emulator_objects import widget
from tests.support.kube import KopfThread
from tests.support.polling import wait_for

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
