"""Label and field selectors (``?labelSelector=``, ``?fieldSelector=``) as predicates on objects."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from .errors import ApiError

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
    """A predicate on a labels dict for a ``labelSelector`` (``k=v``, ``k!=v``, ``k``, ``!k``, ``k in (a,b)``,
    ``k notin (a)``).

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


def object_matcher(
    namespace: str | None, name: str | None, labels: str, fields: str
) -> Callable[[dict[str, Any]], bool]:
    """A predicate on an object for a request's scope: its namespace and name (None: any) and selectors.

    Raises:
        ApiError: 400 for a selector it cannot parse.
    """
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
