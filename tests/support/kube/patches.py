"""PATCH bodies: RFC 7386 merge patches, RFC 6902 JSON patches, and which one a request's Content-Type asks for.

Strategic-merge patches are served as merge patches (lists are replaced, not merged by key).
"""

from __future__ import annotations

import copy
from typing import Any

from .errors import ApiError
from .resources import ResourceSpec

#: Content types applied as a merge patch (strategic merge and plain ``application/json`` included).
MERGE_PATCH_TYPES = ("application/merge-patch+json", "application/strategic-merge-patch+json", "application/json")
JSON_PATCH_TYPE = "application/json-patch+json"


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


def apply_patch(spec: ResourceSpec, current: dict[str, Any], patch: Any, content_type: str) -> dict[str, Any]:
    """``current`` (a stored object) with a PATCH request's body applied as its ``Content-Type`` says.

    Raises:
        ApiError: 422 for a JSON patch that does not apply, 400 for a merge patch that is no object,
            409 for a merge patch naming a stale ``metadata.resourceVersion``, 415 for another content type.
    """
    name = current["metadata"]["name"]
    if content_type == JSON_PATCH_TYPE:
        try:
            return json_patch(current, patch)
        except PatchError as e:
            message = f"the server rejected our request due to an error in our request: {e}"
            raise ApiError(422, "Invalid", message, {"name": name, "group": spec.group, "kind": spec.plural}) from e
    if content_type in MERGE_PATCH_TYPES:
        if not isinstance(patch, dict):
            raise ApiError(400, "BadRequest", "a merge patch must be a JSON object")
        rv = (patch.get("metadata") or {}).get("resourceVersion")
        if rv not in (None, "", current["metadata"]["resourceVersion"]):
            raise ApiError.conflict(spec, name)
        return merge_patch(current, patch)
    raise ApiError(415, "UnsupportedMediaType", f"the body of the request was in an unknown format: {content_type}")
