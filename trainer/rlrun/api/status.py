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

    PENDING = "Pending"  # an attempt's pods were created; its orchestrator is not running yet
    RUNNING = "Running"  # the orchestrator runs
    SUSPENDED = "Suspended"  # spec.suspend: the pods are removed, the snapshot kept
    SUCCEEDED = "Succeeded"  # the orchestrator exited 0: every step trained
    FAILED = "Failed"  # an invalid spec, or the orchestrator failed


#: Lifecycle phases, in the order a run normally goes through them.
PHASES = (Phase.PENDING, Phase.RUNNING, Phase.SUSPENDED, Phase.SUCCEEDED, Phase.FAILED)


class ConditionType:
    """``status.conditions[].type`` (``metav1.Condition``; at most one condition of each type).

    ``Preempted`` and ``Resumed`` are declared for the preemption protocol
    (``shared/ARCHITECTURE.md``) and not set yet.
    """

    READY = "Ready"  # the orchestrator runs and at least one rollout server is ready
    PROGRESSING = "Progressing"  # an attempt is starting or training
    DEGRADED = "Degraded"  # a pod of the attempt failed or is missing, or no rollout server is ready
    FAILED = "Failed"  # the run cannot go on (see the reason)
    SUCCEEDED = "Succeeded"  # every step trained
    PREEMPTED = "Preempted"  # an attempt ended by a preemption is being recovered
    RESUMED = "Resumed"  # the attempt resumed from a snapshot (its counts in lastResume)


#: Every condition type, in the order ``kubectl describe`` lists them once all are set.
CONDITION_TYPES = (
    ConditionType.READY,
    ConditionType.PROGRESSING,
    ConditionType.DEGRADED,
    ConditionType.FAILED,
    ConditionType.SUCCEEDED,
    ConditionType.PREEMPTED,
    ConditionType.RESUMED,
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
    ORCHESTRATOR_FAILED = "OrchestratorFailed"  # the orchestrator pod failed
    ORCHESTRATOR_UNREACHABLE = "OrchestratorUnreachable"  # GET /status got no (valid) answer
    POD_FAILED = "PodFailed"  # a pod of the attempt failed
    PODS_MISSING = "PodsMissing"  # the attempt lacks pods
    NO_ROLLOUT_ENDPOINTS = "NoRolloutEndpoints"  # the orchestrator runs and no rollout server is ready


class EventReason:
    """``reason`` of the Events the operator posts on an RLRun (``kubectl describe rlrun``)."""

    CREATED = "Created"  # an attempt's pods were created (attempt 0)
    RUNNING = Reason.RUNNING  # the orchestrator started running
    PAUSED = "Paused"  # the orchestrator paused and wrote its snapshot (the message has the counts)
    PAUSE_FAILED = "PauseFailed"  # the pause failed; the pods stop on SIGTERM anyway
    SUSPENDED = Reason.SUSPENDED  # the pods were removed for spec.suspend
    RESUMED = ConditionType.RESUMED  # the next attempt's pods were created to resume the run
    SPEC_UPDATED = "SpecUpdated"  # a spec change reaches the pods at the next attempt
    SPEC_FIXED = "SpecFixed"  # a refused spec became valid: the run is created now
    SUCCEEDED = Phase.SUCCEEDED
    FAILED = Phase.FAILED
    INVALID_SPEC = Reason.INVALID_SPEC  # a refused spec, or an invalid change that was ignored
    EXISTING_CLAIM = "ExistingClaim"  # the run's claim already existed and is used as it is


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
    """

    model_config = ConfigDict(extra="forbid")

    attempt: int = Field(ge=0)
    fromStep: int = Field(ge=0)
    groups: int = Field(ge=0)
    queuedTraces: int = Field(ge=0)
    finishedEpisodes: int = Field(ge=0)


class RLRunStatus(BaseModel):
    """The operator's view of a run.

    Attributes:
        observedGeneration: the RLRun generation last acted on.
        attempt: current attempt (0 first; +1 on every restart of the pods).
        step: batches shipped to the trainer.
        maxSteps: the step the run ends at.
        policyVersion: weights version the rollout servers hold.
        lastCheckpointStep: newest complete checkpoint.
        preemptions: attempts ended by a preemption.
        resumedGroups: rollout groups resumed from snapshots (open and requested groups), all attempts.
        resumedTraces: queued samples restored from snapshots, all attempts.
        resumedEpisodes: finished episodes kept in open groups, all attempts.
        lastResume: the newest attempt's resume report.
        rolloutEndpoints: ready rollout servers the orchestrator was given.
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
    resumedGroups: int | None = Field(default=None, ge=0)
    resumedTraces: int | None = Field(default=None, ge=0)
    resumedEpisodes: int | None = Field(default=None, ge=0)
    lastResume: LastResume | None = None
    rolloutEndpoints: int | None = Field(default=None, ge=0)
    message: str | None = None
    conditions: list[Condition] = Field(
        default_factory=list, max_length=16, description=f"at most one of each type: {_one_of(CONDITION_TYPES)}."
    )
