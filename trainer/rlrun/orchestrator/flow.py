"""Flow control: how much rollout work may be out at once, so that none is generated stale.

A rollout dispatched at policy version ``v`` can train at most in batch
``v + 1 + max_off_policy_steps`` (:func:`~rlrun.orchestrator.staleness.last_useful_step`),
and no batch past ``max_steps`` is ever cut. So at version ``v`` with ``shipped`` batches
out (a batch cut from the queue and still being written counts: its samples are committed
nowhere else, and a weight update landing during the write would otherwise buy a batch that
can never train), rollouts can still fill ``min(v + 1 + max_off_policy_steps, max_steps) − shipped``
batches. New groups are dispatched only while the samples committed — queued, waiting in
open groups, and dispatched but not yet consumed — stay below that many batches' worth,
and while the completions in flight stay within ``rollout.max_inflight``. The rest of a
group already counted (a resume request) needs only a batch left to fill and room in flight
(:meth:`FlowControl.may_complete`). After a resume from a trainer checkpoint older than the policy its
snapshot was taken at, nothing is dispatched until the servers hold that policy again (:func:`dispatch_round`'s
``hold_below``).

Guarantee: the orchestrator never dispatches work that is stale on arrival, and
``max_off_policy_steps = 0`` is synchronous on-policy RL (each batch is generated
entirely by the policy that trains on it).
"""

from __future__ import annotations

from dataclasses import dataclass

from rlrun.api.spec import RLRunSpec
from rlrun.ledger import Ledger, LedgerEvent
from rlrun.orchestrator.dispatcher import Dispatcher
from rlrun.orchestrator.sink import TrainSink
from rlrun.orchestrator.source import TrainSource
from rlrun.orchestrator.staleness import last_useful_step


@dataclass(frozen=True)
class FlowControl:
    """The dispatch budget of a run (see the module docstring).

    Attributes:
        batch_size: samples per batch.
        group_size: members per group (what one new group adds).
        max_off_policy_steps: the staleness bound, steps.
        max_inflight: most completions in flight across all rollout servers.
        max_steps: the last batch the run ships.
    """

    batch_size: int
    group_size: int
    max_off_policy_steps: int
    max_inflight: int
    max_steps: int

    @classmethod
    def from_spec(cls, spec: RLRunSpec, max_steps: int) -> FlowControl:
        """The flow control of ``spec`` for a run ending at ``max_steps``."""
        return cls(spec.batch_size, spec.group_size, spec.max_off_policy_steps, spec.rollout.max_inflight, max_steps)

    def budget(self, policy_version: int, shipped: int) -> int:
        """Samples that may be committed at ``policy_version`` with ``shipped`` batches out (may be ≤ 0)."""
        last = min(last_useful_step(policy_version, self.max_off_policy_steps), self.max_steps)
        return self.batch_size * (last - shipped)

    @staticmethod
    def committed(sink: TrainSink, dispatcher: Dispatcher | None) -> int:
        """Samples committed to the next batches: queued, finished and kept in open groups, and dispatched but not
        yet consumed (in flight, or delivered and not taken: :attr:`Dispatcher.outstanding_samples`; none before
        there is a dispatcher). What :meth:`may_dispatch` weighs against :meth:`budget`."""
        outstanding = dispatcher.outstanding_samples if dispatcher is not None else 0
        return len(sink.queue) + sink.finished_episodes_kept + outstanding

    def may_dispatch(self, committed: int, inflight: int, policy_version: int, shipped: int) -> bool:
        """Whether one more group may be dispatched.

        Args:
            committed: samples queued, in open groups, or dispatched and not yet consumed (:meth:`committed`).
            inflight: completions requested from rollout servers and not yet returned.
            policy_version: the policy version the rollout servers hold.
            shipped: batches shipped or cut (being written).
        """
        return committed < self.budget(policy_version, shipped) and inflight + self.group_size <= self.max_inflight

    def may_complete(self, members: int, inflight: int, policy_version: int, shipped: int) -> bool:
        """Whether a request for ``members`` more members of a group already counted may be dispatched (a
        resume request: the rest of an open group, or a failed request's members asked again).

        The group's finished members are already in ``committed``, and the group trains only whole, so
        judging this request against the committed budget could wedge the run: at the last step a queue one
        group short of the batch plus that group's kept members fill the budget, and the request that
        would complete the group was never sent (seen in ``test_preempt_at_step_only_trainer…``). Only the
        staleness bound (a batch left to fill: budget > 0) and the in-flight limit apply.
        """
        return self.budget(policy_version, shipped) > 0 and inflight + members <= self.max_inflight


def hold_reason(hold_below: int, restored_step: int) -> str:
    """Why a resume dispatches nothing yet (:func:`dispatch_round`'s ``hold_below``), in words: its snapshot was taken
    at policy ``hold_below`` and the servers start on ``restored_step``, the trainer checkpoint's."""
    return (
        f"the snapshot was taken at policy {hold_below} and the servers start on {restored_step} (the trainer's "
        f"checkpoint): nothing is dispatched until the trainer has retrained steps {restored_step + 1}–{hold_below} "
        "from the kept batches, so the saved groups are asked of weights as new as before"
    )


def dispatch_round(
    flow: FlowControl,
    source: TrainSource,
    sink: TrainSink,
    dispatcher: Dispatcher,
    ledger: Ledger,
    policy_version: int,
    cut: int,
    hold_below: int = 0,
) -> int:
    """Dispatch groups — the source's resume requests first — while ``flow`` allows; returns how many.

    Nothing while the rollout servers hold a policy older than ``hold_below``: a resume from a trainer checkpoint
    older than the policy its snapshot was taken at waits until the trainer has retrained up to it (from the kept
    batch files), so the saved groups' members are asked of weights at least as new as they were before (a request
    labelled with the restored, older policy would be stale almost at once, and its group abandoned). Each request
    dispatched gets a ``dispatched`` ledger line (one write for the round), also when a task cannot be made.

    Args:
        policy_version: the policy the rollout servers hold (what a request is labelled with).
        cut: batches shipped or being written (:meth:`FlowControl.budget`).
    """
    if policy_version < hold_below:
        return 0
    committed = flow.committed(sink, dispatcher)
    rows = []
    try:
        while True:
            pending = source.resume_requests[0] if source.resume_requests else None
            allowed = (  # a resume request completes a group already counted in `committed`
                flow.may_complete(pending.members, dispatcher.inflight_samples, policy_version, cut)
                if pending is not None
                else flow.may_dispatch(committed, dispatcher.inflight_samples, policy_version, cut)
            )
            if not allowed:
                return len(rows)
            r = source.next_group(flow.group_size)
            rows.append(
                {
                    "group": r.group_id,
                    "task": r.task.index,
                    "env": r.task.env,
                    "first_member": r.first_member,
                    "members": r.members,
                    "v": policy_version,
                }
            )
            dispatcher.dispatch(r, policy_version)  # only schedules the request: it is sent after this returns
            committed += r.members
    finally:
        if rows:  # one write for the round (each system call on the loop lets another thread take the GIL)
            ledger.write_each(LedgerEvent.DISPATCHED, rows)
