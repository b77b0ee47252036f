"""The episode journal's files: their layout, the record frame, reading them back, and the replay.

Layout (``<run_dir>/journal/``)::

    attempt-<K>/base.json                 the checkpoint attempt K began from (step, attempt, seq)
    attempt-<K>/seg-<first seq:012d>.jnl  append-only segments; records numbered 0, 1, … per attempt

Record frame (little-endian): ``magic b"RJ01" | u32 payload length | u32 crc32(payload) |
payload``; payload = ``u64 seq | u32 meta length | meta (JSON: group id, task, per episode
member, policy version, reward, finish reason, token counts) | int64 prompt ids, int64
completion ids, float64 logprobs of each episode in turn``. JSON floats round-trip exactly,
so a replayed episode equals the one journaled. A **turn record** (a multi-turn episode at its last
durable turn, :class:`~rlrun.orchestrator.groups.KeptConversation`) has the same frame; its meta holds
``conv`` (member, policy version, turns, reward, tool counts, the env's state, token counts) and its
payload the conversation's prompt ids, completion ids and logprobs (NaN on env tokens).

Torn tail: a frame that is incomplete, zero-filled or fails its checksum **at the end of an
attempt's newest segment** was never acknowledged (acks follow the fsync); it is dropped with
a log line (and truncated away when the attempt's journal is opened again). Anything else —
a bad frame followed by more data, a bad frame in an older segment, a gap in the sequence —
is :class:`JournalCorrupt`, naming the file and byte offset: acknowledged records cannot be
silently dropped. The writer is :mod:`.journal`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import struct
import zlib
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlrun.envs.base import Task
from rlrun.orchestrator.groups import KeptConversation
from rlrun.rundir import fsync_dir
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

#: The base of an attempt that began from no checkpoint (a fresh start or a start-over).
FRESH_BASE: dict[str, Any] = {"step": None, "attempt": None, "seq": None}


def journal_root(run_dir: Any) -> Path:
    """``<run_dir>/journal`` of a :class:`~rlrun.rundir.RunDir`."""
    return run_dir.root / "journal"


class JournalCorrupt(RuntimeError):
    """A journal record that is neither valid nor a torn tail; the message names file and byte offset."""


@dataclass(frozen=True)
class JournalRecord:
    """One request's finished episodes, or one multi-turn episode's last durable turn, as journaled.

    Attributes:
        attempt: the run-directory attempt that journaled it.
        seq: its sequence number in that attempt's journal (0, 1, …).
        group_id: the group.
        task: the group's task.
        episodes: the request's finished episodes, in member order (none in a turn record).
        conversation: a turn record's conversation (None: an episode record).
    """

    attempt: int
    seq: int
    group_id: int
    task: Task
    episodes: list[Episode]
    conversation: KeptConversation | None = None


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


def encode_turn(seq: int, kept: KeptConversation) -> bytes:
    """One framed turn record (see the module docstring)."""
    conv = [kept.member, kept.policy_version, kept.turns, kept.reward, kept.tool_calls, kept.tool_errors, kept.state]
    meta = {"g": kept.group_id, "task": kept.task.to_dict(), "conv": [*conv, len(kept.prompt_ids), len(kept.logprobs)]}
    meta_b = _META_JSON.encode(meta).encode()
    parts = [_PAYLOAD_HEAD.pack(seq, len(meta_b)), meta_b]
    parts += [_as_array("q", kept.prompt_ids).tobytes(), _as_array("q", kept.completion_ids).tobytes()]
    parts.append(_as_array("d", kept.logprobs).tobytes())
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
    if "conv" in meta:
        member, version, turns, reward, calls, errors, state, n_prompt, n_completion = meta["conv"]
        prompt, off = _take(payload, off, "q", n_prompt)
        completion, off = _take(payload, off, "q", n_completion)
        logprobs, off = _take(payload, off, "d", n_completion)
        if off != len(payload):
            raise ValueError(f"journal record {seq}: {len(payload) - off} bytes left over")
        kept = KeptConversation(
            meta["g"], member, task, version, prompt, completion, logprobs, state, turns, reward, calls, errors
        )
        return JournalRecord(attempt, seq, meta["g"], task, [], kept)
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
            log.warning(
                "journal %s: torn last record at byte %d (%s) dropped: it was never acknowledged", path, off, problem
            )
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


def write_small_atomic(path: Path, text: str) -> None:
    """Temporary file, fsync, rename, directory fsync (no crash-injection points: the checkpoint
    trials count those of :func:`rlrun.rundir.write_file_atomic`)."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
