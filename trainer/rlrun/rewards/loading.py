"""From a :class:`~rlrun.api.spec.RewardSpec` to the reward function it names.

A spec names a builtin reward (``name``: built by its factory in :data:`~rlrun.rewards.builtin.BUILTIN_REWARDS`
with the spec's ``args``) or any callable (``function``: an import path ``package.module:attr``, returned as it
is, sync or async, never wrapped, so a TRL reward function runs unchanged). Loading fails only with one of
three ``ValueError`` s, so callers (``rlrun.manifest``, naming the field) match on the type:
:class:`UnknownRewardError`, :class:`RewardImportError`, :class:`RewardArgsError`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection
from typing import Any

from rlrun.api.spec import RewardSpec
from rlrun.envs import import_module, import_target
from rlrun.rewards.builtin import BUILTIN_REWARDS


class UnknownRewardError(ValueError):
    """``RewardSpec.name`` is not a builtin reward; the message lists the builtin ones."""


class RewardImportError(ValueError):
    """``RewardSpec.function`` does not load: its module does not import, lacks the attribute, or the attribute
    is not callable (the message says which); or a builtin reward's dependency is not installed."""


class RewardArgsError(ValueError):
    """A builtin reward's factory refused ``RewardSpec.args`` (an unknown keyword or a bad value); the message
    names the reward."""


def load_reward(spec: RewardSpec) -> Callable[..., Any]:
    """The reward function ``spec`` names, ready to call with TRL's keyword arguments.

    Returns:
        For ``name``: what its factory returns given ``spec.args``. For ``function``: the object at the import
        path, as it is (a sync or async function, or a callable object; :func:`is_async_reward` tells which).

    Raises:
        UnknownRewardError: ``spec.name`` is not in ``BUILTIN_REWARDS``.
        RewardArgsError: the builtin's factory raised ``TypeError`` or ``ValueError`` on ``spec.args``.
        RewardImportError: ``spec.function`` does not load (see the class), or a builtin's dependency is missing.
    """
    if spec.name is not None:
        return _load_builtin(spec.name, spec.args)
    if spec.function is None:  # RewardSpec's validator forbids it; a hand-built spec may not have run it
        raise UnknownRewardError("a reward spec sets neither name (a builtin reward) nor function (module:attr)")
    return _load_function(spec.function)


def _load_builtin(name: str, args: dict[str, Any]) -> Callable[..., Any]:
    factory = BUILTIN_REWARDS.get(name)
    if factory is None:
        raise UnknownRewardError(
            f"unknown reward {name!r}; builtin rewards: {sorted(BUILTIN_REWARDS)} "
            "(or give function: package.module:attr)"
        )
    try:
        return factory(**args)
    except (TypeError, ValueError) as exc:
        raise RewardArgsError(f"reward {name!r}: bad args {args}: {exc}") from exc
    except ImportError as exc:
        raise RewardImportError(f"reward {name!r} does not load: {exc}") from exc


def _load_function(path: str) -> Callable[..., Any]:
    module_name, sep, attr = path.partition(":")
    if not (module_name and sep and attr):
        raise RewardImportError(f"reward function {path!r} is not an import path package.module:attr")
    try:  # first the module alone, so an error raised while importing it is not taken for a missing attribute
        import_module(module_name)
    except Exception as exc:
        raise RewardImportError(
            f"reward function {path}: module {module_name!r} does not import: {type(exc).__name__}: {exc}"
        ) from exc
    try:
        return import_target(path)
    except AttributeError as exc:
        raise RewardImportError(
            f"reward function {path}: module {module_name!r} has no attribute {attr!r}: {exc}"
        ) from exc
    except TypeError as exc:  # the path's shape is checked above: here the object is not callable
        raise RewardImportError(f"reward function {path} is not callable: {exc}") from exc


def argument_problems(func: Callable[..., Any], passed: Collection[str]) -> tuple[list[str], list[str]]:
    """What a call of ``func`` with the keyword arguments ``passed`` would refuse, read from its signature
    (``inspect.signature``): the parameters it requires that are not passed (a parameter without a default, or a
    positional-only one), and — when it takes no ``**kwargs`` (TRL's convention asks for them) — the arguments
    passed that it does not name. ``([], [])`` when the call fits, or when the signature cannot be read (a C
    function)."""
    try:
        params = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):
        return [], []
    required = [
        p.name
        for p in params
        if p.default is p.empty
        and (
            p.kind is p.POSITIONAL_ONLY
            or (p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in passed)
        )
    ]
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return required, []
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return required, [a for a in passed if a not in named]


def is_async_reward(func: Callable[..., Any]) -> bool:
    """Whether calling ``func`` returns a coroutine: an ``async def`` function (also behind
    ``functools.partial`` or a bound method) or an object whose ``__call__`` is ``async def``."""
    if inspect.iscoroutinefunction(func):
        return True
    return callable(func) and inspect.iscoroutinefunction(type(func).__call__)
