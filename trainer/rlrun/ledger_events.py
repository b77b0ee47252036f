"""The ledger's events: what each line of ``<run_dir>/ledger/attempt-<K>.<role>.jsonl`` can say.

Written by :class:`rlrun.ledger.Ledger`; read by :func:`rlrun.ledger.check_ledger`. Version 2 (the
orchestrator's ``started`` line says so) adds the records that let the check verify tasks as well as episodes:
every orchestrator attempt starts with ``started`` and, unless killed, ends with ``stopped`` after a
``leftover`` of what it still held (episodes and tasks), and ``dropped_stale`` says which floor each episode
was below.
"""

from __future__ import annotations

from enum import Enum

#: The ledger version this code writes (the orchestrator's ``started`` line carries it).
LEDGER_VERSION = 2


class LedgerEvent(str, Enum):
    """The ``"e"`` of a ledger line, and the fields each event carries."""

    #: group, task, env, first_member, members, v (policy version at dispatch)
    DISPATCHED = "dispatched"
    #: id (episode), reward, v, and j (its record's number in the attempt's episode journal) when it was
    #: journaled: written only once the record is durable, so ``j`` marks an *acknowledged* episode
    FINISHED = "finished"
    #: ids, group — scored and queued for a batch
    QUEUED = "queued"
    #: ids, group, reason (``zero_advantage`` or ``too_few_fresh_members``)
    REJECTED = "rejected"
    #: ids, and step (queue sweep), group (left out of scoring) or at (``cancel``, ``resume``); since ledger
    #: version 2 also floor (the ``min_fresh_version`` they were below) and v (each one's policy version): why
    DROPPED_STALE = "dropped_stale"
    #: group, first_member, members, reason (``stale``: could no longer train; ``failed``: no server
    #: answered it, or the answer held a completion that cannot be trained (``abort``, no tokens…), with
    #: the error; ``lost``: its rollout endpoint was removed, with the endpoint in
    #: ``error``) — a request that ended without members
    CANCELLED = "cancelled"
    #: ids, group, env, task (its index), error — members sampled whose reward failed (raised, timed out, not a
    #: number): they never finished and are requested again (``rlrun.rewards.scoring``)
    REWARD_FAILED = "reward_failed"
    #: ids (its finished episodes, possibly none), group, reason — a group given up (counted)
    ABANDONED = "abandoned"
    #: step, ids — a batch published for the trainer
    SHIPPED = "shipped"
    #: step, reason, ledger_line — the orchestrator part of checkpoint ``step`` is written and durable
    #: (checkpoint ``step`` is complete); its sink snapshot refers to this file up to ``ledger_line``
    CHECKPOINT = "checkpoint"
    #: from_attempt, snapshot_line, step, report (the resume report, ``rlrun.api.control.ResumeReport``)
    #: — events of ``from_attempt`` after ``snapshot_line`` are rolled back (line −1: the whole attempt,
    #: a start-over from step 0, which has no report)
    RESUMED = "resumed"
    #: ids, attempts, records — journaled episodes of earlier attempts put back by a resume (after the
    #: snapshot's cut): they count as finished in this attempt, which decides their fate
    REPLAYED = "replayed"
    #: group, members, first_member — members of a restored group requested again
    REDISPATCH_REQUESTED = "redispatch_requested"
    #: id, k (model turns played), j (its turn record in the attempt's journal), v — a multi-turn episode's turn
    #: kept: written once the record is durable (``rlrun.orchestrator.conversations``)
    TURN = "turn"
    #: ids, reason — kept conversations ended without an episode (their request cancelled, group abandoned, run
    #: done; at a resume: stale, surplus, group_scored)
    TURNS_DROPPED = "turns_dropped"
    #: ids, turns, v, floor — kept conversations a resume continues at their last durable turn (each ``v`` ≥ the
    #: staleness floor ``floor`` of the resumed step)
    CONTINUED = "continued"
    #: env, index, reason — a task the cursor passed without rolling it out (``prompt_too_long``: its prompt does not
    #: fit the context less ``sampling.max_tokens``, ``spec.rollout.overlong_prompts: filter``)
    TASK_DROPPED = "task_dropped"
    #: ids — still queued or in open groups when the attempt stopped; since ledger version 2 also groups (the
    #: tasks with work out or requested and nothing finished) and reason (the stop's outcome)
    LEFTOVER = "leftover"
    #: role, ledger_version — an attempt's process started (the orchestrator's first line; version
    #: :data:`LEDGER_VERSION` writes the task records ``rlrun ledger check`` verifies)
    STARTED = "started"
    #: outcome (``complete``, ``paused``, ``error``, ``interrupted``), step; the orchestrator's with error (what
    #: stopped it); the trainer's after a notice with saved (the step of the part it wrote, null: it existed)
    #: — the process stopped (one killed wrote none)
    STOPPED = "stopped"
    #: step, ids — the trainer trained batch ``step`` (trainer ledger)
    TRAINED = "trained"
