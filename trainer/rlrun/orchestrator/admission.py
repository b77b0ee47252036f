"""Admission: a finished request's episodes are journaled, and counted only once the journal made them durable.

Guarantee: an episode counts as finished — ledger ``finished`` (with its journal sequence number
``j``), the sink — only after the episode journal's group commit made its record durable
(:mod:`.journal`), and in journal order; so an abrupt kill loses no episode that counted, and every
episode journaled but not yet admitted is replayed by the next attempt. Until admitted, a request
stays *delivered, not taken* in the dispatcher: a snapshot taken meanwhile lists it as emitted.
Nothing is admitted once paused (the pause snapshot lists those requests as emitted and the journal
keeps them), done or stopping. A failed request, and the members of a request whose reward failed,
go to :func:`~.cancellation.settle`; without a journal, or for an abandoned group, episodes are
admitted at once. A multi-turn episode's turn to keep (:meth:`Admission.keep_turn`) is journaled the
same way and admitted in the same order, into :class:`~.conversations.KeptConversations`.

A policy object (prime-rl's ``concurrency.py`` is the model): it owns no task; :meth:`Admission.bind`
wires it to the stages, and the journal calls :meth:`Admission.on_durable` on the event loop.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

from rlrun.ledger import Ledger, LedgerEvent
from rlrun.orchestrator.conversations import KeptConversations
from rlrun.orchestrator.dispatcher import Dispatcher
from rlrun.orchestrator.groups import GroupCancellation, GroupRequest, GroupResult, KeptConversation
from rlrun.orchestrator.journal import Journal
from rlrun.orchestrator.metrics import StepMetrics
from rlrun.orchestrator.sink import TrainSink
from rlrun.orchestrator.source import TrainSource

#: Journaled requests admitted per event-loop callback once durable (:meth:`Admission.on_durable`).
ADMIT_CHUNK = 16


class Admission:
    """The journal → admit pipeline of one attempt (see the module docstring); :meth:`bind` before use."""

    def __init__(self) -> None:
        self._unadmitted: deque[tuple[int, GroupResult | KeptConversation]] = deque()  # journaled, not yet durable
        self.journal: Journal | None = None  # set once the attempt has begun (its base is known)
        self.stopped = False

    def bind(
        self,
        sink: TrainSink,
        source: TrainSource,
        dispatcher: Dispatcher,
        ledger: Ledger,
        metrics: StepMetrics,
        wake: asyncio.Queue,
        settle: Callable[[list[GroupCancellation]], None],
        next_step: Callable[[], int],
        holding: Callable[[], bool],
        kept: KeptConversations | None = None,
    ) -> None:
        """Wire it to the stages.

        Args:
            wake: the loop's result queue; ``None`` is put in it when episodes were admitted (a batch may
                be ready to ship).
            settle: for a failed request.
            next_step: the step the next batch will be (the sink's staleness floor).
            holding: True while nothing may be admitted (paused, or the run done).
            kept: where multi-turn episodes' durable turns go (None: none are kept); given, the dispatcher's
                ``keep_turn`` becomes :meth:`keep_turn`.
        """
        self.sink, self.source, self.dispatcher, self.ledger, self.metrics = sink, source, dispatcher, ledger, metrics
        self.wake, self.settle, self.next_step, self.holding, self.kept = wake, settle, next_step, holding, kept
        if kept is not None:
            dispatcher.keep_turn = self.keep_turn

    @property
    def unadmitted(self) -> int:
        """Requests journaled and not yet admitted (waiting for their group commit)."""
        return len(self._unadmitted)

    def consume(self, result: GroupResult) -> None:
        """Journal a request's episodes (admitted by :meth:`on_durable` once durable); a failed request is
        settled, and without a journal (or for an abandoned group) the episodes are admitted at once."""
        if result.error is not None:
            g = self.dispatcher.take(result).request.group_id
            out = self.dispatcher.has_work_out(g)
            return self.settle([GroupCancellation(result.request, None, out, "failed", result.error)])
        self.metrics.add_tokens(result.tokens)
        g = result.request.group_id  # requests that keep failing: the dispatcher stops the run (failing.py)
        if result.scored.failed:  # settled first: it may abandon the group, whose episodes are then admitted at once
            self.metrics.reward_failed += len(result.scored.failed)
            members = tuple(m for m, _ in result.scored.failed)
            request = GroupRequest(g, result.request.task, len(members), min(members))
            out = self.dispatcher.has_work_out(g)
            self.settle([GroupCancellation(request, None, out, "reward_failed", result.scored.failed[0][1], members)])
        if self.journal is None or not result.episodes or g in self.sink.abandoned:
            return self._admit([(result, None)])  # nothing that can train: recorded abandoned at once
        self._unadmitted.append((self.journal.append(g, result.request.task, result.episodes), result))

    def keep_turn(self, kept: KeptConversation) -> None:
        """Journal a multi-turn episode's turn (the dispatcher's ``keep_turn``), kept once durable
        (:meth:`on_durable`); nothing without a journal or once stopped."""
        if self.journal is not None and self.kept is not None and not self.stopped:
            self._unadmitted.append((self.journal.append_turn(kept), kept))

    def _admit(self, results: list[tuple[GroupResult, int | None]]) -> None:
        """Count requests' episodes finished: ledger ``finished`` (``n``: completion tokens; with ``j = seq`` when
        journaled; one write for all), the sink, and forget a group that is scored. ``results``: ``(result, seq)``."""
        rows = [
            {"id": e.episode_id, "reward": round(e.reward, 6), "v": e.policy_version, "n": len(e.completion_ids)}
            | ({} if s is None else {"j": s})
            for result, s in results
            for e in result.episodes
        ]
        self.ledger.write_each(LedgerEvent.FINISHED, rows)
        for result, _ in results:
            g = self.dispatcher.take(result).request.group_id
            self.metrics.add_scores(result.request.task.env, result.episodes, result.scored.parts, result.scored.turns)
            if self.kept is not None:
                self.kept.finished(e.episode_id for e in result.episodes)
            self.sink.add_episodes(g, result.request.task, result.episodes, self.next_step())
            if g not in self.sink.open_groups and not self.dispatcher.has_work_out(g):
                self.source.forget(g)

    def on_durable(self, seq: int) -> None:
        """The journal's group commit made records ``≤ seq`` durable (on the loop): admit them, in order,
        at most :data:`ADMIT_CHUNK` per callback (the rest in the next loop iteration, so that a large
        commit does not hold the loop in one piece). Nothing while :meth:`bind`'s ``holding`` or once
        :attr:`stopped`."""
        if self.stopped or self.holding():
            return
        chunk: list[tuple[GroupResult, int | None]] = []
        turns: list[tuple[KeptConversation, int]] = []  # a conversation's turns precede its finish in the journal
        while self._unadmitted and self._unadmitted[0][0] <= seq and len(chunk) + len(turns) < ADMIT_CHUNK:
            s, item = self._unadmitted.popleft()
            (turns if isinstance(item, KeptConversation) else chunk).append((item, s))  # type: ignore[arg-type]
        if not chunk and not turns:
            return
        if turns and self.kept is not None:
            self.kept.admit(turns)
        if chunk:
            self._admit(chunk)
        self.journal.admitted(max(s for _, s in [*chunk, *turns]))  # type: ignore[type-var]
        self.wake.put_nowait(None)  # wake the main loop: a batch may be ready to ship
        if self._unadmitted and self._unadmitted[0][0] <= seq:
            asyncio.get_running_loop().call_soon(self.on_durable, seq)
