"""The roles' settings of the ``RLRun`` spec: how each process runs (``spec.orchestrator``, ``spec.trainer``,
``spec.rollout``) — its pods on Kubernetes (image, resources, GPUs, volumes, env) and its own knobs (the trainer's
ranks, precision and micro-batches; the rollout servers' count, vLLM settings and request handling).

Composed into :class:`rlrun.api.spec.RLRunSpec`; ``rlrun local`` ignores the pod settings.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationInfo, field_validator

from rlrun.api.pod_inputs import EnvVars, ResourcesSpec, Volumes
from rlrun.api.strict import Strict
from rlrun.api.vllm_args import VllmArgs


class RoleSpec(Strict):
    """How the operator runs one role's pods (ignored by ``rlrun local``).

    Attributes:
        image: container image; None: the operator's default for the role.
        resources: CPU / memory requests and limits.
        gpus: ``nvidia.com/gpu`` requested and limited per pod (0: a CPU pod).
        volumes: the user's volumes mounted into the role's pods (a dataset's claim, a ConfigMap, a Secret).
        env: environment variables of the role's container, after rlrun's own (:mod:`rlrun.api.pod_inputs`).
    """

    image: str | None = Field(default=None, min_length=1)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    gpus: int = Field(default=0, ge=0, le=16)
    volumes: Volumes = Field(default_factory=list)
    env: EnvVars = Field(default_factory=list)


class OrchestratorSpec(RoleSpec):
    """The orchestrator pod (CPU only: it samples, scores and queues)."""

    gpus: int = Field(default=0, ge=0, le=0)


class TrainerSpec(RoleSpec):
    """The trainer: ``nodes`` pods (one per node) of ``processes_per_node`` ranks each.

    ``1 × 1`` (default): one pod, one ``rlrun trainer``; larger: ``torchrun`` runs ``nodes × processes_per_node``
    data-parallel ranks (FSDP), on Kubernetes one pod per node (``gpus`` each), restarted together when any is lost.
    A change takes effect at the next attempt (a trainer replaced within an attempt keeps its group's node count).

    Attributes:
        nodes: trainer pods, one per node (1: a single pod, no rendezvous Service).
        processes_per_node: ranks (``torchrun --nproc-per-node``) in each trainer pod, one per GPU; at most ``gpus``
            when the pod has GPUs (two ranks on one GPU is an NCCL error), any number of CPU (gloo) ranks otherwise.
        precision: compute dtype, ``bfloat16`` (float32 master weights and optimizer state) or ``float32``; ``auto``:
            bf16 on a GPU that has it, else float32 (bf16 missing: float32, warned). vLLM serves the same dtype.
        micro_batch_tokens: token slots (padding included) per micro-batch and rank: rows are cut by length (packed
            where the attention allows), gradients summed into one step with the batch's normalisation; sets the
            activation memory. A longer sample is trained alone, never cut. A GPU takes 16k–32k (default: a CPU's).
        logprob_chunk_tokens: LM-head positions computed at once (a few ``[chunk, vocab]`` float32 tensors; GPU: 1k–4k).
        activation_checkpointing: recompute block activations in the backward: less memory, ~⅓ more compute.
    """

    nodes: int = Field(default=1, ge=1, le=256)
    processes_per_node: int = Field(default=1, ge=1, le=16)
    precision: Literal["auto", "float32", "bfloat16"] = "auto"
    micro_batch_tokens: int = Field(default=4096, ge=16, le=1_048_576)
    logprob_chunk_tokens: int = Field(default=128, ge=1, le=65_536)
    activation_checkpointing: bool = False

    @field_validator("processes_per_node")
    @classmethod
    def _one_gpu_per_process(cls, processes: int, info: ValidationInfo) -> int:
        if (gpus := info.data.get("gpus")) and processes > gpus:
            raise ValueError(
                f"must be ≤ gpus ({gpus}) when the trainer has GPUs: each rank takes one GPU, got {processes}"
            )
        return processes


#: CEL rules on ``spec.trainer`` (:mod:`rlrun.api.crd`, before the roles' own): :class:`TrainerSpec`'s
#: validator.
TRAINER_CEL_RULES: list[dict[str, str]] = [
    {
        "rule": "self.gpus == 0 || self.processes_per_node <= self.gpus",
        "message": "trainer.processes_per_node must be ≤ trainer.gpus when the trainer has GPUs: "
        "each rank takes one GPU",
        "fieldPath": ".processes_per_node",
    },
]


class RolloutSpec(RoleSpec):
    """Rollout servers (vLLM), one pod each on Kubernetes.

    Attributes:
        replicas: number of vLLM servers.
        max_inflight: most rollout requests (single completions) outstanding across all servers.
        gpus: GPUs per server (its pod's ``nvidia.com/gpu``), one tensor-parallel engine over all of them
            (vLLM's ``--tensor-parallel-size``); 0: a CPU server.
        kv_cache_gib: KV cache per server on CPU (``VLLM_CPU_KVCACHE_SPACE``), whole GiB.
        gpu_memory_utilization: share of each GPU's memory a server may take (weights, activations, the KV
            cache in the rest), vLLM's ``--gpu-memory-utilization``; lower it when something else shares the GPU.
        max_model_len: context length the server allocates for, in tokens (None: the model's).
        vllm_args: further vLLM server arguments, after rlrun's (``["--enable-prefix-caching",
            "--max-num-seqs", "128"]``); those rlrun sets itself (the model, address, dtype, parallelism,
            memory share, …: ``rlrun.api.vllm_args.OWNED``) are refused. vLLM's dtype is no setting of its
            own: it follows ``trainer.precision`` (``docs/design.md``, "Rollout servers on GPUs").
        members_per_request: members of a group sampled per completions request (None: the whole
            group in one request, fastest on vLLM-CPU; smaller values let members finish apart).
        request_timeout_seconds: most time one completions request may take on one server before
            it counts as failed there (a hung server, a straggler); raise it for long generations.
        retry_window_seconds: how long a failed request keeps being retried, on another server
            when there is one, before the request itself fails.
        max_group_retries: times the members of a group whose request failed are requested again
            (same task and group id) before the group is abandoned (counted, in the ledger).
        overlong_prompts: a prompt longer than the context less ``sampling.max_tokens``: ``filter`` skips its task
            (ledger ``task_dropped``, metrics ``prompts_too_long``), ``refuse`` stops the run (a dataset: at its start).
        max_mismatch_kl: the trainer–sampler mismatch a policy version may have, nats/token: the k3 KL of
            the servers' logprobs against the trainer's on the version's probe (``served_mismatch_kl`` in
            metrics.jsonl; ``docs/design.md``, "What the rollout servers serve"). One version above it warns,
            three in a row stop the run (``SamplerMismatch``); null: never stop. The same weights measure ≈ 0
            (3e-13 on vLLM-CPU in float32).
    """

    replicas: int = Field(default=1, ge=1, le=256)
    max_inflight: int = Field(default=256, ge=1)
    kv_cache_gib: int = Field(default=1, ge=1)
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1, strict=False)
    max_model_len: int | None = Field(default=None, ge=16)
    vllm_args: VllmArgs = Field(default_factory=list)
    members_per_request: int | None = Field(default=None, ge=1)
    request_timeout_seconds: int = Field(default=300, ge=1)
    retry_window_seconds: int = Field(default=120, ge=1)
    max_group_retries: int = Field(default=2, ge=0, le=100)
    overlong_prompts: Literal["filter", "refuse"] = "filter"
    max_mismatch_kl: float | None = Field(default=0.05, gt=0, strict=False)
