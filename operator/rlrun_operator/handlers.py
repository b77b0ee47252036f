"""kopf handlers: thin glue between RLRun events, the builders, the API and the orchestrator.

| handler | on | does |
|---|---|---|
| :func:`create_run` | RLRun created | claim, Secret, ConfigMap, Service, then attempt 0's pods (none if suspended) |
| :func:`spec_changed` | ``spec`` updated | ``suspend`` → pause + remove pods / recreate them as the next attempt; other fields → ConfigMap (next attempt); a fixed invalid spec → what creation did |
| :func:`poll_status` | timer, every ``status_interval_seconds`` | orchestrator ``/status`` + pods → status and conditions; endpoints kept in sync |
| :func:`rollout_pod_changed` | a rollout pod changes | ready rollout servers → ``PUT /rollout-endpoints`` at once |
| :func:`run_pods` | index of the operator's pods | per run, what the other handlers need of its pods |

Deletion needs no handler: everything but a retained claim carries an owner reference
and is garbage-collected. kopf keeps its progress in ``rlrun.dev/*`` annotations and,
because of the timer, a finalizer it removes once the timer has stopped.

Every handler reads the spec as the parsed :class:`~rlrun.api.spec.RLRun` (defaults
filled in by the model, never by the handler). An invalid change to a run that exists is
ignored with a Warning Event: the run goes on with its previous spec, which this process
remembers per run (the last valid spec it parsed, :func:`_spec_in_force`). An operator
restarted since that change knows no previous spec: the status timer then posts a Warning
Event (``InvalidSpec``) saying to fix the spec and raises ``kopf.TemporaryError`` (retried
every 60 s), leaving the run as it is until the spec is valid again. (Guessing would be
worse: the raw spec's values are the invalid change, and the ConfigMap's copy of the last
valid spec would cost a ``get`` on ConfigMaps the operator has no other use for.)

Errors: a spec the pydantic model refuses at creation → ``Failed`` condition
(``InvalidSpec``) and ``kopf.PermanentError`` (never retried); API errors → retried in
:mod:`.kube`, then by kopf; an orchestrator that does not answer, or answers outside the
contract (:mod:`rlrun.api.control`) → ``Ready`` False (``OrchestratorUnreachable``), tried
again at the next tick.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
from typing import Any, NamedTuple

import kopf
from rlrun.api.control import PauseResult
from rlrun.api.crd import PLURAL
from rlrun.api.spec import API_GROUP, API_VERSION, KIND, RLRun
from rlrun.api.status import ConditionType, EventReason, Phase, Reason
from rlrun.manifest import ManifestError, parse_manifest

from rlrun_operator import naming
from rlrun_operator.builders import build_configmap, build_pods, build_run_objects
from rlrun_operator.control import ControlClient, ControlError
from rlrun_operator.kube import Kube, load_api_client
from rlrun_operator.metrics import OperatorMetrics
from rlrun_operator.settings import OperatorSettings
from rlrun_operator.status import PodView, failed, observe, pod_view, rollout_endpoints, starting, suspended

log = logging.getLogger(__name__)

SETTINGS = OperatorSettings.from_env()
METRICS = OperatorMetrics()
RUNS = (API_GROUP, API_VERSION, PLURAL)
OUR_PODS = {naming.MANAGED_BY: naming.OPERATOR_NAME}
SERVICE_ACCOUNT_TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount/token"
TERMINAL_PHASES = (Phase.SUCCEEDED, Phase.FAILED)
#: Seconds between retries of the status timer while a run's spec is invalid and no valid one is known.
UNKNOWN_SPEC_RETRY_SECONDS = 60


class _ValidSpec(NamedTuple):
    """A run's spec as last parsed valid, and the ``metadata.generation`` it had."""

    generation: int
    run: RLRun


class _State:
    """Per-process caches, by ``(namespace, name)``: the API wrapper, one control client per run, the
    endpoints last pushed, and the last valid spec of each run (what it goes on with after an invalid change)."""

    def __init__(self) -> None:
        self.kube: Kube | None = None
        self.clients: dict[tuple[str, str], ControlClient] = {}
        self.pushed: dict[tuple[str, str], list[str]] = {}
        self.valid_specs: dict[tuple[str, str], _ValidSpec] = {}


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
    STATE.__init__()  # control clients belong to an event loop: a restarted operator makes new ones
    STATE.kube = Kube(load_api_client())


@kopf.on.login()
def login(**kwargs) -> kopf.ConnectionInfo | None:
    """In a pod: the service account; elsewhere: ``$KUBECONFIG`` (tests point it at the API emulator)."""
    if os.path.exists(SERVICE_ACCOUNT_TOKEN):
        return kopf.login_with_service_account(**kwargs)
    return kopf.login_with_kubeconfig(**kwargs)


def _kube() -> Kube:
    if STATE.kube is None:  # handlers may run before startup in embedded use; build it lazily then
        STATE.kube = Kube(load_api_client())
    return STATE.kube


# -- the index of our pods ------------------------------------------------------------------------


@kopf.index("pods", labels=OUR_PODS)
def run_pods(body, namespace, labels, **_) -> dict[tuple[str, str], PodView]:
    """``{(namespace, run): PodView}`` for every pod the operator created."""
    return {(namespace, labels.get(naming.INSTANCE, "")): pod_view(body)}


def _pods_of(index: kopf.Index, namespace: str, name: str) -> list[PodView]:
    return list(index.get((namespace, name), []))


# -- helpers --------------------------------------------------------------------------------------


def _parse(body: dict[str, Any], spec: dict[str, Any] | None = None) -> RLRun:
    """The RLRun ``body`` (with ``spec`` instead of its own, if given) as the model; a valid one is remembered.

    Raises:
        ManifestError: the spec is invalid (one line per field, as ``rlrun validate`` prints).
    """
    meta = body["metadata"]
    run = parse_manifest(
        {
            "apiVersion": f"{API_GROUP}/{API_VERSION}",
            "kind": KIND,
            "metadata": {"name": meta["name"], "namespace": meta.get("namespace")},
            "spec": dict(body.get("spec") or {}) if spec is None else dict(spec),
        },
        source=f"{meta.get('namespace')}/{meta['name']}",
    )
    if spec is None:
        key, generation = (meta["namespace"], meta["name"]), meta.get("generation") or 0
        known = STATE.valid_specs.get(key)
        if known is None or generation >= known.generation:  # a timer may hold an older body than a handler
            STATE.valid_specs[key] = _ValidSpec(generation, run)
    return run


def _spec_in_force(body: dict[str, Any]) -> RLRun:
    """The spec the run goes on with: the body's when valid, else the last valid one this process parsed.

    Raises:
        kopf.TemporaryError: the body's spec is invalid and no valid one is known (the operator
            restarted since the invalid change); a Warning Event (``InvalidSpec``) says to fix the
            spec, and the caller is retried after :data:`UNKNOWN_SPEC_RETRY_SECONDS`.
    """
    meta = body["metadata"]
    known = STATE.valid_specs.get((meta["namespace"], meta["name"]))
    if known is not None and known.generation == (meta.get("generation") or 0):
        return known.run
    try:
        return _parse(body)
    except ManifestError as exc:
        if known is not None:
            return known.run
        message = (
            f"the spec is invalid ({'; '.join(exc.errors)}) and the operator knows no earlier valid spec of this "
            "run (it restarted since the change): fix the spec; until then the run's status is not updated"
        )
        kopf.event(body, type="Warning", reason=EventReason.INVALID_SPEC, message=message)
        raise kopf.TemporaryError(message, delay=UNKNOWN_SPEC_RETRY_SECONDS) from None


def _refuse_invalid_spec(body, patch, status, exc: ManifestError) -> kopf.PermanentError:
    """Mark a run that cannot be created as Failed (``InvalidSpec``); returns the error for the handler to raise."""
    message = "; ".join(exc.errors)
    patch.status.update(failed(dict(status), body["metadata"].get("generation"), Reason.INVALID_SPEC, message))
    kopf.event(body, type="Warning", reason=EventReason.INVALID_SPEC, message=message)
    METRICS.set_phase(body["metadata"]["namespace"], body["metadata"]["name"], Phase.FAILED)
    return kopf.PermanentError(f"invalid spec: {message}")


async def _control(namespace: str, name: str) -> ControlClient:
    key = (namespace, name)
    url = SETTINGS.orchestrator_url.format(
        name=name, namespace=namespace, service=naming.orchestrator_service_name(name)
    )
    client = STATE.clients.get(key)
    if client is None or client.base_url != url.rstrip("/"):
        token = await asyncio.to_thread(_kube().read_token, namespace, name)
        client = STATE.clients[key] = ControlClient(url, token, SETTINGS.request_timeout_seconds)
    return client


async def _start_attempt(body, run: RLRun, attempt: int, logger) -> int:
    """Create attempt ``attempt``'s pods; returns how many were created (existing ones are kept)."""
    pods = build_pods(body, run, SETTINGS, attempt)
    created = sum(await asyncio.gather(*(asyncio.to_thread(_kube().create, pod) for pod in pods)))
    STATE.pushed.pop((body["metadata"]["namespace"], body["metadata"]["name"]), None)
    logger.info("attempt %d: %d pods created (%d already there)", attempt, created, len(pods) - created)
    return created


async def _delete_pods(pods: list[PodView], namespace: str, grace_s: int, components=naming.COMPONENTS) -> int:
    doomed = [p for p in pods if p.component in components and not p.deleting]
    await asyncio.gather(*(asyncio.to_thread(_kube().delete_pod, namespace, p.name, grace_s) for p in doomed))
    return len(doomed)


# -- RLRun lifecycle ------------------------------------------------------------------------------


@kopf.on.create(*RUNS)
async def create_run(body, name, namespace, status, patch, logger, **_) -> None:
    """Create the run's objects and, unless ``spec.suspend``, attempt 0's pods."""
    with METRICS.track("create"):
        try:
            run = _parse(body)
        except ManifestError as exc:
            raise _refuse_invalid_spec(body, patch, status, exc) from None
        await _create(body, run, status, patch, logger)


async def _create(body, run: RLRun, status, patch, logger) -> None:
    namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
    generation = body["metadata"].get("generation")
    objects = build_run_objects(body, run, SETTINGS, secrets.token_urlsafe(32))
    created = await asyncio.gather(*(asyncio.to_thread(_kube().create, obj) for obj in objects))
    if objects[0]["kind"] == "PersistentVolumeClaim" and not created[0]:
        # Retained from an earlier RLRun of this name (retention Retain): resuming it is the point of
        # retaining, but the user should know; its size and retention are the old claim's.
        message = (
            f"claim {objects[0]['metadata']['name']} already existed (kept from an earlier run of this name?): "
            "its run directory is resumed; storage.size and retention_policy do not apply to it"
        )
        kopf.event(body, type="Warning", reason=EventReason.EXISTING_CLAIM, message=message)
    if run.spec.suspend:
        patch.status.update(suspended(dict(status), generation, "created suspended"))
        METRICS.set_phase(namespace, name, Phase.SUSPENDED)
        message = "created with spec.suspend: no pods until it is false"
        kopf.event(body, type="Normal", reason=EventReason.SUSPENDED, message=message)
        return
    count = await _start_attempt(body, run, 0, logger)
    patch.status.update(starting(dict(status), generation, 0))
    METRICS.set_phase(namespace, name, Phase.PENDING)
    kopf.event(body, type="Normal", reason=EventReason.CREATED, message=f"attempt 0: {count} pods created")


def _was_refused(status) -> bool:
    """Whether the run was refused for an invalid spec (nothing was created for it)."""
    return any(
        c.get("type") == ConditionType.FAILED and c.get("reason") == Reason.INVALID_SPEC
        for c in status.get("conditions") or []
    )


def _parsed_or_none(body, spec: dict[str, Any]) -> RLRun | None:
    try:
        return _parse(body, spec)
    except ManifestError:
        return None


@kopf.on.update(*RUNS, field="spec")
async def spec_changed(body, old, new, name, namespace, status, patch, logger, run_pods: kopf.Index, **_) -> None:
    """``suspend`` flips: suspend or resume the run. Other changes: the ConfigMap, used from the next attempt.

    The change is ``old`` → ``new`` as kopf saw it, both read through the model. An ``old`` the
    model refuses (an earlier change that was ignored) counts as suspended when the run's phase is.
    """
    with METRICS.track("update"):
        try:
            run = _parse(body)
        except ManifestError as exc:
            if _was_refused(status):  # never created: it stays Failed, with the new reasons
                raise _refuse_invalid_spec(body, patch, status, exc) from None
            message = "; ".join(exc.errors)
            text = f"change ignored, the run goes on with its previous spec: {message}"
            kopf.event(body, type="Warning", reason=EventReason.INVALID_SPEC, message=text)
            raise kopf.PermanentError(f"invalid spec change: {message}") from None
        generation = body["metadata"].get("generation")
        if _was_refused(status):  # the spec is valid now: do what creation could not
            message = "the spec is valid now; creating the run"
            kopf.event(body, type="Normal", reason=EventReason.SPEC_FIXED, message=message)
            await _create(body, run, {**dict(status), "conditions": [], "phase": None}, patch, logger)
            return
        previous = _parsed_or_none(body, dict(old or {}))
        if previous is None or previous.spec.model_copy(update={"suspend": run.spec.suspend}) != run.spec:
            await asyncio.to_thread(_kube().apply_configmap, build_configmap(body, run))
            message = "the new spec takes effect at the next attempt"
            kopf.event(body, type="Normal", reason=EventReason.SPEC_UPDATED, message=message)
        was = previous.spec.suspend if previous is not None else status.get("phase") == Phase.SUSPENDED
        now = run.spec.suspend
        if was == now or status.get("phase") == Phase.SUCCEEDED:  # a failed run may be suspended and resumed
            patch.status["observedGeneration"] = generation
            return
        pods = _pods_of(run_pods, namespace, name)
        if now:
            await _suspend(body, run, status, patch, pods, logger)
        else:
            attempt = 0 if status.get("attempt") is None else int(status["attempt"]) + 1
            count = await _start_attempt(body, run, attempt, logger)
            patch.status.update(starting(dict(status), generation, attempt))
            METRICS.set_phase(namespace, name, Phase.PENDING)
            if attempt == 0:  # created suspended: this is its start
                kopf.event(body, type="Normal", reason=EventReason.CREATED, message=f"attempt 0: {count} pods created")
            else:
                message = f"attempt {attempt}: {count} pods created, resuming from the newest checkpoint"
                kopf.event(body, type="Normal", reason=EventReason.RESUMED, message=message)


async def _suspend(body, run: RLRun, status, patch, pods: list[PodView], logger) -> None:
    """Pause the orchestrator (its snapshot keeps queued samples and open groups), then remove the pods."""
    namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
    generation = body["metadata"].get("generation")
    grace = run.spec.preemption.termination_grace_period_seconds
    try:
        client = await _control(namespace, name)
        paused = await client.pause(timeout_s=run.spec.preemption.snapshot_timeout_seconds)
        message = _pause_message(paused)
        kopf.event(body, type="Normal", reason=EventReason.PAUSED, message=message)
    except Exception as exc:  # the pods go regardless; SIGTERM makes the orchestrator pause itself
        message = f"pause failed ({exc}); pods stop on SIGTERM and the run resumes from its newest checkpoint"
        kopf.event(body, type="Warning", reason=EventReason.PAUSE_FAILED, message=message)
    removed = await _delete_pods(pods, namespace, grace)
    STATE.pushed.pop((namespace, name), None)
    logger.info("suspended: %d pods deleted", removed)
    patch.status.update(suspended(dict(status), generation, f"suspended; {message}"))
    METRICS.set_phase(namespace, name, Phase.SUSPENDED)
    kopf.event(body, type="Normal", reason=EventReason.SUSPENDED, message=f"{removed} pods deleted")


def _pause_message(paused: PauseResult) -> str:
    """The Paused Event's sentence: what the snapshot saved, in the contract's words."""
    if paused.step is None:  # paused before it started, or after it was done
        return f"{paused.note or 'nothing to save'}; it resumes from its newest checkpoint"
    return (
        f"snapshot at step {paused.step}: {paused.queued_traces} queued traces, {paused.open_groups} open groups, "
        f"{paused.requested_groups} requested groups, {paused.finished_episodes_kept} finished episodes kept"
    )


@kopf.on.delete(*RUNS, optional=True)
async def forget_run(name, namespace, **_) -> None:
    """Drop per-run caches (the objects themselves go by owner references)."""
    STATE.pushed.pop((namespace, name), None)
    STATE.valid_specs.pop((namespace, name), None)
    client = STATE.clients.pop((namespace, name), None)
    if client is not None:
        await client.aclose()
    METRICS.set_phase(namespace, name, None)


# -- status and endpoints -------------------------------------------------------------------------


async def _push_endpoints(namespace: str, name: str, desired: list[str], logger) -> bool:
    try:
        client = await _control(namespace, name)
        await client.set_endpoints(desired)
    except Exception as exc:  # unreachable, 4xx/5xx, or the token's Secret gone: the timer tries again
        logger.debug("endpoints not pushed yet: %s", exc)
        return False
    STATE.pushed[(namespace, name)] = desired
    METRICS.endpoint_updates.inc()
    logger.info("rollout endpoints sent to the orchestrator: %s", desired)
    return True


@kopf.timer(*RUNS, interval=SETTINGS.status_interval_seconds)
async def poll_status(body, name, namespace, status, patch, logger, run_pods: kopf.Index, **_) -> None:
    """Poll the orchestrator's ``/status``, fold it and the pods into ``status``, keep endpoints in sync.

    Raises:
        kopf.TemporaryError: the spec is invalid and no earlier valid one is known (see :func:`_spec_in_force`).
    """
    phase = status.get("phase")
    if phase is not None:  # counted even when there is nothing to poll (an operator restart forgets)
        METRICS.set_phase(namespace, name, phase)
    if phase in (*TERMINAL_PHASES, Phase.SUSPENDED) or status.get("attempt") is None:
        return
    with METRICS.track("status"):
        run = _spec_in_force(body)
        if run.spec.suspend:  # the suspend handler is at work
            return
        generation = body["metadata"].get("generation")
        pods = _pods_of(run_pods, namespace, name)
        attempt = int(status["attempt"])
        report, error = None, None
        try:
            report = await (await _control(namespace, name)).status()
        except ControlError as exc:
            error = str(exc)
        if report is not None and report.attempt != attempt:
            # the Service follows the run across attempts: an old attempt's orchestrator may still answer
            report, error = None, f"the orchestrator answering is attempt {report.attempt}, not {attempt}"
        desired = rollout_endpoints(pods, attempt)
        if report is not None and report.rollout_endpoints != desired:
            await _push_endpoints(namespace, name, desired, logger)
        new = observe(dict(status), generation, pods, report, error, rollout_replicas=run.spec.rollout.replicas)
        grace = run.spec.preemption.termination_grace_period_seconds
        if new["phase"] == Phase.SUCCEEDED and phase != Phase.SUCCEEDED:
            freed = await _delete_pods(pods, namespace, grace, components=(naming.ROLLOUT,))
            message = f"{new['message']}; {freed} rollout pods removed"
            kopf.event(body, type="Normal", reason=EventReason.SUCCEEDED, message=message)
        elif new["phase"] == Phase.FAILED and phase != Phase.FAILED:
            # the trainer and rollout servers cannot go on without it: free their GPUs (logs stay in the
            # orchestrator pod); suspend, then unsuspend, starts a new attempt from the newest checkpoint
            freed = await _delete_pods(pods, namespace, grace, components=(naming.TRAINER, naming.ROLLOUT))
            message = f"{new['message']}; {freed} pods removed; suspend and unsuspend to retry"
            kopf.event(body, type="Warning", reason=EventReason.FAILED, message=message)
        elif new["phase"] == Phase.RUNNING and phase != Phase.RUNNING:
            kopf.event(body, type="Normal", reason=EventReason.RUNNING, message=new["message"])
        changed = {k: v for k, v in new.items() if status.get(k) != v}
        if changed:
            patch.status.update(changed)
        METRICS.set_phase(namespace, name, new["phase"])


@kopf.on.event("pods", labels={**OUR_PODS, naming.COMPONENT: naming.ROLLOUT})
async def rollout_pod_changed(namespace, labels, logger, run_pods: kopf.Index, **_) -> None:
    """A rollout pod became ready, unready or went away: send the new endpoint set at once."""
    name = labels.get(naming.INSTANCE)
    if not name:
        return
    pods = _pods_of(run_pods, namespace, name)
    attempts = [p.attempt for p in pods if p.component == naming.ORCHESTRATOR and not p.deleting]
    if not attempts:
        return
    desired = rollout_endpoints(pods, max(attempts))
    if STATE.pushed.get((namespace, name)) != desired:
        with METRICS.track("endpoints"):
            await _push_endpoints(namespace, name, desired, logger)


__all__ = [
    "METRICS",
    "SETTINGS",
    "configure",
    "create_run",
    "poll_status",
    "rollout_pod_changed",
    "run_pods",
    "spec_changed",
]
