"""The ``RLRun`` CustomResourceDefinition, generated from the pydantic spec (``rlrun crd``).

The CRD is never edited by hand: :func:`build_crd` turns :class:`rlrun.api.spec.RLRunSpec`
and :class:`rlrun.api.status.RLRunStatus` into an ``apiextensions.k8s.io/v1`` structural
schema, and ``rlrun crd`` writes it to ``crds/`` and the Helm chart's ``crds/`` (a test
fails when either differs from the generated text).

Conversion rules, pydantic JSON Schema (2020-12) → Kubernetes OpenAPI v3 (structural):

- ``$ref`` inlined; ``title`` dropped; class docstrings become ``description`` (their first
  paragraph), ``Attributes:`` entries become the fields' descriptions (``kubectl explain``);
- ``anyOf: [X, null]`` → ``X`` with ``nullable: true``; ``const`` → one-value ``enum``;
- ``exclusiveMinimum: x`` → ``minimum: x, exclusiveMinimum: true`` (OpenAPI 3.0 form);
- tuples (``prefixItems``) → arrays of the common item type with ``minItems = maxItems``;
- free-form mappings (``dict[str, Any]``) → ``x-kubernetes-preserve-unknown-fields``;
- optional nested objects get ``default: {}`` so the API server applies their fields'
  defaults (defaulting recurses into objects that exist);
- cross-field rules of the pydantic validators (and single-field ones whose message says why) are
  repeated as CEL rules (``x-kubernetes-validations``), each written beside the validator it repeats
  (``*_CEL_RULES`` of :mod:`rlrun.api.spec`, :mod:`~rlrun.api.algorithm`, :mod:`~rlrun.api.run_settings`,
  :mod:`~rlrun.api.role_specs`, :mod:`~rlrun.api.pod_inputs` (each role's), :mod:`~rlrun.api.vllm_args`,
  :mod:`~rlrun.api.curriculum`, :mod:`~rlrun.api.lora`) and collected here, so ``kubectl apply`` rejects them.

Unknown fields are pruned by a structural schema; ``kubectl apply`` (field validation
``Strict`` by default since Kubernetes 1.27) rejects them with the field named.

Checking objects against the generated schema offline (JSON Schema, defaults, CEL rules)
is the tests' business: ``tests/support/crd_validation.py``.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from pathlib import Path
from typing import Any

import yaml

from rlrun.api.algorithm import LOSS_CEL_RULES, OPTIMIZER_CEL_RULES
from rlrun.api.curriculum import CURRICULUM_CEL_RULES
from rlrun.api.pod_inputs import ROLE_CEL_RULES
from rlrun.api.role_specs import TRAINER_CEL_RULES
from rlrun.api.run_settings import PREEMPTION_CEL_RULES, STORAGE_CEL_RULES
from rlrun.api.spec import (
    API_GROUP,
    API_VERSION,
    KIND,
    MODEL_CEL_RULES,
    NAME_CEL_RULES,
    RUN_CEL_RULES,
    RLRunSpec,
)
from rlrun.api.status import RLRunStatus
from rlrun.api.vllm_args import VLLM_ARGS_CEL_RULES

PLURAL = "rlruns"
SINGULAR = "rlrun"
SHORT_NAMES = ["rlr"]
CATEGORIES = ["rlrun", "all-rl"]
CRD_NAME = f"{PLURAL}.{API_GROUP}"
#: Where ``rlrun crd`` writes, relative to the repository root.
CRD_FILE = Path("crds") / f"{API_GROUP}_{PLURAL}.yaml"
CHART_CRD_FILE = Path("charts") / "rlrun-operator" / "crds" / f"{API_GROUP}_{PLURAL}.yaml"
#: The annotation holding the hash of the CRD's ``spec`` (:func:`schema_hash`). Helm installs ``crds/`` once and
#: never upgrades it: the operator compares the installed CRD's hash with its own to tell an outdated one.
SCHEMA_HASH_ANNOTATION = f"{API_GROUP}/schema-hash"

#: Every CEL rule but the roles' own, by the path of the spec object it sits on (``()`` = ``spec``), each written
#: beside the pydantic validator it repeats: collected here in the order they are added to the schema (on
#: ``spec.trainer``, :data:`~rlrun.api.role_specs.TRAINER_CEL_RULES` before :data:`ROLE_CEL_RULES`).
CEL_RULES: list[tuple[tuple[str, ...], list[dict[str, str]]]] = [
    *RUN_CEL_RULES.items(),
    (("optimizer",), OPTIMIZER_CEL_RULES),
    (("storage",), STORAGE_CEL_RULES),
    (("trainer",), TRAINER_CEL_RULES),
    (("preemption",), PREEMPTION_CEL_RULES),
]
#: The roles whose spec is a ``RoleSpec``: each gets :data:`rlrun.api.pod_inputs.ROLE_CEL_RULES`.
ROLES = ("orchestrator", "trainer", "rollout")

#: ``kubectl get rlrun`` columns.
PRINTER_COLUMNS = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase", "description": "Lifecycle phase"},
    {"name": "Step", "type": "integer", "jsonPath": ".status.step", "description": "Batches shipped to the trainer"},
    {
        "name": "Progress",
        "type": "string",
        "jsonPath": ".status.progress.text",
        "description": "Steps done of maxSteps",
    },
    {
        "name": "ETA",
        "type": "string",
        "jsonPath": ".status.progress.eta",
        "description": "Time left at the recent step rate",
    },
    {
        "name": "Resumed",
        "type": "integer",
        "jsonPath": ".status.resumedGroups",
        "description": "Rollout groups resumed from snapshots (open and requested groups), all attempts",
    },
    {
        "name": "Preemptions",
        "type": "integer",
        "jsonPath": ".status.preemptions",
        "description": "Attempts ended by a preemption",
    },
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    {
        "name": "Samples",
        "type": "integer",
        "jsonPath": ".status.resumedTraces",
        "description": "Queued samples restored from snapshots, all attempts",
        "priority": 1,
    },
    {
        "name": "Failures",
        "type": "integer",
        "jsonPath": ".status.failures",
        "description": "Recoveries started by a failed pod (counted against failure_policy.backoff_limit)",
        "priority": 1,
    },
    {"name": "Checkpoint", "type": "integer", "jsonPath": ".status.lastCheckpointStep", "priority": 1},
    {"name": "Attempt", "type": "integer", "jsonPath": ".status.attempt", "priority": 1},
    {"name": "Queue", "type": "string", "jsonPath": ".status.queue.name", "priority": 1},  # Kueue's LocalQueue
]


def _attributes(doc: str) -> dict[str, str]:
    """``{name: text}`` from the ``Attributes:`` section of a Google-style docstring."""
    out: dict[str, str] = {}
    lines = doc.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "Attributes:")
    except StopIteration:
        return out
    current = None
    for line in lines[start + 1 :]:
        if not line.strip():
            break
        m = re.match(r"^\s{2,}(\w+):\s*(.*)$", line)
        if m and (current is None or len(line) - len(line.lstrip()) <= 4):
            current = m.group(1)
            out[current] = m.group(2)
        elif current is not None:
            out[current] += " " + line.strip()
    return out


def _clean_doc(text: str) -> str:
    """First paragraph of a docstring, reST literals turned into plain quotes."""
    first = text.strip().split("\n\n")[0]
    return " ".join(first.split()).replace("``", "`")


class _Converter:
    def __init__(self, defs: dict[str, Any]) -> None:
        self.defs = defs

    def convert(self, node: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
        node = dict(node)
        if "$ref" in node:
            target = self.defs[node.pop("$ref").rsplit("/", 1)[-1]]
            node = {**target, **node}
        if "anyOf" in node:
            options = [o for o in node.pop("anyOf") if o.get("type") != "null"]
            if len(options) != 1:
                raise ValueError(f"spec{''.join('.' + p for p in path)}: unions are not expressible in a CRD")
            # the option's raw schema with the field's keys (a None default left out), converted once: converting
            # the option first and the merge again would turn an exclusive bound twice (`minimum: true`)
            out = self.convert({**options[0], **{k: v for k, v in node.items() if k != "default"}}, path)
            out["nullable"] = True
            return out
        out: dict[str, Any] = {}
        if "description" in node:
            out["description"] = _clean_doc(node["description"])
        kind = node.get("type")
        if "const" in node:
            out["type"] = kind or "string"
            out["enum"] = [node["const"]]
        elif kind == "object" or "properties" in node:
            out["type"] = "object"
            props = node.get("properties")
            extra = node.get("additionalProperties")
            if props:
                docs = _attributes(node.get("description", ""))
                out["properties"] = {}
                for name, sub in props.items():
                    conv = self.convert(sub, (*path, name))
                    if name in docs and "description" not in sub:
                        conv = {"description": _clean_doc(docs[name]), **conv}
                    elif name in docs:
                        conv["description"] = _clean_doc(docs[name])
                    out["properties"][name] = conv
                if node.get("required"):
                    out["required"] = list(node["required"])
            elif isinstance(extra, dict) and extra:
                out["additionalProperties"] = self.convert(extra, (*path, "*"))
            else:
                out["x-kubernetes-preserve-unknown-fields"] = True
        elif kind == "array":
            out["type"] = "array"
            if "prefixItems" in node:
                items = [self.convert(i, path) for i in node["prefixItems"]]
                if any(i != items[0] for i in items):
                    raise ValueError(f"spec.{'.'.join(path)}: tuples of mixed types are not expressible in a CRD")
                out["items"] = items[0]
            else:
                out["items"] = self.convert(node.get("items", {}), (*path, "[]"))
        elif kind is not None:
            out["type"] = kind
        for key in ("enum", "format", "pattern", "minLength", "maxLength", "minItems", "maxItems"):
            if key in node:
                out[key] = node[key]
        for key in ("minimum", "maximum"):
            if key in node:
                out[key] = node[key]
        if "exclusiveMinimum" in node:
            out["minimum"], out["exclusiveMinimum"] = node["exclusiveMinimum"], True
        if "exclusiveMaximum" in node:
            out["maximum"], out["exclusiveMaximum"] = node["exclusiveMaximum"], True
        if node.get("default") is not None:
            out["default"] = node["default"]
        return out


def _defaults_for_models(schema: dict[str, Any], model: type) -> None:
    """Add ``default: {}`` to optional nested objects and the factory defaults pydantic leaves out."""
    from pydantic import BaseModel

    for name, field in model.model_fields.items():
        prop = schema["properties"][name]
        if field.is_required():
            continue
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            prop.setdefault("default", {})
            _defaults_for_models(prop, ann)
        elif "default" not in prop and field.default_factory is not None:
            value = field.default_factory()
            if isinstance(value, list):  # a list of models (spec.curriculum.pools): as the manifest writes it
                value = [v.model_dump(mode="json") if isinstance(v, BaseModel) else v for v in value]
            if value not in ({}, [], None):
                prop["default"] = value
        items = prop.get("items")
        args = getattr(ann, "__args__", ())
        item_model = args[0] if args and isinstance(args[0], type) and issubclass(args[0], BaseModel) else None
        if items and "properties" in items and item_model is not None:
            _defaults_for_models(items, item_model)


def _schema_of(model: type) -> dict[str, Any]:
    js = model.model_json_schema(mode="validation")
    out = _Converter(js.get("$defs", {})).convert(js, ())
    _defaults_for_models(out, model)
    return out


def spec_schema() -> dict[str, Any]:
    """The OpenAPI v3 schema of ``RLRun.spec`` with CEL rules and list semantics."""
    schema = _schema_of(RLRunSpec)
    schema["properties"]["envs"]["x-kubernetes-list-type"] = "map"
    schema["properties"]["envs"]["x-kubernetes-list-map-keys"] = ["name"]
    for role in ROLES:  # the API server keeps volume and variable names unique
        for key in ("volumes", "env"):
            schema["properties"][role]["properties"][key]["x-kubernetes-list-type"] = "map"
            schema["properties"][role]["properties"][key]["x-kubernetes-list-map-keys"] = ["name"]
    rules = [*CEL_RULES]
    rules += [((role, *path), role_rules) for role in ROLES for path, role_rules in ROLE_CEL_RULES.items()]
    rules += [(("rollout", *path), path_rules) for path, path_rules in VLLM_ARGS_CEL_RULES.items()]
    rules += [(("loss", *path), path_rules) for path, path_rules in LOSS_CEL_RULES.items()]
    rules += [(("curriculum", *path), path_rules) for path, path_rules in CURRICULUM_CEL_RULES.items()]
    rules += [(("model", *path), path_rules) for path, path_rules in MODEL_CEL_RULES.items()]
    for path, path_rules in rules:
        node = schema
        for part in path:
            node = node["items"] if part == "[]" else node["properties"][part]
        node.setdefault("x-kubernetes-validations", []).extend(copy.deepcopy(path_rules))
    return schema


def status_schema() -> dict[str, Any]:
    """The OpenAPI v3 schema of ``RLRun.status`` (written by the operator)."""
    schema = _schema_of(RLRunStatus)
    conditions = schema["properties"]["conditions"]
    conditions["x-kubernetes-list-type"] = "map"
    conditions["x-kubernetes-list-map-keys"] = ["type"]
    return schema


def schema_hash(crd_spec: dict[str, Any]) -> str:
    """The first 16 hex digits of the SHA-256 of a CRD's ``spec`` as canonical JSON (sorted keys): what
    :data:`SCHEMA_HASH_ANNOTATION` holds. Any change to a field, default, rule or printer column changes it."""
    return hashlib.sha256(json.dumps(crd_spec, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def build_crd() -> dict[str, Any]:
    """The whole ``CustomResourceDefinition`` object (a dict ready for YAML), its schema hash annotated."""
    crd = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": CRD_NAME,
            "labels": {"app.kubernetes.io/name": "rlrun", "app.kubernetes.io/part-of": "rlrun"},
        },
        "spec": {
            "group": API_GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": SHORT_NAMES,
                "categories": CATEGORIES,
            },
            "versions": [
                {
                    "name": API_VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {
                        "openAPIV3Schema": {
                            "description": "An asynchronous GRPO training run: rollout, trainer and orchestrator "
                            "pods sharing one run directory, resumed without losing finished rollouts.",
                            "type": "object",
                            "required": ["spec"],
                            "x-kubernetes-validations": NAME_CEL_RULES,
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": spec_schema(),
                                "status": status_schema(),
                            },
                        }
                    },
                }
            ],
        },
    }
    crd["metadata"]["annotations"] = {SCHEMA_HASH_ANNOTATION: schema_hash(crd["spec"])}
    return crd


def render_crd() -> str:
    """The CRD as the YAML text written to disk (stable: same input, same bytes)."""
    header = "# Generated by `rlrun crd` from rlrun.api.spec and rlrun.api.status. Do not edit.\n"
    return header + yaml.safe_dump(build_crd(), sort_keys=False, allow_unicode=True, width=100)


def stale_crds(root: Path) -> list[Path]:
    """``rlrun crd --check``: the CRD files (:data:`CRD_FILE`, :data:`CHART_CRD_FILE`, relative to ``root``) missing
    under ``root`` or differing from what :func:`render_crd` writes; empty when both are up to date."""
    text = render_crd()
    return [p for p in (CRD_FILE, CHART_CRD_FILE) if not (root / p).is_file() or (root / p).read_text() != text]


def write_crds(root: Path) -> list[Path]:
    """Write the CRD to ``root/crds/`` and the chart's ``crds/``; returns the paths written."""
    text = render_crd()
    paths = []
    for rel in (CRD_FILE, CHART_CRD_FILE):
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        paths.append(path)
    return paths
