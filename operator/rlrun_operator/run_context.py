"""One run as a reconcile sees it, and every write a reconcile makes: ``RLRun.status``, Events, pods, run objects.

A :class:`RunContext` is built fresh for each reconcile of a run (the RLRun read from the API, its
own pods from the index, the nodes) and lives for that reconcile only. Its :meth:`RunContext.write`
is the one place ``RLRun.status`` is written (the reconciler and its stages go through it, attempt
0's start included), and its ``status`` follows every write, so a stage always decides on what it
wrote last. Every action is idempotent by name: creating what exists is no error (and counts as not
created), deleting what is gone neither.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Mapping
from typing import Any

import kopf
from rlrun.api.spec import RLRun

from rlrun_operator import kueue, naming
from rlrun_operator.builders import build_run_objects
from rlrun_operator.control import ControlClients
from rlrun_operator.disruption import NodeView
from rlrun_operator.kube import Kube
from rlrun_operator.metrics import OperatorMetrics
from rlrun_operator.settings import OperatorSettings
from rlrun_operator.status import PodView, pod_view

log = logging.getLogger(__name__)


class RunContext:
    """A run in one reconcile (see the module docstring).

    Attributes:
        body: the RLRun object as read at the start of the reconcile.
        run: the spec in force (the run's own when valid, else the last valid one).
        status: ``status`` as last written (follows :meth:`write`).
        pods: the run's own pods (controller owner reference = the RLRun's uid), refreshed between stages.
        nodes: the nodes by name.
    """

    def __init__(
        self,
        body: dict[str, Any],
        run: RLRun,
        status: dict[str, Any],
        pods: list[PodView],
        nodes: Mapping[str, NodeView],
        kube: Kube,
        settings: OperatorSettings,
        metrics: OperatorMetrics,
        controls: ControlClients,
    ) -> None:
        self.body, self.run, self.status, self.pods, self.nodes = body, run, status, pods, nodes
        self.kube, self.settings, self.metrics, self.controls = kube, settings, metrics, controls

    # -- what the run is now --------------------------------------------------------------------------

    @property
    def namespace(self) -> str:
        return self.body["metadata"]["namespace"]

    @property
    def name(self) -> str:
        return self.body["metadata"]["name"]

    @property
    def key(self) -> tuple[str, str]:
        """``(namespace, name)``."""
        return self.namespace, self.name

    @property
    def uid(self) -> str | None:
        return self.body["metadata"].get("uid")

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

    # -- what a reconcile does to it -----------------------------------------------------------------

    async def write(self, patch: dict[str, Any]) -> None:
        """Merge ``patch`` into the run's status (the one place status is written) and follow it here."""
        if not patch:
            return
        written = await asyncio.to_thread(self.kube.patch_run_status, self.namespace, self.name, patch)
        if written is not None:
            self.status = dict(written.get("status") or {})
        phase = self.status.get("phase")
        if phase:
            self.metrics.set_phase(self.namespace, self.name, phase)

    def event(self, reason: str, message: str, warning: bool = False) -> None:
        """Post an Event on the run (kopf posts it from a queue, after the handler)."""
        kopf.event(self.body, type="Warning" if warning else "Normal", reason=reason, message=message)

    async def create_each(self, objects: list[dict[str, Any]]) -> list[bool]:
        """Create ``objects`` (idempotent by name); for each, whether it was new (False: it existed)."""
        kube = self.kube
        return list(await asyncio.gather(*(asyncio.to_thread(kube.create, obj) for obj in objects)))

    async def create(self, objects: list[dict[str, Any]]) -> int:
        """Create ``objects`` (idempotent by name: existing ones count as not created); returns how many were new."""
        return sum(await self.create_each(objects))

    async def delete(self, pods: list[PodView], grace_s: int | None = None) -> None:
        """Delete ``pods`` with their own grace period (the one each was created with, not the spec in force
        now: a grace period changed since applies to the next attempt's pods), or ``grace_s`` (0: a force
        delete of a pod stuck on a lost node)."""
        kube = self.kube
        await asyncio.gather(
            *(
                asyncio.to_thread(
                    kube.delete_pod, self.namespace, p.name, p.grace_period_s if grace_s is None else grace_s
                )
                for p in pods
            )
        )

    async def listed_pods(self) -> list[PodView]:
        """The run's own pods as the API server has them now (the index may lag behind a create or delete)."""
        listed = await asyncio.to_thread(self.kube.list_pods, self.namespace, self.name)
        return [v for v in map(pod_view, listed) if v.owner_uid == self.uid]

    async def ensure_run_objects(self) -> int:
        """Create whichever of the run's claim, Secret, ConfigMap and Service are gone (the rest: 409, kept);
        returns how many were made. A recreated Secret holds the token this process knows (the running
        orchestrator's), else a new one."""
        token = self.controls.token(*self.key) or secrets.token_urlsafe(32)
        created = await self.create(build_run_objects(self.body, self.run, self.settings, token))
        if created:
            self.controls.token_changed(*self.key)
            log.info("%s/%s: %d run objects recreated", self.namespace, self.name, created)
        return created

    async def finish_workload(self, reason: str, message: str) -> None:
        """The run ended (``reason`` ``Succeeded`` or ``Failed``): a Kueue-admitted run's Workload gets ``Finished``
        True, so Kueue frees its quota (nothing for a run without ``status.queue``)."""
        if not self.status.get("queue") or not self.settings.kueue_enabled:
            return
        name = naming.workload_name(self.name)
        for _ in range(5):  # read again when Kueue wrote in between (the run's end is written once, not retried later)
            workload = await asyncio.to_thread(self.kube.get_workload, self.namespace, name)
            patch = kueue.finished(workload, reason, message) if workload is not None else None
            ops = kueue.status_ops(workload, patch) if patch else None
            if ops is None or await asyncio.to_thread(self.kube.patch_workload_status, self.namespace, name, ops):
                return
