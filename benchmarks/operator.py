"""Operator latency (JSON on stdout): RLRun create → all pods, orchestrator status change → RLRun status.

The real operator (kopf + ``rlrun_operator.handlers``) runs against the API emulator
(``tests/support/kube/``, the real CRD) and fake orchestrator control servers, with
``--runs`` RLRuns created at once (default 1 and 50). For each size:

- ``create_to_pods_s``: per run, time from its create request to all of its pods existing
  (p50 / p95 / max over runs) and ``all_pods_s`` until every run's pods exist;
- ``baseline_direct_create_s``: the same objects (claim, Secret, ConfigMap, Service, pods)
  created straight through the API client by this process, serially, measured in the same
  run: the API's own cost for one run; ``create_ratio`` = ``all_pods_s`` / (baseline × runs);
- ``status_to_rlrun_s``: per run, time from its orchestrator's ``/status`` changing to the
  RLRun's ``status.step`` showing it (p50 / p95 / max); bounded below by the status poll
  interval (``--interval``, default 1 s), so ``status_ratio`` = max / interval.

Usage: ``python benchmarks/operator.py [--runs 1 50] [--interval 1.0]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def percentiles(values: list[float]) -> dict:
    ordered = sorted(values)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return {"p50": round(statistics.median(ordered), 4), "p95": round(p95, 4), "max": round(ordered[-1], 4)}


def manifest(name: str) -> dict:
    spec = {"model": {"builtin": "tiny-reverse"}, "envs": [{"name": "reverse-text"}], "rollout": {"replicas": 1}}
    return {"apiVersion": "rlrun.dev/v1alpha1", "kind": "RLRun", "metadata": {"name": name}, "spec": spec}


def wait(predicate, timeout: float, poll: float = 0.01):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(poll)
    raise TimeoutError("benchmark condition not reached")


def measure(n_runs: int, interval: float, namespace: str = "bench") -> dict:
    import kopf
    from rlrun_operator import handlers
    from rlrun_operator.builders import build_pods, build_run_objects
    from rlrun_operator.kube import Kube

    from tests.reconcile.fake_orchestrator import FakeOrchestrators
    from tests.support.kube import KopfThread, KubeServer

    pods_per_run = 3
    with (
        KubeServer(crds=ROOT / "crds") as kube,
        FakeOrchestrators() as orchestrators,
        tempfile.TemporaryDirectory() as tmp,
    ):
        os.environ["KUBECONFIG"] = str(kube.write_kubeconfig(Path(tmp) / "kubeconfig", namespace=namespace))
        handlers.SETTINGS = handlers.SETTINGS.model_copy(update={"orchestrator_url": orchestrators.url_template})
        handlers.STATE.__init__()
        kube.create("namespaces", {"metadata": {"name": namespace}})

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

            # every run Pending → wait for the first status, then change every orchestrator's step at once
            def statuses() -> dict[str, dict]:
                return {o["metadata"]["name"]: o.get("status") or {} for o in kube.list("rlruns", namespace)}

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, nargs="+", default=[1, 50])
    parser.add_argument("--interval", type=float, default=1.0, help="status poll interval, seconds")
    args = parser.parse_args()
    # read when the handlers module is imported: set before
    os.environ["RLRUN_OPERATOR_STATUS_INTERVAL_SECONDS"] = str(args.interval)
    import logging

    logging.basicConfig(level=logging.ERROR)
    results = [measure(n, args.interval) for n in args.runs]
    print(json.dumps({"benchmark": "operator", "results": results}, indent=2))


if __name__ == "__main__":
    main()
