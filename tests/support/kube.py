"""A Kubernetes API server emulator for tests: kmock's ``KubernetesEmulator`` made strict enough for kopf and kubectl.

Invariant: every write that changes an object gets the next value of one global
``resourceVersion`` counter, and every watcher sees exactly the changes after the version it
asked for, in that order, each once. kopf relies on it to list-then-watch without handling an
object twice and to test-and-patch its finalizers; kubectl relies on it for ``get -w`` and
``delete --wait``. Everything else here (uids, generations, the status subresource, selectors,
discovery, finalizers, schema validation, the request log) follows the real API server closely
enough that an operator tested against it behaves the same against a cluster.

Known differences from a real API server: strategic-merge patches are plain merge patches
(lists are replaced, not merged by key); server-side apply is not served (415); CEL rules
(``x-kubernetes-validations``) are not evaluated; builtin kinds are not validated; namespaces
need not exist; pods are removed at once whatever their grace period; garbage collection of
``ownerReferences`` runs synchronously with the owner's removal. For kubectl: there is no
``/openapi`` (use ``--validate=false``), no server-side printing (``get`` shows NAME and AGE),
and protobuf bodies (``kubectl create namespace|secret|configmap``) get 415 (use ``apply -f``).

``KubeServer`` runs one emulator on 127.0.0.1 in its own thread and event loop, so tests,
operators in other threads, kubectl subprocesses and the sync ``kubernetes`` client can all
reach it; ``KopfThread`` runs a kopf operator against it in a thread of its own.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import copy
import dataclasses
import datetime
import json
import logging
import random
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import aiohttp.web
import attrs
import kmock
import yaml
from kmock._internal import apps, rendering

log = logging.getLogger(__name__)

#: The version reported by ``/version`` (kubectl warns when its own is more than one minor apart).
SERVER_VERSION = {"major": "1", "minor": "37", "gitVersion": "v1.37.0-emulator", "platform": "linux/amd64"}
#: RBAC verbs of a resource (the subresource ``status`` gets get/patch/update).
RESOURCE_VERBS = ("create", "delete", "deletecollection", "get", "list", "patch", "update", "watch")
_NAME_CHARS = "bcdfghjklmnpqrstvwxz2456789"  # the API server's generateName alphabet (no vowels, no 0/1/3)
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


# --- resources ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class ResourceSpec:
    """One served resource (one group/version/plural) and how the emulator treats it.

    Attributes:
        schema: the CRD version's ``openAPIV3Schema``; when set, created and updated objects get
            its defaults, lose unknown fields (pruning) and are validated against it (422 on failure).
        storage_version: the version objects are stored under (for CRDs serving several versions:
            all served versions share one store; only ``apiVersion`` differs, as with conversion
            strategy ``None``). Empty: this version.
    """

    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    singular: str = ""
    short_names: tuple[str, ...] = ()
    categories: tuple[str, ...] = ()
    status_subresource: bool = False
    schema: dict[str, Any] | None = None
    storage_version: str = ""
    printer_columns: tuple[dict[str, Any], ...] = ()

    @property
    def api_version(self) -> str:
        """``apiVersion`` of the objects: ``v1`` for the core group, else ``group/version``."""
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def store(self) -> kmock.resource:
        """The key objects are stored under in ``KubeEmulator.objects`` (group, storage version, plural)."""
        return kmock.resource(self.group, self.storage_version or self.version, self.plural)

    @property
    def qualified(self) -> str:
        """``plural.group`` (``pods`` for the core group), as in API error messages."""
        return f"{self.plural}.{self.group}" if self.group else self.plural


#: Builtin resources an operator of pods, volumes, secrets and events uses; more via ``add_resource``.
BUILTIN_RESOURCES = (
    ResourceSpec("", "v1", "namespaces", "Namespace", False, "namespace", ("ns",), (), True),
    ResourceSpec("", "v1", "nodes", "Node", False, "node", ("no",), (), True),
    ResourceSpec("", "v1", "pods", "Pod", True, "pod", ("po",), ("all",), True),
    ResourceSpec("", "v1", "services", "Service", True, "service", ("svc",), ("all",), True),
    ResourceSpec(
        "", "v1", "persistentvolumeclaims", "PersistentVolumeClaim", True, "persistentvolumeclaim", ("pvc",), (), True
    ),
    ResourceSpec("", "v1", "secrets", "Secret", True, "secret"),
    ResourceSpec("", "v1", "configmaps", "ConfigMap", True, "configmap", ("cm",)),
    ResourceSpec("", "v1", "serviceaccounts", "ServiceAccount", True, "serviceaccount", ("sa",)),
    ResourceSpec("", "v1", "events", "Event", True, "event", ("ev",)),
    ResourceSpec("events.k8s.io", "v1", "events", "Event", True, "event", ("ev",)),
    ResourceSpec(
        "apiextensions.k8s.io",
        "v1",
        "customresourcedefinitions",
        "CustomResourceDefinition",
        False,
        "customresourcedefinition",
        ("crd", "crds"),
        (),
        True,
    ),
)


def crd_resources(crd: dict[str, Any]) -> list[ResourceSpec]:
    """The resources an ``apiextensions.k8s.io/v1`` CRD object serves, one per served version.

    Raises:
        ApiError: 422 when the CRD lacks group/names/versions or its name is not ``plural.group``.
    """
    spec = crd.get("spec") or {}
    names = spec.get("names") or {}
    group, plural, kind = spec.get("group"), names.get("plural"), names.get("kind")
    versions = [v for v in spec.get("versions") or [] if v.get("served", True)]
    name = (crd.get("metadata") or {}).get("name")
    if not (group and plural and kind and versions):
        raise ApiError.invalid(
            "CustomResourceDefinition", name, "spec", "group, names.plural/kind and versions are required"
        )
    if name != f"{plural}.{group}":
        raise ApiError.invalid(
            "CustomResourceDefinition",
            name,
            "metadata.name",
            f"must be spec.names.plural+'.'+spec.group: {plural}.{group}",
        )
    storage = next((v["name"] for v in versions if v.get("storage")), versions[0]["name"])
    return [
        ResourceSpec(
            group=group,
            version=v["name"],
            plural=plural,
            kind=kind,
            namespaced=spec.get("scope", "Namespaced") == "Namespaced",
            singular=names.get("singular") or kind.lower(),
            short_names=tuple(names.get("shortNames") or ()),
            categories=tuple(names.get("categories") or ()),
            status_subresource="status" in (v.get("subresources") or {}),
            schema=(v.get("schema") or {}).get("openAPIV3Schema"),
            storage_version=storage,
            printer_columns=tuple(v.get("additionalPrinterColumns") or ()),
        )
        for v in versions
    ]


def load_crds(directory: str | Path) -> list[dict[str, Any]]:
    """Every ``CustomResourceDefinition`` document in the ``*.yaml`` files of ``directory`` (sorted by file name)."""
    docs = []
    for path in sorted(Path(directory).glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if isinstance(doc, dict) and doc.get("kind") == "CustomResourceDefinition":
                docs.append(doc)
    return docs


# --- errors ---------------------------------------------------------------------------------------


class ApiError(Exception):
    """A failed API call, answered as a Kubernetes ``Status`` with this HTTP code and reason."""

    def __init__(self, code: int, reason: str, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(f"{code} {reason}: {message}")
        self.code, self.reason, self.message, self.details = code, reason, message, details or {}

    def status(self) -> dict[str, Any]:
        """The ``Status`` body."""
        body = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure"}
        body.update(message=self.message, reason=self.reason, code=self.code)
        if self.details:
            body["details"] = self.details
        return body

    @classmethod
    def not_found(cls, spec: ResourceSpec, name: str) -> ApiError:
        details = {"name": name, "group": spec.group, "kind": spec.plural}
        return cls(404, "NotFound", f'{spec.qualified} "{name}" not found', details)

    @classmethod
    def conflict(cls, spec: ResourceSpec, name: str) -> ApiError:
        message = (
            f'Operation cannot be fulfilled on {spec.qualified} "{name}": '
            "the object has been modified; please apply your changes to the latest version and try again"
        )
        return cls(409, "Conflict", message, {"name": name, "group": spec.group, "kind": spec.plural})

    @classmethod
    def invalid(cls, kind: str, name: str | None, field: str, message: str, group: str = "") -> ApiError:
        cause = {"reason": "FieldValueInvalid", "message": f"Invalid value: {message}", "field": field}
        details = {"name": name or "", "group": group, "kind": kind, "causes": [cause]}
        qualified = f"{kind}.{group}" if group else kind
        return cls(422, "Invalid", f'{qualified} "{name}" is invalid: {field}: Invalid value: {message}', details)


# --- request log ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class KubeRequest:
    """One request the emulator answered, in RBAC terms.

    Attributes:
        verb: the RBAC verb (get, list, watch, create, update, patch, delete, deletecollection);
            ``get`` for non-resource URLs (discovery, ``/version``).
        group: API group ('' for core); None for non-resource URLs.
        resource: the plural; None for non-resource URLs.
        status: the HTTP status (for a watch: 200 once it started streaming).
        path: the URL path (for non-resource URLs, what RBAC's ``nonResourceURLs`` name).
    """

    verb: str
    group: str | None
    version: str | None
    resource: str | None
    subresource: str | None
    namespace: str | None
    name: str | None
    status: int
    path: str

    @property
    def rbac(self) -> tuple[str, str, str] | None:
        """``(apiGroup, resource[/subresource], verb)`` as a ClusterRole rule names it; None for non-resource URLs."""
        if self.resource is None or self.group is None:
            return None
        resource = f"{self.resource}/{self.subresource}" if self.subresource else self.resource
        return self.group, resource, self.verb


@dataclasses.dataclass(frozen=True)
class _Target:
    """A parsed resource URL (syntax only; ``spec`` is None for unknown resources)."""

    group: str
    version: str
    plural: str
    namespace: str | None
    name: str | None
    subresource: str | None
    spec: ResourceSpec | None


# --- selectors ------------------------------------------------------------------------------------

_LABEL_TERM = re.compile(
    r"^\s*(?P<neg>!?)\s*(?P<key>[A-Za-z0-9._/-]+)\s*"
    r"(?:(?P<op>==|=|!=)\s*(?P<value>[A-Za-z0-9._-]*)|\s+(?P<setop>in|notin)\s*\((?P<values>[^)]*)\))?\s*$"
)


def _split_terms(selector: str) -> list[str]:
    terms, depth, current = [], 0, ""
    for char in selector:
        depth += (char == "(") - (char == ")")
        if char == "," and depth == 0:
            terms.append(current)
            current = ""
        else:
            current += char
    return [t for t in [*terms, current] if t.strip()]


def label_matcher(selector: str) -> Callable[[dict[str, str]], bool]:
    """A predicate on a labels dict for a ``labelSelector`` (``k=v``, ``k!=v``, ``k``, ``!k``, ``k in (a,b)``, ``k notin (a)``).

    Raises:
        ApiError: 400 for a term it cannot parse.
    """
    checks: list[Callable[[dict[str, str]], bool]] = []
    for term in _split_terms(selector):
        m = _LABEL_TERM.match(term)
        if not m or (m["neg"] and (m["op"] or m["setop"])):
            raise ApiError(400, "BadRequest", f"unable to parse requirement: {term!r} in labelSelector {selector!r}")
        key, value = m["key"], m["value"]
        values = {v.strip() for v in (m["values"] or "").split(",") if v.strip()}
        if m["neg"]:
            checks.append(lambda labels, k=key: k not in labels)
        elif m["op"] in ("=", "=="):
            checks.append(lambda labels, k=key, v=value: labels.get(k) == v)
        elif m["op"] == "!=":
            checks.append(lambda labels, k=key, v=value: labels.get(k) != v)
        elif m["setop"] == "in":
            checks.append(lambda labels, k=key, vs=values: labels.get(k) in vs)
        elif m["setop"] == "notin":
            checks.append(lambda labels, k=key, vs=values: labels.get(k) not in vs)
        else:
            checks.append(lambda labels, k=key: k in labels)
    return lambda labels: all(check(labels) for check in checks)


def field_matcher(selector: str) -> Callable[[dict[str, Any]], bool]:
    """A predicate on an object for a ``fieldSelector`` (``path=v``, ``path==v``, ``path!=v``, comma-joined).

    Any dotted path is accepted (``metadata.name``, ``metadata.namespace``, ``status.phase``,
    ``spec.nodeName``, ...); a missing field compares as ''.

    Raises:
        ApiError: 400 for a term without an operator.
    """
    checks: list[Callable[[dict[str, Any]], bool]] = []
    for term in _split_terms(selector):
        m = re.match(r"^\s*([A-Za-z0-9._-]+)\s*(==|=|!=)\s*(.*?)\s*$", term)
        if not m:
            raise ApiError(400, "BadRequest", f"invalid field selector term {term!r} in {selector!r}")
        path, op, value = m.groups()

        def check(obj: dict[str, Any], path: str = path, op: str = op, value: str = value) -> bool:
            current: Any = obj
            for part in path.split("."):
                current = current.get(part) if isinstance(current, dict) else None
            text = "" if current is None else str(current).lower() if isinstance(current, bool) else str(current)
            return (text == value) == (op != "!=")

        checks.append(check)
    return lambda obj: all(check(obj) for check in checks)


# --- patches and schemas --------------------------------------------------------------------------


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch: dicts merge recursively, ``None`` removes a key, anything else replaces.

    Keys starting with ``$`` (strategic-merge directives) are dropped: strategic merge is served as plain merge.
    """
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if key.startswith("$"):
            continue
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


class PatchError(ValueError):
    """A JSON patch that does not apply (a failed ``test``, a missing path, a bad op)."""


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise PatchError(f"JSON pointer must start with '/': {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _resolve(doc: Any, tokens: list[str]) -> Any:
    for token in tokens:
        if isinstance(doc, dict) and token in doc:
            doc = doc[token]
        elif isinstance(doc, list) and token.isdigit() and int(token) < len(doc):
            doc = doc[int(token)]
        else:
            raise PatchError(f"path /{'/'.join(tokens)} does not exist")
    return doc


def json_patch(doc: dict[str, Any], ops: list[dict[str, Any]]) -> dict[str, Any]:
    """RFC 6902 JSON patch (add, remove, replace, move, copy, test) applied to a copy of ``doc``.

    Raises:
        PatchError: a ``test`` that fails (message ``testing value <path> failed``), a path
            that does not exist, or an unknown op.
    """
    doc = copy.deepcopy(doc)

    def put(tokens: list[str], value: Any, *, insert: bool) -> None:
        parent = _resolve(doc, tokens[:-1])
        last = tokens[-1]
        if isinstance(parent, dict):
            if not insert and last not in parent:
                raise PatchError(f"replace: path /{'/'.join(tokens)} does not exist")
            parent[last] = value
        elif isinstance(parent, list):
            index = len(parent) if last == "-" else int(last) if last.isdigit() else -1
            if not 0 <= index <= len(parent) - (0 if insert else 1):
                raise PatchError(f"index {last!r} out of range at /{'/'.join(tokens)}")
            if insert:
                parent.insert(index, value)
            else:
                parent[index] = value
        else:
            raise PatchError(f"cannot set /{'/'.join(tokens)}: parent is not an object or array")

    def remove(tokens: list[str]) -> Any:
        parent = _resolve(doc, tokens[:-1])
        value = _resolve(parent, tokens[-1:])
        if isinstance(parent, dict):
            del parent[tokens[-1]]
        else:
            del parent[int(tokens[-1])]
        return value

    if not isinstance(ops, list):
        raise PatchError("a JSON patch must be a list of operations")
    for op in ops:
        kind, tokens = op.get("op"), _pointer(op.get("path", ""))
        if kind == "test":
            try:
                actual = _resolve(doc, tokens)
            except PatchError:
                actual = None
            if actual != op.get("value"):
                raise PatchError(f"testing value {op.get('path')} failed")
        elif not tokens:
            raise PatchError(f"{kind} on the whole document is not supported")
        elif kind == "add":
            put(tokens, copy.deepcopy(op.get("value")), insert=True)
        elif kind == "replace":
            put(tokens, copy.deepcopy(op.get("value")), insert=False)
        elif kind == "remove":
            remove(tokens)
        elif kind in ("move", "copy"):
            source = _pointer(op.get("from", ""))
            value = remove(source) if kind == "move" else copy.deepcopy(_resolve(doc, source))
            put(tokens, value, insert=True)
        else:
            raise PatchError(f"unknown JSON patch op {kind!r}")
    return doc


def to_json_schema(schema: Any) -> Any:
    """An OpenAPI v3 (CRD) schema as JSON Schema: ``nullable`` adds ``null``; int-or-string becomes ``anyOf``."""
    if isinstance(schema, list):
        return [to_json_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: to_json_schema(v) if k in _SCHEMA_NESTING else v for k, v in schema.items()}
    if "properties" in schema:
        out["properties"] = {k: to_json_schema(v) for k, v in schema["properties"].items()}
    if schema.get("x-kubernetes-int-or-string") and "type" not in schema:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if schema.get("nullable") and "type" in schema:
        out["type"] = [schema["type"], "null"]
    for bound in ("Minimum", "Maximum"):  # OpenAPI 3.0's boolean exclusive bounds are numbers in JSON Schema
        if isinstance(schema.get(f"exclusive{bound}"), bool):
            limit = out.pop(bound.lower(), None)
            out.pop(f"exclusive{bound}")
            if schema[f"exclusive{bound}"] and limit is not None:
                out[f"exclusive{bound}"] = limit
            elif limit is not None:
                out[bound.lower()] = limit
    return out


_SCHEMA_NESTING = ("items", "additionalProperties", "allOf", "anyOf", "oneOf", "not")


def apply_schema(obj: Any, schema: dict[str, Any], path: str = "", unknown: list[str] | None = None) -> Any:
    """Apply a CRD schema's ``default``s and prune unknown fields in place, as the API server does on writes.

    Fields under ``x-kubernetes-preserve-unknown-fields`` or an ``additionalProperties`` schema
    are kept. ``apiVersion``, ``kind`` and ``metadata`` at the root are never pruned. The pruned
    fields' paths are appended to ``unknown`` (answered as ``Warning`` headers).
    """
    if isinstance(obj, dict) and schema.get("type") == "object":
        props = schema.get("properties") or {}
        for key, sub in props.items():
            if key not in obj and "default" in sub:
                obj[key] = copy.deepcopy(sub["default"])
        preserve = schema.get("x-kubernetes-preserve-unknown-fields") or "additionalProperties" in schema
        for key in list(obj):
            sub_path = f"{path}.{key}" if path else key
            if path == "" and key in ("apiVersion", "kind", "metadata"):
                continue  # the server's own fields: ObjectMeta is not the CRD's to prune
            if key in props:
                apply_schema(obj[key], props[key], sub_path, unknown)
            elif isinstance(schema.get("additionalProperties"), dict):
                apply_schema(obj[key], schema["additionalProperties"], sub_path, unknown)
            elif not preserve:
                del obj[key]
                if unknown is not None:
                    unknown.append(sub_path)
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for index, item in enumerate(obj):
            apply_schema(item, schema["items"], f"{path}[{index}]", unknown)
    return obj


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> aiohttp.web.Response:
    return aiohttp.web.Response(
        status=status, body=json.dumps(body).encode(), content_type="application/json", headers=headers
    )


@dataclasses.dataclass(frozen=True)
class _WriteOptions:
    dry_run: bool = False
    field_validation: str = "Warn"  # Ignore | Warn | Strict: what to do about pruned (unknown) fields


_WRITE = _WriteOptions()
_LOGGED = aiohttp.web.ResponseKey("kube_logged", bool)  # a watch logs itself once its stream starts


class _Direct(Exception):
    """Raised by the emulator's catch-all kmock reaction: serve the request directly (no user reaction matched)."""


@dataclasses.dataclass(eq=False)
class _Watcher:
    spec: ResourceSpec
    match: Callable[[dict[str, Any]], bool]
    queue: asyncio.Queue[bytes | None]


# --- the emulator ---------------------------------------------------------------------------------


def _wants_table(raw: aiohttp.web.BaseRequest, spec: ResourceSpec) -> bool:
    """kubectl asks for server-side printing (``as=Table``); served for kinds with printer columns (CRDs)."""
    return bool(spec.printer_columns) and "as=Table" in raw.headers.get("Accept", "")


def _json_path(obj: Any, path: str) -> Any:
    """The value at a simple JSONPath (``.status.phase``) or None; enough for printer columns."""
    for part in path.strip(".").split("."):
        if not isinstance(obj, dict):
            return None
        obj = obj.get(part)
    return obj


def _age(timestamp: str | None) -> str | None:
    """A creation timestamp as the API server prints a ``date`` column: ``42s``, ``5m``, ``3h``, ``2d``."""
    if not timestamp:
        return None
    then = datetime.datetime.strptime(timestamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.timezone.utc)
    seconds = max(0, int((datetime.datetime.now(datetime.timezone.utc) - then).total_seconds()))
    for unit, size, limit in (("s", 1, 120), ("m", 60, 120 * 60), ("h", 3600, 48 * 3600)):
        if seconds < limit:
            return f"{seconds // size}{unit}"
    return f"{seconds // 86400}d"


def table(spec: ResourceSpec, objects: list[dict[str, Any]], resource_version: str) -> dict[str, Any]:
    """A ``meta.k8s.io/v1`` Table of ``objects`` with the CRD's printer columns (what ``kubectl get`` prints)."""
    columns = [{"name": "Name", "type": "string", "format": "name", "description": "Name", "priority": 0}]
    columns += [
        {
            "name": c["name"],
            "type": c["type"],
            "format": c.get("format", ""),
            "description": c.get("description", ""),
            "priority": c.get("priority", 0),
        }
        for c in spec.printer_columns
    ]
    rows = []
    for obj in objects:
        cells = [obj["metadata"]["name"]]
        for c in spec.printer_columns:
            value = _json_path(obj, c["jsonPath"])
            cells.append(_age(value) if c["type"] == "date" else value)
        partial = {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": obj["metadata"]}
        rows.append({"cells": cells, "object": partial})
    return {
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": {"resourceVersion": resource_version},
        "columnDefinitions": columns,
        "rows": rows,
    }


def _table_event(spec: ResourceSpec, line: bytes) -> bytes:
    """A watch event line with its object turned into a one-row Table (as the API server sends to kubectl)."""
    event = json.loads(line)
    obj = event.get("object") or {}
    if event.get("type") in ("ADDED", "MODIFIED", "DELETED") and "metadata" in obj:
        event["object"] = table(spec, [obj], obj["metadata"].get("resourceVersion", ""))
    return json.dumps(event).encode() + b"\n"


@attrs.define(kw_only=True)
class KubeEmulator(kmock.KubernetesEmulator):
    """kmock's ``KubernetesEmulator`` with the API-server semantics kopf and kubectl rely on.

    Runs inside one event loop (see ``KubeServer``): every write is synchronous code between
    awaits, hence atomic. User reactions (``emulator['get /api/v1/pods'] << 500``) still take
    precedence; every other request is served here (stock kmock's fallbacks are never reached).
    Objects are kept in kmock's ``objects`` (with their history of versions), keyed by
    ``ResourceSpec.store``; ``resources`` mirrors the served resources for kmock's views.

    Attributes:
        history_size: how many past events a watch can resume from; an older ``resourceVersion``
            gets a 410 Gone ``ERROR`` event (as after an etcd compaction).
        garbage_collection: remove objects whose every ``ownerReferences`` owner is gone.
        request_log: every answered request (``KubeRequest``), in order of completion.
    """

    history_size: int = 10_000
    garbage_collection: bool = True
    request_log: list[KubeRequest] = attrs.field(factory=list, init=False)
    _specs: dict[tuple[str, str, str], ResourceSpec] = attrs.field(factory=dict, init=False)
    _rv: int = attrs.field(default=0, init=False)
    _events: collections.deque[tuple[int, kmock.resource, str, dict | None, dict]] = attrs.field(init=False)
    _compacted_rv: int = attrs.field(default=0, init=False)
    _watchers: set[_Watcher] = attrs.field(factory=set, init=False)
    _validators: dict[tuple[str, str, str], Any] = attrs.field(factory=dict, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._events = collections.deque(maxlen=self.history_size)
        for spec in BUILTIN_RESOURCES:
            self.add_resource(spec)
        # Below user reactions (any priority), above kmock's own K8s fallbacks.
        (self.fallback**1) << self._direct

    @staticmethod
    def _direct(request: rendering.Request) -> None:
        raise _Direct

    # -- resources and the store (call on the emulator's loop) --------------------------------------

    def add_resource(self, spec: ResourceSpec) -> None:
        """Serve ``spec`` (replacing a resource of the same group/version/plural), discovery included."""
        self._specs[spec.group, spec.version, spec.plural] = spec
        self._validators.pop((spec.group, spec.version, spec.plural), None)
        self.resources[kmock.resource(spec.group, spec.version, spec.plural)] = kmock.ResourceInfo(
            namespaced=spec.namespaced,
            kind=spec.kind,
            singular=spec.singular,
            verbs=RESOURCE_VERBS,
            shortnames=spec.short_names,
            categories=spec.categories,
            subresources={"status"} if spec.status_subresource else set(),
        )

    def remove_resource(self, group: str, version: str, plural: str) -> None:
        """Stop serving a resource (its objects stay in ``objects`` until re-served)."""
        self._specs.pop((group, version, plural), None)
        self.resources.pop(kmock.resource(group, version, plural), None)

    def register_crds(self, directory: str | Path) -> list[ResourceSpec]:
        """Create (or replace) every CRD in ``directory/*.yaml`` and serve its resources.

        Returns:
            The resources served for them, one per served version.

        Raises:
            ApiError: 422 for a CRD that names no group/kind/plural/versions.
        """
        served = []
        crds = self.spec("apiextensions.k8s.io/v1/customresourcedefinitions")
        for crd in load_crds(directory):
            name = crd["metadata"]["name"]
            current = self.get_object(crds, name)
            body = copy.deepcopy(crd)
            if current is not None:
                body["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
                self.replace_object(crds, name, body)
            else:
                self.create_object(crds, body)
            served += crd_resources(crd)
        return served

    def spec(self, resource: str | ResourceSpec | kmock.resource) -> ResourceSpec:
        """The served resource for ``'v1/pods'``, ``'rlrun.dev/v1alpha1/rlruns'``, ``'pods'``, ``'rlr'``, ``'RLRun'``, ``'rlruns.rlrun.dev'``.

        Bare names match plural, singular, short name or kind (the core group wins a tie).

        Raises:
            KeyError: no served resource matches.
        """
        if isinstance(resource, ResourceSpec):
            return resource
        if isinstance(resource, kmock.resource):
            return self._specs[resource.group or "", resource.version or "", resource.plural or ""]
        parts = resource.split("/")
        if len(parts) == 3:
            return self._specs[parts[0], parts[1], parts[2]]
        if len(parts) == 2 and parts[0].startswith("v") and parts[0][1:2].isdigit():
            return self._specs["", parts[0], parts[1]]
        name, _, group = resource.partition(".")
        candidates = [
            s
            for s in self._specs.values()
            if (not group or s.group == group)
            and (name in (s.plural, s.singular, *s.short_names) or name.lower() == s.kind.lower())
        ]
        if not candidates:
            raise KeyError(f"no served resource named {resource!r}")
        return sorted(candidates, key=lambda s: (s.group != "", s.group, s.version != s.storage_version))[0]

    def get_object(
        self, resource: str | ResourceSpec, name: str, namespace: str | None = None
    ) -> dict[str, Any] | None:
        """A copy of the stored object, or None."""
        spec = self.spec(resource)
        obj = self._current(spec, self._ns(spec, namespace), name)
        return None if obj is None else self._present(spec, obj)

    def list_objects(
        self,
        resource: str | ResourceSpec,
        namespace: str | None = None,
        label_selector: str = "",
        field_selector: str = "",
    ) -> list[dict[str, Any]]:
        """Copies of the stored objects (all namespaces when ``namespace`` is None), sorted by namespace/name."""
        spec = self.spec(resource)
        match = self._matcher(spec, namespace, None, label_selector, field_selector)
        return [self._present(spec, obj) for obj in self._iter(spec) if match(obj)]

    def create_object(
        self,
        resource: str | ResourceSpec,
        body: dict[str, Any],
        namespace: str | None = None,
        *,
        keep_status: bool = False,
    ) -> dict[str, Any]:
        """Create an object as ``POST`` does: uid, timestamps, generation 1, resourceVersion, defaults, validation.

        Args:
            namespace: the URL's namespace; None: the body's (``default`` when it has none).
            keep_status: keep ``status`` even where the status subresource would drop it (test set-up).

        Raises:
            ApiError: 400 for a body that is no object or a namespace mismatch, 409 AlreadyExists,
                422 for a missing/invalid name or a schema violation.
        """
        spec = self.spec(resource)
        return self._present(spec, self._create(spec, namespace, body, keep_status=keep_status)[0])

    def replace_object(
        self,
        resource: str | ResourceSpec,
        name: str,
        body: dict[str, Any],
        namespace: str | None = None,
        *,
        subresource: str | None = None,
    ) -> dict[str, Any]:
        """Replace an object as ``PUT`` does (a stale ``metadata.resourceVersion`` is a 409 Conflict)."""
        spec = self.spec(resource)
        return self._present(spec, self._replace(spec, self._ns(spec, namespace), name, body, subresource)[0])

    def patch_object(
        self,
        resource: str | ResourceSpec,
        name: str,
        patch: Any,
        namespace: str | None = None,
        *,
        subresource: str | None = None,
        patch_type: str = "merge",
    ) -> dict[str, Any]:
        """Patch an object as ``PATCH`` does; ``patch_type`` is ``merge``, ``strategic`` or ``json``."""
        spec = self.spec(resource)
        content_type = {"json": "application/json-patch+json"}.get(patch_type, "application/merge-patch+json")
        obj = self._patch(spec, self._ns(spec, namespace), name, patch, content_type, subresource)[0]
        return self._present(spec, obj)

    def delete_object(
        self,
        resource: str | ResourceSpec,
        name: str,
        namespace: str | None = None,
        options: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Delete an object as ``DELETE`` does: marked (``deletionTimestamp``) while it has finalizers, else removed."""
        spec = self.spec(resource)
        return self._present(spec, self._delete(spec, self._ns(spec, namespace), name, options or {}))

    @property
    def resource_version(self) -> int:
        """The latest ``resourceVersion`` given out (0 before the first write)."""
        return self._rv

    def close_watches(self) -> None:
        """End every open watch stream (as the API server does on shutdown)."""
        for watcher in list(self._watchers):
            watcher.queue.put_nowait(None)

    # -- HTTP --------------------------------------------------------------------------------------

    async def __call__(self, raw: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        body = await raw.read()
        target = self._parse_target(raw.path)
        verb = self._verb(raw, target)
        try:
            data = json.loads(body) if body else None
        except ValueError:
            data = None
        request = rendering.Request(
            id=len(self._requests),
            raw_request=raw,
            url=raw.url,
            method=raw.method,
            params=dict(raw.query),
            headers=dict(raw.headers),
            cookies=dict(raw.cookies),
            body=body,
            text=body.decode(errors="replace"),
            data=data,
            action=self._action(verb),
            resource=kmock.resource(target.group, target.version, target.plural) if target else None,
            namespace=target.namespace if target else None,
            name=target.name if target else None,
            subresource=target.subresource if target else None,
        )
        self._requests.append(request)
        try:
            response = await self._handle(request)
        except rendering.StreamingError as e:  # a user reaction's stream broke after its headers went out
            response = e.args[0]
            await self._stream_error(e.__cause__ or e, response)
            await response.write_eof()
        except Exception as e:
            log.exception("kube emulator: %s %s failed", raw.method, raw.path_qs)
            if self._errors:
                self._errors[-1].append(e)
            response = await self._render_error(e)
        if not response.get(_LOGGED):
            self._log(raw, target, verb, response.status)
        return response

    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        # Skip KubernetesEmulator._handle: its writes would bypass everything below.
        try:
            return await apps.RawHandler._handle(self, request)
        except _Direct:
            return await self._serve(request)

    def _log(self, raw: aiohttp.web.BaseRequest, target: _Target | None, verb: str, status: int) -> None:
        if target is None:
            entry = KubeRequest(verb, None, None, None, None, None, None, status, raw.path)
        else:
            entry = KubeRequest(
                verb,
                target.group,
                target.version,
                target.plural,
                target.subresource,
                target.namespace,
                target.name,
                status,
                raw.path,
            )
        self.request_log.append(entry)

    def _parse_target(self, path: str) -> _Target | None:
        parts = [p for p in path.split("/") if p]
        if len(parts) >= 3 and parts[0] == "api":
            group, version, rest = "", parts[1], parts[2:]
        elif len(parts) >= 4 and parts[0] == "apis":
            group, version, rest = parts[1], parts[2], parts[3:]
        else:
            return None
        namespace = None
        if len(rest) >= 3 and rest[0] == "namespaces":
            inner = self._specs.get((group, version, rest[2]))
            if inner is None or inner.namespaced:  # else /api/v1/namespaces/{name}/{subresource}
                namespace, rest = rest[1], rest[2:]
        spec = self._specs.get((group, version, rest[0]))
        name = rest[1] if len(rest) > 1 else None
        subresource = "/".join(rest[2:]) or None
        return _Target(group, version, rest[0], namespace, name, subresource, spec)

    @staticmethod
    def _verb(raw: aiohttp.web.BaseRequest, target: _Target | None) -> str:
        if target is None:
            return raw.method.lower()
        named = target.name is not None
        if raw.method == "GET":
            return "watch" if raw.query.get("watch") in ("true", "1") else "get" if named else "list"
        verbs = {"POST": "create", "PUT": "update", "PATCH": "patch"}
        if raw.method == "DELETE":
            return "delete" if named else "deletecollection"
        return verbs.get(raw.method, raw.method.lower())

    @staticmethod
    def _action(verb: str) -> kmock.action | None:
        actions = {"get": "FETCH", "list": "LIST", "watch": "WATCH", "create": "CREATE", "update": "UPDATE"}
        actions |= {"patch": "UPDATE", "delete": "DELETE"}
        return kmock.action(actions[verb]) if verb in actions else None

    async def _serve(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        raw = request._raw_request
        assert raw is not None
        try:
            if request.resource is not None:
                target = self._parse_target(raw.path)
                assert target is not None
                return await self._serve_resource(raw, target, request.data)
            return self._serve_discovery(raw.path.rstrip("/") or "/")
        except ApiError as e:
            return _json(e.status(), e.code)

    def _serve_discovery(self, path: str) -> aiohttp.web.StreamResponse:
        specs = list(self._specs.values())
        groups: dict[str, list[str]] = {}
        for spec in specs:
            if spec.group and spec.version not in groups.setdefault(spec.group, []):
                groups[spec.group].append(spec.version)

        def group_doc(group: str) -> dict[str, Any]:
            versions = groups[group]
            storage = next((s.storage_version for s in specs if s.group == group and s.storage_version), versions[0])
            preferred = storage if storage in versions else versions[0]
            listed = [{"groupVersion": f"{group}/{v}", "version": v} for v in versions]
            return {
                "name": group,
                "versions": listed,
                "preferredVersion": {"groupVersion": f"{group}/{preferred}", "version": preferred},
            }

        def resource_list(group: str, version: str) -> dict[str, Any]:
            resources = []
            for s in specs:
                if (s.group, s.version) != (group, version):
                    continue
                entry = {"name": s.plural, "singularName": s.singular, "namespaced": s.namespaced, "kind": s.kind}
                entry |= {"verbs": list(RESOURCE_VERBS), "shortNames": list(s.short_names)}
                if s.categories:
                    entry["categories"] = list(s.categories)
                resources.append(entry)
                if s.status_subresource:
                    resources.append(
                        {
                            "name": f"{s.plural}/status",
                            "singularName": "",
                            "namespaced": s.namespaced,
                            "kind": s.kind,
                            "verbs": ["get", "patch", "update"],
                        }
                    )
            gv = f"{group}/{version}" if group else version
            return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv, "resources": resources}

        parts = path.strip("/").split("/")
        if path == "/version":
            return _json(SERVER_VERSION)
        if path in ("/healthz", "/livez", "/readyz"):
            return aiohttp.web.Response(text="ok")
        if path == "/api":
            return _json({"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []})
        if path == "/api/v1":
            return _json(resource_list("", "v1"))
        if path == "/apis":
            return _json({"kind": "APIGroupList", "apiVersion": "v1", "groups": [group_doc(g) for g in groups]})
        if parts[0] == "apis" and len(parts) == 2 and parts[1] in groups:
            return _json({"kind": "APIGroup", "apiVersion": "v1", **group_doc(parts[1])})
        if parts[0] == "apis" and len(parts) == 3 and parts[2] in groups.get(parts[1], []):
            return _json(resource_list(parts[1], parts[2]))
        raise ApiError(404, "NotFound", "the server could not find the requested resource")

    async def _serve_resource(
        self, raw: aiohttp.web.BaseRequest, target: _Target, data: Any
    ) -> aiohttp.web.StreamResponse:
        spec = target.spec
        if spec is None:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        if target.subresource not in (None, "status") or (target.subresource and not spec.status_subresource):
            raise ApiError(404, "NotFound", f"the server could not find the requested resource ({target.subresource})")
        ns, name, sub, query = target.namespace, target.name, target.subresource, raw.query
        if ns is not None and not spec.namespaced:
            raise ApiError(404, "NotFound", f"{spec.qualified} is not namespaced")
        opts = _WriteOptions("dryRun" in query, query.get("fieldValidation", "Warn"))
        method = raw.method
        # no Content-Type counts as JSON, as kube-apiserver assumes (the python client sends none on create);
        # aiohttp would report it as application/octet-stream
        sent_type = raw.headers.get("Content-Type", "").split(";")[0].strip()
        if method in ("POST", "PUT") and raw.body_exists and sent_type not in ("application/json", ""):
            # kubectl sends protobuf for builtin kinds (create namespace/secret/...): not decoded here.
            message = f"the body of the request was in an unknown format - accepted media types: application/json ({raw.content_type})"
            raise ApiError(415, "UnsupportedMediaType", message)
        warnings: list[str] = []
        if method == "GET" and query.get("watch") in ("true", "1"):
            return await self._serve_watch(raw, target, spec)
        if method == "GET" and name is None:
            match = self._matcher(spec, ns, None, query.get("labelSelector", ""), query.get("fieldSelector", ""))
            items = [self._present(spec, obj) for obj in self._iter(spec) if match(obj)]
            if _wants_table(raw, spec):
                return _json(table(spec, items, str(self._rv)))
            return _json(self._list_doc(spec, items))
        if method == "GET":
            obj = self._current(spec, self._ns(spec, ns), name)
            if obj is None:
                raise ApiError.not_found(spec, name)
            if _wants_table(raw, spec):
                return _json(table(spec, [self._present(spec, obj)], str(self._rv)))
            return _json(self._present(spec, obj))
        if method == "POST" and name is None:
            obj, warnings = self._create(spec, ns, data, opts=opts)
            return _json(self._present(spec, obj), 201, self._warning_headers(warnings))
        if method == "PUT" and name is not None:
            obj, warnings = self._replace(spec, self._ns(spec, ns), name, data, sub, opts=opts)
            return _json(self._present(spec, obj), 200, self._warning_headers(warnings))
        if method == "PATCH" and name is not None:
            obj, warnings = self._patch(spec, self._ns(spec, ns), name, data, raw.content_type, sub, opts=opts)
            return _json(self._present(spec, obj), 200, self._warning_headers(warnings))
        if method == "DELETE" and name is not None:
            return _json(self._present(spec, self._delete(spec, self._ns(spec, ns), name, data or {}, opts=opts)))
        if method == "DELETE":
            match = self._matcher(spec, ns, None, query.get("labelSelector", ""), query.get("fieldSelector", ""))
            victims = [obj for obj in self._iter(spec) if match(obj)]
            gone = [
                self._delete(spec, o["metadata"].get("namespace"), o["metadata"]["name"], data or {}) for o in victims
            ]
            return _json(self._list_doc(spec, [self._present(spec, obj) for obj in gone]))
        raise ApiError(405, "MethodNotAllowed", f"{method} is not supported on {raw.path}")

    @staticmethod
    def _warning_headers(warnings: list[str]) -> dict[str, str] | None:
        # One header per warning would be right; aiohttp's dict headers take one, so join them.
        return {"Warning": ", ".join(f'299 - "unknown field \\"{w}\\""' for w in warnings)} if warnings else None

    def _list_doc(self, spec: ResourceSpec, items: list[dict[str, Any]]) -> dict[str, Any]:
        metadata = {"resourceVersion": str(self._rv)}
        return {"kind": f"{spec.kind}List", "apiVersion": spec.api_version, "metadata": metadata, "items": items}

    async def _serve_watch(
        self, raw: aiohttp.web.BaseRequest, target: _Target, spec: ResourceSpec
    ) -> aiohttp.web.StreamResponse:
        query = raw.query
        selectors = query.get("labelSelector", ""), query.get("fieldSelector", "")
        match = self._matcher(spec, target.namespace, target.name, *selectors)
        since = query.get("resourceVersion", "")
        initial_events = query.get("sendInitialEvents") == "true"
        if since not in ("", "0") and not since.isdigit():
            raise ApiError(400, "BadRequest", f"invalid resourceVersion {since!r}")
        # From here to the subscription nothing awaits: no event can slip between replay and live.
        lines: list[bytes] = []
        expired = False
        if since in ("", "0") or initial_events:
            lines += [self._event_line(spec, "ADDED", obj) for obj in self._iter(spec) if match(obj)]
            if initial_events:
                marker = {"kind": spec.kind, "apiVersion": spec.api_version}
                marker["metadata"] = {
                    "resourceVersion": str(self._rv),
                    "annotations": {"k8s.io/initial-events-end": "true"},
                }
                lines.append(json.dumps({"type": "BOOKMARK", "object": marker}).encode() + b"\n")
        elif int(since) < self._compacted_rv:
            expired = True
            gone = ApiError(410, "Expired", f"too old resource version: {since} ({self._compacted_rv})").status()
            lines.append(json.dumps({"type": "ERROR", "object": gone}).encode() + b"\n")
        else:
            for rv, store, kind, old, new in self._events:
                if rv > int(since) and store == spec.store:
                    line = self._filtered_event(spec, match, kind, old, new)
                    if line is not None:
                        lines.append(line)
        watcher = _Watcher(spec, match, asyncio.Queue())
        self._watchers.add(watcher)
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        response[_LOGGED] = True
        as_table = _wants_table(raw, spec)
        try:
            await response.prepare(raw)
            self._log(raw, target, "watch", 200)
            for line in lines:
                await response.write(_table_event(spec, line) if as_table else line)
            if expired:  # the client must list again
                return response
            timeout = float(query["timeoutSeconds"]) if query.get("timeoutSeconds", "").isdigit() else None
            deadline = None if timeout is None else time.monotonic() + timeout
            while True:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    break
                try:
                    line = await asyncio.wait_for(watcher.queue.get(), remaining)
                except asyncio.TimeoutError:
                    break
                if line is None:
                    break
                await response.write(_table_event(spec, line) if as_table else line)
            await response.write_eof()
        except (ConnectionError, RuntimeError):  # the client went away ("Cannot write to closing transport")
            pass
        finally:
            self._watchers.discard(watcher)
        return response

    def _event_line(self, spec: ResourceSpec, kind: str, obj: dict[str, Any]) -> bytes:
        return json.dumps({"type": kind, "object": self._present(spec, obj)}).encode() + b"\n"

    def _filtered_event(
        self, spec: ResourceSpec, match: Callable[[dict[str, Any]], bool], kind: str, old: dict | None, new: dict
    ) -> bytes | None:
        # As the API server: an object that starts (stops) matching a selector is ADDED (DELETED) for this watch.
        was = old is not None and match(old)
        now = match(new)
        if kind == "MODIFIED":
            kind = "MODIFIED" if was and now else "ADDED" if now else "DELETED" if was else ""
        elif not now:
            kind = ""
        return self._event_line(spec, kind, new) if kind else None

    # -- the semantics -----------------------------------------------------------------------------

    def _ns(self, spec: ResourceSpec, namespace: str | None) -> str | None:
        return (namespace or "default") if spec.namespaced else None

    def _current(self, spec: ResourceSpec, namespace: str | None, name: str) -> dict[str, Any] | None:
        key = (spec.store, namespace, name)
        if key not in self.objects or self.objects[key].deleted:
            return None
        return self.objects[key].last.raw

    def _iter(self, spec: ResourceSpec) -> Iterator[dict[str, Any]]:
        live = [(key, obj) for key, obj in self.objects.items() if key[0] == spec.store and not obj.deleted]
        for _, obj in sorted(live, key=lambda item: (item[0][1] or "", item[0][2])):
            yield obj.last.raw

    def _present(self, spec: ResourceSpec, obj: dict[str, Any]) -> dict[str, Any]:
        obj = copy.deepcopy(obj)
        obj["apiVersion"] = spec.api_version
        return obj

    def _matcher(
        self, spec: ResourceSpec, namespace: str | None, name: str | None, labels: str, fields: str
    ) -> Callable[[dict[str, Any]], bool]:
        label_ok, field_ok = label_matcher(labels), field_matcher(fields)

        def match(obj: dict[str, Any]) -> bool:
            meta = obj.get("metadata") or {}
            return (
                (namespace is None or meta.get("namespace") == namespace)
                and (name is None or meta.get("name") == name)
                and label_ok(meta.get("labels") or {})
                and field_ok(obj)
            )

        return match

    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    def _emit(self, spec: ResourceSpec, kind: str, old: dict[str, Any] | None, new: dict[str, Any]) -> None:
        rv = int(new["metadata"]["resourceVersion"])
        if len(self._events) == self._events.maxlen:
            self._compacted_rv = self._events[0][0]
        self._events.append((rv, spec.store, kind, old, new))
        for watcher in self._watchers:
            if watcher.spec.store == spec.store:
                line = self._filtered_event(watcher.spec, watcher.match, kind, old, new)
                if line is not None:
                    watcher.queue.put_nowait(line)

    def _store(self, spec: ResourceSpec, obj: dict[str, Any]) -> None:
        meta = obj["metadata"]
        key = (spec.store, meta.get("namespace"), meta["name"])
        if key in self.objects:
            self.objects[key].history.append(copy.deepcopy(obj))
        else:
            self.objects[key] = copy.deepcopy(obj)

    def _validator(self, spec: ResourceSpec) -> Any:
        key = (spec.group, spec.version, spec.plural)
        if key not in self._validators:
            import jsonschema

            self._validators[key] = jsonschema.Draft202012Validator(to_json_schema(spec.schema))
        return self._validators[key]

    def _admit(self, spec: ResourceSpec, obj: dict[str, Any], opts: _WriteOptions) -> list[str]:
        """Defaults, pruning and schema validation of a CRD's object; returns the pruned fields (for warnings).

        Raises:
            ApiError: 400 for pruned fields under ``fieldValidation=Strict``; 422 for a schema violation.
        """
        unknown: list[str] = []
        if spec.schema is None:
            return unknown
        apply_schema(obj, spec.schema, "", unknown)
        if unknown and opts.field_validation == "Strict":
            fields = ", ".join(f'unknown field "{field}"' for field in unknown)
            message = f"{spec.kind} in version {spec.version!r} cannot be handled as a {spec.kind}: strict decoding error: {fields}"
            raise ApiError(400, "BadRequest", message)
        if opts.field_validation == "Ignore":
            unknown = []
        error = next(
            iter(sorted(self._validator(spec).iter_errors(obj), key=lambda e: [str(p) for p in e.absolute_path])), None
        )
        if error is not None:
            field = ".".join(str(p) for p in error.absolute_path) or "<root>"
            value = json.dumps(error.instance)[:200]
            raise ApiError.invalid(
                spec.kind, obj["metadata"].get("name"), field, f"{value}: {error.message}", spec.group
            )
        return unknown

    def _create(
        self,
        spec: ResourceSpec,
        namespace: str | None,
        body: Any,
        *,
        keep_status: bool = False,
        opts: _WriteOptions = _WRITE,
    ) -> tuple[dict[str, Any], list[str]]:
        if not isinstance(body, dict) or not isinstance(body.get("metadata", {}), dict):
            raise ApiError(400, "BadRequest", f"the body of a {spec.kind} must be a JSON object with object metadata")
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
                if self._current(spec, meta.get("namespace"), meta["name"]) is None:
                    break
        name = meta.get("name")
        if not name:
            raise ApiError.invalid(spec.kind, "", "metadata.name", "name or generateName is required", spec.group)
        if len(name) > 253 or not _DNS_SUBDOMAIN.match(name):
            message = f'"{name}": a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, "-" or "."'
            raise ApiError.invalid(spec.kind, name, "metadata.name", message, spec.group)
        if self._current(spec, meta.get("namespace"), name) is not None:
            details = {"name": name, "group": spec.group, "kind": spec.plural}
            raise ApiError(409, "AlreadyExists", f'{spec.qualified} "{name}" already exists', details)
        if spec.status_subresource and not keep_status:
            obj.pop("status", None)
        for server_field in ("deletionTimestamp", "deletionGracePeriodSeconds", "resourceVersion", "managedFields"):
            meta.pop(server_field, None)
        meta |= {"uid": str(uuid.uuid4()), "creationTimestamp": _now(), "generation": 1}
        unknown = self._admit(spec, obj, opts)
        if spec.group == "apiextensions.k8s.io" and spec.plural == "customresourcedefinitions":
            self._crd_admit(obj)
        if opts.dry_run:
            return obj, unknown
        meta["resourceVersion"] = self._next_rv()
        self._store(spec, obj)
        self._emit(spec, "ADDED", None, obj)
        if spec.group == "apiextensions.k8s.io" and spec.plural == "customresourcedefinitions":
            self._crd_serve(obj)
        return obj, unknown

    def _replace(
        self, spec: ResourceSpec, ns: str | None, name: str, body: Any, sub: str | None, *, opts: _WriteOptions = _WRITE
    ) -> tuple[dict[str, Any], list[str]]:
        current = self._current(spec, ns, name)
        if current is None:
            raise ApiError.not_found(spec, name)
        if not isinstance(body, dict) or not isinstance(body.get("metadata", {}), dict):
            raise ApiError(400, "BadRequest", f"the body of a {spec.kind} must be a JSON object with object metadata")
        meta = body.get("metadata") or {}
        if meta.get("name") not in (None, name):
            raise ApiError(
                400, "BadRequest", f"the name of the object ({meta['name']}) does not match the URL ({name})"
            )
        if meta.get("resourceVersion") not in (None, "", current["metadata"]["resourceVersion"]):
            raise ApiError.conflict(spec, name)
        return self._update(spec, current, copy.deepcopy(body), sub, opts=opts)

    def _patch(
        self,
        spec: ResourceSpec,
        ns: str | None,
        name: str,
        patch: Any,
        content_type: str,
        sub: str | None,
        *,
        opts: _WriteOptions = _WRITE,
    ) -> tuple[dict[str, Any], list[str]]:
        current = self._current(spec, ns, name)
        if current is None:
            raise ApiError.not_found(spec, name)
        if content_type == "application/json-patch+json":
            try:
                new = json_patch(current, patch)
            except PatchError as e:
                message = f"the server rejected our request due to an error in our request: {e}"
                raise ApiError(422, "Invalid", message, {"name": name, "group": spec.group, "kind": spec.plural}) from e
        elif content_type in (
            "application/merge-patch+json",
            "application/strategic-merge-patch+json",
            "application/json",
        ):
            if not isinstance(patch, dict):
                raise ApiError(400, "BadRequest", "a merge patch must be a JSON object")
            rv = (patch.get("metadata") or {}).get("resourceVersion")
            if rv not in (None, "", current["metadata"]["resourceVersion"]):
                raise ApiError.conflict(spec, name)
            new = merge_patch(current, patch)
        else:
            raise ApiError(
                415, "UnsupportedMediaType", f"the body of the request was in an unknown format: {content_type}"
            )
        return self._update(spec, current, new, sub, opts=opts)

    def _update(
        self,
        spec: ResourceSpec,
        current: dict[str, Any],
        new: dict[str, Any],
        sub: str | None,
        *,
        opts: _WriteOptions = _WRITE,
    ) -> tuple[dict[str, Any], list[str]]:
        if sub == "status":  # only .status changes through the status subresource
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
        immutable = ("name", "namespace", "uid", "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds")
        for key in (*immutable, "generation", "resourceVersion"):
            meta.pop(key, None)
            if key in old_meta:
                meta[key] = old_meta[key]
        new["apiVersion"], new["kind"] = spec.api_version, spec.kind
        unknown = self._admit(spec, new, opts)
        if spec.group == "apiextensions.k8s.io" and spec.plural == "customresourcedefinitions":
            self._crd_admit(new, current)
        if new == current or opts.dry_run:
            return current if new == current else new, unknown
        outside = lambda obj: {k: v for k, v in obj.items() if k not in ("metadata", "status")}  # noqa: E731
        if outside(new) != outside(current):
            meta["generation"] = old_meta.get("generation", 1) + 1
        meta["resourceVersion"] = self._next_rv()
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            self._remove(spec, new)  # the last finalizer is gone: the pending deletion completes
            return new, unknown
        self._store(spec, new)
        self._emit(spec, "MODIFIED", current, new)
        if spec.group == "apiextensions.k8s.io" and spec.plural == "customresourcedefinitions":
            self._crd_serve(new)
        return new, unknown

    def _delete(
        self, spec: ResourceSpec, ns: str | None, name: str, options: Any, *, opts: _WriteOptions = _WRITE
    ) -> dict[str, Any]:
        current = self._current(spec, ns, name)
        if current is None:
            raise ApiError.not_found(spec, name)
        pre = (options.get("preconditions") if isinstance(options, dict) else None) or {}
        meta = current["metadata"]
        if pre.get("uid") not in (None, meta["uid"]) or pre.get("resourceVersion") not in (
            None,
            meta["resourceVersion"],
        ):
            raise ApiError.conflict(spec, name)
        if opts.dry_run:
            return current
        if meta.get("finalizers"):
            if meta.get("deletionTimestamp"):
                return current  # already pending: nothing changes
            new = copy.deepcopy(current)
            new["metadata"] |= {"deletionTimestamp": _now(), "deletionGracePeriodSeconds": 0}
            new["metadata"]["resourceVersion"] = self._next_rv()
            self._store(spec, new)
            self._emit(spec, "MODIFIED", current, new)
            return new
        final = copy.deepcopy(current)
        final["metadata"]["resourceVersion"] = self._next_rv()
        self._remove(spec, final)
        return final

    def _remove(self, spec: ResourceSpec, final: dict[str, Any]) -> None:
        """Remove an object for good (its final state carries the new resourceVersion), then its dependents."""
        meta = final["metadata"]
        key = (spec.store, meta.get("namespace"), meta["name"])
        previous = self.objects[key].last.raw
        self.objects[key].delete()
        self._emit(spec, "DELETED", previous, final)
        if spec.group == "apiextensions.k8s.io" and spec.plural == "customresourcedefinitions":
            for crd_spec in crd_resources(final):
                self.remove_resource(crd_spec.group, crd_spec.version, crd_spec.plural)
        if spec.group == "" and spec.plural == "namespaces":
            for other in list(self._specs.values()):
                if other.namespaced and other.version == (other.storage_version or other.version):
                    for obj in [o for o in self._iter(other) if o["metadata"].get("namespace") == meta["name"]]:
                        self._delete_quietly(other, obj)
        if self.garbage_collection:
            self._collect_garbage()

    def _delete_quietly(self, spec: ResourceSpec, obj: dict[str, Any]) -> None:
        with contextlib.suppress(ApiError):  # already gone through an earlier cascade
            self._delete(spec, obj["metadata"].get("namespace"), obj["metadata"]["name"], {})

    def _collect_garbage(self) -> None:
        uids = {raw["metadata"].get("uid") for spec in self._store_specs() for raw in self._iter(spec)}
        for spec in self._store_specs():
            for obj in list(self._iter(spec)):
                meta = obj["metadata"]
                owners = [ref.get("uid") for ref in meta.get("ownerReferences") or []]
                if owners and not meta.get("deletionTimestamp") and not any(uid in uids for uid in owners):
                    self._delete_quietly(spec, obj)

    def _store_specs(self) -> list[ResourceSpec]:
        return [s for s in self._specs.values() if s.version == (s.storage_version or s.version)]

    def _crd_admit(self, crd: dict[str, Any], previous: dict[str, Any] | None = None) -> None:
        """Check a CRD can be served and set the status the API server would (names accepted, established)."""
        crd_resources(crd)  # raises 422 for a CRD that cannot be served
        names = crd["spec"]["names"]
        since = {
            c["type"]: c["lastTransitionTime"] for c in ((previous or {}).get("status") or {}).get("conditions", [])
        }
        conditions = [
            {"type": t, "status": "True", "reason": r, "message": m, "lastTransitionTime": since.get(t, _now())}
            for t, r, m in (
                ("NamesAccepted", "NoConflicts", "no conflicts found"),
                ("Established", "InitialNamesAccepted", "the initial names have been accepted"),
            )
        ]
        storage = [v["name"] for v in crd["spec"]["versions"] if v.get("storage")]
        crd["status"] = {"acceptedNames": names, "conditions": conditions, "storedVersions": storage}

    def _crd_serve(self, crd: dict[str, Any]) -> None:
        for spec in crd_resources(crd):
            self.add_resource(spec)


# --- the runner -----------------------------------------------------------------------------------


class KubeServer:
    """A ``KubeEmulator`` served over HTTP on 127.0.0.1 (a free port) from its own thread and event loop.

    Usage::

        with KubeServer(crds=ROOT / "crds") as kube:
            kube.write_kubeconfig(tmp_path / "kubeconfig")
            created = kube.create("v1/pods", {"metadata": {"name": "p"}}, namespace="ns")
            assert kube.get("pods", "p", "ns")["metadata"]["uid"] == created["metadata"]["uid"]

    The object accessors (``get``, ``list``, ``create``, ``patch``, ``replace``, ``delete``,
    ``register_crds``) run on the server's loop and may be called from any other thread; they
    take the same arguments as the ``KubeEmulator`` methods of the same names and raise
    ``ApiError`` as the API would answer. They do not appear in ``requests``.
    """

    def __init__(self, *, crds: str | Path | None = None, emulator: KubeEmulator | None = None) -> None:
        self.emulator = emulator if emulator is not None else KubeEmulator()
        self._crds = crds
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping: asyncio.Event | None = None
        self._port = 0

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>`` (no trailing slash)."""
        if not self._port:
            raise RuntimeError("the kube emulator is not running")
        return f"http://127.0.0.1:{self._port}"

    @property
    def requests(self) -> list[KubeRequest]:
        """A copy of the request log, oldest first."""
        return list(self.emulator.request_log)

    def clear_requests(self) -> None:
        """Forget the requests logged so far."""
        self.emulator.request_log.clear()

    def rbac_usage(self) -> set[tuple[str, str, str]]:
        """``{(apiGroup, resource[/subresource], verb)}`` of every resource request logged (what a ClusterRole must grant)."""
        return {r.rbac for r in self.requests if r.rbac is not None}

    def start(self, timeout: float = 5.0) -> KubeServer:
        """Start serving; returns when the port is listening.

        Raises:
            RuntimeError: started twice, or the server failed to start within ``timeout`` seconds.
        """
        if self._thread is not None:
            raise RuntimeError("the kube emulator is already started")
        ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(ready,), name="kube-emulator", daemon=True)
        self._thread.start()
        ready.result(timeout)
        if self._crds is not None:
            self.register_crds(self._crds)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """End open watches, stop serving and join the thread (idempotent)."""
        if self._thread is None or self._loop is None or self._stopping is None:
            return
        self._loop.call_soon_threadsafe(self._stopping.set)
        self._thread.join(timeout)
        self._thread = None
        self._port = 0

    def __enter__(self) -> KubeServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self, ready: concurrent.futures.Future[None]) -> None:
        try:
            asyncio.run(self._main(ready))
        except BaseException as e:
            if not ready.done():
                ready.set_exception(e)
            else:
                log.exception("kube emulator thread failed")

    async def _main(self, ready: concurrent.futures.Future[None]) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        async with self.emulator:
            server = aiohttp.web.Server(self.emulator, handler_cancellation=True)
            runner = aiohttp.web.ServerRunner(server, shutdown_timeout=0.2)
            await runner.setup()
            site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            self._port = runner.addresses[0][1]
            ready.set_result(None)
            try:
                await self._stopping.wait()
            finally:
                self.emulator.close_watches()
                await asyncio.sleep(0)  # let the watch handlers see the end of their queues
                await runner.cleanup()

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` on the server's loop (thread-safe) and return its result or raise its error.

        Raises:
            RuntimeError: called from the server's own thread (it would deadlock) or not running.
        """
        if self._loop is None or self._thread is None:
            raise RuntimeError("the kube emulator is not running")
        if threading.current_thread() is self._thread:
            raise RuntimeError("KubeServer.call() from the server's own thread; call the emulator directly")
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def run() -> None:
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as e:
                future.set_exception(e)

        self._loop.call_soon_threadsafe(run)
        return future.result(10)

    def get(self, resource: str, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        return self.call(self.emulator.get_object, resource, name, namespace)

    def list(
        self, resource: str, namespace: str | None = None, label_selector: str = "", field_selector: str = ""
    ) -> list[dict[str, Any]]:
        return self.call(self.emulator.list_objects, resource, namespace, label_selector, field_selector)

    def create(
        self, resource: str, body: dict[str, Any], namespace: str | None = None, *, keep_status: bool = False
    ) -> dict[str, Any]:
        return self.call(self.emulator.create_object, resource, body, namespace, keep_status=keep_status)

    def replace(
        self,
        resource: str,
        name: str,
        body: dict[str, Any],
        namespace: str | None = None,
        *,
        subresource: str | None = None,
    ) -> dict[str, Any]:
        return self.call(self.emulator.replace_object, resource, name, body, namespace, subresource=subresource)

    def patch(
        self,
        resource: str,
        name: str,
        patch: Any,
        namespace: str | None = None,
        *,
        subresource: str | None = None,
        patch_type: str = "merge",
    ) -> dict[str, Any]:
        return self.call(
            self.emulator.patch_object, resource, name, patch, namespace, subresource=subresource, patch_type=patch_type
        )

    def delete(
        self, resource: str, name: str, namespace: str | None = None, options: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        return self.call(self.emulator.delete_object, resource, name, namespace, options)

    def register_crds(self, directory: str | Path) -> list[ResourceSpec]:
        return self.call(self.emulator.register_crds, directory)

    def add_resource(self, spec: ResourceSpec) -> None:
        self.call(self.emulator.add_resource, spec)

    def write_kubeconfig(self, path: str | Path, namespace: str = "default") -> Path:
        """Write a kubeconfig (one cluster/user/context ``emulator``, plain http, a dummy token) and return its path."""
        path = Path(path)
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
            "users": [{"name": "emulator", "user": {"token": "emulator-token"}}],
            "contexts": [
                {"name": "emulator", "context": {"cluster": "emulator", "user": "emulator", "namespace": namespace}}
            ],
            "current-context": "emulator",
        }
        path.write_text(yaml.safe_dump(config))
        return path

    def api_client(self) -> Any:
        """A sync ``kubernetes.client.ApiClient`` for this server (its own ``Configuration``: ``$KUBECONFIG`` is not read)."""
        import kubernetes.client

        config = kubernetes.client.Configuration(host=self.url)
        return kubernetes.client.ApiClient(config)


# --- kopf in a thread -----------------------------------------------------------------------------


class KopfThread:
    """A kopf operator running against a ``KubeServer`` in a thread with its own event loop.

    Credentials come from a pre-filled vault (no login handler, no kubeconfig, ``$KUBECONFIG``
    is not read). Settings are tuned for fast tests (short backoffs and timeouts), then
    ``settings_hook(settings)`` may change them further.

    Usage::

        registry = kopf.OperatorRegistry()

        @kopf.on.create("rlrun.dev", "v1alpha1", "rlruns", registry=registry)
        def created(**_): ...

        with KopfThread(registry, kube):
            ...
    """

    def __init__(
        self,
        registry: Any,
        server: KubeServer | str,
        *,
        settings_hook: Callable[[Any], None] | None = None,
        clusterwide: bool = True,
        namespaces: Iterable[str] = (),
        memo: object | None = None,
    ) -> None:
        self.registry = registry
        self.url = server.url if isinstance(server, KubeServer) else server
        self.settings_hook = settings_hook
        self.clusterwide = clusterwide and not namespaces
        self.namespaces = list(namespaces)
        self.memo = memo
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stop = threading.Event()

    def start(self, timeout: float = 10.0) -> KopfThread:
        """Start the operator; returns once kopf reports it is ready (its watches are starting).

        Raises:
            RuntimeError: the operator did not get ready in ``timeout`` seconds or failed (chained).
        """
        self._ready.clear()
        self._stop.clear()
        self.error = None
        self._thread = threading.Thread(target=self._run, name="kopf-operator", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._ready.wait(0.01):
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self._stop.set()
                self._thread.join(timeout)
                self._thread = None
                raise RuntimeError(f"the kopf operator did not get ready within {timeout} s") from self.error
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the operator to stop, join its thread.

        Raises:
            RuntimeError: it did not stop within ``timeout`` seconds, or it failed (chained).
        """
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout)
        alive, self._thread = self._thread.is_alive(), None
        if alive:
            raise RuntimeError(f"the kopf operator did not stop within {timeout} s")
        if self.error is not None:
            raise RuntimeError("the kopf operator failed") from self.error

    def __enter__(self) -> KopfThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as e:
            self.error = e

    async def _main(self) -> None:
        import kopf
        from kopf._cogs.structs.credentials import Vault

        settings = kopf.OperatorSettings()
        settings.watching.reconnect_backoff = 0.05
        settings.watching.server_timeout = 60
        settings.networking.request_timeout = 10
        settings.networking.error_backoffs = [0.1, 0.2, 0.5]
        settings.queueing.idle_timeout = 0.5
        settings.queueing.exit_timeout = 0.1
        settings.background.instant_exit_timeout = 0.01
        settings.process.ultimate_exiting_timeout = 2
        if self.settings_hook is not None:
            self.settings_hook(settings)
        info = kopf.ConnectionInfo(server=self.url, insecure=True, scheme="Bearer", token="emulator-token")
        await kopf.operator(
            registry=self.registry,
            settings=settings,
            standalone=True,
            clusterwide=self.clusterwide,
            namespaces=self.namespaces,
            ready_flag=self._ready,
            stop_flag=self._stop,
            vault=Vault({"emulator": info}),
            memo=self.memo,
        )
