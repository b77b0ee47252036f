"""The episode journal: records round-trip exactly, are group-committed within the bound, a torn tail is
dropped and a damaged middle named, a checkpoint's cut rotates and compacts, and a resume replays exactly the
records after the cut (of the checkpoint's attempt and of the attempts that began from it)."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from array import array

import pytest
from rlrun.envs.base import Task
from rlrun.orchestrator.journal import Journal
from rlrun.orchestrator.journal_files import (
    FRESH_BASE,
    JournalCorrupt,
    encode_record,
    read_records,
    replay,
    scan_segment,
    segments,
)
from rlrun.orchestrator.resume import with_journal
from rlrun.orchestrator.sink import TrainSink
from rlrun.orchestrator.snapshot import SinkSnapshot, restore_plan
from rlrun.samples import Episode

TASK = Task("reverse-text", 7, "flat is=", "si talf")


def episodes(group: int, first: int, n: int = 2, version: int = 3) -> list[Episode]:
    return [
        Episode(
            group,
            m,
            TASK,
            array("q", [5, 6, 7, 8]),
            array("q", [40 + m, 41, 0]),
            array("d", [-0.125 * m, -1e-9, -3.25]),
            version,
            0.1 + m / 3,
            "stop" if m % 2 else "length",
        )
        for m in range(first, first + n)
    ]


def append_all(journal: Journal, records) -> list[int]:
    return [journal.append(g, TASK, eps) for g, eps in records]


async def test_records_round_trip_exactly_and_in_order(tmp_path):
    journal = Journal(tmp_path, 1)
    records = [(g, episodes(g, 2 * g, n=1 + g % 3)) for g in range(20)]
    seqs = append_all(journal, records)
    assert seqs == list(range(20))
    await journal.wait_durable(seqs[-1])
    await asyncio.to_thread(journal.close)
    read = list(read_records(tmp_path / "attempt-1", 1))
    assert [r.seq for r in read] == seqs and [r.group_id for r in read] == [g for g, _ in records]
    assert [r.episodes for r in read] == [eps for _, eps in records]  # floats, tokens, members: equal
    assert read[4].task == TASK and read[4].attempt == 1
    assert json.loads((tmp_path / "attempt-1" / "base.json").read_text()) == FRESH_BASE


async def test_appends_are_group_committed_within_the_delay_bound(tmp_path):
    delay = 0.02  # long enough that a burst's 50 appends land in one window even on a loaded machine
    journal = Journal(tmp_path, 1, max_delay_s=delay)
    latencies = []
    for burst in range(10):
        t0 = time.perf_counter()
        seqs = append_all(journal, [(burst * 50 + i, episodes(burst * 50 + i, 0)) for i in range(50)])
        await journal.wait_durable(seqs[-1])
        latencies.append(time.perf_counter() - t0)
    await asyncio.to_thread(journal.close)
    # 500 records acknowledged with one commit per burst (two where the machine stalled the loop mid-burst),
    # not one fsync each
    assert journal.next_seq == 500 and 10 <= journal.fsyncs <= 20
    # each burst waited the delay (gathering), not much more: bound + one write and fsync
    assert min(latencies) >= delay * 0.9
    assert sorted(latencies)[len(latencies) // 2] < delay + 0.1


async def test_by_default_the_appends_made_during_a_commit_form_the_next_one(tmp_path, monkeypatch):
    """No gathering timer: the first record is committed alone at once; the 20 appended while its
    ``fdatasync`` runs (held 0.2 s here) are committed together right after it."""
    real, syncing = os.fdatasync, threading.Event()

    def slow_fdatasync(fd: int) -> None:
        syncing.set()
        time.sleep(0.2)
        real(fd)

    monkeypatch.setattr(os, "fdatasync", slow_fdatasync)
    journal = Journal(tmp_path, 1)
    assert journal.max_delay_s == 0
    journal.append(0, TASK, episodes(0, 0))
    assert await asyncio.to_thread(syncing.wait, 10)
    seqs = append_all(journal, [(g, episodes(g, 0)) for g in range(1, 21)])
    await journal.wait_durable(seqs[-1])
    await asyncio.to_thread(journal.close)
    assert journal.fsyncs == 2 and journal.durable_seq == 20
    assert [r.seq for r in read_records(tmp_path / "attempt-1", 1)] == list(range(21))


async def test_nothing_is_reported_durable_before_its_fsync(tmp_path):
    seen: list[int] = []
    journal = Journal(tmp_path, 1, on_durable=seen.append, loop=asyncio.get_running_loop(), max_delay_s=0.05)
    seq = journal.append(1, TASK, episodes(1, 0))
    await asyncio.sleep(0.01)
    assert seen == [] and journal.durable_seq == -1  # still gathering: not acknowledged
    await journal.wait_durable(seq)
    assert seen == [0] and journal.fsyncs == 1
    await asyncio.to_thread(journal.close)


def write_segment(path, records) -> list[int]:
    """Frames of ``(seq, group)`` records written to ``path``; returns each frame's offset."""
    offsets, data = [], b""
    for seq, g in records:
        offsets.append(len(data))
        data += encode_record(seq, g, TASK, episodes(g, 0))
    path.write_bytes(data)
    return offsets


@pytest.mark.parametrize("tear", ["cut_short", "zero_filled", "bad_checksum", "half_header"])
def test_a_torn_last_record_is_dropped(tmp_path, tear, caplog):
    seg = tmp_path / "seg-000000000000.jnl"
    offsets = write_segment(seg, [(0, 1), (1, 2), (2, 3)])
    data = bytearray(seg.read_bytes())
    if tear == "cut_short":
        data = data[:-7]
    elif tear == "zero_filled":
        data[offsets[2] :] = bytes(len(data) - offsets[2])
    elif tear == "bad_checksum":
        data[-1] ^= 0xFF
    else:
        data = data[: offsets[2] + 5]
    seg.write_bytes(bytes(data))
    scan = scan_segment(seg, last=True)
    assert [o for o, _ in scan.payloads] == offsets[:2] and scan.torn_at == offsets[2] == scan.valid_bytes
    assert "torn last record at byte" in caplog.text
    assert [r.seq for r in read_records(tmp_path, 1)] == [0, 1]


def test_a_damaged_record_in_the_middle_is_an_error_naming_file_and_offset(tmp_path):
    seg = tmp_path / "seg-000000000000.jnl"
    offsets = write_segment(seg, [(0, 1), (1, 2), (2, 3)])
    data = bytearray(seg.read_bytes())
    data[offsets[1] + 20] ^= 0x01  # a flipped bit inside record 1, record 2 intact after it
    seg.write_bytes(bytes(data))
    with pytest.raises(JournalCorrupt, match=rf"{seg}: checksum mismatch at byte {offsets[1]} of {len(data)}"):
        list(read_records(tmp_path, 1))


def test_a_torn_tail_in_an_older_segment_is_damage_not_a_torn_write(tmp_path):
    write_segment(tmp_path / "seg-000000000000.jnl", [(0, 1), (1, 2)])
    write_segment(tmp_path / "seg-000000000002.jnl", [(2, 3)])
    old = tmp_path / "seg-000000000000.jnl"
    old.write_bytes(old.read_bytes()[:-3])
    with pytest.raises(JournalCorrupt, match=r"seg-000000000000\.jnl: frame runs past the end"):
        list(read_records(tmp_path, 1))


def test_a_gap_in_the_sequence_is_damage(tmp_path):
    write_segment(tmp_path / "seg-000000000000.jnl", [(0, 1), (2, 2)])
    with pytest.raises(JournalCorrupt, match=r"record 2 at byte \d+, expected 1"):
        list(read_records(tmp_path, 1))


async def test_reopening_truncates_a_torn_tail_and_continues_the_sequence(tmp_path):
    journal = Journal(tmp_path, 0)
    await journal.wait_durable(append_all(journal, [(1, episodes(1, 0)), (2, episodes(2, 0))])[-1])
    await asyncio.to_thread(journal.close)
    [(_, seg)] = segments(tmp_path / "attempt-0")
    seg.write_bytes(seg.read_bytes() + encode_record(2, 9, TASK, episodes(9, 0))[:-10])  # killed mid-write
    again = Journal(tmp_path, 0)
    assert again.next_seq == 2
    await again.wait_durable(again.append(3, TASK, episodes(3, 0)))
    await asyncio.to_thread(again.close)
    assert [(r.seq, r.group_id) for r in read_records(tmp_path / "attempt-0", 0)] == [(0, 1), (1, 2), (2, 3)]


async def test_a_cut_starts_a_new_segment_and_compaction_deletes_only_what_the_cut_covers(tmp_path):
    journal = Journal(tmp_path, 2, base={"step": 4, "attempt": 1, "seq": 9})
    (tmp_path / "attempt-1").mkdir()
    write_segment(tmp_path / "attempt-1" / "seg-000000000000.jnl", [(0, 1)])  # an earlier attempt's journal
    seqs = append_all(journal, [(g, episodes(g, 0)) for g in range(5)])
    await journal.wait_durable(seqs[-1])
    for s in seqs[:3]:
        journal.admitted(s)
    cut = journal.cut()  # records 3 and 4 are durable but not admitted: not in the snapshot
    assert cut == {"attempt": 2, "seq": 2}
    await journal.wait_durable(append_all(journal, [(5, episodes(5, 0))])[-1])
    names = [p.name for _, p in segments(tmp_path / "attempt-2")]
    assert names == ["seg-000000000000.jnl", "seg-000000000005.jnl"]
    # records 3 and 4 are in the first segment: it stays until a cut covers them; attempt 1's journal goes
    assert journal.compact(cut) == [tmp_path / "attempt-1"]
    assert [p.name for _, p in segments(tmp_path / "attempt-2")] == names
    for s in (3, 4, 5):
        journal.admitted(s)
    later = journal.cut()
    await journal.wait_durable(append_all(journal, [(6, episodes(6, 0))])[-1])
    assert journal.compact(later) == [
        tmp_path / "attempt-2" / "seg-000000000000.jnl",
        tmp_path / "attempt-2" / "seg-000000000005.jnl",
    ]
    await asyncio.to_thread(journal.close)
    assert [r.seq for r in read_records(tmp_path / "attempt-2", 2)] == [6]


async def test_a_segment_past_its_size_is_rotated_at_a_record_boundary(tmp_path):
    size = len(encode_record(0, 1, TASK, episodes(1, 0)))
    journal = Journal(tmp_path, 1, segment_bytes=4 * size)
    for g in range(20):  # one commit each
        await journal.wait_durable(journal.append(g, TASK, episodes(g, 0)))
    await asyncio.to_thread(journal.close)
    segs = segments(tmp_path / "attempt-1")
    assert [first for first, _ in segs] == [0, 4, 8, 12, 16]
    assert all(4 * size - 8 <= p.stat().st_size < 5 * size for _, p in segs)  # group ids differ in digits
    assert [r.seq for r in read_records(tmp_path / "attempt-1", 1)] == list(range(20))


async def test_replay_after_a_cut_takes_the_tail_and_the_attempts_that_began_from_the_same_checkpoint(tmp_path):
    first = Journal(tmp_path, 1)
    await first.wait_durable(append_all(first, [(g, episodes(g, 0)) for g in range(6)])[-1])
    await asyncio.to_thread(first.close)
    base = {"step": 2, "attempt": 1, "seq": 3}  # attempt 1's checkpoint of step 2 held records 0–3
    second = Journal(tmp_path, 2, base=base)  # resumed from it, then died before a checkpoint of its own
    await second.wait_durable(append_all(second, [(10, episodes(10, 0)), (11, episodes(11, 0))])[-1])
    await asyncio.to_thread(second.close)
    other = Journal(tmp_path, 3, base={"step": 0, "attempt": 1, "seq": 0})  # began from another checkpoint
    await other.wait_durable(other.append(99, TASK, episodes(99, 0)))
    await asyncio.to_thread(other.close)
    got = replay(tmp_path, base, attempt=4)
    assert [(r.attempt, r.seq, r.group_id) for r in got] == [(1, 4, 4), (1, 5, 5), (2, 0, 10), (2, 1, 11)]
    assert replay(tmp_path, {"step": 2, "attempt": 1, "seq": 5}, attempt=2) == []  # nothing after the cut
    # a start-over (no complete checkpoint) replays only attempt 1, the one that began from nothing
    assert [(r.attempt, r.seq) for r in replay(tmp_path, FRESH_BASE, attempt=4)] == [(1, s) for s in range(6)]


async def test_a_start_over_replays_the_journals_of_attempts_that_began_from_nothing(tmp_path):
    first = Journal(tmp_path, 1)  # fresh
    await first.wait_durable(append_all(first, [(0, episodes(0, 0)), (1, episodes(1, 0))])[-1])
    await asyncio.to_thread(first.close)
    assert [(r.attempt, r.group_id) for r in replay(tmp_path, FRESH_BASE, attempt=2)] == [(1, 0), (1, 1)]


def test_replayed_members_complete_their_groups_and_a_completed_group_is_scored_on_restore():
    # the snapshot holds members 0–1 of group 5; the journal after its cut members 2–3 of group 5 and
    # members 0–1 of a group 8 opened after the snapshot
    from rlrun.orchestrator.journal_files import JournalRecord

    snap = SinkSnapshot([], [(5, TASK, episodes(5, 0))], [])
    records = [JournalRecord(1, 7, 5, TASK, episodes(5, 2)), JournalRecord(1, 8, 8, TASK, episodes(8, 0))]
    merged, added = with_journal(snap, records)
    assert [e.episode_id for e in added] == ["5/2", "5/3", "8/0", "8/1"]
    assert snap.open_groups[0][2] == episodes(5, 0)  # the snapshot itself is unchanged
    plan = restore_plan(merged, [], next_step=4, max_off_policy_steps=1, group_size=4)
    assert plan.to_complete == [(8, TASK, 2)] and plan.requested_groups == 0 and plan.episodes_kept == 6
    recorded = []
    sink = TrainSink(4, 8, 1, record=lambda event, ids, **f: recorded.append((event.value, ids)))
    sink.restore(plan, {}, 4)
    assert list(sink.open_groups) == [8]
    assert [s.trace.episode_id for s in sink.queue] == ["5/0", "5/1", "5/2", "5/3"]
    assert recorded == [("queued", ["5/0", "5/1", "5/2", "5/3"])]
    # a record the snapshot already holds is skipped, never doubled
    again, added_again = with_journal(merged, records[:1])
    assert added_again == [] and sum(len(eps) for _, _, eps in again.open_groups) == 6
