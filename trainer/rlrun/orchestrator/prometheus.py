"""The orchestrator's Prometheus metrics: ``GET /metrics`` on the control server (:mod:`.control`).

Read off a view of the orchestrator (:mod:`.view`) built when scraped, by a custom collector (``prometheus_client``'s
``Collector``): nothing is counted on the event loop between scrapes, so the metrics cost the loop nothing
but the scrape itself (a few hundred microseconds for these ~25 series). Names follow Prometheus'
conventions: the ``rlrun_`` prefix, base units (seconds), ``_total`` for counters, ``_ratio`` for shares;
:data:`METRICS` lists every one with its meaning, and ``docs/observability.md`` is checked against it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from rlrun.orchestrator.view import OrchestratorView

#: name (without a counter's ``_total``) → (``gauge`` or ``counter``, help). Gauges named after ``metrics.jsonl`` keys
#: hold the last shipped step's value (absent before the first step).
METRICS: dict[str, tuple[str, str]] = {
    "rlrun_step": ("gauge", "Batches shipped to the trainer."),
    "rlrun_max_steps": ("gauge", "The step the run ends at."),
    "rlrun_policy_version": ("gauge", "Policy version (trainer steps) the rollout servers hold."),
    "rlrun_attempt": ("gauge", "This orchestrator's attempt number."),
    "rlrun_last_checkpoint_step": ("gauge", "Newest complete checkpoint (-1: none yet)."),
    "rlrun_queue_samples": ("gauge", "Scored samples queued for a batch."),
    "rlrun_open_groups": ("gauge", "Groups with members finished and others still to come."),
    "rlrun_inflight_completions": ("gauge", "Completions requested from rollout servers and not yet returned."),
    "rlrun_requested_groups": ("gauge", "Requests waiting to be dispatched (resume requests)."),
    "rlrun_conversations_kept": ("gauge", "Multi-turn episodes kept at a durable turn."),
    "rlrun_episodes_finished": ("counter", "Episodes finished (scored or abandoned) in this attempt."),
    "rlrun_samples_dropped_stale": ("counter", "Queued samples dropped as too old to train (max_off_policy_steps)."),
    "rlrun_groups_abandoned": (
        "counter",
        "Groups given up (nothing left could train, or their requests kept failing).",
    ),
    "rlrun_groups_rejected": ("counter", "Groups scored and not trained (zero reward spread, too few fresh members)."),
    "rlrun_completion_tokens": ("counter", "Completion tokens of the episodes finished (generated), over the run."),
    "rlrun_completion_tokens_zero_spread_solved": (
        "counter",
        "Of them, in groups rejected for zero reward spread that every member solved.",
    ),
    "rlrun_completion_tokens_zero_spread_unsolved": (
        "counter",
        "Of them, in groups rejected for zero reward spread that not every member solved.",
    ),
    "rlrun_completion_tokens_trained": ("counter", "Completion tokens of the samples shipped to the trainer."),
    "rlrun_tasks_skipped": ("counter", "Tasks the curriculum passed over (spec.curriculum), over the run."),
    "rlrun_requests_cancelled": ("counter", "Rollout requests cancelled (stale, failed, lost)."),
    "rlrun_episodes_reward_failed": ("counter", "Members whose reward raised, timed out or was no number."),
    "rlrun_journal_records": ("counter", "Records appended to this attempt's episode journal."),
    "rlrun_journal_fsyncs": ("counter", "Group commits (fdatasync) of the episode journal."),
    "rlrun_journal_bytes": ("counter", "Bytes written to the episode journal."),
    "rlrun_checkpoint_write_seconds": ("gauge", "Time to pack and write the last orchestrator checkpoint part."),
    "rlrun_pause_seconds": ("gauge", "Time the last pause took to write its snapshot."),
    "rlrun_weight_update_seconds": (
        "gauge",
        "Time the last weight update took: validation, then every server's pause, reload and resume.",
    ),
    "rlrun_served_mismatch_kl_nats": (
        "gauge",
        "Trainer-sampler mismatch of the newest policy probed on the rollout servers, nats/token.",
    ),
    "rlrun_weight_updates_unverified": (
        "counter",
        "Server updates after which the served weights were not the published ones.",
    ),
    "rlrun_weight_transfer_seconds": (
        "counter",
        "Time servers spent taking new weights, by path (filesystem: reload; collective: in memory), verified.",
    ),
    "rlrun_weight_transfer_bytes": ("counter", "Bytes of the weights servers took, by path."),
    "rlrun_weight_transfer_updates": ("counter", "Server weight updates, by the path the weights came by."),
    "rlrun_weight_transfer_fallbacks": (
        "counter",
        "In-memory sends that failed (refused, timed out, digest mismatch) and fell back to the files.",
    ),
    "rlrun_eval_rounds_dropped": (
        "counter",
        "Held-out evaluation rounds dropped: failed, unanswered in time, or their weights moved.",
    ),
    "rlrun_eval_hold_seconds": ("counter", "Time evaluation rounds held the weight pushes."),
    "rlrun_reward_mean": ("gauge", "Mean reward of the episodes scored before the last shipped step."),
    "rlrun_reward_std": ("gauge", "Standard deviation of those rewards."),
    "rlrun_staleness_mean_steps": ("gauge", "Mean off-policy staleness of the last batch, steps."),
    "rlrun_groups_zero_std_ratio": (
        "gauge",
        "Share of the groups scored with zero reward spread (TRL frac_reward_zero_std).",
    ),
    "rlrun_groups_solved_all_ratio": (
        "gauge",
        "Share of the groups scored that every member solved (prime-rl solved_all).",
    ),
    "rlrun_groups_solved_none_ratio": (
        "gauge",
        "Share of the groups scored that every member scored 0 (prime-rl solved_none).",
    ),
    "rlrun_episodes_truncated_ratio": ("gauge", "Share of the episodes scored that stopped at max_tokens."),
    "rlrun_rollout_tokens_per_second": ("gauge", "Completion tokens sampled per second over the last step."),
    "rlrun_step_duration_seconds": ("gauge", "Time between the last two shipped steps."),
    "rlrun_zero_spread_token_ratio": (
        "gauge",
        "Share of the completion tokens generated before the last step spent on zero-spread groups.",
    ),
}

#: The series of :data:`METRICS` with a ``path`` label (``filesystem``, ``collective``), by their field in
#: :class:`~rlrun.orchestrator.weight_transfer.PathTotals`.
_BY_PATH = {
    "rlrun_weight_transfer_seconds": "seconds",
    "rlrun_weight_transfer_bytes": "bytes",
    "rlrun_weight_transfer_updates": "updates",
}

#: The gauges of :data:`METRICS` that come from the last ``metrics.jsonl`` line, by its key.
_LAST_STEP = {
    "rlrun_reward_mean": "reward_mean",
    "rlrun_reward_std": "reward_std",
    "rlrun_staleness_mean_steps": "staleness_mean",
    "rlrun_groups_zero_std_ratio": "frac_reward_zero_std",
    "rlrun_groups_solved_all_ratio": "solved_all",
    "rlrun_groups_solved_none_ratio": "solved_none",
    "rlrun_episodes_truncated_ratio": "truncated_fraction",
    "rlrun_rollout_tokens_per_second": "rollout_tokens_per_s",
    "rlrun_step_duration_seconds": "step_time_s",
    "rlrun_zero_spread_token_ratio": "zero_spread_token_fraction",
}


class OrchestratorCollector:
    """Collects :data:`METRICS` at each scrape off a fresh view of the orchestrator: ``view()`` builds it
    (:meth:`~rlrun.orchestrator.loop.Orchestrator.view`)."""

    def __init__(self, view: Callable[[], OrchestratorView]) -> None:
        self.view = view

    def values(self) -> dict[str, float | dict[str, float] | None]:
        """Each metric's value now (None: not known yet; ``{path: value}`` for a series by path)."""
        v = self.view()
        c, last_write, last_pause = v.counters, v.last_checkpoint, v.last_pause
        line = v.last_step_metrics or {}
        transfer = v.weight_transfer
        out: dict[str, float | dict[str, float] | None] = {
            "rlrun_step": v.step,
            "rlrun_max_steps": v.max_steps,
            "rlrun_policy_version": v.policy_version,
            "rlrun_attempt": v.attempt_number,
            "rlrun_last_checkpoint_step": v.last_checkpoint_step,
            "rlrun_queue_samples": v.queued,
            "rlrun_open_groups": v.open_groups,
            "rlrun_inflight_completions": v.inflight_samples,
            "rlrun_requested_groups": v.requested_groups,
            "rlrun_conversations_kept": v.conversations_kept,
            "rlrun_episodes_finished": c.episodes_finished,
            "rlrun_samples_dropped_stale": c.samples_dropped_stale,
            "rlrun_groups_abandoned": c.groups_abandoned,
            "rlrun_groups_rejected": c.groups_rejected,
            "rlrun_completion_tokens": c.tokens_finished,
            "rlrun_completion_tokens_zero_spread_solved": c.tokens_zero_spread_solved,
            "rlrun_completion_tokens_zero_spread_unsolved": c.tokens_zero_spread_unsolved,
            "rlrun_completion_tokens_trained": c.tokens_shipped,
            "rlrun_tasks_skipped": v.tasks_skipped,
            "rlrun_requests_cancelled": v.requests_cancelled,
            "rlrun_episodes_reward_failed": v.rewards_failed,
            "rlrun_journal_records": v.journal_records,
            "rlrun_journal_fsyncs": v.journal_fsyncs,
            "rlrun_journal_bytes": v.journal_bytes,
            "rlrun_checkpoint_write_seconds": last_write.seconds if last_write is not None else None,
            "rlrun_pause_seconds": (
                last_pause.seconds if last_pause is not None and last_pause.step is not None else None
            ),
            "rlrun_weight_update_seconds": v.weight_update_seconds,
            "rlrun_served_mismatch_kl_nats": v.served_mismatch_kl,
            "rlrun_weight_updates_unverified": v.updates_unverified,
            **{name: {p: t[key] for p, t in transfer.items() if isinstance(t, dict)} for name, key in _BY_PATH.items()},
            "rlrun_weight_transfer_fallbacks": transfer.get("fallbacks", 0),
            "rlrun_eval_rounds_dropped": v.eval_rounds_dropped,
            "rlrun_eval_hold_seconds": v.eval_hold_seconds,
        }
        out.update({name: line.get(key) for name, key in _LAST_STEP.items()})
        return out

    def collect(self) -> Iterator[Metric]:
        """One family per known value (``prometheus_client``'s collector protocol)."""
        for name, value in self.values().items():
            if value is None:
                continue
            kind, text = METRICS[name]
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            if isinstance(value, dict):
                labelled = family(name, text, labels=["path"])
                for path, v in sorted(value.items()):
                    labelled.add_metric([path], float(v))
                yield labelled
            else:
                yield family(name, text, value=float(value))


def registry_for(view: Callable[[], OrchestratorView]) -> CollectorRegistry:
    """A registry holding the collector of the orchestrator whose ``view()`` it reads, alone (not the
    process-global one: tests run several)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(OrchestratorCollector(view))
    return registry


def exposition(registry: CollectorRegistry) -> bytes:
    """The text format Prometheus scrapes (``CONTENT_TYPE_LATEST``)."""
    return generate_latest(registry)
