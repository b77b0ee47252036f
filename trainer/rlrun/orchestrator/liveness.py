"""Liveness of rollout servers: requests a server is not working on are asked again within seconds.

A request can be lost without any error: never delivered, held by a server across a pause that
never released it, or answered and lost on the way back (issue 26: a run stalled at its last step,
waiting on 52 requests the server did not have, its stats reading ``Running: 0 reqs, Waiting: 0
reqs`` for minutes). Nothing else notices before ``rollout.request_timeout_seconds`` (300 s by
default), and at the last step lost requests stall the run outright.

The guard: every :data:`CHECK_EVERY_S`, for each server that has requests in flight sent at least
:data:`GRACE_S` ago, it reads what the server says it is working on (vLLM's ``/metrics``: requests
running + waiting, :meth:`~rlrun.rollout.client.RolloutClient.queue_depth`). A server that reports
**0** while such requests are out, at two looks at least :data:`CONFIRM_S` apart, with requests
that were already out at the first look still out at the second, is not working on them: those
requests are cancelled and their members asked again at once (``lost``, as for a removed
endpoint: not counted as retries; logged with the server's name; ``cancelled`` in the ledger), and
the server counts as failed recently, so their next tries prefer another server.

It never fires on a server that cannot say (no ``/metrics``: unknown, not zero), that is being
given new weights (a paused server holds new requests), or that reports any work: it errs on
the side of waiting, because a false alarm wastes the work of a healthy server. Detection time
after a loss: :data:`GRACE_S` + up to :data:`CHECK_EVERY_S` + :data:`CONFIRM_S` (≈ 7 s).

A policy object like :mod:`.endpoints`: it owns no task; the orchestrator's follower loop calls
:meth:`LivenessGuard.check`, and what it takes out of use comes back for the loop to settle.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from rlrun.orchestrator.dispatcher import Dispatcher
from rlrun.orchestrator.groups import GroupCancellation

log = logging.getLogger(__name__)

#: Seconds between looks at the servers.
CHECK_EVERY_S = 2.0
#: A request counts only once it has been out this long (a server needs a moment to admit it, and a
#: finished one may still be on its way back).
GRACE_S = 2.0
#: Seconds between the two looks that must both see 0 before requests are declared lost.
CONFIRM_S = 3.0


class LivenessGuard:
    """Finds requests a rollout server is not working on (module docstring); :meth:`bind` before use."""

    def __init__(self) -> None:
        self._last_check = -1e18
        #: server → (when it was first seen idle with requests out, the requests out then)
        self._idle: dict[str, tuple[float, set[tuple[int, int]]]] = {}
        self.lost_requests = 0  # requests asked again because their server was not working on them

    def bind(self, dispatcher: Dispatcher, settle: Callable[[list[GroupCancellation]], None]) -> None:
        """Wire it to the ``dispatcher`` whose requests it watches and ``settle`` for those it cancels."""
        self.dispatcher = dispatcher
        self.settle = settle

    def _out(self, now: float) -> dict[str, set[tuple[int, int]]]:
        """Each server's requests in flight sent at least :data:`GRACE_S` ago."""
        out: dict[str, set[tuple[int, int]]] = {}
        for key, entry in list(self.dispatcher.inflight.items()):
            if entry.url is not None and now - entry.sent_at >= GRACE_S:
                out.setdefault(entry.url, set()).add(key)
        return out

    async def check(self) -> int:
        """Look at the servers (at most every :data:`CHECK_EVERY_S`); returns how many requests it asked again."""
        now = time.monotonic()
        if now - self._last_check < CHECK_EVERY_S:
            return 0
        self._last_check = now
        asked_again = 0
        out = self._out(now)
        for url in [u for u in self._idle if u not in out]:
            del self._idle[url]
        # every server at once: the follower loop that calls this also pushes weights, and one server's slow
        # /metrics must not hold the others' looks (nor the next update) for its timeout each
        looked = [u for u in out if (c := self.dispatcher.clients.get(u)) is not None and not c.updating]
        answers = await asyncio.gather(*(self.dispatcher.clients[u].queue_depth() for u in looked))
        depths = dict(zip(looked, answers, strict=True))
        for url, keys in out.items():
            client = self.dispatcher.clients.get(url)
            if client is None or client.updating or depths.get(url) != 0:
                self._idle.pop(url, None)  # gone, being given weights, working, or cannot say: nothing to do
                continue
            seen = self._idle.get(url)
            if seen is None:
                self._idle[url] = (now, keys)
                continue
            inflight = self.dispatcher.inflight
            # out at both looks and still out on this server (the look awaited: things may have moved)
            stuck = {k for k in seen[1] & keys if k in inflight and inflight[k].url == url}
            if time.monotonic() - seen[0] < CONFIRM_S or not stuck:
                continue
            del self._idle[url]
            idle_s = time.monotonic() - seen[0]
            lost = self.dispatcher.lose(sorted(stuck), f"reported no request running or waiting for {idle_s:.0f} s")
            self.dispatcher.last_failure[url] = time.monotonic()  # their next tries prefer another server
            self.settle(lost)  # before any await: no snapshot sees them neither in flight nor requested
            self.lost_requests += len(lost)
            asked_again += len(lost)
            log.warning(
                "rollout server %s had %d requests in flight but reported none running or waiting for %.0f s: "
                "they are asked again",
                url, len(lost), idle_s,
            )  # fmt: skip
        return asked_again
