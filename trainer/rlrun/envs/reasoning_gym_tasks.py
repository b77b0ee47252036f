"""reasoning-gym's tasks for the ``reasoning-gym`` env: a mixture member checked by name and config, and its items'
metadata made JSON-compatible (and back) so a reward rebuilds the entry reasoning-gym's ``score_answer`` expects
from a :class:`~rlrun.envs.base.Task` alone.
"""

from __future__ import annotations

import difflib
import functools
import importlib.metadata
import math
import threading
from dataclasses import dataclass, field
from typing import Any

import reasoning_gym
import reasoning_gym.factory

#: Items a member's config must generate one of to be accepted (some configs validate and generate nothing).
TRIAL_ITEMS = 4


def to_json(value: Any) -> tuple[Any, list[list[Any]]]:
    """``(json_value, tuple_paths)``: ``value`` with tuples as lists (their paths, lists of keys and indices, in
    ``tuple_paths``), sets as lists sorted by ``repr``, dict keys as strings, NumPy values as Python ones and
    anything else JSON cannot hold as its ``str``."""
    tuples: list[list[Any]] = []

    def walk(v: Any, path: tuple[Any, ...]) -> Any:
        if isinstance(v, dict):
            return {str(k): walk(x, (*path, str(k))) for k, x in v.items()}
        if isinstance(v, (set, frozenset)):
            v = sorted(v, key=repr)
        elif isinstance(v, tuple):
            tuples.append(list(path))
        if isinstance(v, (list, tuple)):
            return [walk(x, (*path, i)) for i, x in enumerate(v)]
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if hasattr(v, "tolist"):  # a NumPy scalar or array
            return walk(v.tolist(), path)
        return str(v)

    return walk(value, ()), tuples


def restore_tuples(value: Any, paths: list[list[Any]]) -> Any:
    """A copy of the JSON value ``value`` with the lists at ``paths`` (from :func:`to_json`) made tuples again."""
    marked = {tuple(p) for p in paths}

    def walk(v: Any, path: tuple[Any, ...]) -> Any:
        if isinstance(v, dict):
            return {k: walk(x, (*path, k)) for k, x in v.items()}
        if isinstance(v, list):
            items = [walk(x, (*path, i)) for i, x in enumerate(v)]
            return tuple(items) if path in marked else items
        return v

    return walk(value, ())


@functools.cache
def task_names() -> tuple[str, ...]:
    """The names reasoning-gym registers (``reasoning_gym.factory.DATASETS``), without ``composite``."""
    return tuple(sorted(n for n in reasoning_gym.factory.DATASETS if n != "composite"))


def reasoning_gym_version() -> str:
    """The installed reasoning-gym's version."""
    return importlib.metadata.version("reasoning-gym")


@dataclass(eq=False)
class Member:
    """One reasoning-gym task of the mixture.

    Attributes:
        name: reasoning-gym's name of the task (a key of ``reasoning_gym.factory.DATASETS``).
        weight: relative sampling weight (> 0).
        config: the task's config (keyword arguments of ``create_dataset`` but ``seed`` and ``size``).
        scorer: a dataset of that config whose ``score_answer`` scores the member's tasks.
        lock: serializes ``scorer.score_answer`` across reward threads.
    """

    name: str
    weight: float
    config: dict[str, Any]
    scorer: Any
    lock: threading.Lock = field(default_factory=threading.Lock)


def make_member(where: str, name: Any, weight: Any, config: Any) -> Member:
    """A checked :class:`Member`: its config must make a dataset that generates one of its first :data:`TRIAL_ITEMS`.

    Raises:
        ValueError: naming ``where`` (the arg): ``name`` not a registered task (with close matches), a weight
            that is not a positive number, a config that is not a dict or sets ``seed`` or ``size``, or a config
            reasoning-gym rejects (its message).
    """
    names = task_names()
    if name == "composite":
        raise ValueError(f"reasoning-gym: {where}: for a mixture give the env's `tasks` arg, not 'composite'")
    if not isinstance(name, str) or name not in names:
        close = difflib.get_close_matches(str(name), names, n=5)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ValueError(
            f"reasoning-gym: {where}: unknown task {name!r}{hint}; reasoning-gym {reasoning_gym_version()} has "
            f"{len(names)} tasks, the keys of reasoning_gym.factory.DATASETS: python -c "
            "'import reasoning_gym.factory as f; print(sorted(f.DATASETS))'"
        )
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight <= 0:
        raise ValueError(f"reasoning-gym: {where}: weight must be a positive number, got {weight!r}")
    if not isinstance(config, dict):
        raise ValueError(f"reasoning-gym: {where}: config must be a mapping, got {type(config).__name__}")
    if "seed" in config or "size" in config:
        raise ValueError(f"reasoning-gym: {where}: config must not set seed or size (the env derives them per block)")
    try:
        scorer = reasoning_gym.create_dataset(name, seed=0, size=TRIAL_ITEMS, **config)
    except Exception as exc:  # reasoning-gym rejects with TypeError, AssertionError, ValueError, …
        raise ValueError(f"reasoning-gym: {where}: task {name!r} rejects config {config}: {exc!r}") from exc
    failure: Exception | None = None
    for i in range(TRIAL_ITEMS):  # some configs pass validate() and fail to generate; a rare item may fail
        try:
            scorer[i]
            break
        except Exception as exc:
            failure = exc
    else:
        raise ValueError(f"reasoning-gym: {where}: task {name!r} generates nothing with config {config}: {failure!r}")
    return Member(name=name, weight=float(weight), config=dict(config), scorer=scorer)
