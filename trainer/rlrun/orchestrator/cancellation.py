"""Cancellation: requests that can no longer train, or that failed, are settled with their groups.

Three kinds of request end without members:

- **stale**: after each batch ships, the dispatcher cancels every request dispatched before
  the staleness floor of the next batch (:meth:`Dispatcher.cancel_stale`);
- **failed**: a request that found no server to answer it within
  ``rollout.retry_window_seconds`` (a dead or hung server, a straggler past
  ``rollout.request_timeout_seconds``), or whose answer held a completion that cannot be
  trained (``abort``, no tokens: at once), arrives as a result with an error;
- **lost**: a request in flight on an endpoint that ``PUT /rollout-endpoints`` removed (its
  node is gone) is cancelled at once (:meth:`Dispatcher.lose_on`) instead of waiting
  for its timeout;
- **reward failed**: members whose completions came back but whose reward raised, timed out or
  was no number (:mod:`rlrun.rewards.scoring`) — recorded ``reward_failed`` with their ids, the
  task and the error, never scored as 0 — and settled as a failed request.

Each becomes a :class:`GroupCancellation` that :func:`settle` turns into one outcome for the
group: it **goes on** — the members are requested again, same task and group id, numbered
after every earlier member — or it is **abandoned**: its other requests are cancelled, its
finished episodes recorded as abandoned, and it is counted. A stale request's group goes on
while it keeps fresh members or other requests (:meth:`TrainSink.cancel`), and is asked again
for its finished members dropped as stale too (what it holds, has out and asks for adds up to
``group_size``); a failed request's
group goes on while it has been requested again fewer than ``rollout.max_group_retries``
times (counted by the train source, kept in checkpoints). A lost request's group always goes
on, and the request does not count as a retry: losing a node is not the group's fault.
A group is settled once: when two of its requests are cancelled together and the first
abandons it, the second is only recorded (it neither abandons the group again nor brings it back).
A cancelled request's multi-turn episodes kept at a durable turn end with it (``turns_dropped``: its
members are requested again from their first turn, or the group is abandoned).

Guarantee: no group is orphaned (left open waiting for members nobody will produce, holding
flow-control budget), no request is retried without bound, and every outcome is in the
ledger, so the run reaches ``max_steps`` whatever a rollout server does.
"""

from __future__ import annotations

import logging

from rlrun.ledger import Ledger, LedgerEvent
from rlrun.orchestrator.conversations import KeptConversations
from rlrun.orchestrator.dispatcher import Dispatcher
from rlrun.orchestrator.groups import GroupCancellation
from rlrun.orchestrator.sink import TrainSink
from rlrun.orchestrator.source import TrainSource
from rlrun.samples import episode_id

log = logging.getLogger(__name__)

#: The ``abandoned`` reason of a group given up after a cancellation of each kind (else ``stale``).
_ABANDON_REASONS = {"failed": "requests_failed", "reward_failed": "rewards_failed"}


def settle(
    cancellations: list[GroupCancellation],
    sink: TrainSink,
    source: TrainSource,
    dispatcher: Dispatcher,
    ledger: Ledger,
    max_group_retries: int,
    kept: KeptConversations | None = None,
) -> int:
    """Record each cancellation and settle its group (module docstring); returns how many groups go on.

    Args:
        cancellations: in the order the requests ended.
        sink, source, dispatcher: the orchestrator's stages (the sink drops stale members and
            abandons groups, the source numbers requests again and counts retries, the
            dispatcher cancels an abandoned group's other requests).
        ledger: this attempt's ledger (``cancelled`` and ``abandoned`` events).
        max_group_retries: ``rollout.max_group_retries``.
        kept: the attempt's kept conversations (:mod:`.conversations`): those of cancelled requests and abandoned
            groups end here.
    """
    going_on = 0
    for c in cancellations:
        r = c.request
        if c.reason == "reward_failed":
            ids = [episode_id(r.group_id, m) for m in c.members]
            ledger.write(
                LedgerEvent.REWARD_FAILED, ids=ids, group=r.group_id, env=r.task.env, task=r.task.index, error=c.error
            )
            log.warning("env %s task %d: reward failed for %s: %s", r.task.env, r.task.index, ", ".join(ids), c.error)
        else:
            fields = {"reason": c.reason} | ({"error": c.error} if c.error else {})
            ledger.write(
                LedgerEvent.CANCELLED, group=r.group_id, first_member=r.first_member, members=r.members, **fields
            )
        if kept is not None:
            kept.drop_request(r, c.reason, c.members)
        if r.group_id in sink.abandoned:
            continue  # given up already (its other request's cancellation, settled first): once per group
        if c.reason == "stale":  # members to ask again for (None: the group is given up)
            again, retry = sink.cancel(c), False
        elif c.reason == "lost":
            again, retry = r.members, False
        else:
            again, retry = (r.members if source.retries(r.group_id) < max_group_retries else None), True
        if again is not None:
            source.request_again(r.group_id, r.task, again, retry=retry)
            going_on += 1
            continue
        if c.reason in ("failed", "reward_failed"):
            log.warning(
                "group %d abandoned: its requests failed %d times (rollout.max_group_retries %d); last error: %s",
                r.group_id,
                source.retries(r.group_id) + 1,
                max_group_retries,
                c.error,
            )
        source.forget(r.group_id)
        dispatcher.cancel_group(r.group_id)
        sink.abandon(r.group_id, reason=_ABANDON_REASONS.get(c.reason, "stale"), env=r.task.env)
        if kept is not None:
            kept.drop_group(r.group_id, "abandoned")
    return going_on
