"""The spec a run goes on with: the RLRun's own when valid, else the last valid one this process parsed.

An invalid change to a run that exists is ignored with a Warning Event: the run goes on
with its previous spec, which :class:`SpecMemory` remembers per run. An operator restarted
since that change knows no previous spec: :meth:`SpecMemory.in_force` then posts a Warning
Event (``InvalidSpec``, once per change) saying to fix the spec and raises ``kopf.TemporaryError`` (retried
every 60 s), leaving the run as it is until the spec is valid again. (Guessing would be
worse: the raw spec's values are the invalid change, and the ConfigMap's copy of the last
valid spec would cost a ``get`` on ConfigMaps the operator has no other use for.)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import kopf
from rlrun.api.spec import API_GROUP, API_VERSION, KIND, RLRun
from rlrun.api.status import EventReason
from rlrun.manifest import ManifestError, parse_manifest

#: Seconds between retries while a run's spec is invalid and no valid one is known.
UNKNOWN_SPEC_RETRY_SECONDS = 60


class _ValidSpec(NamedTuple):
    """A run's spec as last parsed valid, and the ``metadata.generation`` it had."""

    generation: int
    run: RLRun


class SpecMemory:
    """The last valid spec of each run, by ``(namespace, name)``."""

    def __init__(self) -> None:
        self._valid: dict[tuple[str, str], _ValidSpec] = {}
        self._warned: set[tuple[str, str, int]] = set()  # (namespace, name, generation) asked to fix once

    def forget(self, namespace: str, name: str) -> None:
        """Drop what is known of a deleted run."""
        self._valid.pop((namespace, name), None)
        self._warned = {w for w in self._warned if w[:2] != (namespace, name)}

    def parse(self, body: dict[str, Any], spec: dict[str, Any] | None = None) -> RLRun:
        """The RLRun ``body`` (with ``spec`` instead of its own, if given) as the model; a valid one is remembered.

        Raises:
            ManifestError: the spec is invalid (one line per field, as ``rlrun validate`` prints).
        """
        meta = body["metadata"]
        run = parse_manifest(
            {
                "apiVersion": f"{API_GROUP}/{API_VERSION}",
                "kind": KIND,
                "metadata": {"name": meta["name"], "namespace": meta.get("namespace")},
                "spec": dict(body.get("spec") or {}) if spec is None else dict(spec),
            },
            source=f"{meta.get('namespace')}/{meta['name']}",
            checks="static",  # the user's env packages and data are in the orchestrator pod, not here
        )
        if spec is None:
            key, generation = (meta["namespace"], meta["name"]), meta.get("generation") or 0
            known = self._valid.get(key)
            if known is None or generation >= known.generation:  # a handler may hold an older body than another
                self._valid[key] = _ValidSpec(generation, run)
        return run

    def in_force(self, body: dict[str, Any]) -> RLRun:
        """The spec the run goes on with: the body's when valid, else the last valid one parsed.

        Raises:
            kopf.TemporaryError: the body's spec is invalid and no valid one is known (the operator
                restarted since the invalid change); a Warning Event (``InvalidSpec``) says to fix the
                spec, and the caller is retried after :data:`UNKNOWN_SPEC_RETRY_SECONDS`.
        """
        meta = body["metadata"]
        known = self._valid.get((meta["namespace"], meta["name"]))
        if known is not None and known.generation == (meta.get("generation") or 0):
            return known.run
        try:
            return self.parse(body)
        except ManifestError as exc:
            if known is not None:
                return known.run
            message = (
                f"the spec is invalid ({'; '.join(exc.errors)}) and the operator knows no earlier valid spec of this "
                "run (it restarted since the change): fix the spec; until then the run's status is not updated"
            )
            warned = (meta["namespace"], meta["name"], meta.get("generation") or 0)
            if warned not in self._warned:  # once per change, however many handlers ask
                self._warned.add(warned)
                kopf.event(body, type="Warning", reason=EventReason.INVALID_SPEC, message=message)
            raise kopf.TemporaryError(message, delay=UNKNOWN_SPEC_RETRY_SECONDS) from None
