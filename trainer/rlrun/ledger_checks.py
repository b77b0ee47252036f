"""Parts of :func:`rlrun.ledger.check_ledger` beyond single episodes: multi-turn episodes' kept turns, and tasks.

Each works on the parsed ledger (``{attempt: [event, …]}`` of the orchestrator, every event with its ``_line``) and
adds what it finds to a :class:`rlrun.ledger.LedgerReport` (``problems``, counts); ``pending`` says the run's last
attempt was killed, so what it still held is not a problem (the next attempt resumes it from the checkpoint and the
journal).

**Tasks** (ledger version 2, :data:`rlrun.ledger_events.LEDGER_VERSION`). A group's id is the index of its task,
and the task cursor hands indices out in order, so the tasks a run drew are ``0 … the highest group dispatched in
the final history``. Each must end in the final history as trained (an episode of its group trained), dropped with
a reason (its group rejected or abandoned, its episodes dropped stale) or left over when the run stopped (its
episodes, or the group itself with work out or requested: ``leftover``'s ``groups``; or its episodes in a batch
shipped that the trainer never trained: ``shipped_untrained``). A task with none of these was
skipped: the cursor passed it and nothing records why (issue 35: a journal replay once moved the cursor past a task
in flight). Ledgers written before version 2 have no ``groups`` in their ``leftover`` and no record of what a
stopping attempt still held, so their tasks are not checked (``tasks_checked`` False); their episodes are, as before.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from rlrun.envs.base import SOLVED_REWARD
from rlrun.ledger_events import LedgerEvent
from rlrun.samples import episode_id

#: A task's fates, by the events (or the trainer's training) that give them.
_TASK_DROPS = {
    LedgerEvent.REJECTED.value: "rejected",
    LedgerEvent.ABANDONED.value: "abandoned",
    LedgerEvent.DROPPED_STALE.value: "dropped_stale",
    LedgerEvent.TASK_DROPPED.value: "task_dropped",
}


def check_turns(orch: dict[int, list[dict]], finished: set[str], report: Any, pending: bool) -> None:
    """Multi-turn episodes' kept turns (``rlrun.orchestrator.conversations``): a resume continues a conversation at
    no fewer turns than were kept before it (else turns were lost), with a policy version within the staleness
    bound; and every conversation with a kept turn ends — its episode finished in the final history (and so was
    trained once, or dropped, by the episode checks) or the conversation was dropped (``turns_dropped``). With
    ``pending`` (the last attempt was killed) a conversation not ended yet is held by the journal, not lost."""
    kept: dict[str, int] = {}  # episode → most turns kept so far, over the attempts read so far
    ended: set[str] = set()
    for a in sorted(orch):
        for ev in orch[a]:
            if ev["e"] == LedgerEvent.TURN:
                kept[ev["id"]] = max(kept.get(ev["id"], 0), ev["k"])
                report.turns_kept += 1
            elif ev["e"] == LedgerEvent.TURNS_DROPPED:
                ended.update(ev["ids"])
            elif ev["e"] == LedgerEvent.CONTINUED:
                for eid, k, v in zip(ev["ids"], ev["turns"], ev["v"], strict=True):
                    report.conversations_continued += 1
                    if k < kept.get(eid, 0):
                        report.turns_lost += kept[eid] - k
                        report.problems.append(
                            f"episode {eid} was continued at turn {k} (attempt {a}) although turn {kept[eid]} was kept"
                        )
                    if v < ev["floor"]:
                        report.problems.append(
                            f"episode {eid} was continued with policy version {v}, below the staleness floor "
                            f"{ev['floor']} of its step (attempt {a})"
                        )
    for eid in sorted(set(kept) - finished - ended):
        if not pending:
            report.problems.append(f"episode {eid} kept {kept[eid]} turns but neither finished nor was dropped")


def check_tasks(
    orch: dict[int, list[dict]], cutoff: dict[int, int], fates: dict[str, list[str]], report: Any, pending: bool
) -> None:
    """Every task the cursor passed ends trained, dropped with a reason, or left over (module docstring).

    Args:
        orch: the orchestrator's events by attempt.
        cutoff: per attempt, the first line that is rolled back (what a later attempt resumed from).
        fates: each episode's fates in the final history (``trained@<step>``, ``rejected``, ``dropped_stale``,
            ``abandoned``, ``leftover``, ``shipped_untrained``).
        report: the :class:`~rlrun.ledger.LedgerReport` to fill (``tasks*`` counts, ``problems``).
        pending: the last attempt was killed: a task with no fate yet is held by it (counted, not a problem).
    """
    group_of: dict[str, int] = {}  # every episode id any request asked for → its group (its task)
    drawn: set[int] = set()
    task_fates: dict[int, set[str]] = defaultdict(set)
    for a in sorted(orch):
        for ev in orch[a]:
            e, live = ev["e"], ev["_line"] < cutoff[a]
            if e == LedgerEvent.DISPATCHED:
                for m in range(ev["first_member"], ev["first_member"] + ev["members"]):
                    group_of[episode_id(ev["group"], m)] = ev["group"]
                if live:
                    drawn.add(ev["group"])
            elif live and e in (LedgerEvent.REJECTED, LedgerEvent.ABANDONED):
                task_fates[ev["group"]].add(_TASK_DROPS[e])
            elif live and e == LedgerEvent.TASK_DROPPED:  # its group id is its index (TrainSource.next_group)
                task_fates[ev["index"]].add(_TASK_DROPS[e])
            elif live and e == LedgerEvent.LEFTOVER:
                for g in ev.get("groups", []):
                    task_fates[g].add("leftover")
    for eid, f in fates.items():
        g = group_of.get(eid)
        if g is not None:
            task_fates[g].update(x.split("@")[0] for x in f)
    for g in range(max(drawn, default=-1) + 1):
        f = task_fates.get(g, set())
        report.tasks += 1
        if LedgerEvent.TRAINED.value in f:
            report.tasks_trained += 1
        elif f & set(_TASK_DROPS.values()):
            report.tasks_dropped += 1
        elif f:
            report.tasks_leftover += 1
        elif pending:
            report.tasks_pending += 1
        elif g not in drawn:
            report.problems.append(
                f"task {g} was passed by the task cursor but never dispatched in the final history, nor recorded "
                "as dropped"
            )
        else:
            report.problems.append(f"task {g} was dispatched but never trained, rejected, dropped or left over")


def count_tokens(
    orch: dict[int, list[dict]], cutoff: dict[int, int], finished: set[str], fates: dict, report: Any
) -> None:
    """What the run's tokens went to (issue 48): the completion tokens (``finished`` rows' ``n``: ledgers written
    before it have none, and count 0) of the finished episodes, of those trained, and of those rejected for zero
    reward spread (``rejected`` with reason ``zero_advantage``), split into groups every member solved (reward ≥
    :data:`~rlrun.envs.base.SOLVED_REWARD`) and the rest. An episode counts once, by its final fate."""
    tokens: dict[str, int] = {}
    rewards: dict[str, float] = {}
    for a in sorted(orch):
        for ev in orch[a]:
            if ev["e"] == LedgerEvent.FINISHED and ev["id"] not in tokens:
                tokens[ev["id"]], rewards[ev["id"]] = int(ev.get("n", 0)), float(ev["reward"])
    report.tokens_finished = sum(tokens.get(e, 0) for e in finished)
    report.tokens_trained = sum(
        tokens.get(e, 0) for e in finished if any(f.startswith(LedgerEvent.TRAINED.value) for f in fates.get(e, []))
    )
    for a in sorted(orch):
        for ev in orch[a][: cutoff[a]]:
            if ev["e"] != LedgerEvent.REJECTED or ev.get("reason") != "zero_advantage":
                continue
            ids = [e for e in ev["ids"] if e in finished]
            n = sum(tokens.get(e, 0) for e in ids)
            if ids and all(rewards.get(e, 0.0) >= SOLVED_REWARD for e in ids):
                report.tokens_zero_spread_solved += n
            else:
                report.tokens_zero_spread_unsolved += n
