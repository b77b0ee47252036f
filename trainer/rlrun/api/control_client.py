"""The one client of the orchestrator's control server (``rlrun.orchestrator.control``): the operator's,
``rlrun local``'s and the tests'.

Each call is one HTTP request with the run's bearer token and a short timeout; the answer
is parsed into the contract's model (:mod:`rlrun.api.control`), so the operator reads the
same typed fields the orchestrator wrote. Every failure (no answer, an HTTP error, an
answer that is not the contract's) surfaces as :class:`ControlError`, so handlers can report
"orchestrator unreachable" without a traceback. Retrying is the caller's business (the
status timer simply tries again at its next tick). Asynchronous: the operator keeps one per run
in its event loop; a synchronous caller (``rlrun local``) runs one call at a time with
:func:`call_control`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from rlrun.api.control import EndpointsUpdate, PauseResult, StatusReport

_Answer = TypeVar("_Answer", bound=BaseModel)
_T = TypeVar("_T")


class ControlError(RuntimeError):
    """The orchestrator could not be reached, refused the request, or answered outside the contract."""


class ControlClient:
    """Talks to one run's orchestrator at ``base_url`` with bearer ``token``.

    Args:
        base_url: the control server, ``http://host:port`` (a trailing ``/`` is dropped).
        token: the run's bearer token.
        timeout_s: seconds to wait for an answer (``pause`` passes its own).
        transport: an ``httpx`` transport (tests); None: the network.
    """

    def __init__(self, base_url: str, token: str, timeout_s: float = 5.0, transport=None) -> None:
        self.base_url = base_url.rstrip("/")
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            headers={"Authorization": f"Bearer {token}"},
            timeout=timeout_s,
            transport=transport,
        )

    async def _call(
        self, answer: type[_Answer], method: str, path: str, timeout_s: float | None = None, **kwargs: Any
    ) -> _Answer:
        route = f"{method} {self.base_url}{path}"
        try:
            extra = {"timeout": timeout_s} if timeout_s is not None else {}
            resp = await self._http.request(method, path, **kwargs, **extra)
        except httpx.TimeoutException as exc:
            waited = timeout_s if timeout_s is not None else self._http.timeout.read
            raise ControlError(f"{route}: no answer within {waited} s ({type(exc).__name__})") from None
        except httpx.HTTPError as exc:
            raise ControlError(f"{route}: {type(exc).__name__}: {exc}") from None
        if resp.status_code != 200:
            raise ControlError(f"{route}: HTTP {resp.status_code}: {resp.text[:200]}")
        try:
            return answer.model_validate_json(resp.content)
        except ValidationError as exc:
            first = exc.errors()[0]
            field = ".".join(str(part) for part in first["loc"]) or "<root>"
            raise ControlError(
                f"{route}: the answer is not a {answer.__name__}: {field}: {first['msg']}"
                + (f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else "")
            ) from None

    async def status(self) -> StatusReport:
        """``GET /status``: phase, step, policy version, queue sizes, resume report, endpoints.

        Raises:
            ControlError: no answer, an HTTP error, or an answer that is not a :class:`StatusReport`.
        """
        return await self._call(StatusReport, "GET", "/status")

    async def pause(self, timeout_s: float) -> PauseResult:
        """``POST /pause``: stop and write the snapshot; waits up to ``timeout_s`` seconds for it.

        Raises:
            ControlError: no answer in time, an HTTP error, or an answer that is not a :class:`PauseResult`.
        """
        return await self._call(PauseResult, "POST", "/pause", timeout_s=timeout_s)

    async def set_endpoints(self, endpoints: list[str]) -> list[str]:
        """``PUT /rollout-endpoints``: replace the orchestrator's set of rollout servers; returns the set it took.

        Raises:
            ControlError: no answer, an HTTP error, or an answer that is not an :class:`EndpointsUpdate`.
        """
        body = EndpointsUpdate(endpoints=endpoints).model_dump(mode="json")
        return (await self._call(EndpointsUpdate, "PUT", "/rollout-endpoints", json=body)).endpoints

    async def aclose(self) -> None:
        """Close the HTTP connections (the client cannot be used afterwards)."""
        await self._http.aclose()


def call_control(
    base_url: str, token: str, call: Callable[[ControlClient], Awaitable[_T]], timeout_s: float = 5.0
) -> _T:
    """Run one ``call`` (e.g. ``lambda c: c.status()``) with a client of its own, from synchronous code.

    Raises:
        ControlError: as the call does.
    """

    async def once() -> _T:
        client = ControlClient(base_url, token, timeout_s=timeout_s)
        try:
            return await call(client)
        finally:
            await client.aclose()

    return asyncio.run(once())
