"""The ``RLRun`` spec: pydantic models, the single source of truth for a run's settings.

The same YAML document is what ``kubectl apply`` takes and what ``rlrun local``
runs: a Kubernetes object with ``apiVersion``, ``kind: RLRun``, ``metadata`` and
``spec``. These are the models only; reading a manifest, checking its envs and
naming every bad field by its path (``spec.group_size: must be ≥ 2``) is
:mod:`rlrun.manifest`.

Units: steps are optimizer steps (one shipped batch each); sizes count samples
(one sample = one completion = one episode); ``max_tokens`` counts tokens.

Some settings only matter on Kubernetes (``suspend``, ``storage``, ``scheduling``, the
roles' ``image``/``resources``/``gpus``/``volumes``/``env``); ``rlrun local`` accepts and ignores
them, so one manifest serves both (local processes see this machine's files and environment).
The CRD's schema is generated from these models (:mod:`rlrun.api.crd`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from rlrun.api.algorithm import AdvantageSpec, LossSpec, OptimizerSpec, SamplingSpec
from rlrun.api.curriculum import CurriculumSpec
from rlrun.api.lora import LORA_CEL_RULES, LoraSpec
from rlrun.api.role_specs import OrchestratorSpec, RolloutSpec, TrainerSpec
from rlrun.api.run_settings import (
    CheckpointSpec,
    EvaluationSpec,
    FailurePolicySpec,
    PreemptionSpec,
    SchedulingSpec,
    StorageSpec,
    WeightsSpec,
)
from rlrun.api.strict import Strict
from rlrun.api.tracking import LoggingSpec

API_GROUP = "rlrun.dev"
API_VERSION = "v1alpha1"
KIND = "RLRun"

#: Models built here, no download (:mod:`rlrun.model.resolve`): ``tiny-reverse`` (reverse-text's) and ``tiny``
#: (built for the run's envs).
BUILTIN_MODELS = ("tiny-reverse", "tiny")
#: Longest ``metadata.name`` of an RLRun, and its pattern (a DNS-1035 label; see :class:`ObjectMeta`).
MAX_NAME_LENGTH = 50
NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"


class ModelSpec(Strict):
    """Which policy to train: exactly one of ``builtin`` or ``name``.

    ``builtin: tiny-reverse`` is built and warm-started by ``rlrun model init`` on
    whatever machine needs it (deterministic, no download). ``builtin: tiny`` is the
    same kind of model built for the run's envs: a chat tokenizer, and a warm start
    on the envs' own answers (``rlrun model init --manifest``). ``name`` is a Hugging
    Face model id or a local directory, loaded by the standard transformers / vLLM
    code (needs network or a pre-filled cache).

    Attributes:
        lora: train a LoRA adapter on the frozen model (:class:`LoraSpec`); absent: train every weight.
    """

    builtin: Literal["tiny-reverse", "tiny"] | None = None
    name: str | None = Field(default=None, min_length=1)
    revision: str | None = None
    lora: LoraSpec | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> ModelSpec:
        if (self.builtin is None) == (self.name is None):
            raise ValueError("set exactly one of builtin or name")
        if self.builtin is not None and self.revision is not None:
            raise ValueError("revision applies to name, not builtin")
        return self

    @property
    def identity(self) -> str:
        """A stable string naming the model (used to check a checkpoint belongs to this run)."""
        if self.builtin is not None:
            return f"builtin:{self.builtin}"
        return f"{self.name}@{self.revision or 'main'}"


#: CEL rules by the path of the ``spec.model`` object they sit on (``()`` = ``spec.model``), repeating
#: the pydantic validators above (a LoRA adapter's: :mod:`rlrun.api.lora`): :mod:`rlrun.api.crd` adds them.
MODEL_CEL_RULES: dict[tuple[str, ...], list[dict[str, str]]] = {
    (): [
        {
            "rule": "has(self.builtin) != has(self.name)",
            "message": "set exactly one of model.builtin or model.name",
        },
        {
            "rule": "!has(self.builtin) || !has(self.revision)",
            "message": "model.revision applies to model.name, not model.builtin",
            "fieldPath": ".revision",
        },
        {
            "rule": "self == oldSelf",
            "message": "model is immutable: checkpoints of this run belong to it (create a new RLRun)",
        },
    ],
    ("lora",): LORA_CEL_RULES,
}


#: Builtin rewards that run in worker processes unless their ``isolation`` says ``thread``: math-verify
#: parses and evaluates what the policy writes: a giant exponent (``$10^{10^{7}}$``) holds the GIL seconds.
PROCESS_REWARDS = ("math",)


class RewardSpec(Strict):
    """One reward function of an env: a builtin one by ``name`` or any callable by ``function``.

    A reward function follows TRL ``GRPOTrainer``'s convention (sync or async): called once per group
    with ``prompts``, ``completions``, ``completion_ids`` and every other task field (``answer``, a
    dataset's other columns) as keyword arguments, one list item per completion; returns one score per
    completion (:mod:`rlrun.rewards`).

    Attributes:
        name: a builtin reward (``exact``, ``math``, ``lcs``, ``regex``: :data:`rlrun.rewards.BUILTIN_REWARDS`).
        function: an import path ``package.module:attr`` to a reward function.
        weight: the episode's reward is Σ weight · score over the env's rewards.
        args: keyword arguments of a builtin reward (``regex``: ``pattern``).
        label: the name of its series in ``metrics.jsonl`` (``reward/<label>``); default: ``name``, or
            ``attr`` of ``function``.
        isolation: where it runs: ``process`` (a worker process, killed at the env's
            ``reward_timeout_seconds``: a reward that computes cannot stall the orchestrator) or ``thread``
            (a thread of the orchestrator: no start or pickling cost, module state shared with the env).
            Default: ``process`` for the builtin ``math``, ``thread`` for the other builtins and for a
            ``function`` (``docs/envs.md``, "Where rewards run").
    """

    name: str | None = Field(default=None, min_length=1)
    function: str | None = Field(default=None, pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
    weight: float = Field(default=1.0, strict=False)
    args: dict[str, Any] = Field(default_factory=dict)
    label: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.-]+$")
    isolation: Literal["thread", "process"] | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> RewardSpec:
        if (self.name is None) == (self.function is None):
            raise ValueError("set exactly one of name (a builtin reward) or function (an import path module:attr)")
        if self.function is not None and self.args:
            raise ValueError("args apply to a builtin reward (name), not to a function")
        return self

    @property
    def series(self) -> str:
        """Its name in metrics: ``label``, else ``name``, else the function's ``attr``."""
        return self.label or self.name or str(self.function).rsplit(":", 1)[1].rsplit(".", 1)[-1]

    @property
    def in_process(self) -> bool:
        """Whether it runs in a worker process: as ``isolation`` says, else if it is a builtin of
        :data:`PROCESS_REWARDS`."""
        return self.isolation == "process" if self.isolation is not None else self.name in PROCESS_REWARDS


#: CEL rules on each ``spec.envs[].rewards[]`` (:mod:`rlrun.api.crd`): :class:`RewardSpec`'s validator above.
REWARD_CEL_RULES: list[dict[str, str]] = [
    {
        "rule": "has(self.name) != has(self.function)",
        "message": "set exactly one of name (a builtin reward) or function (an import path module:attr)",
    },
    {
        "rule": "!has(self.function) || !has(self.args) || size(self.args) == 0",
        "message": "args apply to a builtin reward (name), not to a function",
        "fieldPath": ".args",
    },
]


class EnvSpec(Strict):
    """One environment the run samples tasks from.

    Attributes:
        name: a builtin env (``reverse-text``, ``dataset``, ``reasoning-gym``), an env an installed package
            registers (entry point group ``rlrun.envs``; ``rlrun envs`` lists them), or an import path
            ``package.module:attr`` to an env class or factory.
        weight: relative sampling weight among the run's envs.
        args: keyword arguments for the env's constructor.
        rewards: reward functions replacing the env's own reward (empty: the env's own).
        reward_timeout_seconds: most time one group's rewards may take; longer marks its episodes failed.
    """

    name: str = Field(min_length=1)
    weight: float = Field(default=1.0, gt=0)
    args: dict[str, Any] = Field(default_factory=dict)
    rewards: list[RewardSpec] = Field(default_factory=list, max_length=16)
    reward_timeout_seconds: float = Field(default=60.0, gt=0, le=3600, strict=False)

    @field_validator("rewards")
    @classmethod
    def _unique_reward_series(cls, rewards: list[RewardSpec]) -> list[RewardSpec]:
        series = [r.series for r in rewards]
        dups = sorted({s for s in series if series.count(s) > 1})
        if dups:
            raise ValueError(f"two rewards would log as reward/{dups[0]}: give them distinct labels")
        return rewards


class RLRunSpec(Strict):
    """``RLRun.spec``: everything that defines a training run.

    Attributes:
        max_zero_spread_groups: groups since the last batch whose members all got the same reward (no gradient) at
            which the run stops, ``NoLearningSignal`` (a warning at a fifth). Unset: 50 × batch_size / group_size.
        suspend: ``true`` (Kueue's convention) has the operator pause the orchestrator (a snapshot is written)
            and remove the pods; ``false`` again starts the next attempt from that snapshot.
    """

    model: ModelSpec
    envs: list[EnvSpec] = Field(min_length=1, max_length=64)
    group_size: int = Field(default=8, ge=2)
    batch_size: int = Field(default=64, ge=2)
    max_off_policy_steps: int = Field(default=1, ge=0)
    max_steps: int = Field(default=100, ge=1)
    max_zero_spread_groups: int | None = Field(default=None, ge=1, le=100_000_000)
    seed: int = Field(default=0, ge=0)
    sampling: SamplingSpec = Field(default_factory=SamplingSpec)
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec)
    loss: LossSpec = Field(default_factory=LossSpec)
    advantage: AdvantageSpec = Field(default_factory=AdvantageSpec, validate_default=True)  # reads loss's alias
    curriculum: CurriculumSpec = Field(default_factory=CurriculumSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    evaluation: EvaluationSpec = Field(default_factory=EvaluationSpec)
    logging: LoggingSpec = Field(default_factory=LoggingSpec)
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    weights: WeightsSpec = Field(default_factory=WeightsSpec)
    preemption: PreemptionSpec = Field(default_factory=PreemptionSpec)
    failure_policy: FailurePolicySpec = Field(default_factory=FailurePolicySpec)
    orchestrator: OrchestratorSpec = Field(default_factory=OrchestratorSpec)
    trainer: TrainerSpec = Field(default_factory=TrainerSpec)
    storage: StorageSpec = Field(default_factory=StorageSpec)
    scheduling: SchedulingSpec = Field(default_factory=SchedulingSpec)
    suspend: bool = False

    # Cross-field rules are validators of the later field, so errors name it (fields validate in order).
    @field_validator("batch_size")
    @classmethod
    def _batch_holds_groups(cls, batch_size: int, info: ValidationInfo) -> int:
        group_size = info.data.get("group_size")
        if group_size is not None and batch_size < group_size:
            raise ValueError(f"must be ≥ group_size ({group_size}): a batch holds whole groups, got {batch_size}")
        return batch_size

    @field_validator("optimizer")
    @classmethod
    def _warmup_ends_before_the_last_step(cls, optimizer: OptimizerSpec, info: ValidationInfo) -> OptimizerSpec:
        max_steps = info.data.get("max_steps")
        if max_steps is not None and optimizer.warmup_steps >= max_steps:
            raise ValueError(
                f"warmup_steps ({optimizer.warmup_steps}) must be < max_steps ({max_steps}): the warmup ends before "
                "the last step"
            )
        return optimizer

    @field_validator("advantage")
    @classmethod
    def _read_the_deprecated_alias(cls, advantage: AdvantageSpec, info: ValidationInfo) -> AdvantageSpec:
        # spec.loss.std_normalize_advantages (before issue 38) is read into advantage.std_normalize; both set and
        # different is refused (a run must not depend on which of the two wins).
        loss = info.data.get("loss")
        alias = loss.std_normalize_advantages if loss is not None else None
        if alias is None:
            return advantage
        if "std_normalize" in advantage.model_fields_set:
            if advantage.std_normalize != alias:
                raise ValueError(
                    f"std_normalize is {str(advantage.std_normalize).lower()} but loss.std_normalize_advantages, its "
                    f"deprecated alias, is {str(alias).lower()}: set only advantage.std_normalize"
                )
            return advantage
        return advantage.model_copy(update={"std_normalize": alias})

    @property
    def deprecations(self) -> list[str]:
        """One sentence per deprecated field the manifest sets, saying what to set instead (printed by ``rlrun
        validate`` and ``rlrun local``, logged by the orchestrator); empty when none."""
        alias = self.loss.std_normalize_advantages
        if alias is None:
            return []
        return [
            f"spec.loss.std_normalize_advantages is deprecated: it now sets spec.advantage.std_normalize "
            f"({str(alias).lower()}); write that instead"
        ]

    @field_validator("envs")
    @classmethod
    def _unique_env_names(cls, envs: list[EnvSpec]) -> list[EnvSpec]:
        names = [e.name for e in envs]
        if len(set(names)) != len(names):
            raise ValueError(f"names must be unique, got {names}")
        return envs

    @field_validator("rollout")
    @classmethod
    def _inflight_holds_a_group(cls, rollout: RolloutSpec, info: ValidationInfo) -> RolloutSpec:
        group_size = info.data.get("group_size")
        if group_size is not None and rollout.max_inflight < group_size:
            raise ValueError(
                f"max_inflight ({rollout.max_inflight}) must be ≥ group_size ({group_size}): "
                "a group is requested at once"
            )
        return rollout

    @field_validator("weights")
    @classmethod
    def _adapters_stay_on_files(cls, weights: WeightsSpec, info: ValidationInfo) -> WeightsSpec:
        model = info.data.get("model")
        if weights.transport == "collective" and model is not None and model.lora is not None:
            raise ValueError(
                "transport collective cannot be used with model.lora: a LoRA run's adapters reach the rollout "
                "servers through the file system (set weights.transport: filesystem, or drop model.lora)"
            )
        return weights


#: CEL rules by the path of the ``spec`` object they sit on (``()`` = ``spec``), repeating
#: :class:`RLRunSpec`'s validators and :class:`RewardSpec`'s (:mod:`rlrun.api.crd` adds them, with those
#: of the modules composed here). Defaults are applied before validation, so defaulted fields exist;
#: ``has()`` guards the optional ones anyway.
RUN_CEL_RULES: dict[tuple[str, ...], list[dict[str, str]]] = {
    (): [
        {
            "rule": "self.group_size >= 2",
            "message": "group_size must be ≥ 2: GRPO advantages compare the members of a group",
            "fieldPath": ".group_size",
        },
        {
            "rule": "self.batch_size >= self.group_size",
            "message": "batch_size must be ≥ group_size: a batch holds whole groups",
            "fieldPath": ".batch_size",
        },
        {
            "rule": "!has(self.rollout) || self.rollout.max_inflight >= self.group_size",
            "message": "rollout.max_inflight must be ≥ group_size: a group is requested at once",
            "fieldPath": ".rollout.max_inflight",
        },
        {
            "rule": "!has(self.optimizer) || !has(self.optimizer.warmup_steps) || "
            "self.optimizer.warmup_steps < self.max_steps",
            "message": "optimizer.warmup_steps must be < max_steps: the warmup ends before the last step",
            "fieldPath": ".optimizer.warmup_steps",
        },
        {
            # advantage.std_normalize has no default in the CRD, so has() tells whether the user set it
            "rule": "!has(self.loss) || !has(self.loss.std_normalize_advantages) || !has(self.advantage) || "
            "!has(self.advantage.std_normalize) || self.loss.std_normalize_advantages == self.advantage.std_normalize",
            "message": "advantage.std_normalize and loss.std_normalize_advantages, its deprecated alias, disagree: "
            "set only advantage.std_normalize",
            "fieldPath": ".advantage.std_normalize",
        },
        {
            "rule": "!has(self.weights) || !has(self.weights.transport) || self.weights.transport != 'collective' || "
            "!has(self.model.lora)",
            "message": "weights.transport collective cannot be used with model.lora: a LoRA run's adapters reach the "
            "rollout servers through the file system",
            "fieldPath": ".weights.transport",
        },
    ],
    ("envs", "[]", "rewards", "[]"): REWARD_CEL_RULES,
}


#: The CEL rule repeating :class:`ObjectMeta`'s ``name`` (on the manifest's root: the CRD cannot constrain
#: ``metadata`` itself), so ``kubectl apply`` refuses what ``rlrun validate`` refuses, with the same reason.
NAME_CEL_RULES: list[dict[str, str]] = [
    {
        "rule": f"size(self.metadata.name) <= {MAX_NAME_LENGTH} && self.metadata.name.matches('{NAME_PATTERN}')",
        "message": f"metadata.name must be a DNS-1035 label (lower-case letters, digits, '-', starting with a letter) "
        f"of at most {MAX_NAME_LENGTH} characters: the run's Service is named <name>-orchestrator",
        "fieldPath": ".metadata.name",
    }
]


class ObjectMeta(BaseModel):
    """The part of Kubernetes ``metadata`` that rlrun reads; other keys are kept as given."""

    model_config = ConfigDict(extra="allow", frozen=True)

    # ≤ 50 characters starting with a letter: the orchestrator Service is named "<name>-orchestrator",
    # which must be a DNS-1035 label of at most 63 characters.
    name: str = Field(min_length=1, max_length=MAX_NAME_LENGTH, pattern=NAME_PATTERN)
    namespace: str | None = None


class RLRun(Strict):
    """A whole ``RLRun`` manifest."""

    apiVersion: Literal["rlrun.dev/v1alpha1"]
    kind: Literal["RLRun"]
    metadata: ObjectMeta
    spec: RLRunSpec
    status: dict[str, Any] | None = None
