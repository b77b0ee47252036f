"""The run's status patches of Kueue's stages, pure (``rlrun_operator.kueue_recovery``): queueing, admission and
eviction write these exact patches; an eviction is counted once, and takes over only what it may."""

from __future__ import annotations

from rlrun.api.status import Recovery, RLRunStatus
from rlrun_operator import kueue
from rlrun_operator.kueue_recovery import (
    admitted,
    begin_queueing,
    evicted,
    may_take_over,
    queue_record,
    queued,
    same_interruption,
    unqueued,
)

NOW = "2026-12-04T12:00:00Z"
LATER = "2026-12-04T12:05:00Z"
QUEUE = {"name": "team-q", "workload": "rlrun-demo", "admitted": False, "clusterQueue": None, "flavors": None}
ADMISSION = kueue.Admission("cq", {"trainer": ["gpu-a"], "orchestrator": ["cpu-pool"]})


def cond(type_, status, reason, message="", when=NOW, generation=1):
    return {
        "type": type_,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": when,
        "observedGeneration": generation,
    }


def rec(**fields):
    base = dict(trigger="KueueAdmission", kind="suspension", reason="Created", message="waiting for Kueue")
    return Recovery(**{**base, "stage": "Queued", "since": NOW, "stageSince": NOW, "nextAttempt": 0, **fields})


def dump(recovery):
    return recovery.model_dump(mode="json")


def valid(status, patch):
    out = {**status, **patch}
    RLRunStatus.model_validate({k: v for k, v in out.items() if v is not None})  # the CRD's status schema
    return out


def workload(*conditions):
    return {"metadata": {"name": "rlrun-demo"}, "spec": {}, "status": {"conditions": list(conditions)}}


def test_the_queue_record_names_the_admission_or_none():
    assert queue_record("team-q", "rlrun-demo") == QUEUE
    assert queue_record("team-q", "rlrun-demo", ADMISSION) == {
        **QUEUE,
        "admitted": True,
        "clusterQueue": "cq",
        "flavors": {"trainer": ["gpu-a"], "orchestrator": ["cpu-pool"]},
    }


def test_a_new_labelled_run_is_queued_for_attempt_0_without_a_count():
    patch, recovery = begin_queueing(3, now=NOW)
    assert recovery == rec()
    assert patch == {"recovery": dump(rec()), "observedGeneration": 3, "phase": "Queued"}


def test_queued_says_where_the_run_waits_and_an_event_only_when_it_enters_or_the_reason_changes():
    patch, event = queued({"phase": "Pending"}, 1, QUEUE, "Queued", "insufficient quota")
    text = "queued in LocalQueue team-q (Workload rlrun-demo): insufficient quota"
    [condition] = patch["conditions"]
    assert event == "Queued"
    assert patch == {
        "phase": "Queued",
        "message": text,
        "conditions": [cond("Admitted", "False", "Queued", text, condition["lastTransitionTime"])],
        "queue": QUEUE,
    }
    status = valid({"phase": "Pending"}, patch)
    assert queued(status, 1, QUEUE, "Queued", "insufficient quota") == (None, None)  # nothing new
    # Kueue's message changed: the condition follows it, without an Event
    changed, event = queued(status, 1, QUEUE, "Queued", "still insufficient quota")
    assert event is None and changed["message"].endswith(": still insufficient quota")
    # the same words, with the recovery's stage to write: written, no Event
    extra = {"recovery": dump(rec())}
    assert queued(status, 1, QUEUE, "Queued", "insufficient quota", extra) == ({**patch, **extra}, None)
    # another reason: its own Event
    assert queued(status, 1, QUEUE, "FlavorConflict", "gpu-a: clash")[1] == "FlavorConflict"


def test_a_run_held_while_the_integration_is_off_says_so_in_its_own_words_and_no_queue():
    patch, event = queued({}, 1, QUEUE, "KueueDisabled", "held: enable kueue.enabled")
    [condition] = patch["conditions"]
    assert event == "KueueDisabled"
    assert patch == {
        "phase": "Queued",
        "message": "held: enable kueue.enabled",
        "conditions": [
            cond("Admitted", "False", "KueueDisabled", "held: enable kueue.enabled", condition["lastTransitionTime"])
        ],
    }


def test_admission_starts_the_next_attempt_and_records_the_admission():
    status = {"conditions": [cond("Admitted", "False", "Queued", "queued")]}
    message = f"admitted by Kueue: {ADMISSION.describe()}"
    queue = queue_record("team-q", "rlrun-demo", ADMISSION)
    patch = admitted(status, 2, rec(), 0, queue, message, now=LATER)
    [condition] = patch["conditions"]
    assert patch == {
        "recovery": dump(rec(stage="Starting", stageSince=LATER)),
        "queue": queue,
        "conditions": [cond("Admitted", "True", "Admitted", message, condition["lastTransitionTime"], 2)],
        "message": message,
    }
    valid(status, patch)


def test_a_queued_run_whose_label_is_removed_starts_without_kueue():
    status = {"conditions": [cond("Ready", "False", "Starting"), cond("Admitted", "False", "Queued", "queued")]}
    assert unqueued(status, rec(), 4, now=LATER) == {
        "recovery": dump(rec(stage="Starting", stageSince=LATER, nextAttempt=4)),
        "conditions": [cond("Ready", "False", "Starting")],
        "queue": None,
    }


def test_an_eviction_is_an_attempt_preemption_counted_once_in_the_patch_that_records_it():
    ev = kueue.Eviction("Preempted", "preempted by a higher priority workload", "InClusterQueue")
    admitted_queue = queue_record("team-q", "rlrun-demo", ADMISSION)
    status = {"attempt": 1, "preemptions": 2, "phase": "Running", "queue": admitted_queue}
    patch, recovery = evicted(
        status, 5, ev, "team-q", "rlrun-demo", taken=None, same=False, orchestrator_alive=True, now=LATER
    )
    message = "Kueue evicted Workload rlrun-demo (Preempted, InClusterQueue): preempted by a higher priority workload"
    assert recovery == Recovery(
        trigger="KueueEviction",
        kind="preemption",
        reason="Preempted",
        message=message,
        stage="Pausing",
        since=LATER,
        stageSince=LATER,
        attempt=1,
    )
    assert patch == {
        "preemptions": 3,
        "recovery": dump(recovery),
        "phase": "Evicted",
        "message": f"evicted: {message}; pausing, then stopping the pods",
        "conditions": [
            cond("Ready", "False", "Evicted", message, LATER, 5),
            cond("Preempted", "True", "KueueEviction", message, LATER, 5),
            cond("Admitted", "False", "Evicted", message, LATER, 5),
        ],
        "queue": {**admitted_queue, "admitted": False},
    }
    valid(status, patch)


def test_an_eviction_that_explains_the_loss_in_progress_keeps_its_count_and_start():
    ev = kueue.Eviction("Preempted")
    taken = Recovery(
        trigger="PodDeleted", kind="preemption", reason="r", message="m", stage="Stopping", since=NOW, stageSince=NOW
    )
    status = {"attempt": 0, "preemptions": 1}
    patch, recovery = evicted(
        status, 1, ev, "team-q", "rlrun-demo", taken=taken, same=True, orchestrator_alive=False, now=LATER
    )
    assert patch["preemptions"] == 1 and (recovery.since, recovery.stage) == (NOW, "Stopping")
    assert patch["queue"] == QUEUE  # the run had no queue record: the LocalQueue and Workload named
    assert recovery.message == (
        "Kueue evicted Workload rlrun-demo (Preempted); the run was recovering from its pods' loss (PodDeleted): "
        "counted once"
    )


def test_an_eviction_takes_over_any_recovery_but_a_suspension_a_wait_in_the_queue_or_its_own():
    assert may_take_over(None)
    assert may_take_over(rec(trigger="PodDeleted", kind="preemption", stage="Stopping"))
    assert may_take_over(rec(trigger="KueueEviction", kind="preemption", stage="Resuming"))
    assert not may_take_over(rec(trigger="KueueEviction", kind="preemption", stage="Stopping"))
    assert not may_take_over(rec(trigger="SpecSuspend", kind="suspension", stage="Stopping"))
    assert not may_take_over(rec(trigger="PodDeleted", kind="preemption", stage="Queued"))


def test_an_eviction_is_the_pod_loss_it_explains_only_when_that_loss_began_under_the_admission_taken_back():
    def taken(trigger="PodDeleted", kind="preemption", since="2026-12-04T12:00:05Z"):
        fields = dict(trigger=trigger, kind=kind, reason="r", message="m", stage="Stopping")
        return Recovery(**fields, since=since, stageSince=since)

    reserved = {"type": "QuotaReserved", "status": "True", "reason": "R", "message": "", "lastTransitionTime": NOW}
    evicted_now = workload(reserved, {**reserved, "type": "Evicted", "reason": "Preempted"})  # reserved at NOW
    assert same_interruption(taken(), evicted_now) and same_interruption(taken(since=NOW), evicted_now)
    assert not same_interruption(None, evicted_now)
    assert not same_interruption(taken(kind="failure"), evicted_now)  # a crash and an eviction: two counts
    assert not same_interruption(taken(trigger="KueueEviction"), evicted_now)  # Kueue's own eviction
    assert not same_interruption(taken(since="2026-12-04T11:59:59Z"), evicted_now)  # began before this admission
    assert not same_interruption(taken(), workload({**reserved, "status": "False"}))  # QuotaLost: no reservation
