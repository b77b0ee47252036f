"""Watches: every watcher sees exactly the changes after the ``resourceVersion`` it asked for, in order, each once.

``WatchHub`` keeps the last changes (the history a watch may resume from) and the open
watchers. A watch is answered from the history, then from its queue; no await separates the
two, so no change can fall between them or reach it twice. A ``resourceVersion`` older than
the history gets a 410 Gone ``ERROR`` event (as after an etcd compaction) and the client lists again.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import time
from collections.abc import Callable, Iterable
from typing import Any

import aiohttp.web
import kmock

from .errors import ApiError
from .request_log import LOGGED
from .resources import ResourceSpec
from .tables import table_event, wants_table

Match = Callable[[dict[str, Any]], bool]


@dataclasses.dataclass(eq=False)
class Watcher:
    """One open watch: the resource, its selectors, and the event lines still to send (None: end)."""

    spec: ResourceSpec
    match: Match
    queue: asyncio.Queue[bytes | None]


def event_line(spec: ResourceSpec, kind: str, obj: dict[str, Any]) -> bytes:
    """One watch event, as the newline-terminated JSON line the API server streams."""
    return json.dumps({"type": kind, "object": spec.present(obj)}).encode() + b"\n"


def filtered_event(spec: ResourceSpec, match: Match, kind: str, old: dict | None, new: dict) -> bytes | None:
    """The event a watch with selectors ``match`` sees for a change ``old`` → ``new`` (None: none).

    As the API server: an object that starts (stops) matching a selector is ADDED (DELETED) for this watch.
    """
    was = old is not None and match(old)
    now = match(new)
    if kind == "MODIFIED":
        kind = "MODIFIED" if was and now else "ADDED" if now else "DELETED" if was else ""
    elif not now:
        kind = ""
    return event_line(spec, kind, new) if kind else None


class WatchHub:
    """The change history and the open watches of one emulator (use on its event loop only)."""

    def __init__(self, history_size: int) -> None:
        self._events: collections.deque[tuple[int, kmock.resource, str, dict | None, dict]] = collections.deque(
            maxlen=history_size
        )
        self._compacted_rv = 0
        self._watchers: set[Watcher] = set()

    def emit(self, spec: ResourceSpec, kind: str, old: dict[str, Any] | None, new: dict[str, Any]) -> None:
        """Record a change (``new`` carries its resourceVersion) and queue it for the watches it concerns."""
        rv = int(new["metadata"]["resourceVersion"])
        if len(self._events) == self._events.maxlen:
            self._compacted_rv = self._events[0][0]
        self._events.append((rv, spec.store, kind, old, new))
        for watcher in self._watchers:
            if watcher.spec.store == spec.store:
                line = filtered_event(watcher.spec, watcher.match, kind, old, new)
                if line is not None:
                    watcher.queue.put_nowait(line)

    def close(self) -> None:
        """End every open watch stream (as the API server does on shutdown)."""
        for watcher in list(self._watchers):
            watcher.queue.put_nowait(None)

    async def serve(
        self,
        raw: aiohttp.web.BaseRequest,
        spec: ResourceSpec,
        match: Match,
        current: Iterable[dict[str, Any]],
        resource_version: int,
        started: Callable[[], None],
    ) -> aiohttp.web.StreamResponse:
        """Stream a watch request's events until ``timeoutSeconds``, :meth:`close` or the client goes.

        Args:
            current: the stored objects of ``spec`` (the initial ADDED events, where asked for).
            resource_version: the latest one given out (for the initial-events bookmark).
            started: called once the response headers are out (the request is logged then).

        Raises:
            ApiError: 400 for a ``resourceVersion`` that is no number.
        """
        query = raw.query
        since = query.get("resourceVersion", "")
        initial_events = query.get("sendInitialEvents") == "true"
        if since not in ("", "0") and not since.isdigit():
            raise ApiError(400, "BadRequest", f"invalid resourceVersion {since!r}")
        # From here to the subscription nothing awaits: no event can slip between replay and live.
        lines: list[bytes] = []
        expired = False
        if since in ("", "0") or initial_events:
            lines += [event_line(spec, "ADDED", obj) for obj in current if match(obj)]
            if initial_events:
                marker = {"kind": spec.kind, "apiVersion": spec.api_version}
                marker["metadata"] = {
                    "resourceVersion": str(resource_version),
                    "annotations": {"k8s.io/initial-events-end": "true"},
                }
                lines.append(json.dumps({"type": "BOOKMARK", "object": marker}).encode() + b"\n")
        elif int(since) < self._compacted_rv:
            expired = True
            gone = ApiError(410, "Expired", f"too old resource version: {since} ({self._compacted_rv})").status()
            lines.append(json.dumps({"type": "ERROR", "object": gone}).encode() + b"\n")
        else:
            for rv, store, kind, old, new in self._events:
                if rv > int(since) and store == spec.store:
                    line = filtered_event(spec, match, kind, old, new)
                    if line is not None:
                        lines.append(line)
        watcher = Watcher(spec, match, asyncio.Queue())
        self._watchers.add(watcher)
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        response[LOGGED] = True
        as_table = wants_table(raw, spec)
        try:
            await response.prepare(raw)
            started()
            for line in lines:
                await response.write(table_event(spec, line) if as_table else line)
            if expired:  # the client must list again
                return response
            timeout = float(query["timeoutSeconds"]) if query.get("timeoutSeconds", "").isdigit() else None
            deadline = None if timeout is None else time.monotonic() + timeout
            while True:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    break
                try:
                    line = await asyncio.wait_for(watcher.queue.get(), remaining)
                except asyncio.TimeoutError:
                    break
                if line is None:
                    break
                await response.write(table_event(spec, line) if as_table else line)
            await response.write_eof()
        except (ConnectionError, RuntimeError):  # the client went away ("Cannot write to closing transport")
            pass
        finally:
            self._watchers.discard(watcher)
        return response
