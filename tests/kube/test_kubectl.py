"""A user's session: the operator driven through the real kubectl, as the README's "Install on a cluster" shows."""

from __future__ import annotations

import json
import subprocess
import time

from tests.kube.conftest import NAMESPACE, ROOT
from tests.support.binaries import kubectl
from tests.support.fake_orchestrator import resume_report
from tests.support.polling import wait_for


def test_kubectl_apply_get_watch_suspend_and_delete(cluster):
    cluster.operator_only = False  # kubectl's own requests go to the same API

    def k(*args: str) -> str:
        done = subprocess.run(
            [str(kubectl()), "--kubeconfig", str(cluster.kubeconfig), *args], capture_output=True, text=True, timeout=30
        )
        assert done.returncode == 0, f"kubectl {' '.join(args)}: {done.stderr}"
        return done.stdout

    assert "rlrun.rlrun.dev/reverse-text created" in k(
        "apply", "--validate=false", "-f", str(ROOT / "examples" / "reverse-text.yaml")
    )
    selector = "-l=app.kubernetes.io/instance=reverse-text"
    wait_for(lambda: len(k("get", "pods", selector, "-o", "name").split()) == 3, what="3 pods")
    # the kubelet's part, done with kubectl: the rollout pod is ready
    pod = "reverse-text-rollout-0-a0"
    ready = {"status": {"phase": "Running", "podIP": "10.0.0.3", "conditions": [{"type": "Ready", "status": "True"}]}}
    k("patch", "pod", pod, "--subresource=status", "--type=merge", "-p", json.dumps(ready))
    orchestrator = "reverse-text-orchestrator-a0"
    k("patch", "pod", orchestrator, "--subresource=status", "--type=merge", "-p", json.dumps(ready))
    cluster.orchestrators.run(NAMESPACE, "reverse-text").status.update(step=7)

    def table() -> list[list[str]]:
        return [line.split() for line in k("get", "rlrun").splitlines()]

    rows = wait_for(lambda: (t := table()) and t[1][1:3] == ["Running", "7"] and t, what="kubectl get rlrun: Running 7")
    assert rows[0] == ["NAME", "PHASE", "STEP", "PROGRESS", "ETA", "RESUMED", "PREEMPTIONS", "AGE"]
    assert rows[1][:7] == ["reverse-text", "Running", "7", "7%", "-", "0", "0"]  # of 100 steps; no rate yet
    conditions = json.loads(k("get", "rlr", "reverse-text", "-o", "json"))["status"]["conditions"]
    assert {c["type"]: c["status"] for c in conditions}["Ready"] == "True"

    # a preemption that restarts the attempt (the orchestrator's pod), as a user sees it (docs/operator.md shows
    # this output); Recovering lasts until the new orchestrator confirms what it restored
    fake = cluster.orchestrators.run(NAMESPACE, "reverse-text")
    disrupted = {
        "status": {"conditions": [{"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler"}]}
    }
    k("patch", "pod", orchestrator, "--subresource=status", "--type=merge", "-p", json.dumps(disrupted))
    during = wait_for(lambda: (t := k("get", "rlrun", "-o", "wide")) and "Recovering" in t and t, what="Recovering")
    assert during.split("\n")[0].split() == [
        "NAME",
        "PHASE",
        "STEP",
        "PROGRESS",
        "ETA",
        "RESUMED",
        "PREEMPTIONS",
        "AGE",
        "SAMPLES",
        "FAILURES",
        "CHECKPOINT",
        "ATTEMPT",
        "QUEUE",
    ]
    assert during.split("\n")[1].split()[6] == "1"  # counted as soon as it is seen
    wait_for(lambda: len(k("get", "pods", selector, "-l=rlrun.dev/attempt=1", "-o", "name").split()) == 3, what="a1")
    report = resume_report(open_groups=3, requested_groups=1, queued_traces=104, finished_episodes_kept=8)
    report = report.model_dump(mode="json")
    fake.status.update(phase="running", attempt=1, resume=report)
    for pod in ("reverse-text-orchestrator-a1", "reverse-text-rollout-0-a1"):
        k("patch", "pod", pod, "--subresource=status", "--type=merge", "-p", json.dumps(ready))
    after = wait_for(
        lambda: (t := table()) and t[1][1:7] == ["Running", "7", "7%", "-", "4", "1"] and t, what="Resumed 4"
    )
    described = k("describe", "rlrun", "reverse-text")
    assert "resumed at step 10 with 104 queued traces and 4 open groups (8 finished episodes kept)" in described
    print("\n" + during + "\n" + "\n".join(" ".join(r) for r in after) + "\n" + described)

    watch = subprocess.Popen(
        [str(kubectl()), "--kubeconfig", str(cluster.kubeconfig), "get", "rlrun", "-w"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        time.sleep(0.5)
        k("patch", "rlrun", "reverse-text", "--type=merge", "-p", '{"spec":{"suspend":true}}')
        wait_for(lambda: k("get", "pods", selector, "-o", "name").strip() == "", what="pods removed")
        wait_for(lambda: table()[1][1] == "Suspended", what="Suspended")
        time.sleep(0.3)
    finally:
        watch.terminate()
        seen, _ = watch.communicate(timeout=10)
    assert any(line.split()[:2] == ["reverse-text", "Suspended"] for line in seen.splitlines()), seen

    assert 'rlrun.rlrun.dev "reverse-text" deleted' in k("delete", "rlrun", "reverse-text")
    wait_for(lambda: "reverse-text" not in k("get", "rlrun"), what="the RLRun gone")
    assert k("get", "configmaps", selector, "-o", "name").strip() == ""  # owned objects garbage-collected
    assert k("get", "pvc", "-o", "name").strip() == "persistentvolumeclaim/reverse-text-run"  # retained
