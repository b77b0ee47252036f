"""Reading ``RLRun`` manifests: YAML or a decoded dict in, a validated :class:`~rlrun.api.spec.RLRun` out.

What ``rlrun local``, every pod's ``rlrun`` command and the operator use to accept a
manifest. A manifest is either valid or refused with every problem named by its path and
the reason, one line each (``spec.group_size: must be ≥ 2``, ``spec.envs[0].name: unknown
env 'x'; …``): :class:`ManifestError`. Besides the models' own validation (:mod:`rlrun.api.spec`),
every env is built once, so an unknown env or bad ``args`` fails here and not in a pod later.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from rlrun.api.spec import RLRun, RLRunSpec
from rlrun.envs import EnvArgsError, UnknownEnvError, make_env


class ManifestError(ValueError):
    """A manifest that cannot be used; ``errors`` holds one ``"path: reason"`` line per problem.

    Retrying cannot heal it (``permanent``, exit reason ``reason``: :func:`rlrun.errors.classify_error`).
    """

    permanent = True
    reason = "InvalidManifest"

    def __init__(self, source: str, errors: list[str]) -> None:
        self.source = source
        self.errors = errors
        super().__init__(f"invalid RLRun manifest {source}:\n" + "\n".join(f"  {e}" for e in errors))


_REASONS = {
    "greater_than_equal": lambda c: f"must be ≥ {c['ge']}",
    "greater_than": lambda c: f"must be > {c['gt']}",
    "less_than_equal": lambda c: f"must be ≤ {c['le']}",
    "less_than": lambda c: f"must be < {c['lt']}",
    "missing": lambda c: "required field is missing",
    "extra_forbidden": lambda c: "unknown field",
    "too_short": lambda c: f"must have at least {c.get('min_length')} item(s)",
    "string_too_short": lambda c: f"must have at least {c.get('min_length')} character(s)",
    "literal_error": lambda c: f"must be one of {c.get('expected')}",
    "string_pattern_mismatch": lambda c: f"must match {c.get('pattern')}",
    "string_too_long": lambda c: f"must have at most {c.get('max_length')} character(s)",
    "too_long": lambda c: f"must have at most {c.get('max_length')} item(s)",
    "int_type": lambda c: "must be an integer",
    "int_from_float": lambda c: "must be an integer",
    "float_type": lambda c: "must be a number",
    "bool_type": lambda c: "must be true or false",
    "string_type": lambda c: "must be a string",
    "dict_type": lambda c: "must be a mapping",
    "list_type": lambda c: "must be a list",
}


def format_validation_error(exc: ValidationError) -> list[str]:
    """``["spec.group_size: must be ≥ 2", …]`` from a pydantic error (paths dotted, list indices in brackets)."""
    lines = []
    for err in exc.errors():
        path = ""
        for part in err["loc"]:
            if isinstance(part, int):
                path += f"[{part}]"
            elif part.startswith("function-") or part in ("tagged-union",):
                continue
            else:
                path += f".{part}" if path else str(part)
        fmt = _REASONS.get(err["type"])
        reason = fmt(err.get("ctx") or {}) if fmt else err["msg"]
        if err["type"] == "value_error":
            reason = str(err["ctx"]["error"]) if "ctx" in err else err["msg"]
        lines.append(f"{path or '<root>'}: {reason}")
    return lines


def parse_manifest(data: Any, source: str = "<manifest>") -> RLRun:
    """Validate a decoded manifest (a dict) into an :class:`RLRun`, its envs built once.

    Raises:
        ManifestError: with one line per invalid field (``source`` names the manifest in the message).
    """
    if not isinstance(data, dict):
        raise ManifestError(source, [f"<root>: must be a mapping (an RLRun object), got {type(data).__name__}"])
    try:
        run = RLRun.model_validate(data)
    except ValidationError as exc:
        raise ManifestError(source, format_validation_error(exc)) from None
    errors = env_errors(run.spec)
    if errors:
        raise ManifestError(source, errors)
    return run


def env_errors(spec: RLRunSpec) -> list[str]:
    """``["spec.envs[0].name: unknown env …", …]``: builds every env of ``spec`` once; empty when all build."""
    errors = []
    for i, env in enumerate(spec.envs):
        try:
            make_env(env)
        except UnknownEnvError as exc:
            errors.append(f"spec.envs[{i}].name: {exc}")
        except EnvArgsError as exc:
            errors.append(f"spec.envs[{i}].args: {exc}")
    return errors


def load_manifest(path: str | Path) -> RLRun:
    """Read and validate a YAML manifest holding exactly one ``RLRun``.

    Raises:
        ManifestError: unreadable YAML, several documents, or invalid fields.
        FileNotFoundError: ``path`` does not exist.
    """
    text = Path(path).read_text()
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise ManifestError(str(path), [f"<root>: not valid YAML: {exc}"]) from None
    if len(docs) != 1:
        raise ManifestError(str(path), [f"<root>: expected exactly one YAML document, found {len(docs)}"])
    return parse_manifest(docs[0], str(path))
