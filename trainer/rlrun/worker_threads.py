"""Worker threads for user code: each call timed by its own run time, a hung call costing only its own turn,
and no thread that holds the process's exit.

Who relies on it: what the orchestrator runs of a user's code off its event loop — rewards
(:mod:`rlrun.rewards.scoring`), a multi-turn env's ``start`` and ``respond`` (:mod:`rlrun.orchestrator.turns`,
one :class:`WorkerThreads` per env), tools (:mod:`rlrun.envs.tools`, one per tool).

Guarantees of a :class:`WorkerThreads`:

- **A call's timeout is its own run time**, from the moment a thread starts it; waiting for a turn or a thread
  is not its time. Issue 36 found the reward timeout counting the wait for a shared thread (a slow reward
  failed quick ones); issue 47 found env and tool timeouts doing the same: an env whose ``start`` hung on
  every 5th task made innocent starts fail ``took longer than 5 s``, and a tool sleeping 50 s failed 21 of 28
  calls of an instant one.
- **A hung call costs its own turn, then nothing but a thread**: ``threads`` calls run at once; a call past
  its timeout gives its turn to the next one at once, and its thread (Python cannot stop a thread) is replaced
  by a spare while it finishes, up to ``spare`` such calls. Past that many, a call that no thread starts
  within its timeout fails with :class:`NoThreadFree`, which says so — never as the call's own time. Waiting
  for a turn is bounded by the calls ahead, each holding its turn at most its timeout. When hung calls hold
  half the spares, a warning says so (once).
- **No thread holds the exit**: the threads are daemon threads, never joined. ``concurrent.futures``' threads
  are joined when the interpreter exits and ``asyncio.run`` joins the loop's default executor, so one call
  still hung (an env's ``start`` waiting for ever) kept the orchestrator from exiting for minutes after its
  run was done.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["NoThreadFree", "RanTooLong", "WorkerThreads"]

log = logging.getLogger(__name__)


class RanTooLong(TimeoutError):
    """A call ran longer than its timeout (its own run time, seconds: :attr:`timeout_s`); its thread is left
    to finish."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        super().__init__(f"took longer than {timeout_s:g} s")


class NoThreadFree(TimeoutError):
    """No thread started a call within its timeout: every thread of its :class:`WorkerThreads` is held by
    calls past their timeout that still run (:attr:`hung` of them). The call never ran."""

    def __init__(self, name: str, timeout_s: float, hung: int) -> None:
        self.hung = hung
        super().__init__(
            f"no {name} thread was free within {timeout_s:g} s: {hung} calls past their timeout still run "
            "and hold every spare thread (code that can hang should bound its own work)"
        )


class _Job:
    """One call handed to the threads: its result, and when a thread started it (its timeout's clock) — or
    that the caller gave up waiting for a thread (then no thread runs it)."""

    def __init__(self, func: Callable[..., Any], args: tuple) -> None:
        self.func, self.args = func, args
        self.started: concurrent.futures.Future[float] = concurrent.futures.Future()
        self.result: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self.t0: float | None = None  # when a thread started it (monotonic seconds)
        self.run_s: float | None = None  # its run time once it returned (seconds), set before its result
        self._given_up = False
        self._lock = threading.Lock()

    def __call__(self) -> None:
        """In a worker thread: run the call, unless the caller gave up."""
        with self._lock:
            if self._given_up:
                return
            self.t0 = time.monotonic()
            self.result.set_running_or_notify_cancel()
        self.started.set_result(self.t0)
        try:
            value = self.func(*self.args)
        except BaseException as exc:  # the caller's to raise: a SystemExit must not end the thread alone
            self.run_s = time.monotonic() - self.t0
            error = exc if isinstance(exc, Exception) else RuntimeError(f"raised {type(exc).__name__}: {exc}")
            self.result.set_exception(error)
        else:
            self.run_s = time.monotonic() - self.t0
            self.result.set_result(value)

    def give_up(self) -> float | None:
        """Stop waiting for a thread: None, or when a thread started the call meanwhile (it runs)."""
        with self._lock:
            self._given_up = self.t0 is None
            return self.t0


class _DaemonPool:
    """Daemon threads taking jobs from one queue: a thread is started when none is idle, up to ``most``; never
    joined."""

    def __init__(self, name: str, most: int) -> None:
        self.name, self.most = name, most
        self.threads = 0
        self.closed = False
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)  # one release per thread waiting for a job
        self._lock = threading.Lock()

    def submit(self, job: _Job) -> None:
        if self.closed:
            raise RuntimeError(f"{self.name}: its threads were closed")
        self._jobs.put(job)
        if self._idle.acquire(blocking=False):
            return  # a thread waiting for a job takes it
        with self._lock:
            if self.threads < self.most:
                self.threads += 1
                threading.Thread(target=self._work, name=f"{self.name}-{self.threads}", daemon=True).start()

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()
            self._idle.release()

    def close(self) -> None:
        """Take no more jobs, and let the threads waiting for one end (those running a call end once it
        returns; nothing is waited for)."""
        self.closed = True
        for _ in range(self.threads):
            self._jobs.put(None)


class WorkerThreads:
    """Runs calls in daemon threads, ``threads`` at once, each bounded by its own run time (module docstring).

    Args:
        name: what its threads and messages are called (``reward``, ``env guess-number``, ``tool calculate``).
        threads: calls run at once.
        spare: threads that stand in for those of calls past their timeout while these finish.

    Attributes:
        abandoned: calls still running that nobody waits for any more (past their timeout, or their caller
            cancelled): each holds a thread.
    """

    def __init__(self, name: str, threads: int, spare: int) -> None:
        self.name, self.threads, self.spare = name, threads, spare
        self.abandoned = 0
        self._warned = False  # whether the warning at half the spares held was given
        self._pool = _DaemonPool(name, threads + spare)
        self._lock = threading.Lock()
        self._async_turns: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None
        self._sync_turns = threading.Semaphore(threads)

    def _turns(self, loop: asyncio.AbstractEventLoop) -> asyncio.Semaphore:
        """The turns to run on ``loop`` (one semaphore per loop: a semaphore belongs to one)."""
        if self._async_turns is None or self._async_turns[0] is not loop:
            self._async_turns = (loop, asyncio.Semaphore(self.threads))
        return self._async_turns[1]

    async def run(self, func: Callable[..., Any], *args: Any, timeout_s: float) -> Any:
        """``func(*args)`` in a worker thread, awaited on the event loop; returns what it returns.

        Raises:
            RanTooLong: it ran longer than ``timeout_s`` seconds of its own run time (its thread is left to
                finish).
            NoThreadFree: no thread started it within ``timeout_s`` (every spare held by calls past their
                timeout).
            whatever ``func`` raises (a ``BaseException`` that is no ``Exception`` as a ``RuntimeError``).
        """
        loop = asyncio.get_running_loop()
        # a call past its timeout gives up its turn: waiting for one is not its time
        async with self._turns(loop):
            job = _Job(func, args)
            self._pool.submit(job)
            result = asyncio.wrap_future(job.result, loop=loop)
            try:
                started = asyncio.wrap_future(job.started, loop=loop)
                await asyncio.wait({started}, timeout=timeout_s)
                t0 = job.give_up()
                if t0 is None:
                    raise NoThreadFree(self.name, timeout_s, self.abandoned)
                await asyncio.wait({result}, timeout=max(0.0, t0 + timeout_s - time.monotonic()))
            except asyncio.CancelledError:
                self._abandon(job, result)
                raise
            return self._outcome(job, result, timeout_s)

    def call(self, func: Callable[..., Any], *args: Any, timeout_s: float) -> Any:
        """``func(*args)`` in a worker thread, waited for in this one (never on an event loop: it blocks); as
        :meth:`run`.

        Raises:
            RanTooLong, NoThreadFree: as :meth:`run`; whatever ``func`` raises.
        """
        with self._sync_turns:
            job = _Job(func, args)
            self._pool.submit(job)
            concurrent.futures.wait([job.started], timeout=timeout_s)
            t0 = job.give_up()
            if t0 is None:
                raise NoThreadFree(self.name, timeout_s, self.abandoned)
            concurrent.futures.wait([job.result], timeout=max(0.0, t0 + timeout_s - time.monotonic()))
            return self._outcome(job, job.result, timeout_s)

    def _outcome(self, job: _Job, result: Any, timeout_s: float) -> Any:
        """The call's result once waited for: :class:`RanTooLong` when it is not done, or done past its time
        (a busy loop saw it late); else what it returned or raised."""
        if not result.done():
            self._abandon(job, result)
            raise RanTooLong(timeout_s)
        if job.run_s is not None and job.run_s > timeout_s:
            result.exception()  # retrieved: an error past its time is the timeout's
            raise RanTooLong(timeout_s)
        return result.result()

    def _abandon(self, job: _Job, result: Any) -> None:
        """Nobody waits for ``job`` (``result``: what its caller waited on) any more: count it while its
        thread still runs it; what it raises then is dropped."""
        result.add_done_callback(_retrieve)
        if job.give_up() is None or job.result.done():
            return
        with self._lock:
            self.abandoned += 1
            warn = not self._warned and self.abandoned >= max(1, self.spare // 2)
            self._warned |= warn
        if warn:
            log.warning(
                "%s: %d calls past their timeout still run (Python cannot stop a thread), each holding one "
                "of its %d spare threads; once all are held, a call that gets no thread within its timeout "
                "fails: code that can hang should bound its own work",
                self.name,
                self.abandoned,
                self.spare,
            )
        job.result.add_done_callback(self._finished_abandoned)

    def _finished_abandoned(self, future: concurrent.futures.Future) -> None:
        with self._lock:
            self.abandoned -= 1

    def close(self) -> None:
        """Take no more calls (:meth:`run` and :meth:`call` then raise ``RuntimeError``) and let idle threads
        end; calls still running are not waited for (their threads are daemon threads)."""
        self._pool.close()


def _retrieve(future: Any) -> None:
    """Mark an abandoned call's error retrieved (asyncio would log it as never retrieved)."""
    if not future.cancelled():
        future.exception()
