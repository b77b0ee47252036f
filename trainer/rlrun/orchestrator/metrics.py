"""The orchestrator's metrics: one JSON line per shipped step in ``<run_dir>/metrics.jsonl``.

Keys of a line: ``step``, ``attempt``, ``policy_version``; ``reward_mean`` and ``reward_std`` (over every
episode scored since the previous step, rejected groups included, so they track the policy
rather than the batch selection; null when none was scored), ``episodes_scored``,
``batch_reward_mean``, ``completion_len_mean`` and ``completion_len_max`` (tokens, of the batch),
``truncated_fraction`` (the episodes scored since the previous step that stopped at ``max_tokens``),
``solved_all`` / ``solved_none`` (of the groups scored since the previous step, the share every member
solved (reward 1) / every member scored 0: prime-rl's names), ``staleness_mean`` /
``staleness_max`` (steps off-policy in this batch: ``(step − 1) − policy version``),
``queue`` (queued samples left), ``queue_staleness_mean`` / ``queue_staleness_max`` (how off-policy they would
train in the next step: ``step − policy version``; null with the queue empty), ``open_groups``, ``inflight``
(completions), ``groups_rejected`` (cumulative: too few fresh members, or zero reward spread), of them
``groups_rejected_solved`` (zero spread, every member at the top reward: solved by all) and
``groups_rejected_same_wrong`` (zero spread, not solved, every member the same completion tokens:
the same wrong answer; both cumulative, signs of collapse), ``frac_reward_zero_std`` (share of the
groups scored since the previous step whose rewards had zero std, all members; null when none),
``groups_std_floored`` (groups queued since the previous step whose std normalisation divided by
``advantage.min_std``, their reward std being smaller: :mod:`rlrun.orchestrator.advantages`),
``samples_dropped_stale``, ``episodes_wasted_stale`` (cumulative: finished
episodes that never trained because they grew too old — queued samples swept and members left out
of scoring or dropped at a cancel), ``stale_wasted_fraction`` (that ÷ the finished episodes, both
cumulative; null before any), ``per_env`` (``{env: {finished, wasted_stale, abandoned,
stale_wasted_fraction}}``, cumulative: where the waste falls), ``groups_cancelled`` (requests),
``prompts_too_long`` (cumulative over the attempt: tasks passed over because their prompt does not fit the
context less ``sampling.max_tokens``, ``rollout.overlong_prompts: filter``; also in ``per_env``),
``groups_abandoned`` (cumulative: nothing of the group could still train, or its requests kept failing),
what zero-spread groups cost in tokens (:func:`token_cost`: ``tokens_generated``, ``zero_spread_token_fraction``
and its ``_solved`` / ``_unsolved`` parts, ``trained_token_fraction``, ``generated_tokens_per_trained_token``),
``tasks_skipped`` (cumulative over the run: tasks the curriculum passed over, ``spec.curriculum``),
``reward/<env>`` (the mean reward of the env's episodes finished since the previous step; also
``reward/<env>/<family>`` per task family, for tasks whose ``info`` names one:
:data:`rlrun.envs.base.FAMILY`) and
``reward/<series>`` (each reward function's mean score over them, where it applied: ``spec.envs[].rewards``;
an env without ``rewards`` has one, named after it), ``reward_metrics`` (``{name: mean}`` of what the rewards
reported with TRL's ``log_metric(name, value)`` since the previous step; absent when none did),
``episodes_reward_failed`` (cumulative over the attempt:
members whose reward raised, timed out or was no number; requested again), ``num_turns``, ``tool_calls`` and
``tool_errors`` (multi-turn envs only: means per episode finished since the previous step: model turns, tool
calls, tool calls that failed), ``rollout_tokens_per_s`` (sampled tokens) and ``step_time_s`` (since the
previous step), ``weight_update_s`` (time the rollout servers spent taking new weights since the previous step:
validation, then pause, reload, verification and resume), ``weight_transfer`` (cumulative over the attempt: the
servers' weight updates by the path the weights came, ``filesystem`` or ``collective`` — ``{"updates", "seconds",
"bytes"}`` each — and ``fallbacks``, in-memory sends that fell back to the files: ``spec.weights``),
``served_mismatch_kl`` (the trainer–sampler mismatch of the newest policy version the servers hold, nats/token,
the largest over them: the k3 KL of their logprobs against the trainer's on the version's probe,
:mod:`rlrun.probes`; ≈ 0 for the same weights; null when not measured), ``time`` (Unix s),
``eval_rounds_dropped`` (cumulative over the attempt: held-out evaluation rounds dropped — failed,
unanswered within ``evaluation.timeout_seconds``, or discarded because their weights moved:
:mod:`rlrun.orchestrator.evaluation`) and ``eval_hold_s`` (seconds evaluation rounds held the weight
pushes since the previous step, counted at each round's end), ``restored`` (the batch was cut from the
queue a resume put back, before this attempt consumed any rollout: its ``reward_mean`` is null and its
tokens/s 0 are no measurement).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

from rlrun.envs.base import FAMILY, MAX_FAMILIES
from rlrun.orchestrator.curriculum import Curriculum
from rlrun.orchestrator.dispatcher import Dispatcher
from rlrun.orchestrator.follower import WeightFollower
from rlrun.orchestrator.sink import SinkCounters, TrainSink
from rlrun.rundir import end_torn_line
from rlrun.samples import Episode, TrainingSample

log = logging.getLogger(__name__)

#: An env is starved when this share of its finished episodes were wasted as stale…
STARVED_FRACTION = 0.1
#: …and that share is this many times the other envs' (together), …
STARVED_RATIO = 3.0
#: …over at least this many of its finished episodes (fewer say nothing yet).
STARVED_MIN_EPISODES = 64


def starved_envs(per_env: dict[str, dict[str, int]]) -> dict[str, tuple[float, float]]:
    """``{env: (its stale-wasted fraction, the other envs' together)}`` for each env whose finished episodes
    are wasted as stale far more than the others' (the thresholds above; an env alone is never starved).

    Why it happens: a task class that is always slow (long prompts or answers) finishes its groups last, so
    under ``max_off_policy_steps`` its members are the ones that age out, and the run learns less of it
    without saying so (``docs/design.md``, "Orchestrator").
    """
    out = {}
    for env, c in per_env.items():
        others = [o for name, o in per_env.items() if name != env]
        finished = sum(o["finished"] for o in others)
        if not others or c["finished"] < STARVED_MIN_EPISODES or not finished:
            continue
        mine, theirs = c["wasted_stale"] / c["finished"], sum(o["wasted_stale"] for o in others) / finished
        if mine >= STARVED_FRACTION and mine >= STARVED_RATIO * theirs:
            out[env] = (mine, theirs)
    return out


def token_cost(recent: dict[str, int], counters: SinkCounters) -> dict[str, float | int | None]:
    """What zero-spread groups cost, in completion tokens (issue 48): ``tokens_generated`` since the previous step
    (``recent``: :meth:`TrainSink.drain_recent_tokens`) and the shares of them in groups rejected for zero reward
    spread, ``zero_spread_token_fraction`` = ``…_solved…`` (every member solved it) + ``…_unsolved…`` (the rest:
    every member failed it, or scored the same partial reward); ``trained_token_fraction`` (tokens shipped ÷ tokens
    generated) and ``generated_tokens_per_trained_token``, both cumulative over the run (the counters a resume
    restores). Shares are null when nothing was generated (or shipped). ``tokens_generated`` sums to the run's total
    over an uninterrupted run's lines; a resumed attempt counts from its resume, so the tokens an attempt finished
    after its last line are in the cumulative keys and the ledger check, in no line."""
    generated = recent["tokens_finished"]
    solved, unsolved = recent["tokens_zero_spread_solved"], recent["tokens_zero_spread_unsolved"]
    total, shipped = counters.tokens_finished, counters.tokens_shipped
    return {
        "tokens_generated": generated,
        "zero_spread_token_fraction": (solved + unsolved) / generated if generated else None,
        "zero_spread_solved_token_fraction": solved / generated if generated else None,
        "zero_spread_unsolved_token_fraction": unsolved / generated if generated else None,
        "trained_token_fraction": shipped / total if total else None,
        "generated_tokens_per_trained_token": total / shipped if shipped else None,
    }


class StepMetrics:
    """Appends the metrics line of each shipped step (keys in the module docstring).

    Args:
        path: ``<run_dir>/metrics.jsonl`` (appended to, so a resumed run continues it).
        attempt: this attempt's number.
        weights: the weight follower whose update time ``weight_update_s`` reports.
        curriculum: the one whose passed-over tasks ``tasks_skipped`` reports (None: 0).
    """

    def __init__(
        self, path: Path, attempt: int, weights: WeightFollower | None = None, curriculum: Curriculum | None = None
    ) -> None:
        self.path = path
        self.curriculum = curriculum
        self.attempt = attempt
        self.weights = weights
        self._update_seconds = 0.0  # the follower's update seconds at the previous step
        self._fh = None
        self._tokens = 0
        self._since = time.monotonic()
        self._consumed_any = False
        self._warned_starved: set[str] = set()
        self._scores: dict[str, list[float]] = {}  # series → scores of the episodes finished since the last step
        self._families: dict[str, set[str]] = {}  # env → the task families with a series of their own
        self._turns: dict[str, list[int]] = {}  # num_turns / tool_calls / tool_errors → per multi-turn episode
        self._logged: dict[str, list[float]] = {}  # a reward's log_metric(name, value) calls since the last step
        self._logged_lock = threading.Lock()  # log_metric is called from the reward threads
        #: members whose reward failed (cumulative over this attempt)
        self.reward_failed = 0
        #: tasks passed over because their prompt does not fit, by env (cumulative over this attempt)
        self.prompts_too_long: dict[str, int] = {}
        #: the last line written (None before the first step): what ``/metrics`` reports of the last step
        self.last_line: dict | None = None
        #: evaluation rounds dropped, and seconds rounds held the weight pushes (cumulative over this attempt;
        #: counted by :class:`rlrun.orchestrator.evaluation.EvalRounds`)
        self.eval_rounds_dropped = 0
        self.eval_hold_seconds = 0.0
        self._eval_hold_at_step = 0.0

    def add_scores(
        self,
        env: str,
        episodes: list[Episode],
        parts: dict[str, list[float | None]],
        turns: dict[str, list[int]] | None = None,
    ) -> None:
        """Count finished ``episodes`` of ``env`` for ``reward/<env>`` (their rewards) and ``parts`` (each
        reward function's scores of them, None where it did not apply) for ``reward/<series>``; a multi-turn
        env's ``turns`` (``num_turns``, ``tool_calls``, ``tool_errors`` of each episode) for those keys."""
        self._scores.setdefault(env, []).extend(e.reward for e in episodes)
        families = self._families.setdefault(env, set())
        for e in episodes:
            family = e.task.info.get(FAMILY)
            if isinstance(family, str) and family and (family in families or len(families) < MAX_FAMILIES):
                families.add(family)
                self._scores.setdefault(f"{env}/{family}", []).append(e.reward)
        for series, scores in parts.items():
            self._scores.setdefault(series, []).extend(x for x in scores if x is not None)
        for key, values in (turns or {}).items():
            self._turns.setdefault(key, []).extend(values)

    def prompt_too_long(self, env: str) -> None:
        """Count a task of ``env`` passed over: its prompt does not fit (``prompts_too_long``)."""
        self.prompts_too_long[env] = self.prompts_too_long.get(env, 0) + 1

    def log_metric(self, name: str, value: float) -> None:
        """A reward's TRL ``log_metric(name, value)`` (from a worker thread): averaged per step into
        ``reward_metrics`` (TRL averages a name's values over each logging step too)."""
        with self._logged_lock:
            self._logged.setdefault(name, []).append(value)

    def start(self) -> None:
        """Open the file (ending a line a killed attempt cut short) and start the clock of the first step."""
        end_torn_line(self.path)
        self._fh = open(self.path, "a")  # noqa: SIM115 - open for the run
        self._since = time.monotonic()

    def add_tokens(self, tokens: int) -> None:
        """Count completion tokens of a consumed rollout (for ``rollout_tokens_per_s``)."""
        self._tokens += tokens
        self._consumed_any = True

    def shipped(
        self, step: int, batch: list[TrainingSample], policy_version: int, sink: TrainSink, dispatcher: Dispatcher
    ) -> dict:
        """Write and log the line of batch ``step``; returns it."""
        now = time.monotonic()
        elapsed = max(now - self._since, 1e-9)
        rewards = sink.drain_recent_rewards()
        groups_scored, groups_zero_std, solved_all, solved_none, truncated = sink.drain_recent_groups()
        staleness = [(step - 1) - s.policy_version for s in batch]
        queued = [step - s.policy_version for s in sink.queue]  # as the next step would train them
        counters = sink.counters
        line = {
            "step": step,
            "attempt": self.attempt,
            "policy_version": policy_version,
            "reward_mean": (mean := sum(rewards) / len(rewards) if rewards else None),
            "reward_std": (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5 if rewards else None,
            "episodes_scored": len(rewards),
            "batch_reward_mean": sum(s.reward for s in batch) / len(batch),
            "completion_len_mean": sum(len(s.completion_ids) for s in batch) / len(batch),
            "completion_len_max": max(len(s.completion_ids) for s in batch),
            "truncated_fraction": truncated / len(rewards) if rewards else None,
            "staleness_mean": sum(staleness) / len(staleness),
            "staleness_max": max(staleness),
            "queue": len(sink.queue),
            "queue_staleness_mean": sum(queued) / len(queued) if queued else None,
            "queue_staleness_max": max(queued, default=None),
            "open_groups": len(sink.open_groups),
            "inflight": dispatcher.inflight_samples,
            "groups_rejected": counters.groups_rejected,
            "groups_rejected_solved": counters.groups_rejected_solved,
            "groups_rejected_same_wrong": counters.groups_rejected_same_wrong,
            "frac_reward_zero_std": groups_zero_std / groups_scored if groups_scored else None,
            "groups_std_floored": sink.drain_recent_floored(),
            "solved_all": solved_all / groups_scored if groups_scored else None,
            "solved_none": solved_none / groups_scored if groups_scored else None,
            "samples_dropped_stale": counters.samples_dropped_stale,
            "episodes_wasted_stale": (wasted := counters.samples_dropped_stale + counters.members_left_out_stale),
            "stale_wasted_fraction": wasted / counters.episodes_finished if counters.episodes_finished else None,
            "per_env": {
                env: {
                    **c,
                    "stale_wasted_fraction": c["wasted_stale"] / c["finished"] if c.get("finished") else None,
                    **({"prompts_too_long": self.prompts_too_long[env]} if env in self.prompts_too_long else {}),
                }
                for env, c in sorted({**{e: {} for e in self.prompts_too_long}, **counters.per_env}.items())
            },
            **{f"reward/{name}": sum(v) / len(v) if v else None for name, v in sorted(self._scores.items())},
            **{key: sum(v) / len(v) if v else None for key, v in sorted(self._turns.items())},
            **self._reward_metrics(),
            "episodes_reward_failed": self.reward_failed,
            "groups_cancelled": dispatcher.cancelled_groups,
            "groups_abandoned": counters.groups_abandoned,
            **token_cost(sink.drain_recent_tokens(), counters),
            "tasks_skipped": self.curriculum.skipped if self.curriculum is not None else 0,
            "prompts_too_long": sum(self.prompts_too_long.values()),
            "rollout_tokens_per_s": self._tokens / elapsed,
            "step_time_s": elapsed,
            "weight_update_s": self._weight_update_s(),
            "weight_transfer": self.weights.transfers.line() if self.weights is not None else None,
            "served_mismatch_kl": self.weights.mismatch.last if self.weights is not None else None,
            "eval_rounds_dropped": self.eval_rounds_dropped,
            "eval_hold_s": round(self.eval_hold_seconds - self._eval_hold_at_step, 3),
            "time": time.time(),
            "restored": not self._consumed_any,
        }
        self.last_line = line
        self._eval_hold_at_step = self.eval_hold_seconds
        self._tokens = 0
        self._since = now
        self._scores = {name: [] for name in self._scores}  # a series that saw nothing this step says null
        self._turns = {key: [] for key in self._turns}
        for env, (mine, theirs) in starved_envs(counters.per_env).items():
            if env not in self._warned_starved:  # once per env and attempt
                self._warned_starved.add(env)
                log.warning(
                    "env %s is starved: %.0f%% of its finished episodes were wasted as stale (other envs: %.0f%%); "
                    "its tasks finish too late for max_off_policy_steps. Raise max_off_policy_steps, or split its "
                    "groups (rollout.members_per_request) so members finish sooner; per_env in metrics.jsonl",
                    env,
                    100 * mine,
                    100 * theirs,
                )
        if self._fh is not None:
            self._fh.write(json.dumps(line) + "\n")
            self._fh.flush()
        scored = (
            f"reward {line['reward_mean']:.3f}" if rewards else "restored batch" if line["restored"] else "none scored"
        )
        log.info(
            "shipped step %d: %s, staleness %.2f (max %d), queue %d, %.0f tok/s, %.2f s",
            step,
            scored,
            line["staleness_mean"],
            line["staleness_max"],
            line["queue"],
            line["rollout_tokens_per_s"],
            elapsed,
        )
        return line

    def _reward_metrics(self) -> dict[str, dict[str, float]]:
        """``{"reward_metrics": {name: mean}}`` of the ``log_metric`` calls since the previous step (emptied), or {}."""
        with self._logged_lock:
            logged, self._logged = self._logged, {}
        return {"reward_metrics": {k: sum(v) / len(v) for k, v in sorted(logged.items())}} if logged else {}

    def _weight_update_s(self) -> float | None:
        if self.weights is None:
            return None
        seconds, self._update_seconds = self.weights.update_seconds - self._update_seconds, self.weights.update_seconds
        return round(seconds, 4)

    def close(self) -> None:
        """Close the file."""
        if self._fh is not None:
            self._fh.close()
            self._fh = None
