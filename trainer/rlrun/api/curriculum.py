"""``spec.curriculum``: which tasks the orchestrator spends its generation on, from what their groups scored.

A group whose members all got the same reward has zero advantages and is rejected (:mod:`rlrun.orchestrator.sink`):
its tokens teach nothing. The orchestrator keeps, per task of an env with a finite task space (a dataset's rows), what
its groups scored (:mod:`rlrun.orchestrator.difficulty`); a policy reads that state to pass over tasks before they are
generated (:mod:`rlrun.orchestrator.curriculum`). Each policy's formula and source: ``docs/algorithms.md``,
"Curriculum".
"""

from __future__ import annotations

import itertools
from typing import Literal

from pydantic import Field, field_validator

from rlrun.api.strict import Strict

#: Most pools a ``pools`` curriculum may have (the CEL rule below compares neighbours up to it).
MAX_POOLS = 8


class PoolSpec(Strict):
    """One pass-rate pool of the ``pools`` policy: the tasks whose last group's mean reward is at most
    ``max_pass_rate`` (and above the previous pool's), drawn with relative weight ``weight``."""

    max_pass_rate: float = Field(ge=0, le=1, allow_inf_nan=False)
    weight: float = Field(gt=0, le=1e6, allow_inf_nan=False)


#: prime-rl's ``DifficultyPoolSampler`` pools: hard (≤ 0.25) and easy (above 0.75) tasks at a fifth of the weight of
#: the rest.
DEFAULT_POOLS = (
    PoolSpec(max_pass_rate=0.25, weight=0.2),
    PoolSpec(max_pass_rate=0.75, weight=1.0),
    PoolSpec(max_pass_rate=1.0, weight=0.2),
)


class CurriculumSpec(Strict):
    """How the orchestrator picks the next task (``docs/algorithms.md``, "Curriculum").

    Attributes:
        policy: ``uniform`` (default): the seeded task stream as it is; ``pools``: each task drawn with the weight of
            its pass-rate pool (prime-rl's ``DifficultyPoolSampler``), ``unseen_weight`` before any group of it was
            scored; ``skip``: a task whose last ``k`` groups in a row had zero reward spread is passed over with
            probability ``min(max_skip, 1 − exploration^k)`` (GRESO, Zheng et al. 2025, arXiv 2506.02177).
            A task passed over is recorded (ledger ``task_dropped``, reason ``curriculum``) and counted
            (``tasks_skipped``). Envs without a finite task space (procedural ones) are drawn uniformly whatever the
            policy: per-task history needs a task to come back.
        pools: ``pools``' pools, by increasing ``max_pass_rate``, the last one 1 (every task falls in one).
        unseen_weight: ``pools``' weight of a task no group of which was scored yet.
        exploration: ``skip``'s ``p_e`` (0 < p_e < 1): the chance that a task with one zero-spread group is drawn.
        max_skip: ``skip``'s cap on the skip probability: the exploration floor ``1 − max_skip`` with which any task
            is still drawn, so one the policy has improved on can come back.
    """

    policy: Literal["uniform", "pools", "skip"] = "uniform"
    pools: list[PoolSpec] = Field(default_factory=lambda: list(DEFAULT_POOLS), min_length=1, max_length=MAX_POOLS)
    unseen_weight: float = Field(default=1.0, gt=0, le=1e6, allow_inf_nan=False)
    exploration: float = Field(default=0.5, gt=0, lt=1, allow_inf_nan=False)
    max_skip: float = Field(default=0.9, ge=0, lt=1, allow_inf_nan=False)

    @field_validator("pools")
    @classmethod
    def _increasing_to_one(cls, pools: list[PoolSpec]) -> list[PoolSpec]:
        bounds = [p.max_pass_rate for p in pools]
        if any(b >= c for b, c in itertools.pairwise(bounds)):
            raise ValueError(f"max_pass_rate must increase from one pool to the next, got {bounds}")
        if bounds[-1] != 1.0:
            raise ValueError(f"the last pool's max_pass_rate must be 1 (every task falls in a pool), got {bounds[-1]}")
        return pools


def _increasing(i: int) -> str:
    return f"size(self.pools) <= {i + 1} || self.pools[{i}].max_pass_rate < self.pools[{i + 1}].max_pass_rate"


#: :class:`CurriculumSpec`'s rules as CEL, for the CRD (:mod:`rlrun.api.crd`), by path under ``spec.curriculum``.
CURRICULUM_CEL_RULES: dict[tuple[str, ...], list[dict[str, str]]] = {
    (): [
        {
            "rule": " && ".join(f"({_increasing(i)})" for i in range(MAX_POOLS - 1)),
            "message": "curriculum.pools: max_pass_rate must increase from one pool to the next",
            "fieldPath": ".pools",
        },
        {  # double(): a YAML 1 arrives as an int
            "rule": "double(self.pools[size(self.pools) - 1].max_pass_rate) == 1.0",
            "message": "curriculum.pools: the last pool's max_pass_rate must be 1 (every task falls in a pool)",
            "fieldPath": ".pools",
        },
    ],
}
