"""Liveness of rollout servers: requests a server is not working on are asked again within seconds.

A request can be lost without any error: never delivered, held by a server across a pause that
never released it, or answered and lost on the way back (issue 26: a run stalled at its last step,
waiting on 52 requests the server did not have, its stats reading ``Running: 0 reqs, Waiting: 0
reqs`` for minutes). Nothing else notices before ``rollout.request_timeout_seconds`` (300 s by
default), and at the last step lost requests stall the run outright.

The guard: every :data:`CHECK_EVERY_S`, for each server that has requests in flight sent at least
:data:`GRACE_S` ago, it reads what the server says it is working on (vLLM's ``/metrics``: requests
running + waiting, :meth:`~rlrun.rollout.client.RolloutClient.load`). A server that reports
**0** while such requests are out, at two looks at least :data:`CONFIRM_S` apart, with requests
that were already out at the first look still out at the second, is not working on them: those
requests are cancelled and their members asked again at once (``lost``, as for a removed
endpoint: not counted as retries; logged with the server's name; ``cancelled`` in the ledger), and
the server counts as failed recently, so their next tries prefer another server.

It never fires on a server that cannot say (no ``/metrics``: unknown, not zero), that is being
given new weights (a paused server holds new requests), or that reports any work: it errs on
the side of waiting, because a false alarm wastes the work of a healthy server. Detection time
after a loss: :data:`GRACE_S` + up to :data:`CHECK_EVERY_S` + :data:`CONFIRM_S` (≈ 7 s).

A server in its first :data:`WARMUP_S` (by the ``process_start_time_seconds`` its ``/metrics`` gives) gets
:data:`WARMUP_CONFIRM_S` instead of :data:`CONFIRM_S`: vLLM publishes its running and waiting counts with
the output of each engine step, and its first steps after start (new batch shapes compiled) can take many
seconds on a loaded machine, its counts reading 0 all along. Seen with two runs sharing 2 cores: the first 64
requests of a run were answered only after 14 s, and the 3 s window asked them again twice, for nothing
(``docs/measurements.md``, "Liveness guard").

**Stall report.** What the guard cannot see — work lost inside the orchestrator (nothing in flight, nothing
requested, a batch never filled) — the stall report names: when the run has neither shipped a batch nor
finished an episode for :data:`STALL_REPORT_S` while running, it logs once (per stall) the whole accounting
the loop holds (queue, open groups with their finished members and the requests out for them, what is
requested, in flight, journaled and not yet admitted, the flow budget). The stall of issue 26 could not be
reproduced (``docs/design.md``, "Rollout liveness"); the next one says where its work went. A run whose episodes
keep finishing while no batch forms (every group rejected for zero reward spread) never stalls by this measure:
at each :meth:`LivenessGuard.check` the guard of :mod:`.no_signal` looks at the sink's counters, warns, then stops it.

A policy object like :mod:`.endpoints`: it owns no task; the orchestrator's follower loop calls
:meth:`LivenessGuard.check`, and what it takes out of use comes back for the loop to settle.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from rlrun.api.spec import RLRunSpec
from rlrun.orchestrator.dispatcher import Dispatcher
from rlrun.orchestrator.groups import GroupCancellation
from rlrun.orchestrator.no_signal import NoSignalGuard
from rlrun.orchestrator.sink import TrainSink
from rlrun.orchestrator.staleness import min_fresh_version
from rlrun.orchestrator.view import OrchestratorView

log = logging.getLogger(__name__)

#: Seconds between looks at the servers.
CHECK_EVERY_S = 2.0
#: A request counts only once it has been out this long (a server needs a moment to admit it, and a
#: finished one may still be on its way back).
GRACE_S = 2.0
#: Seconds between the two looks that must both see 0 before requests are declared lost.
CONFIRM_S = 3.0
#: Seconds without a shipped batch or a finished episode, while running, before the stall report.
STALL_REPORT_S = 60.0
#: A server whose process started less than this long ago (seconds) is warming up…
WARMUP_S = 120.0
#: …and its looks must be this far apart (seconds): its first engine steps may be long, its counts reading 0.
WARMUP_CONFIRM_S = 30.0


class LivenessGuard:
    """Finds requests a rollout server is not working on (module docstring); :meth:`bind` before use.

    Args:
        spec: the run's spec, for its :class:`~rlrun.orchestrator.no_signal.NoSignalGuard` (None: none).
    """

    def __init__(self, spec: RLRunSpec | None = None) -> None:
        self.no_signal = NoSignalGuard(spec) if spec is not None else None
        self._last_check = -1e18
        #: server → (when it was first seen idle with requests out, the requests out then)
        self._idle: dict[str, tuple[float, set[tuple[int, int]]]] = {}
        self.lost_requests = 0  # requests asked again because their server was not working on them
        self._progress: tuple[float, object] = (time.monotonic(), None)  # (since when, the progress seen)
        self.stalls_reported = 0

    def bind(
        self,
        dispatcher: Dispatcher,
        settle: Callable[[list[GroupCancellation]], None],
        progress: Callable[[], object] = lambda: None,
        accounting: Callable[[], dict] = dict,
        sink: TrainSink | None = None,
    ) -> None:
        """Wire it to the ``dispatcher`` whose requests it watches and ``settle`` for those it cancels; for the
        stall report, ``progress()`` (a value that changes whenever the run moves, None while it is not
        running: paused, done) and ``accounting()`` (what the report logs); the ``sink`` whose counters the
        no-signal guard reads."""
        self.dispatcher = dispatcher
        self.settle = settle
        self.progress = progress
        self.accounting = accounting
        self.sink = sink

    def check_stall(self) -> bool:
        """Log the stall report when the run has not moved for :data:`STALL_REPORT_S` (once per stall);
        returns whether it did."""
        now, seen = time.monotonic(), self.progress()
        since, before = self._progress
        if seen is None or seen != before:
            self._progress = (now, seen)
            return False
        if now - since < STALL_REPORT_S:
            return False
        self._progress = (float("inf"), seen)  # once per stall: reset when the run moves
        self.stalls_reported += 1
        log.error(
            "the run has not moved for %.0f s (no batch shipped, no episode finished); please report this with the "
            "accounting: %s",
            now - since,
            self.accounting(),
        )
        return True

    def _out(self, now: float) -> dict[str, set[tuple[int, int]]]:
        """Each server's requests in flight sent at least :data:`GRACE_S` ago."""
        out: dict[str, set[tuple[int, int]]] = {}
        for key, entry in list(self.dispatcher.inflight.items()):
            if entry.url is not None and now - entry.sent_at >= GRACE_S:
                out.setdefault(entry.url, set()).add(key)
        return out

    async def check(self) -> int:
        """Look at the servers (at most every :data:`CHECK_EVERY_S`); returns how many requests it asked again.

        Raises:
            NoLearningSignal: the sink's groups kept having zero reward spread and no batch formed (:mod:`.no_signal`).
        """
        if self.no_signal is not None and self.sink is not None:
            self.no_signal.check(self.sink.counters)
        now = time.monotonic()
        if now - self._last_check < CHECK_EVERY_S:
            return 0
        self._last_check = now
        self.check_stall()
        asked_again = 0
        out = self._out(now)
        for url in [u for u in self._idle if u not in out]:
            del self._idle[url]
        # every server at once: the follower loop that calls this also pushes weights, and one server's slow
        # /metrics must not hold the others' looks (nor the next update) for its timeout each
        clients = self.dispatcher.pool.clients
        looked = [u for u in out if (c := clients.get(u)) is not None and not c.updating]
        answers = await asyncio.gather(*(clients[u].load() for u in looked))
        loads = dict(zip(looked, answers, strict=True))
        for url, keys in out.items():
            client = clients.get(url)
            load = loads.get(url)
            if client is None or client.updating or load is None or load.requests != 0:
                self._idle.pop(url, None)  # gone, being given weights, working, or cannot say: nothing to do
                continue
            seen = self._idle.get(url)
            if seen is None:
                self._idle[url] = (now, keys)
                continue
            inflight = self.dispatcher.inflight
            # out at both looks and still out on this server (the look awaited: things may have moved)
            stuck = {k for k in seen[1] & keys if k in inflight and inflight[k].url == url}
            warming = load.started_at is not None and time.time() - load.started_at < WARMUP_S
            if time.monotonic() - seen[0] < (WARMUP_CONFIRM_S if warming else CONFIRM_S) or not stuck:
                continue
            del self._idle[url]
            idle_s = time.monotonic() - seen[0]
            lost = self.dispatcher.lose(sorted(stuck), f"reported no request running or waiting for {idle_s:.0f} s")
            self.dispatcher.pool.note_failure(url)  # their next tries prefer another server
            self.settle(lost)  # before any await: no snapshot sees them neither in flight nor requested
            self.lost_requests += len(lost)
            asked_again += len(lost)
            log.warning(
                "rollout server %s had %d requests in flight but reported none running or waiting for %.0f s: "
                "they are asked again",
                url,
                len(lost),
                idle_s,
            )
        return asked_again


def stall_accounting(view: OrchestratorView) -> dict:
    """What the stall report logs of the orchestrator's ``view`` (built with its :attr:`~.view.OrchestratorView.work`):
    where every sample the next batch needs is (queued, kept in open groups, out, requested, journaled not admitted)
    and the flow budget that decides whether more is dispatched.

    Raises:
        ValueError: a view without its work detail.
    """
    work = view.work
    if work is None:
        raise ValueError("the stall report needs the view's work detail (Orchestrator.view(detail=True))")
    v = view.policy_version
    # the least policy that may dispatch: one whose samples may train in the next batch, the one after `cut`
    need = max(view.hold_below, min_fresh_version(view.cut + 1, work.max_off_policy_steps))
    waiting = None
    if view.budget <= 0 or v < view.hold_below:  # nothing may be dispatched until the servers hold a newer policy
        waiting = (
            f"policy {need}: the servers hold {v}; newest broadcast of this attempt: {work.newest_broadcast}"
            f"{' (weight pushes held by an evaluation round)' if work.weights_held else ''}; the trainer "
            f"publishes {need} after training batch {need} (shipped: {view.step})"
        )
    return {
        "waiting_for": waiting,
        "step_shipped": view.step,
        "cut": view.cut,
        "policy_version": v,
        "queue": view.queued,
        "open_groups": {g: {"finished": n, "out": work.out.get(g, [])} for g, n in work.finished.items()},
        "inflight_samples": view.inflight_samples,
        "delivered_not_taken": work.delivered_not_taken,
        "requested": work.requested,
        "journaled_not_admitted": view.journaled_not_admitted,
        "budget": view.budget,
        "committed": view.committed,
    }
