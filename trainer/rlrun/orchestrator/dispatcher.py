"""Dispatcher: turns group requests into rollouts on the rollout servers.

Guarantee: every dispatched group reaches the results queue exactly once — as a
:class:`GroupResult` with its episodes, or not at all because it was cancelled
(counted in ``cancelled_groups``) — and each episode carries the policy version
that was current when its group was dispatched. One request with ``n = members``
samples a whole group (they share the prompt) unless ``rollout.members_per_request``
splits it, so that members finish at different times; requests go to the endpoint with
the fewest samples in flight, and a transport failure is retried (tenacity) on
whichever endpoint is then least loaded, so losing one rollout server only delays
its groups. The endpoint set can be replaced at run time (:meth:`set_endpoints`).
A cancelled request reaches the sink as a
:class:`~rlrun.orchestrator.cancellation.GroupCancellation` (:meth:`Dispatcher.cancel_stale`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_exponential

from rlrun.api.spec import RLRunSpec, SamplingSpec
from rlrun.envs.base import Env
from rlrun.orchestrator.cancellation import GroupCancellation
from rlrun.orchestrator.errors import OrchestratorError
from rlrun.orchestrator.groups import GroupRequest
from rlrun.rollout.client import RolloutClient, RolloutError
from rlrun.samples import Episode

log = logging.getLogger(__name__)


@dataclass
class GroupResult:
    """Finished members of one group request."""

    request: GroupRequest
    episodes: list[Episode]
    tokens: int


def _key(request: GroupRequest) -> tuple[int, int]:
    return (request.group_id, request.first_member)


@dataclass
class _Inflight:
    task: asyncio.Task
    request: GroupRequest
    policy_version: int


class DispatchError(OrchestratorError):
    """The rollout servers cannot be used (message names them and says what to do)."""


class Dispatcher:
    """Runs group requests against a set of rollout endpoints.

    Args:
        endpoints: base URLs of the rollout servers.
        encode: ``encode(text: str) -> list[int]``, the tokenizer without special tokens.
        decode: ``decode(ids: list[int]) -> str``, without special tokens (for the reward).
        eos_id: end-of-sequence token id (completion text is decoded up to it).
        envs: env by name, for rewards.
        sampling: sampling parameters.
        results: the ``asyncio.Queue[GroupResult]`` finished requests go to.
        retry_for_s: how long a request keeps retrying transport errors before the error propagates
            (into :attr:`failures`), seconds.
        client_factory: ``client_factory(url: str) -> RolloutClient`` for each endpoint (tests and
            benchmarks pass fakes).
        members_per_request: split a group into requests of at most this many members (None: one request).
    """

    def __init__(
        self,
        endpoints: list[str],
        encode: Callable[[str], list[int]],
        decode: Callable[[list[int]], str],
        eos_id: int,
        envs: dict[str, Env],
        sampling: SamplingSpec,
        results: asyncio.Queue[GroupResult],
        retry_for_s: float = 120.0,
        client_factory: Callable[[str], RolloutClient] = RolloutClient,
        members_per_request: int | None = None,
    ) -> None:
        self.client_factory = client_factory
        self.clients: dict[str, RolloutClient] = {}
        self.load: dict[str, int] = {}
        self.set_endpoints(endpoints)
        self.encode = encode
        self.decode = decode
        self.eos_id = eos_id
        self.envs = envs
        self.sampling = sampling
        self.results = results
        self.retry_for_s = retry_for_s
        self.members_per_request = members_per_request
        self.inflight: dict[tuple[int, int], _Inflight] = {}
        # results put on the queue and not yet taken by the consumer, by (group id, first member)
        self.undelivered: dict[tuple[int, int], GroupRequest] = {}
        self.cancelled_groups = 0
        self.failures: list[BaseException] = []

    @classmethod
    def for_tokenizer(
        cls,
        tokenizer: Any,
        endpoints: list[str],
        envs: dict[str, Env],
        spec: RLRunSpec,
        results: asyncio.Queue[GroupResult],
        client_factory: Callable[[str], RolloutClient] = RolloutClient,
    ) -> Dispatcher:
        """The dispatcher of a run: encode/decode and EOS from a Hugging Face ``tokenizer``, sampling and
        ``members_per_request`` from ``spec``."""
        return cls(
            endpoints,
            encode=lambda text: tokenizer.encode(text, add_special_tokens=False),
            decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
            eos_id=tokenizer.eos_token_id,
            envs=envs,
            sampling=spec.sampling,
            results=results,
            client_factory=client_factory,
            members_per_request=spec.rollout.members_per_request,
        )

    def set_endpoints(self, endpoints: list[str]) -> None:
        """Replace the endpoint set; requests in flight on removed endpoints finish or fail and retry."""
        wanted = [e.rstrip("/") for e in endpoints]
        for url in list(self.clients):
            if url not in wanted:
                client = self.clients.pop(url)
                self.load.pop(url, None)
                asyncio.get_event_loop().create_task(client.aclose())
        for url in wanted:
            if url not in self.clients:
                self.clients[url] = self.client_factory(url)
                self.load[url] = 0

    async def wait_until_healthy(self, timeout_s: float, stop: asyncio.Event) -> None:
        """Wait until every endpoint answers ``/health``; with none yet, wait for endpoints to be set.

        On Kubernetes the operator sends the endpoints once rollout pods are ready, which may take
        as long as scheduling a GPU node: that wait has no deadline (the operator reports it).
        Returns early once ``stop`` is set.

        Raises:
            DispatchError: endpoints still unhealthy ``timeout_s`` seconds after they were set.
        """
        noted = time.monotonic()
        while not self.clients and not stop.is_set():
            if time.monotonic() - noted > 30:
                log.info("waiting for rollout endpoints (PUT /rollout-endpoints on the control server)")
                noted = time.monotonic()
            await asyncio.sleep(0.2)
        deadline = time.monotonic() + timeout_s
        pending = set(self.clients)
        while pending and not stop.is_set():
            pending &= set(self.clients)  # endpoints removed meanwhile are not waited for
            for url in list(pending):
                if await self.clients[url].healthy():
                    pending.discard(url)
            if pending:
                if time.monotonic() > deadline:
                    raise DispatchError(f"rollout servers not healthy after {timeout_s:.0f} s: {sorted(pending)}")
                await asyncio.sleep(1.0)

    @property
    def inflight_samples(self) -> int:
        """Completions requested and not yet returned."""
        return sum(f.request.members for f in self.inflight.values())

    @property
    def outstanding_samples(self) -> int:
        """Samples dispatched that the consumer has not yet taken: in flight or waiting in the queue."""
        return self.inflight_samples + sum(r.members for r in self.undelivered.values())

    def emitted_requests(self) -> list[GroupRequest]:
        """Requests dispatched whose results have not reached the consumer (in flight or queued).

        These are ``emitted_train_groups`` of a sink snapshot: their results are not saved,
        so a resume re-requests them (same task, same group id).
        """
        return [f.request for f in self.inflight.values()] + list(self.undelivered.values())

    def take(self, result: GroupResult) -> GroupResult:
        """Mark ``result`` (got from the results queue) as taken by the consumer."""
        key = _key(result.request)
        self.undelivered.pop(key, None)
        # The task's done-callback may not have run yet; the request is no longer in flight either way,
        # and a snapshot must not list it as emitted once its episodes are in the sink.
        self.inflight.pop(key, None)
        return result

    def dispatch(self, request: GroupRequest, policy_version: int) -> None:
        """Start rolling out ``request`` with the current policy ``policy_version``, in requests of at most
        ``members_per_request`` members (each a :class:`GroupRequest` of its own, same group id)."""
        size = self.members_per_request or request.members
        for first in range(request.first_member, request.next_member, size):
            part = GroupRequest(request.group_id, request.task, min(size, request.next_member - first), first)
            task = asyncio.get_running_loop().create_task(self._run(part, policy_version))
            self.inflight[_key(part)] = _Inflight(task, part, policy_version)
            task.add_done_callback(lambda t, key=_key(part): self._done(key, t))

    def _done(self, key: tuple[int, int], task: asyncio.Task) -> None:
        entry = self.inflight.get(key)
        if entry is not None and entry.task is task:
            del self.inflight[key]
        if not task.cancelled() and task.exception() is not None:
            self.failures.append(task.exception())

    def _pick(self, failed: set[str]) -> str:
        """The least-loaded endpoint, avoiding those that failed this request while others remain."""
        if not self.clients:
            raise RolloutError("no rollout endpoints")
        candidates = [u for u in self.load if u not in failed] or list(self.load)
        return min(candidates, key=self.load.__getitem__)

    async def _run(self, request: GroupRequest, policy_version: int) -> None:
        prompt_ids = self.encode(request.task.prompt)
        failed: set[str] = set()  # endpoints that failed this request: a healthy one is tried first
        async for attempt in AsyncRetrying(
            retry=retry_if_exception_type((httpx.TransportError, RolloutError)),
            stop=stop_after_delay(self.retry_for_s),
            wait=wait_exponential(multiplier=0.5, max=5),
            reraise=True,
        ):
            with attempt:
                url = self._pick(failed)
                self.load[url] += request.members
                try:
                    completions = await self.clients[url].complete(prompt_ids, self.sampling, n=request.members)
                except (httpx.TransportError, RolloutError) as exc:
                    failed.add(url)
                    log.warning("group %d on %s failed (%s); retrying", request.group_id, url, exc)
                    raise
                finally:
                    if url in self.load:
                        self.load[url] -= request.members
        env = self.envs[request.task.env]
        prompt = array("q", prompt_ids)
        episodes = []
        for k, c in enumerate(completions):
            ids = c.token_ids[: c.token_ids.index(self.eos_id)] if self.eos_id in c.token_ids else c.token_ids
            episodes.append(
                Episode(
                    group_id=request.group_id,
                    member=request.first_member + k,
                    task=request.task,
                    prompt_ids=prompt,
                    completion_ids=array("q", c.token_ids),
                    logprobs=array("d", c.logprobs),
                    policy_version=policy_version,
                    reward=env.reward(request.task, self.decode(ids)),
                    finish_reason=c.finish_reason,
                )
            )
        self.undelivered[_key(request)] = request
        self.results.put_nowait(GroupResult(request, episodes, sum(len(c.token_ids) for c in completions)))

    def cancel_stale(self, min_version: int) -> list[GroupCancellation]:
        """Cancel in-flight requests dispatched before policy ``min_version`` (they can no longer train).

        Returns one :class:`GroupCancellation` per cancelled request, in dispatch order, each saying
        whether other requests of its group are still out once all of them are cancelled.
        """
        cancelled = []
        for entry in list(self.inflight.values()):
            if entry.policy_version < min_version:
                entry.task.cancel()
                del self.inflight[_key(entry.request)]
                cancelled.append(entry.request)
        self.cancelled_groups += len(cancelled)
        out = {r.group_id for r in self.emitted_requests()}
        return [GroupCancellation(r, min_version, r.group_id in out) for r in cancelled]

    async def aclose(self) -> None:
        """Cancel everything in flight and close the HTTP clients."""
        tasks = [e.task for e in self.inflight.values()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.inflight.clear()
        for c in self.clients.values():
            await c.aclose()
