"""An in-process stand-in for vLLM's HTTP API, for tests and benchmarks of the orchestrator.

:func:`fake_vllm_transport` returns an ``httpx.MockTransport`` that answers the routes the
orchestrator uses. Completions of a reverse-text prompt (text + one separator token) are
the text reversed with each token replaced at random with probability ``error_rate``,
then EOS, so rewards and group rejections resemble a real run's. With ``samples_per_s``
set, completions are served at that aggregate rate (a model of a real server's
throughput); without it they are instant.
"""

from __future__ import annotations

import asyncio
import json
import random

import httpx

from rlrun.rollout.client import RolloutClient


def fake_vllm_transport(
    samples_per_s: float | None = None,
    error_rate: float = 0.2,
    eos_id: int = 0,
    vocab: range = range(2, 97),
    seed: int = 0,
) -> httpx.MockTransport:
    """A transport answering ``/v1/completions``, ``/collective_rpc`` and the admin routes."""
    rng = random.Random(seed)
    clock = {"free_at": 0.0}

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/completions":
            body = json.loads(request.content)
            n = body.get("n", 1)
            if samples_per_s:
                loop = asyncio.get_running_loop()
                clock["free_at"] = max(clock["free_at"], loop.time()) + n / samples_per_s
                await asyncio.sleep(clock["free_at"] - loop.time())
            answer = body["prompt"][-2::-1]
            choices = []
            for i in range(n):
                ids = [rng.choice(vocab) if rng.random() < error_rate else t for t in answer] + [eos_id]
                choices.append(
                    {
                        "index": i,
                        "token_ids": ids,
                        "logprobs": {"token_logprobs": [-0.1] * len(ids)},
                        "finish_reason": "stop",
                    }
                )
            return httpx.Response(200, json={"choices": choices})
        if request.url.path == "/collective_rpc":
            return httpx.Response(200, json={"results": [{"ok": True}]})
        return httpx.Response(200, json={})

    return httpx.MockTransport(handler)


def fake_client_factory(**kwargs):
    """A ``client_factory`` for the Orchestrator/Dispatcher whose clients all share one fake server."""
    transport = fake_vllm_transport(**kwargs)
    return lambda url: RolloutClient(url, transport=transport)
