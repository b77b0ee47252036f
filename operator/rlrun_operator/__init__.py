"""The rlrun Kubernetes operator (kopf): reconciles ``RLRun`` objects into pods.

The package is importable as ``rlrun_operator`` — never as ``operator``, which would
shadow Python's standard library. Reconcile handlers arrive with the operator issue;
for now the package exposes the API group and version the CRD will use, so both sides
agree on them from the start.
"""

from rlrun.spec import API_GROUP, API_VERSION, KIND

__all__ = ["API_GROUP", "API_VERSION", "KIND"]
