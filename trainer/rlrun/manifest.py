"""Reading ``RLRun`` manifests: YAML or a decoded dict in, a validated :class:`~rlrun.api.spec.RLRun` out.

What ``rlrun local``, every pod's ``rlrun`` command and the operator use to accept a
manifest. A manifest is either valid or refused with every problem named by its path and
the reason, one line each (``spec.group_size: must be ≥ 2``, ``spec.envs[0].name: unknown
env 'x'; …``): :class:`ManifestError`. Besides the models' own validation (:mod:`rlrun.api.spec`),
every env is built once and every reward loaded, so an unknown env, bad ``args``, a dataset file that
is missing, a reward path that does not import, or a reward requiring a field its env's tasks never
fill (a column the dataset lacks, ``answer`` included: :func:`reward_argument_error`) fails here and
not in a pod later (the operator checks what its own image can: :func:`env_errors`).
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import ValidationError

from rlrun.api.pod_inputs import DNS_LABEL_PATTERN, QUANTITY_PATTERN
from rlrun.api.spec import NAME_PATTERN, EnvSpec, RLRun, RLRunSpec
from rlrun.envs import BUILTIN_ENVS, Env, EnvArgsError, UnknownEnvError, make_env, resolve_env
from rlrun.envs.base import has_task_keys
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
        fields: TaskFields | None = None
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


#: How many train tasks show an env's task fields (a dataset's tasks all have its columns): a field is
#: passed when one of them has it, and has a value when one holds something other than None.
FIELD_SAMPLE = 16
#: How far a field a reward requires, None in every sampled task, is looked for before the reward is
#: refused: a finite env's whole train split (one epoch) up to this many tasks.
FIELD_SEARCH = 200_000
#: The same for a procedural env (no ``num_rows``): its first this many train tasks.
PROCEDURAL_SEARCH = 1024


@dataclass
class TaskFields:
    """The task fields an env hands its rewards (:func:`rlrun.rewards.scoring.task_fields`), as read
    from its train tasks of ``seed``.

    Attributes:
        names: every field passed, sorted (``answer`` always: None for a task without one).
        valued: the fields some task read so far holds a value (not None) for.
        read: how many train tasks were read (the first ``read`` of ``seed``'s stream).
        rows: the train split's rows for a finite env (``num_rows``), None for a procedural one.
    """

    env: Env
    seed: int
    names: list[str]
    valued: set[str] = field(default_factory=set)
    read: int = 0
    rows: int | None = None

    def read_until(self, stop: int, wanted: set[str] | None = None) -> None:
        """Read tasks ``read … stop − 1`` (fewer once every name of ``wanted`` has a value), adding
        their fields.

        Raises:
            whatever the env's ``task`` raises.
        """
        from rlrun.rewards.scoring import task_fields

        while self.read < stop and (wanted is None or not wanted <= self.valued):
            fields = task_fields(self.env.task(self.seed, self.read, "train"))
            self.names = sorted({*self.names, *fields})
            self.valued.update(k for k, v in fields.items() if v is not None)
            self.read += 1

    def always_none(self, names: list[str]) -> list[str]:
        """Those of ``names`` (passed fields) None in every train task: a finite env's whole split (up
        to :data:`FIELD_SEARCH` tasks), a procedural env's first :data:`PROCEDURAL_SEARCH`."""
        suspects = {n for n in names if n not in self.valued}
        if suspects:
            stop = min(self.rows, FIELD_SEARCH) if self.rows is not None else PROCEDURAL_SEARCH
            with contextlib.suppress(Exception):  # a task it cannot make: judged on those read
                self.read_until(stop, suspects)
        return [n for n in names if n not in self.valued]

    def scope(self) -> str:
        """The tasks read, in words (``its 20 train tasks``, ``its first 1024 train tasks``)."""
        first = "" if self.read == self.rows else "first "
        return f"its {first}{self.read} train tasks"


def _env_fields(env: Env, seed: int) -> TaskFields | None:
    """The task fields ``env`` hands its rewards, from its first :data:`FIELD_SAMPLE` train tasks
    (None: its tasks cannot be made here; the run will say why)."""
    try:
        num_rows = getattr(env, "num_rows", None)
        rows = int(num_rows("train")) if callable(num_rows) else None
        fields = TaskFields(env, seed, ["answer"], rows=rows)
        fields.read_until(FIELD_SAMPLE if rows is None else min(FIELD_SAMPLE, rows))
        return fields
    except Exception:
        return None


def reward_argument_error(
    func: Any,
    what: str,
    env_name: str,
    env: Env,
    fields: TaskFields | None,
) -> str | None:
    """Why reward ``func`` would fail or score nothing for env ``env``, or None.

    Refused: a parameter it requires (no default) that the env does not pass, or passes only as None
    (a field no train task has a value for, e.g. ``answer`` over a dataset without an answer column:
    the reward would get ``[None] * n`` and score nothing, issue 47); or, without ``**kwargs``, an
    argument every call passes that it does not take. ``fields``: the env's task fields
    (:func:`_env_fields`; None: unknown, not checked). The message names the parameter, the reward
    and what the env passes (a dataset's columns: its ``field_hint``).
    """
    from rlrun.rewards.calls import CALL_ARGUMENTS, TRAINER_ARGUMENTS

    if fields is None:
        return None
    calls = [*CALL_ARGUMENTS, *TRAINER_ARGUMENTS]
    absent, refused = argument_problems(func, [*calls, *fields.names])
    needed, _ = argument_problems(func, calls)  # what it requires beyond the call's own arguments
    empty = fields.always_none([n for n in needed if n in fields.names])
    label = f"reward function {what}" if ":" in what else f"reward {what!r}"
    missing = absent + empty
    if missing:
        valued = [n for n in fields.names if n not in fields.always_none(fields.names)]
        hint = getattr(env, "field_hint", None)
        if missing[0] in empty and missing[0] in getattr(env, "columns", ()):
            hint = None  # a column empty in every row: "none … has a value" says it
        empties, it = ", ".join(map(repr, empty)), "it" if len(empty) == 1 else "them"
        return (
            f"{label} requires {'argument' if len(missing) == 1 else 'arguments'} "
            f"{', '.join(map(repr, missing))}, which env {env_name} does not pass"
            + (f" ({empties} only as None: none of {fields.scope()} has a value for {it})" if empty else "")
            + f"; it passes {', '.join(calls)} and "
            + (f"its task fields {', '.join(valued)}" if valued else "no task field")
            + (f" ({hint(missing[0])})" if callable(hint) else "")
            + "; or give the parameter a default"
        )
    if refused:
        return (
            f"{label} takes no **kwargs and no parameter for {', '.join(refused)}, which every call "
            "passes: end its signature with **kwargs (TRL's convention)"
        )
    return None


def curriculum_warnings(spec: RLRunSpec) -> list[str]:
    """One sentence per env a non-uniform ``spec.curriculum`` cannot act on: an env without a finite task space
    (:func:`~rlrun.envs.base.has_task_keys`: a procedural env makes a new task at every index) keeps no per-task
    history, and is drawn uniformly whatever the policy. Printed by ``rlrun validate`` and ``rlrun local``, logged by
    the orchestrator; empty for ``uniform``."""
    policy = spec.curriculum.policy
    if policy == "uniform":
        return []
    return [
        f"spec.curriculum.policy {policy} does not apply to env {e.name}: it makes a new task at every index (no "
        "finite task space to keep a per-task history of), so it is drawn uniformly (docs/algorithms.md, Curriculum)"
        for e in spec.envs
        if inspect.isclass(factory := resolve_env(e.name)) and not has_task_keys(factory)  # a factory: unknown
    ]


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
