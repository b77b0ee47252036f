"""The operator image runs ``rlrun operator`` as the chart's Deployment does (its entrypoint, its user, settings
from the environment) against the test API server, and an RLRun applied there gets the pods the operator's
builders make on the host, from the same tree: what the kube tier proves of the operator holds for its image."""

from __future__ import annotations

import httpx
from rlrun.api.spec import RLRun
from rlrun.net import free_port
from rlrun_operator.pods import build_pods
from rlrun_operator.settings import OperatorSettings

from tests.support.images import CPU_IMAGE, CPU_ROLLOUT_IMAGE, OPERATOR_IMAGE, ROOT, Container, image_config, stop
from tests.support.kube import KubeServer
from tests.support.manifests import manifest
from tests.support.polling import wait_for

NAMESPACE = "team-a"


def get(url: str) -> httpx.Response | None:
    try:
        return httpx.get(url, timeout=1.0)
    except httpx.HTTPError:
        return None


def container_shape(pod: dict) -> list[tuple]:
    """What the kubelet would run: each container's name, image, command, args and mounts."""
    return [
        (c["name"], c["image"], c.get("command"), c.get("args"), c.get("volumeMounts"))
        for c in pod["spec"]["containers"]
    ]


def test_operator_image_reconciles_an_rlrun_into_the_pods_its_builders_make(images, tmp_path):
    config = image_config(OPERATOR_IMAGE)
    assert config["Entrypoint"] == ["rlrun", "operator"]
    env = {
        "RLRUN_OPERATOR_STATUS_INTERVAL_SECONDS": "0.5",
        # the chart's runImages: the CPU image serves every role
        "RLRUN_OPERATOR_TRAINER_IMAGE": CPU_IMAGE,
        "RLRUN_OPERATOR_ROLLOUT_IMAGE": CPU_ROLLOUT_IMAGE,
    }
    with KubeServer(crds=ROOT / "crds") as kube:
        kube.create("namespaces", {"metadata": {"name": NAMESPACE}})
        kubeconfig = kube.write_kubeconfig(tmp_path / "kubeconfig", namespace=NAMESPACE)
        health, metrics = free_port(), free_port()
        argv = [*config["Entrypoint"], "--namespace", NAMESPACE]
        argv += ["--health-port", str(health), "--metrics-port", str(metrics)]
        with Container(OPERATOR_IMAGE) as container:
            process = container.start(
                argv,
                log=tmp_path / "operator.log",
                env={**env, "KUBECONFIG": "/etc/rlrun-test/kubeconfig"},
                volumes=[(kubeconfig, "/etc/rlrun-test/kubeconfig", "ro")],
            )
            try:
                up = wait_for(
                    lambda: process.poll() is not None or ((r := get(f"http://127.0.0.1:{health}/healthz")) and r),
                    90,
                    "the operator's /healthz",
                )
                assert up is not True, (tmp_path / "operator.log").read_text()[-3000:]
                kube.create("rlruns", manifest(rollout={"replicas": 2}), NAMESPACE)
                pods = wait_for(lambda: len(p := kube.list("pods", NAMESPACE)) == 4 and p, 60, "4 pods")
                stored = kube.get("rlruns", "demo", NAMESPACE)
                scraped = get(f"http://127.0.0.1:{metrics}/metrics")
            finally:
                status = stop(process)
    log = (tmp_path / "operator.log").read_text()
    assert status == 0, log[-3000:]  # a clean exit on SIGTERM, as on a rollout of the Deployment

    expected = build_pods(stored, RLRun.model_validate(stored), OperatorSettings.from_env(env), attempt=0)
    by_name = {p["metadata"]["name"]: p for p in pods}
    assert (
        sorted(by_name)
        == sorted(p["metadata"]["name"] for p in expected)
        == [
            "demo-orchestrator-a0",
            "demo-rollout-0-a0",
            "demo-rollout-1-a0",
            "demo-trainer-a0",
        ]
    )
    for want in expected:
        got = by_name[want["metadata"]["name"]]
        assert container_shape(got) == container_shape(want)
        assert got["spec"]["volumes"] == want["spec"]["volumes"]
    images = {c["image"] for p in pods for c in p["spec"]["containers"]}
    assert images == {CPU_IMAGE, CPU_ROLLOUT_IMAGE}
    assert scraped is not None and 'rlrun_operator_reconciles_total{handler="create"} 1.0' in scraped.text
