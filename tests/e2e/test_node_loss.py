"""The design's whole story with real processes: ``kubectl apply`` → the operator's pods run as real
``rlrun`` processes (vLLM included) on fake nodes → a node is lost → the run finishes, nothing lost.

Each scenario is one RLRun on a fresh ``LocalCluster`` (≈2–4 min on 2 cores: vLLM starts once per
attempt). ``rlrun ledger check`` on the volume proves no finished episode was lost or trained twice.
"""

from __future__ import annotations

import json

import pytest
from rlrun.launcher.preemption import steps_recomputed

from tests.support.polling import wait_for

from .runs import (
    NAME,
    apply,
    kubectl_row,
    latest_checkpoint_step,
    ledger_check,
    manifest,
    run_dir,
    trainer_loss_cost,
    wait_for_end,
    wait_for_generation,
    wait_for_training,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


def node_of(cluster, component: str) -> str:
    pod = cluster.pod(NAME, component)
    assert pod is not None and pod["spec"].get("nodeName"), f"no scheduled {component} pod"
    return pod["spec"]["nodeName"]


def bound_nodes(cluster, attempt: int) -> dict[str, str]:
    """``{pod: node}`` of every pod of ``attempt`` the scheduler bound."""
    out = {}
    for _, what in cluster.timeline:
        words = what.split()
        if len(words) == 5 and words[0] == "pod" and words[2:4] == ["bound", "to"] and f"-a{attempt}" in words[1]:
            out[words[1]] = words[4]
    return out


def test_trainer_node_lost_with_notice_replaces_only_the_trainer_which_saves_first(cluster):
    apply(cluster, manifest())
    wait_for_training(cluster, 5)  # past the step-4 checkpoint
    lost = node_of(cluster, "trainer")
    assert cluster.nodes.pods_on(lost) == [f"{NAME}-trainer-a0"], "the trainer must be alone on its node"
    keep = {role: cluster.nodes.pid(f"{NAME}-{role}-a0") for role in ("orchestrator", "rollout-0")}
    before = wait_for_generation(cluster)
    cluster.nodes.preempt_node(lost, notice_seconds=10)
    notice = cluster.first(f"notice node {lost}")

    status = wait_for_end(cluster)
    print(f"notice at step {before['step']} (policy {before['policy_version']})")
    assert status["preemptions"] == 1 and status["failures"] == 0 and status["attempt"] == 0
    assert status["failedNodes"] == [lost] and status.get("lastResume") is None
    resumed = next(c for c in status["conditions"] if c["type"] == "Resumed")
    assert "only the trainer was replaced" in resumed["message"], resumed
    # the replacement: off the lost node, same attempt, --resume, started after the old trainer was gone
    replacement = f"{NAME}-trainer-a0-r1"
    assert bound_nodes(cluster, 0)[replacement] != lost
    assert cluster.first(f"pod {replacement} started") > cluster.first(f"pod {NAME}-trainer-a0 deleted")
    # the old trainer saved the step it had on notice: no step is trained twice
    old_log = cluster.nodes.log_path(f"{NAME}-trainer-a0").read_text()
    assert "notice: saved trainer checkpoint step" in old_log or "notice: trainer part of step" in old_log
    assert steps_recomputed(run_dir(cluster) / "ledger") == 0
    # the orchestrator and vLLM ran through: one process each, never signalled, exit 0; no attempt 1
    for role, pid in keep.items():
        assert pid is not None
        assert sum(w.startswith(f"pod {NAME}-{role}-a0 started ") for _, w in cluster.timeline) == 1
        assert not any(f"pod {NAME}-{role}-a0 SIG" in w for _, w in cluster.timeline)
    assert cluster.first(f"pod {NAME}-orchestrator-a0 exited 0") is not None
    assert not any("-a1" in p["metadata"]["name"] for p in cluster.pods(NAME))

    row = kubectl_row(cluster)
    assert row["PHASE"] == "Succeeded" and row["STEP"] == "20" and row["PREEMPTIONS"] == "1"
    print(cluster.kubectl("get", "rlrun", NAME, "-o", "wide"))
    print(cluster.kubectl("describe", "rlrun", NAME))
    print("trainer-only preemption cost (s):", trainer_loss_cost(cluster, notice))
    print(ledger_check(cluster))


def test_orchestrator_node_lost_abruptly_resumes_from_the_latest_periodic_checkpoint(cluster):
    apply(cluster, manifest(max_steps=14))
    wait_for_training(cluster, 5)
    lost = node_of(cluster, "orchestrator")
    cluster.nodes.crash_node(lost, gone_after_seconds=5)
    on_disk = latest_checkpoint_step(cluster)  # nothing on that node writes any more

    status = wait_for_end(cluster)
    assert status["preemptions"] == 1 and status["failures"] == 0
    assert on_disk is not None and on_disk >= 4
    assert status["lastResume"]["fromStep"] == on_disk
    resumed = next(c for c in status["conditions"] if c["type"] == "Resumed")
    assert resumed["status"] == "True" and f"resumed at step {on_disk}" in resumed["message"]
    assert lost not in bound_nodes(cluster, 1).values()
    report = json.loads(ledger_check(cluster))
    print(report)
    # every episode finished after that checkpoint was journaled before it counted: replayed, none lost
    assert report["replayed"] > 0 and report["journal_lost"] == 0 and report["doubled"] == 0


def test_one_rollout_node_lost_replaces_only_that_pod(cluster):
    apply(cluster, manifest(max_steps=14, replicas=2))
    wait_for_training(cluster, 3)
    rollouts = {
        p["metadata"]["name"]: p["spec"]["nodeName"] for p in cluster.pods(NAME) if "-rollout-" in p["metadata"]["name"]
    }
    # a rollout pod alone on its node (the other roles share the rest)
    alone = [n for pod, n in rollouts.items() if cluster.nodes.pods_on(n) == [pod]]
    assert alone, f"every rollout node also runs another role: {rollouts}"
    keep = {role: cluster.nodes.pid(f"{NAME}-{role}-a0") for role in ("trainer", "orchestrator")}
    lost_pod = cluster.nodes.pods_on(alone[0])[0]
    cluster.nodes.preempt_node(alone[0], notice_seconds=5)

    replacement = f"{lost_pod}-r1"
    # started, not running: the run may end (and its rollout pods go) before a fresh vLLM is up
    wait_for(lambda: cluster.first(f"pod {replacement} started"), 120, f"{replacement} started")
    status = wait_for_end(cluster)
    print({k: status.get(k) for k in ("attempt", "preemptions", "failures", "failedNodes", "message")})
    assert status["attempt"] == 0 and status["preemptions"] == 1 and status["failures"] == 0
    # the trainer and orchestrator processes ran through: one process each (the pid seen before the
    # loss), never signalled, until they exited 0
    for role, pid in keep.items():
        assert pid is not None
        assert sum(w.startswith(f"pod {NAME}-{role}-a0 started ") for _, w in cluster.timeline) == 1
        assert cluster.first(f"pod {NAME}-{role}-a0 exited 0") is not None
        assert not any(f"pod {NAME}-{role}-a0 SIG" in w for _, w in cluster.timeline)
    assert {p["metadata"]["name"] for p in cluster.pods(NAME) if "-a1" in p["metadata"]["name"]} == set()
    print(ledger_check(cluster))


def test_second_preemption_during_the_recovery_from_the_first(cluster):
    apply(cluster, manifest(max_steps=14))
    wait_for_training(cluster, 5)
    first = node_of(cluster, "orchestrator")  # a trainer-only loss would not start a new attempt
    cluster.nodes.preempt_node(first, notice_seconds=10)
    # the new attempt's pods are being created: its orchestrator's node goes too
    wait_for(lambda: cluster.nodes.pid(f"{NAME}-orchestrator-a1"), 60, "attempt 1's orchestrator running")
    assert cluster.status(NAME)["phase"] == "Recovering"
    second = node_of(cluster, "orchestrator")
    assert second != first
    cluster.nodes.preempt_node(second, notice_seconds=5)

    status = wait_for_end(cluster)
    assert status["preemptions"] == 2 and status["failures"] == 0 and status["attempt"] == 2
    assert sorted(status["failedNodes"]) == sorted([first, second])
    assert set(bound_nodes(cluster, 2).values()) == {n for n in cluster.nodes.nodes if n not in (first, second)}
    print(ledger_check(cluster))


def test_suspend_then_resume_as_kueue_does(cluster):
    apply(cluster, manifest(max_steps=12))
    wait_for_training(cluster, 5)
    cluster.kubectl("patch", "rlrun", NAME, "--type", "merge", "-p", '{"spec":{"suspend":true}}')
    suspended = wait_for(lambda: (s := cluster.status(NAME)).get("phase") == "Suspended" and s, 120, "Suspended")
    wait_for(lambda: not cluster.pods(NAME), 60, "every pod gone")
    ready = next(c for c in suspended["conditions"] if c["type"] == "Ready")
    assert "queued traces" in ready["message"], ready
    cluster.kubectl("patch", "rlrun", NAME, "--type", "merge", "-p", '{"spec":{"suspend":false}}')

    status = wait_for_end(cluster)
    assert status["suspensions"] == 1 and status["preemptions"] == 0 and status["failures"] == 0
    assert status["lastResume"]["attempt"] == 1 and status["lastResume"]["fromStep"] >= 4
    print(ledger_check(cluster))
