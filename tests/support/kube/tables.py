"""Server-side printing: the ``meta.k8s.io/v1`` Table kubectl asks for (``Accept: ...;as=Table``).

Served for kinds with printer columns (CRDs' ``additionalPrinterColumns``); kubectl prints
other kinds itself (NAME and AGE).
"""

from __future__ import annotations

import datetime
import json
import re
from typing import Any

import aiohttp.web

from .resources import ResourceSpec
from .timestamps import parse


def wants_table(raw: aiohttp.web.BaseRequest, spec: ResourceSpec) -> bool:
    """kubectl asks for server-side printing (``as=Table``); served for kinds with printer columns (CRDs)."""
    return bool(spec.printer_columns) and "as=Table" in raw.headers.get("Accept", "")


#: one step of a printer column's JSONPath: ``.field``, optionally filtered ``.list[?(@.key=='value')]``
_STEP = re.compile(r"\.([^.\[]+)(?:\[\?\(@\.([^=]+)==['\"]([^'\"]*)['\"]\)\])?")


def _json_path(obj: Any, path: str) -> Any:
    """The value at a printer column's JSONPath or None: fields (``.status.phase``) and list filters
    (``.status.conditions[?(@.type=='Ready')].status``: the first item that matches)."""
    for field, key, value in _STEP.findall(path if path.startswith(".") else f".{path}"):
        obj = obj.get(field) if isinstance(obj, dict) else None
        if key:
            obj = next((item for item in obj or [] if isinstance(item, dict) and item.get(key) == value), None)
    return obj


def _age(timestamp: str | None) -> str | None:
    """A creation timestamp as the API server prints a ``date`` column: ``42s``, ``5m``, ``3h``, ``2d``."""
    if not timestamp:
        return None
    seconds = max(0, int((datetime.datetime.now(datetime.timezone.utc) - parse(timestamp)).total_seconds()))
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


def table_event(spec: ResourceSpec, line: bytes) -> bytes:
    """A watch event line with its object turned into a one-row Table (as the API server sends to kubectl)."""
    event = json.loads(line)
    obj = event.get("object") or {}
    if event.get("type") in ("ADDED", "MODIFIED", "DELETED") and "metadata" in obj:
        event["object"] = table(spec, [obj], obj["metadata"].get("resourceVersion", ""))
    return json.dumps(event).encode() + b"\n"
