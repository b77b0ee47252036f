"""A CRD's ``openAPIV3Schema`` applied to writes as the API server does: defaults, pruning, validation.

Order matters and follows the API server: unknown fields are pruned and defaults applied
first, then the result is validated (a 422 names the first failing field by path). CEL rules
(``x-kubernetes-validations``) are not evaluated.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from ..crd_validation import to_json_schema
from .errors import ApiError
from .resources import ResourceSpec


# Not crd_validation.apply_defaults: that fills in defaults on a copy; a write also prunes, in place, reporting what
# went.
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
    """A ``jsonschema`` validator of objects against a CRD's schema (build once per resource: compiling is slow).

    As the API server validates a write: after :func:`apply_schema` pruned unknown fields, and a
    null passes a nullable enum only when the enum lists it.
    """
    import jsonschema

    return jsonschema.Draft202012Validator(
        to_json_schema(schema, reject_unknown_fields=False, null_in_nullable_enums=False)
    )


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
        message = (
            f"{spec.kind} in version {spec.version!r} cannot be handled as a {spec.kind}: "
            f"strict decoding error: {fields}"
        )
        raise ApiError(400, "BadRequest", message)
    if field_validation == "Ignore":
        unknown = []
    error = next(iter(sorted(validate.iter_errors(obj), key=lambda e: [str(p) for p in e.absolute_path])), None)
    if error is not None:
        field = ".".join(str(p) for p in error.absolute_path) or "<root>"
        value = json.dumps(error.instance)[:200]
        raise ApiError.invalid(spec.kind, obj["metadata"].get("name"), field, f"{value}: {error.message}", spec.group)
    return unknown
