"""The preemption protocol end to end against the API emulator: the real operator, fake orchestrators.

The tests play the kubelet and the node lifecycle controller: they schedule pods onto Node
objects, add ``DisruptionTarget`` conditions and taints, and finish graceful deletions
(``KubeServer.expire_pod_deletions``) — so "wait until the old pods are gone" is tested.

Which pods restart depends on which were lost (``recovery.scope_of``): the trainer alone (on
node-a, the rest on node-b: :func:`running_run`) is replaced within its attempt; the trainer
together with the orchestrator (``orchestrator_node="node-a"``) restarts the attempt.
"""

from __future__ import annotations

import datetime as dt
import socket
import time

import pytest
from rlrun_operator import handlers

from tests.kube.conftest import NAMESPACE
from tests.support.fake_orchestrator import resume_report
from tests.support.manifests import manifest
from tests.support.polling import wait_for

LATER = dt.datetime.now(dt.timezone.utc) + dt.timedelta(days=1)


def add_node(cluster, name: str, taints=()) -> None:
    node = {"metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}}, "spec": {"taints": list(taints)}}
    cluster.kube.create("nodes", node)


def schedule(cluster, component: str, node: str, ip: str, index: int = 0, ready: bool = True) -> dict:
    """The scheduler's and kubelet's part: the pod bound to ``node``, Running (Ready) at ``ip``."""
    pod = cluster.pod(component, index=index)
    cluster.kube.patch("pods", pod["metadata"]["name"], {"spec": {"nodeName": node}}, NAMESPACE)
    cluster.set_pod_status(pod, ip=ip, ready=ready)
    return cluster.kube.get("pods", pod["metadata"]["name"], NAMESPACE)


def disrupt(cluster, pod: dict, reason: str = "TerminationByKubelet", status: str = "True") -> None:
    conditions = [{"type": "Ready", "status": "True"}, {"type": "DisruptionTarget", "status": status, "reason": reason}]
    cluster.kube.patch(
        "pods", pod["metadata"]["name"], {"status": {"conditions": conditions}}, NAMESPACE, subresource="status"
    )


def running_run(cluster, orchestrator_node: str = "node-b", **spec) -> object:
    """A run at attempt 0 with every pod scheduled (trainer on node-a, rollout pods on node-b, the orchestrator
    on ``orchestrator_node``) and Running."""
    add_node(cluster, "node-a")
    add_node(cluster, "node-b")
    cluster.kube.create("rlruns", manifest(**spec), NAMESPACE)
    replicas = spec.get("rollout", {}).get("replicas", 1)
    wait_for(lambda: len(cluster.pods()) == 2 + replicas, what="pods")
    fake = cluster.orchestrators.run(NAMESPACE, "demo")
    schedule(cluster, "trainer", "node-a", "10.0.1.1")
    for i in range(replicas):
        schedule(cluster, "rollout", "node-b", f"10.0.2.{i}", index=i)
    schedule(cluster, "orchestrator", orchestrator_node, "10.0.0.2")
    wait_for(lambda: (c := cluster.condition("Ready")) and c["status"] == "True", what="Ready")
    return fake


def attempt_pods(cluster, attempt: int) -> list[dict]:
    return [p for p in cluster.pods() if p["metadata"]["labels"]["rlrun.dev/attempt"] == str(attempt)]


def finish_old_pods(cluster, attempt: int = 0) -> None:
    """Once the operator deleted every pod of ``attempt``, play their kubelets: the deletions finish."""
    wait_for(
        lambda: all(p["metadata"].get("deletionTimestamp") for p in attempt_pods(cluster, attempt)),
        what=f"attempt {attempt}'s pods terminating",
    )
    cluster.kube.expire_pod_deletions(at=LATER)


def node_rule(pod: dict) -> list:
    terms = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    return [t["matchExpressions"][-1] for t in terms]


def confirm_resume(fake, attempt: int = 1) -> None:
    report = resume_report(open_groups=3, requested_groups=1, queued_traces=104, finished_episodes_kept=8)
    report = report.model_dump(mode="json")
    fake.status.update(phase="running", attempt=attempt, resume=report)


def test_a_lost_node_of_the_trainer_and_orchestrator_pauses_stops_and_resumes_the_run_off_it(cluster):
    # the node's notice reaches the trainer first: the orchestrator on the same node is lost with it
    fake = running_run(cluster, orchestrator_node="node-a")
    trainer = cluster.pod("trainer")
    disrupt(cluster, trainer)
    preempted = wait_for(
        lambda: (c := cluster.condition("Preempted")) and c["status"] == "True" and c, what="Preempted"
    )
    assert preempted["reason"] == "DisruptionTarget"
    assert "demo-trainer-a0" in preempted["message"] and "node-a" in preempted["message"]
    wait_for(lambda: all(p["metadata"].get("deletionTimestamp") for p in cluster.pods()), what="old pods terminating")
    assert fake.pauses == 1
    status = cluster.status()
    assert (status["phase"], status["preemptions"], status["recovery"]["stage"]) == ("Recovering", 1, "Stopping")
    assert status["failedNodes"] == ["node-a"] and status.get("failures", 0) == 0
    time.sleep(0.5)  # the old pods are still terminating: nothing of attempt 1 may exist yet
    assert attempt_pods(cluster, 1) == []
    cluster.kube.expire_pod_deletions(at=LATER)  # the kubelets finish
    wait_for(lambda: len(attempt_pods(cluster, 1)) == 3, what="attempt 1 pods")
    assert attempt_pods(cluster, 0) == []
    for pod in attempt_pods(cluster, 1):
        command = pod["spec"]["containers"][0]["command"]
        if "--attempt" in command:  # trainer and orchestrator (a rollout server keeps no state)
            assert "--resume" in command and command[command.index("--attempt") + 1] == "1"
        assert node_rule(pod) == [{"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["node-a"]}]
    ready = wait_for(lambda: (c := cluster.condition("Ready")) and c["reason"] == "Resuming" and c, what="Resuming")
    assert ready["status"] == "False"
    confirm_resume(fake)
    resumed = wait_for(lambda: (c := cluster.condition("Resumed")) and c["status"] == "True" and c, what="Resumed")
    assert (
        resumed["message"]
        == "attempt 1 resumed at step 10 with 104 queued traces and 4 open groups (8 finished episodes kept)"
    )
    status = cluster.status()
    assert "recovery" not in status and status["lastResume"]["attempt"] == 1 and status["resumedGroups"] == 4
    assert cluster.condition("Preempted")["status"] == "False" and status["preemptions"] == 1
    events = cluster.wait_for_events("Preempted", "Paused", "Recreated", "Resumed")
    assert [e["reason"] for e in events].count("Preempted") == 1


def test_a_blocked_eviction_flipping_back_to_false_does_nothing(cluster):
    fake = running_run(cluster)
    disrupt(cluster, cluster.pod("trainer"), reason="EvictionByEvictionAPI", status="False")
    time.sleep(0.5)
    assert fake.pauses == 0 and "recovery" not in cluster.status() and cluster.status().get("preemptions") == 0


def lose_node_a(cluster, change: str) -> None:
    """The node controller's part when node-a dies without notice: unreachable (or Karpenter's taint), or deleted."""
    if change == "deleted":
        cluster.kube.delete("nodes", "node-a")
    else:
        key = {"unreachable": "node.kubernetes.io/unreachable", "karpenter": "karpenter.sh/disrupted"}[change]
        cluster.kube.patch("nodes", "node-a", {"spec": {"taints": [{"key": key, "effect": "NoExecute"}]}})


def force_deleted(cluster) -> list[str]:
    return [
        r.name
        for r in cluster.kube.requests
        if r.rbac == ("", "pods", "delete") and r.param("gracePeriodSeconds") == "0"
    ]


def uids(cluster, *names: str) -> dict[str, str | None]:
    return {n: (cluster.kube.get("pods", n, NAMESPACE) or {}).get("metadata", {}).get("uid") for n in names}


def command_of(pod: dict) -> list[str]:
    return pod["spec"]["containers"][0]["command"]


@pytest.mark.parametrize(
    ("change", "trigger", "reason"),
    [
        ("unreachable", "NodeTainted", "node.kubernetes.io/unreachable"),
        ("karpenter", "NodeTainted", "karpenter.sh/disrupted"),
        ("deleted", "NodeGone", "NodeDeleted"),
    ],
)
def test_the_trainers_node_crashing_replaces_only_the_trainer_once_it_is_force_deleted(
    cluster, monkeypatch, change, trigger, reason
):
    monkeypatch.setattr(
        handlers.STATE.reconciler, "settings", handlers.SETTINGS.model_copy(update={"force_delete_after_seconds": 0})
    )
    grace = {"snapshot_timeout_seconds": 1, "termination_grace_period_seconds": 2}
    fake = running_run(cluster, preemption=grace)
    kept = uids(cluster, "demo-orchestrator-a0", "demo-rollout-0-a0")
    lose_node_a(cluster, change)
    preempted = wait_for(
        lambda: (c := cluster.condition("Preempted")) and c["status"] == "True" and c, what="Preempted"
    )
    assert preempted["reason"] == trigger and reason in cluster.status()["recovery"]["reason"]
    assert cluster.status()["recovery"]["scope"] == "trainer"
    # nobody finishes the trainer's deletion on a dead node: the operator forces it after the grace period,
    # and only then starts its replacement (two trainers never write the run directory at once)
    replacement = wait_for(lambda: cluster.kube.get("pods", "demo-trainer-a0-r1", NAMESPACE), timeout=15, what="r1")
    assert cluster.kube.get("pods", "demo-trainer-a0", NAMESPACE) is None
    assert force_deleted(cluster) == ["demo-trainer-a0"]
    argv = command_of(replacement)
    assert argv[:2] == ["rlrun", "trainer"] and argv[argv.index("--attempt") + 1] == "0" and "--resume" in argv
    assert node_rule(replacement) == [{"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["node-a"]}]
    # the replacement runs (on node-b): done
    cluster.kube.patch("pods", "demo-trainer-a0-r1", {"spec": {"nodeName": "node-b"}}, NAMESPACE)
    cluster.set_pod_status(replacement, ip="10.0.1.9")
    wait_for(lambda: (c := cluster.condition("Resumed")) and c["status"] == "True", what="Resumed")
    status = cluster.status()
    assert (status["preemptions"], status["attempt"], status["failedNodes"]) == (1, 0, ["node-a"])
    assert fake.pauses == 0 and uids(cluster, *kept) == kept  # the orchestrator and vLLM kept running
    deleted = {r.name for r in cluster.kube.requests if r.rbac == ("", "pods", "delete")}
    assert deleted == {"demo-trainer-a0"}


def test_a_node_crash_taking_the_trainer_and_orchestrator_restarts_the_attempt(cluster, monkeypatch):
    monkeypatch.setattr(
        handlers.STATE.reconciler, "settings", handlers.SETTINGS.model_copy(update={"force_delete_after_seconds": 0})
    )
    grace = {"snapshot_timeout_seconds": 1, "termination_grace_period_seconds": 2}
    fake = running_run(cluster, orchestrator_node="node-a", preemption=grace)
    lose_node_a(cluster, "unreachable")
    wait_for(lambda: (c := cluster.condition("Preempted")) and c["status"] == "True", what="Preempted")
    assert cluster.status()["recovery"]["scope"] == "attempt"
    wait_for(lambda: not cluster.kube.get("pods", "demo-trainer-a0", NAMESPACE), timeout=15, what="force delete")
    finish_old_pods(cluster)  # the rollout pod on node-b: its kubelet finishes
    wait_for(lambda: len(attempt_pods(cluster, 1)) == 3, what="attempt 1 pods")
    assert sorted(force_deleted(cluster)) == ["demo-orchestrator-a0", "demo-trainer-a0"]
    assert fake.pauses == 0  # the orchestrator was lost: nobody to pause (it pauses itself on SIGTERM if it can)
    assert cluster.status()["preemptions"] == 1 and cluster.status()["failedNodes"] == ["node-a"]


def spot_notice(cluster, pod: dict, node: str = "node-a") -> None:
    """A spot interruption with graceful node shutdown, as the e2e harness sends it: the node's taint and
    ``DisruptionTarget`` (``TerminationByKubelet``) on its pod at once."""
    taint = {"key": "aws-node-termination-handler/spot-itn", "effect": "NoSchedule"}
    cluster.kube.patch("nodes", node, {"spec": {"taints": [taint]}})
    disrupt(cluster, pod)


def run_replacement(cluster, name: str = "demo-trainer-a0-r1", node: str = "node-b") -> dict:
    """The scheduler's and kubelet's part for a replacement pod: bound to ``node`` and Running."""
    cluster.kube.patch("pods", name, {"spec": {"nodeName": node}}, NAMESPACE)
    cluster.set_pod_status(cluster.kube.get("pods", name, NAMESPACE), ip="10.0.1.9")
    return cluster.kube.get("pods", name, NAMESPACE)


def test_the_trainers_node_lost_with_notice_replaces_only_the_trainer_in_the_same_attempt(cluster):
    fake = running_run(cluster)
    wait_for(lambda: fake.endpoint_puts, what="endpoints sent")
    kept = uids(cluster, "demo-orchestrator-a0", "demo-rollout-0-a0")
    puts = len(fake.endpoint_puts)
    spot_notice(cluster, cluster.pod("trainer"))
    preempted = wait_for(
        lambda: (c := cluster.condition("Preempted")) and c["status"] == "True" and c, what="Preempted"
    )
    assert "demo-trainer-a0" in preempted["message"] and "node-a" in preempted["message"]
    wait_for(lambda: cluster.pod("trainer")["metadata"].get("deletionTimestamp"), what="the trainer terminating")
    status = cluster.status()
    assert (status["recovery"]["scope"], status["recovery"]["stage"], status["phase"]) == (
        "trainer",
        "Stopping",
        "Recovering",
    )
    assert (status["preemptions"], status.get("failures"), status["attempt"]) == (1, 0, 0)
    assert (cluster.condition("Ready")["status"], cluster.condition("Ready")["reason"]) == ("False", "Resuming")
    time.sleep(0.5)  # the old trainer is still terminating: its replacement must not exist yet
    assert cluster.kube.get("pods", "demo-trainer-a0-r1", NAMESPACE) is None
    cluster.kube.expire_pod_deletions(at=LATER)  # its kubelet finishes (the trainer exited on SIGTERM)
    replacement = wait_for(lambda: cluster.kube.get("pods", "demo-trainer-a0-r1", NAMESPACE), what="the replacement")
    labels = replacement["metadata"]["labels"]
    assert (labels["app.kubernetes.io/component"], labels["rlrun.dev/attempt"]) == ("trainer", "0")
    uid = cluster.rlrun()["metadata"]["uid"]
    assert command_of(replacement) == [
        "rlrun",
        "trainer",
        "/etc/rlrun/rlrun.yaml",
        "--run-dir",
        "/var/lib/rlrun/run",
        "--cache-dir",
        "/var/lib/rlrun/cache",
        "--attempt",
        "0",
        "--run-uid",
        uid,
        "--resume",
    ]
    assert node_rule(replacement) == [{"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["node-a"]}]
    wait_for(lambda: cluster.status()["recovery"]["stage"] == "Resuming", what="Resuming")
    assert cluster.status()["phase"] == "Recovering" and cluster.condition("Ready")["reason"] == "Resuming"
    run_replacement(cluster)
    resumed = wait_for(lambda: (c := cluster.condition("Resumed")) and c["status"] == "True" and c, what="Resumed")
    assert resumed["message"] == (
        "attempt 0 goes on: only the trainer was replaced (demo-trainer-a0 by demo-trainer-a0-r1); the trainer "
        "resumes with --resume from the newest complete checkpoint, the orchestrator and the other rollout servers "
        "kept running"
    )
    wait_for(lambda: cluster.status().get("phase") == "Running", what="Running again")
    status = cluster.status()
    assert "recovery" not in status and (status["preemptions"], status["attempt"]) == (1, 0)
    assert status["failedNodes"] == ["node-a"] and status["resumedGroups"] == 0 and "lastResume" not in status
    assert cluster.condition("Preempted")["status"] == "False" and cluster.condition("Ready")["status"] == "True"
    # the orchestrator was never paused, nor its pods or the rollout pods touched; its endpoints never changed
    assert fake.pauses == 0 and uids(cluster, *kept) == kept
    assert {r.name for r in cluster.kube.requests if r.rbac == ("", "pods", "delete")} == {"demo-trainer-a0"}
    created = [r for r in cluster.kube.requests if r.rbac == ("", "pods", "create") and r.status == 201]
    assert len(created) == 4  # attempt 0's three pods, then the replacement alone
    assert fake.endpoint_puts[puts:] == [] and fake.endpoint_puts[-1] == ["http://10.0.2.0:8000"]
    events = cluster.wait_for_events("Preempted", "Recreated", "Resumed")
    reasons = [e["reason"] for e in events]
    assert reasons.count("Preempted") == 1 and "Paused" not in reasons and "PauseFailed" not in reasons
    recreated = next(e for e in events if e["reason"] == "Recreated")
    assert recreated["message"] == (
        "replaced demo-trainer-a0 by demo-trainer-a0-r1 with --resume; attempt 0 goes on, kept off node-a"
    )
    assert next(e for e in events if e["reason"] == "Resumed")["message"] == resumed["message"]


def test_a_crashed_trainer_is_replaced_alone_and_counted_as_a_failure(cluster):
    fake = running_run(cluster, failure_policy={"backoff_limit": 1})
    kept = uids(cluster, "demo-orchestrator-a0", "demo-rollout-0-a0")
    cluster.exit_pod(cluster.pod("trainer"), outcome="error", code=1, step=7)
    degraded = wait_for(lambda: (c := cluster.condition("Degraded")) and c["status"] == "True" and c, what="Degraded")
    assert degraded["reason"] == "PodFailed" and "demo-trainer-a0" in degraded["message"]
    status = cluster.status()
    assert (status["failures"], status["preemptions"], status["recovery"]["scope"]) == (1, 0, "trainer")
    assert "failedNodes" not in status  # its node is fine
    cluster.kube.expire_pod_deletions(at=LATER)
    replacement = wait_for(lambda: cluster.kube.get("pods", "demo-trainer-a0-r1", NAMESPACE), what="the replacement")
    assert "affinity" not in replacement["spec"] and "--resume" in command_of(replacement)
    run_replacement(cluster, node="node-a")
    wait_for(lambda: (c := cluster.condition("Resumed")) and c["status"] == "True", what="Resumed")
    wait_for(lambda: cluster.condition("Degraded")["status"] == "False", what="Degraded cleared")
    assert fake.pauses == 0 and uids(cluster, *kept) == kept and cluster.status()["attempt"] == 0
    # the budget holds across replacements: one more crash than backoff_limit ends the run
    cluster.exit_pod(cluster.kube.get("pods", "demo-trainer-a0-r1", NAMESPACE), outcome="error", code=1, step=8)
    failed = wait_for(lambda: (c := cluster.condition("Failed")) and c["status"] == "True" and c, what="Failed")
    assert failed["reason"] == "BackoffLimitExceeded" and cluster.status()["failures"] == 2


def test_the_orchestrator_lost_while_the_trainer_is_replaced_restarts_the_attempt(cluster):
    fake = running_run(cluster)
    spot_notice(cluster, cluster.pod("trainer"))
    wait_for(lambda: (cluster.status().get("recovery") or {}).get("scope") == "trainer", what="trainer scope")
    wait_for(lambda: cluster.pod("trainer")["metadata"].get("deletionTimestamp"), what="the trainer terminating")
    disrupt(cluster, cluster.pod("orchestrator"), reason="PreemptionByScheduler")  # before the trainer is gone
    wait_for(lambda: (cluster.status().get("recovery") or {}).get("scope") == "attempt", what="attempt scope")
    assert cluster.status()["preemptions"] == 2  # two losses, each counted once
    finish_old_pods(cluster)
    wait_for(lambda: len(attempt_pods(cluster, 1)) == 3, what="attempt 1 pods")
    created = [r for r in cluster.kube.requests if r.rbac == ("", "pods", "create") and r.status == 201]
    assert len(created) == 6  # attempts 0 and 1: the trainer's replacement was never created
    confirm_resume(fake)
    wait_for(lambda: (c := cluster.condition("Resumed")) and c["status"] == "True", what="Resumed")
    assert cluster.status()["attempt"] == 1 and fake.pauses == 0


@pytest.mark.parametrize("stage", ["Stopping", "Starting", "Resuming"])
def test_an_operator_killed_while_replacing_the_trainer_finishes_it_exactly_once(cluster, stage):
    fake = running_run(cluster)
    kept = uids(cluster, "demo-orchestrator-a0", "demo-rollout-0-a0")
    spot_notice(cluster, cluster.pod("trainer"))
    late = stage != "Stopping"  # the old trainer's kubelet must finish for the recovery to get there

    def reached():
        if late:
            cluster.kube.expire_pod_deletions(at=LATER)
        return (cluster.status().get("recovery") or {}).get("stage") in (stage, *_after(stage))

    wait_for(reached, what=stage)
    cluster.operator.stop()  # killed: whatever it recorded is all a new process knows
    recovery = dict(cluster.status()["recovery"])
    assert recovery["scope"] == "trainer"
    recovery["stage"] = stage  # put back as the killed operator left it: this stage recorded, its action not taken
    if stage != "Resuming" and cluster.kube.get("pods", "demo-trainer-a0-r1", NAMESPACE):
        cluster.kube.delete("pods", "demo-trainer-a0-r1", NAMESPACE, {"gracePeriodSeconds": 0})
    cluster.kube.patch("rlruns", "demo", {"status": {"recovery": recovery}}, NAMESPACE, subresource="status")
    cluster.kube.clear_requests()
    cluster.restart_operator()
    cluster.kube.expire_pod_deletions(at=LATER)
    wait_for(lambda: cluster.kube.get("pods", "demo-trainer-a0-r1", NAMESPACE), what="the replacement")
    run_replacement(cluster)
    wait_for(lambda: (c := cluster.condition("Resumed")) and c["status"] == "True", what="Resumed")
    status = cluster.status()
    assert (status["preemptions"], status["attempt"]) == (1, 0)  # counted once, the same attempt
    created = [r for r in cluster.kube.requests if r.rbac == ("", "pods", "create") and r.status == 201]
    assert len(created) == (0 if stage == "Resuming" else 1)  # the replacement, created once
    assert {p["metadata"]["name"] for p in cluster.pods()} == {
        "demo-orchestrator-a0",
        "demo-rollout-0-a0",
        "demo-trainer-a0-r1",
    }
    assert fake.pauses == 0 and uids(cluster, *kept) == kept


def test_losing_a_rollout_pod_replaces_only_it(cluster):
    fake = running_run(cluster, rollout={"replicas": 2})
    keep = {c: cluster.pod(c)["metadata"]["uid"] for c in ("trainer", "orchestrator")}
    wait_for(lambda: fake.endpoint_puts and len(fake.endpoint_puts[-1]) == 2, what="two endpoints")
    disrupt(cluster, cluster.pod("rollout", index=1), reason="PreemptionByScheduler")
    wait_for(lambda: cluster.kube.get("pods", "demo-rollout-1-a0-r1", NAMESPACE), what="the replacement")
    assert fake.pauses == 0 and cluster.status()["attempt"] == 0 and cluster.status()["preemptions"] == 1
    assert {c: cluster.pod(c)["metadata"]["uid"] for c in ("trainer", "orchestrator")} == keep
    replacement = cluster.kube.get("pods", "demo-rollout-1-a0-r1", NAMESPACE)
    assert replacement["metadata"]["labels"]["rlrun.dev/rollout-index"] == "1"
    assert replacement["metadata"]["labels"]["rlrun.dev/attempt"] == "0"
    # the lost server leaves the orchestrator's endpoint set at once; the replacement joins once ready
    wait_for(lambda: fake.endpoint_puts[-1] == ["http://10.0.2.0:8000"], what="the lost endpoint dropped")
    cluster.kube.expire_pod_deletions(at=LATER)
    cluster.kube.patch("pods", "demo-rollout-1-a0-r1", {"spec": {"nodeName": "node-b"}}, NAMESPACE)
    cluster.set_pod_status(cluster.kube.get("pods", "demo-rollout-1-a0-r1", NAMESPACE), ip="10.0.2.9")
    wait_for(lambda: fake.endpoint_puts[-1] == ["http://10.0.2.0:8000", "http://10.0.2.9:8000"], what="replacement in")
    assert "recovery" not in cluster.status() and cluster.condition("Preempted")["status"] == "False"


def test_an_orchestrator_deleted_by_hand_is_recreated_as_the_next_attempt(cluster):
    fake = running_run(cluster)
    cluster.kube.delete("pods", "demo-orchestrator-a0", NAMESPACE, {"gracePeriodSeconds": 0})  # gone at once
    wait_for(lambda: cluster.status().get("preemptions") == 1, what="counted")
    assert cluster.status()["recovery"]["trigger"] in ("PodMissing", "PodDeleted")
    finish_old_pods(cluster)
    wait_for(lambda: len(attempt_pods(cluster, 1)) == 3, what="attempt 1 pods")
    confirm_resume(fake)
    wait_for(lambda: (c := cluster.condition("Resumed")) and c["status"] == "True", what="Resumed")


def test_an_orchestrator_exiting_0_after_a_pause_is_not_success(cluster):
    running_run(cluster)
    cluster.exit_pod(cluster.pod("orchestrator"), outcome="paused", step=7)
    preempted = wait_for(
        lambda: (c := cluster.condition("Preempted")) and c["status"] == "True" and c, what="Preempted"
    )
    assert preempted["reason"] == "ExitedEarly" and cluster.status()["phase"] != "Succeeded"
    finish_old_pods(cluster)
    wait_for(lambda: len(attempt_pods(cluster, 1)) == 3, what="attempt 1 pods")


def test_only_pods_the_run_owns_are_its_pods(cluster):
    fake = running_run(cluster)
    wait_for(lambda: fake.endpoint_puts and fake.endpoint_puts[-1] == ["http://10.0.2.0:8000"], what="endpoints")
    labels = {
        "app.kubernetes.io/instance": "demo",
        "app.kubernetes.io/managed-by": "rlrun-operator",
        "rlrun.dev/attempt": "0",
    }
    for component, name in (("rollout", "demo-rollout-9-a0"), ("orchestrator", "impostor")):
        pod = {
            "metadata": {"name": name, "labels": {**labels, "app.kubernetes.io/component": component}},
            "spec": {"containers": [{"name": "c", "image": "x"}]},
        }
        cluster.kube.create("pods", pod, NAMESPACE)
    cluster.set_pod_status(cluster.kube.get("pods", "demo-rollout-9-a0", NAMESPACE), ip="10.6.6.6")
    cluster.exit_pod(cluster.kube.get("pods", "impostor", NAMESPACE))
    time.sleep(0.6)
    assert all("10.6.6.6" not in " ".join(put) for put in fake.endpoint_puts)
    assert cluster.status()["phase"] == "Running" and "recovery" not in cluster.status()


@pytest.mark.parametrize("stage", ["Pausing", "Stopping", "Starting", "Resuming"])
def test_an_operator_killed_at_any_stage_finishes_the_recovery_exactly_once(cluster, stage):
    fake = running_run(cluster, orchestrator_node="node-a")  # the attempt restarts (and pauses first)
    disrupt(cluster, cluster.pod("trainer"))
    late = stage in ("Starting", "Resuming")  # the old pods' kubelets must finish for the recovery to get there

    def reached():
        if late:
            cluster.kube.expire_pod_deletions(at=LATER)
        return (cluster.status().get("recovery") or {}).get("stage") in (stage, *_after(stage))

    wait_for(reached, what=stage)
    cluster.operator.stop()  # killed: whatever it recorded is all a new process knows
    recovery = dict(cluster.status()["recovery"])
    # put the run back as the killed operator left it: this stage recorded, its action not taken
    recovery["stage"] = stage
    if stage != "Resuming":  # attempt 1 not created yet
        for pod in attempt_pods(cluster, 1):
            cluster.kube.delete("pods", pod["metadata"]["name"], NAMESPACE, {"gracePeriodSeconds": 0})
    attempt = 1 if stage == "Resuming" else 0
    recovery["nextAttempt"] = 1 if stage != "Pausing" else None
    cluster.kube.patch(
        "rlruns", "demo", {"status": {"recovery": recovery, "attempt": attempt}}, NAMESPACE, subresource="status"
    )
    before_pauses = fake.pauses
    cluster.kube.clear_requests()
    cluster.restart_operator()
    cluster.kube.expire_pod_deletions(at=LATER)
    wait_for(lambda: len(attempt_pods(cluster, 1)) == 3 and not attempt_pods(cluster, 0), what="attempt 1 only")
    wait_for(
        lambda: cluster.kube.expire_pod_deletions(at=LATER) == [] and cluster.status().get("attempt") == 1,
        what="settled",
    )
    confirm_resume(fake)
    wait_for(lambda: (c := cluster.condition("Resumed")) and c["status"] == "True", what="Resumed")
    status = cluster.status()
    assert (status["preemptions"], status["attempt"]) == (1, 1)  # counted once, one new attempt
    created = [r for r in cluster.kube.requests if r.rbac == ("", "pods", "create") and r.status == 201]
    assert len(created) == (0 if stage == "Resuming" else 3)  # attempt 1's pods, created once
    assert {p["metadata"]["labels"]["rlrun.dev/attempt"] for p in cluster.pods()} == {"1"}
    assert fake.pauses - before_pauses <= (1 if stage == "Pausing" else 0)  # a pause is never sent twice
    assert len(attempt_pods(cluster, 1)) == 3


def _after(stage: str) -> tuple[str, ...]:
    order = ["Pausing", "Stopping", "Starting", "Resuming"]
    return tuple(order[order.index(stage) + 1 :])


def test_a_status_tick_racing_a_recovery_loses_no_count_or_decision(cluster):
    fake = running_run(cluster, orchestrator_node="node-a")
    fake.pause_delay = 1.0  # five ticks of the status timer while the pause is answered
    disrupt(cluster, cluster.pod("trainer"))
    for step in range(1, 6):
        fake.status["step"] = step
        time.sleep(0.2)
    wait_for(lambda: (cluster.status().get("recovery") or {}).get("stage") == "Stopping", what="Stopping")
    status = cluster.status()
    assert status["preemptions"] == 1 and status["phase"] == "Recovering" and fake.pauses == 1
    assert "snapshot at step 10" in status["recovery"]["pause"]
    assert cluster.condition("Preempted")["status"] == "True"


def test_the_control_secret_and_service_come_back_before_new_pods(cluster):
    fake = running_run(cluster, orchestrator_node="node-a")
    token = cluster.kube.get("secrets", "demo-control", NAMESPACE)["data"]["token"]
    cluster.kube.delete("secrets", "demo-control", NAMESPACE)
    cluster.kube.delete("services", "demo-orchestrator", NAMESPACE)
    fake.status["step"] = 5
    wait_for(lambda: cluster.status().get("step") == 5, what="status still moving")
    disrupt(cluster, cluster.pod("trainer"))
    finish_old_pods(cluster)
    wait_for(lambda: len(attempt_pods(cluster, 1)) == 3, what="attempt 1 pods")
    secret = cluster.kube.get("secrets", "demo-control", NAMESPACE)
    assert secret is not None and secret["data"]["token"] == token  # the token the orchestrator holds
    assert cluster.kube.get("services", "demo-orchestrator", NAMESPACE) is not None
    creates = [
        r.resource for r in cluster.kube.requests if r.rbac in (("", "secrets", "create"), ("", "pods", "create"))
    ]
    assert creates == ["secrets", *["pods"] * 3, "secrets", *["pods"] * 3]  # attempt 1's pods after the Secret


def test_a_reconcile_error_shows_in_a_condition(cluster, monkeypatch):
    running_run(cluster)

    async def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(handlers.STATE.reconciler, "observe", broken)
    degraded = wait_for(
        lambda: (c := cluster.condition("Degraded")) and c["reason"] == "ReconcileError" and c, what="error"
    )
    assert degraded["status"] == "True" and degraded["message"] == "RuntimeError: boom"


def test_deleting_a_run_whose_orchestrator_never_answers_is_quick(cluster, monkeypatch):
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)  # connections are accepted by the kernel and never answered
    url = f"http://127.0.0.1:{silent.getsockname()[1]}"
    settings = handlers.SETTINGS.model_copy(update={"orchestrator_url": url, "request_timeout_seconds": 60})
    monkeypatch.setattr(handlers.STATE.reconciler, "settings", settings)
    try:
        cluster.kube.create("rlruns", manifest(), NAMESPACE)
        wait_for(lambda: len(cluster.pods()) == 3, what="pods")
        cluster.run_orchestrator()
        time.sleep(0.5)  # a reconcile is now waiting on the silent orchestrator
        started = time.monotonic()
        cluster.kube.delete("rlruns", "demo", NAMESPACE)
        wait_for(lambda: cluster.rlrun() is None, timeout=20, what="the RLRun gone")
        assert time.monotonic() - started < 5
    finally:
        silent.close()


def test_a_pod_held_terminating_by_a_foreign_finalizer_is_named_once_and_waited_for(cluster, monkeypatch):
    monkeypatch.setattr(
        handlers.STATE.reconciler, "settings", handlers.SETTINGS.model_copy(update={"force_delete_after_seconds": 0})
    )
    running_run(cluster, preemption={"snapshot_timeout_seconds": 1, "termination_grace_period_seconds": 2})
    # another controller's hold on the trainer pod (a backup agent, a policy engine…)
    cluster.kube.patch("pods", "demo-trainer-a0", {"metadata": {"finalizers": ["example.com/hold"]}}, NAMESPACE)
    lose_node_a(cluster, "unreachable")
    degraded = wait_for(
        lambda: (c := cluster.condition("Degraded")) and c["reason"] == "PodStuckTerminating" and c, what="Degraded"
    )
    assert degraded["status"] == "True"
    assert "pod demo-trainer-a0 is held terminating by finalizers example.com/hold" in degraded["message"]
    time.sleep(2)  # status timer ticks and pod events: each reconcile finds the pod still there
    assert cluster.status()["recovery"]["stage"] == "Stopping"  # waiting, never a second trainer
    assert cluster.kube.get("pods", "demo-trainer-a0-r1", NAMESPACE) is None
    assert force_deleted(cluster) == ["demo-trainer-a0"]  # once, not at every reconcile
    stuck = [e for e in cluster.kube.list("events", NAMESPACE) if e.get("reason") == "PodStuckTerminating"]
    forced = [e for e in cluster.kube.list("events", NAMESPACE) if "force-deleted" in (e.get("message") or "")]
    assert (len(stuck), len(forced)) == (1, 1) and stuck[0]["type"] == "Warning"
    # its owner lets go: the pod goes, the replacement starts, and the condition is taken back
    cluster.kube.patch("pods", "demo-trainer-a0", {"metadata": {"finalizers": None}}, NAMESPACE)
    wait_for(lambda: cluster.kube.get("pods", "demo-trainer-a0-r1", NAMESPACE), what="the replacement")
    wait_for(lambda: cluster.condition("Degraded")["status"] == "False", what="Degraded False")
