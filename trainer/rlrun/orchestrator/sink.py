"""TrainSink: finished episodes → scored groups → queued samples → batches.

Guarantees: advantages of a group use only members that can still train (members
older than ``min_fresh_version`` of the next step are left out, and a group with
fewer than two such members is rejected); the queue sweep — not the dispatcher's
cancellation — is what guarantees that nothing stale ships: every batch ``s`` is cut
only after :meth:`TrainSink.sweep` dropped the samples older than
``min_fresh_version(s, max_off_policy_steps)``.

Advantages are group-relative (:mod:`rlrun.orchestrator.advantages`, ``spec.advantage``):
by default GRPO's ``A_i = r_i − mean(r)``, **not** divided by the group's reward std
(``advantage.std_normalize`` turns it on, with a floor ``advantage.min_std``): Liu et al.
2025 ("Understanding R1-Zero-Like Training", Dr. GRPO) show the std division over-weights
groups that are nearly all right or all wrong. A group whose advantages are all zero (every member got the same reward)
carries no gradient and is rejected (counted), so batches hold only samples that teach something. Why it had
zero spread is counted too, since a run collapsing shows there first: solved by every
member (all at the top reward, prime-rl's ``solved_all``: the task is too easy now), or
the very same wrong completion from every member (the policy stopped exploring).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from rlrun.api.algorithm import AdvantageSpec
from rlrun.api.spec import RLRunSpec
from rlrun.envs.base import SOLVED_REWARD, Task
from rlrun.ledger import LedgerEvent
from rlrun.orchestrator.advantages import group_advantages
from rlrun.orchestrator.groups import GroupCancellation, GroupRequest
from rlrun.orchestrator.snapshot import RestorePlan, SinkSnapshot
from rlrun.orchestrator.staleness import min_fresh_version, split_fresh
from rlrun.samples import Episode, TrainingSample

#: ``record(event, episode_ids, **fields)``: where the sink reports episode fates (the ledger).
Record = Callable[..., None]

ZERO_ADVANTAGE = 1e-9
#: The :class:`SinkCounters` that count completion tokens (what a zero-spread group costs: issue 48).
TOKEN_COUNTERS = ("tokens_finished", "tokens_zero_spread_solved", "tokens_zero_spread_unsolved", "tokens_shipped")


class Difficulty(Protocol):
    """What the sink tells of every group it scores (:class:`rlrun.orchestrator.difficulty.TaskDifficulty`)."""

    def record(self, task: Task, rewards: list[float]) -> None: ...


@dataclass
class OpenGroup:
    """A group still collecting members."""

    group_id: int
    task: Task
    episodes: list[Episode] = field(default_factory=list)


@dataclass
class SinkCounters:
    """Cumulative counts (samples unless named otherwise)."""

    episodes_finished: int = 0  # every finished episode that reached the sink (an abandoned group's too)
    groups_scored: int = 0
    groups_rejected: int = 0  # too few fresh members, or zero reward spread
    groups_rejected_zero_spread: int = 0  # of groups_rejected: zero reward spread (what NoSignalGuard watches)
    groups_rejected_solved: int = 0  # of groups_rejected: zero spread, every member at SOLVED_REWARD
    groups_rejected_same_wrong: int = 0  # of groups_rejected: zero spread, not solved, identical completions
    samples_queued: int = 0
    samples_shipped: int = 0
    samples_dropped_stale: int = 0
    members_left_out_stale: int = 0
    groups_abandoned: int = 0
    #: completion tokens (what the rollout servers generated): of every finished episode that reached the sink, of the
    #: groups rejected for zero spread solved by every member / not solved by every member, of the samples shipped
    tokens_finished: int = 0
    tokens_zero_spread_solved: int = 0
    tokens_zero_spread_unsolved: int = 0
    tokens_shipped: int = 0
    #: ``{env: {"finished": episodes, "wasted_stale": episodes, "abandoned": groups}}``: where the waste falls
    #: (a task class that is always slow is starved first: :func:`rlrun.orchestrator.metrics.starved_envs`)
    per_env: dict[str, dict[str, int]] = field(default_factory=dict)

    def count_env(self, env: str, key: str, n: int = 1) -> None:
        """Add ``n`` to env ``env``'s ``key`` (``finished``, ``wasted_stale`` or ``abandoned``)."""
        counts = self.per_env.setdefault(env, {"finished": 0, "wasted_stale": 0, "abandoned": 0})
        counts[key] += n


class TrainSink:
    """Collects episodes into groups, scores them, queues samples and cuts batches.

    The sink alone changes its queue, open groups and counters: episodes come in through
    :meth:`add_episodes`, batches go out through :meth:`take_batch`, and a cancellation, an
    abandoned group or a resume goes through :meth:`cancel`, :meth:`abandon` or :meth:`restore`.

    Args:
        group_size: members per group.
        batch_size: samples per batch.
        max_off_policy_steps: staleness bound (see :func:`~rlrun.orchestrator.staleness.min_fresh_version`).
        advantage: how rewards become advantages (``spec.advantage``; None: its defaults).
        record: ``record(event: LedgerEvent, episode_ids: list[str], **fields) -> None``, called for
            episodes queued, rejected, dropped stale and abandoned (the ledger); None records nothing.
    """

    def __init__(
        self,
        group_size: int,
        batch_size: int,
        max_off_policy_steps: int,
        advantage: AdvantageSpec | None = None,
        record: Record | None = None,
    ) -> None:
        self.group_size = group_size
        self.batch_size = batch_size
        self.max_off_policy_steps = max_off_policy_steps
        self.advantage = advantage or AdvantageSpec()
        self.queue: list[TrainingSample] = []
        self.open_groups: dict[int, OpenGroup] = {}
        self.abandoned: dict[int, str] = {}  # groups given up in this attempt → why
        self.counters = SinkCounters()
        self._recent_rewards: list[float] = []
        #: since the last drain: groups scored, those whose rewards had zero std, solved by all, scoring 0 for all;
        #: and their episodes that stopped at max_tokens (finish reason length)
        self._recent_groups = [0, 0, 0, 0, 0]
        self._recent_floored = 0  # groups queued since the last drain whose std normalisation used advantage.min_std
        self._recent_tokens: dict[str, int] = dict.fromkeys(TOKEN_COUNTERS, 0)  # the token counters since the drain
        #: told the rewards of every group scored (the curriculum's per-task state); None: nobody is
        self.difficulty: Difficulty | None = None
        self._record = record or (lambda event, ids, **fields: None)

    @classmethod
    def from_spec(cls, spec: RLRunSpec, record: Record | None = None) -> TrainSink:
        """The sink of a run: group and batch sizes, staleness bound and advantage settings from ``spec``."""
        return cls(spec.group_size, spec.batch_size, spec.max_off_policy_steps, spec.advantage, record)

    def min_fresh(self, step: int) -> int:
        """``min_fresh_version(step, max_off_policy_steps)``."""
        return min_fresh_version(step, self.max_off_policy_steps)

    def add_episodes(self, group_id: int, task: Task, episodes: list[Episode], next_step: int) -> list[TrainingSample]:
        """Add finished members of group ``group_id``; score the group once it has ``group_size``.

        Args:
            next_step: the next batch to ship (decides which members are still fresh).

        Returns:
            The samples this call queued (empty while the group is open or when it was rejected).
        """
        self.counters.episodes_finished += len(episodes)
        self._count_tokens("tokens_finished", sum(len(e.completion_ids) for e in episodes))
        self.counters.count_env(task.env, "finished", len(episodes))
        if group_id in self.abandoned:  # results that were on their way when the group was given up
            self._record(
                LedgerEvent.ABANDONED, [e.episode_id for e in episodes], group=group_id, reason=self.abandoned[group_id]
            )
            return []
        group = self.open_groups.setdefault(group_id, OpenGroup(group_id, task))
        group.episodes.extend(episodes)
        if len(group.episodes) < self.group_size:
            return []
        del self.open_groups[group_id]
        return self._score(group, next_step)

    def _score(self, group: OpenGroup, next_step: int) -> list[TrainingSample]:
        self.counters.groups_scored += 1
        rewards = [e.reward for e in group.episodes]
        if self.difficulty is not None:  # every member's reward, stale ones too: they measure the task
            self.difficulty.record(group.task, rewards)
        self._recent_rewards.extend(rewards)
        # of every member, stale ones included, like the reward metric: it tracks the policy
        recent = self._recent_groups
        recent[0] += 1
        recent[1] += all(abs(a) < ZERO_ADVANTAGE for a in group_advantages(rewards).values)
        recent[2] += all(r >= SOLVED_REWARD for r in rewards)
        recent[3] += all(r <= 0.0 for r in rewards)
        recent[4] += sum(e.finish_reason == "length" for e in group.episodes)
        fresh = self._keep_fresh(group, self.min_fresh(next_step))
        scored = group_advantages([e.reward for e in fresh], self.advantage)  # of the members that train only
        advantages = scored.values
        if len(fresh) < 2 or all(abs(a) < ZERO_ADVANTAGE for a in advantages):
            self.counters.groups_rejected += 1
            reason = "too_few_fresh_members" if len(fresh) < 2 else "zero_advantage"
            if reason == "zero_advantage":
                self._count_zero_spread(fresh)
            self._record(LedgerEvent.REJECTED, [e.episode_id for e in fresh], group=group.group_id, reason=reason)
            return []
        samples = [TrainingSample.from_episode(e, a) for e, a in zip(fresh, advantages, strict=True)]
        self._recent_floored += scored.floored
        self.queue.extend(samples)
        self.counters.samples_queued += len(samples)
        self._record(LedgerEvent.QUEUED, [s.trace.episode_id for s in samples], group=group.group_id)
        return samples

    def _count_zero_spread(self, members: list[Episode]) -> None:
        """Count a group rejected for zero reward spread, its tokens, and why it had it: solved by all, or the same
        wrong answer."""
        self.counters.groups_rejected_zero_spread += 1
        tokens = sum(len(e.completion_ids) for e in members)
        if all(e.reward >= SOLVED_REWARD for e in members):
            self.counters.groups_rejected_solved += 1
            self._count_tokens("tokens_zero_spread_solved", tokens)
            return
        self._count_tokens("tokens_zero_spread_unsolved", tokens)
        if len({tuple(e.completion_ids) for e in members}) == 1:
            self.counters.groups_rejected_same_wrong += 1

    def sweep(self, step: int) -> list[TrainingSample]:
        """Drop queued samples too old to train in batch ``step``; returns them."""
        self.queue, stale = split_fresh(self.queue, self.min_fresh(step))
        if stale:
            self.counters.samples_dropped_stale += len(stale)
            for s in stale:
                self.counters.count_env(s.trace.env, "wasted_stale")
            self._record(
                LedgerEvent.DROPPED_STALE,
                [s.trace.episode_id for s in stale],
                step=step,
                floor=self.min_fresh(step),
                v=[s.trace.policy_version for s in stale],
            )
        return stale

    def take_batch(self, step: int) -> list[TrainingSample] | None:
        """Sweep for ``step``, then cut ``batch_size`` samples oldest-first by dispatch version.

        The sort is stable, so samples of one group (queued together) stay adjacent and in
        order; the overflow left in the queue is the youngest, with the most staleness
        budget left. Returns None while fewer than ``batch_size`` fresh samples are queued.
        """
        self.sweep(step)
        if len(self.queue) < self.batch_size:
            return None
        ordered = sorted(self.queue, key=lambda s: s.policy_version)
        batch, self.queue = ordered[: self.batch_size], ordered[self.batch_size :]
        self.counters.samples_shipped += len(batch)
        self._count_tokens("tokens_shipped", sum(len(s.completion_ids) for s in batch))
        return batch

    def drain_recent_rewards(self) -> list[float]:
        """Rewards of every episode scored since the last call (rejected groups included)."""
        out, self._recent_rewards = self._recent_rewards, []
        return out

    def drain_recent_groups(self) -> tuple[int, int, int, int, int]:
        """``(groups scored, those whose rewards had zero std, solved by every member (reward ≥ 1), scored 0 by every
        member, their episodes cut at max_tokens)`` since the last call (restored groups scored by :meth:`restore`
        included). A group's rewards are all its members', stale ones included, as in :meth:`drain_recent_rewards`:
        a group whose fresh members alone have zero spread is rejected without counting here."""
        out, self._recent_groups = tuple(self._recent_groups), [0, 0, 0, 0, 0]
        return out  # type: ignore[return-value]

    def _count_tokens(self, counter: str, n: int) -> None:
        setattr(self.counters, counter, getattr(self.counters, counter) + n)
        self._recent_tokens[counter] += n

    def drain_recent_tokens(self) -> dict[str, int]:
        """The token counters (:data:`TOKEN_COUNTERS`) since the last call: what the step's cost shares divide."""
        out, self._recent_tokens = self._recent_tokens, dict.fromkeys(TOKEN_COUNTERS, 0)
        return out

    def drain_recent_floored(self) -> int:
        """Groups queued since the last call whose std normalisation divided by ``advantage.min_std`` instead of
        their reward std (:class:`~rlrun.orchestrator.advantages.GroupAdvantages` ``floored``)."""
        out, self._recent_floored = self._recent_floored, 0
        return out

    @property
    def finished_episodes_kept(self) -> int:
        """Finished episodes waiting in open groups."""
        return sum(len(g.episodes) for g in self.open_groups.values())

    def _keep_fresh(self, group: OpenGroup, floor: int, **fields: Any) -> list[Episode]:
        """Drop the group's members older than ``floor`` (recorded and counted); returns the fresh ones."""
        fresh, stale = split_fresh(group.episodes, floor)
        if stale:
            self.counters.members_left_out_stale += len(stale)
            self.counters.count_env(group.task.env, "wasted_stale", len(stale))
            ids, versions = [e.episode_id for e in stale], [e.policy_version for e in stale]
            self._record(LedgerEvent.DROPPED_STALE, ids, group=group.group_id, floor=floor, v=versions, **fields)
        group.episodes = fresh
        return fresh

    def cancel(self, cancellation: GroupCancellation) -> int | None:
        """A stale request of a group was cancelled: how many members the group is asked again for, or None.

        The group's finished members older than ``cancellation.min_fresh_version`` are dropped
        (they could not train either). While fresh members remain or other requests of the group
        are out, the group goes on: it is asked again for the cancelled request's members *and*
        for the finished members dropped here, so that what it holds, has out and asks for still
        adds up to ``group_size`` (asking for the cancelled ones only left a group of 16 in 4
        requests waiting for ever for the members dropped here, holding flow-control budget: a
        run stuck one batch short of it). None: nothing of the group can still train; the caller
        abandons it (:meth:`abandon`).
        """
        group = self.open_groups.get(cancellation.request.group_id)
        if group is None:
            return cancellation.request.members if cancellation.others_out else None
        held = len(group.episodes)
        fresh = self._keep_fresh(group, cancellation.min_fresh_version, at="cancel")
        if not fresh and not cancellation.others_out:
            return None
        return cancellation.request.members + held - len(fresh)

    def abandon(self, group_id: int, reason: str, env: str | None = None) -> None:
        """Give up group ``group_id``: its finished episodes are recorded as abandoned (with ``reason``) and
        counted, and episodes of it that still arrive (results already queued) are recorded the same way.

        Without this, a half-finished group would wait forever for members nobody will produce,
        and hold flow-control budget. A group is abandoned once: a second call does nothing.
        """
        if group_id in self.abandoned:
            return
        group = self.open_groups.pop(group_id, None)
        self.abandoned[group_id] = reason
        self.counters.groups_abandoned += 1
        env = group.task.env if group is not None else env
        if env is not None:
            self.counters.count_env(env, "abandoned")
        ids = [e.episode_id for e in group.episodes] if group is not None else []
        self._record(LedgerEvent.ABANDONED, ids, group=group_id, reason=reason)

    def snapshot(self, emitted: list[GroupRequest]) -> SinkSnapshot:
        """Copy the queue and the open groups, with the dispatcher's ``emitted`` requests (call on the loop:
        reference copies only, no ``await``; :mod:`.snapshot` packs it in a thread)."""
        return SinkSnapshot(
            pending_batch=list(self.queue),
            open_groups=[(g.group_id, g.task, list(g.episodes)) for g in self.open_groups.values()],
            emitted_train_groups=emitted,
            counters=asdict(self.counters),
        )

    def restore(self, plan: RestorePlan, counters: dict[str, int], next_step: int) -> None:
        """Put back what a resume keeps of a sink snapshot (an empty sink only).

        Args:
            plan: :func:`~rlrun.orchestrator.snapshot.restore_plan` of the snapshot.
            counters: the snapshot's :class:`SinkCounters` as a dict (empty for older checkpoints).
            next_step: the next batch to ship (recorded with the samples and members dropped stale).

        Raises:
            RuntimeError: the sink already holds work.
        """
        if self.queue or self.open_groups:
            raise RuntimeError("TrainSink.restore needs an empty sink")
        if counters:
            self.counters = SinkCounters(**counters)
        self.queue = list(plan.queue)
        self.open_groups = {g: OpenGroup(g, task, list(eps)) for g, task, eps in plan.open_groups}
        self.counters.samples_dropped_stale += len(plan.dropped_samples)
        self.counters.members_left_out_stale += len(plan.dropped_episodes)
        for env in [s.trace.env for s in plan.dropped_samples] + [e.task.env for e in plan.dropped_episodes]:
            self.counters.count_env(env, "wasted_stale")
        dropped = [s.trace.episode_id for s in plan.dropped_samples] + [e.episode_id for e in plan.dropped_episodes]
        if dropped:  # too old by the policy that generated them (v), not by anything the resume did
            versions = [s.trace.policy_version for s in plan.dropped_samples] + [
                e.policy_version for e in plan.dropped_episodes
            ]
            self._record(LedgerEvent.DROPPED_STALE, dropped, step=next_step, at="resume", floor=plan.floor, v=versions)
        # A group the journal replay completed (its last members finished after the snapshot) is scored now,
        # as it was before the crash; it is not requested again (the plan lists it with no missing member).
        for group_id in [g for g, group in self.open_groups.items() if len(group.episodes) >= self.group_size]:
            self._score(self.open_groups.pop(group_id), next_step)

    def unfinished_episode_ids(self) -> list[str]:
        """Episode ids still queued or waiting in open groups (left over when the run ends)."""
        ids = [s.trace.episode_id for s in self.queue]
        return ids + [e.episode_id for g in self.open_groups.values() for e in g.episodes]
