"""The episode journal: a finished episode is durable before the orchestrator counts it.

Guarantee: every request's finished episodes are appended to this attempt's journal and
fsynced **before** they enter the sink or the ledger records them ``finished``; so a kill
at any instant (SIGKILL, OOM, node loss) loses no acknowledged episode: a resume puts back
the newest complete checkpoint's snapshot and replays the journal records after its cut
(:func:`replay`). Who relies on it: :mod:`.loop` (admits episodes only once durable),
:mod:`.checkpointing` (cuts and compacts at each save), :mod:`.resume` (replays), and
``rlrun ledger check`` (every acknowledged episode ends exactly once).

The files (layout, record frame, torn tails, reading back, the replay) are :mod:`.journal_files`'s.

Group commit: one writer thread writes everything appended since its last commit with one
``write`` and one ``fdatasync``, as soon as it has something (``max_delay_s`` = 0, the
default: the group forms while the previous commit's ``fdatasync`` runs, so the fsync rate
adapts to the load and a lone record waits for one fsync, not for a timer; a positive
``max_delay_s`` gathers for that long first, fewer fsyncs for more latency). The event loop
never blocks on I/O nor takes a lock the writer holds, and is told (``on_durable``, via
``call_soon_threadsafe``) the highest sequence number that is durable. Why no delay by
default: the orchestrator cannot ship a batch before its last episodes are durable, so the
commit latency sits on its critical path at every step (``benchmarks/journal.py``: a 2 ms
gathering delay cost ≈ 7 % of capacity, mostly waiting, not work).

Cut and compaction: a checkpoint captures :meth:`Journal.cut` — the last sequence number the
sink holds (``seq``) — with no ``await`` between it and the sink snapshot, and the journal
starts a new segment there; once ``progress.pt`` is durable, :meth:`Journal.compact` deletes
the segments whose records are all ``≤ seq`` and the journals of earlier attempts (their
records are in the snapshot, through the replay this attempt began with).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlrun.envs.base import Task
from rlrun.orchestrator.groups import KeptConversation
from rlrun.orchestrator.journal_files import (
    _CLOSE,
    _PAYLOAD_HEAD,
    BASE_FILE,
    FRESH_BASE,
    attempt_dirs,
    encode_record,
    encode_turn,
    journal_root,
    read_base,
    scan_segment,
    segments,
    write_small_atomic,
)
from rlrun.rundir import RunDir, _fault_point, fsync_dir
from rlrun.samples import Episode

log = logging.getLogger(__name__)

#: Crash-injection points (``$RLRUN_CRASH_AT``, :func:`rlrun.rundir._fault_point`), in order: the writer
#: took a batch of appends; wrote it, before fsync; fsynced, before the ack; a checkpoint cut (in the
#: capture, before ``progress.pt`` is written); during compaction (after ``progress.pt`` is durable).
JOURNAL_PHASES = ("journal_append", "journal_before_fsync", "journal_after_fsync", "journal_cut", "journal_compact")


class Journal:
    """This attempt's journal: append on the event loop, group-committed by a writer thread.

    Args:
        root: ``<run_dir>/journal``.
        attempt: the run-directory attempt (its directory is ``attempt-<K>``).
        base: the checkpoint this attempt began from, ``{"step", "attempt", "seq"}`` (written to
            ``base.json`` once, before any record; see :func:`replay`).
        on_durable: ``on_durable(seq)``, called on ``loop`` after each commit with the highest
            durable sequence number (None: nobody is told; use :meth:`wait_durable`).
        loop: the event loop that appends (default: the running one, when there is one).
        max_delay_s: how long, seconds, the writer gathers appends after taking the first pending
            one before it writes and fsyncs (0, the default: at once; see the module docstring).
        segment_bytes: a segment grows to about this many bytes before the next one starts.

    Attributes:
        next_seq: the sequence number the next append gets.
        durable_seq: the highest sequence number known durable on the loop (−1: none).
        admitted_seq: the highest sequence number the owner admitted to the sink (:meth:`admitted`).
        fsyncs, bytes_written: commits and bytes so far (for benchmarks and metrics).
    """

    def __init__(
        self,
        root: Path,
        attempt: int,
        base: dict[str, Any] | None = None,
        on_durable: Callable[[int], None] | None = None,
        loop: Any = None,
        max_delay_s: float = 0.0,
        segment_bytes: int = 64 << 20,
    ) -> None:
        self.root = root
        self.attempt = attempt
        self.dir = root / f"attempt-{attempt}"
        self.dir.mkdir(parents=True, exist_ok=True)
        fsync_dir(root)
        if read_base(self.dir) is None:
            write_small_atomic(self.dir / BASE_FILE, json.dumps(base or FRESH_BASE))
        self.on_durable = on_durable
        if loop is None:
            with contextlib.suppress(RuntimeError):
                loop = asyncio.get_running_loop()
        self.loop = loop
        self.max_delay_s = max_delay_s
        self.segment_bytes = segment_bytes
        self.next_seq = self._recover()
        self.durable_seq = self.admitted_seq = self.next_seq - 1
        self.starts: list[int] = [s for s, _ in segments(self.dir)]  # segment first seqs, incl. planned ones
        if not self.starts or self.starts[-1] < self.next_seq:
            self.starts.append(self.next_seq)  # the first segment this process writes
        self.fsyncs = 0
        self.bytes_written = 0
        # The loop never waits on the writer (a writer descheduled while holding a lock would stall the
        # loop): SimpleQueue.put never blocks, and the writer sleeps in get() with the GIL released.
        self._queue: queue.SimpleQueue[tuple[int, bytes] | None] = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._waiters: list[tuple[int, Any]] = []
        self._fd: int | None = None
        self._fd_start = -1
        self._fd_bytes = 0
        self._thread = threading.Thread(target=self._write_loop, name=f"journal-{attempt}", daemon=True)
        self._thread.start()

    def _recover(self) -> int:
        """The next sequence number after what this attempt's directory holds; truncate a torn tail."""
        segs = segments(self.dir)
        if not segs:
            return 0
        first, path = segs[-1]
        scan = scan_segment(path, last=True)
        if scan.torn_at is not None:
            with open(path, "r+b") as fh:
                fh.truncate(scan.torn_at)
                os.fsync(fh.fileno())
        if not scan.payloads:
            return first
        return _PAYLOAD_HEAD.unpack_from(scan.payloads[-1][1])[0] + 1

    # -- the loop's side --------------------------------------------------------------------------

    def append(self, group_id: int, task: Task, episodes: list[Episode]) -> int:
        """Queue one request's finished episodes for the next group commit; returns the record's seq.

        Not durable on return: wait for ``on_durable`` (or :meth:`wait_durable`) before counting them.

        Raises:
            OSError: an earlier commit failed (the journal is unusable; nothing more is acknowledged).
        """
        if self._error is not None:
            raise OSError(f"journal {self.dir} failed: {self._error}") from self._error
        seq = self.next_seq
        self.next_seq += 1
        self._queue.put((seq, encode_record(seq, group_id, task, episodes)))
        return seq

    def append_turn(self, kept: KeptConversation) -> int:
        """Queue a multi-turn episode's last durable turn for the next group commit (:func:`encode_turn`); returns
        the record's seq. Not durable on return, as :meth:`append`.

        Raises:
            OSError: an earlier commit failed.
        """
        if self._error is not None:
            raise OSError(f"journal {self.dir} failed: {self._error}") from self._error
        seq = self.next_seq
        self.next_seq += 1
        self._queue.put((seq, encode_turn(seq, kept)))
        return seq

    def admitted(self, seq: int) -> None:
        """The owner put record ``seq`` (and every one before it) into the sink."""
        self.admitted_seq = max(self.admitted_seq, seq)

    def cut(self) -> dict[str, int]:
        """Where a checkpoint's snapshot ends in the journal: ``{"attempt", "seq"}`` (``seq``: the last
        admitted record). Call on the loop in the same step as the snapshot capture; the next append
        starts a new segment, so compaction can delete whole files."""
        if max(self.starts) < self.next_seq:
            self.starts.append(self.next_seq)  # atomic under the GIL; the writer only reads and appends
        _fault_point("journal_cut")
        return {"attempt": self.attempt, "seq": self.admitted_seq}

    async def wait_durable(self, seq: int) -> None:
        """Return once record ``seq`` is durable (needs ``loop``/a running loop at construction)."""
        if seq <= self.durable_seq:
            return
        fut = self._loop().create_future()
        self._waiters.append((seq, fut))
        if seq <= self.durable_seq:  # committed meanwhile, before a loop was known to tell
            self._durable(self.durable_seq)
        await fut

    def _loop(self) -> Any:
        if self.loop is None:
            self.loop = asyncio.get_running_loop()
        return self.loop

    def _durable(self, seq: int) -> None:  # on the loop
        self.durable_seq = max(self.durable_seq, seq)
        if self._waiters:
            done = [f for s, f in self._waiters if s <= seq]
            self._waiters = [(s, f) for s, f in self._waiters if s > seq]
            for f in done:
                if not f.done():
                    f.set_result(None)
        if self.on_durable is not None:
            self.on_durable(seq)

    def compact(self, cut: dict[str, int]) -> list[Path]:
        """Delete what checkpoint ``cut`` (of this attempt, now durable) covers: earlier attempts'
        journals and this attempt's segments whose records are all ``≤ cut["seq"]``. Returns the
        paths removed (files and directories). Safe in a thread while appends go on."""
        removed: list[Path] = []
        for a, d in attempt_dirs(self.root).items():
            if a < self.attempt:
                for _, p in segments(d):
                    p.unlink(missing_ok=True)
                    _fault_point("journal_compact")
                (d / BASE_FILE).unlink(missing_ok=True)
                try:
                    d.rmdir()
                except OSError:
                    continue  # something else is in it: leave it
                removed.append(d)
        starts = sorted(set(self.starts))
        # a segment's records are [first, next first): all covered when next first − 1 ≤ the cut
        covered = {first for first, nxt in itertools.pairwise(starts) if nxt - 1 <= cut["seq"]}
        for first, path in segments(self.dir):
            if first in covered:
                path.unlink(missing_ok=True)
                removed.append(path)
                _fault_point("journal_compact")
        if removed:
            fsync_dir(self.dir)
            fsync_dir(self.root)
        return removed

    @classmethod
    async def open(
        cls, run_dir: RunDir, attempt: int, base: dict[str, Any], on_durable: Callable[[int], None]
    ) -> Journal:
        """Attempt ``attempt``'s journal under ``run_dir``'s ``journal/`` (:func:`journal_root`), made in a thread (it
        creates and syncs files), from the snapshot's ``base``; ``on_durable`` is called on the running event loop."""
        loop = asyncio.get_running_loop()
        return await asyncio.to_thread(cls, journal_root(run_dir), attempt, base, on_durable, loop)

    async def aclose(self) -> None:
        """:meth:`close` in a thread (what is pending becomes durable: the next attempt replays it), then log the
        journal's counts."""
        await asyncio.to_thread(self.close)
        log.info("journal: %d records, %d fsyncs, %d bytes", self.next_seq, self.fsyncs, self.bytes_written)

    def close(self) -> None:
        """Commit what is pending, stop the writer and close the file (blocking; call in a thread)."""
        self._queue.put(_CLOSE)
        self._thread.join()

    # -- the writer thread ------------------------------------------------------------------------

    def _write_loop(self) -> None:
        while True:
            first = self._queue.get()  # asleep, GIL released, until an append (or close)
            closing = first is _CLOSE
            batch = [] if closing else [first]
            if self.max_delay_s > 0 and not closing:
                time.sleep(self.max_delay_s)  # gather (see max_delay_s)
            while not closing:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is _CLOSE:
                    closing = True
                else:
                    batch.append(item)
            starts = list(self.starts)  # after the drain: covers every seq in it (a later cut starts past them)
            if batch:
                try:
                    self._commit(batch, starts)
                except BaseException as exc:  # reported to the loop's next append
                    log.exception("journal %s: commit failed", self.dir)
                    self._error = exc
                    return
                loop = self.loop
                if loop is not None and not loop.is_closed():
                    with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                        loop.call_soon_threadsafe(self._durable, batch[-1][0])
                else:
                    self.durable_seq = batch[-1][0]
            if closing:
                if self._fd is not None:
                    os.close(self._fd)
                    self._fd = None
                return

    def _commit(self, batch: list[tuple[int, bytes]], starts: list[int]) -> None:
        _fault_point("journal_append")
        chunk: list[bytes] = []
        for seq, frame in batch:
            start = max((s for s in starts if s <= seq), default=seq)
            if self._fd is not None and start == self._fd_start and self._fd_bytes >= self.segment_bytes:
                start = seq  # size-based rotation: a new segment at this record
                starts.append(seq)
                self.starts.append(seq)
            if self._fd is None or start != self._fd_start:
                self._flush(chunk)  # the old segment is durable before the new one gets a record
                chunk = []
                self._open(start)
            chunk.append(frame)
            self._fd_bytes += len(frame)
        self._flush(chunk)

    def _flush(self, chunk: list[bytes]) -> None:
        if not chunk or self._fd is None:
            return
        data = b"".join(chunk)
        view = memoryview(data)
        while view:
            n = os.write(self._fd, view)
            view = view[n:]
        _fault_point("journal_before_fsync")
        os.fdatasync(self._fd) if hasattr(os, "fdatasync") else os.fsync(self._fd)
        _fault_point("journal_after_fsync")
        self.fsyncs += 1
        self.bytes_written += len(data)

    def _open(self, start: int) -> None:
        if self._fd is not None:
            os.close(self._fd)
        path = self.dir / f"seg-{start:012d}.jnl"
        created = not path.exists()
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._fd_start = start
        self._fd_bytes = os.fstat(self._fd).st_size
        if created:
            fsync_dir(self.dir)  # the new file's name is durable before any record in it is acknowledged
