"""Turns: a multi-turn env's episode played as one token stream, exactly as it was sampled.

An episode of a :class:`~rlrun.envs.base.MultiTurnEnv` is stored as token segments after its prompt:
each sampled turn (vLLM's ids and logprobs, trained) and each env answer (its tokens, not trained). The
next turn's prompt **extends the sampled stream** with the tokens of the env's answer — it is never the
history rendered again through the chat template, because templates that rewrite past turns (Qwen3
drops earlier ``<think>`` blocks) would then prompt the model with ids other than the ones it sampled,
and the trainer would train ids the sampler never produced (NVIDIA-NeMo/RL #2821, prime-rl #1334). So
the trained ids of a 3-turn episode are exactly ``prompt + sampled₁ + env₁ + sampled₂ + env₂ + sampled₃``.

How an env answer becomes tokens: for a plain-text prompt, its text encoded as is; for a chat prompt,
the chat template's rendering of the answer's messages *after* an assistant turn, through the next
generation prompt (:func:`rlrun.envs.replies.reply_renderer`). The sampled turn ends with the EOS token
the template ends an assistant message with, so the stream reads as the template would have rendered
it, without ever rendering what the model said.

The mask: an env token's logprob is :data:`~rlrun.samples.ENV_TOKEN_LOGPROB` (NaN: it was not sampled, it has none), and
:func:`rlrun.batch.collate` puts the loss mask on sampled tokens only; the episode journal and sink
snapshots store logprobs as float64, so the mask survives them unchanged.

When an episode ends: the env says ``done``; ``max_turns`` model turns were played; a turn stopped for
``length`` (a truncated turn cannot be answered); or the next turn would not fit the context
(``finish_reason`` ``length``) — known beforehand (``TurnIO.context``), or told by the server refusing the
turn (:class:`~rlrun.rollout.rejections.ContextExceeded`, where rlrun did not know the server's context):
either way the episode ends at its last sampled turn, the env's answer after it dropped. The policy version of
a multi-turn episode is that of its first (oldest) sampled turn — what the staleness rule reads
(``docs/envs.md``).

Env code runs off the loop in threads of the env's own (``TurnIO.env_calls``, a
:class:`~rlrun.worker_threads.WorkerThreads`): at most :data:`ENV_THREADS` calls of one env at once, each ``start`` or
``respond`` timed by its own run time; a hung call gives its turn up at its timeout and holds only a spare thread
(:data:`ENV_SPARE` per env), and no thread holds the orchestrator's exit. Issue 47: these calls shared the
event loop's default executor (6 threads on 2 cores, also the checkpoint's and the journal's) and their
timeout counted the wait for one, so an env whose ``start`` hung on every 5th task failed the innocent ones
(``start failed: took longer than 5 s``), and the finished orchestrator did not exit for minutes.

Durability: after each env answer the episode goes on from, the conversation is handed to ``TurnIO.keep``
(the orchestrator journals it: :mod:`.conversations`), and a resumed attempt continues it from there
(:func:`go_on` from a :class:`~rlrun.orchestrator.groups.KeptConversation`) instead of from its first turn.
The kept state is the env's state **as of the kept turn**: a copy in its JSON form taken when the turn is kept
(:func:`kept_state`), never the object the conversation goes on with — an env whose ``respond`` changes its state
in place would otherwise move the kept state a move past its kept stream while the next turn is played (and a
pause would save, and a resume continue, a conversation whose state is ahead of its tokens). The same holds the
other way: a continued conversation plays on a copy of its kept state.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlrun.envs.base import EnvStateError, Messages, MultiTurnEnv, Task
from rlrun.orchestrator.groups import KeptConversation
from rlrun.rollout.client import Completion, ContextExceeded
from rlrun.samples import ENV_TOKEN_LOGPROB, count_sampled, is_sampled
from rlrun.timeouts import describe_failure
from rlrun.worker_threads import WorkerThreads

#: Calls of one env's ``start`` and ``respond`` run at once (an env's ``max_concurrent_calls`` overrides it).
ENV_THREADS = 32
#: Spare threads of one env: they stand in for those its calls past their timeout still hold.
ENV_SPARE = 64


def env_threads(env: MultiTurnEnv, name: str) -> WorkerThreads:
    """The threads env code of ``env`` (named ``name`` in the run) runs in: its ``max_concurrent_calls`` at
    once (default :data:`ENV_THREADS`), :data:`ENV_SPARE` spare (module docstring)."""
    return WorkerThreads(f"env {name}", int(getattr(env, "max_concurrent_calls", ENV_THREADS)), ENV_SPARE)


def kept_state(state: Any, env: str) -> Any:
    """A resumable env's ``state`` as of now, in the JSON form a journal record and a snapshot keep (a copy: nothing
    the env does to ``state`` afterwards reaches it; tuples read back as lists, dict keys as strings, as a resume
    would read them).

    Raises:
        EnvStateError: ``state`` is not plain JSON (a ``resumable`` env promises it is).
    """
    try:
        return json.loads(json.dumps(state))
    except (TypeError, ValueError) as exc:
        raise EnvStateError(
            f"env {env}: resumable = True, but its state is not plain JSON ({exc}); the state a resumable env's "
            "start and respond return is journaled after each turn: make it JSON (dicts with string keys, lists, "
            "strings, numbers, booleans, None), or drop resumable (a preempted episode then starts over)"
        ) from None


@dataclass
class Conversation:
    """One member's episode so far.

    Attributes:
        prompt_len: tokens of the prompt.
        ids: the whole stream: the prompt, then each sampled turn and env answer (what the next turn is
            prompted with).
        logprobs: per token after the prompt: the sampling logprob, or :data:`~rlrun.samples.ENV_TOKEN_LOGPROB`.
        state: the env's state (JSON-compatible).
        turns: model turns played.
        reward: the env's per-turn rewards (:attr:`~rlrun.envs.base.Reply.reward`), summed.
        tool_calls, tool_errors: over the episode.
        last_text: the last model turn's text up to EOS (what the rewards score).
        finish_reason: the last turn's (``length`` also when the next turn would not fit the context).
        error: why the env failed the episode (its ``respond`` raised or timed out; None: it did not).
    """

    prompt_len: int
    ids: list[int]
    logprobs: list[float] = field(default_factory=list)
    state: Any = None
    turns: int = 0
    reward: float = 0.0
    tool_calls: int = 0
    tool_errors: int = 0
    last_text: str = ""
    finish_reason: str = "stop"
    error: str | None = None

    @property
    def completion_ids(self) -> list[int]:
        """Every token after the prompt (sampled and env)."""
        return self.ids[self.prompt_len :]

    def kept(self, group_id: int, member: int, task: Task, policy_version: int) -> KeptConversation:
        """This conversation as member ``member`` of group ``group_id`` keeps it (ready for its next turn): its stream
        and its env state as of now (:func:`kept_state`: a copy, so a ``respond`` that changes the state in place
        while the next turn is played leaves the kept one as it was).

        Raises:
            EnvStateError: the env's state is not plain JSON.
        """
        return KeptConversation(
            group_id,
            member,
            task,
            policy_version,
            self.ids[: self.prompt_len],
            self.completion_ids,
            list(self.logprobs),
            kept_state(self.state, task.env),
            self.turns,
            self.reward,
            self.tool_calls,
            self.tool_errors,
        )

    @classmethod
    def from_kept(cls, kept: KeptConversation) -> Conversation:
        """The conversation ``kept`` holds, ready for its next turn (on a copy of its state: ``kept`` stays as kept)."""
        ids = [*kept.prompt_ids, *kept.completion_ids]
        return cls(
            len(kept.prompt_ids),
            ids,
            list(kept.logprobs),
            kept_state(kept.state, kept.task.env),
            kept.turns,
            kept.reward,
            kept.tool_calls,
            kept.tool_errors,
        )


@dataclass(frozen=True)
class TurnIO:
    """What playing a conversation needs from the orchestrator.

    Attributes:
        complete: ``await complete(ids) -> Completion``: one sampled turn for the stream ``ids`` (the dispatcher's
            retried request, on a server holding the request's policy version).
        text: a completion's text up to EOS (what the env and the rewards read).
        reply_ids: ``reply_ids(task, message) -> ids`` of an env answer (module docstring).
        context: the model's context in tokens, less ``sampling.max_tokens`` (None: no limit).
        respond_timeout_s: most seconds one ``start`` or ``respond`` may run, from when a thread starts it.
        keep: ``keep(member, conversation)``, called after each env answer the episode goes on from (the
            conversation then waits for its next turn; None: nothing is kept).
        env_calls: the threads the env's ``start`` and ``respond`` run in (:func:`env_threads`: the env's
            own).
    """

    complete: Callable[[list[int]], Awaitable[Completion]]
    text: Callable[[Completion], str]
    reply_ids: Callable[[Task, str | Messages], Sequence[int]]
    context: int | None
    respond_timeout_s: float = 60.0
    keep: Callable[[int, Conversation], None] | None = None
    env_calls: WorkerThreads = field(default_factory=lambda: WorkerThreads("env", ENV_THREADS, ENV_SPARE))


async def play(
    env: MultiTurnEnv, task: Task, prompt_ids: Sequence[int], first: Completion, io: TurnIO, member: int = 0
) -> Conversation:
    """Play member ``member``'s episode from its first sampled turn ``first`` (module docstring); the env's
    ``start`` and ``respond`` run in its threads (``io.env_calls``). An env that raises or times out ends the
    episode with :attr:`Conversation.error`.

    Raises:
        whatever ``io.complete`` raises (the request fails: its members share a fate) but a turn the server
        refused as longer than its context (the episode ends truncated).
    """
    conv = Conversation(len(prompt_ids), list(prompt_ids))
    try:
        conv.state = await io.env_calls.run(env.start, task, timeout_s=io.respond_timeout_s)
    except Exception as exc:
        conv.error = f"env {task.env}: start failed: {describe_failure(exc)}"
        return conv
    return await go_on(env, task, conv, io, member, first)


async def go_on(
    env: MultiTurnEnv, task: Task, conv: Conversation, io: TurnIO, member: int, first: Completion | None = None
) -> Conversation:
    """Play ``conv`` to its end from turn ``first`` (None: sample its next turn first — a conversation continued
    at its last durable turn, :meth:`Conversation.from_kept`)."""
    completion = first if first is not None else await _next_turn(conv, io)
    while completion is not None:
        conv.ids.extend(completion.token_ids)
        conv.logprobs.extend(completion.logprobs)
        conv.turns += 1
        conv.last_text, conv.finish_reason = io.text(completion), completion.finish_reason
        if completion.finish_reason != "stop" or conv.turns >= env.max_turns:
            return conv
        try:
            reply = await io.env_calls.run(
                env.respond, task, conv.state, conv.last_text, timeout_s=io.respond_timeout_s
            )
        except Exception as exc:
            conv.error = f"env {task.env}: respond failed at turn {conv.turns}: {describe_failure(exc)}"
            return conv
        conv.state = reply.state
        conv.reward += reply.reward or 0.0
        conv.tool_calls += reply.tool_calls
        conv.tool_errors += reply.tool_errors
        if reply.done or reply.message is None:
            return conv
        answer = io.reply_ids(task, reply.message)
        if io.context is not None and len(conv.ids) + len(answer) > io.context:
            conv.finish_reason = "length"  # the next turn would not fit: the episode ends at this one
            return conv
        conv.ids.extend(answer)
        conv.logprobs.extend([ENV_TOKEN_LOGPROB] * len(answer))
        if io.keep is not None:
            io.keep(member, conv)
        if asyncio.current_task().cancelling():  # type: ignore[union-attr]
            # Python 3.11's wait_for can swallow a cancel that races its result (a respond that just returned):
            # a cancelled conversation must not send another turn
            raise asyncio.CancelledError
        completion = await _next_turn(conv, io)
    return conv


async def _next_turn(conv: Conversation, io: TurnIO) -> Completion | None:
    """``conv``'s next turn, or None when the server refused it as longer than its context: the episode then
    ends at its last sampled turn (``length``), the env's answer after it dropped, as when the context is
    known."""
    try:
        return await io.complete(conv.ids)
    except ContextExceeded:
        while conv.logprobs and not is_sampled(conv.logprobs[-1]):  # the env's last answer: not sampled
            conv.logprobs.pop()
            conv.ids.pop()
        conv.finish_reason = "length"
        return None


async def play_all(
    env: MultiTurnEnv,
    task: Task,
    prompt_ids: Sequence[int],
    firsts: list[Completion],
    io: TurnIO,
    first_member: int = 0,
) -> list[Conversation]:
    """:func:`play` for each member of a request at once (``firsts``: their first turns, in member order from
    ``first_member``). The first error of a turn's request cancels the other members' conversations and is raised:
    a request's members share a fate."""
    tasks = [
        asyncio.ensure_future(play(env, task, prompt_ids, first, io, first_member + k))
        for k, first in enumerate(firsts)
    ]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
        # the request ends only once its members' conversations have: none may outlive it (or its client)
        await asyncio.gather(*tasks, return_exceptions=True)
    errors = [t.exception() for t in tasks if t.done() and not t.cancelled() and t.exception() is not None]
    if errors:
        raise errors[0]
    return [t.result() for t in tasks]


def is_env_failure(error: str, env: str) -> bool:
    """Whether a failed member's ``error`` is its env's (:attr:`Conversation.error`: ``start`` or ``respond``
    raised or timed out), not a reward's."""
    return error.startswith(f"env {env}: ")


def sum_sampled(conversations: list[Conversation]) -> int:
    """Sampled tokens of ``conversations`` (env tokens not counted)."""
    return sum(count_sampled(c.logprobs) for c in conversations)
