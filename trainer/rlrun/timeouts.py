"""Awaiting with a time limit without losing a cancellation: :func:`within`, where a lost one would hang a
stop; a failure described with its time limit: :func:`describe_failure`.

``asyncio.wait_for`` before Python 3.12 returns the awaited result instead of raising when the waiting task is
cancelled in the same loop iteration as the result arrives (CPython gh-86296, fixed in 3.12 by building ``wait_for``
on ``asyncio.timeout``): the cancellation is lost. The orchestrator's main loop waits for results that way every
``poll_s``, so a cancel of ``Orchestrator.run`` (``asyncio.run`` on Ctrl-C, a test standing in for a kill) was lost
about half the time while results were arriving, and the run went on for ever; its weight follower could lose one
the same way in a drain, and the run's stop then waits on it for ever. ``asyncio.timeout`` (3.11+; its backport
``async_timeout`` below) counts cancellations (``Task.uncancel``) and never takes one that is not its own.
The other ``wait_for`` calls of the orchestrator are in request tasks, whose results a cancel already discards
(``Dispatcher._deliver``), and in evaluation rounds, which nothing awaits once cancelled.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable
from typing import TypeVar

from rlrun.worker_threads import NoThreadFree, RanTooLong

if sys.version_info >= (3, 11):
    from asyncio import timeout
else:  # pragma: no cover - the backport, installed with aiohttp below 3.11
    from async_timeout import timeout

T = TypeVar("T")


async def within(awaitable: Awaitable[T], seconds: float | None) -> T:
    """``await awaitable``, given at most ``seconds`` (None: no limit); a cancellation of the caller always propagates
    (the awaited is cancelled), even when its result arrives in the same loop iteration.

    Raises:
        TimeoutError: (``asyncio.TimeoutError``) not done within ``seconds``; the awaited was cancelled.
    """
    async with timeout(seconds):
        return await awaitable


def describe_failure(exc: BaseException, timeout_s: float | None = None, setting: str = "") -> str:
    """A failed call in words, for a log line or an episode's error: a timeout names its limit.

    Args:
        exc: what the call raised.
        timeout_s: the limit the caller awaited it with (:func:`within`); None: the caller set none.
        setting: the spec field that sets ``timeout_s`` (``rollout.request_timeout_seconds``).

    Returns:
        an env call's timeout (:class:`~rlrun.worker_threads.RanTooLong`,
        :class:`~rlrun.worker_threads.NoThreadFree`) as it says itself (``took longer than 5 s``); with
        ``timeout_s``, an ``asyncio.TimeoutError`` (no message of its own) as ``no answer within 300 s
        (<setting>)``; else ``Type: message``, or ``Type`` alone without a message.
    """
    if isinstance(exc, (RanTooLong, NoThreadFree)):
        return str(exc)  # "took longer than 5 s", or that it never got a thread (spares held by hung calls)
    if timeout_s is not None and isinstance(exc, asyncio.TimeoutError):
        return f"no answer within {timeout_s:.0f} s ({setting})"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
