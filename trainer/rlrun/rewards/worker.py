"""What runs inside a reward worker process (:mod:`rlrun.rewards.workers` starts it and owns it).

A worker serves one call at a time over its connection, for as long as the orchestrator holds the other end:
it loads the rewards it is told (``("load", …)``: builtin ones by name, user ones by import path, as the
orchestrator loaded them) and scores groups with them (``("score", …)``), answering with plain data only —
each reward's scores and member errors, already checked (:func:`rlrun.rewards.scoring.reward_outcome`), never
a user object. It never outlives the orchestrator: it exits when the connection closes, and on Linux the
kernel kills it when the thread that started it ends (``PR_SET_PDEATHSIG``), the orchestrator's death
included, even in the middle of a call. It ignores ``SIGINT`` (a terminal's Ctrl-C reaches the orchestrator,
which stops it). It runs at the orchestrator's CPU priority: a lower one (``nice 10``) gave the loop nothing
measurable (``benchmarks/reward_cost.py``: p99 stall 1.2 ms against 1.4 ms, within the noise) and would let a
trainer or vLLM sharing the machine (``rlrun local``) starve rewards into their timeouts.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> None:
    """Linux: SIGKILL this process when the thread that started it ends (``prctl(PR_SET_PDEATHSIG)``), or
    now when its parent ``parent`` is already gone."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it died before prctl took effect
        os._exit(1)


def load_rewards(
    specs: dict[str, dict[str, Any]],
    sys_path: list[str],
    cwd: str,
    trainer_state: bool,
    funcs: dict[str, Any],
) -> dict[str, str | None]:
    """Load each reward of ``specs`` (key → a ``RewardSpec``'s fields) into ``funcs`` (key → the callable).

    Args:
        sys_path, cwd: the orchestrator's: what a user function's import path is found with.
        trainer_state: import what TRL's ``trainer_state`` needs (``transformers``: seconds, here rather than
            in a call's time).

    Returns:
        ``{key: None}``, or the error (``"<type>: <message>"``) of a reward that does not load.
    """
    from rlrun.api.spec import RewardSpec
    from rlrun.rewards.loading import load_reward

    if os.getcwd() != cwd:
        os.chdir(cwd)
    sys.path.extend(p for p in sys_path if p not in sys.path)
    errors: dict[str, str | None] = {}
    for key, fields in specs.items():
        try:
            funcs[key] = load_reward(RewardSpec(**fields))
            errors[key] = None
        except Exception as exc:  # reported to the orchestrator, which fails the members that need it
            errors[key] = f"{type(exc).__name__}: {exc}"
    if trainer_state:
        from transformers.trainer_callback import TrainerState  # noqa: F401
    return errors


def score_call(
    funcs: dict[str, Any],
    rewards: list[tuple[str, str, bool]],
    task: Any,
    texts: list[str],
    ids: list[list[int]],
    context: tuple[int, int, bool] | None,
) -> tuple[list, list[tuple[str, float]], float]:
    """One group scored by some rewards, as a worker answers a call.

    Args:
        funcs: the loaded rewards by key (:func:`load_rewards`).
        rewards: ``(key, series, builtin)`` of each reward to call, in order.
        task, texts, ids: the group (:func:`rlrun.rewards.scoring.reward_kwargs`): n completions.
        context: ``(step, max_steps, log)`` of TRL's trainer arguments (``log``: keep the ``log_metric``
            calls), or None (none passed). Builtin rewards read none: for them alone, none are built.

    Returns:
        Each reward's outcome (:func:`rlrun.rewards.scoring.reward_outcome`: n scores, n member errors), the
        ``log_metric(name, value)`` calls made, and the call's run time in seconds.
    """
    from rlrun.rewards.calls import RewardContext, RewardFunction
    from rlrun.rewards.scoring import reward_kwargs, reward_outcome

    t0 = time.monotonic()
    logged: list[tuple[str, float]] = []
    ctx = None
    if context is not None and any(not builtin for _, _, builtin in rewards):
        step, max_steps, log = context
        keep = (lambda name, value: logged.append((name, value))) if log else None
        ctx = RewardContext(step, max_steps, keep)
    kwargs = reward_kwargs(task, texts, ids, ctx)
    outcomes = []
    for key, series, _ in rewards:
        outcomes.append(reward_outcome(RewardFunction(series, 1.0, funcs[key]), task, texts, kwargs))
    return outcomes, logged, time.monotonic() - t0


def main() -> None:
    """A worker's entry point (:data:`rlrun.rewards.workers.WORKER_MAIN`): ``argv[1]`` is the file
    descriptor of its connection, ``argv[2]`` the orchestrator's pid; serves until the connection closes."""
    from multiprocessing.connection import Connection

    _die_with_parent(int(sys.argv[2]))
    serve(Connection(int(sys.argv[1])))


def serve(conn: Any) -> None:
    """The worker's loop over ``conn`` (a ``multiprocessing.connection.Connection``): a message in, its
    answer out (``("loaded", errors)``, ``("scored", outcomes, logged, run_s)`` or ``("error", message)``),
    until the orchestrator closes its end."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    funcs: dict[str, Any] = {}
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        try:
            if message[0] == "load":
                reply: tuple = ("loaded", load_rewards(*message[1:], funcs))
            else:
                reply = ("scored", *score_call(funcs, *message[1:]))
        except Exception as exc:  # the machinery's own failure (not a reward's): said, never silent
            reply = ("error", f"{type(exc).__name__}: {exc}")
        try:
            conn.send(reply)
        except (EOFError, OSError):
            return
