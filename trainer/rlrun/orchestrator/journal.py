"""The episode journal: a finished episode is durable before the orchestrator counts it.

Guarantee: every request's finished episodes are appended to this attempt's journal and
fsynced **before** they enter the sink or the ledger records them ``finished``; so a kill
at any instant (SIGKILL, OOM, node loss) loses no acknowledged episode: a resume puts back
the newest complete checkpoint's snapshot and replays the journal records after its cut
(:func:`replay`). Who relies on it: :mod:`.loop` (admits episodes only once durable),
:mod:`.checkpointing` (cuts and compacts at each save), :mod:`.resume` (replays), and
``rlrun ledger check`` (every acknowledged episode ends exactly once).

Layout (``<run_dir>/journal/``)::

    attempt-<K>/base.json                 the checkpoint attempt K began from (step, attempt, seq)
    attempt-<K>/seg-<first seq:012d>.jnl  append-only segments; records numbered 0, 1, … per attempt

Record frame (little-endian): ``magic b"RJ01" | u32 payload length | u32 crc32(payload) |
payload``; payload = ``u64 seq | u32 meta length | meta (JSON: group id, task, per episode
member, policy version, reward, finish reason, token counts) | int64 prompt ids, int64
completion ids, float64 logprobs of each episode in turn``. JSON floats round-trip exactly,
so a replayed episode equals the one journaled.

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

Torn tail: a frame that is incomplete, zero-filled or fails its checksum **at the end of an
attempt's newest segment** was never acknowledged (acks follow the fsync); it is dropped with
a log line (and truncated away when the attempt's journal is opened again). Anything else —
a bad frame followed by more data, a bad frame in an older segment, a gap in the sequence —
is :class:`JournalCorrupt`, naming the file and byte offset: acknowledged records cannot be
silently dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import queue
import re
import struct
import threading
import time
import zlib
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlrun.envs.base import Task
from rlrun.rundir import _fault_point, fsync_dir
from rlrun.samples import Episode

log = logging.getLogger(__name__)

MAGIC = b"RJ01"
_HEADER = struct.Struct("<4sII")  # magic, payload length, crc32(payload)
_PAYLOAD_HEAD = struct.Struct("<QI")  # seq, meta length
_SEGMENT_RE = re.compile(r"^seg-(\d{12})\.jnl$")
_ATTEMPT_RE = re.compile(r"^attempt-(\d+)$")
_META_JSON = json.JSONEncoder(separators=(",", ":"))  # one encoder: json.dumps(…, separators=…) builds one per call
_CLOSE = None  # the writer's stop marker in its queue
BASE_FILE = "base.json"

#: Crash-injection points (``$RLRUN_CRASH_AT``, :func:`rlrun.rundir._fault_point`), in order: the writer
#: took a batch of appends; wrote it, before fsync; fsynced, before the ack; a checkpoint cut (in the
#: capture, before ``progress.pt`` is written); during compaction (after ``progress.pt`` is durable).
JOURNAL_PHASES = ("journal_append", "journal_before_fsync", "journal_after_fsync", "journal_cut", "journal_compact")


#: The base of an attempt that began from no checkpoint (a fresh start or a start-over).
FRESH_BASE: dict[str, Any] = {"step": None, "attempt": None, "seq": None}


def journal_root(run_dir: Any) -> Path:
    """``<run_dir>/journal`` of a :class:`~rlrun.rundir.RunDir`."""
    return run_dir.root / "journal"


class JournalCorrupt(RuntimeError):
    """A journal record that is neither valid nor a torn tail; the message names file and byte offset."""


@dataclass(frozen=True)
class JournalRecord:
    """One request's finished episodes, as journaled.

    Attributes:
        attempt: the run-directory attempt that journaled it.
        seq: its sequence number in that attempt's journal (0, 1, …).
        group_id: the group.
        task: the group's task.
        episodes: the request's finished episodes, in member order.
    """

    attempt: int
    seq: int
    group_id: int
    task: Task
    episodes: list[Episode]


def encode_record(seq: int, group_id: int, task: Task, episodes: list[Episode]) -> bytes:
    """One framed record (see the module docstring); ``episodes`` must belong to group ``group_id``."""
    meta = {
        "g": group_id,
        "task": task.to_dict(),
        "eps": [
            [e.member, e.policy_version, e.reward, e.finish_reason, len(e.prompt_ids), len(e.completion_ids)]
            for e in episodes
        ],
    }
    meta_b = _META_JSON.encode(meta).encode()
    parts = [_PAYLOAD_HEAD.pack(seq, len(meta_b)), meta_b]
    for e in episodes:
        parts.append(_as_array("q", e.prompt_ids).tobytes())
        parts.append(_as_array("q", e.completion_ids).tobytes())
        parts.append(_as_array("d", e.logprobs).tobytes())
    payload = b"".join(parts)
    return _HEADER.pack(MAGIC, len(payload), zlib.crc32(payload)) + payload


def _as_array(typecode: str, values: Any) -> array:
    return values if isinstance(values, array) and values.typecode == typecode else array(typecode, values)


def decode_payload(payload: bytes, attempt: int) -> JournalRecord:
    """Inverse of :func:`encode_record` for a payload whose checksum matched.

    Raises:
        ValueError: the payload's lengths do not add up (a bug, not a torn write).
    """
    seq, meta_len = _PAYLOAD_HEAD.unpack_from(payload)
    off = _PAYLOAD_HEAD.size
    meta = json.loads(payload[off : off + meta_len])
    off += meta_len
    task = Task.from_dict(meta["task"])
    episodes = []
    for member, version, reward, finish, n_prompt, n_completion in meta["eps"]:
        prompt, off = _take(payload, off, "q", n_prompt)
        completion, off = _take(payload, off, "q", n_completion)
        logprobs, off = _take(payload, off, "d", n_completion)
        episodes.append(Episode(meta["g"], member, task, prompt, completion, logprobs, version, reward, finish))
    if off != len(payload):
        raise ValueError(f"journal record {seq}: {len(payload) - off} bytes left over")
    return JournalRecord(attempt, seq, meta["g"], task, episodes)


def _take(buf: bytes, off: int, typecode: str, n: int) -> tuple[array, int]:
    out = array(typecode)
    end = off + 8 * n
    if end > len(buf):
        raise ValueError("journal record shorter than its meta says")
    out.frombytes(buf[off:end])
    return out, end


@dataclass
class SegmentScan:
    """What :func:`scan_segment` found: the valid records, where they end, and a torn tail if any.

    Attributes:
        payloads: ``(offset, payload)`` of each valid frame, in file order.
        valid_bytes: length of the valid prefix.
        torn_at: offset of a torn tail (None: the file ends cleanly).
    """

    payloads: list[tuple[int, bytes]]
    valid_bytes: int
    torn_at: int | None


def scan_segment(path: Path, last: bool) -> SegmentScan:
    """Read a segment's frames, checking each checksum.

    Args:
        path: the segment file.
        last: whether it is the attempt's newest segment (only that one may end in a torn tail).

    Raises:
        JournalCorrupt: a bad frame that is not a torn tail (module docstring), naming file and offset.
    """
    data = path.read_bytes()
    out: list[tuple[int, bytes]] = []
    off = 0
    while off < len(data):
        problem = None
        end = len(data)
        if len(data) - off < _HEADER.size:
            problem = "incomplete frame header"
        else:
            magic, length, crc = _HEADER.unpack_from(data, off)
            end = off + _HEADER.size + length
            if magic != MAGIC:
                problem, end = "bad magic", len(data)
            elif end > len(data):
                problem = "frame runs past the end of the file"
            elif zlib.crc32(data[off + _HEADER.size : end]) != crc:
                problem = "checksum mismatch"
        if problem is None:
            out.append((off, data[off + _HEADER.size : end]))
            off = end
            continue
        # Torn tail: nothing but this frame (or zeros a crash left) follows, in the newest segment.
        if last and (end >= len(data) or not any(data[end:])):
            log.warning("journal %s: torn last record at byte %d (%s) dropped: it was never acknowledged",
                        path, off, problem)  # fmt: skip
            return SegmentScan(out, off, off)
        raise JournalCorrupt(
            f"journal {path}: {problem} at byte {off} of {len(data)}, with data after it — acknowledged records "
            f"follow, so this is damage, not a torn write. Move the file aside to resume without its records "
            f"from byte {off} on (their episodes will count as lost in `rlrun ledger check`)"
        )
    return SegmentScan(out, off, None)


def segments(attempt_dir: Path) -> list[tuple[int, Path]]:
    """``(first seq, path)`` of an attempt's segments, by first seq."""
    if not attempt_dir.is_dir():
        return []
    found = ((_SEGMENT_RE.match(p.name), p) for p in attempt_dir.iterdir())
    return sorted((int(m.group(1)), p) for m, p in found if m)


def read_records(attempt_dir: Path, attempt: int, after: int = -1) -> Iterator[JournalRecord]:
    """An attempt's records with ``seq > after``, in order.

    Raises:
        JournalCorrupt: damage (see :func:`scan_segment`) or a gap in the sequence numbers.
    """
    segs = segments(attempt_dir)
    expected = None
    for i, (first, path) in enumerate(segs):
        if i + 1 < len(segs) and segs[i + 1][0] <= after:
            continue  # wholly before the cut (compaction may just not have run)
        scan = scan_segment(path, last=i == len(segs) - 1)
        for off, payload in scan.payloads:
            seq = _PAYLOAD_HEAD.unpack_from(payload)[0]
            if seq != (first if expected is None else expected):
                raise JournalCorrupt(
                    f"journal {path}: record {seq} at byte {off}, expected {first if expected is None else expected}"
                )
            expected = seq + 1
            if seq > after:
                yield decode_payload(payload, attempt)
        expected = None


def attempt_dirs(root: Path) -> dict[int, Path]:
    """``{attempt: directory}`` under ``<run_dir>/journal``."""
    if not root.is_dir():
        return {}
    found = ((_ATTEMPT_RE.match(p.name), p) for p in root.iterdir())
    return {int(m.group(1)): p for m, p in found if m and p.is_dir()}


def read_base(attempt_dir: Path) -> dict[str, Any] | None:
    """The ``base.json`` of an attempt's journal (None when missing or unreadable)."""
    try:
        return json.loads((attempt_dir / BASE_FILE).read_text())
    except (OSError, ValueError):
        return None


def replay(root: Path, base: dict[str, Any], attempt: int) -> list[JournalRecord]:
    """The journal records a resume from ``base`` must put back, in the order they were acknowledged.

    ``base`` is the checkpoint resumed from, ``{"step": N, "attempt": A, "seq": c}`` (the cut its
    snapshot took, :meth:`Journal.cut`; ``{"step": None, "attempt": None, "seq": None}`` for a start
    from nothing). Returned: attempt ``A``'s records after ``c``, then, in attempt order, every record
    of each later attempt before ``attempt`` that began from this same base (``base.json``) — it built
    on the same state and died before completing a checkpoint of its own. An attempt that began from
    another base is skipped (logged): its records build on a state this resume does not have.

    Raises:
        JournalCorrupt: damage in a journal that must be replayed.
    """
    dirs = attempt_dirs(root)
    out: list[JournalRecord] = []
    a, cut = base.get("attempt"), base.get("seq")
    if a is not None and a in dirs:
        out.extend(read_records(dirs[a], a, -1 if cut is None else cut))
    key = (base.get("step"), a, cut)
    for b in sorted(dirs):
        if b > attempt or (a is not None and b <= a):  # b == attempt: this attempt restarted (same number)
            continue
        began = read_base(dirs[b])
        if began is None or (began.get("step"), began.get("attempt"), began.get("seq")) != key:
            log.info("journal of attempt %d not replayed: it began from %s, not from %s", b, began, key)
            continue
        out.extend(read_records(dirs[b], b))
    return out


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
            _write_small_atomic(self.dir / BASE_FILE, json.dumps(base or FRESH_BASE))
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


def _write_small_atomic(path: Path, text: str) -> None:
    """Temporary file, fsync, rename, directory fsync (no crash-injection points: the checkpoint
    trials count those of :func:`rlrun.rundir.write_file_atomic`)."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


__all__ = [
    "FRESH_BASE",
    "JOURNAL_PHASES",
    "Journal",
    "JournalCorrupt",
    "JournalRecord",
    "encode_record",
    "journal_root",
    "read_records",
    "replay",
    "scan_segment",
]
