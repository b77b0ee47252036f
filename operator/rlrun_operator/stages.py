"""The actions of the preemption protocol: a run's first start, and each stage of a recovery, one function each.

Each function takes the run's :class:`~rlrun_operator.run_context.RunContext` (what the reconcile
read, and the only way it writes) and, for a recovery, the :class:`~rlrun.api.status.Recovery` the
status records. Every stage records what it is about to do **before** doing it (a ``deletedPods``
entry before the delete, the next stage before creating its pods) and acts idempotently by name,
so an operator killed anywhere and restarted finishes the stage exactly once. Each returns True
when it changed something and another stage may follow in the same reconcile.

| stage | function | does |
|---|---|---|
| (created) | :func:`start_first` | the run's objects, attempt 0's pods (none if created suspended), its first status |
| (created, or admitted) | :func:`create_first` | attempt 0's pods and first status: the one first start, Kueue's too |
| — | :func:`begin` | a disruption seen: record the recovery (or fail the run), count it, post the Event |
| Pausing | :func:`pause` | ``POST /pause`` to the live orchestrator, record what the snapshot saved |
| Stopping | :func:`stop` | delete the pods that must restart and wait until they are gone |
| Suspended | :func:`unsuspend` | wait for ``spec.suspend: false`` |
| Queued | :func:`.kueue_stages.queued` | a Kueue-managed run waits for its Workload's admission (that module) |
| Starting | :func:`start` | the next attempt's pods, or the lost pods' replacements |
| Resuming | :func:`resume`, :func:`resume_trainer` | wait for the new attempt's restore, or the new trainer |
| (done) | :func:`succeed` | ``Succeeded``, the rollout pods freed |

Which stage runs when is the reconciler's decision table (:mod:`.reconcile`); what a stage needs to
decide again (a new disruption meanwhile, the run's end) it asks the reconciler through
:class:`Reconciling`.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

from kubernetes.client.exceptions import ApiException
from rlrun.api.control import StatusReport
from rlrun.api.control_client import ControlError
from rlrun.api.status import EventReason, Phase, Recovery, RecoveryKind, Stage, Trigger

from rlrun_operator import kueue, naming, recovery
from rlrun_operator.builders import build_run_objects
from rlrun_operator.disruption import Disruption, node_trouble
from rlrun_operator.pods import build_pods, build_rollout_replacement, build_trainer_replacement
from rlrun_operator.run_context import RunContext
from rlrun_operator.status import PodView, rfc3339_seconds

log = logging.getLogger(__name__)


class Reconciling(Protocol):
    """What a stage asks of the reconciler (:class:`rlrun_operator.reconcile.Reconciler`)."""

    def complete(self, ctx: RunContext) -> bool:
        """The orchestrator reported every step trained and exited."""
        ...

    def disruptions(self, ctx: RunContext) -> list[Disruption]:
        """The run's pods disrupted now."""
        ...

    async def missing(self, ctx: RunContext) -> list[Disruption]:
        """The current attempt's pods that are gone."""
        ...

    async def poll(self, ctx: RunContext) -> tuple[StatusReport | None, str | None]:
        """The orchestrator's ``/status``, or why there is none."""
        ...

    async def observe(
        self, ctx: RunContext, report_in: StatusReport | None = None, resuming: str | None = None
    ) -> None:
        """Fold the orchestrator's report into phase and conditions."""
        ...

    def look_again(self, ctx: RunContext) -> None:
        """Reconcile the run again soon."""
        ...

    def recovery_started(self, ctx: RunContext) -> None:
        """A recovery (or suspension) begins now: its recovery time is measured from here."""
        ...

    def recovery_finished(self, ctx: RunContext, rec: Recovery) -> None:
        """The recovery is over: observe its duration."""
        ...


def _seconds_since(stamp: str | None) -> float:
    if not stamp:
        return 0.0
    return time.time() - rfc3339_seconds(stamp)


def _avoiding(avoid: list[str]) -> str:
    return f", kept off {', '.join(avoid)}" if avoid else ""


# -- the first start --------------------------------------------------------------------------------------


async def start_first(ctx: RunContext, queue: Callable[[RunContext], Awaitable[bool]] | None = None) -> None:
    """A new run: its claim, Secret, ConfigMap and Service, then attempt 0's pods (none with ``spec.suspend``, or
    when ``queue`` takes the run: Kueue's :func:`.kueue_stages.start_queued`), and its first status (the create
    handler calls this through the reconciler; a retry creates nothing twice)."""
    token = ctx.controls.token(*ctx.key) or secrets.token_urlsafe(32)
    objects = build_run_objects(ctx.body, ctx.run, ctx.settings, token)
    created = await ctx.create_each(objects)
    if objects[0]["kind"] == "PersistentVolumeClaim" and not created[0]:
        # Retained from an earlier RLRun of this name (retention Retain): resuming it is the point of
        # retaining, but the user should know; its size and retention are the old claim's.
        message = (
            f"claim {objects[0]['metadata']['name']} already existed (kept from an earlier run of this name?): "
            "its run directory is resumed; storage.size and retention_policy do not apply to it"
        )
        ctx.event(EventReason.EXISTING_CLAIM, message, warning=True)
    if queue is not None and await queue(ctx):
        return
    if ctx.run.spec.suspend:
        await ctx.write(recovery.created_suspended(ctx.status, ctx.generation))
        ctx.event(EventReason.SUSPENDED, "created with spec.suspend: no pods until it is false")
        return
    await create_first(ctx)


async def create_first(
    ctx: RunContext, placements: dict[str, kueue.Placement] | None = None, admission: kueue.Admission | None = None
) -> None:
    """Attempt 0's pods, its first status (:func:`.recovery.started`) and the ``Created`` Event: a new run's
    (:func:`start_first`), or a queued one's once Kueue admits it (:func:`.kueue_stages.starting`: the pods with the
    admission's ``placements``, the record of its wait closed, the ``admission`` named in the Event)."""
    count = await ctx.create(kueue.place(build_pods(ctx.body, ctx.run, ctx.settings, 0), placements))
    patch = recovery.started(ctx.status, ctx.generation, None, 0, ctx.run.spec.rollout.replicas)
    await ctx.write(patch if admission is None else {**patch, "recovery": None})
    log.info("%s/%s: attempt 0: %d pods created", ctx.namespace, ctx.name, count)
    named = f" ({admission.describe()})" if admission is not None else ""
    ctx.event(EventReason.CREATED, f"attempt 0: {count} pods created{named}")


# -- a recovery's start and stages ------------------------------------------------------------------------


async def suspend(r: Reconciling, ctx: RunContext) -> bool:
    """``spec.suspend`` on a run that is not suspended: begin a suspension (the pause path)."""
    alive = ctx.live_orchestrator() is not None and ctx.status.get("phase") != Phase.FAILED
    patch, _ = recovery.begin_suspension(ctx.status, ctx.generation, orchestrator_alive=alive)
    await ctx.write(patch)
    ctx.metrics.recoveries.labels(RecoveryKind.SUSPENSION, Trigger.SUSPEND).inc()
    r.recovery_started(ctx)
    return True


async def begin(r: Reconciling, ctx: RunContext, found: list[Disruption]) -> bool:
    """Disruptions seen: record the recovery they start (or the run's failure, freeing its accelerators),
    count each, post an Event each."""
    hit = {d.pod for d in found}
    alive = ctx.live_orchestrator(hit) is not None
    orchestrator = next((p for p in ctx.current() if p.component == naming.ORCHESTRATOR), None)
    patch, rec = recovery.begin(
        ctx.status,
        ctx.generation,
        found,
        orchestrator_alive=alive,
        backoff_limit=ctx.run.spec.failure_policy.backoff_limit,
        orchestrator_node=orchestrator.node if orchestrator is not None else None,
        trainer_group=[p.name for p in ctx.current() if p.component == naming.TRAINER],
    )
    for d in found:
        reason = EventReason.PREEMPTED if d.kind == RecoveryKind.PREEMPTION else EventReason.POD_FAILED
        ctx.metrics.recoveries.labels(d.kind, d.trigger).inc()
        ctx.event(reason, d.message, warning=True)
    if rec is None:  # the run fails: free the trainer's and rollout servers' accelerators
        doomed = [p for p in ctx.pods if p.component != naming.ORCHESTRATOR and not p.deleting]
        # Kueue's quota freed first: a Failed run is never looked at again (an operator killed in between finds the
        # failure again and finishes the Workload once more, which changes nothing)
        await ctx.finish_workload(Phase.FAILED, patch.get("message") or "failed")
        await ctx.write({**patch, **recovery.deleting(ctx.status, [p.name for p in doomed])})
        await ctx.delete(doomed)
        ctx.event(EventReason.FAILED, ctx.status.get("message") or "failed", warning=True)
        return False
    await ctx.write(patch)
    r.recovery_started(ctx)
    return True


def targets(ctx: RunContext, rec: Recovery) -> list:
    """The pods a recovery stops: all of the run's (scope attempt) or the lost ones (rollout, trainer)."""
    if rec.scope != "attempt":
        return [p for p in ctx.pods if p.name in rec.pods]
    return list(ctx.pods)


async def pause(ctx: RunContext, rec: Recovery) -> bool:
    """``POST /pause`` to the live orchestrator, then record ``Stopping`` (and the pods about to go)."""
    orchestrator = ctx.live_orchestrator(set(rec.pods))
    if orchestrator is None:
        note, ok = "the orchestrator is not running: the run resumes from its newest complete checkpoint", False
    else:
        started = time.perf_counter()
        try:
            client = await ctx.controls.get(*ctx.key)
            paused = await client.pause(timeout_s=ctx.run.spec.preemption.snapshot_timeout_seconds)
            note, ok = paused.describe(), True
        except (ControlError, ApiException) as exc:  # the pods go regardless; SIGTERM pauses it once more
            note, ok = f"pause failed ({exc}); the run resumes from its newest complete checkpoint", False
        ctx.metrics.pause_seconds.labels("paused" if ok else "failed").observe(time.perf_counter() - started)
    names = [p.name for p in targets(ctx, rec)]
    await ctx.write({**recovery.to_stage(rec, Stage.STOPPING, pause=note), **recovery.deleting(ctx.status, names)})
    ctx.event(EventReason.PAUSED if ok else EventReason.PAUSE_FAILED, note, warning=not ok)
    return True


async def held_by_finalizers(ctx: RunContext, held: list[PodView]) -> None:
    """Say once that the recovery waits for pods that finalizers hold terminating (``Degraded`` True,
    ``PodStuckTerminating``, and one Warning Event), and take it back once none is left.

    Nothing the operator can do frees such a pod (a force delete does not remove finalizers, and removing
    another controller's finalizer is that controller's business), and the recovery never starts the next
    pods while the old ones exist: it keeps waiting, and the condition says what for.
    """
    patch, warning = recovery.held_by_finalizers(ctx.status, ctx.generation, held)
    await ctx.write(patch)
    if warning is not None:
        ctx.event(EventReason.POD_STUCK_TERMINATING, warning, warning=True)


async def stop(r: Reconciling, ctx: RunContext, rec: Recovery) -> bool:
    """Delete the pods that must restart and wait until they are gone (force-deleting stuck ones on lost nodes)."""
    stopping = targets(ctx, rec)
    taints = ctx.settings.disruption_taints
    lost = [p.node for p in ctx.pods if p.node and node_trouble(ctx.nodes.get(p.node), True, taints) is not None]
    known = set(ctx.status.get("deletedPods") or [])
    patch = {}
    if any(p.name not in known for p in stopping):  # recorded before deleted
        patch.update(recovery.deleting(ctx.status, [p.name for p in stopping]))
    if lost and not set(lost) <= set(ctx.status.get("failedNodes") or []):
        patch["failedNodes"] = recovery.remember(ctx.status.get("failedNodes") or [], lost, recovery.MAX_FAILED_NODES)
    await ctx.write(patch)
    await ctx.delete([p for p in stopping if not p.deleting])
    overdue = [
        p
        for p in stopping
        if p.deleting and _seconds_since(p.deletion_deadline) > ctx.settings.force_delete_after_seconds
    ]
    stuck = [  # once: a force delete (grace 0) changes nothing the second time
        p
        for p in overdue
        if p.deletion_grace_s != 0 and (p.node is None or node_trouble(ctx.nodes.get(p.node), True, taints))
    ]
    if stuck:
        await ctx.delete(stuck, grace_s=0)
        names = ", ".join(p.name for p in stuck)
        ctx.event(EventReason.PREEMPTED, f"force-deleted {names}: stuck terminating on a lost node", True)
    await held_by_finalizers(ctx, [p for p in overdue if p.finalizers])
    if rec.scope != "attempt":
        if rec.scope == "trainer":
            current = {p.name for p in ctx.current()}
            widened = [
                d
                for d in r.disruptions(ctx)
                if d.component == naming.ORCHESTRATOR and d.pod in current and d.pod not in rec.pods
            ]
            if widened:  # the orchestrator is lost too while the trainer goes: the attempt restarts
                return await begin(r, ctx, widened)
            trainers = {n for n in rec.pods if naming.component_of(ctx.name, n) == naming.TRAINER}
            if any(p.name in trainers for p in await ctx.listed_pods()):
                return False  # two trainers never write the run directory at once: wait (pod events wake us)
        count = sum(ctx.status.get(k) or 0 for k in recovery.COUNTS.values())
        attempt = int(ctx.attempt or 0)
        # a missing pod is known by name only: its component and rollout index are in the name
        replacements = [naming.replacement_name(ctx.name, n, attempt, count) for n in rec.pods]
        await ctx.write(recovery.to_stage(rec, Stage.STARTING, replacements=replacements))
        return True
    if await ctx.listed_pods():
        return False  # never two attempts' pods at once: wait (pod events wake the reconcile)
    if rec.kind == RecoveryKind.SUSPENSION:
        message = f"suspended; {rec.pause}" if rec.pause else "suspended"
        patch = {
            **recovery.suspended_patch(ctx.status, ctx.generation, message),
            **recovery.to_stage(rec, Stage.SUSPENDED),
        }
        await ctx.write(patch)
        ctx.event(EventReason.SUSPENDED, f"{len(stopping)} pods deleted")
        return True
    await ctx.write(recovery.to_stage(rec, Stage.STARTING, nextAttempt=recovery.following_attempt(ctx.attempt)))
    return True


async def unsuspend(r: Reconciling, ctx: RunContext, rec: Recovery) -> bool:
    """A suspended run whose ``spec.suspend`` is false again: on to ``Starting`` the next attempt."""
    if ctx.run.spec.suspend:
        return False
    await ctx.write(recovery.to_stage(rec, Stage.STARTING, nextAttempt=recovery.following_attempt(ctx.attempt)))
    r.recovery_started(ctx)
    return True


async def start(r: Reconciling, ctx: RunContext, rec: Recovery, placements: dict | None = None) -> bool:
    """Create the next attempt's pods (or the lost pods' replacements), with a Kueue admission's ``placements``
    (:func:`.kueue.place`); run objects first (never a pod whose Secret is missing)."""
    await ctx.ensure_run_objects()
    avoid = list(ctx.status.get("failedNodes") or [])
    if rec.scope == "attempt":
        attempt = int(rec.nextAttempt if rec.nextAttempt is not None else 0)
        count = await ctx.create(kueue.place(build_pods(ctx.body, ctx.run, ctx.settings, attempt, avoid), placements))
        await ctx.write(recovery.started(ctx.status, ctx.generation, rec, attempt, ctx.run.spec.rollout.replicas))
        ctx.event(EventReason.RECREATED, f"attempt {attempt}: {count} pods created with --resume{_avoiding(avoid)}")
        return True
    # the same attempt goes on: replacements of the lost pods only; a trainer group is replaced whole
    # (every node's pod, the group's size kept)
    attempt = int(ctx.attempt or 0)
    nodes = sum(1 for name in rec.replacements if naming.component_of(ctx.name, name) == naming.TRAINER)
    pods = [
        build_trainer_replacement(
            ctx.body, ctx.run, ctx.settings, attempt, name, avoid, naming.trainer_node_of(ctx.name, name), nodes
        )
        if naming.component_of(ctx.name, name) == naming.TRAINER
        else build_rollout_replacement(
            ctx.body, ctx.run, ctx.settings, attempt, naming.rollout_index_of(ctx.name, name), name, avoid
        )
        for name in rec.replacements
    ]
    await ctx.create(kueue.place(pods, placements))
    replaced = f"replaced {', '.join(rec.pods)} by {', '.join(rec.replacements)}"
    if rec.scope == "trainer":  # done once the replacement trainer runs
        await ctx.write(recovery.replaced(ctx.status, ctx.generation, rec, attempt))
        ctx.event(EventReason.RECREATED, f"{replaced} with --resume; attempt {attempt} goes on{_avoiding(avoid)}")
        return True
    await ctx.write(recovery.finished(ctx.status, ctx.generation, rec, None, attempt))
    ctx.event(EventReason.RECREATED, replaced)
    r.recovery_finished(ctx, rec)
    return True


async def _ended_or_disrupted(r: Reconciling, ctx: RunContext, rec: Recovery) -> bool | None:
    """What a stage waiting for new pods checks first: the run finished meanwhile (the recovery is over:
    False), or a new disruption hit the current pods (a new recovery begins: its result); None: neither."""
    if r.complete(ctx):  # it finished before a poll saw the recovery end
        await succeed(ctx)
        r.recovery_finished(ctx, rec)
        return False
    found = r.disruptions(ctx) or await r.missing(ctx)
    current = {p.name for p in ctx.current()}
    found = [d for d in found if d.pod in current or d.trigger == Trigger.POD_MISSING]
    if found:
        return await begin(r, ctx, found)
    return None


async def resume(r: Reconciling, ctx: RunContext, rec: Recovery) -> bool:
    """Wait for the new attempt's orchestrator to confirm its restore; a new disruption starts a new recovery."""
    if (outcome := await _ended_or_disrupted(r, ctx, rec)) is not None:
        return outcome
    report, _ = await r.poll(ctx)
    if report is None or report.attempt != ctx.attempt or report.phase not in ("running", "done"):
        waiting = f"attempt {int(ctx.attempt or 0)}: waiting for the orchestrator to confirm what it restored"
        await r.observe(ctx, report_in=report, resuming=waiting)
        r.look_again(ctx)
        return False
    await ctx.write(recovery.finished(ctx.status, ctx.generation, rec, report.resume, int(ctx.attempt or 0)))
    if report.resume is not None:
        ctx.event(EventReason.RESUMED, f"attempt {ctx.attempt} {recovery.resume_message(report.resume)}")
    else:
        ctx.event(EventReason.RESUMED, f"attempt {ctx.attempt} started over: no complete checkpoint")
    r.recovery_finished(ctx, rec)
    await r.observe(ctx, report_in=report)
    return False


async def resume_trainer(r: Reconciling, ctx: RunContext, rec: Recovery) -> bool:
    """Wait for a trainer replacement (same attempt) to run; a new disruption starts a new recovery.

    The orchestrator kept running and has nothing to report about it: the replacement pods running (the
    kubelet started ``rlrun trainer … --resume`` on every node of the group) end the recovery.
    """
    if (outcome := await _ended_or_disrupted(r, ctx, rec)) is not None:
        return outcome
    attempt = int(ctx.attempt or 0)
    trainers = [n for n in rec.replacements if naming.component_of(ctx.name, n) == naming.TRAINER]
    running = {p.name for p in ctx.pods if p.name in trainers and p.phase in ("Running", "Succeeded")}
    if running != set(trainers):  # a group trains only once every node's pod runs
        waiting = ", ".join(n for n in trainers if n not in running)
        await r.observe(ctx, resuming=f"attempt {attempt}: waiting for {waiting} to start")
        return False
    await ctx.write(recovery.finished(ctx.status, ctx.generation, rec, None, attempt))
    ctx.event(EventReason.RESUMED, recovery.trainer_replaced_message(rec, attempt))
    r.recovery_finished(ctx, rec)
    await r.observe(ctx)
    return False


async def advance(r: Reconciling, ctx: RunContext, rec: Recovery) -> bool:
    """Run the stage ``rec`` is in."""
    if rec.stage == Stage.PAUSING:
        return await pause(ctx, rec)
    if rec.stage == Stage.STOPPING:
        return await stop(r, ctx, rec)
    if rec.stage == Stage.SUSPENDED:
        return await unsuspend(r, ctx, rec)
    if rec.stage == Stage.STARTING:
        return await start(r, ctx, rec)
    if rec.scope == "trainer":
        return await resume_trainer(r, ctx, rec)
    return await resume(r, ctx, rec)


# -- the end ----------------------------------------------------------------------------------------------


async def succeed(ctx: RunContext) -> None:
    """Every step trained: ``Succeeded`` (its conditions, the recovery closed), the rollout pods freed."""
    rollouts = [p for p in ctx.pods if p.component == naming.ROLLOUT and not p.deleting]
    patch = recovery.succeeded(ctx.status, ctx.generation)
    message = patch["message"]
    # Kueue's quota freed first: a Succeeded run is never looked at again (killed in between, the operator finds the
    # run complete again and finishes the Workload once more, which changes nothing)
    await ctx.finish_workload(Phase.SUCCEEDED, message)
    await ctx.write({**patch, **recovery.deleting(ctx.status, [p.name for p in rollouts])})
    await ctx.delete(rollouts)
    ctx.event(EventReason.SUCCEEDED, f"{message}; {len(rollouts)} rollout pods removed")
