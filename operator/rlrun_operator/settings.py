"""Operator settings, read from ``RLRUN_OPERATOR_*`` environment variables (the Helm chart sets them)."""

from __future__ import annotations

import os

from pydantic import BaseModel, ConfigDict, Field

ENV_PREFIX = "RLRUN_OPERATOR_"

#: Taints Kubernetes itself puts on a node that is cordoned, failing or shut down (always watched).
NODE_TAINTS = (
    "node.kubernetes.io/unschedulable",
    "node.kubernetes.io/not-ready",
    "node.kubernetes.io/unreachable",
    "node.kubernetes.io/out-of-service",
)
#: Taints that announce a node's end on common clouds and autoscalers (the default of ``disruption_taints``):
#: Karpenter's disruption (v1 and earlier), the AWS Node Termination Handler's spot, rebalance, ASG and
#: maintenance notices, GKE's spot/preemptible node shutdown, and the cluster autoscaler's scale-down.
DEFAULT_DISRUPTION_TAINTS = (
    "karpenter.sh/disrupted",
    "karpenter.sh/disruption",
    "aws-node-termination-handler/spot-itn",
    "aws-node-termination-handler/rebalance-recommendation",
    "aws-node-termination-handler/asg-lifecycle-termination",
    "aws-node-termination-handler/scheduled-maintenance",
    "cloud.google.com/impending-node-termination",
    "ToBeDeletedByClusterAutoscaler",
)


class OperatorSettings(BaseModel):
    """How the operator builds pods and how often it looks at runs.

    Attributes:
        trainer_image: default image of the orchestrator and trainer pods (a role's ``image`` overrides).
        rollout_image: default image of the rollout (vLLM) pods.
        image_pull_policy: ``imagePullPolicy`` of every container it creates.
        image_pull_secrets: names of Secrets (in each run's namespace) its pods pull images with;
            from the environment as a comma-separated list.
        status_interval_seconds: how often each run's orchestrator ``/status`` is polled, seconds.
        orchestrator_url: template of the orchestrator control URL; ``{name}`` and ``{namespace}``
            are the RLRun's, ``{service}`` the control Service's name.
        request_timeout_seconds: timeout of one control-server request, seconds.
        disruption_taints: node taint keys that mean "this node is going away" (spot termination
            notices, autoscaler disruption), on top of Kubernetes' own (:data:`NODE_TAINTS`); from
            the environment as a comma-separated list, which replaces the defaults.
        force_delete_after_seconds: seconds after a pod's deletion grace period ended before a pod
            still terminating on a NotReady, unreachable or deleted node is force-deleted (grace 0).
        kueue_enabled: runs labelled ``kueue.x-k8s.io/queue-name`` are admitted by Kueue through a Workload the
            operator owns (``rlrun_operator.kueue``); off, such a run is held with a Warning (never run unqueued).
            From the environment: ``true``/``false``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    trainer_image: str = "ghcr.io/rlrun/rlrun-trainer:0.1.0"
    rollout_image: str = "ghcr.io/rlrun/rlrun-rollout:0.1.0"
    image_pull_policy: str = Field(default="IfNotPresent", pattern="^(Always|IfNotPresent|Never)$")
    image_pull_secrets: tuple[str, ...] = ()
    status_interval_seconds: float = Field(default=5.0, gt=0)
    orchestrator_url: str = "http://{service}.{namespace}.svc:8080"
    request_timeout_seconds: float = Field(default=5.0, gt=0)
    disruption_taints: tuple[str, ...] = DEFAULT_DISRUPTION_TAINTS
    force_delete_after_seconds: float = Field(default=60.0, ge=0)
    kueue_enabled: bool = False

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> OperatorSettings:
        """Settings from ``RLRUN_OPERATOR_<FIELD>`` variables (e.g. ``RLRUN_OPERATOR_TRAINER_IMAGE``).

        Raises:
            pydantic.ValidationError: a variable with a value of the wrong type.
        """
        env = os.environ if environ is None else environ
        values: dict[str, object] = {}
        for field, info in cls.model_fields.items():
            raw = env.get(ENV_PREFIX + field.upper())
            if raw is None:
                continue
            is_list = info.annotation is not None and "tuple" in str(info.annotation)
            values[field] = tuple(v.strip() for v in raw.split(",") if v.strip()) if is_list else raw
        return cls.model_validate(values)
