"""TaskDifficulty: what every task of the run scored, per task, in compact arrays that survive preemption.

Kept for each env with a finite task space (``num_task_keys()`` / ``task_key(seed, index)``: a dataset's rows,
:mod:`rlrun.envs.dataset`), one entry per task, whichever epoch drew it:

- ``drawn``: groups requested of it (uint32);
- ``scored``: groups of it scored (uint32), every member counted, stale ones too (they measure the task);
- ``reward_sum``: the sum of those groups' mean rewards (float32): ``reward_sum / scored`` is the running pass rate
  (the mean reward, for rewards in [0, 1]);
- ``last``: the last scored group's mean reward (float32; NaN before any);
- ``zero_streak``: the scored groups in a row, up to the last, whose members all got the same reward (uint16,
  saturating): the groups that taught nothing.

18 bytes a task: a 1M-row dataset holds 18 MB (:attr:`TaskDifficulty.nbytes`). A procedural env (a new task at every
index) has no entry: its tasks never come back, and a per-task history needs them to.

**Preemption.** The arrays travel in the orchestrator's checkpoint part, as tensors beside the sink snapshot's
(``curriculum.<env>.<field>``; :meth:`TaskDifficulty.tensors`), captured on the event loop with the snapshot, so a
resumed attempt restores the state the snapshot's cut saw; the groups its journal replay scores again update it as
they did before the crash. An env whose data changed since (another fingerprint or row count) loses its state, with
one warning naming it: it is never applied to other tasks.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import numpy as np

from rlrun.envs.base import Env, Task, has_task_keys

log = logging.getLogger(__name__)

#: Two rewards this close are the same (the sink's zero-advantage rule).
SAME_REWARD = 1e-9
#: The per-task arrays and their types.
FIELDS: dict[str, np.dtype] = {
    "drawn": np.dtype(np.uint32),
    "scored": np.dtype(np.uint32),
    "reward_sum": np.dtype(np.float32),
    "last": np.dtype(np.float32),
    "zero_streak": np.dtype(np.uint16),
}
_STREAK_MAX = np.iinfo(np.uint16).max


class EnvDifficulty:
    """The per-task arrays of one env (:data:`FIELDS`), ``size`` tasks long."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.arrays = {name: np.zeros(size, dtype=dtype) for name, dtype in FIELDS.items()}
        self.arrays["last"][:] = np.nan

    def record(self, key: int, rewards: list[float]) -> None:
        """A group of task ``key`` was scored with ``rewards`` (every member's)."""
        a = self.arrays
        mean = sum(rewards) / len(rewards)
        a["scored"][key] += 1
        a["reward_sum"][key] += mean
        a["last"][key] = mean
        zero_spread = max(rewards) - min(rewards) < SAME_REWARD
        a["zero_streak"][key] = min(int(a["zero_streak"][key]) + 1, _STREAK_MAX) if zero_spread else 0


class TaskDifficulty:
    """Per-task history of the groups of every env with a finite task space (module docstring).

    Args:
        envs: the run's envs by name; those without ``num_task_keys`` / ``task_key`` keep no state.
        seed: the run's seed (task ``index`` of an env's stream is ``task_key(seed, index)``).
    """

    def __init__(self, envs: Mapping[str, Env], seed: int) -> None:
        self.seed = seed
        self.envs = {name: env for name, env in envs.items() if has_task_keys(env)}
        self.tables = {name: EnvDifficulty(int(env.num_task_keys())) for name, env in self.envs.items()}  # type: ignore[attr-defined]

    def key(self, task: Task) -> tuple[EnvDifficulty, int] | None:
        """The table and row of ``task`` (None: its env keeps no state)."""
        table = self.tables.get(task.env)
        if table is None:
            return None
        return table, int(self.envs[task.env].task_key(self.seed, task.index))  # type: ignore[attr-defined]

    def drawn(self, task: Task) -> None:
        """A group of ``task`` is requested."""
        if (found := self.key(task)) is not None:
            table, key = found
            table.arrays["drawn"][key] += 1

    def record(self, task: Task, rewards: list[float]) -> None:
        """A group of ``task`` was scored with ``rewards`` (the sink's call; nothing for an env without state)."""
        if rewards and (found := self.key(task)) is not None:
            table, key = found
            table.record(key, rewards)

    def stats(self, task: Task) -> tuple[int, float, int] | None:
        """``(groups scored, the last one's mean reward, zero-spread groups in a row)`` of ``task`` (None: no state)."""
        found = self.key(task)
        if found is None:
            return None
        table, key = found
        a = table.arrays
        return int(a["scored"][key]), float(a["last"][key]), int(a["zero_streak"][key])

    @property
    def nbytes(self) -> int:
        """Bytes the arrays hold."""
        return sum(a.nbytes for t in self.tables.values() for a in t.arrays.values())

    def state(self) -> dict[str, Any]:
        """JSON-compatible description of the arrays :meth:`tensors` saves: ``{env: {"tasks": n, "fingerprint": str
        | None}}``."""
        return {
            name: {"tasks": t.size, "fingerprint": _fingerprint(self.envs[name])} for name, t in self.tables.items()
        }

    def tensors(self) -> dict[str, Any]:
        """Copies of the arrays as tensors, ``curriculum.<env>.<field>`` (call on the event loop: a consistent cut)."""
        import torch

        return {
            f"curriculum.{name}.{field}": torch.from_numpy(a.copy())
            for name, t in self.tables.items()
            for field, a in t.arrays.items()
        }

    def load(self, state: dict[str, Any] | None, tensors: Mapping[str, Any]) -> None:
        """Restore :meth:`state` and :meth:`tensors` from a checkpoint (None: one written before the curriculum; no
        state). An env whose task count or data fingerprint differs loses its state, with one warning."""
        for name, saved in (state or {}).items():
            table = self.tables.get(name)
            if table is None:
                continue
            if saved.get("tasks") != table.size or saved.get("fingerprint") != _fingerprint(self.envs[name]):
                log.warning(
                    "curriculum: env %s's data changed since the checkpoint (%s tasks then, %d now, or other files): "
                    "its per-task state is dropped, and it is drawn as a fresh env",
                    name,
                    saved.get("tasks"),
                    table.size,
                )
                continue
            for field, dtype in FIELDS.items():
                table.arrays[field] = tensors[f"curriculum.{name}.{field}"].numpy().astype(dtype, copy=True)


def _fingerprint(env: Env) -> str | None:
    fingerprint = getattr(env, "fingerprint", None)
    return fingerprint() if callable(fingerprint) else None
