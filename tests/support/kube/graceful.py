"""Graceful deletion of pods, as the API server does it (pure: the store writes the result).

The rules are kube-apiserver's (``podStrategy.CheckGracefulDelete``, ``rest.BeforeDelete``,
``Store.Delete``, ``ShouldDeleteDuringUpdate``):

- The grace period of a first ``DELETE`` is the request's ``gracePeriodSeconds``, else the pod's
  ``spec.terminationGracePeriodSeconds``, else 30 (the API server defaults that field on create;
  the emulator does not default builtin kinds, so the default is applied here). A negative
  request counts as 1.
- It is 0 for a pod that is not scheduled (no ``spec.nodeName``: nothing runs that needs time
  to stop) or already terminal (``status.phase`` ``Succeeded`` or ``Failed``).
- Grace > 0: ``deletionTimestamp`` = now + grace (RFC 3339, whole seconds),
  ``deletionGracePeriodSeconds`` = grace, ``generation`` + 1; the pod stays (``MODIFIED``) until
  the kubelet's grace-0 ``DELETE`` once its containers stopped.
- Grace 0: the pod is removed at once (its ``DELETED`` state carries the grace-0 mark:
  ``deletionTimestamp``, ``deletionGracePeriodSeconds: 0``); with finalizers it is marked
  (``deletionTimestamp`` now, grace 0) and removed when the last finalizer goes, like any object.
- A pending graceful deletion can only be shortened: a ``DELETE`` with a shorter
  ``gracePeriodSeconds`` moves ``deletionTimestamp`` back by the difference and sets the new
  grace (0 removes the pod unless it has finalizers); none, or an equal or longer one, changes
  nothing. Removing the last finalizer of a pod still in its grace period does not remove it.

Which ``DeleteOptions`` count: the request body when it has one, else the query parameters
(``?gracePeriodSeconds=``), as the API server decodes them.
"""

from __future__ import annotations

import copy
import datetime
from typing import Any

from .errors import ApiError
from .timestamps import FORMAT, parse

#: The API server's default ``spec.terminationGracePeriodSeconds``.
DEFAULT_GRACE_SECONDS = 30
TERMINAL_PHASES = ("Succeeded", "Failed")


def options_from_query(query: Any) -> dict[str, Any]:
    """The ``DeleteOptions`` a bodiless ``DELETE`` carries in its query (only ``gracePeriodSeconds`` matters here).

    Raises:
        ApiError: 400 for a ``gracePeriodSeconds`` that is not an integer.
    """
    raw = query.get("gracePeriodSeconds")
    if raw is None:
        return {}
    try:
        return {"gracePeriodSeconds": int(raw)}
    except ValueError:
        raise ApiError(400, "BadRequest", f"gracePeriodSeconds: invalid integer {raw!r}") from None


def requested_grace(options: Any) -> int | None:
    """``options.gracePeriodSeconds`` (negative: 1), or None when the request names none.

    Raises:
        ApiError: 400 for a value that is not an integer.
    """
    value = options.get("gracePeriodSeconds") if isinstance(options, dict) else None
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, "BadRequest", f"gracePeriodSeconds must be an integer, not {value!r}")
    return 1 if value < 0 else value


def effective_grace(pod: dict[str, Any], requested: int | None) -> int:
    """The grace period a first ``DELETE`` gives ``pod`` (``CheckGracefulDelete``)."""
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    if not spec.get("nodeName") or status.get("phase") in TERMINAL_PHASES:
        return 0
    if requested is not None:
        return requested
    grace = spec.get("terminationGracePeriodSeconds")
    if grace is None:
        return DEFAULT_GRACE_SECONDS
    return 1 if int(grace) < 0 else int(grace)


def pod_deletion(pod: dict[str, Any], options: Any, now: datetime.datetime) -> dict[str, Any] | None:
    """The pod as a ``DELETE`` with ``options`` at ``now`` leaves it, or None when nothing changes.

    The store removes a returned pod whose ``deletionGracePeriodSeconds`` is 0 and that has no
    finalizers, and stores (``MODIFIED``) any other.
    """
    requested = requested_grace(options)
    meta = pod["metadata"]
    marked = copy.deepcopy(pod)
    new_meta = marked["metadata"]
    if meta.get("deletionTimestamp"):
        pending = meta.get("deletionGracePeriodSeconds") or 0
        if not pending:  # grace 0 already: held by finalizers, else removed now
            return None if meta.get("finalizers") else marked
        if requested is None or requested >= pending:
            return None  # only a shorter grace period may be asked for
        moved = parse(meta["deletionTimestamp"]) - datetime.timedelta(seconds=pending - requested)
        new_meta |= {"deletionTimestamp": moved.strftime(FORMAT), "deletionGracePeriodSeconds": requested}
        return marked
    grace = effective_grace(pod, requested)
    deadline = now + datetime.timedelta(seconds=grace)
    new_meta |= {"deletionTimestamp": deadline.strftime(FORMAT), "deletionGracePeriodSeconds": grace}
    if new_meta.get("generation", 0) > 0:
        new_meta["generation"] += 1
    return marked
