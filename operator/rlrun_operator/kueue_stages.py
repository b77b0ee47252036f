"""The Kueue stages of a run labelled ``kueue.x-k8s.io/queue-name``: queueing, admission, eviction, and the job
side of Kueue's contract. :mod:`.kueue` decides (pure); this module acts, through the run's
:class:`~rlrun_operator.run_context.RunContext`, and hands the rest to :mod:`.stages` (the pause → snapshot →
stop path is the preemption's own).

| when | function | does |
|---|---|---|
| a labelled run is created | :func:`start_queued` | its Workload, no pods, phase and stage ``Queued`` (not counted) |
| the label, integration off | :func:`start_queued`, :func:`queued` | held: ``Admitted`` False ``KueueDisabled``³ |
| stage ``Queued`` | :func:`queued` | wait for admission (Kueue's message in ``Admitted``); admitted: ``Starting`` |
| stage ``Starting`` | :func:`starting` | pods only while admitted, placed by the admission; else back to ``Queued`` |
| the Workload evicted¹ | :func:`evict` | an attempt-scope preemption, trigger ``KueueEviction``, phase ``Evicted``² |
| the evicted run's pods gone (``Starting``) | :func:`starting` | the Workload's quota released, back to ``Queued`` |
| stage ``Suspended`` (``spec.suspend``) | :func:`step` | ``spec.active: false``; ``Deactivated`` eviction released⁴ |
| any other look at an admitted run | :func:`step` | the Workload's ``PodsReady`` follows the pods |

¹ Or its quota or itself gone while pods run. ² It takes over any other recovery. ³ And one Warning. ⁴ Kueue's,
not counted.

An eviction that finds the run recovering from the loss of its pods under the admission Kueue takes back is
that loss's cause made known late: counted once (:func:`.kueue_recovery.same_interruption`). The status patches
written here are :mod:`.kueue_recovery`'s (pure); attempt 0's pods are created by :func:`.stages.create_first`,
as for a run without Kueue.

The run's ``status.queue`` marks it as admitted through Kueue: only such a run is watched for evictions (a label
added to, or removed from, a running run takes effect at its next queueing: when it is suspended, or evicted).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from kubernetes.client.exceptions import ApiException
from rlrun.api.status import EventReason, Phase, Reason, Recovery, RecoveryKind, Stage, Trigger

from rlrun_operator import kueue, kueue_recovery, naming, recovery, stages
from rlrun_operator.pods import build_pods
from rlrun_operator.run_context import RunContext
from rlrun_operator.stages import Reconciling

log = logging.getLogger(__name__)

#: Why a labelled run waits when the cluster serves no Workloads (the operator's integration is on, Kueue is not there).
NOT_SERVED = (
    "this cluster does not serve Kueue's Workloads (kueue.x-k8s.io/v1beta1): install Kueue (v0.10 or newer), "
    "or remove the label to run without queueing"
)


def queue_name(ctx: RunContext) -> str | None:
    """The run's LocalQueue (its ``kueue.x-k8s.io/queue-name`` label), if it has one."""
    return kueue.queue_name(ctx.body)


def managed(ctx: RunContext) -> bool:
    """Kueue admits the run: it has the queue label and the operator runs with ``kueue_enabled``."""
    return bool(queue_name(ctx)) and ctx.settings.kueue_enabled


def held(ctx: RunContext) -> bool:
    """The run has the queue label but the operator runs without Kueue: it is held, never run unqueued."""
    return bool(queue_name(ctx)) and not ctx.settings.kueue_enabled


def involved(ctx: RunContext, rec: Recovery | None) -> bool:
    """Whether Kueue has a say in this reconcile: the run has the queue label, was admitted through Kueue
    (``status.queue``), or waits in stage ``Queued`` (its label may be gone since)."""
    return bool(queue_name(ctx) or ctx.status.get("queue") or (rec is not None and rec.stage == Stage.QUEUED))


def _next_attempt(ctx: RunContext, rec: Recovery) -> int:
    """The attempt a queued run starts: the one its recovery already chose, else the one after the current."""
    return int(rec.nextAttempt) if rec.nextAttempt is not None else recovery.following_attempt(ctx.attempt)


def _queue(ctx: RunContext, adm: kueue.Admission | None = None) -> dict[str, Any]:
    return kueue_recovery.queue_record(queue_name(ctx), naming.workload_name(ctx.name), adm)


# -- the Workload -----------------------------------------------------------------------------------------


async def _get(ctx: RunContext) -> dict[str, Any] | None:
    return await asyncio.to_thread(ctx.kube.get_workload, ctx.namespace, naming.workload_name(ctx.name))


async def _patch(ctx: RunContext, patch: dict[str, Any] | None) -> None:
    """Merge ``patch`` into the Workload's spec side (nothing for None)."""
    if patch:
        await asyncio.to_thread(ctx.kube.patch_workload, ctx.namespace, naming.workload_name(ctx.name), patch)


async def _patch_status(ctx: RunContext, workload: dict[str, Any], patch: dict[str, Any] | None) -> bool:
    """Write ``patch`` into the status of ``workload`` as read (:func:`.kueue.status_ops`); False: not written (nothing
    to write, or Kueue changed it meanwhile: the next reconcile, woken by that change, decides again)."""
    if not patch:
        return False
    ops = kueue.status_ops(workload, patch)
    name = naming.workload_name(ctx.name)
    return await asyncio.to_thread(ctx.kube.patch_workload_status, ctx.namespace, name, ops)


async def _release(ctx: RunContext, workload: dict[str, Any]) -> bool:
    """Give an evicted Workload's quota back (the run has no pod left: the caller knows); True when done now."""
    ev = kueue.eviction(workload, has_pods=False)
    if ev is None or not await _patch_status(ctx, workload, kueue.release_quota(workload, ev)):
        return False
    message = f"the pods are gone: Workload {naming.workload_name(ctx.name)}'s quota given back to Kueue ({ev.reason})"
    ctx.event(EventReason.QUOTA_RELEASED, message)
    return True


async def _priority(ctx: RunContext) -> tuple[str, int] | None:
    name = kueue.priority_class(ctx.body)
    if name is None:
        return None
    found = await asyncio.to_thread(ctx.kube.get_kueue_object, kueue.PRIORITY_CLASSES, name)
    if found is None:
        message = (
            f"WorkloadPriorityClass {name} (label {naming.PRIORITY_LABEL}) does not exist: queued without priority"
        )
        ctx.event(EventReason.NO_PRIORITY_CLASS, message, warning=True)
        return None
    return name, int(found.get("value") or 0)


async def ensure_workload(ctx: RunContext, attempt: int) -> dict[str, Any]:
    """The run's Workload as it is now, created (active) for ``attempt``'s pods if it is gone; a Workload holding no
    quota is kept up to date: its ``queueName`` follows the run's label, its pod sets the spec (Kueue's job reconciler
    does both while the job is suspended). ``spec.active`` is left alone: a Workload deactivated by its user or by
    Kueue (``waitForPodsReady``'s requeuing limit) stays so until they reactivate it; only the run's own suspension
    sets it (:func:`step`, :func:`starting`)."""
    pods = build_pods(ctx.body, ctx.run, ctx.settings, attempt, list(ctx.status.get("failedNodes") or []))
    wanted = kueue.pod_sets(pods)
    workload = await _get(ctx)
    if kueue.is_true(workload, kueue.FINISHED):  # a failed run retried: Kueue never admits a finished Workload again
        if not workload["metadata"].get("deletionTimestamp"):  # replaced once it is gone (Kueue's finalizer first)
            await asyncio.to_thread(ctx.kube.delete_workload, ctx.namespace, naming.workload_name(ctx.name))
        return workload
    if workload is None:
        built = kueue.build_workload(ctx.body, pods, queue_name(ctx) or "", await _priority(ctx))
        await ctx.create([built])
        return await _get(ctx) or built
    patch: dict[str, Any] = {}
    if not kueue.is_true(workload, kueue.QUOTA_RESERVED):  # Kueue lets these change only while no quota is reserved
        if queue_name(ctx) and (workload.get("spec") or {}).get("queueName") != queue_name(ctx):
            patch["queueName"] = queue_name(ctx)  # the label was changed while queued: the run moves to that queue
        if kueue.pod_sets_differ(workload, wanted):
            patch["podSets"] = wanted
    if patch:
        await _patch(ctx, {"spec": patch})
        workload = await _get(ctx) or workload
    return workload


async def _placements(ctx: RunContext, adm: kueue.Admission) -> tuple[dict[str, kueue.Placement], str | None]:
    """The admission's placement per pod set, or why the pods could not run with it."""
    names = sorted({f for flavors in adm.flavors.values() for f in flavors})
    found = await asyncio.gather(
        *(asyncio.to_thread(ctx.kube.get_kueue_object, kueue.RESOURCE_FLAVORS, n) for n in names)
    )
    try:
        placements = kueue.placement(adm, {n: f for n, f in zip(names, found, strict=True) if f is not None})
    except ValueError as exc:
        return {}, str(exc)
    clash = kueue.conflicts(ctx.run.spec.scheduling.node_selector or {}, placements)
    return placements, ("; ".join(clash) + ": fix the flavors or the run's node_selector") if clash else None


# -- queueing -----------------------------------------------------------------------------------------------


async def start_queued(ctx: RunContext) -> bool:
    """A new run with the queue label (its objects exist): its Workload and no pods, phase ``Queued`` — or held
    when the integration is off. False: not Kueue's (no label), or created suspended (its Workload comes when it
    is unsuspended)."""
    if not queue_name(ctx) or (managed(ctx) and ctx.run.spec.suspend):
        return False
    patch, rec = kueue_recovery.begin_queueing(ctx.generation)
    await ctx.write(patch)
    await queued(ctx, rec)  # the Workload is created there
    return True


async def _show(
    ctx: RunContext, reason: str, message: str, warning: bool = False, extra: dict[str, Any] | None = None
) -> None:
    """Phase ``Queued`` with ``Admitted`` False (``reason``, ``message``) and the ``extra`` patch
    (:func:`.kueue_recovery.queued`); an Event when the run enters it (or the reason changes)."""
    patch, event = kueue_recovery.queued(ctx.status, ctx.generation, _queue(ctx), reason, message, extra)
    if patch is None:
        return
    await ctx.write(patch)
    if event is not None:  # None: Kueue's message changed, the condition follows it without a new Event
        ctx.event(event, patch["message"], warning=warning)


async def queued(ctx: RunContext, rec: Recovery) -> bool:
    """Stage ``Queued``: no pods; on admission (placement checked), ``Starting`` the next attempt."""
    if held(ctx):
        message = (
            f"the run has the label {naming.QUEUE_LABEL}={queue_name(ctx)} but the operator runs without Kueue: "
            "it is held (never run bypassing the queue); enable kueue.enabled in the rlrun-operator chart, or remove "
            "the label"
        )
        await _show(ctx, Reason.KUEUE_DISABLED, message, warning=True)
        return False
    if not managed(ctx):  # the label was removed: the run starts without Kueue, and its Workload goes (Kueue would
        # admit it again and hold quota for pods it does not own)
        if ctx.settings.kueue_enabled:  # off: none was made (and Kueue's API is not the operator's to call)
            await asyncio.to_thread(ctx.kube.delete_workload, ctx.namespace, naming.workload_name(ctx.name))
        await ctx.write(kueue_recovery.unqueued(ctx.status, rec, _next_attempt(ctx, rec)))
        return True
    if ctx.run.spec.suspend:  # suspended while queued: nothing to pause
        patch, _ = recovery.begin_suspension(ctx.status, ctx.generation, orchestrator_alive=False)
        await ctx.write(patch)
        return True
    try:
        workload = await ensure_workload(ctx, _next_attempt(ctx, rec))
    except ApiException as exc:
        if exc.status != 404:
            raise
        await _show(ctx, Reason.QUEUED, NOT_SERVED, warning=True)  # held until Kueue is installed
        return False
    if kueue.is_true(workload, kueue.FINISHED):
        await _show(ctx, Reason.QUEUED, "the run's Workload finished when the run ended; a new one replaces it")
        return False
    if await _release(ctx, workload):  # evicted with no pod left (e.g. deactivated before it was active again)
        return False
    adm = kueue.admission(workload)
    if adm is None:
        await _show(ctx, Reason.QUEUED, kueue.pending_message(workload))
        return False
    _, problem = await _placements(ctx, adm)
    if problem:
        await _show(ctx, Reason.FLAVOR_CONFLICT, problem, warning=True)
        return False
    message = f"admitted by Kueue: {adm.describe()}"
    await ctx.write(
        kueue_recovery.admitted(ctx.status, ctx.generation, rec, _next_attempt(ctx, rec), _queue(ctx, adm), message)
    )
    ctx.event(EventReason.ADMITTED, message)
    return True


async def _requeue(ctx: RunContext, rec: Recovery, message: str) -> bool:
    """Back to stage ``Queued`` (held when the integration is off)."""
    reason = Reason.KUEUE_DISABLED if held(ctx) else Reason.QUEUED
    await _show(ctx, reason, message, extra=recovery.to_stage(rec, Stage.QUEUED))
    return True


async def starting(r: Reconciling, ctx: RunContext, rec: Recovery, workload: dict[str, Any] | None) -> bool:
    """Stage ``Starting`` of a Kueue-managed run: an evicted Workload's quota is released now (the pods are gone),
    and pods are created only while the Workload is admitted, with its placement; else back to ``Queued``."""
    if workload is None:
        await ensure_workload(ctx, _next_attempt(ctx, rec))
        return await _requeue(ctx, rec, "the Workload was (re)created")
    if rec.trigger == Trigger.SUSPEND and not workload["spec"].get("active", True):
        await _patch(ctx, {"spec": {"active": True}})  # unsuspended: active again (only the suspension made it not)
        return await _requeue(ctx, rec, "the Workload is active again")
    ev = kueue.eviction(workload, has_pods=False)
    if ev is not None and rec.scope == "attempt":
        if not await _release(ctx, workload):
            return False  # Kueue wrote meanwhile: decided again at the next look
        return await _requeue(ctx, rec, f"waiting to be admitted again after {ev.reason}")
    adm = kueue.admission(workload)
    if adm is None:
        return await _requeue(ctx, rec, kueue.pending_message(workload))
    placements, problem = await _placements(ctx, adm)
    if problem:
        return await _requeue(ctx, rec, problem)
    if rec.trigger == Trigger.KUEUE_ADMISSION and ctx.attempt is None:  # the first start: nothing to resume
        await stages.create_first(ctx, placements, adm)
        return True
    return await stages.start(r, ctx, rec, placements)


# -- eviction ---------------------------------------------------------------------------------------------


async def evict(
    r: Reconciling,
    ctx: RunContext,
    ev: kueue.Eviction,
    taken: Recovery | None = None,
    workload: dict[str, Any] | None = None,
) -> bool:
    """Kueue evicted the run: an attempt-scope preemption, the same pause → snapshot → stop path, phase
    ``Evicted``; the recovery in progress ``taken`` (if any) is taken over (its pods stop with the attempt's).
    Counted once in ``status.preemptions``: not again when ``taken`` is that same preemption
    (:func:`.kueue_recovery.same_interruption`), whose start time, count and recoveries metric the eviction keeps."""
    same = kueue_recovery.same_interruption(taken, workload)
    patch, rec = kueue_recovery.evicted(
        ctx.status,
        ctx.generation,
        ev,
        queue_name(ctx),
        naming.workload_name(ctx.name),
        taken=taken,
        same=same,
        orchestrator_alive=ctx.live_orchestrator() is not None,
    )
    await ctx.write(patch)
    ctx.event(EventReason.EVICTED, rec.message, warning=True)
    if not same:  # the same interruption keeps its recovery time from the loss
        ctx.metrics.recoveries.labels(RecoveryKind.PREEMPTION, Trigger.KUEUE_EVICTION).inc()
        r.recovery_started(ctx)
    return True


# -- every look -----------------------------------------------------------------------------------------------


async def step(r: Reconciling, ctx: RunContext, rec: Recovery | None) -> bool | None:
    """What Kueue needs of this reconcile, before the rest of the decision table (:mod:`.reconcile`): True or
    False as a stage's result, None when the rest of the table goes on."""
    if rec is not None and rec.stage == Stage.QUEUED:
        return await queued(ctx, rec)
    tracked = ctx.status.get("queue") is not None
    if not managed(ctx):
        if held(ctx) and rec is not None and rec.stage == Stage.STARTING and rec.scope == "attempt":
            return await _requeue(ctx, rec, "held")  # the integration was turned off: held before the next attempt
        if not (tracked and ctx.settings.kueue_enabled):
            return None
        # the label was removed from a run admitted through Kueue: it stays Kueue's until its next queueing (its
        # Workload holds the quota its pods use, and Kueue may take it back)
    if rec is None and not tracked:
        return None  # labelled while running without Kueue: queued at its next queueing
    workload = await _get(ctx)
    retrying = rec is not None and rec.stage == Stage.STARTING  # a failed run's next attempt: queued anew
    if ctx.status.get("phase") == Phase.FAILED or (kueue.is_true(workload, kueue.FINISHED) and not retrying):
        return None
    if tracked and kueue_recovery.may_take_over(rec):
        ev = kueue.eviction(workload, has_pods=bool(ctx.current()))
        if ev is not None:
            return await evict(r, ctx, ev, rec, workload)
    if rec is not None and rec.stage == Stage.STARTING:
        return await starting(r, ctx, rec, workload)
    if workload is None:
        return None
    if rec is not None and rec.stage == Stage.SUSPENDED:  # Kueue frees the quota of an inactive Workload
        await _patch(ctx, {"spec": {"active": False}} if workload["spec"].get("active", True) else None)
        await _release(ctx, workload)
        return None
    if tracked and kueue.admission(workload) is not None and ctx.current():
        await _patch_status(ctx, workload, kueue.pods_ready(workload, all(p.ready for p in ctx.current())))
    return None
