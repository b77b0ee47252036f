"""Timestamps as the API server writes them: UTC, whole seconds (``2024-05-01T12:00:00Z``)."""

from __future__ import annotations

import datetime

FORMAT = "%Y-%m-%dT%H:%M:%SZ"


def now() -> str:
    """The current time as a ``creationTimestamp`` / ``deletionTimestamp``."""
    return datetime.datetime.now(datetime.timezone.utc).strftime(FORMAT)


def parse(timestamp: str) -> datetime.datetime:
    """A timestamp written by :func:`now` as an aware ``datetime``."""
    return datetime.datetime.strptime(timestamp, FORMAT).replace(tzinfo=datetime.timezone.utc)
