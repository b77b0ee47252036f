"""The errors of a rollout server's client (:mod:`rlrun.rollout.client` re-exports them, where callers import
them).

Each is a :class:`RolloutError`, whose message names the server; the dispatcher decides what a completion's
error costs, the weight follower what an update's does.
"""

from __future__ import annotations

#: The finish reasons a completion is trained with: ``stop`` (EOS or a stop string) and ``length``
#: (``max_tokens``). vLLM 0.32 also answers ``abort`` (the request was aborted), ``error`` and
#: ``repetition``: none of them is a sample of the policy's answer to the task.
TRAINED_FINISH_REASONS = frozenset({"stop", "length"})


class RolloutError(RuntimeError):
    """A rollout server answered with an error or an unusable body (message names the server)."""


class ServerReloading(RolloutError):
    """A completion caught by a weight update of its server: the update began before it was sent (nothing was
    sent), or it was answered after the update's pause (``answered_after_pause``: generated, wholly or in
    part, by weights other than those the server held when it was sent; discarded). Not a failure of the
    server: ask again, on a server not reloading (:meth:`RolloutClient.wait_serving`)."""

    def __init__(self, base_url: str, answered_after_pause: bool = False) -> None:
        self.answered_after_pause = answered_after_pause
        why = (
            "answered after the pause of a weight update: its weights are unknown, discarded"
            if answered_after_pause
            else "its weights are being updated; nothing was sent"
        )
        super().__init__(f"{base_url}: {why}")


class UnusableCompletion(RolloutError):
    """The server answered, but a completion cannot be trained: no tokens, or a finish reason not in
    :data:`TRAINED_FINISH_REASONS` (``reason`` says which). The dispatcher does not retry it in place: the
    request fails and its members are requested again within ``rollout.max_group_retries``, so each one
    is in the ledger (``cancelled``, reason ``failed``, with this message) and never scored."""

    def __init__(self, base_url: str, reason: str) -> None:
        self.reason = reason
        super().__init__(f"{base_url}: unusable completion ({reason})")


class WeightsUnverified(RolloutError):
    """After a weight or adapter update, what the server holds is not what was published: its workers' digest
    differs from the files' (:mod:`rlrun.rollout.verification`; the message names the server, the directory
    and both digests), or a worker could not say. The update did not happen: the server gets no completion
    until an update to the current version is verified (:attr:`RolloutClient.loaded_version`)."""
