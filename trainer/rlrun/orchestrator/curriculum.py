"""Curriculum: whether a task the train source draws is generated, from what its earlier groups scored.

The source's seeded stream stays the proposal (:class:`~rlrun.orchestrator.source.TrainSource`: task ``i`` is a pure
function of the seed and ``i``); a policy (``spec.curriculum``, :class:`~rlrun.api.curriculum.CurriculumSpec`) thins
it: task ``i`` is drawn with probability ``p(task)``, decided by a uniform number seeded by ``(seed, env, i)`` alone,
against the task's state (:class:`~rlrun.orchestrator.difficulty.TaskDifficulty`). Thinning a uniform stream with
``p ∝ w(task)`` draws each task with probability proportional to ``w``, and the decision is a pure function of the
seed, the index and the state, so a resumed attempt (the state restored with the cursor) draws what an uninterrupted
one would have drawn from the same state.

- ``uniform``: ``p = 1``.
- ``pools`` (prime-rl's ``DifficultyPoolSampler``): ``p = w / w_max``, ``w`` the weight of the pool the task's last
  group's mean reward falls in (``unseen_weight`` before any was scored), ``w_max`` the largest weight.
- ``skip`` (GRESO, Zheng et al. 2025, arXiv 2506.02177, "probabilistic pre-rollout filtering"): a task whose last
  ``k`` scored groups in a row had zero reward spread is skipped with probability ``min(max_skip, 1 − p_e^k)``,
  ``p_e = exploration``; GRESO adapts ``p_e`` towards a target share of zero-variance prompts, separately for easy and
  hard ones; here it is one fixed setting (``docs/algorithms.md``, "Curriculum").

A task passed over is recorded before the cursor moves past it (ledger ``task_dropped``, reason ``curriculum``: the
ledger check counts it dropped, not skipped unseen) and counted (``tasks_skipped``, kept in the checkpoint).
"""

from __future__ import annotations

import random
from typing import Any

from rlrun.api.curriculum import CurriculumSpec
from rlrun.envs.base import Task
from rlrun.ledger import Ledger, LedgerEvent
from rlrun.orchestrator.difficulty import TaskDifficulty

#: The ledger's ``task_dropped`` reason of a task the curriculum passed over.
CURRICULUM_SKIP = "curriculum"


class Curriculum:
    """Admits or passes over each task drawn (module docstring); counts draws into the difficulty state.

    Args:
        spec: ``spec.curriculum``.
        difficulty: the per-task state it reads (and whose ``drawn`` it counts).
        seed: the run's seed.
        ledger: where a task passed over is recorded (``task_dropped``, reason :data:`CURRICULUM_SKIP`); None:
            nowhere.

    Attributes:
        skipped: tasks passed over, over the run (restored with the checkpoint).
    """

    def __init__(
        self,
        spec: CurriculumSpec,
        difficulty: TaskDifficulty,
        seed: int,
        ledger: Ledger | None = None,
    ) -> None:
        self.spec = spec
        self.difficulty = difficulty
        self.seed = seed
        self.ledger = ledger
        self.skipped = 0
        self._max_weight = max(spec.unseen_weight, *(p.weight for p in spec.pools))

    def draw_probability(self, task: Task) -> float:
        """The probability that ``task`` is drawn now (1 for an env without per-task state)."""
        stats = self.difficulty.stats(task)
        if self.spec.policy == "uniform" or stats is None:
            return 1.0
        scored, last, zero_streak = stats
        if self.spec.policy == "pools":
            weight = self.spec.unseen_weight if not scored else self._pool_weight(last)
            return weight / self._max_weight
        return 1.0 - min(self.spec.max_skip, 1.0 - self.spec.exploration**zero_streak)

    def _pool_weight(self, pass_rate: float) -> float:
        for pool in self.spec.pools:
            if pass_rate <= pool.max_pass_rate + 1e-9:
                return pool.weight
        return self.spec.pools[-1].weight

    def admit(self, task: Task) -> bool:
        """Whether ``task`` is generated: a seeded draw against :meth:`draw_probability`; one passed over is recorded
        and counted, one drawn is counted in the difficulty state."""
        p = self.draw_probability(task)
        if p < 1.0 and random.Random(f"curriculum:{self.seed}:{task.env}:{task.index}").random() >= p:
            self.skipped += 1
            if self.ledger is not None:  # recorded before the cursor moves past it
                self.ledger.write(LedgerEvent.TASK_DROPPED, env=task.env, index=task.index, reason=CURRICULUM_SKIP)
            return False
        self.difficulty.drawn(task)
        return True

    def state(self) -> dict[str, Any]:
        """JSON-compatible state: ``{"skipped": int, "envs": TaskDifficulty.state()}`` (the arrays:
        :meth:`TaskDifficulty.tensors`)."""
        return {"skipped": self.skipped, "envs": self.difficulty.state()}

    def load(self, state: dict[str, Any] | None, tensors: dict[str, Any]) -> None:
        """Restore :meth:`state` and the arrays from a checkpoint (None: written before the curriculum: nothing)."""
        if not state:
            return
        self.skipped = int(state.get("skipped", 0))
        self.difficulty.load(state.get("envs"), tensors)
