"""Kept conversations: this attempt's multi-turn episodes at their last durable turn (turn-level durability).

After each env answer a multi-turn episode goes on from, the dispatcher hands the conversation to the
orchestrator (``Dispatcher.keep_turn``), which journals it as a turn record (:meth:`Journal.append_turn`);
once the record is durable, :class:`~.admission.Admission` admits it here, in journal order. Only envs that say
their state can be restored (``resumable = True``: the state is plain JSON and the env holds nothing else) are
kept; others are requested again from their first turn after a preemption, as single-turn requests are.

Guarantee (what ``rlrun ledger check`` proves): a kept turn is in the ledger (``turn``: the episode id, its turns
``k``, its journal record ``j``, its policy version ``v``) only once durable, and every kept conversation ends
exactly once: it finishes as an episode (ledger ``finished``), or is **dropped** (``turns_dropped``, with why:
its request was cancelled ``stale``, ``lost``, ``failed`` or ``reward_failed``, its group ``abandoned``, the run
``done``; at a resume ``stale``, ``surplus`` or ``group_scored``), or a resume **continues** it at its last durable
turn (``continued``: ids, turns, versions and the staleness floor they passed). A pause's snapshot holds every
conversation kept here (:meth:`KeptConversations.current`), and a resume puts back the newest turn of each
from the snapshot and the journal records after its cut (:func:`~.resume.with_journal`).

A turn record admitted after its conversation ended (the request was cancelled while the record waited for its
commit) is not kept: an ended conversation never comes back within an attempt.
"""

from __future__ import annotations

from collections.abc import Iterable

from rlrun.ledger import Ledger, LedgerEvent
from rlrun.orchestrator.groups import GroupRequest, KeptConversation
from rlrun.samples import episode_id


class KeptConversations:
    """The conversations kept in this attempt (module docstring), by episode id.

    Args:
        ledger: this attempt's ledger (``turn`` and ``turns_dropped`` events).
    """

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self._kept: dict[str, KeptConversation] = {}
        self._ended: set[str] = set()  # episode ids whose conversation ended in this attempt

    def __len__(self) -> int:
        return len(self._kept)

    def current(self) -> list[KeptConversation]:
        """Every conversation kept now (what a snapshot holds), by episode id."""
        return [self._kept[k] for k in sorted(self._kept)]

    def admit(self, turns: list[tuple[KeptConversation, int]]) -> None:
        """Keep durable turns ``(conversation, journal seq)``, in journal order: one ledger write for all."""
        rows = []
        for kept, seq in turns:
            eid = kept.episode_id
            if eid in self._ended:
                continue
            self._kept[eid] = kept
            rows.append({"id": eid, "k": kept.turns, "j": seq, "v": kept.policy_version})
        if rows:
            self.ledger.write_each(LedgerEvent.TURN, rows)

    def carry(self, continued: Iterable[KeptConversation]) -> None:
        """Keep conversations a resume continues (the ledger's ``continued`` says so; no ``turn`` is written)."""
        for kept in continued:
            self._kept[kept.episode_id] = kept

    def finished(self, ids: Iterable[str]) -> None:
        """Episodes ``ids`` finished: their conversations end (the ``finished`` event says so)."""
        for eid in ids:
            self._kept.pop(eid, None)
            self._ended.add(eid)

    def drop(self, ids: Iterable[str], reason: str) -> None:
        """End the conversations of episodes ``ids`` without an episode (``turns_dropped`` for those kept)."""
        dropped = []
        for eid in ids:
            if self._kept.pop(eid, None) is not None:
                dropped.append(eid)
            self._ended.add(eid)
        if dropped:
            self.ledger.write(LedgerEvent.TURNS_DROPPED, ids=sorted(dropped), reason=reason)

    def drop_request(self, request: GroupRequest, reason: str, members: Iterable[int] = ()) -> None:
        """End the conversations of ``request``'s members (or of ``members`` of its group, when given)."""
        numbers = list(members) or range(request.first_member, request.next_member)
        self.drop([episode_id(request.group_id, m) for m in numbers], reason)

    def drop_group(self, group_id: int, reason: str) -> None:
        """End every kept conversation of group ``group_id``."""
        self.drop([eid for eid, k in self._kept.items() if k.group_id == group_id], reason)

    def drop_all(self, reason: str) -> None:
        """End every kept conversation (the run is done)."""
        self.drop(list(self._kept), reason)
