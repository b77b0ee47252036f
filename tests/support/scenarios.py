"""What the end-to-end scenarios share: the manifest, applying it with kubectl, waiting for the
run, the checks on the volume, and the split of a preemption's wall time.

Used by ``tests/cluster`` and ``benchmarks/preemption.py`` (the same scenario with and without a
preemption, side by side).
"""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml
from rlrun.api.control import StatusReport
from rlrun.api.control_client import ControlError, call_control
from rlrun.checkpoint import latest_complete_checkpoint
from rlrun.model.resolve import ensure_builtin_model
from rlrun.rundir import RunDir
from rlrun_operator.naming import CONTROL_PORT

from tests.support import manifests
from tests.support.kubelet import LocalCluster
from tests.support.polling import wait_for

NAME = "demo"
#: The operator as these tests run it: status polled every second, pods stuck on a lost node
#: force-deleted 3 s after their grace period.
OPERATOR_ENV = {"RLRUN_OPERATOR_STATUS_INTERVAL_SECONDS": "1", "RLRUN_OPERATOR_FORCE_DELETE_AFTER_SECONDS": "3"}
#: Long enough for vLLM's start on 2 busy cores (~60 s) twice and the steps between.
RUN_TIMEOUT = 300.0


def manifest(max_steps: int = 20, replicas: int = 1, seed: int = 3) -> dict[str, Any]:
    """The scenarios' RLRun: batch 18 with groups of 4 and 2 members per request, so a pause
    finds samples queued past the batch cut and groups half-finished; checkpoints every 4 steps.

    ``max_inflight: 4`` (one group at a time) makes generation, not the trainer, the bottleneck,
    as in most real RL runs: the orchestrator is always mid-batch. With the trainer the
    bottleneck it would wait at the staleness bound between batches with nothing in flight,
    and its leftovers would be stale by the next cut: a pause there has nothing to keep.
    """
    return manifests.manifest(
        NAME,
        group_size=4,
        batch_size=18,
        max_off_policy_steps=2,
        max_steps=max_steps,
        seed=seed,
        checkpoint={"interval": 4, "keep_last": 2},
        rollout={"replicas": replicas, "max_inflight": 4, "members_per_request": 2},
        preemption={"snapshot_timeout_seconds": 20, "termination_grace_period_seconds": 30},
    )


def seed_model(cluster: LocalCluster, cache_dir: Path) -> None:
    """Pre-seed the run's volume with the builtin model (built once per session into ``cache_dir``),
    where every pod's ``--cache-dir /var/lib/rlrun/cache`` looks for it."""
    assert cluster.nodes is not None
    model = ensure_builtin_model("tiny-reverse", cache_dir)
    target = cluster.nodes.claim_dir(cluster.namespace, f"{NAME}-run") / "cache" / "models" / model.name
    shutil.copytree(model, target)


def apply(cluster: LocalCluster, doc: dict[str, Any]) -> None:
    """``kubectl apply -f`` the manifest, as a user would."""
    path = cluster.root / "rlrun.yaml"
    path.write_text(yaml.safe_dump(doc))
    out = cluster.kubectl("apply", "--validate=false", "-f", str(path))
    assert f"rlrun.rlrun.dev/{NAME} created" in out, out


def run_dir(cluster: LocalCluster) -> Path:
    """The run directory on the run's volume, as the host sees it."""
    assert cluster.nodes is not None
    return cluster.nodes.claim_dir(cluster.namespace, f"{NAME}-run") / "run"


def wait_for_training(cluster: LocalCluster, trained_steps: int, timeout: float = RUN_TIMEOUT) -> dict[str, Any]:
    """Wait until the trainer published ``trained_steps`` policy versions; the RLRun's status then."""
    return wait_for(
        lambda: (s := cluster.status(NAME)).get("policyVersion", 0) >= trained_steps and s,
        timeout,
        f"policy version {trained_steps}",
        every=0.1,
    )


def orchestrator_status(cluster: LocalCluster) -> StatusReport | None:
    """The live orchestrator's own ``GET /status`` (queue, open groups, in-flight samples), or None
    (no orchestrator pod with an IP yet, or no answer)."""
    pod, secret = cluster.pod(NAME, "orchestrator"), cluster.kube.get("secrets", f"{NAME}-control", cluster.namespace)
    ip = ((pod or {}).get("status") or {}).get("podIP")
    if not ip or secret is None:
        return None
    token = base64.b64decode(secret["data"]["token"]).decode()
    try:
        return call_control(f"http://{ip}:{CONTROL_PORT}", token, lambda c: c.status(), timeout_s=2)
    except ControlError:
        return None


def wait_for_generation(cluster: LocalCluster, timeout: float = 60.0) -> StatusReport:
    """Wait for the orchestrator to be early in generating a batch (samples in flight, fewer than half
    a batch queued); its status.

    When the trainer is the bottleneck (it can be, on 2 busy cores, even with ``max_inflight: 4``),
    the orchestrator ships a batch, then idles at the staleness bound until the next policy version,
    and its leftovers are stale by the next cut. A notice then finds nothing to keep; one sent late
    in a batch races its shipping (CI once lost that race by 0.09 s). Sent early, ≥ half a batch
    (≈1 s of generation here) is still to come when the pause lands ≈0.1 s later.
    """
    half = manifest()["spec"]["batch_size"] // 2
    return wait_for(
        lambda: (s := orchestrator_status(cluster)) and s.inflight_samples > 0 and s.queued_traces < half and s,
        timeout,
        "a batch being generated",
        every=0.05,
    )


def wait_for_end(cluster: LocalCluster, timeout: float = RUN_TIMEOUT) -> dict[str, Any]:
    """Wait for ``Succeeded``; the status. A ``Failed`` run fails at once, with its message."""
    status = wait_for(
        lambda: (s := cluster.status(NAME)).get("phase") in ("Succeeded", "Failed") and s, timeout, "the run's end"
    )
    assert status["phase"] == "Succeeded", status.get("message")
    return status


def ledger_check(cluster: LocalCluster) -> str:
    """``rlrun ledger check`` on the volume's run directory; its output. Fails the test on exit ≠ 0."""
    argv = [sys.executable, "-m", "rlrun", "ledger", "check", str(run_dir(cluster))]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def metrics(cluster: LocalCluster) -> list[dict[str, Any]]:
    """The lines of the run's ``metrics.jsonl``, one per shipped step (a resumed step can repeat)."""
    path = run_dir(cluster) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def latest_checkpoint_step(cluster: LocalCluster) -> int | None:
    """The step of the newest complete checkpoint on the volume, or None."""
    ckpt = latest_complete_checkpoint(RunDir(run_dir(cluster)))
    return None if ckpt is None else ckpt.step


def kubectl_row(cluster: LocalCluster) -> dict[str, str]:
    """``kubectl get rlrun demo -o wide`` as ``{column: value}`` (an empty cell, e.g. QUEUE of a run Kueue does not
    manage, is ``""``): kubectl aligns each column under its header, so the row is cut where the headers start."""
    header, row = cluster.kubectl("get", "rlrun", NAME, "-o", "wide").splitlines()[:2]
    starts = [m.start() for m in re.finditer(r"\S+", header)]
    ends = [*starts[1:], None]
    return {header[a:b].strip(): row[a:b].strip() for a, b in zip(starts, ends, strict=True)}


def attempt_pods_ready(cluster: LocalCluster, attempt: int, after: float) -> float | None:
    """When every pod of ``attempt`` started after ``after`` was ready (the last one's time), or None."""
    ready: dict[str, float] = {}
    for t, what in cluster.timeline:
        if t >= after and what.startswith("pod ") and what.endswith(" ready"):
            pod = what.split()[1]
            if f"-a{attempt}" in pod:
                ready.setdefault(pod, t)
    started = {w.split()[1] for t, w in cluster.timeline if t >= after and " started on " in w and f"-a{attempt}" in w}
    return max(ready.values()) if started and started <= set(ready) else None


def preemption_cost(cluster: LocalCluster, notice: float, attempt: int) -> dict[str, float]:
    """A preemption's wall time split into stages, seconds: notice → pause answered → old pods gone →
    new pods ready → first batch shipped by the new attempt (from the timeline and ``metrics.jsonl``)."""
    paused = cluster.first(f"run {NAME} stage Stopping", notice)
    # the kubelet stand-in removing the last of the old attempt's pods (the Starting stage is too short to see)
    removed = [
        t
        for t, what in cluster.timeline
        if t >= notice and what.startswith("pod ") and what.endswith(" deleted") and f"-a{attempt - 1}" in what
    ]
    gone = max(removed, default=None)
    ready = attempt_pods_ready(cluster, attempt, notice)
    first_batch = next((m["time"] for m in metrics(cluster) if m["time"] > notice and m["attempt"] >= attempt), None)
    points = [("pause_answered", paused), ("pods_gone", gone), ("new_pods_ready", ready), ("first_batch", first_batch)]
    return _stages(cluster, notice, points)


def trainer_loss_cost(
    cluster: LocalCluster, notice: float, old: tuple[str, ...] = (f"{NAME}-trainer-a0",), recovery: int = 1
) -> dict[str, float]:
    """A trainer-only preemption's wall time split into stages, seconds: notice → old trainer signalled
    → old trainer gone → replacement started → the next optimizer step (the first ``trained`` event
    of the trainer ledger after the replacement started).

    ``old``: the trainer pods replaced (every node's pod of a multi-node trainer: the stages then end
    at the first one signalled, the last one gone and the last replacement started), each replaced by
    ``<pod>-r<recovery>``."""
    # SIGTERM by the operator's deletion, or by the node's shutdown at the end of the notice
    signals = [cluster.first(f"pod {pod} SIG", notice) for pod in old] + [cluster.first("shutdown node", notice)]
    signalled = min((t for t in signals if t is not None), default=None)
    gone = _last([cluster.first(f"pod {pod} deleted", notice) for pod in old])
    started = _last([cluster.first(f"pod {pod}-r{recovery} started", notice) for pod in old])
    ledger = run_dir(cluster) / "ledger" / "attempt-0.trainer.jsonl"
    trained = [json.loads(line) for line in ledger.read_text().splitlines() if line.endswith("}")]
    step = next((e["t"] for e in trained if e["e"] == "trained" and started is not None and e["t"] > started), None)
    points = [("trainer_signalled", signalled), ("trainer_gone", gone), ("replacement_started", started)]
    return _stages(cluster, notice, [*points, ("next_optimizer_step", step)])


def _last(times: list[float | None]) -> float | None:
    """The latest of ``times``, or None when one of them is None (that point was not reached)."""
    return None if None in times else max(t for t in times if t is not None)


def _stages(cluster: LocalCluster, start: float, points: list[tuple[str, float | None]]) -> dict[str, float]:
    """``{stage: seconds since the previous point}`` for ``(stage, time)`` points in order, plus ``total``."""
    out: dict[str, float] = {}
    last = start
    for name, t in points:
        assert t is not None, f"no {name} in the timeline: {cluster.timeline}"
        out[name] = round(t - last, 2)
        last = t
    out["total"] = round(last - start, 2)
    return out


def reward_tail(cluster: LocalCluster, steps: int = 10) -> float:
    """Mean reward of the last ``steps`` steps in ``metrics.jsonl`` (a resumed step counts once: its last line)."""
    by_step = {m["step"]: m["reward_mean"] for m in metrics(cluster)}
    tail = [by_step[s] for s in sorted(by_step)[-steps:]]
    return sum(tail) / len(tail)
