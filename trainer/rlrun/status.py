"""``RLRun.status``: what the operator reports (Kubernetes naming: camelCase, conditions).

Written only by the operator (``rlrun_operator.status``) through the ``status``
subresource; the CRD's status schema is generated from these models. Steps count
shipped batches; ``resumed*`` fields add up every attempt's resume report.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

#: Lifecycle phases, in the order a run normally goes through them.
PHASES = ("Pending", "Running", "Suspended", "Succeeded", "Failed")
#: Condition types the operator maintains.
CONDITION_TYPES = ("Ready", "Progressing", "Degraded", "Failed", "Succeeded")


class Condition(BaseModel):
    """A condition in the Kubernetes shape (``metav1.Condition``).

    Attributes:
        type: one of Ready, Progressing, Degraded, Failed, Succeeded.
        status: True, False or Unknown.
        reason: CamelCase machine-readable reason.
        message: what happened, for people.
        lastTransitionTime: when ``status`` last changed (RFC 3339).
        observedGeneration: the RLRun generation the condition was computed from.
    """

    model_config = ConfigDict(extra="forbid")

    type: str = Field(min_length=1, max_length=316)
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(min_length=1, max_length=1024, pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
    message: str = Field(default="", max_length=32768)
    lastTransitionTime: str = Field(json_schema_extra={"format": "date-time"})
    observedGeneration: int | None = Field(default=None, ge=0)


class ResumeReport(BaseModel):
    """What one attempt's orchestrator restored from a snapshot.

    Attributes:
        attempt: the attempt that resumed.
        fromStep: the checkpoint step it resumed from.
        groups: open rollout groups restored (their finished episodes kept).
        queuedTraces: queued samples restored.
        finishedEpisodes: finished episodes of open groups kept.
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
        phase: Pending, Running, Suspended, Succeeded or Failed.
        observedGeneration: the RLRun generation last acted on.
        attempt: current attempt (0 first; +1 on every restart of the pods).
        step: batches shipped to the trainer.
        maxSteps: the step the run ends at.
        policyVersion: weights version the rollout servers hold.
        lastCheckpointStep: newest complete checkpoint.
        preemptions: attempts ended by a preemption.
        resumedGroups: open rollout groups restored from snapshots, all attempts.
        resumedTraces: queued samples restored from snapshots, all attempts.
        resumedEpisodes: finished episodes of open groups kept, all attempts.
        lastResume: the newest attempt's resume report.
        rolloutEndpoints: ready rollout servers the orchestrator was given.
        message: one line on the current state.
        conditions: Ready, Progressing, Degraded, Failed, Succeeded.
    """

    model_config = ConfigDict(extra="forbid")

    phase: Literal["Pending", "Running", "Suspended", "Succeeded", "Failed"] | None = None
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
    lastResume: ResumeReport | None = None
    rolloutEndpoints: int | None = Field(default=None, ge=0)
    message: str | None = None
    conditions: list[Condition] = Field(default_factory=list, max_length=16)
