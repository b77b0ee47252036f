"""Reward worker processes: rewards that compute run where they cannot stall the orchestrator's event loop.

Guarantee: a reward whose spec says ``isolation: process`` (the builtin ``math`` unless told otherwise:
:data:`rlrun.api.spec.PROCESS_REWARDS`) never holds the orchestrator's GIL; a call that runs longer than its
timeout has its worker process killed (``SIGKILL``) and replaced, so a hung or pathological call costs its own
group and at most its timeout of one core, never the loop, a thread or a worker for longer; and no worker
outlives the pool (:meth:`RewardWorkers.close`) or the orchestrator (the kernel kills it when the thread that
started it ends: ``PR_SET_PDEATHSIG``, :mod:`rlrun.rewards.worker`).

A worker is ``python -c`` :data:`WORKER_MAIN` (fork and exec by :mod:`subprocess`, never a bare fork of the
orchestrator, which has threads and an event loop), started on first use by one thread that lives as long as
the pool, and talks over a socket pair (``multiprocessing.connection``: pickled plain data — the task, the
texts and ids in; each reward's checked scores and member errors out). It runs one call at a time;
:attr:`RewardWorkers.size` of them run at once, and a call waiting for one is not timed out for that (the
clock starts when a worker has the call, as for threads). A reward is loaded in a worker the first time a call
there needs it: importing its module is not the call's time (bounded apart, by :data:`LOAD_TIMEOUT_S`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlrun.envs.base import Task
    from rlrun.rewards.calls import RewardContext, RewardFunction

log = logging.getLogger(__name__)

#: Worker processes of a pool by default: one per CPU this process may run on, at most 4.
REWARD_PROCESSES = max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1))
#: Most seconds a worker may take to start and load a reward before the call that needs it fails.
LOAD_TIMEOUT_S = 300.0
#: What a worker runs (``python -c``); its connection's file descriptor and the orchestrator's pid follow.
WORKER_MAIN = "from rlrun.rewards.worker import main; main()"
#: The directory that holds the ``rlrun`` package: put first on a worker's ``PYTHONPATH``.
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])

#: One reward's outcome on a group of n: n scores, n member errors (:func:`.scoring.reward_outcome`).
Outcome = tuple[list[float | None], list[str | None]]


class _Worker:
    """One worker process, the orchestrator's end of its connection, and the exchange it is in."""

    def __init__(self, process: subprocess.Popen, conn: Connection) -> None:
        self.process = process
        self.conn = conn
        self.loaded: set[str] = set()  # keys of the rewards it has loaded (:func:`_key`)
        self.trainer_state = False  # whether it has imported what TRL's trainer_state needs
        self.exchange: asyncio.Future | None = None  # the pool thread sending to it and reading its answer
        self.busy_after_cancel = False  # its call's caller left; the call finishes (or is killed) on its own
        self.deadline: asyncio.TimerHandle | None = None  # when such a call is killed


def _key(spec: Any) -> str:
    """What identifies a reward in a worker: its spec's ``name``/``function`` and ``args``."""
    return repr((spec.name, spec.function, sorted(spec.args.items())))


def _roundtrip(conn: Connection, message: tuple) -> Any:
    """In a pool thread: send ``message``, wait for its answer (``EOFError``/``OSError``: the worker died)."""
    conn.send(message)
    return conn.recv()


class WorkerFailure(Exception):
    """A call in a worker failed as a whole: it ran past its timeout (its worker was killed), its worker died,
    or a reward did not load there; the message says which (every member of the group fails with it)."""


class RewardWorkers:
    """A pool of reward worker processes (module docstring), started on first use.

    Args:
        size: worker processes at most, each running one call at a time.

    Attributes:
        started: workers started so far (replacements included).
        killed: workers killed at a call's timeout.
    """

    def __init__(self, size: int = REWARD_PROCESSES) -> None:
        if size < 1:
            raise ValueError(f"a reward worker pool needs at least one process, got {size}")
        self.size = size
        self.started = 0
        self.killed = 0
        self._idle: list[_Worker] = []
        self._live: set[_Worker] = set()
        # a thread per call in a worker, and one per killed call until its connection reads the end
        self._pipes = ThreadPoolExecutor(max_workers=2 * size, thread_name_prefix="reward-pipe")
        # one thread starts every worker: a worker's PR_SET_PDEATHSIG follows the thread that forked it
        self._starter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward-starter")
        self._turns: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None
        self._closed = False

    def pids(self) -> list[int]:
        """The pids of the live workers."""
        return sorted(w.process.pid for w in self._live)

    def _running(self, loop: asyncio.AbstractEventLoop) -> asyncio.Semaphore:
        if self._turns is None or self._turns[0] is not loop:
            self._turns = (loop, asyncio.Semaphore(self.size))
        return self._turns[1]

    async def score(
        self,
        rewards: list[RewardFunction],
        task: Task,
        texts: list[str],
        completion_ids: list[list[int]],
        timeout_s: float,
        context: RewardContext | None = None,
    ) -> list[Outcome]:
        """Each of ``rewards``' outcome on a group of n completions, computed in a worker process; their
        ``log_metric`` calls are made here, on the caller's loop, once the call returns.

        Args:
            rewards: rewards with a ``spec`` (:attr:`RewardFunction.spec`), in the order of the outcomes.
            task, texts, completion_ids: the group (:func:`rlrun.rewards.scoring.reward_kwargs`).
            timeout_s: most seconds of the call's own run time (from when a worker has it).
            context: TRL's trainer arguments (None: none passed).

        Returns:
            One :data:`Outcome` per reward.

        Raises:
            WorkerFailure: past ``timeout_s`` (the worker is killed), the worker died, a reward did not load,
                or the pool is closed.
        """
        if self._closed:
            raise WorkerFailure("the reward workers are closed")
        loop = asyncio.get_running_loop()
        turns = self._running(loop)
        await turns.acquire()
        worker = None
        try:
            worker = await self._worker(loop)
            specs = {_key(r.spec): r.spec for r in rewards}
            missing = {key: spec.model_dump() for key, spec in specs.items() if key not in worker.loaded}
            trainer_state = context is not None and any(r.spec.function is not None for r in rewards)
            if missing or (trainer_state and not worker.trainer_state):
                await self._load(worker, missing, trainer_state)
            ctx = None
            if context is not None:
                ctx = (context.step, context.max_steps, context.log_metric is not None)
            calls = [(_key(r.spec), r.series, r.spec.name is not None) for r in rewards]
            message = ("score", calls, task, texts, completion_ids, ctx)
            reply = await self._exchange(worker, message, timeout_s)
        finally:
            if worker is not None and worker.busy_after_cancel:
                worker.exchange.add_done_callback(functools.partial(self._settle, worker, turns))
            else:
                if worker is not None:
                    self._release(worker)
                turns.release()
        _, found, logged, run_s = reply
        if run_s > timeout_s:  # done, but past its time (the answer was read late)
            raise WorkerFailure(timed_out(timeout_s))
        if context is not None and context.log_metric is not None:
            for name, value in logged:
                context.log_metric(name, value)
        return found

    async def _worker(self, loop: asyncio.AbstractEventLoop) -> _Worker:
        """An idle live worker, else a new one."""
        while self._idle:
            worker = self._idle.pop()
            if worker.process.poll() is None:
                return worker
            self._kill(worker)  # it died while idle (killed from outside): forget it
        future = loop.run_in_executor(self._starter, self._start)
        try:
            return self._adopt(await asyncio.shield(future))
        except asyncio.CancelledError:  # a worker started for a caller that left is kept for the next one
            future.add_done_callback(self._keep)
            raise
        except OSError as exc:
            raise WorkerFailure(f"a reward worker process did not start: {exc}") from exc

    def _keep(self, started: asyncio.Future) -> None:
        """A worker started for a caller that left: idle, for the next call."""
        if not started.cancelled() and started.exception() is None:
            self._release(self._adopt(started.result()))

    def _adopt(self, worker: _Worker) -> _Worker:
        """A worker just started, counted among the live ones (on the loop: only the loop changes them)."""
        self._live.add(worker)
        self.started += 1
        log.debug("reward worker %d started (%d so far)", worker.process.pid, self.started)
        return worker

    async def _load(self, worker: _Worker, specs: dict[str, dict], trainer_state: bool) -> None:
        """``worker`` loads ``specs`` (and, with ``trainer_state``, imports transformers: a user function gets
        TRL's ``trainer_state``), within :data:`LOAD_TIMEOUT_S`."""
        message = ("load", specs, list(sys.path), os.getcwd(), trainer_state)
        reply = await self._exchange(worker, message, LOAD_TIMEOUT_S)
        worker.trainer_state = worker.trainer_state or trainer_state
        failed = {key: error for key, error in reply[1].items() if error is not None}
        worker.loaded.update(key for key in specs if key not in failed)
        if failed:
            raise WorkerFailure(f"a reward does not load in its worker process: {min(failed.values())}")

    async def _exchange(self, worker: _Worker, message: tuple, timeout_s: float) -> tuple:
        """``message`` to ``worker`` and its answer, within ``timeout_s`` (else the worker is killed).

        Raises:
            WorkerFailure: no answer within ``timeout_s``, the worker died, or its machinery failed.
            asyncio.CancelledError: the caller left; the call goes on until it ends or its time is up.
        """
        loop = asyncio.get_running_loop()
        t0 = time.monotonic()
        worker.exchange = future = loop.run_in_executor(self._pipes, _roundtrip, worker.conn, message)
        try:
            reply = await asyncio.wait_for(asyncio.shield(future), timeout_s)
        except asyncio.TimeoutError:
            self._kill(worker)
            self.killed += 1
            what = timed_out(timeout_s) if message[0] == "score" else f"loading took over {timeout_s:g} s"
            raise WorkerFailure(f"{what}; its worker process was killed") from None
        except asyncio.CancelledError:  # the caller left: a call that ends within its time frees its worker
            worker.busy_after_cancel = True
            left = max(0.0, t0 + timeout_s - time.monotonic())
            worker.deadline = loop.call_later(left, self._kill, worker)
            raise
        except (EOFError, OSError) as exc:
            if self._closed:
                raise WorkerFailure("the reward workers were closed during the call") from None
            status = await loop.run_in_executor(self._starter, _exit_status, worker.process)
            self._kill(worker)
            raise WorkerFailure(f"its reward worker process died ({status}): {exc!r}") from None
        if reply[0] == "error":
            raise WorkerFailure(f"its reward worker failed: {reply[1]}")
        return reply

    def _settle(self, worker: _Worker, turns: asyncio.Semaphore, future: asyncio.Future) -> None:
        """A call whose caller left has ended (or was killed): its worker is free again, or gone."""
        worker.busy_after_cancel = False
        if worker.deadline is not None:
            worker.deadline.cancel()
        if future.cancelled() or future.exception() is not None:
            self._kill(worker)
        self._release(worker)
        turns.release()

    def _release(self, worker: _Worker) -> None:
        """``worker`` back among the idle ones, unless it is dead, killed or the pool closed."""
        if worker in self._live and not self._closed and worker.process.poll() is None:
            self._idle.append(worker)
        else:
            self._kill(worker)

    def _kill(self, worker: _Worker) -> None:
        """Kill ``worker`` and forget it; its connection closes once no thread reads it any more."""
        if worker not in self._live:
            return
        self._live.discard(worker)
        if worker in self._idle:
            self._idle.remove(worker)
        with contextlib.suppress(OSError):
            worker.process.kill()
        if not self._closed:
            self._starter.submit(_reap, worker.process)
        if worker.exchange is None or worker.exchange.done():
            worker.conn.close()
        else:  # once its thread no longer reads it; the error it then gets (EOF) is no one's to see
            worker.exchange.add_done_callback(lambda f: (f.cancelled() or f.exception(), worker.conn.close()))

    def _start(self) -> _Worker:
        """In the starter thread: a new worker process (blocking: fork + exec, about a millisecond)."""
        if self._closed:
            raise WorkerFailure("the reward workers are closed")
        ours, theirs = socket.socketpair()
        path = os.pathsep.join(filter(None, [_PACKAGE_ROOT, os.environ.get("PYTHONPATH")]))
        with theirs:
            argv = [sys.executable, "-c", WORKER_MAIN, str(theirs.fileno()), str(os.getpid())]
            env = {**os.environ, "PYTHONPATH": path}
            process = subprocess.Popen(argv, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env)
        return _Worker(process, Connection(ours.detach()))

    def close(self) -> None:
        """Kill every worker and wait for each to be gone (a few milliseconds): none is left running."""
        self._closed = True
        live = list(self._live)
        for worker in live:
            self._kill(worker)
        for worker in live:
            _reap(worker.process)
        self._pipes.shutdown(wait=False, cancel_futures=True)
        self._starter.shutdown(wait=False, cancel_futures=True)


def _exit_status(process: subprocess.Popen) -> str:
    """How a worker whose connection closed ended (it has, or is about to)."""
    try:
        code = process.wait(timeout=1)
    except subprocess.TimeoutExpired:
        return "its connection closed, the process still runs"
    return f"killed by signal {-code}" if code < 0 else f"exit code {code}"


def _reap(process: subprocess.Popen) -> None:
    try:
        process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        log.warning("reward worker %d did not exit within 5 s of SIGKILL", process.pid)


def timed_out(timeout_s: float) -> str:
    """Why every member of a group whose rewards ran longer than ``timeout_s`` seconds fails."""
    return f"rewards ran longer than {timeout_s:g} s (spec.envs[].reward_timeout_seconds)"
