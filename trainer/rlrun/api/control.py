"""The operator ↔ orchestrator contract: what the control server's routes answer.

Both sides import these models: the orchestrator builds its answers with them
(:mod:`rlrun.orchestrator.control`), the operator's client parses the answers into
them (:mod:`rlrun.api.control_client`). Field names are the JSON keys.

| route | answer |
|---|---|
| ``GET /status`` | :class:`StatusReport` |
| ``POST /pause`` | :class:`PauseResult` |
| ``PUT /rollout-endpoints`` | :class:`EndpointsUpdate` (also the request body) |

and what each process leaves when it exits: an :class:`ExitReport`, as JSON in the file named by
``$RLRUN_TERMINATION_LOG`` (:data:`TERMINATION_LOG_ENV`; the operator's pods set it to
``/dev/termination-log``, the container's termination message), written by
:func:`write_exit_report`.

Counting words, used the same way in every model:

- a **queued trace** is a sample scored and queued for a batch, not yet shipped;
- an **open group** holds at least one finished episode and waits for its other members;
- a **requested group** has members dispatched (in flight, or to be requested again) and
  no finished episode kept: a resume requests the whole group again, same task and group id;
- **finished episodes kept** are the finished episodes held by open groups.

A pause answer's and a resume report's counts use these words for the same things, but at
different moments: the pause counts what the snapshot saved; the resume report counts what
survived the staleness sweep of the resumed step. Units: steps are shipped batches; times
are Unix seconds (``time``) or durations in seconds (``seconds``).

Unknown keys are ignored when parsing, so an operator keeps reading the answers of a newer
orchestrator that added fields; a missing or mistyped field is a validation error.
"""

from __future__ import annotations

import logging
import os
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, computed_field

log = logging.getLogger(__name__)

#: What the orchestrator is doing: ``starting`` (waiting for rollout servers, restoring),
#: ``running``, ``pausing`` (writing the pause snapshot), ``paused`` (stopped for good; the
#: process exits on SIGTERM or stop), ``done`` (``max_steps`` shipped and checkpointed), ``failed``.
OrchestratorPhase = Literal["starting", "running", "pausing", "paused", "done", "failed"]


class _Contract(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class SnapshotCounts(_Contract):
    """What a sink snapshot holds (see the module docstring for the words).

    Attributes:
        queued_traces: queued samples saved.
        open_groups: groups saved with at least one finished episode.
        requested_groups: groups saved with members dispatched and no finished episode.
        finished_episodes_kept: finished episodes saved in open groups.
        conversations_kept: multi-turn episodes saved at their last durable turn (continued there on resume).
        turns_kept: their model turns, together.
    """

    queued_traces: int = Field(ge=0)
    open_groups: int = Field(ge=0)
    requested_groups: int = Field(ge=0)
    finished_episodes_kept: int = Field(ge=0)
    conversations_kept: int = Field(default=0, ge=0)
    turns_kept: int = Field(default=0, ge=0)


class CheckpointWritten(SnapshotCounts):
    """The orchestrator part of a checkpoint, once written (``progress.pt``).

    Attributes:
        step: the checkpoint step (the trainer part it completes).
        reason: ``periodic`` (a new trainer part appeared) or ``pause``.
        path: the ``progress.pt`` written.
        seconds: time to pack and write it.
        time: when it was written (Unix seconds).
    """

    step: int = Field(ge=0)
    reason: Literal["periodic", "pause"]
    path: str
    seconds: float = Field(ge=0)
    time: float


class PauseResult(SnapshotCounts):
    """The answer of ``POST /pause``: the snapshot written, or why none was needed.

    Attributes:
        step: the checkpoint the snapshot completes (the newest trainer part); None when the
            orchestrator had nothing to save — paused before it had started, or after the run was
            complete: nothing was written and the newest complete checkpoint stays what a next
            attempt resumes from.
        path: the ``progress.pt`` written (None with ``step``).
        seconds: time to pack and write it.
        time: when the pause finished (Unix seconds).
        note: a sentence when nothing was written.
        run_complete: the run had already shipped and checkpointed its last step: there is
            nothing to resume.
    """

    step: int | None = Field(ge=0)
    path: str | None
    seconds: float = Field(default=0.0, ge=0)
    time: float
    note: str = ""
    run_complete: bool = False

    def describe(self) -> str:
        """What the pause saved, one sentence (the operator's ``Paused`` Event, ``rlrun local``'s preemption
        line): ``snapshot at step S: Q queued traces, G open groups, R requested groups, E finished episodes
        kept`` (and the multi-turn episodes kept at a durable turn, when any), or the note when nothing was written."""
        if self.step is None:  # paused before it started, or after it was done
            return f"{self.note or 'nothing to save'}; it resumes from its newest checkpoint"
        line = (
            f"snapshot at step {self.step}: {self.queued_traces} queued traces, {self.open_groups} open groups, "
            f"{self.requested_groups} requested groups, {self.finished_episodes_kept} finished episodes kept"
        )
        if self.conversations_kept:  # the journal may hold newer turns yet: the resume says what it continued
            line += f", {self.conversations_kept} multi-turn episodes at a durable turn ({self.turns_kept} turns)"
        return line

    @classmethod
    def of_checkpoint(cls, written: CheckpointWritten) -> PauseResult:
        """The pause answer for the checkpoint the pause wrote."""
        return cls(**written.model_dump(include=set(PauseResult.model_fields)))

    @classmethod
    def nothing_to_save(
        cls, now: float, note: str = "paused before starting: nothing to save", run_complete: bool = False
    ) -> PauseResult:
        """The pause answer of an orchestrator with no work to save (not started yet, or done)."""
        return cls(
            step=None,
            path=None,
            time=now,
            queued_traces=0,
            open_groups=0,
            requested_groups=0,
            finished_episodes_kept=0,
            note=note,
            run_complete=run_complete,
        )


class ResumeReport(_Contract):
    """What an attempt's orchestrator restored from the newest complete checkpoint.

    Attributes:
        from_step: the checkpoint step resumed from.
        from_attempt: the attempt that wrote its orchestrator part (None: unnumbered).
        shipped: batches shipped when its snapshot was taken; the trainer trains
            ``from_step + 1 … shipped`` from the batch files kept on disk.
        queued_traces: queued samples put back (after the staleness sweep of step ``shipped + 1``).
        open_groups: groups put back with at least one fresh finished episode.
        requested_groups: groups with no fresh finished episode, requested again whole.
        finished_episodes_kept: finished episodes put back into open groups.
        dropped_stale: queued samples and finished episodes too old for the resumed step (counted).
        members_requested: members requested again, same tasks and group ids, before any new task.
        progress_only_would_lose: finished episodes that a checkpoint without the sink snapshot
            would have lost (the queue and open groups as saved).
        removed_batches: batch steps a dead attempt shipped after the snapshot, deleted.
        conversations_continued: multi-turn episodes continued at their last durable turn instead of from their
            first; turns_kept: their model turns, together (not sampled again).
        time: when the resume finished (Unix seconds).
    """

    from_step: int = Field(ge=0)
    from_attempt: int | None = Field(default=None, ge=0)
    shipped: int = Field(ge=0)
    queued_traces: int = Field(ge=0)
    open_groups: int = Field(ge=0)
    requested_groups: int = Field(ge=0)
    finished_episodes_kept: int = Field(ge=0)
    dropped_stale: int = Field(ge=0)
    members_requested: int = Field(ge=0)
    progress_only_would_lose: int = Field(ge=0)
    removed_batches: list[int] = Field(default_factory=list)
    conversations_continued: int = Field(default=0, ge=0)
    turns_kept: int = Field(default=0, ge=0)
    time: float

    @computed_field  # in the JSON too, so a reader of /status need not add it up
    @property
    def resumed_groups(self) -> int:
        """Groups resumed with their task and group id: open plus requested."""
        return self.open_groups + self.requested_groups


class StatusReport(_Contract):
    """The answer of ``GET /status``.

    Attributes:
        phase: see :data:`OrchestratorPhase`.
        attempt: this orchestrator's attempt as the operator or launcher numbered it (``--attempt``,
            echoed unchanged; 0: unnumbered).
        run_dir_attempt: the attempt as the run directory numbers it (``--attempt`` plus the offset of
            ``--run-uid``, see :func:`rlrun.rundir.run_dir_attempt`): what files and the ledger are
            stamped with. Equal to ``attempt`` without a run uid; None from an older orchestrator.
        step: batches shipped to the trainer.
        policy_version: the weights version the rollout servers hold (trainer steps).
        max_steps: the step the run ends at.
        last_checkpoint_step: the newest checkpoint this orchestrator completed or resumed from.
        queued_traces: queued samples now.
        open_groups: open groups now.
        finished_episodes_kept: finished episodes in open groups now.
        inflight_samples: completions requested from rollout servers and not yet returned.
        resume_requests: groups waiting to be requested again (served before new tasks).
        last_checkpoint: the newest orchestrator part written by this attempt.
        last_pause: the pause answer, once paused.
        resume: what this attempt restored (None: it started from step 0).
        rollout_endpoints: the rollout servers in use, sorted.
    """

    phase: OrchestratorPhase
    attempt: int = Field(ge=0)
    run_dir_attempt: int | None = Field(default=None, ge=0)
    step: int = Field(ge=0)
    policy_version: int = Field(ge=0)
    max_steps: int = Field(ge=1)
    last_checkpoint_step: int | None = Field(default=None, ge=0)
    queued_traces: int = Field(default=0, ge=0)
    open_groups: int = Field(default=0, ge=0)
    finished_episodes_kept: int = Field(default=0, ge=0)
    inflight_samples: int = Field(default=0, ge=0)
    resume_requests: int = Field(default=0, ge=0)
    last_checkpoint: CheckpointWritten | None = None
    last_pause: PauseResult | None = None
    resume: ResumeReport | None = None
    rollout_endpoints: list[str] = Field(default_factory=list)


class EndpointsUpdate(_Contract):
    """The body (and answer) of ``PUT /rollout-endpoints``.

    Attributes:
        endpoints: base URLs of every rollout server to use (``http://host:port``); the
            list replaces the previous one.
    """

    endpoints: list[Annotated[str, Field(min_length=1)]]


#: The environment variable naming the file an exiting process writes its :class:`ExitReport` to.
TERMINATION_LOG_ENV = "RLRUN_TERMINATION_LOG"

#: Most characters of :attr:`ExitReport.message` (Kubernetes keeps 4096 bytes of a termination
#: message; the rest of the JSON and multi-byte characters need the margin).
EXIT_MESSAGE_MAX_CHARS = 3000

#: Exit status of a permanent error (``sysexits.h`` ``EX_CONFIG``): retrying cannot heal it.
EXIT_PERMANENT = 78

#: How a process ended (see :class:`ExitReport`).
ExitOutcome = Literal["complete", "paused", "interrupted", "error"]


class ExitReport(_Contract):
    """What an ``rlrun orchestrator`` or ``rlrun trainer`` process says when it exits.

    Written as JSON to ``$RLRUN_TERMINATION_LOG`` (:func:`write_exit_report`); the operator reads
    it back from the container's termination message.

    Attributes:
        role: the process: ``orchestrator``, ``trainer`` or ``rollout``.
        outcome: ``complete`` — every step done (``step == max_steps``), exit 0; ``paused`` —
            stopped by a pause or SIGTERM after writing its snapshot (or with nothing to save),
            exit 0; ``interrupted`` — stopped before its work was done without a snapshot (a
            trainer's SIGTERM, exit 143; a pause snapshot that failed, exit 1); ``error`` — it
            raised (exit 1, or :data:`EXIT_PERMANENT` when ``permanent``).
        step: steps shipped (orchestrator) or trained (trainer) when it exited; None when it
            had not started counting.
        max_steps: the step the run ends at; None when unknown (e.g. an invalid manifest).
        permanent: an error retrying cannot heal (a config that does not match the checkpoint,
            weights that do not fit the model, an invalid manifest): the exit status is then
            :data:`EXIT_PERMANENT` (78).
        reason: CamelCase cause of an error: ``CheckpointMismatch``, ``WeightsMismatch``,
            ``InvalidManifest``, ``UnsupportedVersion``, else ``Error``; None when it did not fail.
        message: what happened, in words (:func:`write_exit_report` cuts it to at most
            :data:`EXIT_MESSAGE_MAX_CHARS` characters, in the middle).
    """

    role: Literal["orchestrator", "trainer", "rollout"]
    outcome: ExitOutcome
    step: int | None = Field(default=None, ge=0)
    max_steps: int | None = Field(default=None, ge=1)
    permanent: bool = False
    reason: str | None = None
    message: str = ""


def clip_message(text: str, limit: int = EXIT_MESSAGE_MAX_CHARS) -> str:
    """``text`` cut to at most ``limit`` characters, keeping its start and end (the end of a
    traceback-like message says most)."""
    if len(text) <= limit:
        return text
    marker = " … "
    head = (limit - len(marker)) // 2
    return text[:head] + marker + text[len(text) - (limit - len(marker) - head) :]


def write_exit_report(report: ExitReport, path: str | os.PathLike | None = None) -> bool:
    """Write ``report`` as JSON to ``path`` (default: ``$RLRUN_TERMINATION_LOG``); never raises.

    Does nothing when neither is set (``rlrun local``). The file is replaced, not appended to
    (a termination message is one report), with the message cut by :func:`clip_message`.
    Returns whether it was written; a failed write is logged as a warning.
    """
    target = path if path is not None else os.environ.get(TERMINATION_LOG_ENV)
    if not target:
        return False
    try:
        text = report.model_copy(update={"message": clip_message(report.message)}).model_dump_json()
        with open(target, "w") as fh:
            fh.write(text)
    except Exception as exc:  # an exiting process must not fail on its last words
        log.warning("could not write the exit report to %s: %s", target, exc)
        return False
    return True


__all__ = [
    "EXIT_MESSAGE_MAX_CHARS",
    "EXIT_PERMANENT",
    "TERMINATION_LOG_ENV",
    "CheckpointWritten",
    "EndpointsUpdate",
    "ExitOutcome",
    "ExitReport",
    "OrchestratorPhase",
    "PauseResult",
    "ResumeReport",
    "SnapshotCounts",
    "StatusReport",
    "clip_message",
    "write_exit_report",
]
