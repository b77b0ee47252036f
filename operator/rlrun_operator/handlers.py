"""kopf handlers: thin glue between Kubernetes events and the reconciler (``reconcile.py``).

| handler | on | does |
|---|---|---|
| :func:`create_run` | RLRun created | the reconciler's first start¹ |
| :func:`spec_changed` | ``spec`` updated | ConfigMap (next attempt); invalid changes refused; reconcile (``suspend``) |
| :func:`poll_status` | timer, every ``status_interval_seconds`` | a reconcile |
| :func:`pod_changed` | one of the operator's pods changes | a reconcile of its run (disruptions are seen at once) |
| :func:`node_changed` | a Node's taints or readiness change, or it is deleted | reconciles every run with a pod on it |
| :func:`workload_changed` | one of the operator's Kueue Workloads changes² | a reconcile of its run³ |
| :func:`run_pods`, :func:`nodes` | indexes | the pods of each run, the nodes (what the reconciler reads) |

¹ Claim, Secret, ConfigMap, Service, then attempt 0's pods (none if suspended). ² Only with ``kueue_enabled``:
:func:`watch_workloads`. ³ Admission and eviction are seen at once.

Deletion needs no handler: everything but a retained claim carries an owner reference
and is garbage-collected. kopf keeps its progress in ``rlrun.dev/*`` annotations and,
because of the timer, a finalizer it removes once the timer has stopped (at once: the timer
races its reconcile against kopf's stop flag, so a hanging connection never delays deletion).

Status has one writer, the reconciler (a run's first status too: :meth:`Reconciler.start`); handlers
here never patch status except to refuse an invalid spec at creation (nothing else exists then). Errors: a spec the
pydantic model refuses at creation → ``Failed`` (``InvalidSpec``) and ``kopf.PermanentError``; an invalid
change later → ignored with a Warning Event (``specs.py``); API errors → retried in
:mod:`.kube`, then by kopf; anything else a reconcile raises → a ``Degraded`` condition
(``ReconcileError``), tried again at the next tick.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os

import kopf
from kubernetes.client.exceptions import ApiException
from rlrun.api.crd import CRD_NAME, PLURAL
from rlrun.api.spec import API_GROUP, API_VERSION
from rlrun.api.status import EventReason, Phase, Reason
from rlrun.manifest import ManifestError

from rlrun_operator import crd_drift, kueue, naming, recovery
from rlrun_operator.builders import build_configmap
from rlrun_operator.disruption import NodeView, node_view
from rlrun_operator.kube import Kube, load_api_client
from rlrun_operator.metrics import OperatorMetrics
from rlrun_operator.reconcile import Reconciler, was_refused
from rlrun_operator.settings import OperatorSettings
from rlrun_operator.specs import SpecMemory
from rlrun_operator.status import PodView, pod_view

log = logging.getLogger(__name__)

SETTINGS = OperatorSettings.from_env()
METRICS = OperatorMetrics()
RUNS = (API_GROUP, API_VERSION, PLURAL)
OUR_PODS = {naming.MANAGED_BY: naming.OPERATOR_NAME}
SERVICE_ACCOUNT_TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount/token"


class _State:
    """Per-process state: the API wrapper, the last valid spec of each run, the reconciler (its locks and
    control clients) and the last view of each node (node events that change nothing are ignored)."""

    def __init__(self) -> None:
        self.kube: Kube | None = None
        self.specs = SpecMemory()
        self.reconciler = Reconciler(_kube, SETTINGS, METRICS, self.specs)
        self.nodes: dict[str, NodeView] = {}


def _kube() -> Kube:
    if STATE.kube is None:  # handlers may run before startup in embedded use; build it lazily then
        STATE.kube = Kube(load_api_client())
    return STATE.kube


STATE = _State()


# -- start-up -------------------------------------------------------------------------------------


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_) -> None:
    """kopf settings (annotations under ``rlrun.dev``, events only for warnings) and the API client."""
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=API_GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=API_GROUP, key="last-handled-configuration"
    )
    settings.persistence.finalizer = f"{API_GROUP}/finalizer"
    # transitions post their own Events (kopf.event); kopf posts log lines only if settings.posting.loggers is
    # turned on (off by default), and then only from WARNING up
    settings.posting.level = logging.WARNING
    settings.execution.max_workers = 32
    STATE.__init__()  # locks and control clients belong to an event loop: a restarted operator makes new ones
    STATE.kube = Kube(load_api_client())
    try:
        found = crd_drift.drift(STATE.kube.crd_schema_hash())
    except ApiException as exc:
        log.warning("reading CustomResourceDefinition %s: %s", CRD_NAME, exc.reason)
        found = crd_drift.drift(None, readable=False)
    if found:
        log.error("%s", found)  # and one Warning Event on each run (the reconciler posts it)
    STATE.reconciler.crd_drift = found


@kopf.on.login()
def login(**kwargs) -> kopf.ConnectionInfo | None:
    """In a pod: the service account; elsewhere: ``$KUBECONFIG`` (tests point it at the API emulator)."""
    if os.path.exists(SERVICE_ACCOUNT_TOKEN):
        return kopf.login_with_service_account(**kwargs)
    return kopf.login_with_kubeconfig(**kwargs)


# -- indexes --------------------------------------------------------------------------------------


@kopf.index("pods", labels=OUR_PODS)
def run_pods(body, namespace, labels, **_) -> dict[tuple[str, str], PodView]:
    """``{(namespace, run): PodView}`` for every pod carrying the operator's labels (the reconciler keeps
    only those whose controller owner is the run)."""
    return {(namespace, labels.get(naming.INSTANCE, "")): pod_view(body)}


@kopf.index("nodes")
def nodes(body, name, **_) -> dict[str, NodeView]:
    """``{node name: NodeView}`` (cluster-scoped: watched cluster-wide in both operator modes)."""
    return {name: node_view(body)}


def _reader(index: kopf.Index, namespace: str, name: str):
    return lambda: list(index.get((namespace, name), []))


def _node_reader(index: kopf.Index):
    return lambda: {name: next(iter(views)) for name, views in index.items() if views}


async def _reconcile(namespace: str, name: str, run_pods: kopf.Index, nodes: kopf.Index) -> None:
    await STATE.reconciler.reconcile(namespace, name, _reader(run_pods, namespace, name), _node_reader(nodes))


# -- RLRun lifecycle ------------------------------------------------------------------------------


@kopf.on.create(*RUNS)
async def create_run(body, name, namespace, status, patch, logger, **_) -> None:
    """Create the run's objects and, unless ``spec.suspend``, attempt 0's pods."""
    with METRICS.track("create"):
        try:
            run = STATE.specs.parse(body)
        except ManifestError as exc:
            raise _refuse_invalid_spec(body, patch, status, exc) from None
        await STATE.reconciler.start(body, run, dict(status))


def _refuse_invalid_spec(body, patch, status, exc: ManifestError) -> kopf.PermanentError:
    """Mark a run that cannot be created as Failed (``InvalidSpec``); returns the error for the handler to raise.

    The only status written outside the reconciler: nothing exists for the run yet, and the
    reconciler leaves refused runs alone.
    """
    message = "; ".join(exc.errors)
    patch.status.update(
        recovery.failed_patch(dict(status), body["metadata"].get("generation"), Reason.INVALID_SPEC, message)
    )
    kopf.event(body, type="Warning", reason=EventReason.INVALID_SPEC, message=message)
    METRICS.set_phase(body["metadata"]["namespace"], body["metadata"]["name"], Phase.FAILED)
    return kopf.PermanentError(f"invalid spec: {message}")


@kopf.on.update(*RUNS, field="spec")
async def spec_changed(
    body, old, name, namespace, status, patch, logger, run_pods: kopf.Index, nodes: kopf.Index, **_
) -> None:
    """A valid change: the ConfigMap (used from the next attempt), then a reconcile (``suspend`` flips).

    An invalid change is refused with a Warning Event (the run goes on with its previous spec);
    a refused run whose spec is valid now is created.
    """
    with METRICS.track("update"):
        try:
            run = STATE.specs.parse(body)
        except ManifestError as exc:
            if was_refused(status):  # never created: it stays Failed, with the new reasons
                raise _refuse_invalid_spec(body, patch, status, exc) from None
            message = "; ".join(exc.errors)
            text = f"change ignored, the run goes on with its previous spec: {message}"
            kopf.event(body, type="Warning", reason=EventReason.INVALID_SPEC, message=text)
            raise kopf.PermanentError(f"invalid spec change: {message}") from None
        if was_refused(status):  # the spec is valid now: do what creation could not
            message = "the spec is valid now; creating the run"
            kopf.event(body, type="Normal", reason=EventReason.SPEC_FIXED, message=message)
            await STATE.reconciler.start(body, run, {**dict(status), "conditions": [], "phase": None})
            return
        try:
            previous = STATE.specs.parse(body, dict(old or {}))
        except ManifestError:
            previous = None
        if previous is None or previous.spec.model_copy(update={"suspend": run.spec.suspend}) != run.spec:
            await asyncio.to_thread(_kube().apply_configmap, build_configmap(body, run))
            message = "the new spec takes effect at the next attempt"
            kopf.event(body, type="Normal", reason=EventReason.SPEC_UPDATED, message=message)
        await _reconcile(namespace, name, run_pods, nodes)


@kopf.on.delete(*RUNS, optional=True)
async def forget_run(name, namespace, **_) -> None:
    """Drop per-run state (the objects themselves go by owner references)."""
    STATE.specs.forget(namespace, name)
    for client in STATE.reconciler.forget(namespace, name):
        await client.aclose()
    METRICS.set_phase(namespace, name, None)


# -- reconcile triggers ---------------------------------------------------------------------------


@kopf.timer(*RUNS, interval=SETTINGS.status_interval_seconds)
async def poll_status(name, namespace, status, stopped, run_pods: kopf.Index, nodes: kopf.Index, **_) -> None:
    """Reconcile the run every ``status_interval_seconds``; stops at once when kopf stops the timer (the
    run is being deleted), whatever the network is doing.

    Raises:
        kopf.TemporaryError: the spec is invalid and no earlier valid one is known (``SpecMemory.in_force``).
    """
    phase = status.get("phase")
    if phase is not None:  # counted even when there is nothing to do (an operator restart forgets)
        METRICS.set_phase(namespace, name, phase)
    if phase == Phase.SUCCEEDED or was_refused(status):
        return
    with METRICS.track("status"):
        work = asyncio.ensure_future(_reconcile(namespace, name, run_pods, nodes))
        stop = asyncio.ensure_future(stopped.wait())
        try:
            await asyncio.wait({work, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if not work.done():  # every action is idempotent and recorded first: safe to cut anywhere
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
            return
        work.result()


@kopf.on.event("pods", labels=OUR_PODS)
async def pod_changed(namespace, labels, run_pods: kopf.Index, nodes: kopf.Index, **_) -> None:
    """One of the operator's pods changed (ready, disrupted, ended, deleted): reconcile its run now."""
    name = labels.get(naming.INSTANCE)
    if name:
        with METRICS.track("pod"), contextlib.suppress(kopf.TemporaryError):  # the timer retries and warns
            await _reconcile(namespace, name, run_pods, nodes)


@kopf.on.event("nodes")
async def node_changed(type, name, body, run_pods: kopf.Index, nodes: kopf.Index, **_) -> None:
    """A node's taints or readiness changed, or it was deleted: reconcile every run with a pod on it."""
    view = None if type == "DELETED" else node_view(body)
    if view is not None and STATE.nodes.get(name) == view:
        return  # a heartbeat or label change: nothing the classifier reads
    if view is None:
        STATE.nodes.pop(name, None)
    else:
        STATE.nodes[name] = view
    runs = {key for key, pods in run_pods.items() if any(p.node == name for p in pods)}
    if runs:
        with METRICS.track("node"):
            await asyncio.gather(
                *(_reconcile(ns, run, run_pods, nodes) for ns, run in runs), return_exceptions=True
            )  # one run's invalid spec does not keep the others from being looked at (the timer retries)


async def workload_changed(namespace, labels, run_pods: kopf.Index, nodes: kopf.Index, **_) -> None:
    """One of the operator's Workloads changed (Kueue admitted or evicted it): reconcile its run now (the reconciler
    reads the Workload fresh)."""
    name = labels.get(naming.INSTANCE)
    if name:
        with METRICS.track("workload"), contextlib.suppress(kopf.TemporaryError):  # the timer retries and warns
            await _reconcile(namespace, name, run_pods, nodes)


def watch_workloads(registry: kopf.OperatorRegistry) -> None:
    """Register :func:`workload_changed` on the operator's Workloads (``kueue.x-k8s.io/v1beta1``) in ``registry``: only
    with the integration on, so an operator without Kueue neither needs Kueue's CRDs nor the grant to watch them."""
    kopf.on.event(kueue.GROUP, kueue.VERSION, kueue.WORKLOADS, labels=OUR_PODS, registry=registry)(workload_changed)


if SETTINGS.kueue_enabled:
    watch_workloads(kopf.get_default_registry())


__all__ = [
    "METRICS",
    "SETTINGS",
    "STATE",
    "configure",
    "create_run",
    "node_changed",
    "nodes",
    "pod_changed",
    "poll_status",
    "run_pods",
    "spec_changed",
    "watch_workloads",
    "workload_changed",
]
