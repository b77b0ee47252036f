"""What a rollout server answers: a completion, the load it reports (:mod:`rlrun.rollout.client` re-exports
them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Completion:
    """One sampled completion.

    Attributes:
        token_ids: generated token ids, EOS included when the model stopped.
        logprobs: log-probability (nats) of each generated token under the sampling policy, same length.
        finish_reason: ``"stop"`` (EOS) or ``"length"`` (hit ``max_tokens``): :data:`TRAINED_FINISH_REASONS`.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str


@dataclass(frozen=True)
class ServerLoad:
    """What a rollout server reports it is working on (:meth:`RolloutClient.load`).

    Attributes:
        requests: requests running + waiting (completions: ``n`` > 1 counts ``n``).
        started_at: when the server's process started (Unix seconds; None: not reported).
    """

    requests: int
    started_at: float | None = None
