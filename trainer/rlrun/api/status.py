"""``RLRun.status``: what the operator reports (Kubernetes naming: camelCase, conditions).

Written only by the operator (``rlrun_operator.status``) through the ``status``
subresource; the CRD's status schema is generated from these models. Steps count
shipped batches; ``resumed*`` fields add up every attempt's resume report.

The words the operator writes are constants here, one place for the operator, the CRD's
descriptions and the tests (JobSet's ``constants.go`` is the model): :class:`Phase`,
:class:`ConditionType`, :class:`Reason` (a condition's ``reason``) and :class:`EventReason`
(the ``reason`` of the Events the operator posts; the same word as a condition reason or
phase where it says the same thing).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class Phase:
    """``status.phase``: where a run is in its life (``kubectl get rlrun``'s PHASE column)."""

    QUEUED = "Queued"  # waiting for Kueue's admission (kueue.x-k8s.io/queue-name): no pods
    PENDING = "Pending"  # an attempt's pods were created; its orchestrator is not running yet
    RUNNING = "Running"  # the orchestrator runs
    RECOVERING = "Recovering"  # an attempt hit by a preemption or a failure is paused, stopped and replaced
    EVICTED = "Evicted"  # Kueue evicted the run's Workload: pausing, snapshotting and stopping, then Queued
    SUSPENDED = "Suspended"  # spec.suspend: the pods are removed, the snapshot kept
    SUCCEEDED = "Succeeded"  # the orchestrator reported every step trained
    FAILED = "Failed"  # an invalid spec, an error retrying cannot heal, or more failures than the budget


#: Lifecycle phases, in the order a run normally goes through them.
PHASES = (
    Phase.QUEUED,
    Phase.PENDING,
    Phase.RUNNING,
    Phase.RECOVERING,
    Phase.EVICTED,
    Phase.SUSPENDED,
    Phase.SUCCEEDED,
    Phase.FAILED,
)


class ConditionType:
    """``status.conditions[].type`` (``metav1.Condition``; at most one condition of each type)."""

    READY = "Ready"  # the orchestrator runs and at least one rollout server is ready
    PROGRESSING = "Progressing"  # an attempt is starting or training
    DEGRADED = "Degraded"  # a pod of the attempt failed or is missing, or no rollout server is ready
    FAILED = "Failed"  # the run cannot go on (see the reason)
    SUCCEEDED = "Succeeded"  # every step trained
    PREEMPTED = "Preempted"  # True while an attempt hit by a preemption is recovered (reason: the trigger)
    RESUMED = "Resumed"  # the newest attempt's orchestrator confirmed what it restored (counts in lastResume)
    ADMITTED = "Admitted"  # a Kueue-managed run: its Workload is admitted (False: queued, evicted, or Kueue is off)


#: Every condition type, in the order ``kubectl describe`` lists them once all are set.
CONDITION_TYPES = (
    ConditionType.READY,
    ConditionType.PROGRESSING,
    ConditionType.DEGRADED,
    ConditionType.FAILED,
    ConditionType.SUCCEEDED,
    ConditionType.PREEMPTED,
    ConditionType.RESUMED,
    ConditionType.ADMITTED,
)


class Reason:
    """``status.conditions[].reason``: why a condition has its status (CamelCase)."""

    STARTING = "Starting"  # an attempt's pods were created; its orchestrator is not running yet
    RUNNING = "Running"  # the orchestrator runs
    TRAINING = "Training"  # Progressing: the orchestrator runs the attempt
    COMPLETED = "Completed"  # every step trained
    SUSPENDED = "Suspended"  # spec.suspend
    AS_EXPECTED = "AsExpected"  # Degraded False: nothing is wrong
    INVALID_SPEC = "InvalidSpec"  # the spec model refuses the spec (the message names the fields)
    ORCHESTRATOR_UNREACHABLE = "OrchestratorUnreachable"  # GET /status got no (valid) answer
    POD_FAILED = "PodFailed"  # a pod of the attempt failed
    PODS_MISSING = "PodsMissing"  # the attempt lacks pods
    NO_ROLLOUT_ENDPOINTS = "NoRolloutEndpoints"  # the orchestrator runs and no rollout server is ready
    RESUMED = "Resumed"  # Resumed True: the orchestrator restored its snapshot (the message has the counts)
    RESUMING = "Resuming"  # Ready False: a recovery's new pods run, the orchestrator has not confirmed its restore
    RECOVERED = "Recovered"  # Preempted False: the last recovery is over
    STARTED_OVER = "StartedOver"  # Resumed False: the attempt found no complete checkpoint and started from step 0
    BACKOFF_LIMIT_EXCEEDED = "BackoffLimitExceeded"  # more failures than spec.failure_policy.backoff_limit
    RECONCILE_ERROR = "ReconcileError"  # the operator's reconcile raised (the message has the error)
    #: Degraded True: a pod a recovery waits for is held terminating by finalizers (the message names them)
    POD_STUCK_TERMINATING = "PodStuckTerminating"
    QUEUED = "Queued"  # Admitted False: waiting for Kueue (the message is Kueue's own, e.g. insufficient quota)
    ADMITTED = "Admitted"  # Admitted True: Kueue admitted the Workload (ClusterQueue and flavors in the message)
    EVICTED = "Evicted"  # Admitted False: Kueue evicted the Workload (the message has Kueue's reason)
    #: Admitted False: the run has the queue label but the operator runs without Kueue (kueue.enabled)
    KUEUE_DISABLED = "KueueDisabled"
    #: Admitted False: an admitted flavor's node label contradicts the run's own nodeSelector
    FLAVOR_CONFLICT = "FlavorConflict"


class Trigger:
    """``status.recovery.trigger``: what the operator saw that started a recovery (``disruption.py``)."""

    DISRUPTION_TARGET = "DisruptionTarget"  # the pod got condition DisruptionTarget=True (reason: its reason)
    POD_DELETED = "PodDeleted"  # the pod got a deletionTimestamp the operator did not cause
    POD_MISSING = "PodMissing"  # a pod of the attempt is gone without the operator deleting it
    NODE_TAINTED = "NodeTainted"  # the pod's node has a taint that means it goes away (reason: the taint key)
    NODE_GONE = "NodeGone"  # the pod's Node object was deleted
    POD_FAILED = "PodFailed"  # the pod ended Failed (reason: the container's reason or exit code)
    EXITED_EARLY = "ExitedEarly"  # the pod exited 0 before the run was complete (paused on a SIGTERM)
    SUSPEND = "Suspend"  # spec.suspend became true
    KUEUE_EVICTION = "KueueEviction"  # Kueue evicted the run's Workload (reason: Kueue's, e.g. Preempted)
    KUEUE_ADMISSION = "KueueAdmission"  # a Kueue-managed run waits for its first admission (not counted)


class RecoveryKind:
    """``status.recovery.kind``: which count a recovery adds to (only failures use the failure budget)."""

    PREEMPTION = "preemption"
    SUSPENSION = "suspension"
    FAILURE = "failure"


class Stage:
    """``status.recovery.stage``, in order: each is written to status before its action is taken."""

    PAUSING = "Pausing"  # POST /pause to the live orchestrator (its snapshot: queue and open groups)
    STOPPING = "Stopping"  # delete the pods that must restart; wait until they are gone (force after a timeout)
    SUSPENDED = "Suspended"  # a suspension's pods are gone; waiting for spec.suspend false
    QUEUED = "Queued"  # no pods: waiting for Kueue to admit (again) the run's Workload
    STARTING = "Starting"  # create the next attempt's pods (or a rollout pod's replacement)
    RESUMING = "Resuming"  # wait for the new orchestrator's resume report


class EventReason:
    """``reason`` of the Events the operator posts on an RLRun (``kubectl describe rlrun``)."""

    CREATED = "Created"  # an attempt's pods were created (attempt 0)
    RUNNING = Reason.RUNNING  # the orchestrator started running
    PAUSED = "Paused"  # the orchestrator paused and wrote its snapshot (the message has the counts)
    PAUSE_FAILED = "PauseFailed"  # the pause failed; the pods stop on SIGTERM anyway
    SUSPENDED = Reason.SUSPENDED  # the pods were removed for spec.suspend
    RESUMED = ConditionType.RESUMED  # the resumed orchestrator confirmed what it restored (the message has the counts)
    PREEMPTED = ConditionType.PREEMPTED  # a preemption was seen (one Event per preemption: trigger, pod, node)
    POD_FAILED = Reason.POD_FAILED  # a pod failed: counted against the failure budget, the attempt restarts
    RECREATED = "Recreated"  # the next attempt's pods (or a rollout pod's replacement) were created
    SPEC_UPDATED = "SpecUpdated"  # a spec change reaches the pods at the next attempt
    SPEC_FIXED = "SpecFixed"  # a refused spec became valid: the run is created now
    SUCCEEDED = Phase.SUCCEEDED
    FAILED = Phase.FAILED
    INVALID_SPEC = Reason.INVALID_SPEC  # a refused spec, or an invalid change that was ignored
    EXISTING_CLAIM = "ExistingClaim"  # the run's claim already existed and is used as it is
    POD_STUCK_TERMINATING = Reason.POD_STUCK_TERMINATING  # once per pod held terminating by finalizers
    CRD_OUTDATED = "CRDOutdated"  # the installed CRD is not the operator's (once per run and operator start)
    QUEUED = Reason.QUEUED  # the run waits for Kueue's admission (its LocalQueue and Workload named)
    ADMITTED = Reason.ADMITTED  # Kueue admitted the run (ClusterQueue, flavors)
    EVICTED = Reason.EVICTED  # Kueue evicted the run (Warning: Kueue's reason and message)
    QUOTA_RELEASED = "QuotaReleased"  # the evicted run's pods are gone: its quota reservation given back to Kueue
    KUEUE_DISABLED = Reason.KUEUE_DISABLED  # the queue label on a run while the operator's Kueue integration is off
    FLAVOR_CONFLICT = Reason.FLAVOR_CONFLICT  # an admitted flavor contradicts the run's nodeSelector
    NO_PRIORITY_CLASS = "NoPriorityClass"  # the kueue.x-k8s.io/priority-class label names no WorkloadPriorityClass


def _one_of(words: tuple[str, ...]) -> str:
    return f"{', '.join(words[:-1])} or {words[-1]}"


class Condition(BaseModel):
    """A condition in the Kubernetes shape (``metav1.Condition``).

    Attributes:
        status: True, False or Unknown.
        reason: CamelCase machine-readable reason.
        message: what happened, for people.
        lastTransitionTime: when ``status`` last changed (RFC 3339).
        observedGeneration: the RLRun generation the condition was computed from.
    """

    model_config = ConfigDict(extra="forbid")

    type: str = Field(min_length=1, max_length=316, description=f"one of {_one_of(CONDITION_TYPES)}.")
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(min_length=1, max_length=1024, pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
    message: str = Field(default="", max_length=32768)
    lastTransitionTime: str = Field(json_schema_extra={"format": "date-time"})
    observedGeneration: int | None = Field(default=None, ge=0)


class LastResume(BaseModel):
    """What one attempt's orchestrator restored from a snapshot.

    Attributes:
        attempt: the attempt that resumed.
        fromStep: the checkpoint step it resumed from.
        groups: rollout groups resumed with their task and group id (open and requested groups).
        queuedTraces: queued samples restored.
        finishedEpisodes: finished episodes kept in open groups.
        conversations: multi-turn episodes continued at their last durable turn (not started over).
        turnsKept: their model turns, together.
    """

    model_config = ConfigDict(extra="forbid")

    attempt: int = Field(ge=0)
    fromStep: int = Field(ge=0)
    groups: int = Field(ge=0)
    queuedTraces: int = Field(ge=0)
    finishedEpisodes: int = Field(ge=0)
    conversations: int = Field(default=0, ge=0)
    turnsKept: int = Field(default=0, ge=0)


class Recovery(BaseModel):
    """A recovery in progress (``status.recovery``): written before each of its actions, so a restarted operator
    finishes it exactly once (``rlrun_operator.recovery``).

    Attributes:
        trigger: what started it (a :class:`Trigger`).
        kind: preemption, suspension or failure (:class:`RecoveryKind`).
        reason: the trigger's own reason (``PreemptionByScheduler``, a taint key, ``OOMKilled``, …).
        message: one line for people (names pod and node).
        scope: ``attempt`` (every pod restarts as the next attempt), ``rollout`` (only the lost rollout
            pods are replaced; the trainer and orchestrator keep running) or ``trainer`` (the lost trainer is
            replaced in the same attempt with ``--resume``, with any rollout pods lost with it; the
            orchestrator and the other rollout pods keep running).
        pods: the pods the trigger hit; with scope ``trainer`` also every other pod of the attempt's trainer
            group: a multi-node trainer (``trainer.nodes`` > 1) is one trainer, so losing any of its pods
            replaces all of them together and the list names the whole group even when one node was hit
            (``replacements`` in the same order).
        node: the node the trigger hit, if any.
        stage: the current :class:`Stage`.
        since: when the recovery started (RFC 3339).
        stageSince: when the current stage started (RFC 3339; force deletion counts from here).
        attempt: the attempt being recovered.
        nextAttempt: the attempt its pods are recreated as (scope ``attempt``).
        replacements: names of the replacement pods (scopes ``rollout`` and ``trainer``), decided before creation.
        pause: what the pause answered (or why it failed / was skipped).
    """

    model_config = ConfigDict(extra="forbid")

    trigger: str = Field(min_length=1)
    kind: Literal["preemption", "suspension", "failure"]
    reason: str = ""
    message: str = ""
    scope: Literal["attempt", "rollout", "trainer"] = "attempt"
    pods: list[str] = Field(default_factory=list)
    node: str | None = None
    stage: Literal["Pausing", "Stopping", "Suspended", "Queued", "Starting", "Resuming"]
    since: str
    stageSince: str
    attempt: int | None = Field(default=None, ge=0)
    nextAttempt: int | None = Field(default=None, ge=0)
    replacements: list[str] = Field(default_factory=list)
    pause: str | None = None


class QueueStatus(BaseModel):
    """Where a Kueue-managed run queues (``status.queue``; ``rlrun_operator.kueue``).

    Attributes:
        name: the LocalQueue (the run's ``kueue.x-k8s.io/queue-name`` label).
        workload: the run's Workload (``kueue.x-k8s.io/v1beta1``, same namespace).
        admitted: the Workload is admitted now (the run may have pods).
        clusterQueue: the ClusterQueue that admitted it (None while queued).
        flavors: the ResourceFlavors of the admission, per pod set (orchestrator, trainer, rollout).
    """

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=253)
    workload: str = Field(min_length=1, max_length=253)
    admitted: bool = False
    clusterQueue: str | None = None
    flavors: dict[str, list[str]] | None = None


class Progress(BaseModel):
    """How far a run is: ``kubectl get rlrun``'s Progress and ETA columns (``text``, ``eta``).

    Attributes:
        percent: ``step ÷ maxSteps``, whole percent (0–100).
        text: ``37%``.
        eta: the time left, ``45s``, ``12m`` or ``3h05m`` (``-`` until a step rate is known; a column value
            without spaces, so ``kubectl get`` output splits into its columns).
        stepsPerMinute: the recent step rate: an exponential moving average (weight ½ each) of the rate
            between the operator's looks at least 30 s apart (recoveries included: the ETA counts them).
        etaSeconds: ``(maxSteps − step) ÷ stepsPerMinute``, seconds (None until a rate is known).
        sampledStep, sampledAt: the look the next rate is measured from (a step; RFC 3339).
    """

    model_config = ConfigDict(extra="forbid")

    percent: int = Field(ge=0, le=100)
    text: str
    eta: str = "-"
    stepsPerMinute: float | None = Field(default=None, ge=0)
    etaSeconds: int | None = Field(default=None, ge=0)
    sampledStep: int | None = Field(default=None, ge=0)
    sampledAt: str | None = None


class RLRunStatus(BaseModel):
    """The operator's view of a run.

    Attributes:
        observedGeneration: the RLRun generation last acted on.
        attempt: current attempt (0 first; +1 on every restart of the pods).
        step: batches shipped to the trainer.
        maxSteps: the step the run ends at.
        policyVersion: weights version the rollout servers hold.
        lastCheckpointStep: newest complete checkpoint.
        preemptions: recoveries started by a preemption (pod disrupted or deleted, node lost or tainted, or Kueue's
            eviction of the run's Workload).
        suspensions: times ``spec.suspend`` stopped the run; never failures.
        failures: recoveries started by a failed pod (counted against ``spec.failure_policy.backoff_limit``).
        recovery: the recovery in progress, if any (:class:`Recovery`).
        failedNodes: nodes the run's pods are kept off (``NotIn`` node affinity), newest last.
        deletedPods: pods the operator deleted itself, newest last (so a restarted operator knows
            which deletions were its own).
        resumedGroups: rollout groups resumed from snapshots (open and requested groups), all attempts.
        resumedTraces: queued samples restored from snapshots, all attempts.
        resumedEpisodes: finished episodes kept in open groups, all attempts.
        lastResume: the newest attempt's resume report.
        progress: how far the run is, with an ETA from the recent step rate (:class:`Progress`).
        rolloutEndpoints: ready rollout servers the orchestrator was given.
        queue: the Kueue queue and Workload of a run labelled ``kueue.x-k8s.io/queue-name`` (:class:`QueueStatus`).
        rolloutReplicas: rollout pods the current attempt was created with (a spec change applies
            from the next attempt; a pod missing below this count is replaced).
        message: one line on the current state.
    """

    model_config = ConfigDict(extra="forbid")

    phase: Literal[PHASES] | None = Field(default=None, description=f"{_one_of(PHASES)}.")
    observedGeneration: int | None = Field(default=None, ge=0)
    attempt: int | None = Field(default=None, ge=0)
    step: int | None = Field(default=None, ge=0)
    maxSteps: int | None = Field(default=None, ge=0)
    policyVersion: int | None = Field(default=None, ge=0)
    lastCheckpointStep: int | None = Field(default=None, ge=0)
    preemptions: int | None = Field(default=None, ge=0)
    suspensions: int | None = Field(default=None, ge=0)
    failures: int | None = Field(default=None, ge=0)
    recovery: Recovery | None = None
    failedNodes: list[str] = Field(default_factory=list, max_length=64)
    deletedPods: list[str] = Field(default_factory=list, max_length=256)
    resumedGroups: int | None = Field(default=None, ge=0)
    resumedTraces: int | None = Field(default=None, ge=0)
    resumedEpisodes: int | None = Field(default=None, ge=0)
    lastResume: LastResume | None = None
    progress: Progress | None = None
    rolloutEndpoints: int | None = Field(default=None, ge=0)
    rolloutReplicas: int | None = Field(default=None, ge=0)
    queue: QueueStatus | None = None
    message: str | None = None
    conditions: list[Condition] = Field(
        default_factory=list, max_length=16, description=f"at most one of each type: {_one_of(CONDITION_TYPES)}."
    )
