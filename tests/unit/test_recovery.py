"""The recovery state machine's status patches (pure) and the NotIn node affinity merge."""

from __future__ import annotations

import pytest
from rlrun.api.status import RLRunStatus
from rlrun_operator import recovery
from rlrun_operator.disruption import Disruption
from rlrun_operator.pods import avoid_nodes

from tests.support.fake_orchestrator import resume_report

NOW = "2026-12-01T00:00:00Z"


def hit(component="trainer", kind="preemption", node="node-a", lost=True, permanent=False, trigger="NodeTainted"):
    return Disruption(trigger, kind, "karpenter.sh/disrupted", f"demo-{component}-a0", component, node, lost, permanent)


def merged(status, patch):
    out = {**status, **patch}
    RLRunStatus.model_validate({k: v for k, v in out.items() if v is not None})  # the CRD's status schema
    return out


def test_a_preemption_is_counted_once_and_recorded_with_its_first_stage():
    status = {"attempt": 2, "preemptions": 1, "failures": 1}
    # the trainer's node is lost and the orchestrator runs there too: the attempt restarts, paused first
    patch, rec = recovery.begin(
        status, 3, [hit()], orchestrator_alive=True, backoff_limit=0, orchestrator_node="node-a", now=NOW
    )
    status = merged(status, patch)
    assert (status["preemptions"], status["failures"], status["phase"]) == (2, 1, "Recovering")
    assert (rec.stage, rec.scope, rec.attempt, rec.node, rec.trigger) == (
        "Pausing",
        "attempt",
        2,
        "node-a",
        "NodeTainted",
    )
    assert status["failedNodes"] == ["node-a"]
    preempted = next(c for c in status["conditions"] if c["type"] == "Preempted")
    assert (
        preempted["status"] == "True" and "demo-trainer-a0" in preempted["message"] and "node-a" in preempted["message"]
    )
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "Resuming")


def test_without_a_live_orchestrator_the_recovery_starts_at_stopping():
    _, rec = recovery.begin(
        {"attempt": 0}, 1, [hit("orchestrator")], orchestrator_alive=False, backoff_limit=3, now=NOW
    )
    assert rec.stage == "Stopping"


def test_only_rollout_pods_hit_keeps_the_attempt():
    patch, rec = recovery.begin({"attempt": 0}, 1, [hit("rollout")], orchestrator_alive=True, backoff_limit=3, now=NOW)
    assert (rec.scope, rec.stage) == ("rollout", "Stopping") and "phase" not in patch


def test_failures_use_the_budget_and_preemptions_never_do():
    status = {"attempt": 0, "failures": 2}
    patch, rec = recovery.begin(status, 1, [hit(kind="failure")], orchestrator_alive=True, backoff_limit=3, now=NOW)
    assert rec is not None and patch["failures"] == 3
    patch, rec = recovery.begin(
        {**status, "failures": 3}, 1, [hit(kind="failure")], orchestrator_alive=True, backoff_limit=3
    )
    assert rec is None and patch["phase"] == "Failed" and patch["failures"] == 4
    failed = next(c for c in patch["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "BackoffLimitExceeded"
    _, rec = recovery.begin({"attempt": 0, "preemptions": 50}, 1, [hit()], orchestrator_alive=True, backoff_limit=0)
    assert rec is not None


def test_a_permanent_failure_fails_at_once_with_its_own_reason():
    patch, rec = recovery.begin(
        {"attempt": 0}, 1, [hit(kind="failure", permanent=True)], orchestrator_alive=True, backoff_limit=9
    )
    assert rec is None and patch["phase"] == "Failed"
    assert next(c for c in patch["conditions"] if c["type"] == "Failed")["reason"] == "karpenter.sh/disrupted"


def test_finishing_reports_what_was_restored_once():
    status = {"attempt": 1, "preemptions": 1, "resumedGroups": 2}
    patch, rec = recovery.begin(status, 1, [hit("orchestrator")], orchestrator_alive=False, backoff_limit=3, now=NOW)
    status = merged(status, patch)
    report = resume_report(queued_traces=12, open_groups=3, requested_groups=1, finished_episodes_kept=7)
    status = merged(status, recovery.started(status, 1, rec, 2, now=NOW))
    assert status["attempt"] == 2 and status["recovery"]["stage"] == "Resuming"
    done = merged(status, recovery.finished(status, 1, recovery.recovery_of(status), report, 2, now=NOW))
    assert done["recovery"] is None and done["resumedGroups"] == 6 and done["lastResume"]["fromStep"] == 10
    resumed = next(c for c in done["conditions"] if c["type"] == "Resumed")
    assert (
        resumed["message"]
        == "attempt 2 resumed at step 10 with 12 queued traces and 4 open groups (7 finished episodes kept)"
    )
    assert next(c for c in done["conditions"] if c["type"] == "Preempted")["status"] == "False"


def hit_on(component, node, lost=True, kind="preemption"):
    return Disruption("DisruptionTarget", kind, "TerminationByKubelet", f"demo-{component}-a0", component, node, lost)


@pytest.mark.parametrize(
    ("found", "orchestrator_node", "scope"),
    [
        ([hit_on("rollout", "node-b")], "node-a", "rollout"),
        ([hit_on("trainer", "node-a")], "node-b", "trainer"),  # the trainer's node lost with notice, alone
        ([hit_on("trainer", "node-a")], None, "trainer"),  # the orchestrator not scheduled yet
        ([hit_on("trainer", "node-a", lost=False)], "node-a", "trainer"),  # the pod preempted, not its node
        ([hit_on("trainer", "node-a", lost=False, kind="failure")], "node-a", "trainer"),  # a crash
        ([hit_on("trainer", "node-a"), hit_on("rollout", "node-a")], "node-b", "trainer"),
        ([hit_on("orchestrator", "node-b")], "node-b", "attempt"),
        ([hit_on("trainer", "node-a"), hit_on("orchestrator", "node-b")], "node-b", "attempt"),
        ([hit_on("trainer", "node-a")], "node-a", "attempt"),  # the notice reached the trainer first: one loss
        ([hit_on("rollout", "node-a")], "node-a", "attempt"),
    ],
)
def test_the_scope_is_what_was_lost_and_an_orchestrator_lost_restarts_the_attempt(found, orchestrator_node, scope):
    assert recovery.scope_of(found, orchestrator_node) == scope


def test_a_lost_trainer_is_replaced_in_the_same_attempt_without_a_pause_and_counted_once():
    status = {"attempt": 3, "preemptions": 1, "failures": 0, "resumedGroups": 4}
    patch, rec = recovery.begin(
        status, 2, [hit()], orchestrator_alive=True, backoff_limit=0, orchestrator_node="node-b", now=NOW
    )
    status = merged(status, patch)
    assert (rec.scope, rec.stage, rec.attempt, rec.pods, rec.pause) == (
        "trainer",
        "Stopping",
        3,
        ["demo-trainer-a0"],
        None,
    )
    assert (status["preemptions"], status["failures"], status["phase"]) == (2, 0, "Recovering")
    assert status["failedNodes"] == ["node-a"] and status["attempt"] == 3
    assert status["message"] == "replacing the trainer of attempt 3: " + rec.message
    conditions = {c["type"]: c for c in status["conditions"]}
    assert (conditions["Preempted"]["status"], conditions["Preempted"]["reason"]) == ("True", "NodeTainted")
    assert (conditions["Ready"]["status"], conditions["Ready"]["reason"]) == ("False", "Resuming")
    # Stopping → Starting: the replacement's name decided before it is created (r2: the run's second recovery)
    status = merged(status, recovery.to_stage(rec, "Starting", NOW, replacements=["demo-trainer-a3-r2"]))
    rec = recovery.recovery_of(status)
    status = merged(status, recovery.replaced(status, 2, rec, 3, now=NOW))
    assert (status["recovery"]["stage"], status["phase"], status["attempt"]) == ("Resuming", "Recovering", 3)
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "Resuming") and "demo-trainer-a3-r2" in ready["message"]
    done = merged(status, recovery.finished(status, 2, recovery.recovery_of(status), None, 3, now=NOW))
    resumed = next(c for c in done["conditions"] if c["type"] == "Resumed")
    assert (resumed["status"], resumed["reason"]) == ("True", "Resumed")
    assert resumed["message"] == (
        "attempt 3 goes on: only the trainer was replaced (demo-trainer-a0 by demo-trainer-a3-r2); the trainer "
        "resumes with --resume from the newest complete checkpoint, the orchestrator and the other rollout servers "
        "kept running"
    )
    assert next(c for c in done["conditions"] if c["type"] == "Preempted")["status"] == "False"
    # nothing restored by an orchestrator: the resume totals stay, counted once, no new attempt
    assert done["recovery"] is None and done["resumedGroups"] == 4 and "lastResume" not in done
    assert (done["preemptions"], done["attempt"]) == (2, 3)


def test_a_trainer_and_rollout_pod_lost_together_are_both_replaced_and_said_so():
    found = [hit_on("trainer", "node-a"), hit_on("rollout", "node-a")]
    _, rec = recovery.begin({"attempt": 1}, 1, found, orchestrator_alive=True, backoff_limit=0, orchestrator_node="n")
    assert (rec.scope, rec.pods) == ("trainer", ["demo-rollout-a0", "demo-trainer-a0"])
    rec = rec.model_copy(update={"pods": ["demo-rollout-0-a1", "demo-trainer-a1"]})
    rec = rec.model_copy(update={"replacements": ["demo-rollout-0-a1-r3", "demo-trainer-a1-r3"]})
    assert recovery.trainer_replaced_message(rec, 1).startswith(
        "attempt 1 goes on: only the trainer and 1 rollout server(s) were replaced "
        "(demo-rollout-0-a1 by demo-rollout-0-a1-r3, demo-trainer-a1 by demo-trainer-a1-r3);"
    )


def test_a_crashed_trainer_is_replaced_alone_and_uses_the_failure_budget():
    crash = hit(kind="failure", lost=False, trigger="PodFailed")
    patch, rec = recovery.begin({"attempt": 0, "failures": 1}, 1, [crash], orchestrator_alive=True, backoff_limit=2)
    assert (rec.scope, rec.kind, rec.stage, patch["failures"]) == ("trainer", "failure", "Stopping", 2)
    assert "failedNodes" not in patch  # its node is fine: the replacement may run there again
    degraded = next(c for c in patch["conditions"] if c["type"] == "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "PodFailed")
    patch, rec = recovery.begin({"attempt": 0, "failures": 2}, 1, [crash], orchestrator_alive=True, backoff_limit=2)
    assert rec is None and patch["phase"] == "Failed" and patch["failures"] == 3


def test_deleted_pods_and_failed_nodes_are_bounded():
    names = recovery.remember([f"p{i}" for i in range(200)], ["p5", "new"], recovery.MAX_DELETED_PODS)
    assert len(names) == recovery.MAX_DELETED_PODS and names[-2:] == ["p5", "new"]


def test_not_in_is_merged_into_every_node_selector_term():
    user = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100"]}]},
                    {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["a100"]}]},
                ]
            }
        },
        "podAntiAffinity": {"x": 1},
    }
    out = avoid_nodes(user, ["node-b", "node-a"])
    terms = out["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    rule = {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["node-a", "node-b"]}
    assert [t["matchExpressions"][-1] for t in terms] == [rule, rule] and len(terms) == 2
    assert out["podAntiAffinity"] == {"x": 1}
    assert (
        len(
            user["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0][
                "matchExpressions"
            ]
        )
        == 1
    )
    assert avoid_nodes(None, ["n"])["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"] == {
        "nodeSelectorTerms": [{"matchExpressions": [rule | {"values": ["n"]}]}]
    }
    assert avoid_nodes(None, []) is None


def test_a_hit_trainer_rank_makes_the_whole_trainer_group_the_recovery():
    """Any trainer pod of a multi-node trainer lost: every trainer pod of the group is replaced (the rollout
    pods hit with it too); a rollout-only or attempt-wide recovery is not widened."""
    rank1 = Disruption("NodeTainted", "preemption", "spot", "demo-trainer-1-a0", "trainer", "node-a", True, False)
    rollout = Disruption("NodeTainted", "preemption", "spot", "demo-rollout-0-a0", "rollout", "node-a", True, False)
    group = ["demo-trainer-0-a0", "demo-trainer-1-a0"]
    patch, rec = recovery.begin(
        {"attempt": 0},
        1,
        [rank1, rollout],
        orchestrator_alive=True,
        backoff_limit=3,
        orchestrator_node="node-b",
        trainer_group=group,
        now=NOW,
    )
    assert (rec.scope, rec.stage) == ("trainer", "Stopping")
    assert rec.pods == ["demo-rollout-0-a0", "demo-trainer-0-a0", "demo-trainer-1-a0"]
    assert "demo-trainer-1-a0" in rec.message and "demo-trainer-0-a0" not in rec.message  # what was hit
    assert merged({"attempt": 0}, patch)["preemptions"] == 1  # one loss, counted once
    _, rec = recovery.begin(
        {"attempt": 0}, 1, [rollout], orchestrator_alive=True, backoff_limit=3, trainer_group=group, now=NOW
    )
    assert (rec.scope, rec.pods) == ("rollout", ["demo-rollout-0-a0"])
    _, rec = recovery.begin(
        {"attempt": 0},
        1,
        [rank1],
        orchestrator_alive=True,
        backoff_limit=3,
        orchestrator_node="node-a",
        trainer_group=group,
        now=NOW,
    )
    assert (rec.scope, rec.pods) == ("attempt", ["demo-trainer-1-a0"])  # every pod restarts anyway


def conditions(status) -> dict[str, str]:
    return {c["type"]: c["status"] for c in status.get("conditions") or []}


@pytest.mark.parametrize(
    ("lost", "orchestrator_node", "ready", "phase"),
    [
        ([hit("rollout", node="node-b")], "node-a", "True", "Running"),  # training goes on: still Ready
        ([hit("trainer")], "node-b", "False", "Recovering"),  # no training until the replacement trainer runs
        ([hit("trainer")], "node-a", "False", "Recovering"),  # the orchestrator's node too: the attempt restarts
    ],
)
def test_which_conditions_are_true_together_during_a_preemption(lost, orchestrator_node, ready, phase):
    """The rule of docs/operator.md ("Conditions true together"): Preempted says a preemption is being
    recovered from; Ready says training goes on. A lost rollout pod leaves both True (the run trains with the
    servers left); a lost trainer or orchestrator makes Ready False until the recovery ends."""
    running = merged(
        {"attempt": 0, "phase": "Running"},
        {
            "conditions": recovery._conditions(
                {},
                1,
                NOW,
                ("Ready", True, "Running", ""),
                ("Preempted", False, "Recovered", ""),
                ("Succeeded", False, "Running", ""),
                ("Failed", False, "Running", ""),
            )
        },
    )
    patch, rec = recovery.begin(
        running, 1, lost, orchestrator_alive=True, backoff_limit=3, orchestrator_node=orchestrator_node, now=NOW
    )
    during = merged(running, patch)
    assert conditions(during) == {"Ready": ready, "Preempted": "True", "Succeeded": "False", "Failed": "False"}
    assert during.get("phase") == phase
    done = merged(during, recovery.finished(during, 1, rec, None, rec.attempt or 0, now=NOW))
    assert conditions(done)["Preempted"] == "False" and conditions(done)["Ready"] in ("True", "False")
    assert not (
        conditions(done)["Ready"] == "True" and "True" in (conditions(done)["Succeeded"], conditions(done)["Failed"])
    )


def test_success_completes_every_condition_closes_the_recovery_and_fills_the_progress():
    status = {"maxSteps": 40, "step": 39, "recovery": {"stage": "Resuming"}}
    status["conditions"] = [{"type": "Preempted", "status": "True", "reason": "NodeTainted", "message": "m"}]
    completed = {"reason": "Completed", "lastTransitionTime": NOW, "observedGeneration": 2}
    assert recovery.succeeded(status, 2, now=NOW) == {
        "phase": "Succeeded",
        "message": "all 40 steps trained",
        "conditions": [
            {"type": "Succeeded", "status": "True", "message": "all 40 steps trained", **completed},
            {"type": "Failed", "status": "False", "message": "", **completed},
            {"type": "Ready", "status": "False", "message": "the run has finished", **completed},
            {"type": "Progressing", "status": "False", "message": "all 40 steps trained", **completed},
            {"type": "Degraded", "status": "False", "message": "", **completed},
            {"type": "Preempted", "status": "False", "message": "", **completed},
        ],
        "observedGeneration": 2,
        "recovery": None,
        "step": 40,
        "progress": {"percent": 100, "text": "100%", "eta": "-", "etaSeconds": None},
    }
    # no step count known, no recovery in progress: Preempted is left as it is
    patch = recovery.succeeded({"conditions": status["conditions"]}, 2, now=NOW)
    assert patch["message"] == "training finished" and "step" not in patch and "progress" not in patch
    assert patch["conditions"][0] == status["conditions"][0]  # Preempted left as it was


def test_a_finalizer_hold_is_said_once_and_taken_back_when_the_pod_is_gone():
    from rlrun_operator.status import PodView

    held = PodView("demo-trainer-a0", "trainer", 0, "Running", True, None, deleting=True, finalizers=("example.com/f",))
    message = (
        "pod demo-trainer-a0 is held terminating by finalizers example.com/f: the recovery goes on once it is gone "
        "(whatever owns a finalizer must remove it)"
    )
    patch, warning = recovery.held_by_finalizers({}, 3, [held], now=NOW)
    degraded = {"type": "Degraded", "lastTransitionTime": NOW, "observedGeneration": 3}
    assert warning == message
    assert patch == {
        "conditions": [{**degraded, "status": "True", "reason": "PodStuckTerminating", "message": message}]
    }
    assert recovery.held_by_finalizers(patch, 3, [held], now=NOW) == ({}, None)  # said already
    assert recovery.held_by_finalizers(patch, 3, [], now=NOW) == (
        {"conditions": [{**degraded, "status": "False", "reason": "AsExpected", "message": ""}]},
        None,
    )
    assert recovery.held_by_finalizers({}, 3, [], now=NOW) == ({}, None)  # nothing to take back


def test_the_attempt_after_none_is_0_and_after_n_is_n_plus_1():
    assert [recovery.following_attempt(a) for a in (None, 0, 3)] == [0, 1, 4]
