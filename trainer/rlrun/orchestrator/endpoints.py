"""The rollout servers in use: one owner of them (:class:`RolloutPool`) and the policy that changes them
(:class:`EndpointMembership`), as servers come, go, miss and regain weights.

Guarantee: a rollout server gets a request only while it holds the current weights and is not reloading, and only once
the vLLM it reports is found within rlrun's pins (**Versions**, below). The pool alone holds the servers — their
clients, load, benching, refusal and last failure — and :meth:`RolloutPool.pick` enforces the rule: a request goes to
the least-loaded server holding at least the version it is labelled with
(:attr:`~rlrun.rollout.client.RolloutClient.loaded_version`, set when a reload is confirmed) and not in a weight
update's reload window (:attr:`~rlrun.rollout.client.RolloutClient.reloading`), so the label is never newer than the
weights that produce the tokens, and those are the weights the server held when it was sent, whatever the order of
weight updates and endpoint changes (while every server holding the version reloads, a request waits for the first to
resume); a server that failed the request, or failed one within the retry window, is passed over while others remain.

A server added (``PUT /rollout-endpoints``) gets no request until it is caught up; one that missed an
update while it was being caught up (the update's server list was made before it joined) is caught up
again at the next look (:meth:`EndpointMembership.catch_up_lagging`); one that cannot be reached during a weight
update is **benched** — its requests are requested again elsewhere at once — and rejoins only after
it answers ``/health`` and is given the current weights (tried every :data:`REJOIN_EVERY_S` per
server); a removed server's requests are requested again at once too, not counted as retries.

**Versions.** No server gets a request before the vLLM version it reports (``GET /version``, read once per
URL) is found within rlrun's pins (:mod:`rlrun.versions`): the first endpoints are read together once they are
healthy, and one outside them ends the orchestrator (:meth:`EndpointMembership.start`,
:class:`~rlrun.versions.UnsupportedVersion`); a server added later is read before it is caught up, and one
outside them is **refused**: never used while it is listed, logged as an error naming its URL and versions
(:attr:`RolloutPool.refused`). A server that does not answer is benched and read when it answers again. One
whose updates keep failing verification (:mod:`rlrun.orchestrator.served`) is refused so; none left: a stop.

Policy objects in the manner of prime-rl's ``concurrency.py``: neither owns a task. The pool says which servers
went out of use; the dispatcher, which keeps the requests in flight, cancels those that were on them
(:meth:`~rlrun.orchestrator.dispatcher.Dispatcher.lose_on`), and :class:`EndpointMembership` (wired by
:meth:`~EndpointMembership.bind`) hands those cancellations to the loop to settle.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import httpx

from rlrun.errors import OrchestratorError
from rlrun.orchestrator.follower import WeightFollower
from rlrun.orchestrator.groups import GroupCancellation
from rlrun.orchestrator.served import ServedWeightsUnverified
from rlrun.rollout.client import RolloutClient, RolloutError
from rlrun.timeouts import within
from rlrun.versions import UnsupportedVersion, check_served

log = logging.getLogger(__name__)

#: How often a benched rollout server is asked whether it is back, seconds.
REJOIN_EVERY_S = 2.0

#: Most seconds a request waiting for a server to end its reload waits before it looks at the endpoints again.
RELOAD_LOOK_S = 1.0

#: Most seconds the read of a server's ``GET /version`` may take (then it counts as unreachable: benched).
VERSION_READ_S = 10.0


class DispatchError(OrchestratorError):
    """The rollout servers cannot be used (message names them and says what to do)."""


@dataclass(frozen=True)
class EndpointChange:
    """What :meth:`RolloutPool.set_endpoints` changed.

    Attributes:
        added: clients of the endpoints that are new (they need the current weights).
        removed: the endpoints dropped, sorted (the requests in flight on them are lost).
    """

    added: list[RolloutClient]
    removed: list[str]


class RolloutPool:
    """The rollout servers in use and the pick among them (see the module docstring).

    Args:
        endpoints: base URLs of the rollout servers to begin with.
        client_factory: ``client_factory(url: str) -> RolloutClient`` for each endpoint (tests and benchmarks pass
            fakes).
        retry_window_s: how long a server that failed a request counts as failed recently, seconds.

    Attributes:
        clients: the servers in use, by base URL.
        load: completions out on each server in use (requests of ``n`` samples count ``n``).
        benched: the servers out of use until they rejoin, with why (:meth:`bench`).
        refused: the servers listed but never used, with the line saying why (their vLLM version: :meth:`refuse`).
        vetting: the servers in use whose vLLM version is being read: no request goes to them meanwhile.
        last_failure: when a request last failed on each server (monotonic seconds).
    """

    def __init__(
        self,
        endpoints: list[str],
        client_factory: Callable[[str], RolloutClient] = RolloutClient,
        retry_window_s: float = 120.0,
    ) -> None:
        self.client_factory = client_factory
        self.retry_window_s = retry_window_s
        self.clients: dict[str, RolloutClient] = {}
        self.load: dict[str, int] = {}
        self.benched: dict[str, str] = {}
        self.refused: dict[str, str] = {}
        self.vetting: set[str] = set()
        self.last_failure: dict[str, float] = {}
        self.set_endpoints(endpoints)

    def set_endpoints(self, endpoints: list[str]) -> EndpointChange:
        """Replace the endpoint set; returns the new clients and the endpoints removed.

        The requests in flight on a removed endpoint are lost: the caller cancels them before its next ``await``
        (:meth:`~rlrun.orchestrator.dispatcher.Dispatcher.lose_on`). A benched endpoint still listed stays benched
        (it rejoins once caught up, :meth:`rejoin`), a refused one stays refused; one no longer listed is forgotten.
        """
        wanted = [e.rstrip("/") for e in endpoints]
        for out_of_use in (self.benched, self.refused):
            for url in [u for u in out_of_use if u not in wanted]:
                del out_of_use[url]
        removed = sorted(url for url in self.clients if url not in wanted)
        self._drop(removed)
        added = []
        for url in wanted:
            if url not in self.clients and url not in self.benched and url not in self.refused:
                self.clients[url] = self.client_factory(url)
                self.load[url] = 0
                added.append(self.clients[url])
        return EndpointChange(added, removed)

    def bench(self, url: str, reason: str) -> bool:
        """Stop using endpoint ``url`` (it missed a weight update: ``reason``) until :meth:`rejoin`; returns whether
        it was in use (False for one removed meanwhile). Its requests in flight are lost, as a removed endpoint's."""
        if url not in self.clients:
            return False
        self.benched[url] = reason
        self._drop([url])
        return True

    def refuse(self, url: str, why: str) -> None:
        """Never use endpoint ``url`` while it is listed (its vLLM version is outside rlrun's pins: ``why``); one in
        use is dropped (its requests in flight are lost, as a removed endpoint's), a benched one forgotten."""
        self.benched.pop(url, None)
        if url in self.clients:
            self._drop([url])
        self.refused[url] = why

    def rejoin(self, client: RolloutClient) -> bool:
        """Use benched endpoint ``client.base_url`` again, through ``client`` (it has the current weights);
        False when it is no longer benched (the endpoint set dropped it meanwhile)."""
        if self.benched.pop(client.base_url, None) is None:
            return False
        self.clients[client.base_url] = client
        self.load[client.base_url] = 0
        return True

    def _drop(self, urls: list[str]) -> None:
        """Take the clients of ``urls`` out of use and close them (in the background: no await here)."""
        for url in urls:
            client = self.clients.pop(url)
            self.load.pop(url, None)
            self.vetting.discard(url)
            asyncio.get_event_loop().create_task(client.aclose())

    async def pick(self, failed: set[str], policy_version: int) -> str:
        """The least-loaded endpoint holding at least ``policy_version`` (the version the request is labelled
        with: a label never newer than the weights that produce the tokens) and not reloading, avoiding those that
        failed this request (``failed``) or failed recently (within the retry window) while others remain; while
        every endpoint holding it reloads (all are given new weights at once), the first to resume. An endpoint
        whose vLLM version is being read (:attr:`vetting`) is none of them.

        Raises:
            RolloutError: no endpoints, or none holds ``policy_version`` yet (one joining is being caught up):
                the request's next try asks again.
        """
        while True:
            if not self.clients:
                raise RolloutError("no rollout endpoints")
            holding = [
                u for u in self.load if self.clients[u].loaded_version >= policy_version and u not in self.vetting
            ]
            if not holding:
                raise RolloutError(f"no rollout server holds policy {policy_version} yet")
            if serving := [u for u in holding if not self.clients[u].reloading]:
                break
            waits = [asyncio.ensure_future(self.clients[u].wait_serving()) for u in holding]
            try:  # looked at again after RELOAD_LOOK_S whatever happens: the endpoints may change meanwhile
                await asyncio.wait(waits, timeout=RELOAD_LOOK_S, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
        recent = time.monotonic() - self.retry_window_s
        healthy = [u for u in serving if u not in failed and self.last_failure.get(u, -1e18) < recent]
        candidates = healthy or [u for u in serving if u not in failed] or serving
        return min(candidates, key=self.load.__getitem__)

    @contextlib.contextmanager
    def sending(self, url: str, samples: int) -> Iterator[RolloutClient]:
        """The client of picked endpoint ``url``, its load raised by ``samples`` while the request is out."""
        self.load[url] += samples
        try:
            yield self.clients[url]
        finally:
            if url in self.load:  # dropped meanwhile: nothing to count down
                self.load[url] -= samples

    def note_failure(self, url: str) -> None:
        """A request failed on ``url`` (or was lost there): its next tries, and others', prefer another server."""
        self.last_failure[url] = time.monotonic()

    async def aclose(self) -> None:
        """Close the clients of the servers in use (a dropped one's was closed when it was dropped)."""
        for client in self.clients.values():
            await client.aclose()


async def wait_until_healthy(pool: RolloutPool, timeout_s: float, stop: asyncio.Event) -> None:
    """Wait until every endpoint of ``pool`` answers ``/health``; with none yet, wait for endpoints to be set (no
    deadline: on Kubernetes the operator sends them once rollout pods are ready, which may take as long as scheduling a
    GPU node; the operator reports that wait). Returns early once ``stop`` is set.

    Raises:
        DispatchError: endpoints still unhealthy ``timeout_s`` seconds after they were set.
    """
    noted = time.monotonic()
    while not pool.clients and not stop.is_set():
        if time.monotonic() - noted > 30:
            log.info("waiting for rollout endpoints (PUT /rollout-endpoints on the control server)")
            noted = time.monotonic()
        await asyncio.sleep(0.2)
    deadline = time.monotonic() + timeout_s
    pending = set(pool.clients)
    while pending and not stop.is_set():
        pending &= set(pool.clients)  # endpoints removed meanwhile are not waited for
        for url in list(pending):
            if await pool.clients[url].healthy():
                pending.discard(url)
        if pending:
            if time.monotonic() > deadline:
                raise DispatchError(f"rollout servers not healthy after {timeout_s:.0f} s: {sorted(pending)}")
            await asyncio.sleep(1.0)


class EndpointMembership:
    """The set of rollout endpoints in use (see the module docstring); :meth:`bind` before use."""

    def __init__(self) -> None:
        self._rejoin_tried: dict[str, float] = {}  # benched endpoint → when it was last asked (monotonic)
        self._vetted: set[str] = set()  # endpoints whose vLLM version was read and admitted: never read again
        #: whether servers added are read as they come (:meth:`set`): from :meth:`start` on; before it the first
        #: endpoints are set, and :meth:`start` reads them once they are healthy
        self.checking = False
        self.pool: RolloutPool | None = None
        self.unusable: str | None = None  # why no server is left to use (refuse_unverified): the run stops

    def bind(
        self,
        pool: RolloutPool,
        lose: Callable[[list[str], str], list[GroupCancellation]],
        weights: WeightFollower,
        settle: Callable[[list[GroupCancellation]], None],
        capacity: Callable[[], None],
    ) -> None:
        """Wire it to the stages: the ``pool`` of servers it changes; ``lose(urls, why)``, which cancels the requests
        in flight on servers taken out of use and returns them (the dispatcher's
        :meth:`~rlrun.orchestrator.dispatcher.Dispatcher.lose_on`); the ``weights`` follower that catches servers
        up; ``settle`` for the requests lost; and ``capacity`` to call when a server comes back (more may be
        dispatched)."""
        self.pool = pool
        self.lose = lose
        self.weights = weights
        self.settle = settle
        self.capacity = capacity
        weights.unverified.refuse = self.refuse_unverified

    def refuse_unverified(self, due: dict[str, str]) -> None:
        """Never use again, while listed, the servers ``{url: why}`` that kept serving other weights than the
        published ones (their requests out are asked again; an error line each).

        Raises:
            ServedWeightsUnverified: none is left in use or benched (and at each :meth:`look` from then on).
        """
        for url, why in due.items():
            self.settle(self.lose([url], "refused: its weights are not the published ones"))
            self.pool.refuse(url, why)
            log.error("refused: %s", why)
        if not self.pool.clients and not self.pool.benched:
            self.unusable = "no rollout server left to use: " + "; ".join(self.pool.refused.values())
            raise ServedWeightsUnverified(self.unusable)

    async def set(self, urls: list[str]) -> None:
        """Replace the endpoints with ``urls``; new ones get the current weights first.

        Requests in flight on a removed endpoint are cancelled at once and their members requested
        again (served before new tasks, not counted against ``rollout.max_group_retries``): a lost
        node's requests do not wait for a timeout.

        Once :attr:`checking`, a new server's vLLM version is read first (:meth:`vet`): one outside rlrun's pins is
        refused, with an error log line naming it and the versions, and never used while it is listed.

        Raises:
            WeightsError, RolloutError: a new server could not be given the current weights.
        """
        change = self.pool.set_endpoints(urls)
        lost = self.lose(change.removed, "removed")
        self.settle(lost)  # before any await: no snapshot sees them neither in flight nor requested
        if lost:
            log.info(
                "cancelled %d requests in flight on removed endpoints %s; their members are requested again",
                len(lost),
                change.removed,
            )
        added = change.added
        if self.checking:
            for why in (await self.vet(added)).values():
                log.error("refused: %s", why)
            added = [c for c in added if self.pool.clients.get(c.base_url) is c]  # neither refused nor benched
        self.bench(await self.weights.catch_up(added))

    async def start(self, timeout_s: float, stop: asyncio.Event) -> None:
        """The first endpoints, before the attempt begins: wait until they are healthy (:func:`wait_until_healthy`),
        then read their vLLM versions together (:meth:`vet`), unless ``stop`` was set meanwhile; from here on each
        server added is read as it comes (:attr:`checking`).

        Raises:
            DispatchError: endpoints still unhealthy ``timeout_s`` seconds after they were set.
            UnsupportedVersion: a server's vLLM is outside rlrun's pins, or it reports none (the line of the first,
                the others' URLs after it): the orchestrator cannot run with the servers it was given.
            PinsError: rlrun's package metadata pins vLLM inconsistently.
        """
        await wait_until_healthy(self.pool, timeout_s, stop)
        if stop.is_set():
            return
        self.checking = True
        refused = await self.vet(list(self.pool.clients.values()))
        if refused:
            first, *others = refused
            also = f" (also refused: {', '.join(others)})" if others else ""
            raise UnsupportedVersion(f"{refused[first]}{also}")

    async def vet(self, clients: list[RolloutClient]) -> dict[str, str]:
        """Read the vLLM version of each server of ``clients`` not read yet, all at once (``GET /version``, at most
        :data:`VERSION_READ_S` each; :func:`rlrun.versions.check_served`), and refuse those outside rlrun's pins
        (:meth:`RolloutPool.refuse`); returns them, URL → the line saying why. No request goes to a server while it
        is read (:attr:`RolloutPool.vetting`). One in use that cannot be read (no answer, an error status) is
        benched: it is read again when it answers (:meth:`rejoin_benched`). Once admitted, a URL is never read again.

        Raises:
            PinsError: rlrun's package metadata pins vLLM inconsistently.
        """
        new = [c for c in clients if c.base_url not in self._vetted]
        urls = {c.base_url for c in new}
        self.pool.vetting |= urls
        try:
            answers = await asyncio.gather(*(within(c.version(), VERSION_READ_S) for c in new), return_exceptions=True)
        finally:
            self.pool.vetting -= urls
        refused: dict[str, str] = {}
        unread: dict[str, str] = {}
        for client, answer in zip(new, answers, strict=True):
            url = client.base_url
            if url not in self.pool.clients and url not in self.pool.benched:
                continue  # removed meanwhile: nothing to decide
            # RolloutError: an error status; RuntimeError: its client closed meanwhile
            if isinstance(answer, (httpx.HTTPError, RuntimeError, asyncio.TimeoutError)):
                unread[url] = f"GET /version: {type(answer).__name__}" + (f": {answer}" if str(answer) else "")
                continue
            if isinstance(answer, BaseException):
                raise answer
            try:
                check_served(url, answer)
            except UnsupportedVersion as exc:
                refused[url] = str(exc)
                self.pool.refuse(url, str(exc))
            else:
                self._vetted.add(url)
        self.bench({url: why for url, why in unread.items() if url in self.pool.clients})
        return refused

    async def look(self) -> None:
        """The membership's periodic look (the orchestrator's follower loop): :meth:`catch_up_lagging`, then
        :meth:`rejoin_benched`; it raises :meth:`refuse_unverified`'s error once no server is left to use (a
        refusal in ``PUT /rollout-endpoints`` fails that request, not the run: the run stops here)."""
        if self.unusable is not None:
            raise ServedWeightsUnverified(self.unusable)
        await self.catch_up_lagging()
        await self.rejoin_benched()

    async def catch_up_lagging(self) -> None:
        """Give the servers in use that hold an older policy than the current one the current weights: one
        caught up to ``v`` while the update to ``v + 1`` went to the servers listed when it began holds ``v``
        and gets no request until then."""
        lagging = [c for c in self.pool.clients.values() if c.loaded_version < self.weights.version]
        if lagging:
            log.info("catching up rollout servers %s to policy %d", [c.base_url for c in lagging], self.weights.version)
            self.bench(await self.weights.catch_up(lagging))
            self.capacity()

    def bench(self, unreachable: dict[str, str]) -> None:
        """Take rollout servers that missed a weight update (``{url: error}``) out of use; their requests
        are asked again."""
        for url, error in unreachable.items():
            lost = self.lose([url], f"benched ({error})") if self.pool.bench(url, error) else []
            self.settle(lost)  # before any await, as for a removed endpoint
            log.warning(
                "rollout server %s benched until it answers and has policy %d; %d requests on it asked again",
                url,
                self.weights.version,
                len(lost),
            )

    async def rejoin_benched(self) -> None:
        """Give each benched rollout server that answers ``/health`` the current weights, then use it again
        (tried at most every :data:`REJOIN_EVERY_S` per server)."""
        now = time.monotonic()
        for url in list(self.pool.benched):
            if now - self._rejoin_tried.get(url, -1e18) < REJOIN_EVERY_S:
                continue
            self._rejoin_tried[url] = now
            client = self.pool.client_factory(url)
            try:
                rejoined = (
                    await client.healthy()
                    and await self._admitted(client)
                    and not await self.weights.catch_up([client])
                    and self.pool.rejoin(client)
                )
            except RolloutError as exc:  # it answers but cannot reload yet: it stays benched, asked again later
                log.warning("benched rollout server %s could not catch up: %s", url, exc)
                rejoined = False
            if rejoined:
                log.info("rollout server %s rejoined with policy %d", url, self.weights.version)
                self.capacity()
            else:
                await client.aclose()

    async def _admitted(self, client: RolloutClient) -> bool:
        """Whether benched server ``client`` serves a vLLM within rlrun's pins: read once (:meth:`vet`; it was benched
        before it could be read), refused (logged) when it does not; False while it cannot be read."""
        if client.base_url not in self._vetted:
            for why in (await self.vet([client])).values():
                log.error("refused: %s", why)
        return client.base_url in self._vetted
