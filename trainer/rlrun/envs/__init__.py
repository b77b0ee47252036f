"""Registered environments. Add one by writing a module with a class that has
``name``, ``task(seed, index)`` and ``reward(task, completion)`` and listing it here."""

from __future__ import annotations

from rlrun.envs.base import Env, Task
from rlrun.envs.reverse_text import ReverseTextEnv
from rlrun.spec import EnvSpec

ENVS: dict[str, type] = {ReverseTextEnv.name: ReverseTextEnv}


def make_env(spec: EnvSpec) -> Env:
    """Instantiate the env named by ``spec`` with ``spec.args``.

    Raises:
        ValueError: unknown env name, or arguments the env rejects (message names the env).
    """
    cls = ENVS.get(spec.name)
    if cls is None:
        raise ValueError(f"unknown env {spec.name!r}; registered envs: {sorted(ENVS)}")
    try:
        return cls(**spec.args)
    except TypeError as exc:
        raise ValueError(f"env {spec.name!r}: bad args {spec.args}: {exc}") from None


__all__ = ["ENVS", "Env", "ReverseTextEnv", "Task", "make_env"]
