"""The preemption protocol end to end against the API emulator: the real operator, fake orchestrators.

The tests play the kubelet and the node lifecycle controller: they schedule pods onto Node
objects, add ``DisruptionTarget`` conditions and taints, and finish graceful deletions
(``KubeServer.expire_pod_deletions``) — so "wait until the old pods are gone" is tested.
"""

from __future__ import annotations

import datetime as dt
import socket
import time

import pytest
from rlrun_operator import handlers

from tests.reconcile.conftest import NAMESPACE, manifest, wait_for
from tests.reconcile.fake_orchestrator import resume_report

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


def running_run(cluster, **spec) -> object:
    """A run at attempt 0 with every pod scheduled (trainer on node-a, the rest on node-b) and Running."""
    add_node(cluster, "node-a")
    add_node(cluster, "node-b")
    cluster.kube.create("rlruns", manifest(**spec), NAMESPACE)
    replicas = spec.get("rollout", {}).get("replicas", 1)
    wait_for(lambda: len(cluster.pods()) == 2 + replicas, what="pods")
    fake = cluster.orchestrators.run(NAMESPACE, "demo")
    schedule(cluster, "trainer", "node-a", "10.0.1.1")
    for i in range(replicas):
        schedule(cluster, "rollout", "node-b", f"10.0.2.{i}", index=i)
    schedule(cluster, "orchestrator", "node-b", "10.0.0.2")
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
    fake.status.update(phase="running", attempt=attempt, resume=report)


def test_a_disrupted_trainer_pauses_stops_and_resumes_the_run_off_its_node(cluster):
    fake = running_run(cluster)
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


@pytest.mark.parametrize(
    ("change", "trigger", "reason"),
    [
        ("unreachable", "NodeTainted", "node.kubernetes.io/unreachable"),
        ("karpenter", "NodeTainted", "karpenter.sh/disrupted"),
        ("deleted", "NodeGone", "NodeDeleted"),
    ],
)
def test_a_lost_node_is_a_preemption_and_stuck_pods_are_force_deleted(cluster, monkeypatch, change, trigger, reason):
    monkeypatch.setattr(
        handlers.STATE.reconciler, "settings", handlers.SETTINGS.model_copy(update={"force_delete_after_seconds": 0})
    )
    grace = {"snapshot_timeout_seconds": 1, "termination_grace_period_seconds": 2}
    fake = running_run(cluster, preemption=grace)
    if change == "deleted":
        cluster.kube.delete("nodes", "node-a")
    else:
        key = {"unreachable": "node.kubernetes.io/unreachable", "karpenter": "karpenter.sh/disrupted"}[change]
        cluster.kube.patch("nodes", "node-a", {"spec": {"taints": [{"key": key, "effect": "NoExecute"}]}})
    preempted = wait_for(
        lambda: (c := cluster.condition("Preempted")) and c["status"] == "True" and c, what="Preempted"
    )
    assert preempted["reason"] == trigger and reason in cluster.status()["recovery"]["reason"]
    # the orchestrator (on node-b) was alive: paused (Pausing is recorded before the call, so wait for it)
    wait_for(lambda: fake.pauses == 1, what="the pause")
    # the trainer's node is lost: nobody finishes its deletion, the operator forces it after the grace period
    wait_for(lambda: cluster.kube.get("pods", "demo-trainer-a0", NAMESPACE) is None, timeout=15, what="force delete")
    finish_old_pods(cluster)
    wait_for(lambda: len(attempt_pods(cluster, 1)) == 3, what="attempt 1 pods")
    forced = [
        r for r in cluster.kube.requests if r.rbac == ("", "pods", "delete") and r.param("gracePeriodSeconds") == "0"
    ]
    assert [r.name for r in forced] == ["demo-trainer-a0"]
    assert cluster.status()["preemptions"] == 1 and cluster.status()["failedNodes"] == ["node-a"]


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


def test_a_pod_deleted_by_hand_is_recreated_as_the_next_attempt(cluster):
    fake = running_run(cluster)
    cluster.kube.delete("pods", "demo-trainer-a0", NAMESPACE, {"gracePeriodSeconds": 0})  # gone at once
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
    fake = running_run(cluster)
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
    fake = running_run(cluster)
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
    fake = running_run(cluster)
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

    monkeypatch.setattr(handlers.STATE.reconciler, "_observe", broken)
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
