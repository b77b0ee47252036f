"""The rlrun Kubernetes operator (kopf): reconciles ``RLRun`` objects into pods and reports status.

The package is importable as ``rlrun_operator`` — never as ``operator``, which would
shadow Python's standard library. Layout, one job per module (``docs/design.md`` has the map):

- :mod:`.handlers` — thin kopf handlers: Kubernetes events in, the reconciler called;
- :mod:`.reconcile` — the reconciler: per-run gate, fresh read, the decision table;
- :mod:`.run_context` — one run as a reconcile sees it, and every write it makes (the one writer of status);
- :mod:`.stages` — the actions: a run's first start, each stage of a recovery, success;
- :mod:`.recovery`, :mod:`.disruption`, :mod:`.status` — pure: recovery patches, disruption
  classification, status from observations;
- :mod:`.builders`, :mod:`.pods` — pure: an RLRun in, Kubernetes object dicts out;
- :mod:`.specs` — the spec in force;
- :mod:`.kube` — the few Kubernetes API calls, with retries on transient errors;
- :mod:`.control` — one control client per run (:class:`rlrun.api.control_client.ControlClient`);
- :mod:`.settings`, :mod:`.naming`, :mod:`.metrics` — configuration, names and labels, Prometheus;
- :mod:`.main` — ``rlrun operator``: run kopf with liveness and metrics endpoints.

What it shares with the rest of rlrun is the API package :mod:`rlrun.api`: the spec and
status models, the words of the status (phases, condition types, reasons), the CRD, and the
typed operator ↔ orchestrator contract. This package re-exports none of it.
"""
