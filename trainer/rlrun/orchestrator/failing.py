"""FailureStreak: a run whose requests keep failing says so, then stops — no error is retried for ever.

A request *fails* when it delivers no episode: its tries failed for ``rollout.retry_window_seconds`` (a server
fault: a transport error, a 5xx, no answer in time), a server refused it (a 4xx:
:class:`~rlrun.rollout.rejections.RequestRejected`) or answered a completion that cannot be trained
(:class:`~rlrun.rollout.client.UnusableCompletion`), or every member's reward or env failed. Its members are
requested again within ``rollout.max_group_retries``, then its group is abandoned and the source moves on to
new tasks — so each failure is bounded, but a run where *every* request fails abandons group after group for
ever. Issue 47: a server whose context was smaller than rlrun believed answered every request 400; it was
retried 1,879 times in 6 minutes, every group (63) abandoned, no step shipped, the console silent at ``step
0/3``, and the run never stopped. (A context refusal now ends its episode or stops the run at once:
:mod:`.dispatcher`; this streak is what stops any other error that never heals.)

The bound: failed requests **in a row**, per attempt, counted in two streaks so that a request's order is the
order in which its fate was known. The **rollout streak** counts requests the servers failed (a fault, a
refusal, an unusable answer), and any request a server answers with usable completions ends it — at the
answer, not after its scoring, else the quick failures between two slow-scored successes would read as a
streak. The **scoring streak** counts requests whose every member's reward or env failed, and any request that
delivers an episode ends it. Not a share: a run where most requests fail but some succeed still trains
(slowly), and goes on. Each stops at :data:`LIMIT`, except server faults and unusable answers — each one
already retried for the retry window, or a server's passing trouble — that stop at the larger of :data:`LIMIT`
and twice the requests that fit in flight (``rollout.max_inflight`` over the members per request): a server
outage longer than the retry window fails every request out at once, and must do so twice over before the run
gives up. A warning comes at :data:`WARN_SHARE` of the limit (once per streak); at the limit the run stops
with one message: how many failed, of which kinds, and the last error. The error's class (and exit reason)
follows that last failure's kind: :class:`RewardsFailing`, :class:`EnvFailing` and :class:`RequestsRejected`
are permanent (exit 78: the same spec fails the same way); :class:`RequestsFailing`, for server faults and
unusable answers, is not (exit 1: new servers may heal it).

A policy object like :mod:`.no_signal`: it owns no task; the dispatcher tells it each request's outcome as it
delivers the result, and its raising there stops the run (the dispatcher's ``failures``).
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from typing import Literal

from rlrun.api.spec import RLRunSpec
from rlrun.errors import OrchestratorError

log = logging.getLogger(__name__)

#: Failed requests in a row at which a run stops (server faults: at least this,
#: :meth:`FailureStreak.from_spec`).
LIMIT = 64
#: The warning comes at this share of the limit (once per streak).
WARN_SHARE = 0.2

#: What a failed request came to: a server fault (every try failed for the retry window), an unusable answer,
#: a refusal (4xx), every member's reward failed, every member's env failed.
FailureKind = Literal["server", "unusable", "rejected", "reward", "env"]
_TRANSIENT: frozenset[FailureKind] = frozenset({"server", "unusable"})
_WORDS: dict[FailureKind, str] = {
    "server": "failed on every try",
    "unusable": "answered unusable completions",
    "rejected": "were refused by the server",
    "reward": "had every member's reward fail",
    "env": "had every member's env fail",
}


class RequestsFailing(OrchestratorError):
    """Requests kept failing on the rollout servers (every try for the retry window, or unusable answers) with
    none delivering an episode between them (message: how many, of which kinds, the last error). New servers
    may heal it: not permanent (exit 1)."""

    permanent = False
    reason = "RequestsFailing"


class RequestsRejected(RequestsFailing):
    """The rollout servers kept refusing requests (a 4xx): the request is wrong, not the server.
    ``permanent``."""

    permanent = True
    reason = "RequestsRejected"


class RewardsFailing(RequestsFailing):
    """Every member's reward kept failing: the reward is broken, not flaky. ``permanent``."""

    permanent = True
    reason = "RewardsFailing"


class EnvFailing(RequestsFailing):
    """Every member's env call (``start``, ``respond``) kept failing or timing out. ``permanent``."""

    permanent = True
    reason = "EnvFailing"


_ERRORS: dict[FailureKind, type[RequestsFailing]] = {
    "server": RequestsFailing,
    "unusable": RequestsFailing,
    "rejected": RequestsRejected,
    "reward": RewardsFailing,
    "env": EnvFailing,
}


class _Streak:
    """Failed requests since the streak last ended, by kind."""

    def __init__(self) -> None:
        self.count = 0
        self.kinds: Counter[FailureKind] = Counter()
        self.warned = False

    def end(self) -> None:
        self.count, self.warned = 0, False
        self.kinds.clear()


class FailureStreak:
    """Counts failed requests in a row in two streaks; warns, then stops the run (module docstring).

    Args:
        server_limit: the limit for server faults and unusable answers (at least :data:`LIMIT`).

    Attributes:
        longest: the longest streak of this attempt (either).
    """

    def __init__(self, server_limit: int = LIMIT) -> None:
        self.server_limit = max(LIMIT, server_limit)
        self.longest = 0
        self._rollout, self._scoring = _Streak(), _Streak()

    @classmethod
    def from_spec(cls, spec: RLRunSpec) -> FailureStreak:
        """The streaks of a run: server faults bounded at twice the requests that fit in flight (module
        docstring)."""
        per_request = min(spec.rollout.members_per_request or spec.group_size, spec.group_size)
        return cls(2 * math.ceil(spec.rollout.max_inflight / per_request))

    def answered(self) -> None:
        """A rollout server answered a request with usable completions: the rollout streak ends."""
        self._rollout.end()

    def delivered(self) -> None:
        """A request delivered an episode: the scoring streak ends (and the rollout streak: it was
        answered)."""
        self._rollout.end()
        self._scoring.end()

    def failed(self, kind: FailureKind, env: str, error: str) -> None:
        """A request of env ``env`` failed (``kind``, its ``error``): count it in its streak; warn once per
        streak.

        Raises:
            RequestsFailing: the streak reached its limit (the subclass of the last failure's ``kind``).
        """
        streak = self._scoring if kind in ("reward", "env") else self._rollout
        streak.count += 1
        streak.kinds[kind] += 1
        self.longest = max(self.longest, streak.count)
        limit = self.server_limit if kind in _TRANSIENT else LIMIT
        if streak.count >= limit:
            what, words = self._what(streak, kind, env, error), self._limit_words(kind)
            n = streak.count
            raise _ERRORS[kind](f"{what}. Stopped after {n} such requests in a row (the limit: {words})")
        if streak.count >= max(1, math.ceil(WARN_SHARE * limit)) and not streak.warned:
            streak.warned = True
            what, words = self._what(streak, kind, env, error), self._limit_words(kind)
            log.warning("%s. The run stops at %d in a row (%s)", what, limit, words)

    @staticmethod
    def _what(streak: _Streak, kind: FailureKind, env: str, error: str) -> str:
        split = ", ".join(f"{n} {_WORDS[k]}" for k, n in streak.kinds.most_common())
        if kind in ("reward", "env"):  # the words of the reward's stop since issue 36
            what = "rewards" if kind == "reward" else "env calls (start, respond)"
            return (
                f"the {what} of {streak.count} requests in a row failed for every member (env {env}); "
                f"the last error: {error}" + ("" if len(streak.kinds) == 1 else f" ({split})")
            )
        n = streak.count
        return f"{n} requests in a row got no usable answer ({split}); the last (env {env}): {error}"

    def _limit_words(self, kind: FailureKind) -> str:
        if kind in _TRANSIENT:
            return (
                f"{self.server_limit} for server faults: twice the requests that fit in flight, at least "
                f"{LIMIT}; check the rollout servers' logs, or raise rollout.retry_window_seconds to ride "
                "out longer outages"
            )
        return f"{LIMIT} for a failure no retry heals"
