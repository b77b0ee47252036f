"""The records that travel from rollouts to the trainer: episodes, queued traces, samples.

Naming follows the field: an **episode** is one finished rollout (one completion of one
prompt); a **group** is the ``group_size`` episodes of one task that are scored together;
a **sample** is an episode with its advantage, ready to train; its **trace**
(:class:`QueuedTrace`) records where it came from and the policy version that generated
it (the start of its policy span), which is what the staleness rule reads.

Both sides import these: the orchestrator makes them, :mod:`rlrun.batch` (the shipped
batch format the trainer reads) serializes them. Token ids and logprobs are
``Sequence``s: the dispatcher stores them as ``array("q")`` / ``array("d")`` (8 bytes per
value instead of a Python object each), which also lets a sink snapshot copy them into
flat tensors at ``memcpy`` speed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlrun.envs.base import Task

if TYPE_CHECKING:
    import torch

#: The logprob an env token of a multi-turn episode carries: NaN, since it was not sampled and has none
#: (:mod:`rlrun.orchestrator.turns`). The mask travels as the logprob: a token is trained exactly when its logprob
#: is a number (:func:`is_sampled`, :func:`count_sampled`, on a tensor :func:`sampled_mask`); JSON holds an env
#: token's logprob as ``null`` (:func:`logprobs_to_json`).
ENV_TOKEN_LOGPROB = math.nan


def is_sampled(logprob: float) -> bool:
    """Whether a completion token with this logprob was sampled (trained), not an env token's
    (:data:`ENV_TOKEN_LOGPROB`)."""
    return not math.isnan(logprob)


def count_sampled(logprobs: Sequence[float]) -> int:
    """Tokens with these logprobs that were sampled (:func:`is_sampled`); env tokens are not counted."""
    return sum(map(is_sampled, logprobs))


def sampled_mask(logprobs: torch.Tensor) -> torch.Tensor:
    """:func:`is_sampled` of each element of ``logprobs`` (any shape; a bool tensor of that shape)."""
    return ~logprobs.isnan()


def logprobs_to_json(logprobs: Sequence[float]) -> list[float | None]:
    """``logprobs`` as JSON holds them: an env token's (:data:`ENV_TOKEN_LOGPROB`) as ``null``."""
    return [x if is_sampled(x) else None for x in logprobs]


def logprobs_from_json(values: Sequence[float | None]) -> list[float]:
    """Inverse of :func:`logprobs_to_json`."""
    return [ENV_TOKEN_LOGPROB if x is None else float(x) for x in values]


def episode_id(group_id: int, member: int) -> str:
    """``"<group_id>/<member>"``: the id an episode has in the ledger and in batch traces."""
    return f"{group_id}/{member}"


@dataclass(frozen=True)
class Episode:
    """One finished rollout.

    Attributes:
        group_id: the group it belongs to (the task number of a fresh group).
        member: its number in the group; members dispatched again after a cancellation or a
            resume get new numbers, so ``(group_id, member)`` is unique in the run.
        task: what was asked.
        prompt_ids / completion_ids: tokens (completion includes EOS when the model stopped).
        logprobs: per completion token, nats, under the sampling policy (vLLM, processed logprobs).
        policy_version: policy version when the group was dispatched.
        reward: the env's reward in [0, 1].
        finish_reason: ``"stop"`` or ``"length"``.
    """

    group_id: int
    member: int
    task: Task
    prompt_ids: Sequence[int]
    completion_ids: Sequence[int]
    logprobs: Sequence[float]
    policy_version: int
    reward: float
    finish_reason: str

    @property
    def episode_id(self) -> str:
        """``"<group_id>/<member>"``."""
        return episode_id(self.group_id, self.member)


@dataclass(frozen=True)
class QueuedTrace:
    """Provenance of a queued sample: env, dispatch policy version, group and member."""

    env: str
    policy_version: int
    group_id: int
    member: int

    @property
    def episode_id(self) -> str:
        """``"<group_id>/<member>"``."""
        return episode_id(self.group_id, self.member)

    def to_dict(self) -> dict[str, Any]:
        """JSON form (in a shipped batch's ``meta.json``): the fields plus ``episode_id``."""
        return {
            "env": self.env,
            "policy_version": self.policy_version,
            "group_id": self.group_id,
            "member": self.member,
            "episode_id": self.episode_id,
        }


@dataclass(frozen=True)
class TrainingSample:
    """An episode scored and ready to train: tokens, sampling logprobs, advantage, trace."""

    prompt_ids: Sequence[int]
    completion_ids: Sequence[int]
    logprobs: Sequence[float]
    advantage: float
    reward: float
    trace: QueuedTrace

    @property
    def policy_version(self) -> int:
        """The policy version that generated it (its trace's), what the staleness rule reads."""
        return self.trace.policy_version

    @classmethod
    def from_episode(cls, ep: Episode, advantage: float) -> TrainingSample:
        """The sample of episode ``ep`` with its group-relative ``advantage``."""
        return cls(
            prompt_ids=ep.prompt_ids,
            completion_ids=ep.completion_ids,
            logprobs=ep.logprobs,
            advantage=advantage,
            reward=ep.reward,
            trace=QueuedTrace(ep.task.env, ep.policy_version, ep.group_id, ep.member),
        )
