"""The reconciler: the one writer of ``RLRun.status``, a decision table over one run's context.

Every handler that wants a run looked at calls :meth:`Reconciler.reconcile` (the status timer,
pod and node events, spec changes); the create handler calls :meth:`Reconciler.start` (attempt 0,
through :func:`.stages.start_first`). One reconcile of a run runs at a time (a per-run lock; a
call arriving while another waits is dropped, the waiting one sees its change too). Each
reconcile reads the RLRun fresh from the API into a :class:`~.run_context.RunContext`, decides,
and writes status through it before acting, so a timer tick can never undo a decision or erase
a count made by another handler (they are the same code, one at a time).

What a reconcile does, first match wins (a run without a phase is left alone: its create handler has
not written the first status yet, and nothing may act on it before that):

0. a run labelled ``kueue.x-k8s.io/queue-name`` (or admitted through Kueue): Kueue's part first
   (:func:`.kueue_stages.step`: queued, admitted, evicted; no pod without admission);
1. a recovery in progress (``status.recovery``): advance it (:func:`.stages.advance`;
   ``recovery.py`` has the stages and the scopes: the next attempt, or a lost rollout pod or
   trainer replaced within the attempt);
2. ``spec.suspend`` on a run that is not suspended: start a suspension (same pause path);
3. the orchestrator reported every step trained and exited: ``Succeeded``, rollout pods removed;
4. a pod of the run disrupted or missing (``disruption.py``): start a recovery, or fail the run;
5. otherwise: poll the orchestrator's ``/status``, keep its rollout endpoints in sync, and
   fold both into phase and conditions (``status.observe``).

Anything else a reconcile raises becomes a ``Degraded`` condition (``ReconcileError``) instead of
freezing the status for kopf's back-off; the next tick tries again. The run's pods are those whose
controller owner reference is the RLRun's uid: a pod that merely carries the run's labels is never
adopted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException
from rlrun.api.control import StatusReport
from rlrun.api.control_client import ControlClient, ControlError
from rlrun.api.spec import RLRun
from rlrun.api.status import ConditionType, EventReason, Phase, Reason, Recovery, RecoveryKind, Trigger

from rlrun_operator import kueue_stages, naming, recovery, stages
from rlrun_operator.control import ControlClients
from rlrun_operator.disruption import Disruption, NodeView, disruption
from rlrun_operator.kube import Kube
from rlrun_operator.metrics import OperatorMetrics
from rlrun_operator.run_context import RunContext
from rlrun_operator.settings import OperatorSettings
from rlrun_operator.specs import SpecMemory
from rlrun_operator.status import PodView, observe, rollout_endpoints, set_condition

log = logging.getLogger(__name__)

#: Most stages one reconcile advances through before it lets other runs have a turn.
MAX_STAGES_PER_RECONCILE = 8
#: Seconds between looks at a new attempt's orchestrator while a recovery waits for its resume report.
#: Nothing else announces it (its pod is Ready before it restores: the operator must reach it
#: through its Service to send the rollout endpoints it needs first), and the status timer is seconds apart.
RESUME_POLL_SECONDS = 0.25


@dataclass
class _Gate:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    waiting: bool = False


class Reconciler:
    """Reconciles runs; keeps per-run locks and control clients (both belong to one event loop).

    Args:
        kube: returns the API wrapper (built lazily by the handlers).
        settings: the operator's settings.
        metrics: where recoveries, pause latency and recovery time are counted.
        specs: the last valid spec of each run.
    """

    def __init__(
        self, kube: Callable[[], Kube], settings: OperatorSettings, metrics: OperatorMetrics, specs: SpecMemory
    ) -> None:
        self.kube = kube
        self.settings = settings
        self.metrics = metrics
        self.specs = specs
        self.controls = ControlClients(kube, lambda: self.settings)
        self._gates: dict[tuple[str, str], _Gate] = {}
        #: when each recovery was first seen by this process (its recovery time is measured from here)
        self._seen: dict[tuple[str, str], float] = {}
        #: each run's latest index readers, and its scheduled next look while resuming
        self._readers: dict[
            tuple[str, str], tuple[Callable[[], list[PodView]], Callable[[], Mapping[str, NodeView]]]
        ] = {}
        self._soon: dict[tuple[str, str], asyncio.TimerHandle] = {}
        #: how the installed CRD differs from this operator's (:mod:`.crd_drift`; None: it does not), and the
        #: runs already told so by an Event
        self.crd_drift: str | None = None
        self._told_drift: set[tuple[str, str]] = set()

    def _context(
        self, body: dict[str, Any], run: RLRun, status: dict[str, Any], pods: list[PodView], nodes
    ) -> RunContext:
        uid = body["metadata"].get("uid")
        mine = [p for p in pods if p.owner_uid == uid]
        ctx = RunContext(body, run, status, mine, nodes, self.kube(), self.settings, self.metrics, self.controls)
        if self.crd_drift and ctx.key not in self._told_drift:  # once per run and operator process
            self._told_drift.add(ctx.key)
            ctx.event(EventReason.CRD_OUTDATED, self.crd_drift, warning=True)
        return ctx

    # -- entry ------------------------------------------------------------------------------------

    async def start(self, body: dict[str, Any], run: RLRun, status: dict[str, Any]) -> None:
        """A new run's first start (:func:`.stages.start_first`), under its lock: its objects, attempt 0's
        pods and its first status, ``status`` the one it starts from (a run refused before: none)."""
        namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
        async with self._gates.setdefault((namespace, name), _Gate()).lock:
            await stages.start_first(self._context(body, run, dict(status), [], {}), kueue_stages.start_queued)

    async def reconcile(
        self,
        namespace: str,
        name: str,
        pods: Callable[[], list[PodView]],
        nodes: Callable[[], Mapping[str, NodeView]],
    ) -> None:
        """Look at run ``namespace/name`` once and act (see the module docstring).

        Args:
            pods: the run's pods as the index has them now (read again after waiting for the lock).
            nodes: the nodes as the index has them now.

        Raises:
            kopf.TemporaryError: the spec is invalid and no valid one is known (``SpecMemory.in_force``).
        """
        self._readers[(namespace, name)] = (pods, nodes)
        gate = self._gates.setdefault((namespace, name), _Gate())
        if gate.waiting:  # a reconcile is queued already and will see this change too
            return
        gate.waiting = True
        async with gate.lock:
            gate.waiting = False
            body = await asyncio.to_thread(self.kube().get_run, namespace, name)
            if body is None or body["metadata"].get("deletionTimestamp"):
                return
            status = dict(body.get("status") or {})
            if status.get("phase") == Phase.SUCCEEDED or was_refused(status):
                return
            ctx = self._context(body, self.specs.in_force(body), status, pods(), nodes())
            try:
                for _ in range(MAX_STAGES_PER_RECONCILE):
                    if not await self._step(ctx):
                        break
                    ctx.pods = [p for p in pods() if p.owner_uid == ctx.uid]
            except (kopf.TemporaryError, asyncio.CancelledError):
                raise
            except Exception as exc:  # shown in a condition instead of freezing the status for kopf's back-off
                log.exception("reconcile of %s/%s failed", namespace, name)
                message = f"{type(exc).__name__}: {exc}"[:1000]
                conditions = set_condition(
                    list(ctx.status.get("conditions") or []),
                    ConditionType.DEGRADED,
                    True,
                    Reason.RECONCILE_ERROR,
                    message,
                    ctx.generation,
                )
                await ctx.write({"conditions": conditions})

    def forget(self, namespace: str, name: str) -> list[ControlClient]:
        """Drop a deleted run's state; returns its control clients for the caller to close."""
        key = (namespace, name)
        self._gates.pop(key, None)
        self._seen.pop(key, None)
        self._readers.pop(key, None)
        self._told_drift.discard(key)
        soon = self._soon.pop(key, None)
        if soon is not None:
            soon.cancel()
        return self.controls.forget(namespace, name)

    # -- the decision table -------------------------------------------------------------------------

    async def _step(self, ctx: RunContext) -> bool:
        """Do the next thing the run needs; True when something changed and another step may follow."""
        phase = ctx.status.get("phase")
        if phase is None:  # its create handler has not written the first status yet: the run is still its
            return False
        rec = recovery.recovery_of(ctx.status)
        if kueue_stages.involved(ctx, rec):  # Kueue's part first: admission gates every pod
            outcome = await kueue_stages.step(self, ctx, rec)
            if outcome is not None:
                return outcome
        if rec is not None:
            return await stages.advance(self, ctx, rec)
        if ctx.run.spec.suspend and phase != Phase.SUSPENDED:
            return await stages.suspend(self, ctx)
        if phase == Phase.FAILED or ctx.attempt is None:
            return False
        if self.complete(ctx):
            await stages.succeed(ctx)
            return False
        found = self.disruptions(ctx) or await self.missing(ctx)
        if found:
            return await stages.begin(self, ctx, found)
        await self.observe(ctx)
        return False

    def complete(self, ctx: RunContext) -> bool:
        """The orchestrator exited 0 reporting every step trained (its exit report, or failing one its last
        ``/status``: ``step == maxSteps``)."""
        for p in ctx.current():
            if p.component == naming.ORCHESTRATOR and p.phase == "Succeeded":
                if p.exit_report is not None:
                    return p.exit_report.outcome == "complete"
                steps = ctx.status.get("maxSteps")
                return bool(steps) and ctx.status.get("step") == steps
        return False

    def disruptions(self, ctx: RunContext) -> list[Disruption]:
        """The run's pods disrupted now (:func:`.disruption.disruption`; not the ones the operator deletes)."""
        deleted = set(ctx.status.get("deletedPods") or [])
        steps = ctx.status.get("maxSteps")
        complete = bool(steps) and ctx.status.get("step") == steps  # a trainer's exit 0 without a report
        found = []
        for p in ctx.pods:
            hit = disruption(
                p,
                ctx.nodes.get(p.node) if p.node else None,
                deleted_by_operator=p.name in deleted,
                run_complete=complete,
                taints=self.settings.disruption_taints,
            )
            if hit is not None:
                found.append(hit)
        return found

    def _expected(self, ctx: RunContext) -> list[tuple[str, int | None, str]]:
        """``(component, index, name)`` of every pod the current attempt should have (index: a rollout pod's,
        or a multi-node trainer's node; None: the one orchestrator or single-node trainer)."""
        run, attempt = ctx.name, int(ctx.attempt or 0)
        out = [
            (naming.ROLLOUT, i, naming.pod_name(run, naming.ROLLOUT, attempt, i)) for i in range(ctx.rollout_replicas)
        ]
        nodes = ctx.trainer_nodes
        if nodes > 1:
            out += [(naming.TRAINER, i, naming.pod_name(run, naming.TRAINER, attempt, i)) for i in range(nodes)]
        else:
            out.append((naming.TRAINER, None, naming.pod_name(run, naming.TRAINER, attempt)))
        out.append((naming.ORCHESTRATOR, None, naming.pod_name(run, naming.ORCHESTRATOR, attempt)))
        return out

    async def missing(self, ctx: RunContext) -> list[Disruption]:
        """Pods the attempt should have and has not (deleted by hand, lost mid-recovery), as PodMissing
        preemptions; what the index lacks is confirmed with the API (a pod just created may not be indexed yet)."""

        def index(p: PodView) -> int | None:
            return p.rollout_index if p.component == naming.ROLLOUT else p.trainer_node

        def absent(pods: list[PodView]) -> list[tuple[str, int | None, str]]:
            mine = [p for p in pods if p.attempt == ctx.attempt]
            return [
                (c, i, n)
                for c, i, n in self._expected(ctx)
                if not any(p.component == c and (i is None or index(p) == i) for p in mine)
            ]

        lacking = absent(ctx.pods)
        if lacking:
            lacking = absent(await ctx.listed_pods())
        return [Disruption(Trigger.POD_MISSING, RecoveryKind.PREEMPTION, "PodGone", n, c) for c, _, n in lacking]

    # -- the steady state ---------------------------------------------------------------------------

    async def poll(self, ctx: RunContext) -> tuple[StatusReport | None, str | None]:
        """The orchestrator's ``/status``, or None and why (a deleted Secret or Service is made again)."""
        try:
            return await (await ctx.controls.get(*ctx.key)).status(), None
        except ControlError as exc:
            orchestrator = ctx.live_orchestrator()
            if orchestrator is not None and orchestrator.ready:  # it should answer: a deleted Service comes back
                await ctx.ensure_run_objects()
            return None, str(exc)
        except ApiException as exc:
            if exc.status != 404:
                raise
            await ctx.ensure_run_objects()
            secret = naming.secret_name(ctx.name)
            return None, f"the control Secret {secret} was deleted and is recreated; the orchestrator is asked again"

    async def observe(
        self, ctx: RunContext, report_in: StatusReport | None = None, resuming: str | None = None
    ) -> None:
        """Poll ``/status`` (unless given), keep endpoints in sync, fold both into phase and conditions.

        Args:
            resuming: a recovery waits in ``Resuming``: the message of ``Ready`` False (``Resuming``), and the
                phase stays ``Recovering`` (``Pending`` after a suspension).
        """
        report, error = (report_in, None) if report_in is not None else await self.poll(ctx)
        attempt = int(ctx.attempt or 0)
        if report is not None and report.attempt != attempt:
            # the Service follows the run across attempts: an old attempt's orchestrator may still answer
            report, error = None, f"the orchestrator answering is attempt {report.attempt}, not {attempt}"
        desired = rollout_endpoints(ctx.pods, attempt)
        if report is not None and report.rollout_endpoints != desired:
            await self._push_endpoints(ctx, desired)
        new = observe(dict(ctx.status), ctx.generation, ctx.pods, report, error, rollout_replicas=ctx.rollout_replicas)
        if resuming:
            rec = recovery.recovery_of(ctx.status)
            new["phase"] = Phase.RECOVERING if rec and rec.kind != RecoveryKind.SUSPENSION else Phase.PENDING
            new["message"] = resuming
            new["conditions"] = set_condition(
                new["conditions"], ConditionType.READY, False, Reason.RESUMING, new["message"], ctx.generation
            )
        old = ctx.status.get("phase")
        if new["phase"] == Phase.RUNNING and old != Phase.RUNNING:
            ctx.event(EventReason.RUNNING, new["message"])
        await ctx.write({k: v for k, v in new.items() if ctx.status.get(k) != v})

    async def _push_endpoints(self, ctx: RunContext, desired: list[str]) -> None:
        try:
            await (await ctx.controls.get(*ctx.key)).set_endpoints(desired)
        except (ControlError, ApiException) as exc:  # the next reconcile tries again
            log.debug("endpoints of %s/%s not pushed yet: %s", ctx.namespace, ctx.name, exc)
            return
        self.metrics.endpoint_updates.inc()
        log.info("rollout endpoints of %s/%s sent to the orchestrator: %s", ctx.namespace, ctx.name, desired)

    # -- timing -------------------------------------------------------------------------------------

    def look_again(self, ctx: RunContext) -> None:
        """Reconcile the run again in :data:`RESUME_POLL_SECONDS` (once: a pending look is kept)."""
        namespace, name = key = ctx.key
        pending = self._soon.get(key)
        if pending is not None and not pending.cancelled() and pending.when() > asyncio.get_running_loop().time():
            return

        def look() -> None:
            self._soon.pop(key, None)
            readers = self._readers.get(key)
            if readers is not None:
                task = asyncio.ensure_future(self.reconcile(namespace, name, *readers))
                task.add_done_callback(_log_failure)

        self._soon[key] = asyncio.get_running_loop().call_later(RESUME_POLL_SECONDS, look)

    def recovery_started(self, ctx: RunContext) -> None:
        """A recovery or suspension begins now (its recovery time is measured from here)."""
        self._seen[ctx.key] = time.monotonic()

    def recovery_finished(self, ctx: RunContext, rec: Recovery) -> None:
        """The recovery ``rec`` is over: observe how long it took, when this process saw it begin."""
        started = self._seen.pop(ctx.key, None)
        if started is not None:
            self.metrics.recovery_seconds.labels(rec.scope).observe(time.monotonic() - started)


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None and not isinstance(task.exception(), kopf.TemporaryError):
        log.error("a scheduled reconcile failed: %s", task.exception())


def was_refused(status: dict[str, Any]) -> bool:
    """Whether the run was refused for an invalid spec (nothing was created for it)."""
    return any(
        c.get("type") == ConditionType.FAILED and c.get("reason") == Reason.INVALID_SPEC
        for c in status.get("conditions") or []
    )
