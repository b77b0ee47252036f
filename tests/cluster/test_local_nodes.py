"""``LocalNodes`` plays kube-scheduler, the kubelets, the pod GC and cluster DNS against the API emulator.

Each test runs tiny real pods (a ``sh -c`` or ``python -c`` one-liner as the container) on fake
nodes and checks what a Kubernetes cluster would show: binding, pod IP, readiness, volumes at
their mount paths, exit codes and termination messages, graceful deletion, node loss with notice
and without, DNS, and a clean ``close()``.

Mount points are created under a directory of each test's own (``/var/lib/rlrun-kubelet-test-*``),
which the nodes must remove again on ``close()`` (checked after every test).
"""

from __future__ import annotations

import base64
import json
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from rlrun.net import free_port

from tests.support.kube import KubeServer
from tests.support.kubelet import LocalNodes
from tests.support.kubelet.containers import IMAGE_PATHS
from tests.support.kubelet.nodes import NODE_SHUTDOWN_MESSAGE, SPOT_TAINT
from tests.support.polling import wait_for
from tests.support.processes import alive

NS = "team-a"
PY = sys.executable
TIMEOUT = 15.0  # seconds; every wait below normally takes well under one

#: Serves 200 on /ready at ``--host``:``--port`` after ``--delay`` seconds; prints the address it binds.
SERVE = r"""
import http.server, sys, time
arg = lambda name: sys.argv[sys.argv.index(name) + 1]
host, port = arg("--host"), int(arg("--port"))
time.sleep(float(arg("--delay")))
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/ready" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass
server = http.server.HTTPServer((host, port), Handler)
print(host, flush=True)
server.serve_forever()
"""

#: Writes ``argv[1]`` + ".started" once its SIGTERM handler is in place; on SIGTERM waits 0.5 s,
#: writes "stopped" to ``argv[1]`` and exits 0.
TERM_EXITS_0 = r"""
import signal, sys, time
def stop(*_):
    time.sleep(0.5)
    with open(sys.argv[1], "w") as f:
        f.write("stopped")
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
open(sys.argv[1] + ".started", "w").close()
while True:
    time.sleep(0.05)
"""

#: Ignores SIGTERM; writes ``argv[1]`` once it does.
TERM_IGNORED = r"""
import signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
open(sys.argv[1], "w").close()
while True:
    time.sleep(0.05)
"""

#: Reports what the container sees: a ConfigMap key, whether its volume takes writes, ``/tmp``
#: (an emptyDir), env from a Secret and the pod IP; writes ``x`` into the claim at ``argv[2]``.
VOLUMES = r"""
import errno, json, os, sys
cfg, data, scratch = sys.argv[1:4]
seen = {"settings": open(cfg + "/settings.yaml").read()}
try:
    open(cfg + "/new", "w")
    seen["cfg_write"] = "ok"
except OSError as e:
    seen["cfg_write"] = errno.errorcode[e.errno]
with open(data + "/x", "w") as f:
    f.write("from writer")
with open("/tmp/" + scratch, "w") as f:
    f.write("scratch")
seen["tmp"] = sorted(os.listdir("/tmp"))
seen["token"], seen["ip"] = os.environ["TOKEN"], os.environ["POD_IP"]
with open(os.environ["MESSAGE"], "w") as f:
    f.write(json.dumps(seen))
"""


def wait(predicate: Callable[[], Any], what: str, timeout: float = TIMEOUT) -> Any:
    return wait_for(predicate, timeout, what, every=0.05)


def condition(pod: dict[str, Any], kind: str) -> dict[str, Any] | None:
    return next((c for c in (pod.get("status") or {}).get("conditions") or [] if c["type"] == kind), None)


class Cluster:
    """The API emulator and the fake nodes of one test, with pod helpers."""

    def __init__(self, kube: KubeServer, root: Path, mnt: Path) -> None:
        self.kube = kube
        self.root = root
        self.mnt = mnt  # this test's own mount points go under it
        self.nodes: LocalNodes | None = None

    def start(self, *names: str) -> LocalNodes:
        self.nodes = LocalNodes(self.kube, self.root, node_names=names or ("node-1", "node-2", "node-3")).start()
        return self.nodes

    def create_pod(self, name: str, command: list[str], labels: dict[str, str] | None = None, **extra: Any) -> None:
        """A one-container pod; ``extra`` goes into the container unless it is a pod spec field."""
        pod_fields = (
            "volumes",
            "terminationGracePeriodSeconds",
            "nodeSelector",
            "tolerations",
            "affinity",
            "hostname",
            "subdomain",
        )
        container: dict[str, Any] = {
            "name": "main",
            "image": "local",
            "command": command,
            "terminationMessagePath": f"{self.mnt}/termination-log",
        }
        spec: dict[str, Any] = {"containers": [container]}
        for key, value in extra.items():
            (spec if key in pod_fields else container)[key] = value
        body = {"metadata": {"name": name, "namespace": NS, "labels": labels or {}}, "spec": spec}
        self.kube.create("pods", body, NS)

    def pod(self, name: str) -> dict[str, Any] | None:
        return self.kube.get("pods", name, NS)

    def phase(self, name: str) -> str | None:
        pod = self.pod(name)
        return (pod.get("status") or {}).get("phase") if pod else None

    def wait_phase(self, name: str, phase: str) -> dict[str, Any]:
        wait(lambda: self.phase(name) == phase, f"pod {name} {phase}")
        pod = self.pod(name)
        assert pod is not None
        return pod

    def wait_gone(self, name: str) -> float:
        """Seconds until pod ``name`` is gone from the API."""
        t0 = time.monotonic()
        wait(lambda: self.pod(name) is None, f"pod {name} removed")
        return time.monotonic() - t0

    def terminated(self, name: str) -> dict[str, Any]:
        pod = self.pod(name)
        assert pod is not None
        return pod["status"]["containerStatuses"][0]["state"]["terminated"]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    mnt = Path("/var/lib") / f"rlrun-kubelet-test-{uuid.uuid4().hex[:12]}"
    assert not mnt.exists()
    with KubeServer() as kube:
        kube.create("namespaces", {"metadata": {"name": NS}})
        c = Cluster(kube, tmp_path / "nodes", mnt)
        try:
            yield c
        finally:
            if c.nodes is not None:
                c.nodes.close()
    assert not mnt.exists(), f"close() left {mnt} behind"


# -- scheduling and status ------------------------------------------------------------------------


def test_a_pod_is_bound_started_and_ready_at_once_without_a_probe(cluster):
    nodes = cluster.start()
    cluster.create_pod("p", ["sleep", "30"])
    pod = cluster.wait_phase("p", "Running")
    assert pod["spec"]["nodeName"] == "node-1"  # all idle: the first by name
    status = pod["status"]
    pid = nodes.pid("p")
    assert pid is not None and alive(pid)
    assert status["podIP"] == "127.0.10.2"  # the first address handed out
    assert status["podIPs"] == [{"ip": "127.0.10.2"}]
    assert status["hostIP"] == "127.0.0.1"
    assert [(c["type"], c["status"]) for c in status["conditions"]] == [
        ("PodScheduled", "True"),
        ("Initialized", "True"),
        ("ContainersReady", "True"),
        ("Ready", "True"),
    ]
    (cs,) = status["containerStatuses"]
    assert (cs["name"], cs["ready"], cs["started"], cs["restartCount"]) == ("main", True, True, 0)
    assert cs["containerID"] == f"local://{pid}"
    assert list(cs["state"]) == ["running"]
    assert nodes.pods_on("node-1") == ["p"]
    assert nodes.pods_on("node-2") == []


def test_pods_spread_over_the_least_loaded_nodes_with_distinct_ips(cluster):
    cluster.start("node-1", "node-2")
    for name in ("a", "b", "c"):
        cluster.create_pod(name, ["sleep", "30"])
    pods = {name: cluster.wait_phase(name, "Running") for name in ("a", "b", "c")}
    placed = {name: p["spec"]["nodeName"] for name, p in pods.items()}
    assert placed == {"a": "node-1", "b": "node-2", "c": "node-1"}  # fewest pods, then by name
    assert len({p["status"]["podIP"] for p in pods.values()}) == 3


def test_a_pod_that_fits_no_node_is_unschedulable(cluster):
    cluster.start("node-1")
    cluster.create_pod("p", ["sleep", "30"], nodeSelector={"accelerator": "h100"})
    wait(lambda: condition(cluster.pod("p"), "PodScheduled"), "PodScheduled")
    pod = cluster.pod("p")
    assert pod["status"]["phase"] == "Pending"
    assert condition(pod, "PodScheduled") == {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}
    time.sleep(0.3)
    assert "nodeName" not in cluster.pod("p")["spec"]


def test_a_readiness_probe_that_answers_makes_the_pod_ready(cluster):
    nodes = cluster.start("node-1")
    port = free_port()
    probe = {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 10}
    command = [PY, "-c", SERVE, "--host", "0.0.0.0", "--port", str(port), "--delay", "1"]
    cluster.create_pod("p", command, ports=[{"name": "http", "containerPort": port}], readinessProbe=probe)
    pod = cluster.wait_phase("p", "Running")
    assert condition(pod, "Ready")["status"] == "False"  # not serving yet
    assert pod["status"]["containerStatuses"][0]["ready"] is False
    wait(lambda: condition(cluster.pod("p"), "Ready")["status"] == "True", "Ready=True")
    pod = cluster.pod("p")
    assert condition(pod, "ContainersReady")["status"] == "True"
    assert pod["status"]["containerStatuses"][0]["ready"] is True
    # it bound the pod IP, not 0.0.0.0: the kubelet rewrote --host
    assert nodes.log_path("p").read_text() == f"{pod['status']['podIP']}\n"


# -- volumes and env ------------------------------------------------------------------------------


def test_volumes_appear_at_their_mount_paths_and_a_claim_is_shared(cluster, tmp_path):
    nodes = cluster.start("node-1")
    assert str(tmp_path).startswith("/tmp/")  # the volume sources sit under the emptyDir's mount path
    cluster.kube.create("configmaps", {"metadata": {"name": "cfg"}, "data": {"settings.yaml": "lr: 0.1\n"}}, NS)
    secret = {"metadata": {"name": "creds"}, "data": {"token": base64.b64encode(b"s3cret").decode()}}
    cluster.kube.create("secrets", secret, NS)
    cfg, data = f"{cluster.mnt}/etc/cfg", f"{cluster.mnt}/data"
    scratch = f"rlrun-scratch-{uuid.uuid4().hex[:8]}"
    volumes = [
        {"name": "cfg", "configMap": {"name": "cfg"}},
        {"name": "data", "persistentVolumeClaim": {"claimName": "shared"}},
        {"name": "tmp", "emptyDir": {}},
    ]
    mounts = [
        {"name": "cfg", "mountPath": cfg, "readOnly": True},
        {"name": "data", "mountPath": data},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    env = [
        {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "token"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "MESSAGE", "value": f"{cluster.mnt}/termination-log"},
    ]
    command = [PY, "-c", VOLUMES, cfg, data, scratch]
    cluster.create_pod("writer", command, volumes=volumes, volumeMounts=mounts, env=env)
    pod = cluster.wait_phase("writer", "Succeeded")
    seen = json.loads(cluster.terminated("writer")["message"])
    assert seen == {
        "settings": "lr: 0.1\n",
        "cfg_write": "EROFS",
        # a fresh emptyDir, not the host's /tmp; the image's mount point when the checkout is under /tmp
        "tmp": sorted([scratch, *{p.parts[2] for p in IMAGE_PATHS if p.parts[1] == "tmp"}]),
        "token": "s3cret",
        "ip": pod["status"]["podIP"],
    }
    assert (nodes.claim_dir(NS, "shared") / "x").read_text() == "from writer"
    assert (tmp_path / "nodes" / "pods" / "writer" / "volumes" / "tmp" / scratch).read_text() == "scratch"
    assert not Path("/tmp", scratch).exists()

    # a second pod mounts the same claim elsewhere and reads what the first wrote
    reader = f"{cluster.mnt}/shared"
    claim = [{"name": "data", "persistentVolumeClaim": {"claimName": "shared"}}]
    command = ["sh", "-c", f"cat {reader}/x > {cluster.mnt}/termination-log"]
    cluster.create_pod("reader", command, volumes=claim, volumeMounts=[{"name": "data", "mountPath": reader}])
    cluster.wait_phase("reader", "Succeeded")
    assert cluster.terminated("reader")["message"] == "from writer"


# -- exit codes and termination messages ----------------------------------------------------------


def test_a_failing_container_reports_its_exit_code_and_termination_message(cluster):
    nodes = cluster.start("node-1")
    script = 'printf "bad config: lr" > "$TERMINATION_LOG"; exit 3'
    env = [{"name": "TERMINATION_LOG", "value": "/dev/termination-log"}]
    cluster.create_pod("p", ["sh", "-c", script], env=env, terminationMessagePath="/dev/termination-log")
    pod = cluster.wait_phase("p", "Failed")
    terminated = pod["status"]["containerStatuses"][0]["state"]["terminated"]
    assert (terminated["exitCode"], terminated["reason"], terminated["message"]) == (3, "Error", "bad config: lr")
    assert condition(pod, "Ready")["status"] == "False"
    assert pod["status"]["containerStatuses"][0]["started"] is False
    assert nodes.pid("p") is None
    assert "reason" not in pod["status"]  # only a node shutdown sets the pod's reason


def test_fallback_to_logs_on_error_uses_the_log_tail(cluster):
    cluster.start("node-1")
    script = "echo first; echo second >&2; exit 1"
    cluster.create_pod("p", ["sh", "-c", script], terminationMessagePolicy="FallbackToLogsOnError")
    cluster.wait_phase("p", "Failed")
    terminated = cluster.terminated("p")
    assert (terminated["exitCode"], terminated["message"]) == (1, "first\nsecond")


def test_a_container_that_exits_0_succeeds_without_a_message(cluster):
    cluster.start("node-1")
    cluster.create_pod("p", ["sh", "-c", "echo done"], terminationMessagePolicy="FallbackToLogsOnError")
    pod = cluster.wait_phase("p", "Succeeded")
    terminated = cluster.terminated("p")
    assert (terminated["exitCode"], terminated["reason"]) == (0, "Completed")
    assert "message" not in terminated
    assert condition(pod, "Ready")["status"] == "False"


def test_a_container_killed_by_a_signal_exits_128_plus_its_number(cluster):
    cluster.start("node-1")
    cluster.create_pod("p", ["sh", "-c", "kill -9 $$"])
    cluster.wait_phase("p", "Failed")
    assert cluster.terminated("p")["exitCode"] == 137


# -- deletion -------------------------------------------------------------------------------------


def test_a_deleted_pod_is_removed_once_its_process_exited_on_sigterm(cluster, tmp_path):
    nodes = cluster.start("node-1")
    marker = tmp_path / "marker"
    cluster.create_pod("p", [PY, "-c", TERM_EXITS_0, str(marker)], terminationGracePeriodSeconds=5)
    cluster.wait_phase("p", "Running")
    wait(lambda: Path(f"{marker}.started").exists(), "the SIGTERM handler")
    pid = nodes.pid("p")
    assert pid is not None
    t0 = time.monotonic()
    cluster.kube.delete("pods", "p", NS)
    assert cluster.pod("p")["metadata"]["deletionGracePeriodSeconds"] == 5  # terminating, still there
    wait(lambda: cluster.pod("p") is None, "pod p removed")
    elapsed = time.monotonic() - t0
    assert marker.read_text() == "stopped"  # the handler ran to its end before the pod went
    assert not alive(pid)
    assert 0.5 <= elapsed < 4.0, elapsed  # the handler's 0.5 s, not the 5 s grace
    assert any(what == "pod p SIGTERM (deletion, grace 5 s)" for _, what in nodes.timeline)
    assert not any("SIGKILL" in what for _, what in nodes.timeline)


def test_a_process_ignoring_sigterm_is_killed_when_the_grace_period_ends(cluster, tmp_path):
    nodes = cluster.start("node-1")
    started = tmp_path / "started"
    cluster.create_pod("p", [PY, "-c", TERM_IGNORED, str(started)], terminationGracePeriodSeconds=1)
    cluster.wait_phase("p", "Running")
    wait(started.exists, "SIGTERM ignored")
    pid = nodes.pid("p")
    assert pid is not None
    t0 = time.monotonic()
    cluster.kube.delete("pods", "p", NS)
    time.sleep(0.5)
    assert alive(pid) and cluster.pod("p") is not None  # SIGTERM did nothing, the grace is not over
    wait(lambda: cluster.pod("p") is None, "pod p removed")
    elapsed = time.monotonic() - t0
    assert 1.0 <= elapsed < 4.0, elapsed
    assert not alive(pid)
    assert any(what == "pod p SIGKILL (grace over)" for _, what in nodes.timeline)


def test_children_of_a_deleted_pod_do_not_survive_it(cluster, tmp_path):
    cluster.start("node-1")
    pids = tmp_path / "pids"
    # SIGTERM reaches the main process only (as PID 1's stop signal): its children, one ignoring SIGTERM, go
    # when the runtime stops what the exited main process left behind
    script = f'sleep 300 & echo $! > {pids}; (trap "" TERM; exec sleep 301) & echo $! >> {pids}; wait'
    cluster.create_pod("p", ["sh", "-c", script], terminationGracePeriodSeconds=30)
    cluster.wait_phase("p", "Running")
    wait(lambda: pids.exists() and len(pids.read_text().split()) == 2, "both children started")
    children = [int(pid) for pid in pids.read_text().split()]
    assert [psutil.Process(pid).cmdline() for pid in children] == [["sleep", "300"], ["sleep", "301"]]
    cluster.kube.delete("pods", "p", NS)
    elapsed = cluster.wait_gone("p")
    assert elapsed < 4.0  # the main process exited on SIGTERM: no waiting for the 30 s grace
    assert alive(children) == []


# -- node loss ------------------------------------------------------------------------------------


def test_a_preempted_node_is_tainted_and_its_pods_stopped_after_the_notice(cluster, tmp_path):
    nodes = cluster.start("node-1", "node-2")
    for name in ("a", "b"):  # a lands on node-1, b on node-2
        cluster.create_pod(name, [PY, "-c", TERM_EXITS_0, str(tmp_path / name)], terminationGracePeriodSeconds=10)
    pods = {name: cluster.wait_phase(name, "Running") for name in ("a", "b")}
    assert {name: p["spec"]["nodeName"] for name, p in pods.items()} == {"a": "node-1", "b": "node-2"}
    wait(lambda: all((tmp_path / f"{name}.started").exists() for name in ("a", "b")), "SIGTERM handlers")
    pid_a, pid_b = nodes.pid("a"), nodes.pid("b")

    t0 = time.monotonic()
    nodes.preempt_node("node-1", notice_seconds=0.5)
    taints = cluster.kube.get("nodes", "node-1")["spec"]["taints"]
    assert [(t["key"], t["effect"]) for t in taints] == [(SPOT_TAINT, "NoSchedule")]
    disruption = condition(cluster.pod("a"), "DisruptionTarget")
    assert (disruption["status"], disruption["reason"]) == ("True", "TerminationByKubelet")
    assert cluster.phase("a") == "Running" and alive(pid_a)  # the notice is not over yet

    pod = cluster.wait_phase("a", "Failed")
    assert time.monotonic() - t0 >= 0.5
    assert (tmp_path / "a").read_text() == "stopped"  # it got SIGTERM and stopped on its own
    assert (pod["status"]["reason"], pod["status"]["message"]) == ("Terminated", NODE_SHUTDOWN_MESSAGE)
    assert cluster.terminated("a")["exitCode"] == 0  # exit 0, and still Failed: the node shut it down
    assert not alive(pid_a)

    # the other node's pod is untouched
    b = cluster.pod("b")
    assert b["status"]["phase"] == "Running"
    assert condition(b, "DisruptionTarget") is None
    assert alive(pid_b) and not (tmp_path / "b").exists()

    # the tainted node takes no new pod, even though it is now the least loaded
    cluster.create_pod("c", ["sleep", "30"])
    assert cluster.wait_phase("c", "Running")["spec"]["nodeName"] == "node-2"
    assert nodes.pods_on("node-2") == ["b", "c"]


def test_a_crashed_node_kills_its_processes_at_once_and_its_pods_are_collected(cluster):
    nodes = cluster.start("node-1", "node-2")
    for name in ("a", "b"):
        cluster.create_pod(name, ["sleep", "30"])
    pods = {name: cluster.wait_phase(name, "Running") for name in ("a", "b")}
    assert {name: p["spec"]["nodeName"] for name, p in pods.items()} == {"a": "node-1", "b": "node-2"}
    pid_a, pid_b = nodes.pid("a"), nodes.pid("b")

    t0 = time.monotonic()
    nodes.crash_node("node-1", gone_after_seconds=0.5)
    assert not alive(pid_a)
    node = cluster.kube.get("nodes", "node-1")
    ready = condition(node, "Ready")
    assert (ready["status"], ready["reason"]) == ("Unknown", "NodeStatusUnknown")
    assert [(t["key"], t["effect"]) for t in node["spec"]["taints"]] == [
        ("node.kubernetes.io/unreachable", "NoExecute")
    ]
    assert cluster.phase("a") == "Running"  # a dead kubelet reports nothing

    wait(lambda: cluster.kube.get("nodes", "node-1") is None, "node-1 deleted")
    cluster.wait_gone("a")
    assert time.monotonic() - t0 >= 0.5
    assert any(what == "pod a deleted by pod GC" for _, what in nodes.timeline)
    assert cluster.phase("b") == "Running" and alive(pid_b)
    assert [n["metadata"]["name"] for n in cluster.kube.list("nodes")] == ["node-2"]


# -- cluster DNS ----------------------------------------------------------------------------------


def test_a_service_resolves_to_its_ready_pod_and_stops_when_the_pod_is_deleted(cluster):
    nodes = cluster.start("node-1")
    host_file = Path("/etc/hosts").read_text().rstrip("\n") + "\n"
    port = free_port()
    service = {"selector": {"app": "orch"}, "ports": [{"name": "http", "port": port, "targetPort": port}]}
    cluster.kube.create("services", {"metadata": {"name": "orch"}, "spec": service}, NS)
    probe = {"httpGet": {"path": "/ready", "port": port}}
    command = [PY, "-c", SERVE, "--host", "0.0.0.0", "--port", str(port), "--delay", "0.5"]
    cluster.create_pod("orch-0", command, labels={"app": "orch"}, readinessProbe=probe)
    cluster.create_pod("other", ["sleep", "30"], labels={"app": "other"})
    pod = cluster.wait_phase("orch-0", "Running")
    assert condition(pod, "Ready")["status"] == "False"
    assert nodes.hosts_path.read_text() == Path("/etc/hosts").read_text()  # not Ready: not resolved

    line = f"{pod['status']['podIP']}\torch.{NS}.svc orch.{NS}.svc.cluster.local"
    wait(lambda: line in nodes.hosts_path.read_text().splitlines(), "the DNS entry")
    assert nodes.hosts_path.read_text() == host_file + line + "\n"

    cluster.kube.delete("pods", "orch-0", NS)
    wait(lambda: line not in nodes.hosts_path.read_text(), "the DNS entry removed")
    assert nodes.hosts_path.read_text() == host_file


def test_a_pod_with_hostname_and_subdomain_resolves_under_its_headless_service_in_other_pods(cluster):
    nodes = cluster.start("node-1")
    port = free_port()
    headless = {
        "clusterIP": "None",
        "publishNotReadyAddresses": True,
        "selector": {"app": "w"},
        "ports": [{"port": port}],
    }
    cluster.kube.create("services", {"metadata": {"name": "workers"}, "spec": headless}, NS)
    never_ready = {"httpGet": {"path": "/ready", "port": port}}
    cluster.create_pod(
        "w-0", ["sleep", "30"], labels={"app": "w"}, hostname="w-0", subdomain="workers", readinessProbe=never_ready
    )
    cluster.create_pod("stray", ["sleep", "30"], labels={"app": "x"}, hostname="stray", subdomain="workers")
    # w-1 looks its peer up as a pod does: through its own /etc/hosts
    lookup = f"until getent hosts w-0.workers.{NS}.svc > {cluster.mnt}/termination-log; do sleep 0.1; done"
    cluster.create_pod("w-1", ["sh", "-c", lookup], labels={"app": "w"}, hostname="w-1", subdomain="workers")
    cluster.wait_phase("w-1", "Succeeded")
    ip = cluster.pod("w-0")["status"]["podIP"]
    name = f"w-0.workers.{NS}.svc"
    assert cluster.terminated("w-1")["message"].split() == [ip, name, f"{name}.cluster.local"]  # not Ready: published
    # w-1 ended, stray is not selected, no Ready pod for the Service's own name: w-0's record only
    host_file = Path("/etc/hosts").read_text().rstrip("\n") + "\n"
    wait(lambda: nodes.hosts_path.read_text() == f"{host_file}{ip}\t{name} {name}.cluster.local\n", "w-0's record only")
    cluster.kube.delete("pods", "w-0", NS)
    wait(lambda: nodes.hosts_path.read_text() == host_file, "the record removed")


def test_a_service_whose_port_is_not_its_target_port_fails_the_nodes(cluster):
    nodes = cluster.start("node-1")
    service = {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8080}]}
    cluster.kube.create("services", {"metadata": {"name": "web"}, "spec": service}, NS)
    cluster.create_pod("web-0", ["sleep", "30"], labels={"app": "web"})
    wait(lambda: nodes.error is not None, "the loop's error")
    assert str(nodes.error) == "service web: port 80 ≠ target 8080"
    cluster.nodes = None
    with pytest.raises(RuntimeError, match="the local nodes' loop failed"):
        nodes.close()


# -- close ----------------------------------------------------------------------------------------


def test_close_kills_every_process_and_removes_the_mount_points_it_created(cluster, tmp_path):
    nodes = cluster.start("node-1", "node-2")
    pids = tmp_path / "pids"
    deep = f"{cluster.mnt}/a/b/c"
    script = (
        f"sleep 300 & echo $! > {pids}; exec {PY} -c "
        "'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)'"
    )
    volumes = [{"name": "scratch", "emptyDir": {}}]
    cluster.create_pod(
        "p", ["sh", "-c", script], volumes=volumes, volumeMounts=[{"name": "scratch", "mountPath": deep}]
    )
    cluster.create_pod("q", ["sleep", "300"])
    cluster.wait_phase("p", "Running")
    cluster.wait_phase("q", "Running")
    wait(lambda: pids.exists() and pids.read_text().strip(), "the child started")
    tracked = [nodes.pid("p"), nodes.pid("q"), int(pids.read_text())]
    assert len(alive(tracked)) == len(tracked)
    assert Path(deep).is_dir() and Path(f"{cluster.mnt}/termination-log").is_file()

    cluster.nodes = None
    nodes.close()
    assert alive(tracked) == []
    assert not cluster.mnt.exists()
