"""A reward function written for TRL's ``GRPOTrainer``, used unchanged by ``examples/arithmetic-trl-reward.yaml``.

TRL calls it once per group with the completions and every dataset column as keyword arguments (here
``answer``), one list item per completion, and expects one float per completion; rlrun does the same. The
manifest names it by import path, ``examples.trl_reward:numeric_closeness``, resolved like ``python -m`` does:
from the working directory (the repository root).
"""

from __future__ import annotations

import re

NUMBER = re.compile(r"-?\d+")


def numeric_closeness(completions: list[str], answer: list[str], **kwargs) -> list[float]:
    """1.0 for the right number, partial credit ``1 / (1 + |guess − answer|)`` for a near one, 0.0 for no number.

    The partial credit gives a tiny model's group members different rewards while few are exactly right.
    """
    scores = []
    for completion, gold in zip(completions, answer, strict=True):
        found = NUMBER.search(completion)
        scores.append(0.0 if found is None else 1.0 / (1.0 + abs(int(found.group()) - int(gold))))
    return scores
