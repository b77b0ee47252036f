"""``rlrun operator`` as its image runs it: a process that logs in through ``$KUBECONFIG``, serves
``/healthz`` and ``/metrics``, reconciles, and exits cleanly on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
from rlrun.net import free_port

from tests.kube.conftest import NAMESPACE, ROOT
from tests.support.kube import KubeServer
from tests.support.manifests import manifest
from tests.support.polling import wait_for


def get(url: str) -> httpx.Response | None:
    try:
        return httpx.get(url, timeout=1.0)
    except httpx.HTTPError:
        return None


def test_rlrun_operator_process_reconciles_and_serves_health_and_metrics(tmp_path):
    with KubeServer(crds=ROOT / "crds") as kube:
        kube.create("namespaces", {"metadata": {"name": NAMESPACE}})
        env = {
            **os.environ,
            "KUBECONFIG": str(kube.write_kubeconfig(tmp_path / "kubeconfig", namespace=NAMESPACE)),
            "RLRUN_OPERATOR_STATUS_INTERVAL_SECONDS": "0.5",
            "RLRUN_OPERATOR_TRAINER_IMAGE": "registry.example/trainer:9",
        }
        health, metrics = free_port(), free_port()
        argv = [sys.executable, "-m", "rlrun", "operator", "--namespace", NAMESPACE]
        argv += ["--health-port", str(health), "--metrics-port", str(metrics)]
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            wait_for(lambda: (r := get(f"http://127.0.0.1:{health}/healthz")) and r.status_code == 200, 30, "healthz")
            kube.create("rlruns", manifest(), NAMESPACE)
            pods = wait_for(lambda: len(p := kube.list("pods", NAMESPACE)) == 3 and p, 30, "pods")
            trainer = next(p for p in pods if p["metadata"]["name"] == "demo-trainer-a0")
            assert trainer["spec"]["containers"][0]["image"] == "registry.example/trainer:9"  # settings from the env

            def scraped():
                r = get(f"http://127.0.0.1:{metrics}/metrics")
                return r is not None and 'rlrun_operator_reconciles_total{handler="create"} 1.0' in r.text and r.text

            text = wait_for(scraped, 10, "metrics")
            assert 'rlrun_operator_runs{phase="Pending"}' in text or 'rlrun_operator_runs{phase="Running"}' in text
        finally:
            proc.send_signal(signal.SIGTERM)
            out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, out[-2000:]
