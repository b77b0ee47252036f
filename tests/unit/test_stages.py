"""The operator's stages (``rlrun_operator.stages``) on a real :class:`~rlrun_operator.run_context.RunContext`
whose Kubernetes is a list of the calls made: which pods a stage stops, what it records before it acts, when it
force-deletes a pod stuck on a lost node, what it says of a pod held by finalizers, how a suspension ends and what a
run's success writes. The decision table that picks a stage is ``kube/test_operator.py``'s, against real kopf."""

from __future__ import annotations

import datetime as dt
from typing import Any

import kopf
import pytest
from prometheus_client import CollectorRegistry
from rlrun.api.status import ConditionType, EventReason, Phase, Reason, Recovery, Stage, Trigger
from rlrun_operator import stages
from rlrun_operator.disruption import NodeView
from rlrun_operator.metrics import OperatorMetrics
from rlrun_operator.run_context import RunContext
from rlrun_operator.settings import OperatorSettings
from rlrun_operator.status import PodView

from tests.support.manifests import parse

SINCE = "2026-01-01T00:00:00Z"


class Kube:
    """The calls a :class:`RunContext` makes to the API server, in order; status patches merged as the server
    merges them (a key set to None is removed)."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body
        self.calls: list[tuple] = []

    def patch_run_status(self, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        self.calls.append(("status", patch))
        status = dict(self.body.get("status") or {})
        for key, value in patch.items():
            if value is None:
                status.pop(key, None)
            else:
                status[key] = value
        self.body = {**self.body, "status": status}
        return self.body

    def delete_pod(self, namespace: str, name: str, grace_s: int | None) -> None:
        self.calls.append(("delete", name, grace_s))

    def list_pods(self, namespace: str, name: str) -> list[dict[str, Any]]:
        return []  # every pod the stage deleted is gone


class Reconciler:
    """A :class:`~rlrun_operator.stages.Reconciling` that only counts the recoveries started."""

    def __init__(self) -> None:
        self.started = 0

    def recovery_started(self, ctx: RunContext) -> None:
        self.started += 1

    def disruptions(self, ctx: RunContext) -> list:
        return []


@pytest.fixture
def events(monkeypatch) -> list[tuple[str, str, str]]:
    """The Events posted on the run: ``(type, reason, message)``."""
    posted: list[tuple[str, str, str]] = []
    monkeypatch.setattr(kopf, "event", lambda body, type, reason, message: posted.append((type, reason, message)))
    return posted


def context(status: dict[str, Any], pods: list[PodView], nodes=(), **spec) -> tuple[RunContext, Kube]:
    body = {"metadata": {"namespace": "ns", "name": "demo", "uid": "uid-1", "generation": 3}, "status": status}
    kube = Kube(body)
    settings = OperatorSettings(force_delete_after_seconds=60)
    ctx = RunContext(
        body,
        parse("demo", **spec),
        dict(status),
        pods,
        {n.name: n for n in nodes},
        kube,
        settings,
        OperatorMetrics(CollectorRegistry()),
        controls=None,
    )
    return ctx, kube


def pod(name: str, component: str, node: str | None = "node-a", **kw) -> PodView:
    return PodView(name, component, 0, kw.pop("phase", "Running"), True, "10.0.0.1", node=node, **kw)


def stamp(seconds_ago: float) -> str:
    """An RFC 3339 timestamp ``seconds_ago`` seconds ago, as the API server writes ``deletionTimestamp``."""
    return (dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=seconds_ago)).strftime("%Y-%m-%dT%H:%M:%SZ")


def recovery(scope: str = "attempt", pods=(), stage: str = Stage.STOPPING, kind: str = "preemption") -> Recovery:
    return Recovery(
        trigger=Trigger.NODE_GONE,
        kind=kind,
        scope=scope,
        pods=list(pods),
        stage=stage,
        since=SINCE,
        stageSince=SINCE,
        attempt=0,
    )


def statuses(kube: Kube) -> list[dict[str, Any]]:
    return [call[1] for call in kube.calls if call[0] == "status"]


def test_a_recovery_of_the_attempt_stops_every_pod_and_one_of_a_rollout_only_its_own():
    pods = [pod("demo-orchestrator-a0", "orchestrator"), pod("demo-rollout-0-a0", "rollout")]
    pods += [pod("demo-rollout-1-a0", "rollout"), pod("demo-trainer-a0", "trainer")]
    ctx, _ = context({"attempt": 0}, pods)
    assert stages.targets(ctx, recovery("attempt")) == pods
    assert stages.targets(ctx, recovery("rollout", ["demo-rollout-1-a0"])) == [pods[2]]
    assert stages.targets(ctx, recovery("rollout", ["demo-rollout-7-a0"])) == []  # already gone


async def test_stopping_records_the_pods_it_deletes_before_deleting_each_with_its_own_grace(events):
    pods = [pod("demo-orchestrator-a0", "orchestrator", grace_period_s=30), pod("demo-trainer-a0", "trainer")]
    pods[1] = PodView(**{**pods[1].__dict__, "grace_period_s": 120})
    ctx, kube = context({"attempt": 0, "deletedPods": ["demo-rollout-0-a0"]}, pods, [NodeView("node-a", frozenset())])
    assert await stages.stop(Reconciler(), ctx, recovery()) is True
    first, *deletes, starting = kube.calls
    assert first == ("status", {"deletedPods": ["demo-rollout-0-a0", "demo-orchestrator-a0", "demo-trainer-a0"]})
    assert sorted(deletes) == [("delete", "demo-orchestrator-a0", 30), ("delete", "demo-trainer-a0", 120)]
    # every pod gone: the next attempt is decided (recorded) before any of its pods exists
    assert starting[1]["recovery"]["stage"] == Stage.STARTING and starting[1]["recovery"]["nextAttempt"] == 1
    assert events == []


async def test_a_pod_stuck_terminating_on_a_lost_node_is_force_deleted_once_past_the_setting(events):
    """``force_delete_after_seconds`` (60) counts from the end of the pod's grace period (its ``deletionTimestamp``);
    only a pod whose node is gone (or tainted to go, or not ready) is force-deleted: a kubelet that is alive finishes
    its own deletions."""
    stuck = pod("demo-trainer-a0", "trainer", node="node-gone", deleting=True, deletion_deadline=stamp(120))
    recent = pod("demo-orchestrator-a0", "orchestrator", node="node-gone", deleting=True, deletion_deadline=stamp(10))
    alive = pod("demo-rollout-0-a0", "rollout", node="node-a", deleting=True, deletion_deadline=stamp(120))
    names = [p.name for p in (stuck, recent, alive)]
    ctx, kube = context({"attempt": 0, "deletedPods": names}, [stuck, recent, alive], [NodeView("node-a", frozenset())])
    await stages.stop(Reconciler(), ctx, recovery())
    assert statuses(kube)[0] == {"failedNodes": ["node-gone"]}  # kept off by the next attempt's pods
    assert [c for c in kube.calls if c[0] == "delete"] == [("delete", "demo-trainer-a0", 0)]
    assert events == [
        ("Warning", EventReason.PREEMPTED, "force-deleted demo-trainer-a0: stuck terminating on a lost node")
    ]
    # once: a pod already force-deleted (grace 0) is not deleted again, and the node is remembered once
    force_deleted = PodView(**{**stuck.__dict__, "deletion_grace_s": 0})
    ctx, kube = context({"attempt": 0, "deletedPods": names, "failedNodes": ["node-gone"]}, [force_deleted, recent])
    await stages.stop(Reconciler(), ctx, recovery())
    assert [c for c in kube.calls if c[0] == "delete"] == [] and "failedNodes" not in statuses(kube)[0]


async def test_a_pod_held_by_finalizers_degrades_the_run_once_and_the_condition_clears_when_it_is_gone(events):
    held = pod("demo-trainer-a0", "trainer", deleting=True, deletion_deadline=stamp(120), finalizers=("example.com/f",))
    nodes = [NodeView("node-a", frozenset())]  # its node is fine: nothing the operator may do frees it
    ctx, kube = context({"attempt": 0, "deletedPods": [held.name]}, [held], nodes)
    await stages.stop(Reconciler(), ctx, recovery())
    [degraded] = [c for c in statuses(kube)[0]["conditions"] if c["type"] == ConditionType.DEGRADED]
    message = (
        "pod demo-trainer-a0 is held terminating by finalizers example.com/f: the recovery goes on once it is gone "
        "(whatever owns a finalizer must remove it)"
    )
    assert (degraded["status"], degraded["reason"], degraded["message"]) == (
        "True",
        Reason.POD_STUCK_TERMINATING,
        message,
    )
    assert events == [("Warning", EventReason.POD_STUCK_TERMINATING, message)]
    assert [c for c in kube.calls if c[0] == "delete"] == []  # not force-deleted: its node is not lost
    # the next look, still held: nothing written again, no second Event
    ctx, kube = context(kube.body["status"], [held], nodes)
    await stages.held_by_finalizers(ctx, [held])
    assert kube.calls == [] and len(events) == 1
    # gone: Degraded goes back to False
    await stages.held_by_finalizers(ctx, [])
    [cleared] = [c for c in statuses(kube)[0]["conditions"] if c["type"] == ConditionType.DEGRADED]
    assert (cleared["status"], cleared["reason"]) == ("False", Reason.AS_EXPECTED)


async def test_a_suspension_waits_for_spec_suspend_false_then_starts_the_next_attempt(events):
    suspended = recovery(stage=Stage.SUSPENDED, kind="suspension")
    reconciler = Reconciler()
    ctx, kube = context({"attempt": 2}, [], suspend=True)
    assert await stages.unsuspend(reconciler, ctx, suspended) is False and kube.calls == []
    ctx, kube = context({"attempt": 2}, [], suspend=False)
    assert await stages.unsuspend(reconciler, ctx, suspended) is True
    [patch] = statuses(kube)
    assert patch["recovery"]["stage"] == Stage.STARTING and patch["recovery"]["nextAttempt"] == 3
    assert reconciler.started == 1  # its recovery time is measured from the unsuspend


async def test_success_writes_the_end_and_frees_the_rollout_pods(events):
    pods = [pod("demo-orchestrator-a0", "orchestrator", phase="Succeeded"), pod("demo-trainer-a0", "trainer")]
    pods += [pod("demo-rollout-0-a0", "rollout"), pod("demo-rollout-1-a0", "rollout", deleting=True)]
    ctx, kube = context({"attempt": 0, "maxSteps": 40, "phase": Phase.RUNNING, "step": 39}, pods)
    await stages.succeed(ctx)
    [patch] = statuses(kube)
    assert patch["phase"] == Phase.SUCCEEDED and patch["message"] == "all 40 steps trained" and patch["step"] == 40
    assert patch["progress"] == {"percent": 100, "text": "100%", "eta": "-", "etaSeconds": None}
    assert patch["recovery"] is None and patch["deletedPods"] == ["demo-rollout-0-a0"]
    conditions = {c["type"]: (c["status"], c["reason"]) for c in patch["conditions"]}
    assert conditions[ConditionType.SUCCEEDED] == ("True", Reason.COMPLETED)
    assert conditions[ConditionType.READY] == conditions[ConditionType.FAILED] == ("False", Reason.COMPLETED)
    assert kube.calls[1:] == [("delete", "demo-rollout-0-a0", None)]  # recorded first; the one not yet deleting
    assert events == [("Normal", EventReason.SUCCEEDED, "all 40 steps trained; 1 rollout pods removed")]
    assert ctx.status["phase"] == Phase.SUCCEEDED  # the context follows what it wrote
