"""A :class:`~rlrun.orchestrator.dispatcher.Dispatcher` over fake rollout transports, with a one-character tokenizer."""

from __future__ import annotations

import asyncio

import httpx
from rlrun.api.spec import SamplingSpec
from rlrun.envs import ReverseTextEnv
from rlrun.orchestrator.dispatcher import Dispatcher
from rlrun.orchestrator.episodes import EpisodeBuilder
from rlrun.orchestrator.groups import GroupResult
from rlrun.rollout.client import RolloutClient

ENV = ReverseTextEnv()
CHARS = {c: i + 2 for i, c in enumerate("abcdefghijklmnopqrstuvwxyz= ")}
IDS = {i: c for c, i in CHARS.items()}


def make_dispatcher(
    transports: dict[str, httpx.AsyncBaseTransport], members_per_request=None, retry_window_s=5.0, timeout_s=30.0
):
    results: asyncio.Queue[GroupResult] = asyncio.Queue()
    dispatcher = Dispatcher(
        list(transports),
        episodes=EpisodeBuilder(
            encode=lambda text: [CHARS[c] for c in text],
            decode=lambda ids: "".join(IDS.get(i, "?") for i in ids),
            eos_id=0,
            envs={ENV.name: ENV},
        ),
        sampling=SamplingSpec(max_tokens=8),
        results=results,
        retry_window_s=retry_window_s,
        client_factory=lambda url: RolloutClient(url, transport=transports[url]),
        members_per_request=members_per_request,
        request_timeout_s=timeout_s,
    )
    return dispatcher, results
