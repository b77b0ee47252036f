"""Advantages: a scored group's rewards → each member's advantage (``spec.advantage``).

For the ``n`` members of a group that will train (the sink passes only those: invariant 3), with rewards ``r``::

    A_i = (r_i − b_i) / d
    b_i = mean(r)                      baseline group_mean      (GRPO: Shao et al. 2024, DeepSeekMath)
    b_i = mean_{j≠i} r_j               baseline leave_one_out   (RLOO: Kool et al. 2019; Ahmadian et al. 2024)
        ⇒ r_i − b_i = n/(n − 1) · (r_i − mean(r))
    d = 1                              std_normalize false (default; Dr. GRPO: Liu et al. 2025)
    d = max(std(r), min_std)           std_normalize true (population std)

The floor ``min_std`` is the minimum-spread rule: a group whose rewards barely differ (reasoning-gym scores
every wrong non-empty answer 0.01, an empty one 0) would otherwise have that difference blown up to unit size
(1.7 for the two members at 0.01 of a group of eight) and weigh as much as a group where some members solved the task.
With the floor, ``|A_i| ≤ spread / min_std``. Precedent: TRL and verl divide by ``std + ε`` with ``ε`` 1e-4 and 1e-6,
which guards only against a division by zero; Dr. GRPO's argument against the division is exactly this
over-weighting of groups with a small spread. A group whose rewards are all equal is not affected by the floor:
its advantages are 0, and the sink rejects it (counted as zero spread, what the no-learning-signal bound
watches); a group with a small but real spread still trains, with small advantages (the signal it carries).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from rlrun.api.algorithm import AdvantageSpec


@dataclass(frozen=True)
class GroupAdvantages:
    """A group's advantages, in member order, and whether ``min_std`` replaced its reward std (``floored``: std
    normalisation on and ``0 < std < min_std``; what ``groups_std_floored`` in ``metrics.jsonl`` counts)."""

    values: list[float]
    floored: bool = False


def group_advantages(rewards: list[float], spec: AdvantageSpec | None = None) -> GroupAdvantages:
    """The advantages of members with ``rewards`` under ``spec`` (default: ``group_mean``, no std division), by the
    formula in the module docstring. Fewer than two rewards: the leave-one-out baseline is undefined, and a single
    member has nothing to be compared with; the advantages are then 0 (the sink rejects such a group anyway)."""
    spec = spec or AdvantageSpec()
    n = len(rewards)
    if n < 2:
        return GroupAdvantages([0.0] * n)
    mean = sum(rewards) / n
    scale = n / (n - 1) if spec.baseline == "leave_one_out" else 1.0
    values = [scale * (r - mean) for r in rewards]
    if not spec.std_normalize:
        return GroupAdvantages(values)
    std = statistics.pstdev(rewards)
    if std == 0.0:
        return GroupAdvantages([0.0] * n)
    return GroupAdvantages([a / max(std, spec.min_std) for a in values], floored=std < spec.min_std)
