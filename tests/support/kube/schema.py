"""A CRD's ``openAPIV3Schema`` applied to writes as the API server does: defaults, pruning, validation.

Order matters and follows the API server: unknown fields are pruned and defaults applied
first, then the result is validated (a 422 names the first failing field by path). CEL rules
(``x-kubernetes-validations``) are not evaluated.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from .errors import ApiError
from .resources import ResourceSpec


# Not rlrun.crd.to_json_schema: that one rejects unknown fields and lets null into nullable enums (an offline check);
# the API server prunes unknown fields first (apply_schema) and rejects a null its enum lacks, as this one does.
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


# Not rlrun.crd.apply_defaults: that fills in defaults on a copy; a write also prunes, in place, reporting what went.
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


def validator(schema: dict[str, Any]) -> Any:
    """A ``jsonschema`` validator of objects against a CRD's schema (build once per resource: compiling is slow)."""
    import jsonschema

    return jsonschema.Draft202012Validator(to_json_schema(schema))


def admit(spec: ResourceSpec, obj: dict[str, Any], field_validation: str, validate: Any) -> list[str]:
    """Defaults, pruning and schema validation of a CRD's object, in place; returns the pruned fields (for warnings).

    Args:
        field_validation: ``Ignore``, ``Warn`` or ``Strict``: what to do about pruned (unknown) fields.
        validate: :func:`validator` of ``spec.schema``.

    Raises:
        ApiError: 400 for pruned fields under ``fieldValidation=Strict``; 422 for a schema violation.
    """
    unknown: list[str] = []
    if spec.schema is None:
        return unknown
    apply_schema(obj, spec.schema, "", unknown)
    if unknown and field_validation == "Strict":
        fields = ", ".join(f'unknown field "{field}"' for field in unknown)
        message = f"{spec.kind} in version {spec.version!r} cannot be handled as a {spec.kind}: strict decoding error: {fields}"
        raise ApiError(400, "BadRequest", message)
    if field_validation == "Ignore":
        unknown = []
    error = next(iter(sorted(validate.iter_errors(obj), key=lambda e: [str(p) for p in e.absolute_path])), None)
    if error is not None:
        field = ".".join(str(p) for p in error.absolute_path) or "<root>"
        value = json.dumps(error.instance)[:200]
        raise ApiError.invalid(spec.kind, obj["metadata"].get("name"), field, f"{value}: {error.message}", spec.group)
    return unknown
