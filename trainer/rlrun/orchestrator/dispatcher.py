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
"""

from __future__ import annotations

import asyncio
import logging
from array import array
from dataclasses import dataclass

import httpx
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_exponential

from rlrun.envs.base import Env
from rlrun.orchestrator.types import Episode, GroupRequest
from rlrun.rollout.client import RolloutClient, RolloutError
from rlrun.spec import SamplingSpec

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


class Dispatcher:
    """Runs group requests against a set of rollout endpoints.

    Args:
        endpoints: base URLs of the rollout servers.
        encode / decode: tokenizer functions (text → ids, ids → text without special tokens).
        eos_id: end-of-sequence token id (completion text is decoded up to it).
        envs: env by name, for rewards.
        sampling: sampling parameters.
        results: where finished groups go.
        retry_for_s: how long a group keeps retrying transport errors before the error propagates.
        client_factory: makes the client of an endpoint URL (tests and benchmarks pass fakes).
        members_per_request: split a group into requests of at most this many members (None: one request).
    """

    def __init__(
        self,
        endpoints: list[str],
        encode,
        decode,
        eos_id: int,
        envs: dict[str, Env],
        sampling: SamplingSpec,
        results: asyncio.Queue,
        retry_for_s: float = 120.0,
        client_factory=RolloutClient,
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

    @property
    def inflight_samples(self) -> int:
        """Completions requested and not yet returned."""
        return sum(f.request.n for f in self.inflight.values())

    @property
    def outstanding_samples(self) -> int:
        """Samples dispatched that the consumer has not yet taken: in flight or waiting in the queue."""
        return self.inflight_samples + sum(r.n for r in self.undelivered.values())

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
        size = self.members_per_request or request.n
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

    def _pick(self) -> str:
        if not self.clients:
            raise RolloutError("no rollout endpoints")
        return min(self.load, key=self.load.__getitem__)

    async def _run(self, request: GroupRequest, policy_version: int) -> None:
        prompt_ids = self.encode(request.task.prompt)
        async for attempt in AsyncRetrying(
            retry=retry_if_exception_type((httpx.TransportError, RolloutError)),
            stop=stop_after_delay(self.retry_for_s),
            wait=wait_exponential(multiplier=0.5, max=5),
            reraise=True,
        ):
            with attempt:
                url = self._pick()
                self.load[url] += request.n
                try:
                    completions = await self.clients[url].complete(prompt_ids, self.sampling, n=request.n)
                except (httpx.TransportError, RolloutError) as exc:
                    log.warning("group %d on %s failed (%s); retrying", request.group_id, url, exc)
                    raise
                finally:
                    if url in self.load:
                        self.load[url] -= request.n
        env = self.envs[request.task.env]
        prompt = array("q", prompt_ids)
        episodes = []
        for k, c in enumerate(completions):
            ids = c.token_ids[: c.token_ids.index(self.eos_id)] if self.eos_id in c.token_ids else c.token_ids
            member = request.first_member + k
            episodes.append(
                Episode(
                    episode_id=f"{request.group_id}/{member}",
                    group_id=request.group_id,
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

    def cancel_stale(self, min_version: int) -> list[GroupRequest]:
        """Cancel in-flight groups dispatched before policy ``min_version`` (they can no longer train)."""
        cancelled = []
        for entry in list(self.inflight.values()):
            if entry.policy_version < min_version:
                entry.task.cancel()
                del self.inflight[_key(entry.request)]
                cancelled.append(entry.request)
        self.cancelled_groups += len(cancelled)
        return cancelled

    async def aclose(self) -> None:
        """Cancel everything in flight and close the HTTP clients."""
        tasks = [e.task for e in self.inflight.values()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.inflight.clear()
        for c in self.clients.values():
            await c.aclose()
