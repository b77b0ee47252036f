"""The RL algorithm's settings of the ``RLRun`` spec: sampling, the optimizer, the loss.

Composed into :class:`rlrun.api.spec.RLRunSpec` (``spec.sampling``, ``spec.optimizer``, ``spec.loss``); each formula
they select is in :mod:`rlrun.training.loss` with its source.
"""

from __future__ import annotations

from pydantic import Field

from rlrun.api.strict import Strict


class SamplingSpec(Strict):
    """Rollout sampling parameters (OpenAI completions semantics)."""

    temperature: float = Field(default=1.0, gt=0, le=4)
    top_p: float = Field(default=1.0, gt=0, le=1)
    max_tokens: int = Field(default=24, ge=1, le=32768)


class OptimizerSpec(Strict):
    """AdamW settings of the trainer."""

    lr: float = Field(default=3e-4, gt=0, le=1)
    betas: tuple[float, float] = Field(default=(0.9, 0.99), strict=False)  # YAML gives a list
    weight_decay: float = Field(default=0.0, ge=0)
    eps: float = Field(default=1e-8, gt=0)
    max_grad_norm: float = Field(default=1.0, gt=0)


class LossSpec(Strict):
    """Policy-gradient loss settings (see ``rlrun.training.loss``).

    Attributes:
        ratio_clip: ε of the clipped importance ratio ``clip(r, 1 − ε, 1 + ε)``.
        std_normalize_advantages: divide GRPO advantages by the group's reward std.
    """

    ratio_clip: float = Field(default=0.2, gt=0, le=10)
    std_normalize_advantages: bool = False
