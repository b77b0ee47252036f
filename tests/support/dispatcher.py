"""A :class:`~rlrun.orchestrator.dispatcher.Dispatcher` over fake rollout transports, with a one-character tokenizer,
and the faulty rollout servers the dispatcher, endpoint and liveness tests share."""

from __future__ import annotations

import asyncio

import httpx
from rlrun.api.spec import SamplingSpec
from rlrun.envs import ReverseTextEnv
from rlrun.orchestrator.dispatcher import Dispatcher
from rlrun.orchestrator.episodes import EpisodeBuilder
from rlrun.orchestrator.groups import GroupResult
from rlrun.rollout.client import RolloutClient
from rlrun.rollout.fake import fake_vllm_transport

ENV = ReverseTextEnv()
CHARS = {c: i + 2 for i, c in enumerate("abcdefghijklmnopqrstuvwxyz= ")}
IDS = {i: c for c, i in CHARS.items()}


def make_dispatcher(
    transports: dict[str, httpx.AsyncBaseTransport],
    members_per_request=None,
    retry_window_s=5.0,
    timeout_s=30.0,
    envs: list | None = None,
):
    """A dispatcher over ``transports`` (URL → transport) of ``envs`` (default: reverse-text), its results'
    queue."""
    results: asyncio.Queue[GroupResult] = asyncio.Queue()
    dispatcher = Dispatcher(
        list(transports),
        episodes=EpisodeBuilder(
            encode=lambda text: [CHARS[c] for c in text],
            decode=lambda ids: "".join(IDS.get(i, "?") for i in ids),
            eos_id=0,
            envs={env.name: env for env in envs or [ENV]},
        ),
        sampling=SamplingSpec(max_tokens=8),
        results=results,
        retry_window_s=retry_window_s,
        client_factory=lambda url: RolloutClient(url, transport=transports[url]),
        members_per_request=members_per_request,
        request_timeout_s=timeout_s,
    )
    return dispatcher, results


async def drain(results: asyncio.Queue, count: int, timeout: float = 5.0) -> list[GroupResult]:
    """The next ``count`` results of a dispatcher's queue (each within ``timeout`` seconds)."""
    return [await asyncio.wait_for(results.get(), timeout) for _ in range(count)]


def never_answers() -> httpx.MockTransport:
    """A rollout server that takes every request and never answers (hung, or a straggler)."""

    async def hang(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(3600)
        raise AssertionError("never answered")

    return httpx.MockTransport(hang)


class Mute(httpx.AsyncBaseTransport):
    """A server that takes completion requests and never answers them while its ``/metrics`` says it runs
    ``running`` requests (0: it lost them, issue 26; None: it has no ``/metrics``)."""

    def __init__(self, running: int | None = 0, started_at: float | None = None) -> None:
        self.inner = fake_vllm_transport(error_rate=0.3)
        self.running = running
        self.started_at = started_at  # its process_start_time_seconds (None: not reported)
        self.taken = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/completions":
            self.taken += 1
            await asyncio.sleep(3600)
        if request.url.path == "/metrics":
            if self.running is None:
                return httpx.Response(404, text="Not Found")
            text = f'vllm:num_requests_running{{model_name="policy"}} {self.running}\n'
            if self.started_at is not None:
                text += f"process_start_time_seconds {self.started_at}\n"
            return httpx.Response(200, text=text)
        return await self.inner.handle_async_request(request)
