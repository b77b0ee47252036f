"""``KubeServer``: one ``KubeEmulator`` served over HTTP on 127.0.0.1 from its own thread and event loop.

Tests, operators in other threads, kubectl subprocesses and the sync ``kubernetes`` client
all reach it by URL; the object accessors hop onto the server's loop, so the emulator is
only ever touched from that one thread (each write stays atomic).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp.web
import yaml

from .emulator import KubeEmulator
from .request_log import KubeRequest
from .resources import ResourceSpec

log = logging.getLogger(__name__)


class KubeServer:
    """A ``KubeEmulator`` served over HTTP on 127.0.0.1 (a free port) from its own thread and event loop.

    Usage::

        with KubeServer(crds=ROOT / "crds") as kube:
            kube.write_kubeconfig(tmp_path / "kubeconfig")
            created = kube.create("v1/pods", {"metadata": {"name": "p"}}, namespace="ns")
            assert kube.get("pods", "p", "ns")["metadata"]["uid"] == created["metadata"]["uid"]

    The object accessors (``get``, ``list``, ``create``, ``patch``, ``replace``, ``delete``,
    ``register_crds``) run on the server's loop and may be called from any other thread; they
    take the same arguments as the ``KubeEmulator`` methods of the same names and raise
    ``ApiError`` as the API would answer. They do not appear in ``requests``.

    There is no kubelet: a scheduled pod (``spec.nodeName``) deleted with a grace period stays,
    terminating, until a test plays the kubelet with ``finish_pod_deletion`` (its containers
    stopped) or ``expire_pod_deletions`` (every pod whose grace period is over); see
    ``tests/support/kube/graceful.py`` for the rules.
    """

    def __init__(self, *, crds: str | Path | None = None, emulator: KubeEmulator | None = None) -> None:
        self.emulator = emulator if emulator is not None else KubeEmulator()
        self._crds = crds
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping: asyncio.Event | None = None
        self._port = 0

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>`` (no trailing slash)."""
        if not self._port:
            raise RuntimeError("the kube emulator is not running")
        return f"http://127.0.0.1:{self._port}"

    @property
    def requests(self) -> list[KubeRequest]:
        """A copy of the request log, oldest first."""
        return list(self.emulator.request_log)

    def clear_requests(self) -> None:
        """Forget the requests logged so far."""
        self.emulator.request_log.clear()

    def rbac_usage(self) -> set[tuple[str, str, str]]:
        """``{(apiGroup, resource[/subresource], verb)}`` of every resource request logged (what a ClusterRole must
        grant)."""
        return {r.rbac for r in self.requests if r.rbac is not None}

    def start(self, timeout: float = 5.0) -> KubeServer:
        """Start serving; returns when the port is listening.

        Raises:
            RuntimeError: started twice, or the server failed to start within ``timeout`` seconds.
        """
        if self._thread is not None:
            raise RuntimeError("the kube emulator is already started")
        ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(ready,), name="kube-emulator", daemon=True)
        self._thread.start()
        ready.result(timeout)
        if self._crds is not None:
            self.register_crds(self._crds)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """End open watches, stop serving and join the thread (idempotent)."""
        if self._thread is None or self._loop is None or self._stopping is None:
            return
        self._loop.call_soon_threadsafe(self._stopping.set)
        self._thread.join(timeout)
        self._thread = None
        self._port = 0

    def __enter__(self) -> KubeServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self, ready: concurrent.futures.Future[None]) -> None:
        try:
            asyncio.run(self._main(ready))
        except BaseException as e:
            if not ready.done():
                ready.set_exception(e)
            else:
                log.exception("kube emulator thread failed")

    async def _main(self, ready: concurrent.futures.Future[None]) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        async with self.emulator:
            server = aiohttp.web.Server(self.emulator, handler_cancellation=True)
            runner = aiohttp.web.ServerRunner(server, shutdown_timeout=0.2)
            await runner.setup()
            site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            self._port = runner.addresses[0][1]
            ready.set_result(None)
            try:
                await self._stopping.wait()
            finally:
                self.emulator.close_watches()
                await asyncio.sleep(0)  # let the watch handlers see the end of their queues
                await runner.cleanup()

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` on the server's loop (thread-safe) and return its result or raise its error.

        Raises:
            RuntimeError: called from the server's own thread (it would deadlock) or not running.
        """
        if self._loop is None or self._thread is None:
            raise RuntimeError("the kube emulator is not running")
        if threading.current_thread() is self._thread:
            raise RuntimeError("KubeServer.call() from the server's own thread; call the emulator directly")
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def run() -> None:
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as e:
                future.set_exception(e)

        self._loop.call_soon_threadsafe(run)
        return future.result(10)

    def get(self, resource: str, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        return self.call(self.emulator.get_object, resource, name, namespace)

    def list(
        self, resource: str, namespace: str | None = None, label_selector: str = "", field_selector: str = ""
    ) -> list[dict[str, Any]]:
        return self.call(self.emulator.list_objects, resource, namespace, label_selector, field_selector)

    def create(
        self, resource: str, body: dict[str, Any], namespace: str | None = None, *, keep_status: bool = False
    ) -> dict[str, Any]:
        return self.call(self.emulator.create_object, resource, body, namespace, keep_status=keep_status)

    def replace(
        self,
        resource: str,
        name: str,
        body: dict[str, Any],
        namespace: str | None = None,
        *,
        subresource: str | None = None,
    ) -> dict[str, Any]:
        return self.call(self.emulator.replace_object, resource, name, body, namespace, subresource=subresource)

    def patch(
        self,
        resource: str,
        name: str,
        patch: Any,
        namespace: str | None = None,
        *,
        subresource: str | None = None,
        patch_type: str = "merge",
    ) -> dict[str, Any]:
        return self.call(
            self.emulator.patch_object, resource, name, patch, namespace, subresource=subresource, patch_type=patch_type
        )

    def delete(
        self, resource: str, name: str, namespace: str | None = None, options: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        return self.call(self.emulator.delete_object, resource, name, namespace, options)

    def finish_pod_deletion(self, name: str, namespace: str | None = None) -> dict[str, Any]:
        """Play the kubelet once a terminating pod's containers stopped: its grace-0 ``DELETE`` (uid precondition).

        The pod is removed (a ``DELETED`` event); one that still has finalizers keeps them, at
        ``deletionGracePeriodSeconds: 0``, until the last goes. Returns the pod's last state.

        Raises:
            ApiError: 404 when there is no such pod.
            ValueError: the pod is not being deleted (no ``deletionTimestamp``).
        """
        return self.call(self.emulator.finish_pod_deletion, name, namespace)

    def expire_pod_deletions(self, at: datetime.datetime | str | None = None) -> list[tuple[str, str]]:
        """Play every kubelet whose pod's grace period is over: ``finish_pod_deletion`` for each one due.

        Due: a pending graceful deletion (``deletionGracePeriodSeconds`` > 0) whose
        ``deletionTimestamp`` is not after ``at`` (an aware ``datetime`` or an RFC 3339
        timestamp; None: now). Pass a future ``at`` rather than sleeping through a grace period.

        Returns:
            ``(namespace, name)`` of each pod it finished, sorted.
        """
        return self.call(self.emulator.expire_pod_deletions, at)

    def register_crds(self, directory: str | Path) -> list[ResourceSpec]:
        return self.call(self.emulator.register_crds, directory)

    def add_resource(self, spec: ResourceSpec) -> None:
        self.call(self.emulator.add_resource, spec)

    def write_kubeconfig(self, path: str | Path, namespace: str = "default") -> Path:
        """Write a kubeconfig (one cluster/user/context ``emulator``, plain http, a dummy token) and return its path."""
        path = Path(path)
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
            "users": [{"name": "emulator", "user": {"token": "emulator-token"}}],
            "contexts": [
                {"name": "emulator", "context": {"cluster": "emulator", "user": "emulator", "namespace": namespace}}
            ],
            "current-context": "emulator",
        }
        path.write_text(yaml.safe_dump(config))
        return path

    def api_client(self) -> Any:
        """A sync ``kubernetes.client.ApiClient`` for this server (its own ``Configuration``: ``$KUBECONFIG`` is not
        read)."""
        import kubernetes.client

        config = kubernetes.client.Configuration(host=self.url)
        return kubernetes.client.ApiClient(config)
