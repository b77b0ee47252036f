"""Dispatcher: turns group requests into rollouts on the rollout servers.

Guarantee: every dispatched group reaches the results queue exactly once — as a
:class:`GroupResult` with its episodes, or not at all because it was cancelled
(counted in ``cancelled_groups``) — and each episode carries the policy version
that was current when its group was dispatched. One request with ``n = members``
samples a whole group (they share the prompt); requests go to the endpoint with
the fewest samples in flight, and a transport failure is retried (tenacity) on
whichever endpoint is then least loaded, so losing one rollout server only delays
its groups. The endpoint set can be replaced at run time (:meth:`set_endpoints`).
"""

from __future__ import annotations

import asyncio
import logging
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
        self.inflight: dict[int, _Inflight] = {}
        self.undelivered_samples = 0  # in results put on the queue and not yet taken
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
        return self.inflight_samples + self.undelivered_samples

    def take(self, result: GroupResult) -> GroupResult:
        """Mark ``result`` (got from the results queue) as taken by the consumer."""
        self.undelivered_samples -= len(result.episodes)
        return result

    def dispatch(self, request: GroupRequest, policy_version: int) -> None:
        """Start rolling out ``request`` with the current policy ``policy_version``."""
        task = asyncio.get_running_loop().create_task(self._run(request, policy_version))
        self.inflight[request.group_id] = _Inflight(task, request, policy_version)
        task.add_done_callback(lambda t, gid=request.group_id: self._done(gid, t))

    def _done(self, group_id: int, task: asyncio.Task) -> None:
        entry = self.inflight.get(group_id)
        if entry is not None and entry.task is task:
            del self.inflight[group_id]
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
        episodes = []
        for k, c in enumerate(completions):
            ids = c.token_ids[: c.token_ids.index(self.eos_id)] if self.eos_id in c.token_ids else c.token_ids
            member = request.first_member + k
            episodes.append(
                Episode(
                    episode_id=f"{request.group_id}/{member}",
                    group_id=request.group_id,
                    task=request.task,
                    prompt_ids=prompt_ids,
                    completion_ids=c.token_ids,
                    logprobs=c.logprobs,
                    policy_version=policy_version,
                    reward=env.reward(request.task, self.decode(ids)),
                    finish_reason=c.finish_reason,
                )
            )
        self.undelivered_samples += len(episodes)
        self.results.put_nowait(GroupResult(request, episodes, sum(len(c.token_ids) for c in completions)))

    def cancel_stale(self, min_version: int) -> int:
        """Cancel in-flight groups dispatched before policy ``min_version`` (they can no longer train)."""
        n = 0
        for entry in list(self.inflight.values()):
            if entry.policy_version < min_version:
                entry.task.cancel()
                del self.inflight[entry.request.group_id]
                n += 1
        self.cancelled_groups += n
        return n

    async def aclose(self) -> None:
        """Cancel everything in flight and close the HTTP clients."""
        tasks = [e.task for e in self.inflight.values()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.inflight.clear()
        for c in self.clients.values():
            await c.aclose()
