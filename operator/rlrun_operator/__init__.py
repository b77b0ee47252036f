"""The rlrun Kubernetes operator (kopf): reconciles ``RLRun`` objects into pods and reports status.

The package is importable as ``rlrun_operator`` — never as ``operator``, which would
shadow Python's standard library. Layout, one job per module:

- :mod:`.settings` — operator configuration from the environment (images, intervals);
- :mod:`.naming` — object names and labels of a run;
- :mod:`.builders` — pure functions: an RLRun in, Kubernetes object dicts out;
- :mod:`.status` — pure functions: conditions and status fields from observations;
- :mod:`.kube` — the few Kubernetes API calls, with retries on transient errors;
- :mod:`.control` — the orchestrator's control-server client (``/status``, ``/pause``, endpoints),
  answers parsed into the contract's models;
- :mod:`.metrics` — Prometheus metrics of the operator;
- :mod:`.handlers` — thin kopf handlers tying these together;
- :mod:`.main` — ``rlrun operator``: run kopf with liveness and metrics endpoints.

What it shares with the rest of rlrun is the API package :mod:`rlrun.api`: the spec and
status models, the words of the status (phases, condition types, reasons), the CRD, and the
typed operator ↔ orchestrator contract. This package re-exports none of it.
"""
