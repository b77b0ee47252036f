"""The disruption classifier: one case per trigger, and the exit-code cases other operators reported."""

from __future__ import annotations

import pytest
from rlrun.api.control import ExitReport
from rlrun_operator.disruption import NodeView, disruption, node_view
from rlrun_operator.status import pod_view

NODE = NodeView("node-a", frozenset())


def pod(
    phase="Running", conditions=(), terminated=None, deleting=False, node="node-a", reason=None, component="trainer"
):
    status = {"phase": phase, "conditions": list(conditions)}
    if reason:
        status["reason"] = reason
    if terminated is not None:
        status["containerStatuses"] = [{"name": "c", "state": {"terminated": terminated}}]
    meta = {
        "name": f"demo-{component}-a0",
        "labels": {"app.kubernetes.io/component": component, "rlrun.dev/attempt": "0"},
        "ownerReferences": [{"uid": "u1", "controller": True}],
    }
    if deleting:
        meta["deletionTimestamp"] = "2026-12-01T00:00:00Z"
    return pod_view({"metadata": meta, "spec": {"nodeName": node} if node else {}, "status": status})


def classify(p, node=NODE, *, ours=False, complete=False, taints=()):
    return disruption(p, node, deleted_by_operator=ours, run_complete=complete, taints=taints)


def target(reason, status="True"):
    return {"type": "DisruptionTarget", "status": status, "reason": reason}


@pytest.mark.parametrize(
    "reason",
    [
        "PreemptionByScheduler",
        "DeletionByTaintManager",
        "EvictionByEvictionAPI",
        "DeletionByPodGC",
        "TerminationByKubelet",
    ],
)
def test_disruption_target_of_any_reason_is_a_preemption(reason):
    found = classify(pod(conditions=[target(reason)]))
    assert (found.trigger, found.kind, found.reason) == ("DisruptionTarget", "preemption", reason)
    assert found.node_lost == (reason != "PreemptionByScheduler" and reason != "EvictionByEvictionAPI")


def test_a_disruption_target_flipped_back_to_false_is_nothing():
    assert classify(pod(conditions=[target("EvictionByEvictionAPI", status="False")])) is None


def test_a_deletion_the_operator_did_not_cause_is_a_preemption_and_its_own_is_nothing():
    found = classify(pod(deleting=True))
    assert (found.trigger, found.kind) == ("PodDeleted", "preemption")
    assert classify(pod(deleting=True), ours=True) is None


@pytest.mark.parametrize(
    "taint",
    [
        "node.kubernetes.io/unschedulable",
        "node.kubernetes.io/not-ready",
        "node.kubernetes.io/unreachable",
        "node.kubernetes.io/out-of-service",
    ],
)
def test_kubernetes_node_taints_are_preemptions(taint):
    found = classify(pod(), NodeView("node-a", frozenset({taint})))
    assert (found.trigger, found.kind, found.reason, found.node_lost) == ("NodeTainted", "preemption", taint, True)


def test_spot_taints_count_only_when_configured():
    node = NodeView("node-a", frozenset({"karpenter.sh/disrupted"}))
    assert classify(pod(), node) is None
    assert classify(pod(), node, taints=("karpenter.sh/disrupted",)).reason == "karpenter.sh/disrupted"


def test_a_deleted_node_and_a_not_ready_one():
    assert classify(pod(), None).trigger == "NodeGone"
    assert classify(pod(node=None), None) is None  # not scheduled: no node to lose
    not_ready = node_view(
        {"metadata": {"name": "node-a"}, "status": {"conditions": [{"type": "Ready", "status": "Unknown"}]}}
    )
    assert classify(pod(), not_ready).reason == "NodeNotReady"


def test_exit_codes_as_other_operators_reported_them():
    killed = {"exitCode": 137, "reason": "Error"}
    found = classify(pod("Failed", [target("PreemptionByScheduler")], killed))
    assert (found.trigger, found.kind) == ("PodFailed", "preemption")
    oom = classify(pod("Failed", terminated={"exitCode": 137, "reason": "OOMKilled"}))
    assert (oom.kind, oom.reason) == ("failure", "OOMKilled")
    shutdown = classify(pod("Failed", [target("TerminationByKubelet")], {"exitCode": 143, "reason": "Error"}))
    assert (shutdown.kind, shutdown.reason, shutdown.node_lost) == ("preemption", "TerminationByKubelet", True)
    crash = classify(pod("Failed", terminated={"exitCode": 1, "reason": "Error"}))
    assert (crash.kind, crash.reason) == ("failure", "Error")
    evicted = classify(pod("Failed", reason="Evicted"))
    assert evicted.kind == "preemption"
    sigkill_on_lost_node = classify(
        pod("Failed", terminated={"exitCode": 137, "reason": "Error"}),
        NodeView("node-a", frozenset({"node.kubernetes.io/unreachable"})),
    )
    assert sigkill_on_lost_node.kind == "preemption"


def test_a_torchrun_trainer_stopped_on_a_troubled_node_is_a_preemption_by_its_exit_report():
    # torchrun exits 1 after forwarding SIGTERM, whatever its ranks did; rank 0's report says "interrupted"
    saved = ExitReport(role="trainer", outcome="interrupted", step=7, max_steps=20).model_dump_json()
    draining = NodeView("node-a", frozenset({"node.kubernetes.io/unreachable"}))
    stopped = pod("Failed", terminated={"exitCode": 1, "reason": "Error", "message": saved})
    found = classify(stopped, draining)
    assert (found.kind, found.reason, found.node_lost) == ("preemption", "node.kubernetes.io/unreachable", True)
    assert classify(stopped).kind == "failure"  # on a healthy node an exit 1 stays a failure
    crashed = classify(pod("Failed", terminated={"exitCode": 1, "reason": "Error"}), draining)
    assert crashed.kind == "failure"


def test_a_permanent_error_says_so_in_its_exit_report():
    report = ExitReport(role="orchestrator", outcome="error", permanent=True, reason="CheckpointMismatch")
    found = classify(pod("Failed", terminated={"exitCode": 78, "reason": "Error", "message": report.model_dump_json()}))
    assert (found.kind, found.permanent, found.reason) == ("failure", True, "CheckpointMismatch")


def test_exit_0_is_success_only_when_the_run_is_complete():
    paused = ExitReport(role="orchestrator", outcome="paused", step=7, max_steps=20).model_dump_json()
    complete = ExitReport(role="orchestrator", outcome="complete", step=20, max_steps=20).model_dump_json()
    early = classify(pod("Succeeded", terminated={"exitCode": 0, "message": paused}, component="orchestrator"))
    assert (early.trigger, early.kind, early.reason) == ("ExitedEarly", "preemption", "paused")
    assert classify(pod("Succeeded", terminated={"exitCode": 0, "message": complete}, component="orchestrator")) is None
    assert classify(pod("Succeeded", terminated={"exitCode": 0}, component="orchestrator"), complete=True) is None
