"""Endpoint membership: which rollout servers get requests, as servers come, go, miss and regain weights.

Guarantee: a rollout server gets a request only while it holds the current weights and is not reloading (the
dispatcher checks each server's confirmed version, :attr:`~rlrun.rollout.client.RolloutClient.loaded_version`, and
its reload window, :attr:`~rlrun.rollout.client.RolloutClient.reloading`). A
server added (``PUT /rollout-endpoints``) gets no request until it is caught up; one that missed an
update while it was being caught up (the update's server list was made before it joined) is caught up
again at the next look (:meth:`EndpointMembership.catch_up_lagging`); one that cannot be reached during a weight
update is **benched** — its requests are requested again elsewhere at once — and rejoins only after
it answers ``/health`` and is given the current weights (tried every :data:`REJOIN_EVERY_S` per
server); a removed server's requests are requested again at once too, not counted as retries.

A policy object in the manner of prime-rl's ``concurrency.py``: it owns no task and no connection
pool (the dispatcher owns the clients, the weight follower the versions); :meth:`EndpointMembership.bind`
wires it to them, and what it takes out of use comes back as cancellations for the loop to settle.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from rlrun.errors import OrchestratorError
from rlrun.orchestrator.dispatcher import Dispatcher
from rlrun.orchestrator.follower import WeightFollower
from rlrun.orchestrator.groups import GroupCancellation
from rlrun.rollout.client import RolloutClient, RolloutError

log = logging.getLogger(__name__)

#: How often a benched rollout server is asked whether it is back, seconds.
REJOIN_EVERY_S = 2.0


class DispatchError(OrchestratorError):
    """The rollout servers cannot be used (message names them and says what to do)."""


async def wait_until_healthy(dispatcher: Dispatcher, timeout_s: float, stop: asyncio.Event) -> None:
    """Wait until every endpoint of ``dispatcher`` answers ``/health``; with none yet, wait for endpoints to be set (no deadline:
    on Kubernetes the operator sends them once rollout pods are ready, which may take as long as scheduling a
    GPU node; the operator reports that wait). Returns early once ``stop`` is set.

    Raises:
        DispatchError: endpoints still unhealthy ``timeout_s`` seconds after they were set.
    """
    noted = time.monotonic()
    while not dispatcher.clients and not stop.is_set():
        if time.monotonic() - noted > 30:
            log.info("waiting for rollout endpoints (PUT /rollout-endpoints on the control server)")
            noted = time.monotonic()
        await asyncio.sleep(0.2)
    deadline = time.monotonic() + timeout_s
    pending = set(dispatcher.clients)
    while pending and not stop.is_set():
        pending &= set(dispatcher.clients)  # endpoints removed meanwhile are not waited for
        for url in list(pending):
            if await dispatcher.clients[url].healthy():
                pending.discard(url)
        if pending:
            if time.monotonic() > deadline:
                raise DispatchError(f"rollout servers not healthy after {timeout_s:.0f} s: {sorted(pending)}")
            await asyncio.sleep(1.0)


class EndpointMembership:
    """The set of rollout endpoints in use (see the module docstring); :meth:`bind` before use."""

    def __init__(self) -> None:
        self._rejoin_tried: dict[str, float] = {}  # benched endpoint → when it was last asked (monotonic)
        self.dispatcher: Dispatcher | None = None

    def bind(
        self,
        dispatcher: Dispatcher,
        weights: WeightFollower,
        client_factory: Callable[[str], RolloutClient],
        settle: Callable[[list[GroupCancellation]], None],
        capacity: Callable[[], None],
    ) -> None:
        """Wire it to the stages: the ``dispatcher`` whose endpoints it sets, the ``weights`` follower that
        catches servers up, ``client_factory`` for a rejoining server, ``settle`` for the requests it takes
        out of use, and ``capacity`` to call when a server comes back (more may be dispatched)."""
        self.dispatcher = dispatcher
        self.weights = weights
        self.client_factory = client_factory
        self.settle = settle
        self.capacity = capacity

    async def set(self, urls: list[str]) -> None:
        """Replace the endpoints with ``urls``; new ones get the current weights first.

        Requests in flight on a removed endpoint are cancelled at once and their members requested
        again (served before new tasks, not counted against ``rollout.max_group_retries``): a lost
        node's requests do not wait for a timeout.

        Raises:
            WeightsError, RolloutError: a new server could not be given the current weights.
        """
        change = self.dispatcher.set_endpoints(urls)
        self.settle(change.lost)  # before any await: no snapshot sees them neither in flight nor requested
        if change.lost:
            log.info(
                "cancelled %d requests in flight on removed endpoints %s; their members are requested again",
                len(change.lost), change.removed,
            )  # fmt: skip
        self.bench(await self.weights.catch_up(change.added))

    async def catch_up_lagging(self) -> None:
        """Give the servers in use that hold an older policy than the current one the current weights: one
        caught up to ``v`` while the update to ``v + 1`` went to the servers listed when it began holds ``v``
        and gets no request until then."""
        lagging = [c for c in self.dispatcher.clients.values() if c.loaded_version < self.weights.version]
        if lagging:
            log.info("catching up rollout servers %s to policy %d", [c.base_url for c in lagging], self.weights.version)
            self.bench(await self.weights.catch_up(lagging))
            self.capacity()

    def bench(self, unreachable: dict[str, str]) -> None:
        """Take rollout servers that missed a weight update (``{url: error}``) out of use; their requests
        are asked again."""
        for url, error in unreachable.items():
            lost = self.dispatcher.bench(url, error)
            self.settle(lost)  # before any await, as for a removed endpoint
            log.warning(
                "rollout server %s benched until it answers and has policy %d; %d requests on it asked again",
                url, self.weights.version, len(lost),
            )  # fmt: skip

    async def rejoin_benched(self) -> None:
        """Give each benched rollout server that answers ``/health`` the current weights, then use it again
        (tried at most every :data:`REJOIN_EVERY_S` per server)."""
        now = time.monotonic()
        for url in list(self.dispatcher.benched):
            if now - self._rejoin_tried.get(url, -1e18) < REJOIN_EVERY_S:
                continue
            self._rejoin_tried[url] = now
            client = self.client_factory(url)
            try:
                rejoined = (
                    await client.healthy()
                    and not await self.weights.catch_up([client])
                    and self.dispatcher.rejoin(client)
                )
            except RolloutError as exc:  # it answers but cannot reload yet: it stays benched, asked again later
                log.warning("benched rollout server %s could not catch up: %s", url, exc)
                rejoined = False
            if rejoined:
                log.info("rollout server %s rejoined with policy %d", url, self.weights.version)
                self.capacity()
            else:
                await client.aclose()
