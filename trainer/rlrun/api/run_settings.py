"""How a run is kept and placed (``spec.evaluation``, ``spec.checkpoint``, ``spec.preemption``,
``spec.failure_policy``, ``spec.storage``, ``spec.scheduling``, ``spec.weights``): the run's settings around its
algorithm and roles.

Composed into :class:`rlrun.api.spec.RLRunSpec`; the CEL rules for the API server sit beside the models
(:data:`PREEMPTION_CEL_RULES`, repeating a validator; :data:`STORAGE_CEL_RULES`, which has no pydantic twin:
only the API server sees a change), and :mod:`rlrun.api.crd` adds them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator

from rlrun.api.pod_inputs import DNS_LABEL_PATTERN, Quantity
from rlrun.api.strict import Strict


class EvaluationSpec(Strict):
    """Evaluation on each env's held-out ``eval`` split (:mod:`rlrun.orchestrator.evaluation`): at the start,
    every ``interval`` steps and at the end, greedy (temperature 0) and sampled (the run's sampling, ``k =
    samples_per_task`` completions per task: mean reward and pass@k) on ``tasks`` held-out tasks per env, on the
    rollout servers. Never trained, never in the ledger; results in ``<run_dir>/eval.jsonl``. Off unless
    ``enabled`` (as in TRL, verl and prime-rl: it costs rollout time; the examples turn it on). A round not
    answered within ``timeout_seconds`` is skipped."""

    enabled: bool = False
    interval: int = Field(default=20, ge=1)
    tasks: int = Field(default=100, ge=1, le=100_000)
    samples_per_task: int = Field(default=1, ge=1, le=64)
    timeout_seconds: float = Field(default=300.0, gt=0)


class CheckpointSpec(Strict):
    """Checkpoint cadence (``interval`` steps) and retention (the ``keep_last`` newest complete ones)."""

    interval: int = Field(default=10, ge=1)
    keep_last: int = Field(default=2, ge=1)


class PreemptionSpec(Strict):
    """How a run is stopped for preemption.

    Attributes:
        snapshot_timeout_seconds: most time the orchestrator spends after SIGTERM pausing, writing its
            snapshot and pairing it with the trainer's save on notice (it waits for the trainer to stop,
            until 10 % of this before the end) before it exits anyway (files stay consistent either way).
        termination_grace_period_seconds: the pods' grace period; must exceed the snapshot timeout.
    """

    snapshot_timeout_seconds: int = Field(default=60, ge=1)
    termination_grace_period_seconds: int = Field(default=120, ge=1)

    @field_validator("termination_grace_period_seconds")
    @classmethod
    def _grace_fits_timeout(cls, grace: int, info: ValidationInfo) -> int:
        timeout = info.data.get("snapshot_timeout_seconds")
        if timeout is not None and timeout >= grace:
            raise ValueError(
                f"must be > snapshot_timeout_seconds ({timeout}): the snapshot must be written before the "
                f"kubelet kills the pod, got {grace}"
            )
        return grace


#: CEL rules on ``spec.preemption`` (:mod:`rlrun.api.crd`): the grace period's validator above.
PREEMPTION_CEL_RULES: list[dict[str, str]] = [
    {
        "rule": "self.snapshot_timeout_seconds < self.termination_grace_period_seconds",
        "message": "termination_grace_period_seconds must be > snapshot_timeout_seconds: "
        "the snapshot must be written before the kubelet kills the pod",
        "fieldPath": ".termination_grace_period_seconds",
    },
]


class FailurePolicySpec(Strict):
    """How many crashes a run survives on Kubernetes (JobSet's ``failurePolicy``, Job's ``backoffLimit``).

    A failure is a pod that ends ``Failed`` for a reason of its own (a crash, ``OOMKilled``): the
    operator restarts the attempt from the newest complete checkpoint and counts it in
    ``status.failures``. Preemptions (a pod disrupted or deleted, its node lost or tainted) and
    suspensions never count. Errors that retrying cannot heal (a manifest or checkpoint that does
    not match, weights that do not fit the model: the process exits 78 and says so) fail the run
    at once, whatever the budget.

    Attributes:
        backoff_limit: failures restarted before the run ends ``Failed`` with reason
            ``BackoffLimitExceeded`` (0: the first failure ends it).
    """

    backoff_limit: int = Field(default=3, ge=0, le=1000)


class StorageSpec(Strict):
    """The volume holding the run directory (checkpoints, batches, broadcasts, ledger, logs).

    Every pod of a run mounts it, so pods on different nodes need ``ReadWriteMany``.

    Attributes:
        size: capacity of the claim the operator creates.
        storage_class_name: its storage class (None: the cluster's default).
        access_modes: its access modes.
        existing_claim: use this PersistentVolumeClaim (in the run's namespace) instead of
            creating one; it is never deleted by the operator.
        retention_policy: what happens to a created claim when the RLRun is deleted:
            ``Retain`` (default: the run directory outlives the RLRun) or ``Delete``.
    """

    size: Quantity = "20Gi"
    storage_class_name: str | None = Field(default=None, min_length=1)
    access_modes: list[Literal["ReadWriteMany", "ReadWriteOnce", "ReadWriteOncePod"]] = Field(
        default_factory=lambda: ["ReadWriteMany"], min_length=1, max_length=3
    )
    existing_claim: str | None = Field(default=None, max_length=253, pattern=DNS_LABEL_PATTERN)
    retention_policy: Literal["Retain", "Delete"] = "Retain"


#: CEL rules on ``spec.storage`` (:mod:`rlrun.api.crd`): immutable, an update of the RLRun only.
STORAGE_CEL_RULES: list[dict[str, str]] = [
    {
        "rule": "self == oldSelf",
        "message": "storage is immutable: the run directory lives on it (create a new RLRun)",
    },
]


class WeightsSpec(Strict):
    """How each policy version reaches the rollout servers (issue 50; ``docs/design.md``, "Weights in memory").

    Attributes:
        transport: ``filesystem``: every server reloads the version's broadcast from the run directory;
            ``collective``: the trainer's rank 0 sends the version it holds in memory to each server over a
            collective (gloo on CPUs, through vLLM's weight-transfer API), the broadcast still written
            (checkpoints, catch-up) and reloaded from on any failure. Each update is verified either way. Not with
            ``spec.model.lora`` (adapters stay on the file system). May change across a resume.
        timeout_seconds: most time one in-memory round of one server may take (rendezvous, send, load) before the
            server falls back to the file system.
    """

    transport: Literal["filesystem", "collective"] = "filesystem"
    timeout_seconds: float = Field(default=120.0, gt=0, le=3600, strict=False)


class SchedulingSpec(Strict):
    """Where the run's pods may go: passed through to every pod unchanged (Kubernetes' own shapes)."""

    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[dict[str, Any]] = Field(default_factory=list)
    affinity: dict[str, Any] | None = None
    priority_class_name: str | None = Field(default=None, pattern=DNS_LABEL_PATTERN)
