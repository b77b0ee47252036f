"""Registered environments. Add one by writing a module with a class that has
``name``, ``task(seed, index)`` and ``reward(task, completion)`` and listing it here.

Building an env from its spec fails with a typed error, so callers (``rlrun.manifest``
naming the bad field) match on the type, not on the message: :class:`UnknownEnvError`
for a name not in :data:`ENVS`, :class:`EnvArgsError` for ``args`` the env refuses.
Both are ``ValueError`` s.
"""

from __future__ import annotations

from rlrun.api.spec import EnvSpec
from rlrun.envs.base import Env, Task
from rlrun.envs.reverse_text import ReverseTextEnv

ENVS: dict[str, type] = {ReverseTextEnv.name: ReverseTextEnv}


class UnknownEnvError(ValueError):
    """``EnvSpec.name`` is no registered env; the message lists the registered ones."""


class EnvArgsError(ValueError):
    """The env refused ``EnvSpec.args``: an unknown keyword, or a value its constructor rejects."""


def make_env(spec: EnvSpec) -> Env:
    """Instantiate the env named by ``spec`` with ``spec.args``.

    Raises:
        UnknownEnvError: ``spec.name`` is not in :data:`ENVS`.
        EnvArgsError: the env's constructor refused ``spec.args`` (a ``TypeError`` or
            ``ValueError`` of its own; the message names the env).
    """
    cls = ENVS.get(spec.name)
    if cls is None:
        raise UnknownEnvError(f"unknown env {spec.name!r}; registered envs: {sorted(ENVS)}")
    try:
        return cls(**spec.args)
    except TypeError as exc:
        raise EnvArgsError(f"env {spec.name!r}: bad args {spec.args}: {exc}") from None
    except ValueError as exc:
        raise EnvArgsError(str(exc)) from exc


__all__ = ["ENVS", "Env", "EnvArgsError", "ReverseTextEnv", "Task", "UnknownEnvError", "make_env"]
