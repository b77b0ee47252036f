"""The sink snapshot: what of the orchestrator's unfinished work a checkpoint keeps.

Saved (in ``progress.pt``, beside progress and the train-source state):

- ``pending_batch``: queued :class:`TrainingSample`s with their :class:`QueuedTrace`;
- ``open_groups``: every open train group's env, task, group id and finished episodes;
- ``emitted_train_groups``: group requests dispatched whose results have not reached the
  sink (in flight, or waiting in the results queue);
- ``conversations``: multi-turn episodes of those requests at their last durable turn
  (:mod:`~rlrun.orchestrator.conversations`), continued there by a resume;
- the train source's pending resume requests (in the source state).

Not saved: in-flight rollouts and unconsumed results — they are regenerated with
their group, unless the episode journal holds them (:func:`rlrun.orchestrator.resume.with_journal` adds the
journal records after the snapshot's cut before :func:`restore_plan` runs). Token ids and logprobs go into flat tensors,
everything else into JSON; no object is pickled.

Guarantee: the capture (:meth:`rlrun.orchestrator.sink.TrainSink.snapshot`, which the sink hands
itself: this module knows no stage) runs on the event loop with no ``await`` inside, so the
snapshot is a state that existed; it only copies references to immutable records
(``O(queue)`` pointer copies), and :func:`pack` — the costly part — runs in a thread.
:func:`restore_plan` applies the staleness rule of the resumed step to everything
restored, so invariant 2 holds across a resume, and lists every saved group to be
completed with its same task and group id (invariant 3).
"""

from __future__ import annotations

import dataclasses
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from rlrun.api.control import SnapshotCounts
from rlrun.envs.base import Task
from rlrun.orchestrator.groups import GroupRequest, KeptConversation
from rlrun.orchestrator.staleness import min_fresh_version, split_fresh
from rlrun.samples import Episode, QueuedTrace, TrainingSample

#: 2: open-group episodes carry their member number (1: parsed from the episode id).
SINK_STATE_VERSION = 2


@dataclass
class SinkSnapshot:
    """A consistent copy of the sink's unfinished work (references to immutable records)."""

    pending_batch: list[TrainingSample]
    open_groups: list[tuple[int, Task, list[Episode]]]
    emitted_train_groups: list[GroupRequest]
    counters: dict[str, int] = field(default_factory=dict)
    conversations: list[KeptConversation] = field(default_factory=list)
    #: tensors of the source's state taken at the same cut (the curriculum's per-task arrays), saved beside the sink's
    source_tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def taken_members(self) -> Iterator[tuple[int, int]]:
        """``(group_id, next_member)`` for every saved episode, emitted request and kept conversation: member
        numbers in use."""
        for group_id, _, episodes in self.open_groups:
            for e in episodes:
                yield group_id, e.member + 1
        for r in self.emitted_train_groups:
            yield r.group_id, r.next_member
        for c in self.conversations:
            yield c.group_id, c.member + 1

    def counts(self, pending_requests: list[GroupRequest]) -> SnapshotCounts:
        """The contract's counts of this snapshot; ``pending_requests`` are the source's resume requests."""
        open_ids = {g for g, _, _ in self.open_groups}
        requested = {r.group_id for r in [*self.emitted_train_groups, *pending_requests]} - open_ids
        return SnapshotCounts(
            queued_traces=len(self.pending_batch),
            open_groups=len(open_ids),
            requested_groups=len(requested),
            finished_episodes_kept=sum(len(eps) for _, _, eps in self.open_groups),
            conversations_kept=len(self.conversations),
            turns_kept=sum(c.turns for c in self.conversations),
        )


def _view(a: array, dtype: torch.dtype) -> torch.Tensor:
    return torch.frombuffer(a, dtype=dtype) if len(a) else torch.zeros(0, dtype=dtype)


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
        """Zero-copy tensor views of the arrays (they stay alive with this object)."""
        view = _view
        return {
            "prompt_ids": view(self.prompt_ids, torch.int64),
            "completion_ids": view(self.completion_ids, torch.int64),
            "logprobs": view(self.logprobs, torch.float64),
            "prompt_lens": view(self.prompt_lens, torch.int64),
            "completion_lens": view(self.completion_lens, torch.int64),
        }


def pack(snap: SinkSnapshot) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """JSON-compatible sink state and its token tensors (runs in a thread)."""
    tokens = _Tokens()
    # The queue can hold 10k+ samples: its per-sample fields go into arrays too, so the JSON
    # part stays small (a long json.dumps holds the GIL and would stall the event loop).
    envs: dict[str, int] = {}
    cols = {k: array("d") for k in ("advantage", "reward")} | {
        k: array("q") for k in ("policy_version", "group_id", "member", "env")
    }
    for s in snap.pending_batch:
        tokens.add(s.prompt_ids, s.completion_ids, s.logprobs)
        t = s.trace
        cols["advantage"].append(s.advantage)
        cols["reward"].append(s.reward)
        cols["policy_version"].append(t.policy_version)
        cols["group_id"].append(t.group_id)
        cols["member"].append(t.member)
        cols["env"].append(envs.setdefault(t.env, len(envs)))
    pending = {"count": len(snap.pending_batch), "envs": list(envs)}
    groups = []
    for group_id, task, episodes in snap.open_groups:
        eps = []
        for e in episodes:
            i = tokens.add(e.prompt_ids, e.completion_ids, e.logprobs)
            eps.append(
                {
                    "row": i,
                    "member": e.member,
                    "policy_version": e.policy_version,
                    "reward": e.reward,
                    "finish_reason": e.finish_reason,
                }
            )
        groups.append({"group_id": group_id, "env": task.env, "task": task.to_dict(), "episodes": eps})
    conversations = []
    for c in snap.conversations:
        i = tokens.add(c.prompt_ids, c.completion_ids, c.logprobs)
        d = {k: v for k, v in c.to_dict().items() if k not in ("prompt_ids", "completion_ids", "logprobs")}
        conversations.append(d | {"row": i})
    state = {
        "version": SINK_STATE_VERSION,
        "pending_batch": pending,
        "open_groups": groups,
        # a continued conversation's request is listed without it: the conversation is in "conversations"
        "emitted_train_groups": [dataclasses.replace(r, resume_from=None).to_dict() for r in snap.emitted_train_groups],
        "counters": snap.counters,
        "conversations": conversations,
    }
    tensors = {f"sink.{k}": v for k, v in tokens.tensors().items()}
    for k, col in cols.items():
        tensors[f"sink.pending.{k}"] = _view(col, torch.float64 if col.typecode == "d" else torch.int64)
    return state, tensors | snap.source_tensors


def unpack(state: dict[str, Any] | None, tensors: dict[str, torch.Tensor]) -> SinkSnapshot:
    """Inverse of :func:`pack`; a missing state (older checkpoint) is an empty snapshot."""
    if not state:
        return SinkSnapshot([], [], [])
    t = {k.removeprefix("sink."): v for k, v in tensors.items() if k.startswith("sink.")}
    p_off = _offsets(t["prompt_lens"])
    c_off = _offsets(t["completion_lens"])
    prompt_ids = _array("q", t["prompt_ids"])
    completion_ids = _array("q", t["completion_ids"])
    logprobs = _array("d", t["logprobs"])

    def row(i: int) -> tuple[array, array, array]:
        return (
            prompt_ids[p_off[i] : p_off[i + 1]],
            completion_ids[c_off[i] : c_off[i + 1]],
            logprobs[c_off[i] : c_off[i + 1]],
        )

    pb = state["pending_batch"]
    cols = {k.removeprefix("pending."): v.tolist() for k, v in t.items() if k.startswith("pending.")}
    pending = []
    for i in range(pb["count"]):
        p, c, lp = row(i)
        g = cols["group_id"][i]
        trace = QueuedTrace(pb["envs"][cols["env"][i]], cols["policy_version"][i], g, cols["member"][i])
        pending.append(TrainingSample(p, c, lp, cols["advantage"][i], cols["reward"][i], trace))
    groups = []
    for g in state["open_groups"]:
        task = Task.from_dict(g["task"])
        eps = []
        for rec in g["episodes"]:
            p, c, lp = row(rec["row"])
            # version 1 wrote the episode id "<group>/<member>" instead of the member
            member = rec["member"] if "member" in rec else int(rec["episode_id"].rsplit("/", 1)[1])
            eps.append(
                Episode(
                    g["group_id"],
                    member,
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
    conversations = [  # none before multi-turn envs
        KeptConversation(
            d["group_id"],
            d["member"],
            Task.from_dict(d["task"]),
            d["policy_version"],
            *row(d["row"]),
            d["state"],
            d["turns"],
            d["reward"],
            d["tool_calls"],
            d["tool_errors"],
        )
        for d in state.get("conversations", [])
    ]
    return SinkSnapshot(pending, groups, emitted, dict(state.get("counters", {})), conversations)


def _array(typecode: str, t: torch.Tensor) -> array:
    out = array(typecode)
    out.frombytes(t.contiguous().numpy().tobytes())
    return out


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
        open_groups: ``(group_id, task, kept episodes)`` of the groups with at least one fresh
            finished episode, by group id.
        to_complete: ``(group_id, task, missing members)`` of every saved group (open, emitted or
            waiting for a resume request), by group id: each is requested again for
            ``group_size − kept`` members before any new task.
        dropped_samples / dropped_episodes: queued samples and finished group members
            too old for the resumed step (counted, not trained).
        continued: multi-turn episodes to continue at their last durable turn (before any other request; the
            most turns first), counted in their group's members.
        dropped_conversations: ``(conversation, why)`` of those not continued: ``stale`` (its first turn is older
            than ``floor``), ``surplus`` (its group has its members without it), ``group_scored`` (its group
            is queued already).
        floor: the staleness floor of the resumed step (:func:`~rlrun.orchestrator.staleness.min_fresh_version`).
    """

    queue: list[TrainingSample]
    open_groups: list[tuple[int, Task, list[Episode]]]
    to_complete: list[tuple[int, Task, int]]
    dropped_samples: list[TrainingSample]
    dropped_episodes: list[Episode]
    continued: list[KeptConversation] = field(default_factory=list)
    dropped_conversations: list[tuple[KeptConversation, str]] = field(default_factory=list)
    floor: int = 0

    @property
    def episodes_kept(self) -> int:
        """Finished episodes put back into open groups."""
        return sum(len(eps) for _, _, eps in self.open_groups)

    @property
    def requested_groups(self) -> int:
        """Groups to complete that keep no finished episode (requested again whole)."""
        return len({g for g, _, _ in self.to_complete} - {g for g, _, _ in self.open_groups})

    @property
    def members_requested(self) -> int:
        """Members requested again over all groups to complete."""
        return sum(missing for _, _, missing in self.to_complete)


def restore_plan(
    snap: SinkSnapshot,
    pending_requests: list[GroupRequest],
    next_step: int,
    max_off_policy_steps: int,
    group_size: int,
) -> RestorePlan:
    """Apply ``min_fresh_version(next_step)`` to a snapshot and work out every group's missing members.

    Every group that was open, emitted, or waiting for a resume request (``pending_requests``,
    from the train-source state) is completed to ``group_size`` with one request for the
    members it lacks; member numbering is the train source's (:meth:`TrainSource.request_again`).
    A kept conversation (a multi-turn episode at its last durable turn) is continued unless its group is
    queued, its first turn is older than the floor, or its group has its members without it
    (:attr:`RestorePlan.dropped_conversations`); a continued one counts as one of its group's members.
    """
    floor = min_fresh_version(next_step, max_off_policy_steps)
    queue, dropped_samples = split_fresh(snap.pending_batch, floor)
    tasks: dict[int, Task] = {}
    kept: dict[int, list[Episode]] = {}
    dropped_episodes: list[Episode] = []
    for group_id, task, episodes in snap.open_groups:
        tasks[group_id] = task
        kept[group_id], stale = split_fresh(episodes, floor)
        dropped_episodes += stale
    for req in [*snap.emitted_train_groups, *pending_requests]:
        tasks.setdefault(req.group_id, req.task)
    members = {g: len(eps) for g, eps in kept.items()}
    queued = {s.trace.group_id for s in snap.pending_batch}
    continued, dropped_conversations = [], []
    for c in sorted(snap.conversations, key=lambda c: (-c.turns, c.group_id, c.member)):
        why = (
            "group_scored"
            if c.group_id in queued
            else "stale"
            if c.policy_version < floor
            else "surplus"
            if members.get(c.group_id, 0) >= group_size
            else None
        )
        if why is not None:
            dropped_conversations.append((c, why))
            continue
        continued.append(c)
        members[c.group_id] = members.get(c.group_id, 0) + 1
        tasks.setdefault(c.group_id, c.task)
    to_complete = [(g, tasks[g], group_size - members.get(g, 0)) for g in sorted(tasks)]
    open_groups = [(g, tasks[g], eps) for g, eps in sorted(kept.items()) if eps]
    return RestorePlan(
        queue,
        open_groups,
        [c for c in to_complete if c[2] > 0],
        dropped_samples,
        dropped_episodes,
        continued,
        dropped_conversations,
        floor,
    )
