"""``KopfThread``: a kopf operator run against a ``KubeServer`` in a thread with its own event loop.

It starts and stops with the test (``with KopfThread(registry, kube): ...``); a failure in the
operator is raised from ``stop()``, so a test cannot pass while its operator crashed.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from .server import KubeServer


class KopfThread:
    """A kopf operator running against a ``KubeServer`` in a thread with its own event loop.

    Credentials come from a pre-filled vault (no login handler, no kubeconfig, ``$KUBECONFIG``
    is not read). Settings are tuned for fast tests (short backoffs and timeouts), then
    ``settings_hook(settings)`` may change them further.

    Usage::

        registry = kopf.OperatorRegistry()

        @kopf.on.create("rlrun.dev", "v1alpha1", "rlruns", registry=registry)
        def created(**_): ...

        with KopfThread(registry, kube):
            ...
    """

    def __init__(
        self,
        registry: Any,
        server: KubeServer | str,
        *,
        settings_hook: Callable[[Any], None] | None = None,
        clusterwide: bool = True,
        namespaces: Iterable[str] = (),
        memo: object | None = None,
    ) -> None:
        self.registry = registry
        self.url = server.url if isinstance(server, KubeServer) else server
        self.settings_hook = settings_hook
        self.clusterwide = clusterwide and not namespaces
        self.namespaces = list(namespaces)
        self.memo = memo
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stop = threading.Event()

    def start(self, timeout: float = 10.0) -> KopfThread:
        """Start the operator; returns once kopf reports it is ready (its watches are starting).

        Raises:
            RuntimeError: the operator did not get ready in ``timeout`` seconds or failed (chained).
        """
        self._ready.clear()
        self._stop.clear()
        self.error = None
        self._thread = threading.Thread(target=self._run, name="kopf-operator", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._ready.wait(0.01):
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self._stop.set()
                self._thread.join(timeout)
                self._thread = None
                raise RuntimeError(f"the kopf operator did not get ready within {timeout} s") from self.error
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the operator to stop, join its thread.

        Raises:
            RuntimeError: it did not stop within ``timeout`` seconds, or it failed (chained).
        """
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout)
        alive, self._thread = self._thread.is_alive(), None
        if alive:
            raise RuntimeError(f"the kopf operator did not stop within {timeout} s")
        if self.error is not None:
            raise RuntimeError("the kopf operator failed") from self.error

    def __enter__(self) -> KopfThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as e:
            self.error = e

    async def _main(self) -> None:
        import kopf
        from kopf._cogs.structs.credentials import Vault

        settings = kopf.OperatorSettings()
        settings.watching.reconnect_backoff = 0.05
        settings.watching.server_timeout = 60
        settings.networking.request_timeout = 10
        settings.networking.error_backoffs = [0.1, 0.2, 0.5]
        settings.queueing.idle_timeout = 0.5
        settings.queueing.exit_timeout = 0.1
        settings.background.instant_exit_timeout = 0.01
        settings.process.ultimate_exiting_timeout = 2
        if self.settings_hook is not None:
            self.settings_hook(settings)
        info = kopf.ConnectionInfo(server=self.url, insecure=True, scheme="Bearer", token="emulator-token")
        await kopf.operator(
            registry=self.registry,
            settings=settings,
            standalone=True,
            clusterwide=self.clusterwide,
            namespaces=self.namespaces,
            ready_flag=self._ready,
            stop_flag=self._stop,
            vault=Vault({"emulator": info}),
            memo=self.memo,
        )
