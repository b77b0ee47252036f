"""NoSignalGuard: a run whose groups all carry no learning signal says so, then stops — it never spins for hours.

A group whose members all got the same reward has zero advantages and is rejected (:mod:`.sink`): it teaches
nothing. When every group is like that — a reward that never varies, a task far too hard or too easy for the
model, a policy that collapsed to one answer — no batch ever forms, yet episodes keep finishing, so the stall
report (:mod:`.liveness`) never fires, and the journal grows with every rejected group. Issue 36.1: a run sat 14
minutes at step 0, 192,572 episodes finished, 24,071 groups rejected, 400 MB of journal, not one warning.

The guard counts the groups rejected for zero reward spread since the last batch was cut (or since the attempt
began). Once they reach :data:`WARN_SHARE` of the limit it warns, once per attempt; once they reach the limit —
``spec.max_zero_spread_groups``, by default :data:`DEFAULT_LIMIT_BATCHES` batches' worth of groups
(``batch_size / group_size`` each) — it raises :class:`NoLearningSignal`, a permanent error (the orchestrator
exits 78; retrying the same spec would spin again). Both messages say how the rejected groups split (solved by
every member; the very same wrong completion from every member; the rest: equal rewards without solving it) and
which knobs change it: the reward, the task difficulty, ``group_size``, ``sampling.temperature``.

Why per batch and not per run: a run that rejects most groups but still forms a batch now and then trains
(slowly: DAPO-style dynamic sampling is the same trade); one that forms none in 50 batches' worth of groups
rejects more than 98 % of them and is wasting its rollouts. Why this also bounds the journal: every episode is
journaled before it counts, and the journal is compacted at each checkpoint (after a batch): while no batch
forms, the records of rejected groups accumulate — at most the limit's groups' episodes, then the run stops
(``docs/design.md``, "Runs that form no batch", has the bytes).

A policy object: it owns no task; the liveness guard, which the orchestrator's follower loop calls while the run
is not paused, calls :meth:`NoSignalGuard.check` (:mod:`.liveness`: the run level's other guard, the stall report).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from rlrun.api.spec import RLRunSpec
from rlrun.errors import OrchestratorError
from rlrun.orchestrator.sink import SinkCounters

log = logging.getLogger(__name__)

#: The limit when ``spec.max_zero_spread_groups`` is unset: this many batches' worth of groups rejected for zero
#: reward spread since the last batch.
DEFAULT_LIMIT_BATCHES = 50
#: The warning comes at this share of the limit (once per attempt).
WARN_SHARE = 0.2


class NoLearningSignal(OrchestratorError):
    """Groups kept being rejected for zero reward spread and no batch formed (message: how they split, what to
    change). Retrying the same spec cannot heal it (``permanent``; exit 78, reason ``reason``)."""

    permanent = True
    reason = "NoLearningSignal"


@dataclass(frozen=True)
class _Split:
    """Groups rejected for zero spread since the last batch, and of them solved by all / the same wrong answer."""

    groups: int
    solved: int
    same_wrong: int

    def words(self) -> str:
        other = self.groups - self.solved - self.same_wrong
        share = [100 * n / self.groups for n in (self.solved, self.same_wrong, other)]
        return (
            f"{share[0]:.0f} % solved by every member (the tasks are too easy now), {share[1]:.0f} % the very same "
            f"wrong completion from every member (the policy stopped exploring), {share[2]:.0f} % every member "
            "scored the same without solving it (a reward that does not vary, or tasks too hard for the model)"
        )


class NoSignalGuard:
    """Warns, then stops, a run that forms no batch because its groups have zero reward spread (module docstring).

    Args:
        spec: the run's spec (``max_zero_spread_groups``, and the knobs the messages name).

    Attributes:
        limit: groups rejected for zero spread since the last batch at which the run stops.
        warn_at: the count at which it warns (once per attempt).
        warned: whether this attempt has warned.
    """

    def __init__(self, spec: RLRunSpec) -> None:
        self.spec = spec
        per_batch = math.ceil(spec.batch_size / spec.group_size)
        self.limit = spec.max_zero_spread_groups or DEFAULT_LIMIT_BATCHES * per_batch
        self.warn_at = max(1, math.ceil(WARN_SHARE * self.limit))
        self.warned = False
        self._since: tuple[int, int, int] | None = None  # the counters when the last batch was cut
        self._shipped: int | None = None  # samples shipped then

    def _split(self, counters: SinkCounters) -> _Split:
        now = (
            counters.groups_rejected_zero_spread,
            counters.groups_rejected_solved,
            counters.groups_rejected_same_wrong,
        )
        if self._since is None or counters.samples_shipped != self._shipped:  # the attempt's start, or a batch cut
            self._since, self._shipped = now, counters.samples_shipped
        return _Split(*(n - b for n, b in zip(now, self._since, strict=True)))

    def check(self, counters: SinkCounters) -> None:
        """Look at the sink's ``counters`` (the first look of an attempt starts its count); warn once per attempt
        at :attr:`warn_at` groups rejected for zero spread since the last batch was cut.

        Raises:
            NoLearningSignal: they reached :attr:`limit`.
        """
        split = self._split(counters)
        shipped = counters.samples_shipped // self.spec.batch_size  # batches cut (each holds batch_size)
        if split.groups >= self.limit:
            raise NoLearningSignal(
                f"{self._what(split, shipped)}. Stopped after {split.groups} such groups "
                f"({self._limit_words()}); check {self._knobs()}"
            )
        if split.groups >= self.warn_at and not self.warned:
            self.warned = True
            log.warning(
                "%s. Check %s. The run stops after %d such groups (%s)",
                self._what(split, shipped),
                self._knobs(),
                self.limit,
                self._limit_words(),
            )

    def _what(self, split: _Split, shipped: int) -> str:
        since = f"since batch {shipped}" if shipped else "since the run began"
        return (
            f"no batch can form: {split.groups} groups {since} were rejected because every member got the same "
            f"reward (zero spread: no gradient) — {split.words()}"
        )

    def _limit_words(self) -> str:
        if self.spec.max_zero_spread_groups is not None:
            return f"spec.max_zero_spread_groups: {self.limit}"
        return f"spec.max_zero_spread_groups unset: {DEFAULT_LIMIT_BATCHES} batches' worth of groups, {self.limit}"

    def _knobs(self) -> str:
        s = self.spec
        return (
            "the reward (does it score different completions differently?), the task difficulty (what the "
            f"model can solve some of the time), group_size ({s.group_size}: more members, more chance of "
            f"different rewards) and sampling.temperature ({s.sampling.temperature:g}: more diverse completions)"
        )
