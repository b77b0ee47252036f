"""Finding envs: builtin ones, installed packages' entry points, import paths.

An env's ``name`` in a manifest is looked up, in this order:

1. a **builtin** env (:data:`BUILTIN_ENVS`: ``reverse-text``, ``dataset``, ``reasoning-gym``, and the multi-turn
   ``guess-number`` and ``calculator``);
2. an env an installed package registers under the entry point group ``rlrun.envs``
   (:data:`ENTRY_POINT_GROUP`; the standard plugin mechanism of Python packaging, as pytest
   plugins are found): ``[project.entry-points."rlrun.envs"] my-env = "my_pkg.env:MyEnv"``;
3. an **import path** ``package.module:attr`` (a name holding a ``:``).

What is found is a class or a factory: called with the spec's ``args`` as keyword arguments, it
returns the env (:class:`~rlrun.envs.base.Env`). A builtin name cannot be taken by a package (a
package registering one is ignored, with a warning).

Building an env from its spec fails with a typed error, so callers (``rlrun.manifest``
naming the bad field) match on the type, not on the message: :class:`UnknownEnvError`
for a name found nowhere or a path that does not import, :class:`EnvArgsError` for ``args`` the env
refuses. Both are ``ValueError`` s.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib
import logging
import os
import sys
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

from rlrun.api.spec import EnvSpec
from rlrun.envs.base import Env, Split, Task

log = logging.getLogger(__name__)

#: The entry point group installed packages register envs under.
ENTRY_POINT_GROUP = "rlrun.envs"

#: Builtin envs: name → import path (imported on first use: ``datasets`` and ``reasoning_gym`` take seconds).
BUILTIN_ENVS: dict[str, str] = {
    "reverse-text": "rlrun.envs.reverse_text:ReverseTextEnv",
    "dataset": "rlrun.envs.dataset:DatasetEnv",
    "reasoning-gym": "rlrun.envs.reasoning_gym:ReasoningGymEnv",
    "guess-number": "rlrun.envs.guess_number:GuessNumberEnv",
    "calculator": "rlrun.envs.calculator:CalculatorEnv",
}


class UnknownEnvError(ValueError):
    """``EnvSpec.name`` is no builtin or installed env, or an import path that does not import; the message
    lists the installed ones."""


class EnvArgsError(ValueError):
    """The env refused ``EnvSpec.args``: an unknown keyword, or a value its constructor rejects."""


@dataclass(frozen=True)
class EnvEntry:
    """An env that can be named in a manifest.

    Attributes:
        name: what ``spec.envs[].name`` says.
        target: its import path, ``module:attr``.
        source: ``builtin``, or the distribution (``name version``) that registers it.
    """

    name: str
    target: str
    source: str


@functools.cache
def installed_envs() -> dict[str, EnvEntry]:
    """Every env that can be named: builtin ones, then the ``rlrun.envs`` entry points (cached per process)."""
    found = {name: EnvEntry(name, target, "builtin") for name, target in BUILTIN_ENVS.items()}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        dist = f"{ep.dist.name} {ep.dist.version}" if ep.dist is not None else "?"
        if ep.name in found:
            log.warning("ignoring env %r of %s: the name is taken by %s", ep.name, dist, found[ep.name].source)
            continue
        found[ep.name] = EnvEntry(ep.name, ep.value, dist)
    return found


def resolve_env(name: str) -> Any:
    """The class or factory ``name`` refers to (module docstring: builtin, entry point, or ``module:attr``).

    Raises:
        UnknownEnvError: found nowhere, an import path whose module does not import or lacks the attribute,
            or something that is not callable.
    """
    entry = installed_envs().get(name)
    if entry is None and ":" not in name:
        close = difflib.get_close_matches(name, list(installed_envs()), n=1)
        if "." in name and not close:  # a module path without its attribute
            module, _, last = name.rpartition(".")
            guess = f"{name}:MyEnv" if last.islower() else f"{module}:{last}"  # a class's name is capitalised
            raise UnknownEnvError(
                f"unknown env {name!r}: an import path names the module and the attribute, module:attr (e.g. "
                f"{guess}); installed envs: {sorted(installed_envs())}"
            )
        raise UnknownEnvError(
            f"unknown env {name!r}; "
            + (f"did you mean {close[0]!r}? " if close else "")
            + f"installed envs: {sorted(installed_envs())} (or give an import path package.module:attr)"
        )
    target = entry.target if entry is not None else name
    try:
        return import_target(target)
    except (ImportError, AttributeError, TypeError) as exc:
        what = f"env {name!r} ({target})" if entry is not None else f"env import path {name!r}"
        raise UnknownEnvError(f"{what} does not load: {exc}") from None


def import_module(name: str) -> Any:
    """Import module ``name`` as ``python -m`` would find it: installed packages, then modules under the working
    directory (appended to ``sys.path`` when needed, so the ``rlrun`` script and ``python -m rlrun`` find the
    same modules, and nothing there shadows an installed one).

    Raises:
        ImportError: it does not import (the original error).
    """
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        cwd = os.getcwd()
        if exc.name != name.split(".")[0] or cwd in sys.path or "" in sys.path:
            raise
        sys.path.append(cwd)
        return importlib.import_module(name)


def import_target(target: str) -> Any:
    """The callable at import path ``package.module:attr`` (``attr`` may be dotted: ``Class.factory``).

    Raises:
        ImportError: the module does not import (the original error's message).
        AttributeError: the module has no such attribute.
        TypeError: the path is not ``module:attr``, or the object is not callable.
    """
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise TypeError(f"{target!r} is not an import path module:attr")
    obj: Any = import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"{target} is a {type(obj).__name__}, not a class or function")
    return obj


def make_env(spec: EnvSpec) -> Env:
    """Instantiate the env named by ``spec`` with ``spec.args``.

    Raises:
        UnknownEnvError: see :func:`resolve_env`.
        EnvArgsError: the env's constructor refused ``spec.args`` (a ``TypeError`` or
            ``ValueError`` of its own; the message names the env).
    """
    factory = resolve_env(spec.name)
    try:
        env = factory(**spec.args)
    except TypeError as exc:
        raise EnvArgsError(f"env {spec.name!r}: bad args {spec.args}: {exc}") from None
    except ValueError as exc:
        raise EnvArgsError(str(exc)) from exc
    for method in ("task", "reward"):
        if not callable(getattr(env, method, None)):
            raise UnknownEnvError(f"env {spec.name!r} made a {type(env).__name__}, which has no {method}() method")
    return env if getattr(env, "name", None) == spec.name else RenamedEnv(env, spec.name)


class RenamedEnv:
    """An env under the name the manifest gives it (an import path, or an entry point named apart from the
    class's ``name``): its tasks carry that name, which is how the orchestrator finds a task's env again.
    Everything else is the env's own (``fingerprint``, ``demonstration``…)."""

    def __init__(self, env: Any, name: str) -> None:
        self.env = env
        self.name = name

    def task(self, seed: int, index: int, split: Split = "train") -> Task:
        """The env's task ``index`` of ``split``, carrying this name."""
        return dataclasses.replace(self.env.task(seed, index, split), env=self.name)

    def reward(self, task: Task, completion: str) -> float:
        """The env's own reward of ``completion`` for ``task``."""
        return self.env.reward(task, completion)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.env, attr)


def __getattr__(name: str) -> Any:
    # `from rlrun.envs import ReverseTextEnv` keeps working without importing every builtin env here.
    if name == "ReverseTextEnv":
        from rlrun.envs.reverse_text import ReverseTextEnv

        return ReverseTextEnv
    raise AttributeError(name)


__all__ = [
    "BUILTIN_ENVS",
    "ENTRY_POINT_GROUP",
    "Env",
    "EnvArgsError",
    "EnvEntry",
    "RenamedEnv",
    "ReverseTextEnv",
    "Task",
    "UnknownEnvError",
    "import_module",
    "import_target",
    "installed_envs",
    "make_env",
    "resolve_env",
]
