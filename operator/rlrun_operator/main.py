"""``rlrun operator``: run the kopf operator with a liveness endpoint and Prometheus metrics.

One replica only: kopf peering is off (``standalone``), so two operators would both act
on every RLRun. The Helm chart runs one, with ``strategy: Recreate``.
"""

from __future__ import annotations

import asyncio
import logging

import kopf
import prometheus_client


class _QuietTimer(logging.Filter):
    """Drops kopf's "Timer 'poll_status' succeeded." line, logged for every run at every tick."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno <= logging.INFO and str(record.msg).startswith("Timer 'poll_status' succeeded"))


def run_operator(
    namespaces: list[str],
    health_port: int | None = 8080,
    metrics_port: int | None = 9090,
    log_level: str = "info",
) -> None:
    """Serve until SIGTERM/SIGINT.

    Args:
        namespaces: namespaces to watch; empty: all namespaces (cluster-wide).
        health_port: port of ``GET /healthz`` (kopf's liveness probe); None: no endpoint.
        metrics_port: port of the Prometheus ``/metrics`` endpoint; None: no endpoint.
        log_level: debug, info, warning or error.
    """
    logging.basicConfig(
        level=getattr(logging, log_level.upper()),
        format="%(asctime)s operator %(levelname)s %(name)s: %(message)s",
        force=True,
    )
    # Every status poll is an HTTP request and a timer run: at INFO they would drown what matters.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("kopf.objects").addFilter(_QuietTimer())
    if metrics_port is not None:
        prometheus_client.start_http_server(metrics_port)
    import rlrun_operator.handlers  # noqa: F401 - registers the handlers with kopf

    liveness = f"http://0.0.0.0:{health_port}/healthz" if health_port is not None else None
    asyncio.run(
        kopf.operator(
            clusterwide=not namespaces,
            namespaces=namespaces,
            standalone=True,
            liveness_endpoint=liveness,
        )
    )
