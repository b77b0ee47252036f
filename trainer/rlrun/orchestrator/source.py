"""TrainSource: which task comes next, and the member numbers of every group.

Task number ``i`` of a run is a pure function of ``(seed, i)``: its env is drawn
with the envs' weights from an RNG seeded by ``(seed, i)``, and the env makes task
``i`` of its own seeded stream. The whole sampler state is therefore the cursor
``i`` — with a curriculum (``spec.curriculum``), which passes over tasks by a draw seeded by
``(seed, env, i)`` against the per-task state, that state too (:mod:`.curriculum`) — and a resumed run
that restores them draws exactly the tasks an uninterrupted run would have drawn next. The group id of a
fresh group is its task number, unique within the run.

Resume requests — members of a group asked again, same task and same group id, after a
cancellation or a resume from a sink snapshot — are served **before** any new task
(invariant 3), in the order they were made, and are part of the saved state until
dispatched, so a second crash during a resume loses nothing.

Member numbers: the source hands out every request's members, and a group's new members
are always numbered after every member requested before (in this attempt, or in the
snapshot it resumed from), so an episode id is never used twice. Retries: the source also
counts how often each group was requested again after a failed request, and keeps the
counts in its state, so ``rollout.max_group_retries`` bounds them across resumes too.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from rlrun.envs.base import Env, Task
from rlrun.orchestrator.groups import GroupRequest, KeptConversation

if TYPE_CHECKING:
    from rlrun.orchestrator.curriculum import Curriculum


class TrainSource:
    """Seeded task sampling with a cursor; resume requests; member numbering.

    Args:
        envs: ``[(env, weight), …]``, weights > 0.
        seed: the run's seed.
        cursor: index of the next task.

    Raises:
        ValueError: no envs.
    """

    def __init__(
        self, envs: list[tuple[Env, float]], seed: int, cursor: int = 0, curriculum: Curriculum | None = None
    ) -> None:
        if not envs:
            raise ValueError("TrainSource needs at least one env")
        self.envs = [e for e, _ in envs]
        self.weights = [w for _, w in envs]
        self.seed = seed
        self.cursor = cursor
        self.resume_requests: deque[GroupRequest] = deque()
        self._next_member: dict[int, int] = {}  # groups with members out → first unused member number
        self._retries: dict[int, int] = {}  # groups requested again after failed requests → how often
        #: ``admit(task) -> bool``: False passes a fresh task over (the caller records why); None: every task is
        #: admitted
        self.admit: Callable[[Task], bool] | None = None
        #: passes over tasks by what their earlier groups scored (``spec.curriculum``); None: every task is drawn
        self.curriculum = curriculum

    def task_at(self, index: int) -> Task:
        """Task number ``index`` (pure; does not move the cursor)."""
        if len(self.envs) == 1:
            env = self.envs[0]
        else:
            env = random.Random(f"env:{self.seed}:{index}").choices(self.envs, weights=self.weights)[0]
        return env.task(self.seed, index)

    def next_group(self, group_size: int) -> GroupRequest:
        """The next request to roll out: a pending resume request, else the next new task :attr:`admit` admits, with
        ``group_size`` members."""
        if self.resume_requests:
            return self.resume_requests.popleft()
        while True:  # a task admit refuses is passed over: the cursor moves on, the caller has recorded it
            index = self.cursor
            task = self.task_at(index)
            admitted = (self.admit is None or self.admit(task)) and (
                self.curriculum is None or self.curriculum.admit(task)
            )
            # only past a task that was made and judged: one whose env raised, or that admit raised on (refuse), is
            # not passed over: the run stops on it, and a draw meanwhile (the loop's, after its follower's) asks again
            self.cursor += 1
            if admitted:
                break
        request = GroupRequest(group_id=index, task=task, members=group_size)
        self.note_members(index, request.next_member)
        return request

    def request_again(self, group_id: int, task: Task, members: int, retry: bool = False) -> GroupRequest:
        """Ask for ``members`` more members of a group, numbered after all of its earlier ones.

        The request is served before any new task; returns it. ``retry``: it replaces a failed
        request (counted in :meth:`retries`).
        """
        request = GroupRequest(group_id, task, members, self._next_member.get(group_id, 0))
        self.note_members(group_id, request.next_member)
        self.resume_requests.append(request)
        if retry:
            self._retries[group_id] = self._retries.get(group_id, 0) + 1
        return request

    def retries(self, group_id: int) -> int:
        """How often the group was requested again after a failed request."""
        return self._retries.get(group_id, 0)

    def note_members(self, group_id: int, next_member: int) -> None:
        """Record that the group's members below ``next_member`` are taken (by a request or an episode)."""
        self._next_member[group_id] = max(self._next_member.get(group_id, 0), next_member)

    def forget(self, group_id: int) -> None:
        """The group is scored or abandoned: its numbering, retries and any resume request of it are dropped."""
        self._next_member.pop(group_id, None)
        self._retries.pop(group_id, None)
        if any(r.group_id == group_id for r in self.resume_requests):
            self.resume_requests = deque(r for r in self.resume_requests if r.group_id != group_id)

    def restore(
        self,
        taken: list[tuple[int, int]],
        to_complete: list[tuple[int, Task, int]],
        continued: Sequence[KeptConversation] = (),
    ) -> None:
        """After :meth:`load_state` on a resume: replace the resume requests with one per conversation to continue,
        then one per group to complete.

        Args:
            taken: ``(group_id, next_member)`` of every member number the snapshot used
                (:meth:`SinkSnapshot.taken_members`); the pending requests' are noted already.
            to_complete: ``(group_id, task, missing members)`` from the restore plan, in order.
            continued: multi-turn episodes to continue at their last durable turn (each keeps its member number).
        """
        for group_id, next_member in taken:
            self.note_members(group_id, next_member)
        self.resume_requests.clear()
        for c in continued:
            self.note_members(c.group_id, c.member + 1)
            self.resume_requests.append(GroupRequest(c.group_id, c.task, 1, c.member, resume_from=c))
        for group_id, task, missing in to_complete:
            self.request_again(group_id, task, missing)

    def state(self) -> dict[str, Any]:
        """JSON-compatible state for checkpoints: ``{"cursor": int, "resume_requests": [GroupRequest dict, …],
        "retries": {"<group id>": int}}``, and ``"curriculum"`` (:meth:`Curriculum.state`) with one.

        Member numbers are not saved: a resume notes them again from the snapshot's episodes and
        requests (:meth:`note_members`).
        """
        return {
            "cursor": self.cursor,
            "resume_requests": [r.to_dict() for r in self.resume_requests],
            "retries": {str(g): n for g, n in self._retries.items()},
        } | ({"curriculum": self.curriculum.state()} if self.curriculum is not None else {})

    def tensors(self) -> dict[str, Any]:
        """The bulk part of :meth:`state`, as tensors: the curriculum's per-task arrays (copies; {} without one)."""
        return self.curriculum.difficulty.tensors() if self.curriculum is not None else {}

    def load_state(self, state: dict[str, Any], tensors: dict[str, Any] | None = None) -> None:
        """Restore :meth:`state` and :meth:`tensors` (older checkpoints lack resume requests, retries and the
        curriculum: none)."""
        self.cursor = int(state["cursor"])
        if self.curriculum is not None:
            self.curriculum.load(state.get("curriculum"), tensors or {})
        self._retries = {int(g): int(n) for g, n in state.get("retries", {}).items()}
        self.resume_requests = deque(GroupRequest.from_dict(r) for r in state.get("resume_requests", []))
        self._next_member = {}
        for r in self.resume_requests:
            self.note_members(r.group_id, r.next_member)
