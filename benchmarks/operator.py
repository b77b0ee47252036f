"""Operator latency (JSON on stdout): create → pods, orchestrator status → RLRun status, preemption → resumed.

The real operator (kopf + ``rlrun_operator.handlers``) runs against the API emulator
(``tests/support/kube/``, the real CRD) and fake orchestrator control servers, with
``--runs`` RLRuns created at once (default 1 and 50). For each size:

- ``create_to_pods_s``: per run, time from its create request to all of its pods existing
  (p50 / p95 / max over runs) and ``all_pods_s`` until every run's pods exist;
- ``baseline_direct_create_s``: the same objects (claim, Secret, ConfigMap, Service, pods)
  created straight through the API client by this process, serially, measured in the same
  run: the API's own cost for one run; ``create_ratio`` = ``all_pods_s`` / (baseline × runs);
- ``status_to_rlrun_s``: per run, time from its orchestrator's ``/status`` changing to the
  RLRun's ``status.step`` showing it (p50 / p95 / max), once each orchestrator pod is Running
  (the benchmark plays the kubelet); governed by the status poll interval (``--interval``,
  default 1 s): the change lands anywhere in the timer's period, ``status_ratio`` = max / interval.

Under ``"recovery"`` (``--trials``, default 50, per resume signal): one RLRun preempted and
recovered ``--trials`` times in a row (attempts 0 → 1 → … → trials), the benchmark playing the
kubelet (binding pods to nodes, finishing graceful deletions) and a fake orchestrator whose
``POST /pause`` answers at once (``pause_delay`` 0). Per trial, from a ``DisruptionTarget=True``
condition (``TerminationByKubelet``: its node is going away) written onto the trainer pod, whose node
the orchestrator shares (the time the benchmark sends that request). The node's notice reaching the
trainer first is the case the pause exists for: the orchestrator is on a node going away but still
running, so the whole attempt restarts and is paused first (a trainer lost on a node of its own is
replaced in place, with no pause; an orchestrator hit itself writes its snapshot on SIGTERM):

- ``pause_s``: the operator's share of the pause: trigger → the fake receiving ``POST /pause``,
  plus the fake's answer → ``status.recovery.stage: Stopping`` (the answer recorded);
  ``pause_raw_s``: trigger → recorded, the fake's own time included;
- ``trigger_to_deleting_s`` (2a): trigger → every old pod has a ``deletionTimestamp``;
- ``finished_to_replacements_s`` (2b): the benchmark finishing the old pods' deletions
  (``expire_pod_deletions`` returned) → every pod of the next attempt exists;
- ``resume_to_resumed_s`` (3): the fake's ``/status`` reporting the new attempt with a resume
  report → the RLRun's ``Resumed`` condition True for that attempt;
- ``operator_share_s``: 2a less the fake's time answering the pause (2a contains the whole
  pause: adding ``pause_s`` as well would count it twice) + 2b + 3; ``goal_met``: its p95 ≤ 1 s.

The resume signal (``--signals``): ``timer`` — every new pod is Ready before the orchestrator
reports its resume (the real orchestrator serves ``/healthz`` before it restores), so only the
status timer (``--interval``) can notice it; ``pod_ready`` — the orchestrator pod turns Ready
right after it reports (as a readiness probe gated on the restore would), a pod event.
Watch events (pods, rlruns) timestamp the operator's writes as they reach this process.

Usage: ``python benchmarks/operator.py [--runs 1 50] [--interval 1.0] [--trials 50]
[--signals timer pod_ready] [--recovery-only]``
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import http.client
import json
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def percentiles(values: list[float]) -> dict:
    ordered = sorted(values)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return {"p50": round(statistics.median(ordered), 4), "p95": round(p95, 4), "max": round(ordered[-1], 4)}


def manifest(name: str) -> dict:
    from tests.support.manifests import manifest as small_manifest

    return small_manifest(name, rollout={"replicas": 1})


def wait(predicate, timeout: float, poll: float = 0.01):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(poll)
    raise TimeoutError("benchmark condition not reached")


@contextlib.contextmanager
def emulated_cluster(fakes, namespace: str):
    """The API emulator serving the real CRD, ``fakes`` (fake orchestrators) started, the operator's
    settings pointed at them and ``namespace`` created; yields ``(kube, fakes)``."""
    from rlrun_operator import handlers

    from tests.support.kube import KubeServer

    with KubeServer(crds=ROOT / "crds") as kube, fakes as orchestrators, tempfile.TemporaryDirectory() as tmp:
        os.environ["KUBECONFIG"] = str(kube.write_kubeconfig(Path(tmp) / "kubeconfig", namespace=namespace))
        handlers.SETTINGS = handlers.SETTINGS.model_copy(update={"orchestrator_url": orchestrators.url_template})
        handlers.STATE.__init__()
        kube.create("namespaces", {"metadata": {"name": namespace}})
        yield kube, orchestrators


def measure(n_runs: int, interval: float, namespace: str = "bench") -> dict:
    import kopf
    from rlrun_operator import handlers
    from rlrun_operator.builders import build_run_objects
    from rlrun_operator.kube import Kube
    from rlrun_operator.pods import build_pods

    from tests.support.fake_orchestrator import FakeOrchestrators
    from tests.support.kube import KopfThread

    pods_per_run = 3
    with emulated_cluster(FakeOrchestrators(), namespace) as (kube, orchestrators):
        # baseline: the same objects straight through the API, serially, from this process
        direct = Kube(kube.api_client())
        body = {"metadata": {"name": "baseline", "namespace": "baseline", "uid": "u-0"}}
        kube.create("namespaces", {"metadata": {"name": "baseline"}})
        from rlrun.manifest import parse_manifest

        run = parse_manifest(manifest("baseline"))
        objects = build_run_objects(body, run, handlers.SETTINGS, "token") + build_pods(body, run, handlers.SETTINGS, 0)
        t0 = time.perf_counter()
        for obj in objects:
            direct.create(obj)
        baseline = time.perf_counter() - t0

        with KopfThread(kopf.get_default_registry(), kube):
            names = [f"run-{i:03d}" for i in range(n_runs)]
            created_at: dict[str, float] = {}
            for name in names:
                kube.create("rlruns", manifest(name), namespace)
                created_at[name] = time.perf_counter()
            pods_at: dict[str, float] = {}

            def all_pods() -> bool:
                counts: dict[str, int] = {}
                for pod in kube.list("pods", namespace):
                    inst = pod["metadata"]["labels"]["app.kubernetes.io/instance"]
                    counts[inst] = counts.get(inst, 0) + 1
                now = time.perf_counter()
                for name, count in counts.items():
                    if count == pods_per_run and name not in pods_at:
                        pods_at[name] = now
                return len(pods_at) == n_runs

            wait(all_pods, timeout=60 + n_runs)
            create_latency = [pods_at[n] - created_at[n] for n in names]
            all_pods_s = max(pods_at.values()) - min(created_at.values())

            # every run Pending → its orchestrator pod Running → wait for the first status, then change every
            # orchestrator's step at once
            def statuses() -> dict[str, dict]:
                return {o["metadata"]["name"]: o.get("status") or {} for o in kube.list("rlruns", namespace)}

            # the kubelet's part: each orchestrator pod Running (a run is Running only with a live one)
            for pod in kube.list("pods", namespace, label_selector="app.kubernetes.io/component=orchestrator"):
                ready = {"phase": "Running", "podIP": "10.0.0.2", "conditions": [{"type": "Ready", "status": "True"}]}
                kube.patch("pods", pod["metadata"]["name"], {"status": ready}, namespace, subresource="status")
            wait(lambda: all(s.get("phase") == "Running" for s in statuses().values()), timeout=30 + n_runs)
            changed_at = {}
            for name in names:
                orchestrators.run(namespace, name).status["step"] = 42
                changed_at[name] = time.perf_counter()
            seen_at: dict[str, float] = {}

            def all_seen() -> bool:
                now = time.perf_counter()
                for name, status in statuses().items():
                    if status.get("step") == 42 and name not in seen_at:
                        seen_at[name] = now
                return len(seen_at) == n_runs

            wait(all_seen, timeout=30 + interval * 5)
            status_latency = [seen_at[n] - changed_at[n] for n in names]
    return {
        "runs": n_runs,
        "pods_per_run": pods_per_run,
        "create_to_pods_s": percentiles(create_latency),
        "all_pods_s": round(all_pods_s, 4),
        "baseline_direct_create_s": round(baseline, 4),
        "create_ratio": round(all_pods_s / (baseline * n_runs), 2),
        "status_to_rlrun_s": percentiles(status_latency),
        "status_interval_s": interval,
        "status_ratio": round(max(status_latency) / interval, 2),
    }


# -- recovery latency ---------------------------------------------------------------------------

GOAL_S = 1.0
#: a time after every grace period: finishing deletions "at" it plays kubelets whose pods stopped
LATER = dt.datetime.now(dt.timezone.utc) + dt.timedelta(days=1)
#: time left for the reconciles the kubelet's pod updates started, before the fake reports its resume
SETTLE_S = 0.25


class Recorder:
    """Watches (raw HTTP, one thread each) that timestamp every event as it reaches this process."""

    def __init__(self, url: str, paths: dict[str, str]) -> None:
        self.url = urllib.parse.urlsplit(url)
        self.events: list[tuple[float, str, str, dict]] = []  # (time, kind, type, object)
        self.lock = threading.Lock()
        self.connections: list[http.client.HTTPConnection] = []
        self.threads = [
            threading.Thread(target=self._watch, args=(kind, path), daemon=True) for kind, path in paths.items()
        ]
        for t in self.threads:
            t.start()

    def _watch(self, kind: str, path: str) -> None:
        rv = None
        while True:
            conn = http.client.HTTPConnection(self.url.hostname, self.url.port, timeout=None)
            self.connections.append(conn)
            query = "watch=true&timeoutSeconds=3600" + (f"&resourceVersion={rv}" if rv else "")
            try:
                conn.request("GET", f"{path}?{query}", headers={"Authorization": "Bearer emulator-token"})
                response = conn.getresponse()
                while line := response.readline():
                    event = json.loads(line)
                    now = time.perf_counter()
                    if event.get("type") not in ("ADDED", "MODIFIED", "DELETED"):
                        continue
                    obj = event.get("object") or {}
                    rv = (obj.get("metadata") or {}).get("resourceVersion", rv)
                    with self.lock:
                        self.events.append((now, kind, event.get("type"), obj))
            except OSError:
                return
            finally:
                conn.close()

    def mark(self) -> int:
        with self.lock:
            return len(self.events)

    def since(self, mark: int, kind: str) -> list[tuple[float, str, dict]]:
        with self.lock:
            return [(t, typ, obj) for t, k, typ, obj in self.events[mark:] if k == kind]

    def first(self, mark: int, kind: str, predicate) -> float | None:
        """The time of the first ``kind`` event after ``mark`` whose object satisfies ``predicate``."""
        return next((t for t, _, obj in self.since(mark, kind) if predicate(obj)), None)

    def close(self) -> None:
        for conn in self.connections:
            if conn.sock is not None:
                with contextlib.suppress(OSError):
                    conn.sock.shutdown(socket.SHUT_RDWR)


def _attempt(pod: dict) -> int:
    return int(pod["metadata"]["labels"]["rlrun.dev/attempt"])


def _component(pod: dict) -> str:
    return pod["metadata"]["labels"]["app.kubernetes.io/component"]


def _resumed(attempt: int):
    def check(run: dict) -> bool:
        conditions = (run.get("status") or {}).get("conditions") or []
        return any(
            c["type"] == "Resumed" and c["status"] == "True" and c.get("message", "").startswith(f"attempt {attempt} ")
            for c in conditions
        )

    return check


def measure_recovery(trials: int, signal: str, interval: float, namespace: str = "bench-recovery") -> dict:
    """One run preempted (``DisruptionTarget`` on its trainer, on the orchestrator's node) and recovered ``trials``
    times; see the module docs."""
    import kopf

    from tests.support.fake_orchestrator import FakeOrchestrators, resume_report
    from tests.support.kube import KopfThread

    class TimedOrchestrators(FakeOrchestrators):
        """The fake orchestrators, with when each ``POST /pause`` arrived and was answered."""

        def __init__(self) -> None:
            super().__init__()
            self.pauses: list[tuple[float, float]] = []

        async def _handle(self, request):
            pause = (request.method, request.match_info["route"]) == ("POST", "pause")
            received = time.perf_counter()
            response = await super()._handle(request)
            if pause:
                self.pauses.append((received, time.perf_counter()))
            return response

    name = "demo"
    with emulated_cluster(TimedOrchestrators(), namespace) as (kube, orchestrators):
        recorder = Recorder(
            kube.url,
            {
                "pods": f"/api/v1/namespaces/{namespace}/pods",
                "rlruns": f"/apis/rlrun.dev/v1alpha1/namespaces/{namespace}/rlruns",
            },
        )
        fake = orchestrators.run(namespace, name)
        fake.pause_delay = 0.0

        def add_node(node: str) -> None:
            kube.create("nodes", {"metadata": {"name": node, "labels": {"kubernetes.io/hostname": node}}})

        def pods(attempt: int) -> list[dict]:
            return [p for p in kube.list("pods", namespace) if _attempt(p) == attempt]

        def status() -> dict:
            return (kube.get("rlruns", name, namespace) or {}).get("status") or {}

        def ready() -> bool:
            return any(c["type"] == "Ready" and c["status"] == "True" for c in status().get("conditions") or [])

        def kubelet(attempt: int, orchestrator_ready: bool = True) -> None:
            """Bind attempt ``attempt``'s pods (trainer and orchestrator to a node of their own) and report them
            Running."""
            for i, pod in enumerate(sorted(pods(attempt), key=lambda p: p["metadata"]["name"])):
                component = _component(pod)
                node = f"node-t{attempt}" if component in ("trainer", "orchestrator") else "node-b"
                meta = pod["metadata"]
                kube.patch("pods", meta["name"], {"spec": {"nodeName": node}}, namespace)
                up = orchestrator_ready or component != "orchestrator"
                body = {
                    "phase": "Running",
                    "podIP": f"10.{attempt % 250}.0.{i + 1}",
                    "conditions": [{"type": "Ready", "status": "True" if up else "False"}],
                }
                kube.patch("pods", meta["name"], {"status": body}, namespace, subresource="status")

        add_node("node-b")
        add_node("node-t0")
        rows: list[dict[str, float]] = []
        with KopfThread(kopf.get_default_registry(), kube):
            kube.create("rlruns", manifest(name), namespace)
            wait(lambda: len(pods(0)) == 3, timeout=30)
            kubelet(0)
            wait(ready, timeout=30)
            for n in range(trials):
                add_node(f"node-t{n + 1}")  # where the next trainer and orchestrator go (their old node is avoided)
                old = {p["metadata"]["name"] for p in pods(n)}
                hit = next(p for p in pods(n) if _component(p) == "trainer")["metadata"]["name"]
                mark, paused_before = recorder.mark(), len(orchestrators.pauses)
                conditions = [
                    {"type": "Ready", "status": "True"},
                    {"type": "DisruptionTarget", "status": "True", "reason": "TerminationByKubelet"},
                ]
                triggered = time.perf_counter()
                kube.patch("pods", hit, {"status": {"conditions": conditions}}, namespace, subresource="status")

                def all_deleting(mark=mark, old=old) -> float | None:
                    pending = set(old)
                    for t, _, pod in recorder.since(mark, "pods"):
                        if pod["metadata"]["name"] in pending and pod["metadata"].get("deletionTimestamp"):
                            pending.discard(pod["metadata"]["name"])
                            if not pending:
                                return t
                    return None

                deleting = wait(all_deleting, timeout=30)
                recorded = recorder.first(
                    mark, "rlruns", lambda r: ((r.get("status") or {}).get("recovery") or {}).get("stage") == "Stopping"
                )
                (received, answered), *more = orchestrators.pauses[paused_before:]
                assert not more and recorded is not None and fake.pauses == n + 1, "one pause per recovery"

                finished = kube.expire_pod_deletions(at=LATER)  # the kubelets finish: the old pods are gone
                finished_at = time.perf_counter()
                assert {pod for _, pod in finished} == old, finished

                def all_created(mark=mark, attempt=n + 1) -> float | None:
                    seen = set()
                    for t, typ, pod in recorder.since(mark, "pods"):
                        if typ == "ADDED" and _attempt(pod) == attempt:
                            seen.add(pod["metadata"]["name"])
                            if len(seen) == 3:
                                return t
                    return None

                created = wait(all_created, timeout=30)
                kubelet(n + 1, orchestrator_ready=signal != "pod_ready")
                stage = (n + 1, "Resuming")
                wait(
                    lambda stage=stage: (
                        (status().get("attempt"), (status().get("recovery") or {}).get("stage")) == stage
                    ),
                    30,
                )
                time.sleep(SETTLE_S)
                mark = recorder.mark()
                report = resume_report(open_groups=3, requested_groups=1, queued_traces=104, finished_episodes_kept=8)
                reported = time.perf_counter()
                fake.status.update(phase="running", attempt=n + 1, step=10, resume=report)
                if signal == "pod_ready":  # the readiness probe passes once the restore is done
                    orchestrator = next(p for p in pods(n + 1) if _component(p) == "orchestrator")
                    body = {"conditions": [{"type": "Ready", "status": "True"}]}
                    kube.patch(
                        "pods", orchestrator["metadata"]["name"], {"status": body}, namespace, subresource="status"
                    )
                resumed = wait(lambda mark=mark, n=n: recorder.first(mark, "rlruns", _resumed(n + 1)), timeout=30)
                rows.append(
                    {
                        "pause": (received - triggered) + (recorded - answered),
                        "pause_raw": recorded - triggered,
                        "deleting": deleting - triggered,
                        "replacements": created - finished_at,
                        "resumed": resumed - reported,
                        "share": (deleting - triggered - (answered - received))
                        + (created - finished_at)
                        + (resumed - reported),
                        "share_overlapping": (received - triggered)
                        + (recorded - answered)
                        + (deleting - triggered)
                        + (created - finished_at)
                        + (resumed - reported),
                    }
                )
                wait(ready, timeout=30)  # the run is back to Running before the next preemption
            final = status()
        recorder.close()
    assert final["attempt"] == trials and final["preemptions"] == trials, final
    share = percentiles([r["share"] for r in rows])
    return {
        "resume_signal": signal,
        "trials": trials,
        "pause_s": percentiles([r["pause"] for r in rows]),
        "pause_raw_s": percentiles([r["pause_raw"] for r in rows]),
        "trigger_to_deleting_s": percentiles([r["deleting"] for r in rows]),
        "finished_to_replacements_s": percentiles([r["replacements"] for r in rows]),
        "resume_to_resumed_s": percentiles([r["resumed"] for r in rows]),
        "operator_share_s": share,
        "operator_share_overlapping_s": percentiles([r["share_overlapping"] for r in rows]),
        "goal_met": share["p95"] <= GOAL_S,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, nargs="+", default=[1, 50])
    parser.add_argument("--interval", type=float, default=1.0, help="status poll interval, seconds")
    parser.add_argument("--trials", type=int, default=50, help="recoveries per resume signal (0: none)")
    parser.add_argument("--signals", nargs="+", choices=["timer", "pod_ready"], default=["timer", "pod_ready"])
    parser.add_argument("--recovery-only", action="store_true", help="skip the create and status measures")
    args = parser.parse_args()
    # read when the handlers module is imported: set before
    os.environ["RLRUN_OPERATOR_STATUS_INTERVAL_SECONDS"] = str(args.interval)
    import logging

    logging.basicConfig(level=logging.ERROR)
    out: dict = {"benchmark": "operator"}
    out["results"] = [] if args.recovery_only else [measure(n, args.interval) for n in args.runs]
    if args.trials > 0:
        signals = [measure_recovery(args.trials, signal, args.interval) for signal in args.signals]
        out["recovery"] = {
            "trials": args.trials,
            "pause_delay_s": 0.0,
            "status_interval_s": args.interval,
            "goal_s": GOAL_S,
            "goal_met": all(s["goal_met"] for s in signals),
            "signals": signals,
        }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
