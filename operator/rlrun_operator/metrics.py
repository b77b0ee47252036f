"""Prometheus metrics of the operator (served by ``rlrun operator --metrics-port``).

| metric | type | labels |
|---|---|---|
| ``rlrun_operator_reconciles_total`` | counter | ``handler`` |
| ``rlrun_operator_reconcile_errors_total`` | counter | ``handler`` |
| ``rlrun_operator_reconcile_seconds`` | histogram | ``handler`` |
| ``rlrun_operator_endpoint_updates_total`` | counter | — |
| ``rlrun_operator_runs`` | gauge | ``phase`` (every phase, 0 included) |
| ``rlrun_operator_recoveries_total`` | counter | ``kind`` (preemption, suspension, failure), ``trigger`` |
| ``rlrun_operator_pause_seconds`` | histogram | ``outcome`` (paused, failed): ``POST /pause`` sent → answered |
| ``rlrun_operator_recovery_seconds`` | histogram | ``scope`` (attempt, rollout, trainer)¹ |

¹ Trigger seen → the restore confirmed (rollout: replacement created; trainer: replacement running).
"""

from __future__ import annotations

import contextlib
import time

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from rlrun.api.status import PHASES


class OperatorMetrics:
    """The operator's metrics in one registry (tests make their own; the operator uses the default)."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.registry = registry
        self.reconciles = Counter(
            "rlrun_operator_reconciles_total", "Handler invocations", ["handler"], registry=registry
        )
        self.errors = Counter(
            "rlrun_operator_reconcile_errors_total", "Handler invocations that raised", ["handler"], registry=registry
        )
        self.seconds = Histogram(
            "rlrun_operator_reconcile_seconds", "Handler duration, seconds", ["handler"], registry=registry
        )
        self.endpoint_updates = Counter(
            "rlrun_operator_endpoint_updates_total", "PUT /rollout-endpoints sent to orchestrators", registry=registry
        )
        self.recoveries = Counter(
            "rlrun_operator_recoveries_total",
            "Recoveries started, by kind and trigger",
            ["kind", "trigger"],
            registry=registry,
        )
        buckets = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
        self.pause_seconds = Histogram(
            "rlrun_operator_pause_seconds",
            "POST /pause sent to answered, seconds",
            ["outcome"],
            buckets=buckets,
            registry=registry,
        )
        self.recovery_seconds = Histogram(
            "rlrun_operator_recovery_seconds",
            "Trigger seen to recovery done, seconds",
            ["scope"],
            buckets=buckets,
            registry=registry,
        )
        self.runs = Gauge("rlrun_operator_runs", "RLRuns by phase", ["phase"], registry=registry)
        self._phases: dict[tuple[str, str], str] = {}
        for phase in PHASES:
            self.runs.labels(phase).set(0)

    @contextlib.contextmanager
    def track(self, handler: str):
        """Count one invocation of ``handler``, its duration, and whether it raised."""
        self.reconciles.labels(handler).inc()
        t0 = time.perf_counter()
        try:
            yield
        except Exception:
            self.errors.labels(handler).inc()
            raise
        finally:
            self.seconds.labels(handler).observe(time.perf_counter() - t0)

    def set_phase(self, namespace: str, name: str, phase: str | None) -> None:
        """Record a run's phase (None: the run is gone) and refresh the per-phase gauge."""
        key = (namespace, name)
        if phase is None:
            self._phases.pop(key, None)
        else:
            self._phases[key] = phase
        counts = dict.fromkeys(PHASES, 0)
        for p in self._phases.values():
            counts[p] = counts.get(p, 0) + 1
        for p, c in counts.items():
            self.runs.labels(p).set(c)
