"""The RL algorithm's settings of the ``RLRun`` spec: sampling, the optimizer and its LR schedule, the loss, the
advantages.

Composed into :class:`rlrun.api.spec.RLRunSpec` (``spec.sampling``, ``spec.optimizer``, ``spec.loss``,
``spec.advantage``); each formula they select is in ``docs/algorithms.md`` with its source (code:
:mod:`rlrun.training.objectives`, :mod:`rlrun.training.schedule`, :mod:`rlrun.orchestrator.advantages`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator

from rlrun.api.strict import Strict


class SamplingSpec(Strict):
    """Rollout sampling parameters (OpenAI completions semantics)."""

    temperature: float = Field(default=1.0, gt=0, le=4)
    top_p: float = Field(default=1.0, gt=0, le=1)
    max_tokens: int = Field(default=24, ge=1, le=32768)


class OptimizerSpec(Strict):
    """AdamW settings of the trainer, and the schedule of its learning rate (see ``rlrun.training.schedule``).

    Attributes:
        lr: the learning rate: the peak of the schedule (reached after the warmup).
        betas: AdamW's (β1, β2).
        weight_decay: AdamW's decoupled weight decay.
        eps: AdamW's ε.
        max_grad_norm: each step's gradient is clipped to this global L2 norm.
        lr_schedule: ``constant`` (default), or ``linear`` / ``cosine`` decay after the warmup, from ``lr`` at the
            warmup's end to ``min_lr_ratio × lr`` at ``spec.max_steps`` (transformers'
            ``get_linear_schedule_with_warmup`` / ``get_cosine_with_min_lr_schedule_with_warmup``: step s trains
            with the factor at s − 1). ``rlrun local --max-steps`` only stops a run: the decay still ends at
            ``spec.max_steps`` (past it the rate stays at the floor).
        warmup_steps: steps of linear warmup from 0 to ``lr`` (0: none; the first warmup step trains at 0, as in
            transformers); must be < ``spec.max_steps``.
        min_lr_ratio: the floor of the decay, as a share of ``lr`` (``linear`` and ``cosine`` only).
    """

    lr: float = Field(default=3e-4, gt=0, le=1)
    betas: tuple[float, float] = Field(default=(0.9, 0.99), strict=False)  # YAML gives a list
    weight_decay: float = Field(default=0.0, ge=0)
    eps: float = Field(default=1e-8, gt=0)
    max_grad_norm: float = Field(default=1.0, gt=0)
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = Field(default=0, ge=0)
    min_lr_ratio: float = Field(default=0.0, ge=0, le=1)

    @field_validator("min_lr_ratio")
    @classmethod
    def _floor_needs_a_decay(cls, ratio: float, info: ValidationInfo) -> float:
        schedule = info.data.get("lr_schedule")
        if ratio > 0 and schedule == "constant":
            raise ValueError(
                f"applies to a decaying lr_schedule (linear or cosine), got lr_schedule constant with {ratio}: "
                "set lr_schedule, or remove min_lr_ratio"
            )
        return ratio


#: CEL rules on ``spec.optimizer`` (:mod:`rlrun.api.crd`): :class:`OptimizerSpec`'s validator above.
OPTIMIZER_CEL_RULES: list[dict[str, str]] = [
    {  # double(): a YAML 0 arrives as an int, and CEL compares an int with a double only by converting it
        "rule": "!has(self.min_lr_ratio) || double(self.min_lr_ratio) == 0.0 || "
        "(has(self.lr_schedule) && self.lr_schedule != 'constant')",
        "message": "optimizer.min_lr_ratio applies to a decaying lr_schedule (linear or cosine)",
        "fieldPath": ".min_lr_ratio",
    },
]


#: ε of the clip on both sides when none of ``ratio_clip``, ``clip_low``, ``clip_high`` is set (PPO's 0.2).
DEFAULT_CLIP = 0.2


class ImportanceCorrectionSpec(Strict):
    """Train–inference mismatch correction (``docs/algorithms.md``, "Importance correction"): a factor on each trained
    token's policy term from the sampler-to-trainer weight ``w = π_trainer / μ_sampler`` of the token (``level:
    token``) or its geometric mean over the sequence (``level: sequence``), taken at the step's start (the weights
    the step's forward runs on), without gradient.

    Attributes:
        mode: ``none``; ``truncate``: the weight a token's gradient carries is capped at ``cap`` (truncated
            importance sampling, TIS: Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL
            Training"); ``mask``: a token (a sequence, at ``level: sequence``) whose weight leaves [``low``,
            ``high``] is dropped from the loss, still counted by its normaliser (masked importance sampling; IcePop,
            Ling team 2025, "Every Step Evolves: Scaling Reinforcement Learning for Trillion-Scale Thinking Model").
        level: ``token`` (each token's own weight) or ``sequence`` (the geometric mean of its sequence's token
            weights, one factor for every token of the sequence).
        cap: the largest weight a token's gradient carries with ``mode: truncate`` (≥ 1: an on-policy token, weight
            1, is never down-weighted).
        low: the smallest weight kept with ``mode: mask``, in (0, 1].
        high: the largest weight kept with ``mode: mask``, ≥ 1 and > ``low``.
    """

    mode: Literal["none", "truncate", "mask"] = "none"
    level: Literal["token", "sequence"] = "token"
    cap: float = Field(default=2.0, ge=1, le=1000)
    low: float = Field(default=0.5, gt=0, le=1)
    high: float = Field(default=2.0, ge=1, le=1000)

    @field_validator("high")
    @classmethod
    def _window_is_not_empty(cls, high: float, info: ValidationInfo) -> float:
        low = info.data.get("low")
        if low is not None and high <= low:
            raise ValueError(f"must be > low ({low}): tokens whose weight leaves [low, high] are dropped, got {high}")
        return high


class LossSpec(Strict):
    """Policy-gradient loss settings: every formula, its source and the metrics it logs are in
    ``docs/algorithms.md`` (code: ``rlrun.training.objectives``).

    Attributes:
        ratio_clip: ε of the clip on both sides, ``clip(r, 1 − ε, 1 + ε)``: the shorthand for ``clip_low = clip_high
            = ε`` (not with either). None of the three set: 0.2.
        clip_low: ε below 1, ``clip(r, 1 − clip_low, …)``, in (0, 1] (default 0.2; DAPO, Yu et al. 2025).
        clip_high: ε above 1, ``clip(r, …, 1 + clip_high)`` (default 0.2; DAPO's clip-higher: 0.28).
        objective: ``ppo_clip`` (the token ratio clipped: PPO, Schulman et al. 2017); ``gspo`` (the sequence's
            geometric-mean ratio, clipped per sequence: GSPO, Zheng et al. 2025); ``cispo`` (the clipped ratio as a
            stop-gradient weight on the log-probability: CISPO, MiniMax-M1, 2025).
        dual_clip: c > 1 bounding a negative advantage's term at ``c · A`` (dual-clip PPO: Ye et al. 2020,
            "Mastering Complex Control in MOBA Games with Deep Reinforcement Learning"; verl's 3); ``ppo_clip`` and
            ``gspo`` only. Unset: off.
        aggregation: how token terms become the loss: ``token_mean`` (every trained token of the batch weighs the
            same; DAPO), ``sequence_mean`` (mean over each sequence's tokens, then over sequences; GRPO, Shao et al.
            2024), ``constant`` (sum over tokens / (``batch_size`` × ``sampling.max_tokens``); Dr. GRPO, Liu et al.
            2025).
        kl_coef: β of the KL penalty to the reference policy (the starting weights, frozen, held by the trainer); 0:
            off, and no reference is computed or held.
        kl_estimator: the per-token KL estimate penalised: ``k1`` (log ratio), ``k2`` (half its square), ``k3``
            (``e^(−d) − 1 + d``), J. Schulman 2020, "Approximating KL Divergence".
        importance_correction: the train–inference mismatch correction (off by default).
        std_normalize_advantages: deprecated alias of ``spec.advantage.std_normalize``, read into it with a warning
            (``rlrun validate``, ``rlrun local``, the orchestrator's log); set together with it, the two must agree.
    """

    ratio_clip: float | None = Field(default=None, gt=0, le=10)
    clip_low: float | None = Field(default=None, gt=0, le=1)
    clip_high: float | None = Field(default=None, gt=0, le=10)
    objective: Literal["ppo_clip", "gspo", "cispo"] = "ppo_clip"
    dual_clip: float | None = Field(default=None, gt=1, le=100)
    aggregation: Literal["token_mean", "sequence_mean", "constant"] = "token_mean"
    kl_coef: float = Field(default=0.0, ge=0, le=100)
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    importance_correction: ImportanceCorrectionSpec = Field(default_factory=ImportanceCorrectionSpec)
    std_normalize_advantages: bool | None = None

    @field_validator("clip_low", "clip_high")
    @classmethod
    def _not_with_ratio_clip(cls, value: float | None, info: ValidationInfo) -> float | None:
        ratio_clip = info.data.get("ratio_clip")
        if value is not None and ratio_clip is not None:
            raise ValueError(
                f"set either ratio_clip (both sides, {ratio_clip}) or clip_low/clip_high, not both: they contradict"
            )
        return value

    @field_validator("dual_clip")
    @classmethod
    def _dual_clip_needs_a_clipped_surrogate(cls, value: float | None, info: ValidationInfo) -> float | None:
        if value is not None and info.data.get("objective") == "cispo":
            raise ValueError("applies to objective ppo_clip or gspo: cispo has no clipped surrogate for it to bound")
        return value

    @property
    def epsilon_low(self) -> float:
        """ε below 1: ``clip_low``, else ``ratio_clip``, else :data:`DEFAULT_CLIP`."""
        return next(e for e in (self.clip_low, self.ratio_clip, DEFAULT_CLIP) if e is not None)

    @property
    def epsilon_high(self) -> float:
        """ε above 1: ``clip_high``, else ``ratio_clip``, else :data:`DEFAULT_CLIP`."""
        return next(e for e in (self.clip_high, self.ratio_clip, DEFAULT_CLIP) if e is not None)


#: The CEL rules of ``spec.loss`` (:mod:`rlrun.api.crd`), by path below it: the validators above, for the API server.
LOSS_CEL_RULES: dict[tuple[str, ...], list[dict[str, str]]] = {
    (): [
        {
            "rule": "!has(self.ratio_clip) || !has(self.clip_low)",
            "message": "set either loss.ratio_clip (both sides) or loss.clip_low/clip_high, not both: they contradict",
            "fieldPath": ".clip_low",
        },
        {
            "rule": "!has(self.ratio_clip) || !has(self.clip_high)",
            "message": "set either loss.ratio_clip (both sides) or loss.clip_low/clip_high, not both: they contradict",
            "fieldPath": ".clip_high",
        },
        {
            "rule": "!has(self.dual_clip) || self.objective != 'cispo'",
            "message": "loss.dual_clip applies to objective ppo_clip or gspo: cispo has no clipped surrogate to bound",
            "fieldPath": ".dual_clip",
        },
    ],
    ("importance_correction",): [
        {
            "rule": "self.high > self.low",
            "message": "loss.importance_correction.high must be > low: tokens whose weight leaves [low, high] are "
            "dropped",
            "fieldPath": ".high",
        },
    ],
}


def _no_crd_default(schema: dict[str, Any]) -> None:
    """Leave a field's default out of the CRD: the API server must not fill it in, so that a CEL rule can tell
    whether the user set it (the pydantic default still applies when the manifest is read)."""
    schema.pop("default", None)


class AdvantageSpec(Strict):
    """How a scored group's rewards become its members' advantages, in the orchestrator's sink (see
    ``rlrun.orchestrator.advantages``): ``A_i = (r_i − b_i) / d``, over the members that will train.

    Attributes:
        baseline: ``b_i``: ``group_mean`` (GRPO, Shao et al. 2024: the mean reward of the group) or
            ``leave_one_out`` (RLOO, Kool et al. 2019, Ahmadian et al. 2024: the mean reward of the other members,
            which makes ``A_i = n/(n − 1) · (r_i − mean r)``).
        std_normalize: ``d`` is the group's reward std (population), floored at ``min_std``; off (``d = 1``) by
            default, as Dr. GRPO argues (Liu et al. 2025: the division over-weights nearly solved and nearly
            hopeless prompts). Default false, or ``spec.loss.std_normalize_advantages`` (its deprecated alias).
        min_std: the floor of that std, in reward units: ``d = max(std, min_std)``, so a group whose rewards differ
            by 0.01 (reasoning-gym's score of a wrong non-empty answer) gets advantages of at most ±0.1 (0.01 ÷
            0.1), not ±1.7; a group whose reward std is at least this is untouched. Used only with ``std_normalize``.
            Groups it touched: ``groups_std_floored`` in ``metrics.jsonl``.
    """

    baseline: Literal["group_mean", "leave_one_out"] = "group_mean"
    std_normalize: bool = Field(default=False, json_schema_extra=_no_crd_default)
    min_std: float = Field(default=0.1, gt=0, le=1e6)
