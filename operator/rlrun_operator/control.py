"""The operator's control clients: one per run, its bearer token read from the run's Secret once.

The client itself is the one every caller uses (:class:`rlrun.api.control_client.ControlClient`);
this cache belongs to the reconciler's event loop (a restarted operator builds a new one). A run's
orchestrator is reached at ``settings.orchestrator_url`` (its Service in the cluster): when that
changes, or the Secret is recreated with a new token, the run's client is made again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from rlrun.api.control_client import ControlClient

from rlrun_operator import naming
from rlrun_operator.kube import Kube
from rlrun_operator.settings import OperatorSettings


class ControlClients:
    """The runs' control clients and the tokens this process knows.

    Args:
        kube: returns the API wrapper (built lazily by the handlers).
        settings: returns the operator's settings in force (``orchestrator_url``, ``request_timeout_seconds``).
    """

    def __init__(self, kube: Callable[[], Kube], settings: Callable[[], OperatorSettings]) -> None:
        self.kube = kube
        self.settings = settings
        self.clients: dict[tuple[str, str], ControlClient] = {}
        self.tokens: dict[tuple[str, str], str] = {}

    async def get(self, namespace: str, name: str) -> ControlClient:
        """Run ``namespace/name``'s client.

        Raises:
            ApiException: 404 when the run's Secret is gone (the token cannot be read).
        """
        key = (namespace, name)
        settings = self.settings()
        url = settings.orchestrator_url.format(
            name=name, namespace=namespace, service=naming.orchestrator_service_name(name)
        )
        client = self.clients.get(key)
        if client is None or client.base_url != url.rstrip("/"):
            token = await asyncio.to_thread(self.kube().read_token, namespace, name)
            self.tokens[key] = token
            client = self.clients[key] = ControlClient(url, token, settings.request_timeout_seconds)
        return client

    def token(self, namespace: str, name: str) -> str | None:
        """The token this process knows for the run (its running orchestrator's), or None."""
        return self.tokens.get((namespace, name))

    def token_changed(self, namespace: str, name: str) -> None:
        """The run's Secret was made again with a token this process did not know: read it anew."""
        if (namespace, name) not in self.tokens:
            self.clients.pop((namespace, name), None)

    def forget(self, namespace: str, name: str) -> list[ControlClient]:
        """Drop a deleted run's token and client; returns the client for the caller to close."""
        self.tokens.pop((namespace, name), None)
        client = self.clients.pop((namespace, name), None)
        return [client] if client is not None else []
