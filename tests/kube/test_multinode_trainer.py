"""A multi-node trainer against the API emulator: one pod per node, and a group that restarts together.

The real operator and a fake orchestrator, the tests playing the scheduler, kubelets and node lifecycle
(as in ``test_preemption.py``). A run with ``trainer.nodes: 2`` has pods ``demo-trainer-0-a0`` (node 0,
the rendezvous host, on node-c) and ``demo-trainer-1-a0`` (on node-a), a rollout pod and the orchestrator
on node-b, and the headless Service ``demo-trainer``. Losing **any** trainer pod is a trainer loss for
the whole group: every trainer pod is stopped, and only once all are gone does the group come back as
``-r<K>`` replacements with ``--resume`` in the same attempt; the orchestrator and vLLM keep running.
"""

from __future__ import annotations

import time

import pytest

from tests.kube.conftest import NAMESPACE
from tests.kube.test_preemption import (
    LATER,
    _after,
    add_node,
    attempt_pods,
    command_of,
    disrupt,
    node_rule,
    schedule,
    spot_notice,
    uids,
)
from tests.support.manifests import manifest
from tests.support.polling import wait_for

OLD = ["demo-trainer-0-a0", "demo-trainer-1-a0"]
NEW = ["demo-trainer-0-a0-r1", "demo-trainer-1-a0-r1"]
TWO_NODES = {"nodes": 2, "processes_per_node": 2}


def two_node_run(cluster, orchestrator_node: str = "node-b", **spec):
    """Attempt 0 of a 2-node trainer run, every pod scheduled and Running, the run Ready."""
    for node in ("node-a", "node-b", "node-c"):
        add_node(cluster, node)
    cluster.kube.create("rlruns", manifest(trainer=TWO_NODES, **spec), NAMESPACE)
    wait_for(lambda: len(cluster.pods()) == 4, what="4 pods")
    fake = cluster.orchestrators.run(NAMESPACE, "demo")
    schedule(cluster, "trainer", "node-c", "10.0.1.0", index=0)
    schedule(cluster, "trainer", "node-a", "10.0.1.1", index=1)
    schedule(cluster, "rollout", "node-b", "10.0.2.0")
    schedule(cluster, "orchestrator", orchestrator_node, "10.0.0.2")
    wait_for(lambda: (c := cluster.condition("Ready")) and c["status"] == "True", what="Ready")
    return fake


def run_pod(cluster, name: str, node: str, ip: str) -> None:
    """The scheduler's and kubelet's part for one pod: bound to ``node`` and Running."""
    cluster.kube.patch("pods", name, {"spec": {"nodeName": node}}, NAMESPACE)
    cluster.set_pod_status(cluster.kube.get("pods", name, NAMESPACE), ip=ip)


def pod(cluster, name: str) -> dict | None:
    return cluster.kube.get("pods", name, NAMESPACE)


def pods_created(cluster) -> int:
    return sum(1 for r in cluster.kube.requests if r.rbac == ("", "pods", "create") and r.status == 201)


def test_a_two_node_trainer_is_two_pods_behind_a_headless_service(cluster):
    two_node_run(cluster)
    trainers = sorted(
        (p for p in cluster.pods() if p["metadata"]["labels"]["app.kubernetes.io/component"] == "trainer"),
        key=lambda p: p["metadata"]["name"],
    )
    assert [p["metadata"]["name"] for p in trainers] == OLD
    uid = cluster.rlrun()["metadata"]["uid"]
    for node, trainer in enumerate(trainers):
        assert trainer["metadata"]["labels"]["rlrun.dev/trainer-node"] == str(node)
        assert (trainer["spec"]["hostname"], trainer["spec"]["subdomain"]) == (f"trainer-{node}", "demo-trainer")
        argv = command_of(trainer)
        assert argv[: argv.index("rlrun")] == [
            "torchrun",
            "--nnodes",
            "2",
            "--nproc-per-node",
            "2",
            "--node-rank",
            str(node),
            "--master-addr",
            "trainer-0.demo-trainer.team-a.svc",
            "--master-port",
            "29500",
            "--rdzv-conf",
            "timeout=1800",
            "--max-restarts",
            "0",
            "--no-python",
        ]
        assert argv[argv.index("rlrun") :] == [
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
    service = cluster.kube.get("services", "demo-trainer", NAMESPACE)
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert service["metadata"]["ownerReferences"][0]["uid"] == uid
    assert service["spec"]["selector"]["app.kubernetes.io/component"] == "trainer"
    assert cluster.status()["phase"] == "Running" and cluster.condition("Degraded")["status"] == "False"


def test_losing_trainer_node_1_with_notice_restarts_the_whole_trainer_group_in_the_same_attempt(cluster):
    fake = two_node_run(cluster)
    kept = uids(cluster, "demo-orchestrator-a0", "demo-rollout-0-a0")
    spot_notice(cluster, cluster.pod("trainer", index=1))  # node-a: trainer node 1 only
    preempted = wait_for(
        lambda: (c := cluster.condition("Preempted")) and c["status"] == "True" and c, what="Preempted"
    )
    assert "demo-trainer-1-a0" in preempted["message"] and "node-a" in preempted["message"]
    # node 0 on its healthy node-c is stopped too: the ranks of one group restart together
    wait_for(lambda: all(pod(cluster, n)["metadata"].get("deletionTimestamp") for n in OLD), what="both terminating")
    status = cluster.status()
    assert (status["recovery"]["scope"], status["recovery"]["pods"], status["phase"]) == ("trainer", OLD, "Recovering")
    assert (status["preemptions"], status.get("failures"), status["attempt"]) == (1, 0, 0)
    assert set(OLD) <= set(status["deletedPods"]) and status["failedNodes"] == ["node-a"]
    # no replacement while any old rank may still be in the group's collectives
    cluster.kube.finish_pod_deletion("demo-trainer-1-a0", NAMESPACE)
    time.sleep(0.5)
    assert [n for n in NEW if pod(cluster, n)] == []
    cluster.kube.finish_pod_deletion("demo-trainer-0-a0", NAMESPACE)
    replacements = [wait_for(lambda n=n: pod(cluster, n), what=n) for n in NEW]
    uid = cluster.rlrun()["metadata"]["uid"]
    for node, replacement in enumerate(replacements):
        labels = replacement["metadata"]["labels"]
        assert (labels["rlrun.dev/attempt"], labels["rlrun.dev/trainer-node"]) == ("0", str(node))
        argv = command_of(replacement)
        assert argv[argv.index("--node-rank") + 1] == str(node) and argv[argv.index("--nnodes") + 1] == "2"
        assert argv[argv.index("rlrun") :] == [
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
        assert replacement["spec"]["hostname"] == f"trainer-{node}"  # node 0 keeps the rendezvous address
        assert node_rule(replacement) == [{"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["node-a"]}]
    # the recovery ends only once every node's replacement runs
    run_pod(cluster, NEW[0], "node-c", "10.0.1.7")
    time.sleep(0.6)
    assert cluster.status()["recovery"]["stage"] == "Resuming" and cluster.condition("Resumed") is None
    run_pod(cluster, NEW[1], "node-b", "10.0.1.8")
    resumed = wait_for(lambda: (c := cluster.condition("Resumed")) and c["status"] == "True" and c, what="Resumed")
    assert resumed["message"] == (
        "attempt 0 goes on: only the trainer was replaced (demo-trainer-0-a0 by demo-trainer-0-a0-r1, "
        "demo-trainer-1-a0 by demo-trainer-1-a0-r1); the trainer resumes with --resume from the newest complete "
        "checkpoint, the orchestrator and the other rollout servers kept running"
    )
    wait_for(lambda: cluster.status().get("phase") == "Running", what="Running again")
    status = cluster.status()
    assert "recovery" not in status and (status["preemptions"], status.get("failures"), status["attempt"]) == (1, 0, 0)
    assert fake.pauses == 0 and uids(cluster, *kept) == kept  # the orchestrator and vLLM kept running
    assert {r.name for r in cluster.kube.requests if r.rbac == ("", "pods", "delete")} == set(OLD)
    assert pods_created(cluster) == 6  # attempt 0's four pods, then the group once
    assert {p["metadata"]["name"] for p in cluster.pods()} == {"demo-orchestrator-a0", "demo-rollout-0-a0", *NEW}
    assert cluster.condition("Degraded")["status"] == "False"  # the group is whole again: no pod missing


def test_a_crashed_rank_and_its_peer_failing_after_it_count_one_failure(cluster):
    fake = two_node_run(cluster, failure_policy={"backoff_limit": 1})
    cluster.exit_pod(cluster.pod("trainer", index=0), outcome="error", code=1, step=7)
    wait_for(lambda: (cluster.status().get("recovery") or {}).get("scope") == "trainer", what="trainer scope")
    wait_for(lambda: pod(cluster, OLD[1])["metadata"].get("deletionTimestamp"), what="node 1 stopped")
    # node 1's ranks lose their peers and exit non-zero too: the operator stopped them, it is no new failure
    cluster.exit_pod(pod(cluster, OLD[1]), outcome="error", code=1, step=7)
    cluster.kube.expire_pod_deletions(at=LATER)
    for name, ip in zip(NEW, ("10.0.1.7", "10.0.1.8"), strict=True):
        wait_for(lambda name=name: pod(cluster, name), what=name)
        run_pod(cluster, name, "node-c", ip)
    wait_for(lambda: (c := cluster.condition("Resumed")) and c["status"] == "True", what="Resumed")
    status = cluster.status()
    assert (status["failures"], status["preemptions"], status["attempt"]) == (1, 0, 0)  # within backoff_limit 1
    assert "failedNodes" not in status and fake.pauses == 0 and cluster.condition("Failed")["status"] == "False"


def test_a_lost_node_holding_a_trainer_rank_and_the_orchestrator_restarts_the_attempt(cluster):
    fake = two_node_run(cluster, orchestrator_node="node-a")
    disrupt(cluster, cluster.pod("trainer", index=1))  # node-a's notice reaches trainer node 1 first
    wait_for(lambda: (cluster.status().get("recovery") or {}).get("scope") == "attempt", what="attempt scope")
    wait_for(lambda: all(p["metadata"].get("deletionTimestamp") for p in cluster.pods()), what="all terminating")
    cluster.kube.expire_pod_deletions(at=LATER)
    wait_for(lambda: len(attempt_pods(cluster, 1)) == 4, what="attempt 1's four pods")
    names = sorted(p["metadata"]["name"] for p in attempt_pods(cluster, 1))
    assert names == ["demo-orchestrator-a1", "demo-rollout-0-a1", "demo-trainer-0-a1", "demo-trainer-1-a1"]
    assert fake.pauses == 1 and cluster.status()["preemptions"] == 1  # the live orchestrator paused first
    assert all(node_rule(p)[0]["values"] == ["node-a"] for p in attempt_pods(cluster, 1))


@pytest.mark.parametrize("created", [0, 1])
def test_an_operator_killed_while_creating_the_trainer_group_finishes_it_exactly_once(cluster, created):
    """Killed at ``Starting`` (recorded, then none or only node 0's replacement created): the restarted operator
    creates what is missing, once each, and the group ends whole."""
    fake = two_node_run(cluster)
    kept = uids(cluster, "demo-orchestrator-a0", "demo-rollout-0-a0")
    spot_notice(cluster, cluster.pod("trainer", index=1))

    def reached():
        cluster.kube.expire_pod_deletions(at=LATER)
        return (cluster.status().get("recovery") or {}).get("stage") in ("Starting", *_after("Starting"))

    wait_for(reached, what="Starting")
    wait_for(lambda: all(pod(cluster, n) for n in NEW), what="the replacements")
    cluster.operator.stop()
    survivor = uids(cluster, *NEW[:created])
    recovery = {**cluster.status()["recovery"], "stage": "Starting"}
    assert recovery["replacements"] == NEW
    for name in NEW[created:]:  # what the killed operator had not created yet
        cluster.kube.delete("pods", name, NAMESPACE, {"gracePeriodSeconds": 0})
    cluster.kube.patch("rlruns", "demo", {"status": {"recovery": recovery}}, NAMESPACE, subresource="status")
    cluster.kube.clear_requests()
    cluster.restart_operator()
    for name, ip in zip(NEW, ("10.0.1.7", "10.0.1.8"), strict=True):
        wait_for(lambda name=name: pod(cluster, name), what=name)
        run_pod(cluster, name, "node-c", ip)
    wait_for(lambda: (c := cluster.condition("Resumed")) and c["status"] == "True", what="Resumed")
    assert pods_created(cluster) == len(NEW) - created  # each missing replacement created once
    assert uids(cluster, *NEW[:created]) == survivor  # the one created before the kill is kept
    status = cluster.status()
    assert (status["preemptions"], status["attempt"]) == (1, 0)
    assert {p["metadata"]["name"] for p in cluster.pods()} == {"demo-orchestrator-a0", "demo-rollout-0-a0", *NEW}
    assert fake.pauses == 0 and uids(cluster, *kept) == kept


def test_a_trainer_pod_deleted_at_once_is_a_loss_of_the_group(cluster):
    """Node 0's pod gone without the operator (grace 0: no ``deletionTimestamp`` ever seen): the group's size on
    node 1's pod (``rlrun.dev/trainer-nodes``) says a pod is missing, and the whole group is replaced."""
    fake = two_node_run(cluster)
    cluster.kube.delete("pods", OLD[0], NAMESPACE, {"gracePeriodSeconds": 0})
    wait_for(lambda: cluster.status().get("preemptions") == 1, what="counted")
    recovery = cluster.status()["recovery"]
    assert recovery["scope"] == "trainer" and recovery["pods"] == OLD
    assert recovery["trigger"] == "PodMissing"
    wait_for(lambda: pod(cluster, OLD[1])["metadata"].get("deletionTimestamp"), what="node 1 stopped")
    cluster.kube.expire_pod_deletions(at=LATER)
    for name, ip in zip(NEW, ("10.0.1.7", "10.0.1.8"), strict=True):
        wait_for(lambda name=name: pod(cluster, name), what=name)
        run_pod(cluster, name, "node-c", ip)
    wait_for(lambda: (c := cluster.condition("Resumed")) and c["status"] == "True", what="Resumed")
    assert cluster.status()["attempt"] == 0 and fake.pauses == 0
