"""Multi-turn envs in the builtin ``tiny`` model's warm start: a demonstration played into one transcript, and
greedy conversations to check the warm start's progress.

A multi-turn env's ``demonstration(task)`` is the list of model turns that solve the task. Played against the
env (:meth:`~rlrun.envs.base.MultiTurnEnv.respond`), it becomes one text after the prompt — each turn, the EOS
token that ends it, and the env's answer as the rollouts render it (:func:`rlrun.envs.replies.reply_renderer`
for a chat prompt) — and the warm start teaches that whole text (the env's answers included: teacher forcing
on them costs nothing, and the model never samples them in a rollout).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from rlrun.envs.base import MultiTurnEnv, Task
from rlrun.envs.replies import answer_text, reply_renderer


def transcript(tokenizer: Any, env: MultiTurnEnv, task: Task, turns: Sequence[str]) -> str | None:
    """The text after ``task``'s prompt of ``turns`` played against ``env`` (module docstring); None when the env
    ends the episode before the last turn or the turns are more than ``env.max_turns``."""
    if not turns or len(turns) > env.max_turns:
        return None
    render, state, text = reply_renderer(tokenizer), env.start(task), ""
    for k, turn in enumerate(turns):
        text += turn
        if k == len(turns) - 1:
            return text
        reply = env.respond(task, state, turn)
        if reply.done or reply.message is None:
            return None
        state = reply.state
        text += tokenizer.eos_token + answer_text(render, task, reply.message)
    return text


def greedy_conversations(
    generate: Callable[[list[str], list[int]], list[str]],
    tokenizer: Any,
    env: MultiTurnEnv,
    tasks: Sequence[Task],
    prompts: Sequence[str],
    cap: int,
) -> tuple[list[str], list[float]]:
    """Play ``tasks`` (rendered ``prompts``) to the end with ``generate(streams, caps) -> turns`` (greedy, each turn
    cut at EOS or ``cap`` tokens); returns each episode's last turn and the env's per-turn rewards, summed."""
    render = reply_renderer(tokenizer)
    streams, states = list(prompts), [env.start(t) for t in tasks]
    last, bonus = [""] * len(tasks), [0.0] * len(tasks)
    live = list(range(len(tasks)))
    for turn in range(env.max_turns):
        if not live:
            break
        texts = generate([streams[i] for i in live], [cap] * len(live))
        still = []
        for i, text in zip(live, texts, strict=True):
            last[i] = text
            if turn + 1 == env.max_turns:
                continue
            reply = env.respond(tasks[i], states[i], text)
            states[i], bonus[i] = reply.state, bonus[i] + (reply.reward or 0.0)
            if not reply.done and reply.message is not None:
                streams[i] += text + tokenizer.eos_token + answer_text(render, tasks[i], reply.message)
                still.append(i)
        live = still
    return last, bonus
