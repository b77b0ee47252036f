"""The RL algorithm's settings of the ``RLRun`` spec: sampling, the optimizer and its LR schedule, the loss, the
advantages.

Composed into :class:`rlrun.api.spec.RLRunSpec` (``spec.sampling``, ``spec.optimizer``, ``spec.loss``,
``spec.advantage``); each formula they select is in :mod:`rlrun.training.loss`, :mod:`rlrun.training.schedule`
and :mod:`rlrun.orchestrator.advantages` with its source (``docs/algorithms.md``).
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


class LossSpec(Strict):
    """Policy-gradient loss settings (see ``rlrun.training.loss``).

    Attributes:
        ratio_clip: ε of the clipped importance ratio ``clip(r, 1 − ε, 1 + ε)``.
        std_normalize_advantages: deprecated alias of ``spec.advantage.std_normalize``, read into it with a warning
            (``rlrun validate``, ``rlrun local``, the orchestrator's log); set together with it, the two must agree.
    """

    ratio_clip: float = Field(default=0.2, gt=0, le=10)
    std_normalize_advantages: bool | None = None


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
            0.1), not ±1.7; a group whose reward std is at least this is untouched. Used only with ``std_normalize``. Groups it
            touched: ``groups_std_floored`` in ``metrics.jsonl``.
    """

    baseline: Literal["group_mean", "leave_one_out"] = "group_mean"
    std_normalize: bool = Field(default=False, json_schema_extra=_no_crd_default)
    min_std: float = Field(default=0.1, gt=0, le=1e6)
