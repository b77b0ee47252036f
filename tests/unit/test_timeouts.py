"""``within``: a time limit that never loses a cancellation (``asyncio.wait_for`` before Python 3.12 does, gh-86296);
``describe_failure``: a failure in words, a timeout with its limit."""

from __future__ import annotations

import asyncio
import sys

import pytest
from rlrun.timeouts import describe_failure, within
from rlrun.worker_threads import NoThreadFree, RanTooLong


async def cancelled_as_the_item_arrives(wait) -> bool:
    """Whether a task waiting ``wait(queue.get(), 10)`` stops when cancelled in the loop iteration an item arrives."""
    queue: asyncio.Queue[int] = asyncio.Queue()

    async def consume() -> None:
        while True:
            await wait(queue.get(), 10)

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.01)  # it waits in get()
    queue.put_nowait(1)
    await asyncio.sleep(0)  # the get has its item
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=0.2)
    task.cancel()
    return bool(done) and task.cancelled() and queue.qsize() <= 1


async def test_a_cancel_that_comes_with_the_result_stops_the_waiting_task():
    if sys.version_info < (3, 12):  # the race this module exists for
        assert not await cancelled_as_the_item_arrives(asyncio.wait_for)
    assert await cancelled_as_the_item_arrives(within)


async def test_the_time_limit_raises_timeout_error_and_a_result_in_time_is_returned():
    with pytest.raises(asyncio.TimeoutError):
        await within(asyncio.sleep(1), 0.01)
    assert await within(asyncio.sleep(0, result=7), 1) == 7
    assert await within(asyncio.sleep(0, result=8), None) == 8


@pytest.mark.parametrize(
    ("exc", "timeout_s", "words"),
    [
        (asyncio.TimeoutError(), 300.0, "no answer within 300 s (rollout.request_timeout_seconds)"),
        (asyncio.TimeoutError(), None, "TimeoutError"),  # no limit of the caller's: the exception's own
        (RanTooLong(5.0), None, "took longer than 5 s"),
        (RanTooLong(5.0), 300.0, "took longer than 5 s"),  # an env call's own limit, not the caller's
        (
            NoThreadFree("env x", 0.3, 2),
            None,
            "no env x thread was free within 0.3 s: 2 calls past their timeout "
            "still run and hold every spare thread (code that can hang should bound its own work)",
        ),
        (ConnectionResetError(), 300.0, "ConnectionResetError"),
        (ConnectionError("the sandbox is gone"), None, "ConnectionError: the sandbox is gone"),
    ],
)
def test_a_failure_is_described_with_the_time_limit_it_ran_past(exc, timeout_s, words):
    assert describe_failure(exc, timeout_s, "rollout.request_timeout_seconds") == words
