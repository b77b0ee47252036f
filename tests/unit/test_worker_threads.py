"""Worker threads for user code: a call's timeout is its own run time, a hung call costs its own turn and
one spare thread, what the call raises is the caller's (its own ``TimeoutError`` never read as the
timeout), and the threads never hold the process's exit."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from rlrun.worker_threads import NoThreadFree, RanTooLong, WorkerThreads


@pytest.fixture
def hang():
    """An event the test's hung calls wait on; set when the test ends."""
    event = threading.Event()
    yield event
    event.set()


async def test_quick_calls_behind_hung_ones_are_not_timed_out_for_their_wait(hang):
    threads = WorkerThreads("test", threads=2, spare=4)
    hung = [asyncio.ensure_future(threads.run(hang.wait, timeout_s=0.3)) for _ in range(4)]
    await asyncio.sleep(0)
    started = time.monotonic()
    quick = await asyncio.gather(*(threads.run(lambda i=i: i, timeout_s=0.3) for i in range(10)))
    assert quick == list(range(10))  # they waited up to two hung rounds (0.6 s) for a turn: not their time
    assert time.monotonic() - started < 2.0
    assert [type(e) for e in await asyncio.gather(*hung, return_exceptions=True)] == [RanTooLong] * 4
    assert threads.abandoned == 4
    for _ in range(2):
        with pytest.raises(RanTooLong):
            await threads.run(hang.wait, timeout_s=0.1)
    # every thread is held now (2 + 4 spares): a call that gets none fails saying so, and never runs
    ran = []
    says = r"no test thread was free within 0\.1 s: 6 calls past their timeout"
    with pytest.raises(NoThreadFree, match=says):
        await threads.run(ran.append, 1, timeout_s=0.1)
    hang.set()
    await asyncio.sleep(0.2)
    assert threads.abandoned == 0 and ran == []
    assert await threads.run(lambda: "free again", timeout_s=1.0) == "free again"
    assert all(t.daemon for t in threading.enumerate() if t.name.startswith("test-"))


def times_out() -> None:
    raise TimeoutError("the sandbox did not answer")


def exits() -> None:
    raise SystemExit(3)


async def test_what_a_call_raises_is_its_own_never_the_timeout():
    threads = WorkerThreads("test", threads=2, spare=2)
    with pytest.raises(TimeoutError, match="the sandbox did not answer") as raised:
        await threads.run(times_out, timeout_s=5.0)
    assert not isinstance(raised.value, RanTooLong)
    # a SystemExit never ends the thread (or the loop) alone
    with pytest.raises(RuntimeError, match="raised SystemExit: 3"):
        await threads.run(exits, timeout_s=5.0)
    assert await threads.run(sum, [1, 2], timeout_s=5.0) == 3


def test_a_blocking_call_from_another_thread_is_timed_the_same_way(hang):
    threads = WorkerThreads("test", threads=1, spare=1)
    with pytest.raises(RanTooLong, match=r"took longer than 0\.2 s"):
        threads.call(hang.wait, timeout_s=0.2)
    assert threads.call(lambda a, b: a * b, 6, 7, timeout_s=1.0) == 42  # on the spare thread
    with pytest.raises(TimeoutError, match="the sandbox did not answer"):
        threads.call(times_out, timeout_s=1.0)
