"""A CRD's ``openAPIV3Schema`` checked offline: as JSON Schema, with its defaults, and its CEL rules.

What the API server would check, without one: :func:`to_json_schema` turns a structural
schema into JSON Schema for :mod:`jsonschema`, :func:`apply_defaults` fills in ``default``
values as the API server does before validating, :func:`cel_violations` evaluates the
``x-kubernetes-validations`` rules with cel-python. Test code only: ``jsonschema`` and
``celpy`` are dev dependencies. The Kubernetes API emulator (``tests/support/kube``) uses
the same :func:`to_json_schema`, in its API-server mode.
"""

from __future__ import annotations

import copy
from typing import Any

#: Keys of a schema node that hold schemas (or lists of them).
_SCHEMA_NESTING = ("items", "additionalProperties", "allOf", "anyOf", "oneOf", "not")


def to_json_schema(schema: Any, *, reject_unknown_fields: bool = True, null_in_nullable_enums: bool = True) -> Any:
    """An OpenAPI v3 (CRD) schema as JSON Schema (2020-12) for :mod:`jsonschema`.

    ``nullable`` adds a ``null`` type, OpenAPI 3.0's boolean ``exclusiveMinimum`` /
    ``exclusiveMaximum`` become JSON Schema's numeric ones, ``x-kubernetes-int-or-string``
    becomes ``anyOf`` integer or string; other ``x-kubernetes-*`` keys are left for JSON
    Schema to ignore (CEL rules: :func:`cel_violations`).

    The defaults are an offline check of a whole object. The API server (the emulator's mode:
    both False) differs in two ways, both parameters:

    Args:
        reject_unknown_fields: objects with ``properties`` (and no ``additionalProperties`` schema,
            no ``x-kubernetes-preserve-unknown-fields``) reject other fields, as ``kubectl apply``'s
            strict field validation does. False where unknown fields are pruned before validation.
        null_in_nullable_enums: a ``nullable`` enum also takes ``null``. False: ``null`` passes an
            enum only when the enum lists it (what the API server answers).
    """

    def convert(sub: Any) -> Any:
        return to_json_schema(
            sub, reject_unknown_fields=reject_unknown_fields, null_in_nullable_enums=null_in_nullable_enums
        )

    if isinstance(schema, list):
        return [convert(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: convert(v) if k in _SCHEMA_NESTING else v for k, v in schema.items()}
    if "properties" in schema:
        out["properties"] = {k: convert(v) for k, v in schema["properties"].items()}
        preserve = schema.get("x-kubernetes-preserve-unknown-fields") or "additionalProperties" in schema
        if reject_unknown_fields and not preserve:
            out["additionalProperties"] = False
    if schema.get("x-kubernetes-int-or-string") and "type" not in schema:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if schema.get("nullable") and "type" in schema:
        out["type"] = [schema["type"], "null"]
        if null_in_nullable_enums and "enum" in schema:
            out["enum"] = [*schema["enum"], None]
    for bound in ("Minimum", "Maximum"):  # OpenAPI 3.0's boolean exclusive bounds are numbers in JSON Schema
        if isinstance(schema.get(f"exclusive{bound}"), bool):
            limit = out.pop(bound.lower(), None)
            out.pop(f"exclusive{bound}")
            if schema[f"exclusive{bound}"] and limit is not None:
                out[f"exclusive{bound}"] = limit
            elif limit is not None:
                out[bound.lower()] = limit
    return out


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """A copy of ``value`` with the schema's defaults filled in, as the API server does before validation."""
    if not isinstance(value, dict) or "properties" not in schema:
        if isinstance(value, list) and "items" in schema:
            return [apply_defaults(schema["items"], v) for v in value]
        return value
    out = dict(value)
    for name, sub in schema["properties"].items():
        if name not in out and "default" in sub:
            out[name] = copy.deepcopy(sub["default"])
        if name in out:
            out[name] = apply_defaults(sub, out[name])
    return out


def cel_violations(schema: dict[str, Any], value: Any, old: Any = None, path: str = "") -> list[str]:
    """Evaluate the schema's ``x-kubernetes-validations`` on ``value`` (defaults applied first).

    ``old`` is the previous object for transition rules (``oldSelf``); without it those rules
    are skipped, as the API server does on create. Returns ``"<path>: <message>"`` lines.
    """
    import celpy

    value = apply_defaults(schema, value)
    old = apply_defaults(schema, old) if old is not None else None
    errors: list[str] = []
    env = celpy.Environment()
    for rule in schema.get("x-kubernetes-validations", []):
        if "oldSelf" in rule["rule"] and old is None:
            continue
        activation = {"self": celpy.json_to_cel(value)}
        if old is not None:
            activation["oldSelf"] = celpy.json_to_cel(old)
        result = env.program(env.compile(rule["rule"])).evaluate(activation)
        if result is not True and not (isinstance(result, celpy.celtypes.BoolType) and bool(result)):
            errors.append(f"{path}{rule.get('fieldPath', '')}: {rule['message']}")
    if isinstance(value, dict):
        for name, sub in schema.get("properties", {}).items():
            if name in value:
                sub_old = old.get(name) if isinstance(old, dict) else None
                errors += cel_violations(sub, value[name], sub_old, f"{path}.{name}")
    elif isinstance(value, list) and "items" in schema:  # items' rules, without oldSelf (items are not paired)
        for i, item in enumerate(value):
            errors += cel_violations(schema["items"], item, None, f"{path}[{i}]")
    return errors
