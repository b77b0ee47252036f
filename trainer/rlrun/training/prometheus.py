"""The trainer's Prometheus metrics and health: ``GET /metrics`` and ``GET /healthz`` on ``$RLRUN_METRICS_PORT``.

Rank 0 serves them (in a daemon thread: the WSGI server of the standard library with ``prometheus_client``'s
exposition) when the variable is set — ``rlrun local`` sets it to a free port and prints the address; on
Kubernetes the pod sets it. Each trained step updates the gauges from the step's metrics (the
``trainer_metrics.jsonl`` line): :data:`METRICS` lists them, with units; ``docs/observability.md`` is checked
against it. ``/healthz`` answers ``ok`` while the process runs.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, make_wsgi_app

from rlrun.roles import METRICS_PORT_ENV

log = logging.getLogger(__name__)

#: The variable naming the port (unset or empty: no server).
PORT_VARIABLE = METRICS_PORT_ENV

#: name (without a counter's ``_total``) → (``gauge`` or ``counter``, help, the step metric it is read from).
METRICS: dict[str, tuple[str, str, str | None]] = {
    "rlrun_trainer_step": ("gauge", "The last step trained.", "step"),
    "rlrun_trainer_steps": ("counter", "Steps trained by this process.", None),
    "rlrun_trainer_loss": ("gauge", "The last step's loss.", "loss"),
    "rlrun_trainer_grad_norm": ("gauge", "The last step's gradient norm, before clipping.", "grad_norm"),
    "rlrun_trainer_learning_rate": ("gauge", "The learning rate the last step trained with (the LR schedule's).", "lr"),
    "rlrun_trainer_entropy_nats": ("gauge", "Mean next-token entropy over the trained tokens, nats.", "entropy"),
    "rlrun_trainer_mismatch_kl_nats": (
        "gauge",
        "Mean KL(vLLM || trainer) over the trained tokens (k3), nats: ~0 unless weights or tokens differ.",
        "mismatch_kl",
    ),
    "rlrun_trainer_mismatch_kl_on_policy_nats": (
        "gauge",
        "The same over the samples of the weights the trainer holds, nats.",
        "mismatch_kl_on_policy",
    ),
    "rlrun_trainer_clip_ratio": ("gauge", "Share of trained tokens whose ratio was clipped.", "clip_fraction"),
    "rlrun_trainer_dual_clip_ratio": (
        "gauge",
        "Share of trained tokens the dual clip bound (loss.dual_clip set).",
        "dual_clip_fraction",
    ),
    "rlrun_trainer_is_truncated_ratio": (
        "gauge",
        "Share of trained tokens whose sampler-to-trainer weight was capped (importance_correction truncate).",
        "is_truncated_fraction",
    ),
    "rlrun_trainer_is_masked_ratio": (
        "gauge",
        "Share of trained tokens dropped by the mismatch mask (importance_correction mask).",
        "is_masked_fraction",
    ),
    "rlrun_trainer_kl_ref_nats": (
        "gauge",
        "Mean KL estimate to the reference policy over the trained tokens, nats (loss.kl_coef > 0).",
        "kl_ref",
    ),
    "rlrun_trainer_tokens": ("gauge", "Tokens trained in the last step.", "tokens"),
    "rlrun_trainer_padding_share": (
        "gauge",
        "Share of the last step's micro-batch token slots that were padding.",
        "padding_share",
    ),
    "rlrun_trainer_tokens_per_second": ("gauge", "Tokens trained per second of the last step's compute.", None),
    "rlrun_trainer_step_seconds": ("gauge", "The last step's compute time (after its batch arrived).", "train_s"),
    "rlrun_trainer_batch_wait_seconds": ("gauge", "Time the last step waited for its batch.", "wait_s"),
    "rlrun_trainer_broadcast_seconds": (
        "gauge",
        "Time the last step's weights took to publish for the rollout servers.",
        "broadcast_s",
    ),
    "rlrun_trainer_broadcast_bytes": (
        "gauge",
        "Bytes the last step's weights took to publish (the adapter alone with LoRA).",
        "broadcast_bytes",
    ),
    "rlrun_trainer_checkpoint_seconds": ("gauge", "Time the last trainer checkpoint took to write.", "checkpoint_s"),
}


class TrainerMetrics:
    """The trainer's gauges and counters in a registry of their own (tests run several trainers)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._metrics: dict[str, Gauge | Counter] = {}
        for name, (kind, text, _) in METRICS.items():
            cls = Counter if kind == "counter" else Gauge
            self._metrics[name] = cls(name, text, registry=self.registry)

    def observe(self, step: dict[str, Any]) -> None:
        """Update from one trained step's metrics (:meth:`rlrun.training.trainer.Trainer.train_step`)."""
        for name, (_, _, key) in METRICS.items():
            if key is not None and step.get(key) is not None:
                self._metrics[name].set(float(step[key]))  # type: ignore[union-attr]
        self._metrics["rlrun_trainer_steps"].inc()
        if step.get("train_s"):
            self._metrics["rlrun_trainer_tokens_per_second"].set(step["tokens"] / step["train_s"])  # type: ignore[union-attr]


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # the base class names it `format`
        pass


def serve(metrics: TrainerMetrics, port: int, host: str = "0.0.0.0") -> WSGIServer:
    """Serve ``/metrics`` and ``/healthz`` on ``host:port`` (0: any free port) in a daemon thread; returns the
    server (``server.server_port``: the bound port; ``shutdown()`` stops it)."""
    exposition = make_wsgi_app(metrics.registry)

    def app(environ: dict, start_response: Any) -> Any:
        if environ.get("PATH_INFO") == "/healthz":
            start_response("200 OK", [("Content-Type", "text/plain")])
            return [b"ok\n"]
        return exposition(environ, start_response)

    server = make_server(host, port, app, handler_class=_Quiet)
    threading.Thread(target=server.serve_forever, name="trainer-metrics", daemon=True).start()
    log.info("trainer metrics on http://%s:%d/metrics", host, server.server_port)
    return server


def serve_from_env(metrics: TrainerMetrics) -> WSGIServer | None:
    """:func:`serve` on ``$RLRUN_METRICS_PORT`` when it is set (None otherwise, or when the port cannot be bound:
    metrics are not worth a training run, so that is a warning — e.g. the previous trainer of a pod being replaced
    still holds it).

    Raises:
        ValueError: the variable is not a port number.
    """
    value = os.environ.get(PORT_VARIABLE, "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) > 65535:
        raise ValueError(f"${PORT_VARIABLE} must be a port number, got {value!r}")
    try:
        return serve(metrics, int(value))
    except OSError as exc:
        log.warning("trainer metrics not served: port %s: %s", value, exc)
        return None
