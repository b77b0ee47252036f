"""The kube tier: the operator's handlers in real kopf against the API emulator; the emulator's own tests.

``cluster`` starts, per test (≈0.3 s), the API emulator serving the real CRD, fake orchestrators
and real kopf. The operator's handlers are the real
module (``rlrun_operator.handlers``, kopf's default registry); its status timer ticks
every 0.2 s here (``RLRUN_OPERATOR_STATUS_INTERVAL_SECONDS``, read when the module is
first imported — set before that by this conftest). Every (group, resource, verb) the
operator used is collected into :data:`RBAC_USAGE` for the RBAC proof.

The emulator's own tests (``test_emulator_*.py``) get ``kube`` (an emulator serving a small CRD of
their own, ``tests/support/emulator_objects.py``), ``http``, ``api`` and ``run_kubectl`` (clients of it).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

os.environ["RLRUN_OPERATOR_STATUS_INTERVAL_SECONDS"] = "0.2"

import httpx
import kopf
import kubernetes_validate
import pytest
import yaml
from rlrun.api.control import ExitReport
from rlrun_operator import handlers

from tests.support.binaries import kubectl
from tests.support.emulator_objects import GADGET_CRD, WIDGET_CRD
from tests.support.fake_orchestrator import FakeOrchestrators
from tests.support.kube import KopfThread, KubeServer
from tests.support.polling import wait_for

ROOT = Path(__file__).resolve().parents[2]
K8S_VERSION = kubernetes_validate.utils.latest_version()
NAMESPACE = "team-a"
#: (apiGroup, resource[/subresource], verb) the operator used in this test session: without Kueue, and with the
#: integration on (``tests/kube/test_kueue.py``'s ``kueue`` fixture), proven against the chart's two renderings.
RBAC_USAGE: set[tuple[str, str, str]] = set()
KUEUE_RBAC_USAGE: set[tuple[str, str, str]] = set()


@dataclass
class Cluster:
    """What an operator test works with."""

    kube: KubeServer
    orchestrators: FakeOrchestrators
    operator: KopfThread
    kubeconfig: Path
    #: whether this test's API calls count as the operator's in ``RBAC_USAGE`` (not when kubectl calls too)
    operator_only: bool = True
    #: the operator runs with its Kueue integration on (its calls count in ``KUEUE_RBAC_USAGE``)
    kueue: bool = False

    def rlrun(self, name: str = "demo", namespace: str = NAMESPACE) -> dict | None:
        return self.kube.get("rlruns", name, namespace)

    def pods(self, name: str = "demo", namespace: str = NAMESPACE) -> list[dict]:
        return self.kube.list("pods", namespace, label_selector=f"app.kubernetes.io/instance={name}")

    def pod(self, component: str, name: str = "demo", namespace: str = NAMESPACE, index: int = 0) -> dict:
        pods = [
            p for p in self.pods(name, namespace) if p["metadata"]["labels"]["app.kubernetes.io/component"] == component
        ]
        return sorted(pods, key=lambda p: p["metadata"]["name"])[index]

    def set_pod_status(self, pod: dict, phase: str = "Running", ready: bool = True, ip: str | None = None, **extra):
        """Do the kubelet's part: write a pod's phase, readiness and IP."""
        status = {
            "phase": phase,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            **({"podIP": ip} if ip else {}),
            **extra,
        }
        meta = pod["metadata"]
        self.kube.patch("pods", meta["name"], {"status": status}, meta["namespace"], subresource="status")

    def run_orchestrator(self, name: str = "demo", namespace: str = NAMESPACE) -> dict:
        """Do the kubelet's part for the orchestrator pod: Running and Ready (the operator calls a run
        Running only with a live orchestrator pod); returns the pod."""
        pod = self.pod("orchestrator", name, namespace)
        self.set_pod_status(pod, ip="10.0.0.2")
        return pod

    def exit_pod(self, pod: dict, outcome: str = "complete", code: int = 0, step: int = 100, **report) -> None:
        """The pod's container exits with ``code`` and an exit report (``ExitReport``) as its termination message."""
        component = pod["metadata"]["labels"]["app.kubernetes.io/component"]
        message = ExitReport(role=component, outcome=outcome, step=step, max_steps=100, **report).model_dump_json()
        terminated = {"exitCode": code, "reason": "Completed" if code == 0 else "Error", "message": message}
        statuses = [
            {
                "name": component,
                "state": {"terminated": terminated},
                "ready": False,
                "restartCount": 0,
                "image": pod["spec"]["containers"][0]["image"],
                "imageID": "",
            }
        ]
        phase = "Succeeded" if code == 0 else "Failed"
        self.set_pod_status(pod, phase=phase, ready=False, containerStatuses=statuses)

    def status(self, name: str = "demo", namespace: str = NAMESPACE) -> dict:
        return (self.rlrun(name, namespace) or {}).get("status") or {}

    def condition(self, type_: str, name: str = "demo", namespace: str = NAMESPACE) -> dict | None:
        return next((c for c in self.status(name, namespace).get("conditions", []) if c["type"] == type_), None)

    def wait_for_events(self, *reasons: str, namespace: str = NAMESPACE) -> list[dict]:
        """The namespace's Events once one of each ``reason`` is there (kopf posts them asynchronously)."""

        def events():
            found = self.kube.list("events", namespace)
            return found if set(reasons) <= {e.get("reason") for e in found} else None

        return wait_for(events, what=f"events {reasons}")

    def restart_operator(self) -> None:
        self.operator.stop()
        self.operator = KopfThread(kopf.get_default_registry(), self.kube).start()


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    with KubeServer(crds=ROOT / "crds") as kube, FakeOrchestrators() as orchestrators:
        kubeconfig = kube.write_kubeconfig(tmp_path / "kubeconfig", namespace=NAMESPACE)
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
        url = orchestrators.url_template
        monkeypatch.setattr(handlers, "SETTINGS", handlers.SETTINGS.model_copy(update={"orchestrator_url": url}))
        handlers.STATE.__init__()
        kube.create("namespaces", {"metadata": {"name": NAMESPACE}})
        operator = KopfThread(kopf.get_default_registry(), kube).start()
        c = Cluster(kube, orchestrators, operator, kubeconfig)
        try:
            yield c
            validate_created_objects(kube)
        finally:
            c.operator.stop()
            if c.operator_only:
                (KUEUE_RBAC_USAGE if c.kueue else RBAC_USAGE).update(kube.rbac_usage())


#: The Kueue fixture's flavor (a GPU pool: its node label and taint) and queues.
GPU_FLAVOR = "gpu-a"
GPU_POOL = {"pool": "gpu-a"}
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
LOCAL_QUEUE, CLUSTER_QUEUE = "team-q", "cq"


@pytest.fixture
def kueue_operator(monkeypatch):
    """The operator's Kueue integration on for one test (request it before ``cluster``, which starts the operator):
    ``handlers.SETTINGS`` (read by the reconciler ``cluster`` builds) and the Workload watch in kopf's registry,
    taken out again afterwards so the other tests run without Kueue, as the chart's default does."""
    monkeypatch.setattr(handlers, "SETTINGS", handlers.SETTINGS.model_copy(update={"kueue_enabled": True}))
    registry = kopf.get_default_registry()
    watching = list(registry._watching._handlers)  # kopf has no public way to unregister a handler
    handlers.watch_workloads(registry)
    yield
    registry._watching._handlers[:] = watching


@pytest.fixture
def kueue(kueue_operator, cluster):
    """Kueue's stand-in (``tests/support/kueue.py``) on the test's cluster, its controller running: the GPU flavor
    ``gpu-a`` (``GPU_POOL`` nodes, ``GPU_TOLERATION``), ClusterQueue ``cq`` (64 CPUs, 256 GiB, 8 GPUs) and
    LocalQueue ``team-q`` in the test namespace; the operator runs with the integration on."""
    from tests.support.kueue import KueueStandIn

    cluster.kueue = True
    standin = KueueStandIn(cluster.kube, NAMESPACE)
    standin.install()
    standin.flavor(GPU_FLAVOR, node_labels=GPU_POOL, tolerations=[GPU_TOLERATION])
    standin.cluster_queue(CLUSTER_QUEUE, {GPU_FLAVOR: {"cpu": "64", "memory": "256Gi", "nvidia.com/gpu": "8"}})
    standin.local_queue(LOCAL_QUEUE, CLUSTER_QUEUE)
    with standin:
        yield standin


def validate_object(obj: dict) -> None:
    """Kubernetes' own schema, strictly, on an object the operator created (its status is the kubelet's,
    written by the tests here, so it is left out)."""
    kubernetes_validate.validate({k: v for k, v in obj.items() if k != "status"}, K8S_VERSION, strict=True)


def validate_created_objects(kube: KubeServer) -> None:
    """Every object the operator created in a test passes Kubernetes' own schema, strictly."""
    for resource in ("persistentvolumeclaims", "secrets", "configmaps", "services", "pods"):
        for obj in kube.list(resource, label_selector="app.kubernetes.io/managed-by=rlrun-operator"):
            validate_object(obj)


# -- the emulator's own tests: a small CRD of their own, a running emulator, clients of it --------------


@pytest.fixture
def crd_dir(tmp_path: Path) -> Path:
    """A directory with the two CRDs above (one per file) and a non-CRD document that is skipped."""
    directory = tmp_path / "crds"
    directory.mkdir()
    (directory / "example.com_widgets.yaml").write_text(yaml.safe_dump(WIDGET_CRD))
    (directory / "example.com_gadgets.yaml").write_text(yaml.safe_dump(GADGET_CRD))
    (directory / "README.yaml").write_text(yaml.safe_dump({"kind": "ConfigMap", "metadata": {"name": "x"}}))
    return directory


@pytest.fixture
def kube(crd_dir: Path) -> Iterator[KubeServer]:
    with KubeServer(crds=crd_dir) as server:
        yield server


@pytest.fixture
def http(kube: KubeServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=kube.url, timeout=5) as client:
        yield client


@pytest.fixture
def api(kube: KubeServer):
    """A sync ``kubernetes`` ApiClient of the emulator."""
    with kube.api_client() as client:
        yield client


@pytest.fixture
def run_kubectl(kube: KubeServer, tmp_path: Path) -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run the real kubectl against the emulator (own kubeconfig, cache and HOME; ``$KUBECONFIG`` ignored)."""
    config = kube.write_kubeconfig(tmp_path / "kubeconfig")
    env = dict(os.environ, HOME=str(tmp_path), KUBECONFIG=str(config))

    def run(*args: str, check: bool = True, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        argv = [str(kubectl()), "--kubeconfig", str(config), "--cache-dir", str(tmp_path / "cache"), *args]
        result = subprocess.run(argv, input=stdin, capture_output=True, text=True, env=env, timeout=30, check=False)
        if check:
            assert result.returncode == 0, f"kubectl {' '.join(args)}: {result.stderr}"
        return result

    run.argv = lambda *args: [
        str(kubectl()),
        "--kubeconfig",
        str(config),
        "--cache-dir",
        str(tmp_path / "cache"),
        *args,
    ]  # type: ignore[attr-defined]
    run.env = env  # type: ignore[attr-defined]
    return run
