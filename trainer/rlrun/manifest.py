"""Reading ``RLRun`` manifests: YAML or a decoded dict in, a validated :class:`~rlrun.api.spec.RLRun` out.

What ``rlrun local``, every pod's ``rlrun`` command and the operator use to accept a
manifest. A manifest is either valid or refused with every problem named by its path and
the reason, one line each (``spec.group_size: must be ≥ 2``, ``spec.envs[0].name: unknown
env 'x'; …``): :class:`ManifestError`. Besides the models' own validation (:mod:`rlrun.api.spec`),
every env is built once and every reward loaded, so an unknown env, bad ``args``, a dataset file that
is missing, or a reward path that does not import fails here and not in a pod later (the operator
checks what its own image can: :func:`env_errors`).
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import ValidationError

from rlrun.api.pod_inputs import DNS_LABEL_PATTERN, QUANTITY_PATTERN
from rlrun.api.spec import NAME_PATTERN, EnvSpec, RLRun, RLRunSpec
from rlrun.envs import BUILTIN_ENVS, Env, EnvArgsError, UnknownEnvError, make_env, resolve_env
from rlrun.rewards.loading import RewardArgsError, argument_problems, load_reward
from rlrun.tracking.backends import missing_packages

#: How far a manifest's envs and rewards are checked (:func:`env_errors`): ``full`` (where the run's env code and
#: data are: ``rlrun local``/``validate``, the orchestrator) or ``static`` (what needs neither: the operator, the
#: trainer and rollout pods).
Checks = Literal["full", "static"]


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


#: What a value must look like, by the pattern it did not match (a regex alone says little to a user).
_PATTERNS = {
    QUANTITY_PATTERN: "must be a Kubernetes quantity (e.g. 500m, 2, 16Gi)",
    DNS_LABEL_PATTERN: "must be a DNS label: lowercase letters, digits and '-', starting and ending alphanumeric",
    NAME_PATTERN: "must start with a lowercase letter, then lowercase letters, digits and '-', ending alphanumeric",
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
        elif err["type"] == "string_pattern_mismatch" and err["loc"][-1] == "function":  # a reward's import path
            reason = f"must be an import path module:attr (e.g. my_pkg.rewards:accuracy), got {err['input']!r}"
        elif err["type"] == "string_pattern_mismatch" and err.get("ctx", {}).get("pattern") in _PATTERNS:
            reason = f"{_PATTERNS[err['ctx']['pattern']]}, got {err['input']!r}"
        lines.append(f"{path or '<root>'}: {reason}")
    return lines


def parse_manifest(data: Any, source: str = "<manifest>", checks: Checks = "full") -> RLRun:
    """Validate a decoded manifest (a dict) into an :class:`RLRun`, its envs and rewards checked (:func:`env_errors`).

    Args:
        checks: ``full`` or ``static`` (:data:`Checks`, :func:`env_errors`).

    Raises:
        ManifestError: with one line per invalid field (``source`` names the manifest in the message).
    """
    if not isinstance(data, dict):
        raise ManifestError(source, [f"<root>: must be a mapping (an RLRun object), got {type(data).__name__}"])
    try:
        run = RLRun.model_validate(data)
    except ValidationError as exc:
        raise ManifestError(source, format_validation_error(exc)) from None
    errors = env_errors(run.spec, checks)
    if checks == "full":  # the orchestrator logs to the trackers: the operator's image need not hold them
        errors += missing_packages(run.spec.logging)
    if errors:
        raise ManifestError(source, errors)
    return run


def env_errors(spec: RLRunSpec, checks: Checks = "full") -> list[str]:
    """``["spec.envs[0].name: unknown env …", …]``: every env of ``spec`` built once and its rewards loaded; empty
    when all are fine.

    ``checks="full"`` also checks each reward function's signature against what its env passes (TRL's arguments
    and the env's task fields, e.g. a dataset's columns: :func:`reward_argument_error`), and, for the builtin
    ``tiny`` model, that the warm start will find demonstrations (:func:`warm_start_error`).

    ``checks="static"``: the operator's image holds neither the user's env packages nor their data (those
    reach the orchestrator pod: a custom image, a mounted volume), nor do the trainer and rollout pods need
    them, so it checks the builtin envs' ``args`` against their constructors without building those that
    read run data (``reads_run_data``, e.g. ``dataset``), and the builtin rewards; installed envs, import
    paths and reward functions are left to the orchestrator, which refuses them at start with the same message.
    """
    errors = []
    envs = {e.name for e in spec.envs}
    built: list[tuple[str, Env]] = []
    for i, env_spec in enumerate(spec.envs):
        at = f"spec.envs[{i}]"
        env = None
        try:
            if checks == "full" or env_spec.name in BUILTIN_ENVS:
                env = _check_env(env_spec, checks)
        except UnknownEnvError as exc:
            errors.append(f"{at}.name: {exc}")
        except EnvArgsError as exc:
            errors.append(f"{at}.args: {exc}")
        if env is not None:
            built.append((env_spec.name, env))
        fields: list[str] | None = None
        for j, reward in enumerate(env_spec.rewards):
            field = "name" if reward.name is not None else "function"
            if reward.series in envs - {env_spec.name}:
                errors.append(f"{at}.rewards[{j}].label: reward/{reward.series} is the series of env {reward.series}")
            if checks == "static" and reward.function is not None:
                continue
            try:
                func = load_reward(reward)
            except RewardArgsError as exc:
                errors.append(f"{at}.rewards[{j}].args: {exc}")
                continue
            except ValueError as exc:
                errors.append(f"{at}.rewards[{j}].{field}: {exc}")
                continue
            if checks == "full" and env is not None:
                if fields is None:
                    fields = _env_fields(env, spec.seed)
                problem = reward_argument_error(func, reward.name or reward.function, env_spec.name, env, fields)
                if problem:
                    errors.append(f"{at}.rewards[{j}].{field}: {problem}")
    if checks == "full" and spec.model.builtin == "tiny" and len(built) == len(spec.envs):
        problem = warm_start_error(built)
        if problem:
            errors.append(f"spec.model.builtin: {problem}")
    return errors


def _env_fields(env: Env, seed: int) -> list[str] | None:
    """The task fields ``env`` hands its rewards (None: its tasks cannot be made here; the run will say why)."""
    from rlrun.rewards.scoring import env_fields

    try:
        return env_fields(env, seed)
    except Exception:
        return None


def reward_argument_error(func: Any, what: str, env_name: str, env: Env, fields: list[str] | None) -> str | None:
    """Why every call of reward ``func`` would fail for env ``env`` — a parameter it requires that the env does not
    pass, or (without ``**kwargs``) an argument it does not take — or None. ``fields``: the env's task fields
    (:func:`rlrun.rewards.scoring.env_fields`; None: unknown, not checked)."""
    from rlrun.rewards.scoring import CALL_ARGUMENTS, TRAINER_ARGUMENTS

    if fields is None:
        return None
    passed = [*CALL_ARGUMENTS, *TRAINER_ARGUMENTS, *fields]
    missing, refused = argument_problems(func, passed)
    label = f"reward function {what}" if ":" in what else f"reward {what!r}"
    if missing:
        names = ", ".join(repr(m) for m in missing)
        hint = getattr(env, "field_hint", None)
        return (
            f"{label} requires {'argument' if len(missing) == 1 else 'arguments'} {names}, which env {env_name} does "
            f"not pass; it passes {', '.join(CALL_ARGUMENTS + TRAINER_ARGUMENTS)} and its task fields "
            f"{', '.join(fields)}"
            + (f" ({hint(missing[0])})" if callable(hint) else "")
            + "; or give the parameter a default"
        )
    if refused:
        return (
            f"{label} takes no **kwargs and no parameter for {', '.join(refused)}, which every call passes: end its "
            "signature with **kwargs (TRL's convention)"
        )
    return None


def warm_start_error(envs: list[tuple[str, Env]]) -> str | None:
    """Why the builtin ``tiny`` model's warm start would find nothing to teach on ``envs`` (no env gives a usable
    demonstration), with what to set; None when it will find some."""
    from rlrun.model.chat_tokenizer import build_chat_tokenizer
    from rlrun.model.demonstrations import probe_demonstrations
    from rlrun.model.recipe import TinyEnvsRecipe

    recipe = TinyEnvsRecipe()
    error = probe_demonstrations(envs, build_chat_tokenizer(), recipe.max_position_embeddings, recipe.seed)
    return str(error) if error is not None else None


def _check_env(spec: EnvSpec, checks: Checks) -> Env | None:
    """Build the env of ``spec`` (``static``: only bind its args when it reads run data; None then)."""
    if checks == "static":
        factory = resolve_env(spec.name)
        if getattr(factory, "reads_run_data", False):
            try:
                inspect.signature(factory).bind(**spec.args)
            except TypeError as exc:
                raise EnvArgsError(f"env {spec.name!r}: bad args {spec.args}: {exc}") from None
            return None
    return make_env(spec)


def load_manifest(path: str | Path, checks: Checks = "full") -> RLRun:
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
    return parse_manifest(docs[0], str(path), checks)
