"""The operator against the real orchestrator's control server (instant fake rollout endpoints behind it).

What the orchestrator pod would run — ``Orchestrator`` with the ConfigMap's manifest and
the Secret's token — runs here in a thread; the operator must find it ready for its
endpoints, fold its real ``/status`` into the RLRun, and suspend it with a real pause
that writes a complete checkpoint.
"""

from __future__ import annotations

import asyncio
import base64
import threading

import pytest
import yaml
from rlrun.checkpoint import latest_complete_checkpoint
from rlrun.manifest import parse_manifest
from rlrun.orchestrator.loop import Orchestrator
from rlrun.rundir import RunDir
from rlrun_operator import handlers

from tests.kube.conftest import NAMESPACE
from tests.support.manifests import manifest
from tests.support.orchestrators import make_orchestrator, trainer_start_part
from tests.support.polling import wait_for


class OrchestratorThread:
    """An :class:`Orchestrator` on its own event loop in a thread, as its pod would run it."""

    def __init__(self, orchestrator: Orchestrator) -> None:
        self.orchestrator = orchestrator
        self.loop = asyncio.new_event_loop()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            self.loop.run_until_complete(self.orchestrator.run())
        except BaseException as exc:
            self.error = exc

    def start(self) -> int:
        self.thread.start()
        wait_for(lambda: self.orchestrator.control.port != 0 or self.error, what="control server")
        assert self.error is None, self.error
        return self.orchestrator.control.port

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.orchestrator.request_stop)
        self.thread.join(10)


@pytest.fixture
def real_orchestrator(cluster, tmp_path, tiny_model, monkeypatch):
    spec = {"group_size": 4, "batch_size": 8, "max_steps": 50, "rollout": {"max_inflight": 16}}
    cluster.kube.create("rlruns", manifest(**spec), NAMESPACE)
    secret = wait_for(lambda: cluster.kube.get("secrets", "demo-control", NAMESPACE), what="Secret")
    configmap = wait_for(lambda: cluster.kube.get("configmaps", "demo-config", NAMESPACE), what="ConfigMap")
    run = parse_manifest(yaml.safe_load(configmap["data"]["rlrun.yaml"]))  # what every pod reads
    run_dir = RunDir(tmp_path / "run")
    trainer_start_part(run_dir, tiny_model)  # a pause pairs its snapshot with it
    token = base64.b64decode(secret["data"]["token"]).decode()
    # as in the pod: attempt 0, the endpoints come from the operator
    orchestrator = make_orchestrator(
        run.spec, run_dir, tiny_model, urls=[], attempt=0, poll_s=0.05, control_port=0, control_token=token
    )
    thread = OrchestratorThread(orchestrator)
    port = thread.start()
    url = f"http://127.0.0.1:{port}"
    settings = handlers.SETTINGS.model_copy(update={"orchestrator_url": url})
    monkeypatch.setattr(handlers, "SETTINGS", settings)
    monkeypatch.setattr(handlers.STATE.reconciler, "settings", settings)
    handlers.STATE.reconciler.controls.clients.clear()
    yield orchestrator
    thread.stop()
    assert thread.error is None, thread.error


def test_operator_drives_the_real_orchestrator(cluster, real_orchestrator):
    orchestrator = real_orchestrator
    assert orchestrator.phase == "starting"  # no endpoints yet: it waits for the operator
    cluster.run_orchestrator()
    cluster.set_pod_status(cluster.pod("rollout"), ip="10.0.0.7")
    wait_for(lambda: orchestrator.rollout_urls == ["http://10.0.0.7:8000"], what="endpoints sent")
    # no trainer here: flow control stops the orchestrator after 2 batches (v + 1 + k)
    wait_for(lambda: cluster.status().get("step") == 2, timeout=30, what="step 2 in the RLRun status")
    status = cluster.status()
    assert status["phase"] == "Running" and status["rolloutEndpoints"] == 1
    assert cluster.condition("Ready")["status"] == "True"
    cluster.kube.patch("rlruns", "demo", {"spec": {"suspend": True}}, NAMESPACE)
    wait_for(lambda: cluster.status().get("phase") == "Suspended", timeout=30, what="Suspended")
    assert orchestrator.phase == "paused" and cluster.pods() == []
    paused = orchestrator.last_pause
    assert f"{paused.queued_traces} queued traces" in cluster.condition("Ready")["message"]
    ckpt = latest_complete_checkpoint(orchestrator.run_dir)
    assert ckpt.step == 0 and ckpt.orchestrator["sink"]["pending_batch"]["count"] == paused.queued_traces
