"""``wait_for``: the one way tests wait for something another thread or process does (``wait_for_async``
inside a coroutine, where the event loop must keep running)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(predicate: Callable[[], T], timeout: float = 10.0, what: str = "condition", every: float = 0.02) -> T:
    """Poll ``predicate`` every ``every`` seconds until it returns something truthy; return that.

    Raises:
        AssertionError: naming ``what`` after ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(every)


async def wait_for_async(
    predicate: Callable[[], T], timeout: float = 10.0, what: str = "condition", every: float = 0.01
) -> T:
    """:func:`wait_for` for a coroutine: polls without blocking the event loop.

    Raises:
        AssertionError: naming ``what`` after ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        await asyncio.sleep(every)
