"""Pure status logic: phases, conditions in the Kubernetes shape, resume totals, endpoints."""

from __future__ import annotations

from rlrun.api.control import StatusReport
from rlrun.api.crd import PRINTER_COLUMNS
from rlrun.api.status import CONDITION_TYPES, PHASES, ConditionType, Phase, Reason, RLRunStatus, Trigger
from rlrun_operator.disruption import Disruption
from rlrun_operator.recovery import (
    begin,
    begin_suspension,
    created_suspended,
    finished,
    recovery_of,
    replaced,
    started,
    suspended_patch,
)
from rlrun_operator.recovery import failed_patch as failed
from rlrun_operator.status import (
    PodView,
    observe,
    pod_view,
    progress,
    rfc3339_seconds,
    rollout_endpoints,
    set_condition,
)

from tests.support.fake_orchestrator import resume_report

T0, T1 = "2026-11-29T12:00:00Z", "2026-11-29T12:05:00Z"


def pods(attempt=0, ready_rollouts=2, orch_phase="Running"):
    out = [PodView(f"r-rollout-{i}-a{attempt}", "rollout", attempt, "Running", True, f"10.0.0.{i}") for i in range(2)]
    out = out[:ready_rollouts] + [
        PodView(f"r-rollout-{i}-a{attempt}", "rollout", attempt, "Running", False, None)
        for i in range(ready_rollouts, 2)
    ]
    out.append(PodView(f"r-trainer-a{attempt}", "trainer", attempt, "Running", True, "10.0.1.1"))
    out.append(PodView(f"r-orchestrator-a{attempt}", "orchestrator", attempt, orch_phase, True, "10.0.1.2"))
    return out


def conds(status):
    return {c["type"]: c["status"] for c in status["conditions"]}


REPORT = StatusReport(phase="running", attempt=0, step=12, max_steps=100, policy_version=11, last_checkpoint_step=10)


def test_running_with_ready_rollouts_is_ready_and_progressing():
    out = observe({"attempt": 0}, 3, pods(), REPORT, now=T0)
    assert out["phase"] == "Running" and out["step"] == 12 and out["lastCheckpointStep"] == 10
    assert conds(out) == {
        "Ready": "True",
        "Progressing": "True",
        "Degraded": "False",
        "Succeeded": "False",
        "Failed": "False",
    }
    assert all(c["observedGeneration"] == 3 and c["lastTransitionTime"] == T0 for c in out["conditions"])
    RLRunStatus.model_validate(out)  # the shape the CRD's status schema accepts


def test_transition_time_changes_only_with_the_status():
    first = observe({"attempt": 0}, 1, pods(), REPORT, now=T0)
    again = observe({"attempt": 0, **first}, 1, pods(), REPORT.model_copy(update={"step": 13}), now=T1)
    assert {c["lastTransitionTime"] for c in again["conditions"]} == {T0}
    down = observe({"attempt": 0, **again}, 1, pods(ready_rollouts=0), REPORT, now=T1)
    ready = next(c for c in down["conditions"] if c["type"] == "Ready")
    degraded = next(c for c in down["conditions"] if c["type"] == "Degraded")
    assert ready["status"] == "False" and ready["lastTransitionTime"] == T1
    assert degraded["status"] == "True" and degraded["reason"] == "NoRolloutEndpoints"


def test_unreachable_orchestrator_is_pending_with_the_reason():
    out = observe({"attempt": 0}, 1, pods(), None, "connection refused")
    ready = next(c for c in out["conditions"] if c["type"] == "Ready")
    assert out["phase"] == "Pending" and ready["reason"] == "OrchestratorUnreachable"
    assert ready["message"] == "connection refused" and "step" not in out


def test_never_ready_or_running_without_a_live_orchestrator_pod():
    for orch_phase in ("Pending", "Succeeded", "Failed"):
        out = observe({"attempt": 0}, 1, pods(orch_phase=orch_phase), REPORT)  # a stale endpoint still answers
        assert out["phase"] == "Pending" and conds(out)["Ready"] == "False"
    out = observe({"attempt": 0}, 1, [p for p in pods() if p.component != "orchestrator"], REPORT)
    assert out["phase"] == "Pending" and conds(out)["Ready"] == "False"


RESUME = resume_report(
    shipped=11,
    queued_traces=104,
    open_groups=2,
    requested_groups=1,
    finished_episodes_kept=8,
    dropped_stale=5,
    members_requested=8,
    progress_only_would_lose=112,
)


def test_resume_totals_add_each_attempt_once():
    report = REPORT.model_copy(update={"attempt": 1, "resume": RESUME})
    first = observe({"attempt": 1, "resumedGroups": 2, "resumedTraces": 50, "resumedEpisodes": 1}, 1, pods(1), report)
    assert (first["resumedGroups"], first["resumedTraces"], first["resumedEpisodes"]) == (5, 154, 9)
    assert first["lastResume"] == {
        "attempt": 1,
        "fromStep": 10,
        "groups": 3,
        "queuedTraces": 104,
        "finishedEpisodes": 8,
        "conversations": 0,  # no multi-turn env
        "turnsKept": 0,
    }
    again = observe({"attempt": 1, **first}, 1, pods(1), report)
    assert again["resumedGroups"] == 5 and again["resumedTraces"] == 154  # the same report is not added twice


def test_endpoints_are_the_ready_rollout_pods_of_the_current_attempt():
    everything = pods(0) + pods(1, ready_rollouts=1)
    assert rollout_endpoints(everything, 0) == ["http://10.0.0.0:8000", "http://10.0.0.1:8000"]
    assert rollout_endpoints(everything, 1) == ["http://10.0.0.0:8000"]
    deleting = [PodView("x", "rollout", 0, "Running", True, "10.9.9.9", deleting=True)]
    assert rollout_endpoints(deleting, 0) == []


def test_pod_view_reads_readiness_ip_and_exit_reason():
    body = {
        "metadata": {"name": "p", "labels": {"app.kubernetes.io/component": "trainer", "rlrun.dev/attempt": "2"}},
        "status": {
            "phase": "Failed",
            "podIP": "10.1.2.3",
            "conditions": [{"type": "Ready", "status": "False"}],
            "containerStatuses": [{"state": {"terminated": {"reason": "OOMKilled", "exitCode": 137}}}],
        },
    }
    assert pod_view(body) == PodView("p", "trainer", 2, "Failed", False, "10.1.2.3", "OOMKilled", exit_code=137)


def test_suspended_and_failed_patches():
    out = suspended_patch({}, 4, "suspended by user", now=T0)
    assert out["phase"] == "Suspended"
    assert conds(out) == {"Ready": "False", "Progressing": "False", "Degraded": "False", "Failed": "False"}
    out = failed({}, 1, "InvalidSpec", "spec.group_size: must be ≥ 2", now=T0)
    failed_cond = next(c for c in out["conditions"] if c["type"] == "Failed")
    assert (
        out["phase"] == "Failed" and failed_cond["reason"] == "InvalidSpec" and "group_size" in failed_cond["message"]
    )
    RLRunStatus.model_validate({k: v for k, v in out.items() if v is not None})


def test_set_condition_replaces_by_type():
    conditions = set_condition([], "Ready", True, "A", "", 1, T0)
    conditions = set_condition(conditions, "Ready", True, "B", "m", 2, T1)
    assert conditions == [
        {
            "type": "Ready",
            "status": "True",
            "reason": "B",
            "message": "m",
            "lastTransitionTime": T0,
            "observedGeneration": 2,
        }
    ]


def test_missing_pods_make_the_run_degraded():
    without_trainer = [p for p in pods() if p.component != "trainer"]
    out = observe({"attempt": 0}, 1, without_trainer, REPORT, rollout_replicas=3)
    degraded = next(c for c in out["conditions"] if c["type"] == "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "PodsMissing"
    assert degraded["message"] == "attempt 0 lacks pods: trainer, 1 rollout"


def test_one_unanswered_poll_keeps_a_running_run_running():
    running = observe({"attempt": 0}, 1, pods(), REPORT, now=T0)
    out = observe({"attempt": 0, **running}, 1, pods(), None, "GET /status: no answer within 5.0 s", now=T1)
    assert out["phase"] == "Running"
    ready = next(c for c in out["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "False" and ready["reason"] == "OrchestratorUnreachable"


def test_a_new_attempt_starts_pending_and_not_degraded():
    out = started(
        {"resumedGroups": 3, "conditions": failed({}, 1, "OrchestratorFailed", "x", now=T0)["conditions"]},
        2,
        None,
        1,
        now=T1,
    )
    assert out["phase"] == "Pending" and out["attempt"] == 1 and out["resumedGroups"] == 3 and out["step"] == 0
    assert conds(out) == {
        "Ready": "False",
        "Progressing": "True",
        "Degraded": "False",
        "Succeeded": "False",
        "Failed": "False",
    }
    RLRunStatus.model_validate(out)


def test_every_condition_written_uses_a_declared_type_and_reason():
    preempted = Disruption("DisruptionTarget", "preemption", "PreemptionByScheduler", "r-trainer-a0", "trainer", "n1")
    crashed = Disruption("PodFailed", "failure", "Error", "r-trainer-a0", "trainer", "n1")
    _, rec = begin({"attempt": 0}, 1, [preempted], orchestrator_alive=True, backoff_limit=1)
    resuming = {"attempt": 1, "conditions": [], "recovery": rec.model_dump(mode="json")}
    lost_trainer = Disruption(
        "NodeTainted", "preemption", "node.kubernetes.io/unreachable", "r-trainer-a0", "trainer", "n1", node_lost=True
    )
    _, trainer_rec = begin({"attempt": 0}, 1, [lost_trainer], orchestrator_alive=True, backoff_limit=1)
    assert trainer_rec.scope == "trainer"
    trainer_rec = trainer_rec.model_copy(update={"replacements": ["r-trainer-a0-r1"]})
    replacing = {"attempt": 0, "conditions": [], "recovery": trainer_rec.model_dump(mode="json")}
    # a reason is a Reason, or (Preempted's) the Trigger that started the recovery
    reasons = {v for cls in (Reason, Trigger) for k, v in vars(cls).items() if k.isupper()}
    patches = [
        observe({"attempt": 0}, 1, pods(), REPORT),
        observe({"attempt": 0}, 1, pods(ready_rollouts=0), REPORT),
        observe({"attempt": 0}, 1, pods(), None, "refused"),
        observe({"attempt": 0}, 1, pods()[1:], REPORT, rollout_replicas=2),
        started({}, 1, None, 0),
        suspended_patch({}, 1, "suspended"),
        failed({}, 1, Reason.INVALID_SPEC, "spec.group_size: must be ≥ 2"),
        begin({"attempt": 0}, 1, [preempted], orchestrator_alive=True, backoff_limit=1)[0],
        begin({"attempt": 0}, 1, [crashed], orchestrator_alive=True, backoff_limit=0)[0],
        begin_suspension({"attempt": 0}, 1, orchestrator_alive=True)[0],
        created_suspended({}, 1),
        finished(resuming, 1, recovery_of(resuming), RESUME, 1),
        finished(resuming, 1, recovery_of(resuming), None, 1),
        # a trainer replaced in its attempt (the trainer's node lost, the orchestrator elsewhere)
        begin({"attempt": 0}, 1, [lost_trainer], orchestrator_alive=True, backoff_limit=1, orchestrator_node="n2")[0],
        replaced(replacing, 1, recovery_of(replacing), 0),
        finished(replacing, 1, recovery_of(replacing), None, 0),
    ]
    for patch in patches:
        assert patch.get("phase", Phase.RUNNING) in PHASES
        assert {c["type"] for c in patch["conditions"]} <= set(CONDITION_TYPES)
        assert {c["reason"] for c in patch["conditions"]} <= reasons, patch["conditions"]
    assert {p.get("phase") for p in patches} == {
        Phase.RUNNING,
        Phase.PENDING,
        Phase.RECOVERING,
        Phase.FAILED,
        Phase.SUSPENDED,
        None,
    }  # fmt: skip  (Succeeded is written by the reconciler, with Reason.COMPLETED)
    written = {c["type"] for p in patches for c in p["conditions"]}
    assert ConditionType.PREEMPTED in written and ConditionType.RESUMED in written


def test_progress_has_a_percentage_and_an_eta_from_the_recent_step_rate():
    first = progress(None, 10, 100, "2026-12-03T10:00:00Z")
    assert first == {
        "percent": 10,
        "text": "10%",
        "eta": "-",
        "stepsPerMinute": None,
        "etaSeconds": None,
        "sampledStep": 10,
        "sampledAt": "2026-12-03T10:00:00Z",
    }
    soon = progress(first, 11, 100, "2026-12-03T10:00:20Z")  # under 30 s: no rate measured yet, the sample stays
    assert soon["stepsPerMinute"] is None and soon["sampledStep"] == 10 and soon["percent"] == 11
    rated = progress(soon, 20, 100, "2026-12-03T10:01:00Z")  # 10 steps in a minute
    assert (
        rated["stepsPerMinute"] == 10.0
        and rated["etaSeconds"] == 480
        and (rated["text"], rated["eta"]) == ("20%", "8m")
    )
    slower = progress(rated, 22, 100, "2026-12-03T10:02:00Z")  # 2 steps/min now: the average is 6
    assert (
        slower["stepsPerMinute"] == 6.0
        and slower["etaSeconds"] == 780
        and (slower["text"], slower["eta"]) == ("22%", "13m")
    )
    back = progress(slower, 18, 100, "2026-12-03T10:03:00Z")  # an abrupt loss retrains steps: measure again
    assert back["sampledStep"] == 18 and back["stepsPerMinute"] == 6.0 and (back["text"], back["eta"]) == ("18%", "14m")
    long = progress(
        {"stepsPerMinute": 0.1, "sampledStep": 0, "sampledAt": "2026-12-03T10:00:00Z"}, 0, 100, "2026-12-03T10:00:10Z"
    )
    assert long["eta"] == "16h40m"
    assert progress(None, 100, 100, "2026-12-03T10:00:00Z")["text"] == "100%"


def test_observe_writes_progress_and_the_crd_shows_it():
    report = REPORT.model_copy(update={"attempt": 1})
    out = observe({"attempt": 1}, 1, pods(1), report, now="2026-12-03T10:00:00Z")
    assert out["progress"]["percent"] == int(100 * report.step / report.max_steps)
    RLRunStatus.model_validate({"progress": out["progress"]})  # the CRD's schema is this model's
    columns = {c["name"]: c["jsonPath"] for c in PRINTER_COLUMNS}
    assert (columns["Progress"], columns["ETA"]) == (".status.progress.text", ".status.progress.eta")


def test_rfc3339_seconds_reads_kubernetes_stamps_fractions_and_offsets_alike():
    assert rfc3339_seconds(T1) - rfc3339_seconds(T0) == 300.0
    assert rfc3339_seconds("2026-11-29T12:00:00.5Z") == rfc3339_seconds(T0) + 0.5
    assert rfc3339_seconds("2026-11-29T14:00:00+02:00") == rfc3339_seconds("2026-11-29T12:00:00") == rfc3339_seconds(T0)
