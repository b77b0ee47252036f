"""``LocalNodes``: the scheduler, the kubelets, the pod garbage collector and cluster DNS of a few fake nodes.

One thread looks at the API emulator every ``TICK_SECONDS`` and plays, for the fake nodes
it created:

- **the scheduler**: a pending pod gets the least-loaded node it fits (``scheduling``);
  none fits: ``PodScheduled=False`` ``Unschedulable``.
- **the kubelet** of each node that is up: a bound pod's container runs as a real process
  (``containers``) with its own loopback IP ``127.0.10.N`` as ``status.podIP`` (the whole
  ``127.0.0.0/8`` routes to ``lo`` on Linux, so no address is added to the host); its status
  follows the process (``Running``; ``Ready`` once its readiness probe, tried every
  ``PROBE_SECONDS`` rather than its ``periodSeconds``, answers 2xx, or at once without a probe;
  ``Succeeded``/``Failed`` with the exit code, reason and termination message). A deleted pod's
  main process gets SIGTERM (once, as a container runtime sends the stop signal to PID 1), its
  whole process tree SIGKILL once ``deletionGracePeriodSeconds`` are over, and the pod is removed
  only then (the kubelet's grace-0 ``DELETE``).
- **the pod garbage collector**: a pod bound to a node that no longer exists is force-deleted.
- **cluster DNS**: ``hosts_path`` (an ``/etc/hosts`` every pod gets bind-mounted at ``/etc/hosts``,
  as the kubelet manages a pod's ``/etc/hosts``; kept in place, so a rewrite reaches every pod)
  holds, each also under ``.cluster.local``:

  - ``<service>.<namespace>.svc`` → the IP of the first Ready, non-terminating pod the Service
    selects (a headless Service, in effect: the Service's ``port`` must equal its ``targetPort``'s
    number, which is checked);
  - ``<hostname>.<subdomain>.<namespace>.svc`` → the IP of a pod with ``spec.hostname`` and
    ``spec.subdomain`` when a headless Service (``clusterIP: None``) named ``<subdomain>`` in its
    namespace selects it: Kubernetes' pod DNS record, for a Ready pod or, with
    ``publishNotReadyAddresses``, any running one; never a terminating or ended one.

  Every pod shares the host's name (no UTS namespace): a process resolving its own host name (gloo
  picking its interface) gets the host's address, which reaches every pod as well.

A node is lost **with notice** (``preempt_node``: a spot interruption handled by graceful node
shutdown — the node is tainted, its pods get ``DisruptionTarget=True``
``TerminationByKubelet``, after the notice window their main processes get SIGTERM (not those
already stopping: a runtime sends a container its stop signal once) and, after their grace period,
SIGKILL, and they end ``Failed`` with reason ``Terminated``; then the node goes) or
**abruptly** (``crash_node``: every process on it is SIGKILLed at once, the kubelet stops
answering, the node turns ``Ready=Unknown`` with the ``unreachable`` taint, and it is deleted
after a delay). What happens when is appended to ``timeline`` (wall-clock seconds, text).

What it does to the host: it creates the mount points the pods need that are missing
(directories such as ``/var/lib/rlrun`` and ``/etc/rlrun``, the empty file
``/dev/termination-log``) and removes them in ``close()``; everything else is under
``root`` (removed by the caller). Mounts exist only inside each pod's mount namespace. Run one
``LocalNodes`` per host at a time (pytest runs tests one after another): Linux detaches a
directory's mounts in every namespace when the directory is removed, so one session's
``close()`` would pull the volumes out from under another session's pods.
``close()`` kills every process it started and raises if one survived.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import ipaddress
import itertools
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.support.kube import ApiError, KubeServer, label_matcher

from .containers import IMAGE_PATHS, ContainerProcess, Mount, pod_argv, pod_env
from .scheduling import choose_node

log = logging.getLogger(__name__)

TICK_SECONDS = 0.1
#: Pods get 127.0.10.2, .3, … (never reused within a ``LocalNodes``; 127.0.0.1 is the API server's).
FIRST_POD_IP = ipaddress.IPv4Address("127.0.10.2")
PROBE_SECONDS = 0.5
#: The termination taint a spot notice puts on its node (the AWS Node Termination Handler's).
SPOT_TAINT = "aws-node-termination-handler/spot-itn"
#: How long a graceful node shutdown lets pods stop (the kubelet's ``shutdownGracePeriod``), seconds.
SHUTDOWN_GRACE_SECONDS = 30.0
NODE_SHUTDOWN_MESSAGE = "Pod was terminated in response to imminent node shutdown."


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class PodRun:
    """What one kubelet knows about one of its pods."""

    namespace: str
    name: str
    uid: str
    node: str
    ip: str
    container: ContainerProcess
    probe: dict[str, Any] | None
    started_at: str
    ready: bool = False
    failures: int = 0
    next_probe: float = 0.0
    kill_at: float | None = None
    exit_code: int | None = None
    disruption: dict[str, Any] | None = None
    shutdown: bool = False
    removed: bool = False


@dataclass
class Node:
    name: str
    up: bool = True
    shutdown_at: float | None = None
    delete_at: float | None = None


@dataclass
class LocalNodes:
    """The scheduler, kubelets, pod GC and DNS of ``node_names`` against ``kube`` (see the module docstring).

    Attributes:
        root: where volumes, pod files and logs go (``root/pods/<pod>/``, ``root/claims/<ns>/<claim>/``).
        image_env: what the "image" sets in every container's environment, as a Dockerfile's ``ENV`` does
            (the pod's ``env`` wins); e.g. ``RLRUN_FAKE_ROLLOUT=1`` makes every ``rlrun rollout`` the fake server.
        timeline: ``(time.time(), what)`` of everything the nodes did or saw, in order (wall clock, so it
            lines up with the run's own timestamps, e.g. ``metrics.jsonl``'s ``time``).
    """

    kube: KubeServer
    root: Path
    node_names: tuple[str, ...] = ("node-1", "node-2", "node-3")
    #: Environment the "image" sets in every container (a Dockerfile's ``ENV``), under the pod's own ``env``.
    image_env: dict[str, str] = field(default_factory=dict)
    timeline: list[tuple[float, str]] = field(default_factory=list)
    nodes: dict[str, Node] = field(default_factory=dict, init=False)
    runs: dict[str, PodRun] = field(default_factory=dict, init=False)  # by pod uid
    _ips: itertools.count = field(default_factory=itertools.count, init=False)
    _lock: threading.RLock = field(default_factory=threading.RLock, init=False)
    _stop: threading.Event = field(default_factory=threading.Event, init=False)
    _thread: threading.Thread | None = field(default=None, init=False)
    _created_paths: list[Path] = field(default_factory=list, init=False)
    _hosts_text: str = field(default="", init=False)
    _unschedulable: set[str] = field(default_factory=set, init=False)
    error: BaseException | None = field(default=None, init=False)

    @property
    def hosts_path(self) -> Path:
        """The cluster DNS file (``/etc/hosts`` format) a process can bind-mount at ``/etc/hosts``."""
        return self.root / "hosts"

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> LocalNodes:
        """Create the Node objects and start the loop (returns at once)."""
        self.root.mkdir(parents=True, exist_ok=True)
        self.hosts_path.write_text(Path("/etc/hosts").read_text())
        self._hosts_text = self.hosts_path.read_text()
        for name in self.node_names:
            self.add_node(name)
        self._thread = threading.Thread(target=self._loop, name="local-nodes", daemon=True)
        self._thread.start()
        return self

    def add_node(self, name: str) -> None:
        """A new Ready node ``name`` (labels ``kubernetes.io/hostname``, ``node.kubernetes.io/instance-type``)."""
        with self._lock:
            self.nodes[name] = Node(name)
            labels = {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux"}
            status = {"conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}]}
            self.kube.create("nodes", {"metadata": {"name": name, "labels": labels}, "spec": {}})
            self.kube.patch("nodes", name, {"status": status}, subresource="status")  # create drops status
            self.note(f"node {name} up")

    def close(self) -> None:
        """Stop the loop, kill every pod process, remove the mount points it created.

        Raises:
            RuntimeError: a process it started is still alive, or the loop failed (chained).
        """
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        survivors: list[int] = []
        for run in self.runs.values():
            run.container.kill()
        for run in self.runs.values():
            survivors += run.container.alive_tree()
        for path in reversed(self._created_paths):
            with contextlib.suppress(OSError):
                path.rmdir() if path.is_dir() else path.unlink()
        if survivors:
            raise RuntimeError(f"pod processes outlived the cluster: {survivors}")
        if self.error is not None:
            raise RuntimeError("the local nodes' loop failed") from self.error

    def __enter__(self) -> LocalNodes:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ what tests do to nodes
    def preempt_node(self, name: str, notice_seconds: float = 10.0, taint: str = SPOT_TAINT) -> None:
        """A spot interruption of node ``name``: taint now, pods' ``DisruptionTarget`` now, shutdown after
        ``notice_seconds`` (see the module docstring), then the node is deleted."""
        with self._lock:
            node = self.nodes[name]
            self._add_taints(name, [{"key": taint, "effect": "NoSchedule"}])
            for run in self._runs_on(name):
                run.disruption = {
                    "type": "DisruptionTarget",
                    "status": "True",
                    "reason": "TerminationByKubelet",
                    "message": "Pod was terminated in response to imminent node shutdown.",
                    "lastTransitionTime": _now(),
                }
                self._write_status(run)
            node.shutdown_at = time.monotonic() + notice_seconds
            self.note(f"notice node {name}")

    def crash_node(self, name: str, gone_after_seconds: float = 5.0) -> None:
        """Node ``name`` dies at once: SIGKILL to every process on it, its kubelet stops, the node turns
        ``Ready=Unknown`` with the ``unreachable`` taint, and it is deleted ``gone_after_seconds`` later."""
        with self._lock:
            node = self.nodes[name]
            node.up = False
            for run in self._runs_on(name):
                run.container.kill()
            self.note(f"crash node {name}")
            self._node_not_ready(name, "NodeStatusUnknown", "Kubelet stopped posting node status.")
            self._add_taints(name, [{"key": "node.kubernetes.io/unreachable", "effect": "NoExecute"}])
            node.delete_at = time.monotonic() + gone_after_seconds

    def pods_on(self, name: str) -> list[str]:
        """Names of the pods running (or stopping) on node ``name``."""
        with self._lock:
            return [r.name for r in self._runs_on(name)]

    def pid(self, pod: str) -> int | None:
        """pid of pod ``pod``'s live container process, or None."""
        with self._lock:
            return next((r.container.pid for r in self.runs.values() if r.name == pod and r.exit_code is None), None)

    def claim_dir(self, namespace: str, claim: str) -> Path:
        """The host directory behind PersistentVolumeClaim ``claim`` (provisioned on first use)."""
        path = self.root / "claims" / namespace / claim
        path.mkdir(parents=True, exist_ok=True)
        return path

    def log_path(self, pod: str) -> Path:
        """The container log (stdout and stderr) of pod ``pod``."""
        return self.root / "pods" / pod / "container.log"

    # ------------------------------------------------------------------ the loop
    def note(self, what: str) -> None:
        """Append ``what`` to the timeline, now."""
        self.timeline.append((time.time(), what))
        log.info("local nodes: %s", what)

    def _loop(self) -> None:
        while not self._stop.wait(TICK_SECONDS):
            try:
                with self._lock:
                    self._tick()
            except Exception as exc:  # the tests see it from close()
                log.exception("local nodes: tick failed")
                self.error = exc
                return

    def _tick(self) -> None:
        now = time.monotonic()
        for node in self.nodes.values():
            if node.shutdown_at is not None and now >= node.shutdown_at and node.up:
                self._shut_down(node)
            if node.delete_at is not None and now >= node.delete_at:
                node.delete_at = None
                with contextlib.suppress(ApiError):
                    self.kube.delete("nodes", node.name)
                self.note(f"node {node.name} deleted")
        node_objs = {n["metadata"]["name"]: n for n in self.kube.list("nodes")}
        pods = self.kube.list("pods")
        load: dict[str, int] = {}  # pods per node, kept current as this tick binds more
        for p in pods:
            if p["spec"].get("nodeName") and (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed"):
                load[p["spec"]["nodeName"]] = load.get(p["spec"]["nodeName"], 0) + 1
        by_uid = {p["metadata"]["uid"]: p for p in pods}
        for pod in pods:
            node = pod["spec"].get("nodeName")
            if node is None:
                self._schedule(pod, node_objs, load)
            elif node not in node_objs:  # pod GC: orphaned by a deleted node
                with contextlib.suppress(ApiError):
                    self.kube.delete(
                        "pods", pod["metadata"]["name"], pod["metadata"]["namespace"], {"gracePeriodSeconds": 0}
                    )
                self.note(f"pod {pod['metadata']['name']} deleted by pod GC")
            elif self.nodes.get(node) and self.nodes[node].up and pod["metadata"]["uid"] not in self.runs:
                self._start(pod)
        for uid, run in list(self.runs.items()):
            if run.removed:
                continue
            pod = by_uid.get(uid)
            if pod is None:  # gone from the API (force-deleted): stop what still runs
                run.container.kill()
                run.removed = True
                continue
            if not self.nodes[run.node].up:
                continue  # a dead kubelet writes nothing and finishes nothing
            self._sync(run, pod, now)
        self._write_hosts(pods)

    # ------------------------------------------------------------------ scheduler
    def _schedule(self, pod: dict[str, Any], node_objs: dict[str, Any], load: dict[str, int]) -> None:
        meta = pod["metadata"]
        if meta.get("deletionTimestamp"):
            return
        ours = [n for name, n in node_objs.items() if name in self.nodes]
        chosen = choose_node(pod, ours, load)
        key = meta["uid"]
        if chosen is None:
            if key not in self._unschedulable:
                self._unschedulable.add(key)
                cond = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}
                self._patch_status(pod, {"phase": "Pending", "conditions": [cond]})
                self.note(f"pod {meta['name']} unschedulable")
            return
        self.kube.patch("pods", meta["name"], {"spec": {"nodeName": chosen}}, meta["namespace"])
        load[chosen] = load.get(chosen, 0) + 1
        cond = {"type": "PodScheduled", "status": "True", "lastTransitionTime": _now()}
        self._patch_status(pod, {"phase": "Pending", "conditions": [cond]})
        self.note(f"pod {meta['name']} bound to {chosen}")

    # ------------------------------------------------------------------ kubelet
    def _start(self, pod: dict[str, Any]) -> None:
        meta, spec = pod["metadata"], pod["spec"]
        if meta.get("deletionTimestamp"):  # deleted before it ever started: nothing to stop
            self._finish_deletion(meta["namespace"], meta["name"])
            return
        (container,) = spec["containers"]  # the operator's pods have one container each
        ip = str(FIRST_POD_IP + next(self._ips))
        pod_dir = self.root / "pods" / meta["name"]
        volumes = {v["name"]: self._volume_dir(pod, v, pod_dir) for v in spec.get("volumes", [])}
        mounts = [
            Mount(volumes[m["name"]], m["mountPath"], bool(m.get("readOnly")))
            for m in container.get("volumeMounts", [])
        ]
        message_path = pod_dir / "termination-log"
        pod_dir.mkdir(parents=True, exist_ok=True)  # a pod without volumes has no directory yet
        message_path.write_text("")
        mounts.append(Mount(message_path, container.get("terminationMessagePath", "/dev/termination-log")))
        mounts.append(Mount(self.hosts_path, "/etc/hosts"))  # cluster DNS
        mounts += [Mount(path, str(path)) for path in IMAGE_PATHS]
        for m in mounts:
            self._ensure_mount_point(Path(m.target), m.source.is_dir())
        env = {
            **self.image_env,
            **pod_env(container, lambda name: self.kube.get("secrets", name, meta["namespace"]), ip, pod),
        }
        process = ContainerProcess(
            name=meta["name"],
            argv=pod_argv(container, ip),
            env=env,
            mounts=mounts,
            workdir=pod_dir,
            log_path=pod_dir / "container.log",
            message_path=message_path,
        )
        process.start()
        probe = container.get("readinessProbe")
        run = PodRun(meta["namespace"], meta["name"], meta["uid"], spec["nodeName"], ip, process, probe, _now())
        run.ready = probe is None
        self.runs[meta["uid"]] = run
        self._write_status(run)
        self.note(f"pod {meta['name']} started on {run.node} at {ip}")
        if run.ready:
            self.note(f"pod {meta['name']} ready")  # no readiness probe: Ready once started

    def _volume_dir(self, pod: dict[str, Any], volume: dict[str, Any], pod_dir: Path) -> Path:
        namespace = pod["metadata"]["namespace"]
        if "persistentVolumeClaim" in volume:
            return self.claim_dir(namespace, volume["persistentVolumeClaim"]["claimName"])
        path = pod_dir / "volumes" / volume["name"]
        path.mkdir(parents=True, exist_ok=True)
        if "configMap" in volume:
            cm = self.kube.get("configmaps", volume["configMap"]["name"], namespace)
            if cm is None:
                raise RuntimeError(f"pod {pod['metadata']['name']}: ConfigMap {volume['configMap']['name']} not found")
            for key, value in (cm.get("data") or {}).items():
                (path / key).write_text(value)
        elif "secret" in volume:
            secret = self.kube.get("secrets", volume["secret"]["secretName"], namespace) or {}
            for key, value in (secret.get("data") or {}).items():
                (path / key).write_bytes(base64.b64decode(value))
        elif "emptyDir" not in volume:
            raise RuntimeError(f"pod {pod['metadata']['name']}: volume {volume['name']} of an unsupported kind")
        return path

    def _ensure_mount_point(self, target: Path, is_dir: bool) -> None:
        if target.exists():
            return
        missing = [p for p in [*reversed(target.parents), target] if not p.exists()]
        if is_dir:
            target.mkdir(parents=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.touch()
        self._created_paths += missing

    def _sync(self, run: PodRun, pod: dict[str, Any], now: float) -> None:
        meta = pod["metadata"]
        if run.exit_code is None:
            code = run.container.poll()
            if code is not None:
                run.container.kill()  # the runtime stops what the main process left behind
                self._exited(run, code)
        if meta.get("deletionTimestamp"):
            grace = float(meta.get("deletionGracePeriodSeconds") or 0)
            deadline = now + grace
            if run.exit_code is None and run.kill_at is None:
                run.container.signal(signal.SIGTERM)
                self.note(f"pod {run.name} SIGTERM (deletion, grace {grace:.0f} s)")
            if run.kill_at is None or deadline < run.kill_at:
                run.kill_at = deadline
            if run.exit_code is None and now >= run.kill_at:
                run.container.kill()
                self.note(f"pod {run.name} SIGKILL (grace over)")
                self._exited(run, _killed_code(run.container.poll()))
            if run.exit_code is not None:
                run.container.kill()  # nothing of the tree may outlive the pod
                self._finish_deletion(run.namespace, run.name)
                run.removed = True
            return
        if run.shutdown and run.exit_code is None and run.kill_at is not None and now >= run.kill_at:
            run.container.kill()
            self.note(f"pod {run.name} SIGKILL (node shutdown grace over)")
            self._exited(run, _killed_code(run.container.poll()))
        if run.exit_code is None and run.probe is not None and now >= run.next_probe:
            run.next_probe = now + PROBE_SECONDS
            ready = self._probe(run)
            run.failures = 0 if ready else run.failures + 1
            if ready != run.ready and (ready or run.failures >= int(run.probe.get("failureThreshold", 3))):
                run.ready = ready
                self._write_status(run)
                self.note(f"pod {run.name} {'ready' if ready else 'not ready'}")

    def _probe(self, run: PodRun) -> bool:
        get = run.probe.get("httpGet") if run.probe else None
        if not get:
            return True
        port = get["port"]
        if isinstance(port, str):
            pod = self.kube.get("pods", run.name, run.namespace)
            ports = pod["spec"]["containers"][0].get("ports", []) if pod else []
            port = next(p["containerPort"] for p in ports if p["name"] == port)
        try:
            return 200 <= httpx.get(f"http://{run.ip}:{port}{get.get('path', '/')}", timeout=0.5).status_code < 400
        except httpx.HTTPError:
            return False

    def _exited(self, run: PodRun, code: int) -> None:
        run.exit_code = code
        run.ready = False
        self._write_status(run)
        self.note(f"pod {run.name} exited {code}")

    def _finish_deletion(self, namespace: str, name: str) -> None:
        with contextlib.suppress(ApiError, ValueError):
            self.kube.finish_pod_deletion(name, namespace)
            self.note(f"pod {name} deleted")

    def _shut_down(self, node: Node) -> None:
        """Graceful node shutdown: SIGTERM to every pod not already stopping, SIGKILL at the end of its grace;
        pods end Failed."""
        node.shutdown_at = None
        self.note(f"shutdown node {node.name}")
        for run in self._runs_on(node.name):
            run.shutdown = True
            if run.exit_code is None:
                pod = self.kube.get("pods", run.name, run.namespace) or {"spec": {}}
                grace = min(float(pod["spec"].get("terminationGracePeriodSeconds", 30)), SHUTDOWN_GRACE_SECONDS)
                if run.kill_at is None:  # not yet stopping (a deleted pod has its SIGTERM already)
                    run.container.signal(signal.SIGTERM)
                run.kill_at = min(run.kill_at or float("inf"), time.monotonic() + grace)
        # once its pods stopped the node is gone (the cloud deletes the instance)
        node.delete_at = time.monotonic() + SHUTDOWN_GRACE_SECONDS + 1

    def _runs_on(self, node: str) -> list[PodRun]:
        return [r for r in self.runs.values() if r.node == node and not r.removed]

    # ------------------------------------------------------------------ status writes
    def _write_status(self, run: PodRun) -> None:
        pod = self.kube.get("pods", run.name, run.namespace)
        if pod is None:
            return
        cname = pod["spec"]["containers"][0]["name"]
        policy = pod["spec"]["containers"][0].get("terminationMessagePolicy", "File")
        if run.exit_code is None:
            state = {"running": {"startedAt": run.started_at}}
            phase = "Running"
        else:
            message = run.container.termination_message(run.exit_code, policy)
            terminated = {
                "exitCode": run.exit_code,
                "reason": "Completed" if run.exit_code == 0 else "Error",
                "startedAt": run.started_at,
                "finishedAt": _now(),
                **({"message": message} if message else {}),
            }
            state = {"terminated": terminated}
            phase = "Succeeded" if run.exit_code == 0 and not run.shutdown else "Failed"
        ready = "True" if run.ready and run.exit_code is None else "False"
        conditions = [
            {"type": "PodScheduled", "status": "True"},
            {"type": "Initialized", "status": "True"},
            {"type": "ContainersReady", "status": ready},
            {"type": "Ready", "status": ready},
        ]
        if run.disruption:
            conditions.append(run.disruption)
        status: dict[str, Any] = {
            "phase": phase,
            "podIP": run.ip,
            "podIPs": [{"ip": run.ip}],
            "hostIP": "127.0.0.1",
            "startTime": run.started_at,
            "conditions": conditions,
            "containerStatuses": [
                {
                    "name": cname,
                    "ready": ready == "True",
                    "started": run.exit_code is None,
                    "restartCount": 0,
                    "image": pod["spec"]["containers"][0].get("image", ""),
                    "imageID": "",
                    "containerID": f"local://{run.container.pid}",
                    "state": state,
                }
            ],
        }
        if run.shutdown and run.exit_code is not None:
            status["reason"] = "Terminated"
            status["message"] = NODE_SHUTDOWN_MESSAGE
        self._patch_status(pod, status)

    def _patch_status(self, pod: dict[str, Any], status: dict[str, Any]) -> None:
        meta = pod["metadata"]
        with contextlib.suppress(ApiError):
            self.kube.patch("pods", meta["name"], {"status": status}, meta["namespace"], subresource="status")

    def _add_taints(self, name: str, taints: list[dict[str, Any]]) -> None:
        node = self.kube.get("nodes", name)
        if node is None:
            return
        stamped = [{**t, "timeAdded": _now()} for t in taints]
        self.kube.patch("nodes", name, {"spec": {"taints": [*(node["spec"].get("taints") or []), *stamped]}})

    def _node_not_ready(self, name: str, reason: str, message: str) -> None:
        cond = {"type": "Ready", "status": "Unknown", "reason": reason, "message": message}
        with contextlib.suppress(ApiError):
            self.kube.patch("nodes", name, {"status": {"conditions": [cond]}}, subresource="status")

    # ------------------------------------------------------------------ DNS
    def _write_hosts(self, pods: list[dict[str, Any]]) -> None:
        lines = [Path("/etc/hosts").read_text().rstrip("\n")]
        for svc in self.kube.list("services"):
            meta, spec = svc["metadata"], svc.get("spec") or {}
            if not spec.get("selector"):
                continue
            match = label_matcher(",".join(f"{k}={v}" for k, v in spec["selector"].items()))
            ready = sorted(
                (
                    p
                    for p in pods
                    if match(p["metadata"].get("labels") or {})
                    and not p["metadata"].get("deletionTimestamp")
                    and _is_ready(p)
                ),
                key=lambda p: p["metadata"]["name"],
            )
            if not ready:
                continue
            self._check_ports(svc, ready[0])
            host = f"{meta['name']}.{meta['namespace']}.svc"
            lines.append(f"{ready[0]['status']['podIP']}\t{host} {host}.cluster.local")
        lines += self._pod_records(pods)
        text = "\n".join(lines) + "\n"
        if text != self._hosts_text:
            # in place (not a rename): processes bind-mount this very inode. One write, then the cut: a
            # process resolving meanwhile never finds the file empty (a torchrun agent's rendezvous address)
            data = text.encode()
            fd = os.open(self.hosts_path, os.O_WRONLY)
            try:
                os.pwrite(fd, data, 0)
                os.ftruncate(fd, len(data))
            finally:
                os.close(fd)
            self._hosts_text = text
            self.note("dns " + "; ".join(line.replace("\t", " ") for line in lines[1:]))

    def _pod_records(self, pods: list[dict[str, Any]]) -> list[str]:
        """``<ip>\t<hostname>.<subdomain>.<ns>.svc …`` of every pod a headless Service named its ``subdomain``
        selects (see the module docstring)."""
        headless = {
            (svc["metadata"]["namespace"], svc["metadata"]["name"]): svc["spec"]
            for svc in self.kube.list("services")
            if (svc.get("spec") or {}).get("clusterIP") == "None" and svc["spec"].get("selector")
        }
        lines = []
        for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
            meta, status = pod["metadata"], pod.get("status") or {}
            hostname, subdomain = pod["spec"].get("hostname"), pod["spec"].get("subdomain")
            spec = headless.get((meta["namespace"], subdomain))
            if not hostname or spec is None or meta.get("deletionTimestamp") or status.get("phase") != "Running":
                continue
            match = label_matcher(",".join(f"{k}={v}" for k, v in spec["selector"].items()))
            if not match(meta.get("labels") or {}) or not (spec.get("publishNotReadyAddresses") or _is_ready(pod)):
                continue
            host = f"{hostname}.{subdomain}.{meta['namespace']}.svc"
            lines.append(f"{status['podIP']}\t{host} {host}.cluster.local")
        return lines

    @staticmethod
    def _check_ports(svc: dict[str, Any], pod: dict[str, Any]) -> None:
        ports = {p["name"]: p["containerPort"] for p in pod["spec"]["containers"][0].get("ports", []) if "name" in p}
        for port in svc["spec"].get("ports", []):
            target = port.get("targetPort", port["port"])
            number = ports.get(target, target) if isinstance(target, str) else target
            if number != port["port"]:
                raise RuntimeError(f"service {svc['metadata']['name']}: port {port['port']} ≠ target {number}")


def _is_ready(pod: dict[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def _killed_code(code: int | None) -> int:
    """The exit code of a container just SIGKILLed: its own if it exited in between, else 137."""
    return 137 if code is None else code
