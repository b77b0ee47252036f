"""The sink snapshot: what of the orchestrator's unfinished work a checkpoint keeps.

Saved (in ``progress.pt``, beside progress and the train-source state):

- ``pending_batch``: queued :class:`TrainingSample`s with their :class:`QueuedTrace`;
- ``open_groups``: every open train group's env, task, group id and finished episodes;
- ``emitted_train_groups``: groups dispatched whose results have not reached the sink
  (in flight, or waiting in the results queue);
- the train source's pending resume requests (in the source state).

Not saved: in-flight rollouts and unconsumed results — they are regenerated with
their group. Token ids and logprobs go into flat tensors, everything else into JSON;
no object is pickled.

Guarantee: :func:`capture` runs on the event loop with no ``await`` inside, so the
snapshot is a state that existed; it only copies references to immutable records
(``O(queue)`` pointer copies), and :func:`pack` — the costly part — runs in a thread.
:func:`restore_plan` applies the staleness rule of the resumed step to everything
restored, so invariant 2 holds across a resume.
"""

from __future__ import annotations

from array import array
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from rlrun.envs.base import Task
from rlrun.orchestrator.types import Episode, GroupRequest, QueuedTrace, TrainingSample, min_fresh_version

SINK_STATE_VERSION = 1


@dataclass
class SinkSnapshot:
    """A consistent copy of the sink's unfinished work (references to immutable records)."""

    pending_batch: list[TrainingSample]
    open_groups: list[tuple[int, Task, list[Episode]]]
    emitted_train_groups: list[GroupRequest]
    counters: dict[str, int] = field(default_factory=dict)


def capture(sink, dispatcher) -> SinkSnapshot:
    """Copy the sink's queue and open groups and the dispatcher's emitted groups (call on the loop)."""
    return SinkSnapshot(
        pending_batch=list(sink.queue),
        open_groups=[(g.group_id, g.task, list(g.episodes)) for g in sink.open_groups.values()],
        emitted_train_groups=dispatcher.emitted_requests() if dispatcher is not None else [],
        counters=asdict(sink.counters),
    )


class _Tokens:
    """Flat token/logprob arrays that records point into by index."""

    def __init__(self) -> None:
        self.prompt_ids = array("q")
        self.completion_ids = array("q")
        self.logprobs = array("d")
        self.prompt_lens = array("q")
        self.completion_lens = array("q")

    def add(self, prompt_ids: list[int], completion_ids: list[int], logprobs: list[float]) -> int:
        self.prompt_ids.extend(prompt_ids)
        self.completion_ids.extend(completion_ids)
        self.logprobs.extend(logprobs)
        self.prompt_lens.append(len(prompt_ids))
        self.completion_lens.append(len(completion_ids))
        return len(self.prompt_lens) - 1

    def tensors(self) -> dict[str, torch.Tensor]:
        return {
            "prompt_ids": torch.frombuffer(bytearray(self.prompt_ids), dtype=torch.int64)
            if self.prompt_ids
            else torch.zeros(0, dtype=torch.int64),
            "completion_ids": torch.frombuffer(bytearray(self.completion_ids), dtype=torch.int64)
            if self.completion_ids
            else torch.zeros(0, dtype=torch.int64),
            "logprobs": torch.frombuffer(bytearray(self.logprobs), dtype=torch.float64)
            if self.logprobs
            else torch.zeros(0, dtype=torch.float64),
            "prompt_lens": torch.tensor(self.prompt_lens.tolist(), dtype=torch.int64),
            "completion_lens": torch.tensor(self.completion_lens.tolist(), dtype=torch.int64),
        }


def pack(snap: SinkSnapshot) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """JSON-compatible sink state and its token tensors (runs in a thread)."""
    tokens = _Tokens()
    pending = []
    for s in snap.pending_batch:
        i = tokens.add(s.prompt_ids, s.completion_ids, s.logprobs)
        pending.append({"row": i, "advantage": s.advantage, "reward": s.reward, "trace": asdict(s.trace)})
    groups = []
    for group_id, task, episodes in snap.open_groups:
        eps = []
        for e in episodes:
            i = tokens.add(e.prompt_ids, e.completion_ids, e.logprobs)
            eps.append(
                {
                    "row": i,
                    "episode_id": e.episode_id,
                    "policy_version": e.policy_version,
                    "reward": e.reward,
                    "finish_reason": e.finish_reason,
                }
            )
        groups.append({"group_id": group_id, "env": task.env, "task": task.to_dict(), "episodes": eps})
    state = {
        "version": SINK_STATE_VERSION,
        "pending_batch": pending,
        "open_groups": groups,
        "emitted_train_groups": [r.to_dict() for r in snap.emitted_train_groups],
        "counters": snap.counters,
    }
    return state, {f"sink.{k}": v for k, v in tokens.tensors().items()}


def unpack(state: dict[str, Any] | None, tensors: dict[str, torch.Tensor]) -> SinkSnapshot:
    """Inverse of :func:`pack`; a missing state (older checkpoint) is an empty snapshot."""
    if not state:
        return SinkSnapshot([], [], [])
    t = {k.removeprefix("sink."): v for k, v in tensors.items() if k.startswith("sink.")}
    p_off = _offsets(t["prompt_lens"])
    c_off = _offsets(t["completion_lens"])
    prompt_ids, completion_ids, logprobs = (
        t["prompt_ids"].tolist(),
        t["completion_ids"].tolist(),
        t["logprobs"].tolist(),
    )

    def row(i: int) -> tuple[list[int], list[int], list[float]]:
        return (
            prompt_ids[p_off[i] : p_off[i + 1]],
            completion_ids[c_off[i] : c_off[i + 1]],
            logprobs[c_off[i] : c_off[i + 1]],
        )

    pending = []
    for rec in state["pending_batch"]:
        p, c, lp = row(rec["row"])
        pending.append(TrainingSample(p, c, lp, rec["advantage"], rec["reward"], QueuedTrace(**rec["trace"])))
    groups = []
    for g in state["open_groups"]:
        task = Task.from_dict(g["task"])
        eps = []
        for rec in g["episodes"]:
            p, c, lp = row(rec["row"])
            eps.append(
                Episode(
                    rec["episode_id"],
                    g["group_id"],
                    task,
                    p,
                    c,
                    lp,
                    rec["policy_version"],
                    rec["reward"],
                    rec["finish_reason"],
                )
            )
        groups.append((g["group_id"], task, eps))
    emitted = [GroupRequest.from_dict(r) for r in state["emitted_train_groups"]]
    return SinkSnapshot(pending, groups, emitted, dict(state.get("counters", {})))


def _offsets(lens: torch.Tensor) -> list[int]:
    out = [0]
    for n in lens.tolist():
        out.append(out[-1] + n)
    return out


@dataclass
class RestorePlan:
    """What a resume puts back, after the staleness rule of the resumed step.

    Attributes:
        queue: samples to put back into ``pending_batch`` (fresh ones only).
        open_groups: ``(group_id, task, kept episodes)`` with at least one kept episode.
        resume_requests: the missing members of every restored group, by group id.
        dropped_samples / dropped_episodes: queued samples and finished group members
            too old for the resumed step (counted, not trained).
    """

    queue: list[TrainingSample]
    open_groups: list[tuple[int, Task, list[Episode]]]
    resume_requests: list[GroupRequest]
    dropped_samples: list[TrainingSample]
    dropped_episodes: list[Episode]

    @property
    def groups(self) -> int:
        """Groups being resumed (open or to be re-requested)."""
        return len({r.group_id for r in self.resume_requests} | {g for g, _, _ in self.open_groups})

    @property
    def episodes_kept(self) -> int:
        return sum(len(eps) for _, _, eps in self.open_groups)


def restore_plan(
    snap: SinkSnapshot,
    pending_requests: list[GroupRequest],
    next_step: int,
    max_off_policy_steps: int,
    group_size: int,
) -> RestorePlan:
    """Apply ``min_fresh_version(next_step)`` to a snapshot and work out the missing members.

    Every group that was open, emitted, or waiting for a resume request becomes one
    resume request for ``group_size − kept`` members (same task and group id), numbered
    after every member dispatched before. Requests come out ordered by group id.
    """
    floor = min_fresh_version(next_step, max_off_policy_steps)
    queue = [s for s in snap.pending_batch if s.trace.policy_version >= floor]
    dropped_samples = [s for s in snap.pending_batch if s.trace.policy_version < floor]
    tasks: dict[int, Task] = {}
    kept: dict[int, list[Episode]] = {}
    next_member: dict[int, int] = {}
    dropped_episodes: list[Episode] = []
    for group_id, task, episodes in snap.open_groups:
        tasks[group_id] = task
        fresh = [e for e in episodes if e.policy_version >= floor]
        dropped_episodes += [e for e in episodes if e.policy_version < floor]
        kept[group_id] = fresh
        members = [int(e.episode_id.rsplit("/", 1)[1]) for e in episodes]
        next_member[group_id] = max([next_member.get(group_id, 0), *(m + 1 for m in members)])
    for req in [*snap.emitted_train_groups, *pending_requests]:
        tasks.setdefault(req.group_id, req.task)
        next_member[req.group_id] = max(next_member.get(req.group_id, 0), req.next_member)
    requests = []
    for group_id in sorted(tasks):
        missing = group_size - len(kept.get(group_id, []))
        if missing > 0:
            requests.append(GroupRequest(group_id, tasks[group_id], missing, next_member[group_id]))
    open_groups = [(g, tasks[g], eps) for g, eps in sorted(kept.items()) if eps]
    return RestorePlan(queue, open_groups, requests, dropped_samples, dropped_episodes)
