"""Client of the orchestrator's control server (``rlrun.orchestrator.control``), used by the operator.

Each call is one HTTP request with the run's bearer token and a short timeout; errors
surface as :class:`ControlError` so handlers can report "orchestrator unreachable"
without a traceback. Retrying is the caller's business (the status timer simply
tries again at its next tick).
"""

from __future__ import annotations

from typing import Any

import httpx


class ControlError(RuntimeError):
    """The orchestrator could not be reached or refused the request."""


class ControlClient:
    """Talks to one run's orchestrator at ``base_url`` with bearer ``token``."""

    def __init__(self, base_url: str, token: str, timeout_s: float = 5.0, transport=None) -> None:
        self.base_url = base_url.rstrip("/")
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            headers={"Authorization": f"Bearer {token}"},
            timeout=timeout_s,
            transport=transport,
        )

    async def _call(self, method: str, path: str, timeout_s: float | None = None, **kwargs) -> dict[str, Any]:
        try:
            extra = {"timeout": timeout_s} if timeout_s is not None else {}
            resp = await self._http.request(method, path, **kwargs, **extra)
        except httpx.TimeoutException as exc:
            waited = timeout_s if timeout_s is not None else self._http.timeout.read
            raise ControlError(
                f"{method} {self.base_url}{path}: no answer within {waited} s ({type(exc).__name__})"
            ) from None
        except httpx.HTTPError as exc:
            raise ControlError(f"{method} {self.base_url}{path}: {type(exc).__name__}: {exc}") from None
        if resp.status_code != 200:
            raise ControlError(f"{method} {self.base_url}{path}: HTTP {resp.status_code}: {resp.text[:200]}")
        return resp.json()

    async def status(self) -> dict[str, Any]:
        """``GET /status``: step, policy version, queue sizes, resume report, endpoints."""
        return await self._call("GET", "/status")

    async def pause(self, timeout_s: float) -> dict[str, Any]:
        """``POST /pause``: stop and write the snapshot; waits up to ``timeout_s`` seconds for it."""
        return await self._call("POST", "/pause", timeout_s=timeout_s)

    async def set_endpoints(self, endpoints: list[str]) -> dict[str, Any]:
        """``PUT /rollout-endpoints``: replace the orchestrator's set of rollout servers."""
        return await self._call("PUT", "/rollout-endpoints", json={"endpoints": endpoints})

    async def aclose(self) -> None:
        """Close the HTTP connections (the client cannot be used afterwards)."""
        await self._http.aclose()
