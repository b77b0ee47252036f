"""SIGTERM on the orchestrator: pause (write the sink snapshot), pair the trainer's save on notice, then stop.

The kubelet sends SIGTERM when a pod is deleted or its node is drained, then SIGKILL
after the pod's grace period; ``spec.preemption.snapshot_timeout_seconds`` is shorter,
so the snapshot is written in time. The operator deletes every pod of an attempt at once,
so the trainer gets its notice together with the orchestrator and is still finishing its
step when the pause is done: before stopping, the orchestrator waits (``before_stop``, within
the same deadline) for the trainer's save on notice and pairs it with the pause snapshot
(:meth:`rlrun.orchestrator.checkpointing.CheckpointManager.pair_notice_save`). A second
signal, or the deadline passing, exits at once: every file is written by rename, so nothing
is torn either way, and the resume starts from the newest complete checkpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)


class TerminationHandler:
    """Turns SIGTERM / SIGINT into ``pause()`` then ``stop()``.

    Args:
        pause: ``async pause()``: stop dispatching and shipping, write the snapshot.
        stop: ``stop()``: make the orchestrator's run loop return.
        deadline_s: most seconds the pause may take before the process exits (status 1).
        before_stop: ``async before_stop(seconds_left)``, awaited after the pause and before ``stop()`` (pairing the
            trainer's save on notice); it must return within ``seconds_left`` (None: nothing).

    Attributes:
        error: the exception of a pause that failed (the process then exits 1), else None.
    """

    def __init__(
        self,
        pause: Callable[[], Awaitable[object]],
        stop: Callable[[], None],
        deadline_s: float,
        before_stop: Callable[[float], Awaitable[object]] | None = None,
    ) -> None:
        self.pause = pause
        self.stop = stop
        self.deadline_s = deadline_s
        self.before_stop = before_stop
        self._deadline = 0.0
        self.error: BaseException | None = None
        self.signals = 0
        self._task: asyncio.Task | None = None

    def install(self) -> None:
        """Handle SIGTERM and SIGINT on the running loop (where the platform allows)."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self._on_signal)

    def _on_signal(self) -> None:
        self.signals += 1
        if self.signals > 1:
            log.warning("second termination signal: exiting now (files on disk stay consistent)")
            os._exit(143)
        log.info("SIGTERM: pausing and writing the snapshot (deadline %.0f s)", self.deadline_s)
        loop = asyncio.get_running_loop()
        loop.call_later(self.deadline_s, self._deadline_passed)
        self._deadline = loop.time() + self.deadline_s
        self._task = loop.create_task(self._pause_then_stop())

    @staticmethod
    def _deadline_passed() -> None:
        log.error("snapshot deadline passed; exiting")
        os._exit(1)

    async def _pause_then_stop(self) -> None:
        try:
            await self.pause()
        except Exception as exc:
            self.error = exc
            log.error("SIGTERM: could not write the snapshot (%s); exiting without one", exc)
        else:
            if self.before_stop is not None:
                try:
                    await self.before_stop(self._deadline - asyncio.get_running_loop().time())
                except Exception as exc:  # the pause's own checkpoint stands
                    log.warning("SIGTERM: could not pair the trainer's save on notice: %s", exc)
        finally:
            self.stop()
