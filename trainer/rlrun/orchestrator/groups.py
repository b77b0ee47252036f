"""Requests for the members of a group, what one comes to, and how one ends without its members (the types the
stages pass).

A group's members can be requested in several :class:`GroupRequest` objects — split by
``rollout.members_per_request``, or asked again after a cancellation or a resume — all
with the same task and group id. Member numbers are handed out by the train source
(:class:`~rlrun.orchestrator.source.TrainSource`), always after every member of the group
requested before, so episode ids stay unique across requests and attempts — except a multi-turn
episode continued at its last durable turn (:class:`KeptConversation`, a request's ``resume_from``): it
is the same episode going on, and keeps its member number.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from rlrun.envs.base import Task
from rlrun.samples import Episode, count_sampled, episode_id, logprobs_from_json, logprobs_to_json


@dataclass(frozen=True)
class KeptConversation:
    """A multi-turn episode at its last durable turn: what a resume continues it from (:mod:`.conversations`).

    Attributes:
        group_id, member: the episode (it keeps its id when continued).
        task: its task.
        policy_version: the version of its first sampled turn (what the staleness rule reads).
        prompt_ids: the prompt's tokens.
        completion_ids: every token after the prompt so far — sampled turns and env answers — ending with the
            env's last answer (the next turn is sampled after it).
        logprobs: per completion token: the sampling logprob, NaN on env tokens.
        state: the env's state after its last answer (JSON-compatible).
        turns: model turns played.
        reward, tool_calls, tool_errors: the env's per-turn rewards summed, and tool counts, so far.
    """

    group_id: int
    member: int
    task: Task
    policy_version: int
    prompt_ids: Sequence[int]
    completion_ids: Sequence[int]
    logprobs: Sequence[float]
    state: Any
    turns: int
    reward: float = 0.0
    tool_calls: int = 0
    tool_errors: int = 0

    @property
    def episode_id(self) -> str:
        """``"<group_id>/<member>"``."""
        return episode_id(self.group_id, self.member)

    @property
    def sampled_tokens(self) -> int:
        """Tokens of its sampled turns (what a resume from its first turn would sample again)."""
        return count_sampled(self.logprobs)

    def to_dict(self) -> dict[str, Any]:
        """JSON form (snapshots, train-source state); an env token's logprob is ``null``."""
        return {
            "group_id": self.group_id,
            "member": self.member,
            "task": self.task.to_dict(),
            "policy_version": self.policy_version,
            "prompt_ids": list(self.prompt_ids),
            "completion_ids": list(self.completion_ids),
            "logprobs": logprobs_to_json(self.logprobs),
            "state": self.state,
            "turns": self.turns,
            "reward": self.reward,
            "tool_calls": self.tool_calls,
            "tool_errors": self.tool_errors,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KeptConversation:
        """Inverse of :meth:`to_dict`."""
        return cls(
            int(d["group_id"]),
            int(d["member"]),
            Task.from_dict(d["task"]),
            int(d["policy_version"]),
            [int(x) for x in d["prompt_ids"]],
            [int(x) for x in d["completion_ids"]],
            logprobs_from_json(d["logprobs"]),
            d["state"],
            int(d["turns"]),
            float(d.get("reward", 0.0)),
            int(d.get("tool_calls", 0)),
            int(d.get("tool_errors", 0)),
        )


@dataclass(frozen=True)
class GroupRequest:
    """A request to roll out ``members`` members of group ``group_id`` on ``task``.

    Members are numbered ``first_member … first_member + members − 1`` (episode ids
    ``"<group_id>/<member>"``). ``resume_from``: a multi-turn episode to continue at its last durable turn
    instead (then ``members`` is 1 and ``first_member`` its member).
    """

    group_id: int
    task: Task
    members: int
    first_member: int = 0
    resume_from: KeptConversation | None = None

    @property
    def next_member(self) -> int:
        """One past this request's last member number."""
        return self.first_member + self.members

    def to_dict(self) -> dict[str, Any]:
        """JSON form (snapshots and train-source state)."""
        out = {
            "group_id": self.group_id,
            "task": self.task.to_dict(),
            "members": self.members,
            "first_member": self.first_member,
        }
        return out | ({"resume_from": self.resume_from.to_dict()} if self.resume_from is not None else {})

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GroupRequest:
        """Inverse of :meth:`to_dict`; checkpoints before the field was named ``members`` wrote ``n``."""
        members = d["members"] if "members" in d else d["n"]
        kept = KeptConversation.from_dict(d["resume_from"]) if d.get("resume_from") else None
        return cls(int(d["group_id"]), Task.from_dict(d["task"]), int(members), int(d.get("first_member", 0)), kept)


#: Why a request ended without members (see :mod:`rlrun.orchestrator.cancellation`).
CancelReason = Literal["stale", "failed", "lost", "reward_failed"]


@dataclass(frozen=True)
class GroupCancellation:
    """One request of a group ended before its members returned.

    Attributes:
        request: the request; none of its members reached the sink.
        min_fresh_version: for ``stale``, the staleness floor of the next batch: the group's
            finished members older than this can no longer train either (None otherwise).
        others_out: other requests of the same group are still in flight or waiting to be
            consumed (their members may still complete the group).
        reason: ``stale`` (cancelled: it could no longer train), ``failed`` (no server answered),
            ``lost`` (cancelled: its endpoint was removed) or ``reward_failed`` (the members were sampled, and
            their rewards failed: :mod:`rlrun.rewards.scoring`).
        error: for ``failed`` and ``reward_failed``, what went wrong; for ``lost``, which endpoint went.
        members: for ``reward_failed``, the member numbers that failed (``request`` counts them; its
            ``first_member`` is the lowest).
    """

    request: GroupRequest
    min_fresh_version: int | None
    others_out: bool
    reason: CancelReason = "stale"
    error: str | None = None
    members: tuple[int, ...] = ()


@dataclass
class ScoredRequest:
    """A request's completions made into episodes (:meth:`rlrun.orchestrator.episodes.EpisodeBuilder.episodes`).

    Attributes:
        episodes: the members whose rewards were computed, in member order.
        failed: ``(member, error)`` of each member whose reward (or multi-turn env) failed
            (:mod:`rlrun.rewards.scoring`): no episode.
        parts: each reward function's scores of ``episodes`` by series (None: it did not apply).
        turns: for a multi-turn env, ``num_turns``, ``tool_calls`` and ``tool_errors`` of each of ``episodes``.
    """

    episodes: list[Episode] = field(default_factory=list)
    failed: list[tuple[int, str]] = field(default_factory=list)
    parts: dict[str, list[float | None]] = field(default_factory=dict)
    turns: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class GroupResult:
    """What one group request came to.

    Attributes:
        request: the request.
        scored: its members made into episodes (nothing when it failed).
        tokens: completion tokens generated.
        error: why the request failed on every try for ``retry_window_seconds`` (None: it did not).
    """

    request: GroupRequest
    scored: ScoredRequest = field(default_factory=ScoredRequest)
    tokens: int = 0
    error: str | None = None

    @property
    def episodes(self) -> list[Episode]:
        """Its finished members (:attr:`ScoredRequest.episodes`; empty when it failed)."""
        return self.scored.episodes
