"""The simulated preemption of ``rlrun local --preempt-at-step K``: when it can happen, and what a
resumed attempt reports.

A resumed orchestrator reports what it restored in ``GET /status``; one that finishes at once
exits before it is asked, and its report is read from the ``resumed`` event of its ledger.
"""

from __future__ import annotations

import json
from pathlib import Path

from rlrun.api.control import ResumeReport
from rlrun.ledger import LedgerEvent, read_ledger


def preemption_skip_reason(preempt_at_step: int, last_step: int, resumed_from: int | None) -> str | None:
    """Why a preemption at trainer step ``preempt_at_step`` cannot happen in a run that trains up to
    ``last_step`` starting after checkpoint ``resumed_from`` (None: from step 0); None when it can.

    After the last step there is nothing left to preempt; a step at or before the checkpoint a
    resume starts from is never trained again.
    """
    if preempt_at_step >= last_step:
        return (
            f"--preempt-at-step {preempt_at_step} is not before the run's last step {last_step}: "
            "nothing would be left to preempt"
        )
    if resumed_from is not None and preempt_at_step <= resumed_from:
        return (
            f"--preempt-at-step {preempt_at_step} is not after step {resumed_from}, "
            "the checkpoint this run resumes from: that step is not trained again"
        )
    return None


def steps_recomputed(ledger_root: Path) -> int:
    """Trainer steps trained more than once over every attempt (``trained`` events of the trainer
    ledgers, a torn line ignored): ``Σ_step (times trained − 1)``. A preemption noticed by the trainer
    recomputes none; an abrupt one recomputes the steps after the checkpoint resumed from."""
    counts: dict[int, int] = {}
    for (_, role), events in read_ledger(ledger_root).items():
        for ev in events:
            if role == "trainer" and ev.get("e") == LedgerEvent.TRAINED.value:
                counts[ev["step"]] = counts.get(ev["step"], 0) + 1
    return sum(n - 1 for n in counts.values())


def resume_report_from_ledger(ledger_root: Path, attempt: int) -> ResumeReport | None:
    """The resume report attempt ``attempt``'s orchestrator wrote into its ledger (the ``report`` of
    its ``resumed`` event), or None: it started from step 0 or wrote none (a torn last line is ignored).

    Raises:
        pydantic.ValidationError: a ``report`` that is not a :class:`ResumeReport`.
    """
    path = ledger_root / f"attempt-{attempt}.orchestrator.jsonl"
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return None
    for line in lines:
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if ev.get("e") == LedgerEvent.RESUMED.value and ev.get("report") is not None:
            return ResumeReport.model_validate(ev["report"])
    return None


def resume_line(report: ResumeReport) -> str:
    """What the launcher prints about a resume report."""
    return (
        f"Resuming with {report.queued_traces} queued traces, {report.open_groups} open groups "
        f"({report.finished_episodes_kept} finished episodes kept) and {report.requested_groups} requested groups; "
        f"a progress-only checkpoint would have lost {report.progress_only_would_lose} finished episodes"
    )
