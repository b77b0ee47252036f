"""Cancellation: in-flight requests that can no longer train are cancelled, and their groups settled.

After each batch ships, the dispatcher cancels every request dispatched before the
staleness floor of the next batch (:meth:`Dispatcher.cancel_stale`). Each cancelled request
becomes a :class:`GroupCancellation` that the sink settles (:meth:`TrainSink.cancel`): the
group goes on — its cancelled members are requested again, same task and group id, numbered
after every earlier member — or is abandoned. Guarantee: no group is orphaned (left open
waiting for members nobody will produce, holding flow-control budget), and every
cancellation is in the ledger.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from rlrun.ledger import Ledger, LedgerEvent
from rlrun.orchestrator.groups import GroupRequest

if TYPE_CHECKING:
    from rlrun.orchestrator.sink import TrainSink
    from rlrun.orchestrator.source import TrainSource


@dataclass(frozen=True)
class GroupCancellation:
    """One request of a group was cancelled before its members returned (they could no longer train).

    Attributes:
        request: the cancelled request; none of its members reached the sink.
        min_fresh_version: the staleness floor of the next batch: the group's finished
            members older than this can no longer train either.
        others_out: other requests of the same group are still in flight or waiting to be
            consumed (their members may still complete the group).
    """

    request: GroupRequest
    min_fresh_version: int
    others_out: bool


def settle(cancellations: list[GroupCancellation], sink: TrainSink, source: TrainSource, ledger: Ledger) -> int:
    """Record each cancellation and have the sink settle its group; returns how many groups go on.

    A group that goes on gets its cancelled members requested again from ``source`` (served
    before new tasks); an abandoned one is forgotten by the source (numbering and any pending
    resume request of it).
    """
    going_on = 0
    for c in cancellations:
        r = c.request
        ledger.write(LedgerEvent.CANCELLED, group=r.group_id, first_member=r.first_member, members=r.members)
        if sink.cancel(c):
            source.request_again(r.group_id, r.task, r.members)
            going_on += 1
        else:
            source.forget(r.group_id)
    return going_on
