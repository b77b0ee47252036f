"""Small real objects for unit tests (token fields as arrays, as the dispatcher makes them)."""

from __future__ import annotations

from array import array

from rlrun.envs.base import Task
from rlrun.samples import Episode, QueuedTrace, TrainingSample


def task(index: int = 0) -> Task:
    return Task(env="reverse-text", index=index, prompt="ab=", answer="ba")


def episode(group_id: int, member: int, reward: float, version: int, completion=(5, 6, 0)) -> Episode:
    return Episode(
        group_id=group_id,
        member=member,
        task=task(group_id),
        prompt_ids=array("q", [3, 4, 9]),
        completion_ids=array("q", completion),
        logprobs=array("d", [-0.5] * len(completion)),
        policy_version=version,
        reward=reward,
        finish_reason="stop",
    )


def sample(group_id: int, member: int, version: int, advantage: float = 0.5) -> TrainingSample:
    return TrainingSample(
        prompt_ids=array("q", [3, 4, 9]),
        completion_ids=array("q", [5, 0]),
        logprobs=array("d", [-0.1, -0.2]),
        advantage=advantage,
        reward=0.5,
        trace=QueuedTrace("reverse-text", version, group_id, member),
    )
