"""The ledger: append-only records of every episode's fate, and the checker of invariant 1.

Each process of each attempt appends JSON lines to its own file,
``<run_dir>/ledger/attempt-<K>.<role>.jsonl`` (role ``orchestrator`` or ``trainer``), so
no two writers share a file. ``K`` is the run-directory attempt
(:func:`rlrun.rundir.run_dir_attempt`): a run re-created over the same directory gets new
numbers, so it never appends to the files of the run before it. The events are :class:`LedgerEvent` values: the
orchestrator writes what was dispatched, finished, queued, rejected, dropped stale, cancelled,
shipped, checkpointed, resumed and left over; the trainer what it trained.

Rollback: an attempt resumes from a snapshot of an earlier attempt; that attempt's
orchestrator events after the snapshot are rolled back (their episodes are regenerated),
and every attempt's ``trained`` records for steps after the restored step are superseded
by the later attempt's. A graceful preemption snapshots last, so it rolls back nothing;
an abrupt loss rolls back the work since the last periodic checkpoint, and the checker
reports how much. With the episode journal (:mod:`rlrun.orchestrator.journal`) a rolled-back
``finished`` event of a journaled episode (``j``) must come back as ``replayed`` in a later
attempt that counts: :func:`check_ledger` reports each one that does not as lost, and each
episode finished (or replayed) more than once in the final history as doubled.

Stops (version 2, :mod:`rlrun.ledger_events`): every attempt starts with ``started`` and, unless killed, ends
with ``leftover`` (what it still held: episodes and tasks) and ``stopped``, so the check passes after any stop
and verifies tasks too (:mod:`rlrun.ledger_checks`); a killed last attempt's work is pending, not lost.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlrun.ledger_checks import check_tasks, check_turns, count_tokens
from rlrun.ledger_events import LEDGER_VERSION, LedgerEvent

__all__ = [
    "LEDGER_VERSION",
    "Ledger",
    "LedgerEvent",
    "LedgerReport",
    "check_ledger",
    "has_stopped",
    "ledger_attempts",
    "ledger_file",
    "read_ledger",
]


_FILE_RE = re.compile(r"^attempt-(\d+)\.(orchestrator|trainer)\.jsonl$")


def ledger_file(root: Path, attempt: int, role: str) -> Path:
    """The ledger file of ``role`` (``"orchestrator"`` or ``"trainer"``) in ``attempt``, under the ledger folder
    ``root`` (``attempt-<attempt>.<role>.jsonl``, what :data:`_FILE_RE` reads back)."""
    return root / f"attempt-{attempt}.{role}.jsonl"


class Ledger:
    """Appends events for one role of one attempt (line-buffered; each line is flushed).

    Args:
        root: ``<run_dir>/ledger``.
        attempt: the attempt number.
        role: ``"orchestrator"`` or ``"trainer"``.
    """

    def __init__(self, root: Path, attempt: int, role: str) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.attempt = attempt
        self.role = role
        self.path = ledger_file(root, attempt, role)
        self.lines = 0
        if self.path.exists():
            with open(self.path, "rb") as fh:
                self.lines = sum(1 for _ in fh)
        self._fh = open(self.path, "a", buffering=1)  # noqa: SIM115 - open for the process lifetime

    def write(self, event: LedgerEvent, **fields: Any) -> int:
        """Append one event; returns its line number (0-based) in this file."""
        return self.write_each(event, [fields])

    def write_each(self, event: LedgerEvent, rows: list[dict[str, Any]]) -> int:
        """Append one ``event`` line per ``rows`` item, handed to the OS in one ``write`` (not one per
        line: each system call lets another thread take the GIL from the orchestrator's event loop);
        returns the last line's number, 0-based (with no rows: the previous line's, −1 in an empty file)."""
        t = round(time.time(), 3)
        self._fh.write("".join(json.dumps({"e": event.value, "t": t, **row}) + "\n" for row in rows))
        self.lines += len(rows)
        return self.lines - 1

    def record(self, event: LedgerEvent, ids: list[str], **fields: Any) -> int:
        """Append an event about episodes ``ids`` (the sink's ``record`` callback)."""
        return self.write(event, ids=ids, **fields)

    def flush(self) -> None:
        """Hand buffered lines to the OS (cheap; not durable against a machine crash)."""
        self._fh.flush()

    def sync(self) -> None:
        """Flush and fsync the file (before a snapshot that refers to a line of it is written)."""
        self._fh.flush()
        os.fsync(self._fh.fileno())

    def close(self) -> None:
        self._fh.close()


def ledger_attempts(root: Path, role: str) -> list[int]:
    """The attempts that wrote a ``role`` ledger under ``root``, ascending."""
    if not root.is_dir():
        return []
    found = (_FILE_RE.match(p.name) for p in root.iterdir())
    return sorted(int(m.group(1)) for m in found if m and m.group(2) == role)


def has_stopped(root: Path, attempt: int, role: str) -> bool | None:
    """Whether the ``role`` process of ``attempt`` has stopped: the last line of its ledger is a ``stopped`` event.

    None when it has no ledger (it never started); False while its last line is another event (it runs, or was
    killed). Reads the file's last 4 KiB only: a long run's ledger is long, and a ``stopped`` line is short.
    """
    path = ledger_file(root, attempt, role)
    try:
        with open(path, "rb") as fh:
            fh.seek(max(0, fh.seek(0, os.SEEK_END) - 4096))
            tail = fh.read().rstrip(b"\n").rsplit(b"\n", 1)[-1]
    except FileNotFoundError:
        return None
    try:
        return json.loads(tail).get("e") == LedgerEvent.STOPPED.value
    except ValueError:  # a torn or cut line: not a stop
        return False


def read_ledger(root: Path) -> dict[tuple[int, str], list[dict]]:
    """``{(attempt, role): [event, …]}``; a torn last line (crash mid-write) is ignored."""
    out: dict[tuple[int, str], list[dict]] = {}
    if not root.is_dir():
        return out
    for p in root.iterdir():
        m = _FILE_RE.match(p.name)
        if not m:
            continue
        events = []
        for i, line in enumerate(p.read_text().splitlines()):
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            ev["_line"] = i
            events.append(ev)
        out[(int(m.group(1)), m.group(2))] = events
    return out


@dataclass
class LedgerReport:
    """Result of :func:`check_ledger`; ``ok`` when ``problems`` is empty."""

    attempts: list[int]
    finished: int = 0
    trained: int = 0
    rejected: int = 0
    dropped_stale: int = 0
    abandoned: int = 0
    leftover: int = 0
    #: finished episodes in a batch shipped but never trained because the run stopped first (an error or a pause
    #: with the trainer behind, as it runs up to max_off_policy_steps behind): left over in ``rollouts/step_N``
    shipped_untrained: int = 0
    rolled_back: int = 0
    journaled: int = 0
    replayed: int = 0
    journal_lost: int = 0
    doubled: int = 0
    turns_kept: int = 0
    conversations_continued: int = 0
    turns_lost: int = 0
    steps: int = 0
    #: the last attempt was killed (it started and never stopped): what it held is pending, not lost
    interrupted: bool = False
    pending: int = 0  # finished episodes the interrupted run still holds (its checkpoint and journal)
    #: tasks are checked for ledgers of version 2 (``rlrun.ledger_checks``); older ones check episodes only
    tasks_checked: bool = False
    tasks: int = 0
    tasks_trained: int = 0
    tasks_dropped: int = 0  # rejected, abandoned or dropped stale (the ledger says why), none trained
    tasks_leftover: int = 0
    tasks_pending: int = 0
    #: completion tokens of the finished episodes, of those trained, and of those rejected for zero reward spread in
    #: groups every member solved / not every member solved (:func:`~rlrun.ledger_checks.count_tokens`)
    tokens_finished: int = 0
    tokens_trained: int = 0
    tokens_zero_spread_solved: int = 0
    tokens_zero_spread_unsolved: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "ok": self.ok}


#: Final fates an orchestrator event gives its episodes (training is the trainer's).
_FATES = tuple(
    e.value for e in (LedgerEvent.REJECTED, LedgerEvent.DROPPED_STALE, LedgerEvent.ABANDONED, LedgerEvent.LEFTOVER)
)


#: The fate of a finished episode whose batch was shipped and never trained because the run stopped first.
_SHIPPED_UNTRAINED = "shipped_untrained"


def _shipped_untrained(
    orch: dict[int, list[dict]],
    cutoff: dict[int, int],
    holders: list[int],
    by_step: dict[int, tuple[int, list[str]]],
    finished: set[str],
    fates: dict[str, list[str]],
    report: LedgerReport,
) -> None:
    """Give the episodes of batches shipped (live ``shipped``) and never trained in the final history their fate.

    The trainer runs behind the orchestrator (up to ``max_off_policy_steps`` batches), so an attempt that stops
    (an error, a pause not resumed) has usually shipped batches the trainer never trained: their episodes are in
    ``rollouts/step_N``, past anything the orchestrator still held, and a ``--resume`` rolls them back to its
    checkpoint and replays them. They are left over (``shipped_untrained``) once the last attempt holding work
    stopped other than ``complete``; killed (``interrupted``) they are pending like the rest of what it held; after a
    ``complete`` stop every shipped batch must have trained, so they stay problems.
    """
    if report.interrupted or not holders:
        return
    outcomes = [ev.get("outcome") for ev in orch[holders[-1]] if ev["e"] == LedgerEvent.STOPPED]
    if not outcomes or outcomes[-1] == "complete":
        return
    for a in sorted(orch):
        for ev in orch[a]:
            if ev["e"] == LedgerEvent.SHIPPED and ev["_line"] < cutoff[a] and ev["step"] not in by_step:
                for eid in ev["ids"]:
                    if eid in finished and not fates.get(eid):
                        fates[eid].append(_SHIPPED_UNTRAINED)


def check_ledger(root: Path) -> LedgerReport:
    """Prove invariant 1 on a finished run from its ledger.

    Every episode finished (and not rolled back) must end exactly once as trained (in the
    final history), rejected, dropped stale, abandoned with its group, or left over at the
    end of the run; no episode may be trained twice; every step 1..last must be trained
    exactly once in the final history; and no attempt may resume from a step older than a
    checkpoint an earlier attempt completed (trained steps lost, e.g. to a pruned or
    damaged checkpoint). Turn-level durability (:func:`~rlrun.ledger_checks.check_turns`): no kept turn lost,
    none continued past the staleness bound. Tasks (ledger version 2, :func:`~rlrun.ledger_checks.check_tasks`):
    every task the cursor passed is trained, dropped with a reason, or left over.

    A run whose last attempt was killed (a ``started`` line and no ``stopped``: SIGKILL, OOM, a lost node) is
    ``interrupted``: what that attempt still held — finished episodes not yet trained, tasks out, kept
    conversations — is ``pending`` (the next ``--resume`` puts it back from the checkpoint and the journal), not a
    problem. Every other way an attempt stops (done, paused, an error) writes ``leftover`` for what it held; the
    episodes of batches it shipped that the trainer never trained are left over too (``shipped_untrained``).
    """
    ledger = read_ledger(root)
    attempts = sorted({a for a, _ in ledger})
    report = LedgerReport(attempts)
    if not attempts:
        report.problems.append(f"{root}: no ledger files")
        return report
    orch = {a: ledger.get((a, "orchestrator"), []) for a in attempts}
    began = [a for a in attempts if orch[a]]
    versioned = bool(began) and all(
        any(ev["e"] == LedgerEvent.STARTED and ev.get("ledger_version", 1) >= 2 for ev in orch[a]) for a in began
    )
    # The work is held by the last attempt that did more than start and stop (one stopped while waiting for its
    # rollout servers took nothing over): killed, it holds it still.
    lifecycle = (LedgerEvent.STARTED.value, LedgerEvent.STOPPED.value)
    holders = [a for a in began if any(ev["e"] not in lifecycle for ev in orch[a])]
    report.interrupted = (
        versioned and bool(holders) and not any(ev["e"] == LedgerEvent.STOPPED for ev in orch[holders[-1]])
    )
    # How far each attempt's orchestrator events count: up to the snapshot a later attempt resumed from.
    cutoff: dict[int, int] = {a: len(orch[a]) for a in attempts}
    restored_step: dict[int, int] = {}
    for a in attempts:
        for ev in orch[a]:
            if ev["e"] == LedgerEvent.RESUMED and ev.get("from_attempt") is not None:
                src = ev["from_attempt"]
                line = ev.get("snapshot_line")
                if src in cutoff and line is not None:
                    cutoff[src] = min(cutoff[src], line + 1)
                restored_step[a] = min(restored_step.get(a, ev["step"]), ev["step"])
    # Resuming from an older step than a checkpoint already completed loses trained steps.
    completed: tuple[int, int] = (-1, -1)  # (newest step completed so far, the attempt that completed it)
    for a in attempts:
        if a in restored_step and restored_step[a] < completed[0]:
            step, by = completed
            report.problems.append(
                f"attempt {a} resumed from step {restored_step[a]} although attempt {by} had completed checkpoint "
                f"{step}: trained steps {restored_step[a] + 1}–{step} were lost"
            )
        for ev in orch[a]:
            if ev["e"] == LedgerEvent.CHECKPOINT and ev["step"] > completed[0]:
                completed = (ev["step"], a)
    # final fate of every episode
    fates: dict[str, list[str]] = defaultdict(list)
    finished: set[str] = set()
    finishes: Counter = Counter()  # live finished + replayed, per episode: more than 1 is a double
    journaled: dict[str, tuple[int, int]] = {}  # acknowledged by the journal → (attempt, record)
    rolled_back_journaled: set[str] = set()
    for a in attempts:
        for ev in orch[a]:
            live = ev["_line"] < cutoff[a]
            if ev["e"] == LedgerEvent.FINISHED:
                if ev.get("j") is not None:
                    journaled.setdefault(ev["id"], (a, ev["j"]))
                if live:
                    finished.add(ev["id"])
                    finishes[ev["id"]] += 1
                else:
                    report.rolled_back += 1
                    if ev.get("j") is not None:
                        rolled_back_journaled.add(ev["id"])
            elif live and ev["e"] == LedgerEvent.REPLAYED:
                finished.update(ev["ids"])
                finishes.update(ev["ids"])
                report.replayed += len(ev["ids"])
            elif live and ev["e"] in _FATES:
                for eid in ev["ids"]:
                    fates[eid].append(ev["e"])
    report.journaled = len(journaled)
    # Invariant 1 with the journal: an acknowledged episode is never lost to a rollback, nor counted twice.
    for eid in sorted(rolled_back_journaled - finished):
        a, j = journaled[eid]
        report.journal_lost += 1
        report.problems.append(
            f"episode {eid} was acknowledged by the journal (attempt {a}, record {j}) but lost: "
            "its finish was rolled back and no later attempt replayed it"
        )
    for eid, n in sorted(finishes.items()):
        if n > 1:
            report.doubled += 1
            report.problems.append(f"episode {eid} was finished or replayed {n} times in the final history")
    # final training history: for each step, the last attempt that trained it (later attempts restart
    # from a checkpoint and supersede the steps after it)
    by_step: dict[int, tuple[int, list[str]]] = {}
    for a in attempts:
        for ev in ledger.get((a, "trainer"), []):
            if ev["e"] == LedgerEvent.TRAINED:
                prev = by_step.get(ev["step"])
                if prev is None or a >= prev[0]:
                    by_step[ev["step"]] = (a, ev["ids"])
    for step, (_, ids) in by_step.items():
        for eid in ids:
            fates[eid].append(f"{LedgerEvent.TRAINED.value}@{step}")
    report.steps = len(by_step)
    missing_steps = [s for s in range(1, max(by_step, default=0) + 1) if s not in by_step]
    if missing_steps:
        report.problems.append(f"steps never trained: {missing_steps[:10]}")
    _shipped_untrained(orch, cutoff, holders, by_step, finished, fates, report)
    counts = Counter()
    for eid in finished:
        f = fates.get(eid, [])
        if not f and report.interrupted:
            report.pending += 1
        elif not f:
            report.problems.append(f"episode {eid} finished but was never trained, rejected, dropped or left over")
        elif len(f) > 1:
            report.problems.append(f"episode {eid} has {len(f)} fates: {f}")
        else:
            counts[f[0].split("@")[0]] += 1
    for eid, f in fates.items():
        if eid not in finished and any(x.startswith(LedgerEvent.TRAINED.value) for x in f):
            report.problems.append(f"episode {eid} was trained but its finish was rolled back or never recorded")
    check_turns(orch, finished, report, report.interrupted)
    if versioned:
        report.tasks_checked = True
        check_tasks(orch, cutoff, fates, report, report.interrupted)
    report.finished = len(finished)
    report.trained = counts[LedgerEvent.TRAINED.value]
    report.rejected = counts[LedgerEvent.REJECTED.value]
    report.dropped_stale = counts[LedgerEvent.DROPPED_STALE.value]
    report.abandoned = counts[LedgerEvent.ABANDONED.value]
    report.leftover = counts[LedgerEvent.LEFTOVER.value]
    report.shipped_untrained = counts[_SHIPPED_UNTRAINED]
    count_tokens(orch, cutoff, finished, fates, report)
    report.problems = report.problems[:50]
    return report
