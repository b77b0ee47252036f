"""The reconciler: the one writer of ``RLRun.status``, and the actions of the preemption protocol.

Every handler that wants a run looked at calls :meth:`Reconciler.reconcile` (the status timer,
pod and node events, spec changes). One reconcile of a run runs at a time (a per-run lock; a
call arriving while another waits is dropped, the waiting one sees its change too). Each
reconcile reads the RLRun fresh from the API, decides, and writes status through
:meth:`Reconciler._write` before acting, so a timer tick can never undo a decision or erase
a count made by another handler (they are the same code, one at a time).

What a reconcile does, first match wins (a run without a phase is left alone: its create handler has
not written the first status yet, and nothing may act on it before that):

1. a recovery in progress (``status.recovery``): advance it (``recovery.py`` has the stages and
   the scopes: the next attempt, or a lost rollout pod or trainer replaced within the attempt);
2. ``spec.suspend`` on a run that is not suspended: start a suspension (same pause path);
3. the orchestrator reported every step trained and exited: ``Succeeded``, rollout pods removed;
4. a pod of the run disrupted or missing (``disruption.py``): start a recovery, or fail the run;
5. otherwise: poll the orchestrator's ``/status``, keep its rollout endpoints in sync, and
   fold both into phase and conditions (``status.observe``).

The run's pods are those whose controller owner reference is the RLRun's uid: a pod that
merely carries the run's labels is never adopted.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException
from rlrun.api.control import StatusReport
from rlrun.api.control_client import ControlClient, ControlError
from rlrun.api.spec import RLRun
from rlrun.api.status import ConditionType, EventReason, Phase, Reason, Recovery, RecoveryKind, Stage, Trigger

from rlrun_operator import naming, recovery
from rlrun_operator.builders import build_pods, build_rollout_replacement, build_run_objects, build_trainer_replacement
from rlrun_operator.disruption import Disruption, NodeView, disruption, node_trouble
from rlrun_operator.kube import Kube
from rlrun_operator.metrics import OperatorMetrics
from rlrun_operator.settings import OperatorSettings
from rlrun_operator.specs import SpecMemory
from rlrun_operator.status import PodView, observe, pod_view, rollout_endpoints, set_condition

log = logging.getLogger(__name__)

#: Most stages one reconcile advances through before it lets other runs have a turn.
MAX_STAGES_PER_RECONCILE = 8
#: Seconds between looks at a new attempt's orchestrator while a recovery waits for its resume report.
#: Nothing else announces it (its pod is Ready before it restores: the operator must reach it
#: through its Service to send the rollout endpoints first), and the status timer is seconds apart.
RESUME_POLL_SECONDS = 0.25


@dataclass
class _Gate:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    waiting: bool = False


@dataclass
class _Run:
    """One reconcile's view of a run (``status`` follows every write)."""

    body: dict[str, Any]
    run: RLRun
    status: dict[str, Any]
    pods: list[PodView]
    nodes: Mapping[str, NodeView]

    @property
    def namespace(self) -> str:
        return self.body["metadata"]["namespace"]

    @property
    def name(self) -> str:
        return self.body["metadata"]["name"]

    @property
    def generation(self) -> int | None:
        return self.body["metadata"].get("generation")

    @property
    def attempt(self) -> int | None:
        return self.status.get("attempt")

    @property
    def rollout_replicas(self) -> int:
        """Rollout pods the current attempt was created with (a spec change applies from the next attempt)."""
        created = self.status.get("rolloutReplicas")
        return int(created) if created is not None else self.run.spec.rollout.replicas

    @property
    def trainer_nodes(self) -> int:
        """Trainer pods (nodes) the current attempt's trainer group has: its pods' ``rlrun.dev/trainer-nodes``
        (a spec change applies when the trainer is next created), the spec's ``trainer.nodes`` without any."""
        mine = [p for p in self.pods if p.component == naming.TRAINER and p.attempt == self.attempt]
        return max(p.trainer_nodes for p in mine) if mine else self.run.spec.trainer.nodes

    def current(self) -> list[PodView]:
        """The current attempt's pods that are not being deleted."""
        return [p for p in self.pods if p.attempt == self.attempt and not p.deleting]

    def live_orchestrator(self, hit: set[str] = frozenset()) -> PodView | None:
        """The current attempt's orchestrator when it can be asked to pause (running, not hit, not ending)."""
        return next(
            (
                p
                for p in self.current()
                if p.component == naming.ORCHESTRATOR and p.phase == "Running" and not p.ended and p.name not in hit
            ),
            None,
        )


def _seconds_since(stamp: str | None) -> float:
    if not stamp:
        return 0.0
    when = dt.datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    return (dt.datetime.now(dt.timezone.utc) - when).total_seconds()


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
        self._gates: dict[tuple[str, str], _Gate] = {}
        self.clients: dict[tuple[str, str], ControlClient] = {}
        self._tokens: dict[tuple[str, str], str] = {}
        #: when each recovery was first seen by this process (its recovery time is measured from here)
        self._seen: dict[tuple[str, str], float] = {}
        #: each run's latest index readers, and its scheduled next look while resuming
        self._readers: dict[
            tuple[str, str], tuple[Callable[[], list[PodView]], Callable[[], Mapping[str, NodeView]]]
        ] = {}
        self._soon: dict[tuple[str, str], asyncio.TimerHandle] = {}

    # -- entry ------------------------------------------------------------------------------------

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
            run = self.specs.in_force(body)
            uid = body["metadata"].get("uid")
            ctx = _Run(body, run, status, [p for p in pods() if p.owner_uid == uid], nodes())
            try:
                for _ in range(MAX_STAGES_PER_RECONCILE):
                    if not await self._step(ctx):
                        break
                    ctx.pods = [p for p in pods() if p.owner_uid == uid]
            except (kopf.TemporaryError, asyncio.CancelledError):
                raise
            except Exception as exc:  # shown in a condition instead of freezing the status for kopf's back-off
                log.exception("reconcile of %s/%s failed", namespace, name)
                message = f"{type(exc).__name__}: {exc}"[:1000]
                conditions = set_condition(
                    list(ctx.status.get("conditions") or []), ConditionType.DEGRADED, True, Reason.RECONCILE_ERROR,
                    message, ctx.generation,
                )  # fmt: skip
                await self._write(ctx, {"conditions": conditions})

    def forget(self, namespace: str, name: str) -> list[ControlClient]:
        """Drop a deleted run's state; returns its control clients for the caller to close."""
        key = (namespace, name)
        self._gates.pop(key, None)
        self._tokens.pop(key, None)
        self._seen.pop(key, None)
        self._readers.pop(key, None)
        soon = self._soon.pop(key, None)
        if soon is not None:
            soon.cancel()
        client = self.clients.pop(key, None)
        return [client] if client is not None else []

    # -- status -----------------------------------------------------------------------------------

    async def _write(self, ctx: _Run, patch: dict[str, Any]) -> None:
        """Merge ``patch`` into the run's status (the one place status is written) and follow it locally."""
        if not patch:
            return
        written = await asyncio.to_thread(self.kube().patch_run_status, ctx.namespace, ctx.name, patch)
        if written is not None:
            ctx.status = dict(written.get("status") or {})
        phase = ctx.status.get("phase")
        if phase:
            self.metrics.set_phase(ctx.namespace, ctx.name, phase)

    def _event(self, ctx: _Run, reason: str, message: str, warning: bool = False) -> None:
        kopf.event(ctx.body, type="Warning" if warning else "Normal", reason=reason, message=message)

    # -- one step ---------------------------------------------------------------------------------

    async def _step(self, ctx: _Run) -> bool:
        """Do the next thing the run needs; True when something changed and another step may follow."""
        spec = ctx.run.spec
        phase = ctx.status.get("phase")
        if phase is None:  # its create handler has not written the first status yet: the run is still its
            return False
        rec = recovery.recovery_of(ctx.status)
        if rec is not None:
            return await self._advance(ctx, rec)
        if spec.suspend and phase != Phase.SUSPENDED:
            alive = ctx.live_orchestrator() is not None and phase != Phase.FAILED
            patch, rec = recovery.begin_suspension(ctx.status, ctx.generation, orchestrator_alive=alive)
            await self._write(ctx, patch)
            self.metrics.recoveries.labels(RecoveryKind.SUSPENSION, Trigger.SUSPEND).inc()
            self._seen[(ctx.namespace, ctx.name)] = time.monotonic()
            return True
        if phase == Phase.FAILED or ctx.attempt is None:
            return False
        if self._complete(ctx):
            await self._succeed(ctx)
            return False
        found = self._disruptions(ctx) or await self._missing(ctx)
        if found:
            return await self._begin(ctx, found)
        await self._observe(ctx)
        return False

    def _complete(self, ctx: _Run) -> bool:
        """The orchestrator exited 0 reporting every step trained (its exit report, or failing one its last
        ``/status``: ``step == maxSteps``)."""
        for p in ctx.current():
            if p.component == naming.ORCHESTRATOR and p.phase == "Succeeded":
                if p.exit_report is not None:
                    return p.exit_report.outcome == "complete"
                steps = ctx.status.get("maxSteps")
                return bool(steps) and ctx.status.get("step") == steps
        return False

    def _disruptions(self, ctx: _Run) -> list[Disruption]:
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

    def _expected(self, ctx: _Run) -> list[tuple[str, int | None, str]]:
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

    async def _missing(self, ctx: _Run) -> list[Disruption]:
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
            lacking = absent(await self._listed_pods(ctx))
        return [Disruption(Trigger.POD_MISSING, RecoveryKind.PREEMPTION, "PodGone", n, c) for c, _, n in lacking]

    async def _begin(self, ctx: _Run, found: list[Disruption]) -> bool:
        hit = {d.pod for d in found}
        alive = ctx.live_orchestrator(hit) is not None
        orchestrator = next((p for p in ctx.current() if p.component == naming.ORCHESTRATOR), None)
        patch, rec = recovery.begin(
            ctx.status, ctx.generation, found, orchestrator_alive=alive,
            backoff_limit=ctx.run.spec.failure_policy.backoff_limit,
            orchestrator_node=orchestrator.node if orchestrator is not None else None,
            trainer_group=[p.name for p in ctx.current() if p.component == naming.TRAINER],
        )  # fmt: skip
        for d in found:
            reason = EventReason.PREEMPTED if d.kind == RecoveryKind.PREEMPTION else EventReason.POD_FAILED
            self.metrics.recoveries.labels(d.kind, d.trigger).inc()
            self._event(ctx, reason, d.message, warning=True)
        if rec is None:  # the run fails: free the trainer's and rollout servers' accelerators
            doomed = [p for p in ctx.pods if p.component != naming.ORCHESTRATOR and not p.deleting]
            await self._write(ctx, {**patch, **recovery.deleting(ctx.status, [p.name for p in doomed])})
            await self._delete(ctx, doomed)
            self._event(ctx, EventReason.FAILED, ctx.status.get("message") or "failed", warning=True)
            return False
        await self._write(ctx, patch)
        self._seen[(ctx.namespace, ctx.name)] = time.monotonic()
        return True

    # -- a recovery's stages ----------------------------------------------------------------------

    async def _advance(self, ctx: _Run, rec: Recovery) -> bool:
        if rec.stage == Stage.PAUSING:
            return await self._pause(ctx, rec)
        if rec.stage == Stage.STOPPING:
            return await self._stop(ctx, rec)
        if rec.stage == Stage.SUSPENDED:
            if ctx.run.spec.suspend:
                return False
            next_attempt = 0 if ctx.attempt is None else int(ctx.attempt) + 1
            await self._write(ctx, recovery.to_stage(rec, Stage.STARTING, nextAttempt=next_attempt))
            self._seen[(ctx.namespace, ctx.name)] = time.monotonic()
            return True
        if rec.stage == Stage.STARTING:
            return await self._start(ctx, rec)
        if rec.scope == "trainer":
            return await self._resume_trainer(ctx, rec)
        return await self._resume(ctx, rec)

    def _targets(self, ctx: _Run, rec: Recovery) -> list[PodView]:
        """The pods a recovery stops: all of the run's (scope attempt) or the lost ones (rollout, trainer)."""
        if rec.scope != "attempt":
            return [p for p in ctx.pods if p.name in rec.pods]
        return list(ctx.pods)

    async def _pause(self, ctx: _Run, rec: Recovery) -> bool:
        """``POST /pause`` to the live orchestrator, then record ``Stopping`` (and the pods about to go)."""
        orchestrator = ctx.live_orchestrator(set(rec.pods))
        if orchestrator is None:
            note, ok = "the orchestrator is not running: the run resumes from its newest complete checkpoint", False
        else:
            started = time.perf_counter()
            try:
                client = await self._control(ctx)
                paused = await client.pause(timeout_s=ctx.run.spec.preemption.snapshot_timeout_seconds)
                note, ok = paused.describe(), True
            except (ControlError, ApiException) as exc:  # the pods go regardless; SIGTERM pauses it once more
                note, ok = f"pause failed ({exc}); the run resumes from its newest complete checkpoint", False
            self.metrics.pause_seconds.labels("paused" if ok else "failed").observe(time.perf_counter() - started)
        names = [p.name for p in self._targets(ctx, rec)]
        await self._write(
            ctx, {**recovery.to_stage(rec, Stage.STOPPING, pause=note), **recovery.deleting(ctx.status, names)}
        )
        self._event(ctx, EventReason.PAUSED if ok else EventReason.PAUSE_FAILED, note, warning=not ok)
        return True

    async def _stop(self, ctx: _Run, rec: Recovery) -> bool:
        """Delete the pods that must restart and wait until they are gone (force-deleting stuck ones on lost nodes)."""
        targets = self._targets(ctx, rec)
        lost = [
            p.node for p in ctx.pods
            if p.node and node_trouble(ctx.nodes.get(p.node), True, self.settings.disruption_taints) is not None
        ]  # fmt: skip
        known = set(ctx.status.get("deletedPods") or [])
        patch = {}
        if any(p.name not in known for p in targets):  # recorded before deleted
            patch.update(recovery.deleting(ctx.status, [p.name for p in targets]))
        if lost and not set(lost) <= set(ctx.status.get("failedNodes") or []):
            patch["failedNodes"] = recovery.remember(
                ctx.status.get("failedNodes") or [], lost, recovery.MAX_FAILED_NODES
            )
        await self._write(ctx, patch)
        await self._delete(ctx, [p for p in targets if not p.deleting])
        stuck = [
            p for p in targets
            if p.deleting
            and _seconds_since(p.deletion_deadline) > self.settings.force_delete_after_seconds
            and (p.node is None or node_trouble(ctx.nodes.get(p.node), True, self.settings.disruption_taints))
        ]  # fmt: skip
        if stuck:
            await self._delete(ctx, stuck, grace_s=0)
            names = ", ".join(p.name for p in stuck)
            self._event(ctx, EventReason.PREEMPTED, f"force-deleted {names}: stuck terminating on a lost node", True)
        if rec.scope != "attempt":
            if rec.scope == "trainer":
                current = {p.name for p in ctx.current()}
                widened = [
                    d for d in self._disruptions(ctx)
                    if d.component == naming.ORCHESTRATOR and d.pod in current and d.pod not in rec.pods
                ]  # fmt: skip
                if widened:  # the orchestrator is lost too while the trainer goes: the attempt restarts
                    return await self._begin(ctx, widened)
                trainers = {n for n in rec.pods if naming.component_of(ctx.name, n) == naming.TRAINER}
                if any(p.name in trainers for p in await self._listed_pods(ctx)):
                    return False  # two trainers never write the run directory at once: wait (pod events wake us)
            count = sum(ctx.status.get(k) or 0 for k in recovery.COUNTS.values())
            attempt = int(ctx.attempt or 0)
            # a missing pod is known by name only: its component and rollout index are in the name
            replacements = [naming.replacement_name(ctx.name, n, attempt, count) for n in rec.pods]
            await self._write(ctx, recovery.to_stage(rec, Stage.STARTING, replacements=replacements))
            return True
        if await self._listed_pods(ctx):
            return False  # never two attempts' pods at once: wait (pod events wake the reconcile)
        if rec.kind == RecoveryKind.SUSPENSION:
            message = f"suspended; {rec.pause}" if rec.pause else "suspended"
            patch = {
                **recovery.suspended_patch(ctx.status, ctx.generation, message),
                **recovery.to_stage(rec, Stage.SUSPENDED),
            }
            await self._write(ctx, patch)
            self._event(ctx, EventReason.SUSPENDED, f"{len(targets)} pods deleted")
            return True
        next_attempt = 0 if ctx.attempt is None else int(ctx.attempt) + 1
        await self._write(ctx, recovery.to_stage(rec, Stage.STARTING, nextAttempt=next_attempt))
        return True

    async def _start(self, ctx: _Run, rec: Recovery) -> bool:
        """Create the next attempt's pods (or the rollout replacements); run objects first (never a pod whose
        Secret is missing)."""
        await self._ensure_run_objects(ctx)
        avoid = list(ctx.status.get("failedNodes") or [])
        key = (ctx.namespace, ctx.name)
        if rec.scope != "attempt":  # the same attempt goes on: replacements of the lost pods only
            attempt = int(ctx.attempt or 0)
            # a trainer group is replaced whole: every node's pod, the group's size kept
            nodes = sum(1 for name in rec.replacements if naming.component_of(ctx.name, name) == naming.TRAINER)
            pods = [
                build_trainer_replacement(
                    ctx.body,
                    ctx.run,
                    self.settings,
                    attempt,
                    name,
                    avoid,
                    naming.trainer_node_of(ctx.name, name),
                    nodes,
                )
                if naming.component_of(ctx.name, name) == naming.TRAINER
                else build_rollout_replacement(
                    ctx.body, ctx.run, self.settings, attempt, naming.rollout_index_of(ctx.name, name), name, avoid
                )
                for name in rec.replacements
            ]
            await self._create(pods)
            replaced = f"replaced {', '.join(rec.pods)} by {', '.join(rec.replacements)}"
            if rec.scope == "trainer":  # done once the replacement trainer runs
                await self._write(ctx, recovery.replaced(ctx.status, ctx.generation, rec, attempt))
                avoiding = f", kept off {', '.join(avoid)}" if avoid else ""
                self._event(
                    ctx, EventReason.RECREATED, f"{replaced} with --resume; attempt {attempt} goes on{avoiding}"
                )
                return True
            await self._write(ctx, recovery.finished(ctx.status, ctx.generation, rec, None, attempt))
            self._event(ctx, EventReason.RECREATED, replaced)
            self._recovered(key, rec)
            return True
        attempt = int(rec.nextAttempt if rec.nextAttempt is not None else 0)
        count = await self._create(build_pods(ctx.body, ctx.run, self.settings, attempt, avoid))
        await self._write(
            ctx, recovery.started(ctx.status, ctx.generation, rec, attempt, ctx.run.spec.rollout.replicas)
        )
        avoiding = f", kept off {', '.join(avoid)}" if avoid else ""
        self._event(ctx, EventReason.RECREATED, f"attempt {attempt}: {count} pods created with --resume{avoiding}")
        return True

    async def _ended_or_disrupted(self, ctx: _Run, rec: Recovery) -> bool | None:
        """What a stage waiting for new pods checks first: the run finished meanwhile (the recovery is over:
        False), or a new disruption hit the current pods (a new recovery begins: its result); None: neither."""
        if self._complete(ctx):  # it finished before a poll saw the recovery end
            await self._succeed(ctx)
            self._recovered((ctx.namespace, ctx.name), rec)
            return False
        found = self._disruptions(ctx) or await self._missing(ctx)
        current = {p.name for p in ctx.current()}
        found = [d for d in found if d.pod in current or d.trigger == Trigger.POD_MISSING]
        if found:
            return await self._begin(ctx, found)
        return None

    async def _resume(self, ctx: _Run, rec: Recovery) -> bool:
        """Wait for the new attempt's orchestrator to confirm its restore; a new disruption starts a new recovery."""
        if (outcome := await self._ended_or_disrupted(ctx, rec)) is not None:
            return outcome
        report, _ = await self._poll(ctx)
        if report is None or report.attempt != ctx.attempt or report.phase not in ("running", "done"):
            waiting = f"attempt {int(ctx.attempt or 0)}: waiting for the orchestrator to confirm what it restored"
            await self._observe(ctx, report_in=report, resuming=waiting)
            self._look_again(ctx.namespace, ctx.name)
            return False
        await self._write(ctx, recovery.finished(ctx.status, ctx.generation, rec, report.resume, int(ctx.attempt or 0)))
        if report.resume is not None:
            self._event(ctx, EventReason.RESUMED, f"attempt {ctx.attempt} {recovery.resume_message(report.resume)}")
        else:
            self._event(ctx, EventReason.RESUMED, f"attempt {ctx.attempt} started over: no complete checkpoint")
        self._recovered((ctx.namespace, ctx.name), rec)
        await self._observe(ctx, report_in=report)
        return False

    async def _resume_trainer(self, ctx: _Run, rec: Recovery) -> bool:
        """Wait for a trainer replacement (same attempt) to run; a new disruption starts a new recovery.

        The orchestrator kept running and has nothing to report about it: the replacement pods running (the
        kubelet started ``rlrun trainer … --resume`` on every node of the group) end the recovery.
        """
        key = (ctx.namespace, ctx.name)
        if (outcome := await self._ended_or_disrupted(ctx, rec)) is not None:
            return outcome
        attempt = int(ctx.attempt or 0)
        trainers = [n for n in rec.replacements if naming.component_of(ctx.name, n) == naming.TRAINER]
        running = {p.name for p in ctx.pods if p.name in trainers and p.phase in ("Running", "Succeeded")}
        if running != set(trainers):  # a group trains only once every node's pod runs
            waiting = ", ".join(n for n in trainers if n not in running)
            await self._observe(ctx, resuming=f"attempt {attempt}: waiting for {waiting} to start")
            return False
        await self._write(ctx, recovery.finished(ctx.status, ctx.generation, rec, None, attempt))
        self._event(ctx, EventReason.RESUMED, recovery.trainer_replaced_message(rec, attempt))
        self._recovered(key, rec)
        await self._observe(ctx)
        return False

    def _look_again(self, namespace: str, name: str) -> None:
        """Reconcile the run again in :data:`RESUME_POLL_SECONDS` (once: a pending look is kept)."""
        key = (namespace, name)
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

    def _recovered(self, key: tuple[str, str], rec: Recovery) -> None:
        started = self._seen.pop(key, None)
        if started is not None:
            self.metrics.recovery_seconds.labels(rec.scope).observe(time.monotonic() - started)

    # -- the steady state -------------------------------------------------------------------------

    async def _succeed(self, ctx: _Run) -> None:
        rollouts = [p for p in ctx.pods if p.component == naming.ROLLOUT and not p.deleting]
        steps = ctx.status.get("maxSteps")
        message = f"all {steps} steps trained" if steps else "training finished"
        conditions = list(ctx.status.get("conditions") or [])
        for type_, value, text in (
            (ConditionType.SUCCEEDED, True, message),
            (ConditionType.FAILED, False, ""),
            (ConditionType.READY, False, "the run has finished"),
            (ConditionType.PROGRESSING, False, message),
            (ConditionType.DEGRADED, False, ""),
        ):
            conditions = set_condition(conditions, type_, value, Reason.COMPLETED, text, ctx.generation)
        if ctx.status.get("recovery") and any(c["type"] == ConditionType.PREEMPTED for c in conditions):
            conditions = set_condition(conditions, ConditionType.PREEMPTED, False, Reason.COMPLETED, "", ctx.generation)
        patch = {
            "phase": Phase.SUCCEEDED,
            "message": message,
            "conditions": conditions,
            "observedGeneration": ctx.generation,
            "recovery": None,
        }
        if steps:
            patch["step"] = steps
        await self._write(ctx, {**patch, **recovery.deleting(ctx.status, [p.name for p in rollouts])})
        await self._delete(ctx, rollouts)
        self._event(ctx, EventReason.SUCCEEDED, f"{message}; {len(rollouts)} rollout pods removed")

    async def _poll(self, ctx: _Run) -> tuple[StatusReport | None, str | None]:
        try:
            return await (await self._control(ctx)).status(), None
        except ControlError as exc:
            orchestrator = ctx.live_orchestrator()
            if orchestrator is not None and orchestrator.ready:  # it should answer: a deleted Service comes back
                await self._ensure_run_objects(ctx)
            return None, str(exc)
        except ApiException as exc:
            if exc.status != 404:
                raise
            await self._ensure_run_objects(ctx)
            secret = naming.secret_name(ctx.name)
            return None, f"the control Secret {secret} was deleted and is recreated; the orchestrator is asked again"

    async def _observe(self, ctx: _Run, report_in: StatusReport | None = None, resuming: str | None = None) -> None:
        """Poll ``/status`` (unless given), keep endpoints in sync, fold both into phase and conditions.

        Args:
            resuming: a recovery waits in ``Resuming``: the message of ``Ready`` False (``Resuming``), and the
                phase stays ``Recovering`` (``Pending`` after a suspension).
        """
        report, error = (report_in, None) if report_in is not None else await self._poll(ctx)
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
            self._event(ctx, EventReason.RUNNING, new["message"])
        await self._write(ctx, {k: v for k, v in new.items() if ctx.status.get(k) != v})

    async def _push_endpoints(self, ctx: _Run, desired: list[str]) -> None:
        try:
            await (await self._control(ctx)).set_endpoints(desired)
        except (ControlError, ApiException) as exc:  # the next reconcile tries again
            log.debug("endpoints of %s/%s not pushed yet: %s", ctx.namespace, ctx.name, exc)
            return
        self.metrics.endpoint_updates.inc()
        log.info("rollout endpoints of %s/%s sent to the orchestrator: %s", ctx.namespace, ctx.name, desired)

    # -- API and control calls --------------------------------------------------------------------

    async def _control(self, ctx: _Run) -> ControlClient:
        """The run's control client (the token read from its Secret once; ApiException 404 when the Secret is gone)."""
        key = (ctx.namespace, ctx.name)
        url = self.settings.orchestrator_url.format(
            name=ctx.name, namespace=ctx.namespace, service=naming.orchestrator_service_name(ctx.name)
        )
        client = self.clients.get(key)
        if client is None or client.base_url != url.rstrip("/"):
            token = await asyncio.to_thread(self.kube().read_token, ctx.namespace, ctx.name)
            self._tokens[key] = token
            client = self.clients[key] = ControlClient(url, token, self.settings.request_timeout_seconds)
        return client

    async def _ensure_run_objects(self, ctx: _Run) -> None:
        """Create whichever of the run's claim, Secret, ConfigMap and Service are gone (the rest: 409, kept).

        A recreated Secret holds the token this process knows (the running orchestrator's), else a new one.
        """
        key = (ctx.namespace, ctx.name)
        token = self._tokens.get(key) or secrets.token_urlsafe(32)
        created = await self._create(build_run_objects(ctx.body, ctx.run, self.settings, token))
        if created:
            if key not in self._tokens:  # a new token: the client must read it again
                self.clients.pop(key, None)
            log.info("%s/%s: %d run objects recreated", ctx.namespace, ctx.name, created)

    async def _listed_pods(self, ctx: _Run) -> list[PodView]:
        """The run's own pods as the API server has them now (the index may lag behind a create or delete)."""
        uid = ctx.body["metadata"].get("uid")
        listed = await asyncio.to_thread(self.kube().list_pods, ctx.namespace, ctx.name)
        return [v for v in map(pod_view, listed) if v.owner_uid == uid]

    async def _create(self, objects: list[dict[str, Any]]) -> int:
        """Create ``objects`` (idempotent by name: existing ones count as not created); returns how many were new."""
        kube = self.kube()
        return sum(await asyncio.gather(*(asyncio.to_thread(kube.create, obj) for obj in objects)))

    async def _delete(self, ctx: _Run, pods: list[PodView], grace_s: int | None = None) -> None:
        grace = ctx.run.spec.preemption.termination_grace_period_seconds if grace_s is None else grace_s
        kube = self.kube()
        await asyncio.gather(*(asyncio.to_thread(kube.delete_pod, ctx.namespace, p.name, grace) for p in pods))


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None and not isinstance(task.exception(), kopf.TemporaryError):
        log.error("a scheduled reconcile failed: %s", task.exception())


def was_refused(status: dict[str, Any]) -> bool:
    """Whether the run was refused for an invalid spec (nothing was created for it)."""
    return any(
        c.get("type") == ConditionType.FAILED and c.get("reason") == Reason.INVALID_SPEC
        for c in status.get("conditions") or []
    )
