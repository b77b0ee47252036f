"""What the API server checks and sets on a write before it stores anything (pure: no store, no resourceVersion).

Creates get a name (``generateName``), a uid, a creation timestamp and generation 1; updates
keep what only the server may change (name, namespace, uid, timestamps, generation,
resourceVersion) and, with a status subresource, change either ``status`` or everything
else, never both. Schema defaults, pruning and validation are :mod:`.schema`'s.
"""

from __future__ import annotations

import copy
import dataclasses
import random
import re
import uuid
from collections.abc import Callable
from typing import Any

from .errors import ApiError
from .resources import ResourceSpec
from .timestamps import now

_NAME_CHARS = "bcdfghjklmnpqrstvwxz2456789"  # the API server's generateName alphabet (no vowels, no 0/1/3)
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
#: Metadata only the server sets: an update keeps the stored values.
_SERVER_METADATA = (
    "name",
    "namespace",
    "uid",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "generation",
    "resourceVersion",
)


@dataclasses.dataclass(frozen=True)
class WriteOptions:
    """A write's query options (``?dryRun``, ``?fieldValidation``)."""

    dry_run: bool = False
    field_validation: str = "Warn"  # Ignore | Warn | Strict: what to do about pruned (unknown) fields


DEFAULT_WRITE = WriteOptions()


def _check_body(spec: ResourceSpec, body: Any) -> None:
    if not isinstance(body, dict) or not isinstance(body.get("metadata", {}), dict):
        raise ApiError(400, "BadRequest", f"the body of a {spec.kind} must be a JSON object with object metadata")


def new_object(
    spec: ResourceSpec,
    namespace: str | None,
    body: Any,
    *,
    keep_status: bool,
    exists: Callable[[str | None, str], bool],
) -> dict[str, Any]:
    """The object a ``POST`` of ``body`` creates, before schema admission and its resourceVersion.

    Args:
        namespace: the URL's namespace; None: the body's (``default`` when it has none).
        keep_status: keep ``status`` even where the status subresource would drop it (test set-up).
        exists: whether an object ``(namespace, name)`` is stored (for ``generateName`` and AlreadyExists).

    Raises:
        ApiError: 400 for a body that is no object or a kind/namespace mismatch, 409 AlreadyExists,
            422 for a missing/invalid name.
    """
    _check_body(spec, body)
    obj = copy.deepcopy(body)
    meta = obj.setdefault("metadata", {})
    if obj.get("kind") not in (None, spec.kind):
        raise ApiError(400, "BadRequest", f"the kind {obj['kind']!r} does not match the resource {spec.qualified}")
    obj["apiVersion"], obj["kind"] = spec.api_version, spec.kind
    if spec.namespaced:
        if namespace and meta.get("namespace") not in (None, "", namespace):
            message = "the namespace of the provided object does not match the namespace sent on the request"
            raise ApiError(400, "BadRequest", message)
        meta["namespace"] = namespace or meta.get("namespace") or "default"
    else:
        meta.pop("namespace", None)
    if not meta.get("name") and meta.get("generateName"):
        while True:
            meta["name"] = meta["generateName"] + "".join(random.choices(_NAME_CHARS, k=5))
            if not exists(meta.get("namespace"), meta["name"]):
                break
    name = meta.get("name")
    if not name:
        raise ApiError.invalid(spec.kind, "", "metadata.name", "name or generateName is required", spec.group)
    if len(name) > 253 or not _DNS_SUBDOMAIN.match(name):
        message = (
            f'"{name}": a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, "-" or "."'
        )
        raise ApiError.invalid(spec.kind, name, "metadata.name", message, spec.group)
    if exists(meta.get("namespace"), name):
        details = {"name": name, "group": spec.group, "kind": spec.plural}
        raise ApiError(409, "AlreadyExists", f'{spec.qualified} "{name}" already exists', details)
    if spec.status_subresource and not keep_status:
        obj.pop("status", None)
    for server_field in ("deletionTimestamp", "deletionGracePeriodSeconds", "resourceVersion", "managedFields"):
        meta.pop(server_field, None)
    meta |= {"uid": str(uuid.uuid4()), "creationTimestamp": now(), "generation": 1}
    return obj


def check_replace(spec: ResourceSpec, current: dict[str, Any], name: str, body: Any) -> None:
    """Check a ``PUT`` body against the stored object.

    Raises:
        ApiError: 400 for a body that is no object or names another object, 409 for a stale
            ``metadata.resourceVersion`` (none: last write wins).
    """
    _check_body(spec, body)
    meta = body.get("metadata") or {}
    if meta.get("name") not in (None, name):
        raise ApiError(400, "BadRequest", f"the name of the object ({meta['name']}) does not match the URL ({name})")
    if meta.get("resourceVersion") not in (None, "", current["metadata"]["resourceVersion"]):
        raise ApiError.conflict(spec, name)


def updated_object(
    spec: ResourceSpec, current: dict[str, Any], new: dict[str, Any], subresource: str | None
) -> dict[str, Any]:
    """``new`` (a replaced or patched copy of ``current``) limited to what an update may change.

    Through the ``status`` subresource only ``status`` changes; through the main resource of a
    kind with that subresource, everything but ``status``. Server-set metadata is ``current``'s.
    """
    if subresource == "status":  # only .status changes through the status subresource
        status = new.get("status")
        new = copy.deepcopy(current)
        new.pop("status", None)
        if status is not None:
            new["status"] = status
    elif spec.status_subresource:  # ... and never through the main resource
        new.pop("status", None)
        if "status" in current:
            new["status"] = copy.deepcopy(current["status"])
    meta = new.get("metadata")
    if not isinstance(meta, dict):
        meta = new["metadata"] = {}
    old_meta = current["metadata"]
    for key in _SERVER_METADATA:
        meta.pop(key, None)
        if key in old_meta:
            meta[key] = old_meta[key]
    new["apiVersion"], new["kind"] = spec.api_version, spec.kind
    return new


def changes_generation(current: dict[str, Any], new: dict[str, Any]) -> bool:
    """``metadata.generation`` counts changes outside ``metadata`` and ``status`` (what a controller must act on)."""

    def outside(obj: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in obj.items() if k not in ("metadata", "status")}

    return outside(new) != outside(current)


def check_preconditions(spec: ResourceSpec, current: dict[str, Any], options: Any) -> None:
    """Check a ``DELETE``'s ``preconditions`` (uid, resourceVersion) against the stored object.

    Raises:
        ApiError: 409 when one does not hold.
    """
    pre = (options.get("preconditions") if isinstance(options, dict) else None) or {}
    meta = current["metadata"]
    if pre.get("uid") not in (None, meta["uid"]) or pre.get("resourceVersion") not in (None, meta["resourceVersion"]):
        raise ApiError.conflict(spec, meta["name"])
