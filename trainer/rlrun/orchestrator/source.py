"""TrainSource: which task comes next.

Task number ``i`` of a run is a pure function of ``(seed, i)``: its env is drawn
with the envs' weights from an RNG seeded by ``(seed, i)``, and the env makes task
``i`` of its own seeded stream. The whole sampler state is therefore the cursor
``i``, and a resumed run that restores the cursor draws exactly the tasks an
uninterrupted run would have drawn next. The group id of a fresh group is its task
number, unique within the run.

Resume requests — the missing members of groups restored from a sink snapshot,
same task and same group id — are served **before** any new task (invariant 3), in
the order they were added, and are part of the saved state until dispatched, so a
second crash during a resume loses nothing.
"""

from __future__ import annotations

import random
from collections import deque
from typing import Any

from rlrun.envs.base import Env, Task
from rlrun.orchestrator.types import GroupRequest


class TrainSource:
    """Seeded task sampling with a cursor.

    Args:
        envs: ``[(env, weight), …]``, weights > 0.
        seed: the run's seed.
        cursor: index of the next task.
    """

    def __init__(self, envs: list[tuple[Env, float]], seed: int, cursor: int = 0) -> None:
        if not envs:
            raise ValueError("TrainSource needs at least one env")
        self.envs = [e for e, _ in envs]
        self.weights = [w for _, w in envs]
        self.seed = seed
        self.cursor = cursor
        self.resume_requests: deque[GroupRequest] = deque()

    def task_at(self, index: int) -> Task:
        """Task number ``index`` (pure; does not move the cursor)."""
        if len(self.envs) == 1:
            env = self.envs[0]
        else:
            env = random.Random(f"env:{self.seed}:{index}").choices(self.envs, weights=self.weights)[0]
        return env.task(self.seed, index)

    def add_resume_request(self, request: GroupRequest) -> None:
        """Queue the missing members of a restored group; served before new tasks."""
        self.resume_requests.append(request)

    def next_group(self, group_size: int) -> GroupRequest:
        """The next group to roll out: a pending resume request, else a new task with ``group_size`` members."""
        if self.resume_requests:
            return self.resume_requests.popleft()
        index = self.cursor
        self.cursor += 1
        return GroupRequest(group_id=index, task=self.task_at(index), n=group_size)

    def state(self) -> dict[str, Any]:
        """JSON-compatible state for checkpoints: the cursor and pending resume requests."""
        return {"cursor": self.cursor, "resume_requests": [r.to_dict() for r in self.resume_requests]}

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state` (a state without resume requests, from older checkpoints, has none)."""
        self.cursor = int(state["cursor"])
        self.resume_requests = deque(GroupRequest.from_dict(r) for r in state.get("resume_requests", []))
