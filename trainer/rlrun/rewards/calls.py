"""What a reward call is made of, shared by the scorer (:mod:`rlrun.rewards.scoring`) and its worker processes
(:mod:`rlrun.rewards.workers`): the reward ready to call and what TRL's trainer tells it besides the data."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlrun.api.spec import RewardSpec

#: Keyword arguments a reward function gets from the call itself; a task field of the same name is not passed.
CALL_ARGUMENTS = ("prompts", "completions", "completion_ids")
#: Keyword arguments TRL's trainer adds for every reward (:class:`RewardContext`); a task field of the same name
#: is not passed either.
TRAINER_ARGUMENTS = ("trainer_state", "log_extra", "log_metric")


@dataclass(frozen=True)
class RewardContext:
    """What TRL's ``GRPOTrainer`` tells a reward besides the data (:data:`TRAINER_ARGUMENTS`).

    Attributes:
        step: ``trainer_state.global_step``: the policy version that sampled the group (trainer steps behind its
            weights; TRL's ``global_step`` when it scores an on-policy batch).
        max_steps: ``trainer_state.max_steps``: the run's last step.
        log_metric: where ``log_metric(name, value)`` goes (None: dropped, e.g. in an evaluation).
    """

    step: int = 0
    max_steps: int = 0
    log_metric: Callable[[str, float], None] | None = None

    def kwargs(self, n: int) -> dict[str, Any]:
        """``trainer_state``, ``log_extra`` and ``log_metric`` for a call scoring ``n`` completions."""
        from transformers.trainer_callback import TrainerState  # imports torch: the orchestrator has it already

        def log_extra(column: str, values: list) -> None:  # rlrun keeps no completions table (module docstring)
            if not isinstance(column, str) or len(values) != n:
                raise ValueError(f"log_extra(column, values) takes a column name and {n} values, got {column!r}")

        def log_metric(name: str, value: float) -> None:
            if not isinstance(name, str) or not name:
                raise ValueError(f"log_metric(name, value): name must be a non-empty string, got {name!r}")
            number = float(value)  # ints, floats, NumPy and torch scalars
            if self.log_metric is not None and math.isfinite(number):
                self.log_metric(name, number)

        state = TrainerState(global_step=self.step, max_steps=self.max_steps)
        return {"trainer_state": state, "log_extra": log_extra, "log_metric": log_metric}


@dataclass(frozen=True)
class RewardFunction:
    """One reward of an env, ready to call.

    Attributes:
        series: its name in metrics (``reward/<series>``).
        weight: its weight in the episode's reward.
        func: a TRL-convention function (``own`` False), or the env's ``reward(task, text)`` (``own`` True).
        own: whether ``func`` is the env's own reward.
        spec: what the manifest says of it (a worker process loads it from there; None: the env's own, or a
            function given as it is, as tests do).
    """

    series: str
    weight: float
    func: Callable[..., Any]
    own: bool = False
    spec: RewardSpec | None = None

    @property
    def process(self) -> bool:
        """Whether it runs in a worker process (:attr:`RewardSpec.in_process`); never the env's own."""
        return not self.own and self.spec is not None and self.spec.in_process
