"""Episodes: a prompt's token ids, and a group's completions turned into scored episodes.

What a request does on the event loop besides waiting: render a chat prompt through the tokenizer's
chat template (once per distinct prompt, here in the orchestrator: vLLM receives token ids), encode
the prompt (once per distinct prompt text: a group's requests share it, an env's prompts repeat) and,
when completions come back, decode each up to EOS for the rewards, which run in worker threads
(:mod:`rlrun.rewards.scoring`). The trainer trains exactly the token ids vLLM sampled: an episode keeps
the completion's ids and logprobs as they came (a completion that stopped keeps its EOS; one cut by
``max_tokens`` has none), only the rewards read the decoded text; nothing is decoded and encoded again.
"""

from __future__ import annotations

import functools
import json
from array import array
from collections.abc import Callable, Sequence
from typing import Any

from rlrun.api.spec import RLRunSpec
from rlrun.envs.base import Env, Messages, Task, is_multi_turn
from rlrun.envs.replies import answer_text, reply_renderer
from rlrun.orchestrator.groups import GroupRequest, ScoredRequest
from rlrun.orchestrator.turns import Conversation, TurnIO, env_threads
from rlrun.rewards.calls import RewardContext, RewardFunction
from rlrun.rewards.scoring import GroupScores, RewardScorer, env_rewards, own_reward
from rlrun.rollout.client import Completion, ContextExceeded
from rlrun.samples import Episode

#: Distinct prompt texts whose token ids :func:`tokenizer_codec` keeps (about 1 KiB each).
PROMPT_CACHE_SIZE = 4096
#: A tokenizer's ``model_max_length`` at or above this is transformers' "no limit" (``int(1e30)``), not a context.
UNLIMITED_CONTEXT = 10**9


def tokenizer_codec(tokenizer: Any) -> tuple[Callable[[str], Sequence[int]], Callable[[list[int]], str], int]:
    """``(encode, decode, eos_id)`` of a Hugging Face ``tokenizer``, without special tokens.

    Tokenizing is the dearest thing a request does on the event loop: a fast tokenizer's Rust backend
    directly (≈ 13 µs for a short prompt against ≈ 90 µs through ``tokenizer.encode``, the same ids),
    and each prompt text once (:data:`PROMPT_CACHE_SIZE` of them).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)

    @functools.lru_cache(maxsize=PROMPT_CACHE_SIZE)
    def encode(text: str) -> tuple[int, ...]:
        if backend is not None:
            return tuple(backend.encode(text, add_special_tokens=False).ids)
        return tuple(tokenizer.encode(text, add_special_tokens=False))

    return encode, lambda ids: tokenizer.decode(ids, skip_special_tokens=True), tokenizer.eos_token_id


class PromptError(ValueError):
    """A task's prompt cannot be sent: a chat prompt for a tokenizer without a chat template. Retrying cannot heal
    it (``permanent``)."""

    permanent = True
    reason = "InvalidPrompt"


class PromptTooLongError(PromptError):
    """A task's prompt leaves no room for ``sampling.max_tokens`` within the model's context: the env's tasks must
    be shorter, or ``max_tokens`` smaller."""

    reason = "PromptTooLong"


class ServerContextTooSmall(PromptError):
    """A rollout server refused a task's prompt as longer than its context, which rlrun did not know (the
    message names ``spec.rollout.max_model_len`` and the server's context): every prompt must be measured
    against the real context at the start (:mod:`.prompts`). Retrying cannot heal it (``permanent``, exit 78,
    ``reason``)."""

    reason = "ServerContextTooSmall"


class EpisodeBuilder:
    """Prompts in, scored episodes out.

    Args:
        encode: ``encode(text: str) -> Sequence[int]``, the tokenizer without special tokens.
        decode: ``decode(ids: list[int]) -> str``, without special tokens (for the reward).
        eos_id: end-of-sequence token id (completion text is decoded up to it).
        envs: env by name.
        rewards: each env's rewards by env name (:func:`rlrun.rewards.scoring.env_rewards`); an env not in it
            is scored by its own ``reward``.
        reward_timeout_s: most seconds a group's scoring may take, by env name (default 60 s).
        render: ``render(messages[, tools]) -> str``, a chat prompt (and the task's tool schemas) through the
            tokenizer's chat template with the generation prompt (None: chat prompts are refused).
        max_prompt_tokens: longest prompt in tokens (the context less ``sampling.max_tokens``; None: no limit); a
            multi-turn episode's stream too, before each of its turns.
        render_reply: ``render_reply(messages, tools) -> str``, a multi-turn env's answer to a chat prompt as the
            chat template renders it after an assistant turn (:func:`rlrun.envs.replies.reply_renderer`;
            None: chat answers are refused).

    Attributes:
        max_steps: the run's last step, TRL's ``trainer_state.max_steps`` for the rewards
            (:class:`~rlrun.rewards.scoring.RewardContext`).
        log_metric: ``log_metric(name, value)``: where a reward's ``log_metric`` calls of a training group go
            (:meth:`rlrun.orchestrator.metrics.StepMetrics.log_metric`; None: dropped).
    """

    def __init__(
        self,
        encode: Callable[[str], Sequence[int]],
        decode: Callable[[list[int]], str],
        eos_id: int,
        envs: dict[str, Env],
        rewards: dict[str, list[RewardFunction]] | None = None,
        reward_timeout_s: dict[str, float] | None = None,
        render: Callable[[Messages], str] | None = None,
        max_prompt_tokens: int | None = None,
        render_reply: Callable[[Messages, list | None], str] | None = None,
    ) -> None:
        self.encode = encode
        self.decode = decode
        self.eos_id = eos_id
        self.envs = envs
        self.rewards = {name: (rewards or {}).get(name) or [own_reward(name, env)] for name, env in envs.items()}
        self.reward_timeout_s = reward_timeout_s or {}
        self.render = render
        self.max_prompt_tokens = max_prompt_tokens
        self.render_reply = render_reply
        #: each multi-turn env's threads for its ``start`` and ``respond``
        #: (:func:`rlrun.orchestrator.turns.env_threads`)
        self.env_calls = {name: env_threads(env, name) for name, env in envs.items() if is_multi_turn(env)}
        self.scorer = RewardScorer()
        self.max_steps = 0
        self.log_metric: Callable[[str, float], None] | None = None
        self._rendered: dict[str, str] = {}  # chat prompt (as JSON) → its text: each rendered once

    @classmethod
    def from_spec(cls, tokenizer: Any, envs: dict[str, Env], spec: RLRunSpec) -> EpisodeBuilder:
        """The builder of a run: encode/decode and EOS from a Hugging Face ``tokenizer`` (:func:`tokenizer_codec`),
        chat prompts through its chat template, each env's rewards and timeout from ``spec.envs``, prompts
        limited to the context (``rollout.max_model_len``, else the tokenizer's ``model_max_length``) less
        ``sampling.max_tokens``.

        Raises:
            the errors of :func:`rlrun.rewards.scoring.env_rewards`.
        """
        encode, decode, eos_id = tokenizer_codec(tokenizer)
        render = render_reply = None
        if getattr(tokenizer, "chat_template", None):

            def render(messages: Messages, tools: list | None = None) -> str:
                kwargs = {"tools": tools} if tools else {}
                return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)

            render_reply = reply_renderer(tokenizer)

        context = spec.rollout.max_model_len or getattr(tokenizer, "model_max_length", None)
        limit = context - spec.sampling.max_tokens if context and context < UNLIMITED_CONTEXT else None
        builder = cls(
            encode,
            decode,
            eos_id,
            envs,
            rewards={e.name: env_rewards(e, envs[e.name]) for e in spec.envs if e.name in envs},
            reward_timeout_s={e.name: e.reward_timeout_seconds for e in spec.envs},
            render=render,
            max_prompt_tokens=limit,
            render_reply=render_reply,
        )
        builder.max_steps = spec.max_steps
        return builder

    def tell_rewards(self, max_steps: int, log_metric: Callable[[str, float], None] | None) -> None:
        """What the rewards are told besides the data (TRL's trainer arguments): the run's last step, and where their
        ``log_metric`` calls go (:class:`~rlrun.rewards.scoring.RewardContext`)."""
        self.max_steps, self.log_metric = max_steps, log_metric

    def prompt_text(self, task: Task) -> str:
        """The text the model is prompted with: the prompt itself, or a chat prompt through the chat template
        (rendered once per distinct prompt).

        Raises:
            PromptError: a chat prompt and no chat template.
        """
        if not task.is_chat:
            return task.prompt  # type: ignore[return-value]
        if self.render is None:
            raise PromptError(
                f"env {task.env} gave a chat prompt, and the model's tokenizer has no chat template: give the env "
                "plain-text prompts, or use a model with one (the builtin tiny model has one)"
            )
        tools = task.info.get("tools")  # tool schemas (rlrun.envs.tools), for a template that renders them
        key = json.dumps([task.prompt, tools], sort_keys=True)
        text = self._rendered.get(key)
        if text is None:
            if len(self._rendered) >= PROMPT_CACHE_SIZE:
                self._rendered.clear()
            args = (task.prompt, tools) if tools else (task.prompt,)
            text = self._rendered[key] = self.render(*args)  # type: ignore[arg-type]
        return text

    def prompt_ids(self, task: Task) -> Sequence[int]:
        """The token ids of ``task``'s prompt.

        Raises:
            PromptTooLongError: longer than ``max_prompt_tokens``.
        """
        ids = self.encode(self.prompt_text(task))
        if self.max_prompt_tokens is not None and len(ids) > self.max_prompt_tokens:
            raise self.too_long(task, len(ids))
        return ids

    def prompt_overflow(self, task: Task) -> int | None:
        """The length of ``task``'s prompt in tokens when it is longer than ``max_prompt_tokens``, else None.

        Raises:
            PromptError: a chat prompt and no chat template.
        """
        if self.max_prompt_tokens is None:
            return None
        n = len(self.encode(self.prompt_text(task)))
        return n if n > self.max_prompt_tokens else None

    def too_long(self, task: Task, tokens: int) -> PromptTooLongError:
        """The error of ``task``'s prompt of ``tokens`` tokens, too long (names the env, the task and both lengths)."""
        return PromptTooLongError(
            f"env {task.env} task {task.index}: the prompt is {tokens} tokens, and at most "
            f"{self.max_prompt_tokens} fit (the model's context less sampling.max_tokens); "
            f"prompt starts {self.prompt_text(task)[:60]!r}"
        )

    def context_refused(self, task: Task, tokens: int, refusal: ContextExceeded) -> ServerContextTooSmall:
        """The error that stops a run whose server refused ``task``'s prompt of ``tokens`` tokens as longer
        than its context (``refusal``): one line naming the setting to give (``spec.rollout.max_model_len``)
        and the context."""
        context = refusal.context
        said = f"its context is {context} tokens" if context else f"it said: {refusal.message[:200]}"
        limit = self.max_prompt_tokens
        believed = (
            "rlrun was told no context (spec.rollout.max_model_len unset, the tokenizer gives no limit)"
            if limit is None
            else f"rlrun allowed prompts of up to {limit} tokens (the context it was told less max_tokens)"
        )
        value = context if context else "the server's context"
        return ServerContextTooSmall(
            f"env {task.env} task {task.index}: the rollout server refused the prompt of {tokens} tokens as "
            f"longer than its context ({said}), and {believed}: set spec.rollout.max_model_len: {value} "
            "so that every prompt is measured against it before the first request "
            "(rollout.overlong_prompts: filter skips a prompt too long, refuse stops the run) and "
            "multi-turn episodes end before it"
        )

    def multi_turn(self, task: Task) -> bool:
        """Whether ``task``'s env plays conversations (:func:`rlrun.envs.base.is_multi_turn`)."""
        return is_multi_turn(self.envs[task.env])

    def text(self, completion: Completion) -> str:
        """A completion's text up to EOS, without special tokens (what envs and rewards read)."""
        ids = completion.token_ids
        return self.decode(list(ids[: ids.index(self.eos_id)] if self.eos_id in ids else ids))

    def reply_ids(self, task: Task, message: str | Messages) -> Sequence[int]:
        """The token ids of a multi-turn env's answer ``message`` to ``task`` (:mod:`.turns`): its text for a
        plain-text prompt; for a chat prompt, a ``user`` message (a text) or the messages given, as the chat
        template renders them after an assistant turn.

        Raises:
            PromptError: chat messages for a plain-text prompt, or a chat answer without a chat template.
        """
        if task.is_chat and self.render_reply is None:
            raise PromptError(f"env {task.env} answered a chat prompt, and the tokenizer has no chat template")
        try:
            return self.encode(answer_text(self.render_reply, task, message))  # type: ignore[arg-type]
        except ValueError as exc:
            raise PromptError(str(exc)) from exc

    def turn_io(self, task: Task, complete: Callable[[list[int]], Any]) -> TurnIO:
        """What :func:`rlrun.orchestrator.turns.play` needs for ``task``, sampling each turn with ``complete``."""
        timeout = self.reward_timeout_s.get(task.env, 60.0)
        if task.env not in self.env_calls:  # an env added after the builder was made
            self.env_calls[task.env] = env_threads(self.envs[task.env], task.env)
        calls = self.env_calls[task.env]
        return TurnIO(complete, self.text, self.reply_ids, self.max_prompt_tokens, timeout, env_calls=calls)

    async def episodes(
        self,
        request: GroupRequest,
        policy_version: int,
        prompt_ids: Sequence[int],
        completions: list[Completion] | None,
        conversations: list[Conversation] | None = None,
    ) -> ScoredRequest:
        """The episodes of ``request``'s members, numbered from its first member, each scored by its env's rewards
        on its text up to EOS (in a worker thread) and stamped with ``policy_version`` (the version current at
        dispatch); members whose reward failed are listed instead.

        ``conversations``: a multi-turn env's played episodes, one per member (:mod:`.turns`; ``completions``: their
        first turns, None for a conversation continued at its last durable turn): each episode's completion is its
        whole stream after the prompt (env tokens with NaN logprobs), its rewards score its last turn's text, plus
        the env's per-turn rewards; a conversation the env failed is a failed member. A continued conversation's
        episode keeps its member number (``request.resume_from``; the dispatcher passes its first turn's version).
        """
        task = request.task
        scores = await self.score(task, completions or [], conversations, policy_version)
        prompt = array("q", prompt_ids)
        out = ScoredRequest([], [], {series: [] for series in scores.parts})
        for k in range(len(conversations) if conversations is not None else len(completions or [])):
            member = request.first_member + k
            conv, c = (conversations[k], None) if conversations is not None else (None, completions[k])  # type: ignore[index]
            reward = scores.rewards[k]
            if reward is None:
                out.failed.append((member, scores.errors[k] or "no reward"))
                continue
            out.episodes.append(
                Episode(
                    group_id=request.group_id,
                    member=member,
                    task=task,
                    prompt_ids=prompt,
                    completion_ids=array("q", conv.completion_ids if conv is not None else c.token_ids),
                    logprobs=array("d", conv.logprobs if conv is not None else c.logprobs),
                    policy_version=policy_version,
                    reward=reward,
                    finish_reason=conv.finish_reason if conv is not None else c.finish_reason,
                )
            )
            for series, values in scores.parts.items():
                out.parts[series].append(values[k])
            if conv is not None:
                for key, value in (
                    ("num_turns", conv.turns),
                    ("tool_calls", conv.tool_calls),
                    ("tool_errors", conv.tool_errors),
                ):
                    out.turns.setdefault(key, []).append(value)
        return out

    async def score(
        self,
        task: Task,
        completions: list[Completion],
        conversations: list[Conversation] | None = None,
        policy_version: int = 0,
        training: bool = True,
    ) -> GroupScores:
        """``completions`` of ``task`` scored by its env's rewards on their texts up to EOS, in a worker thread.

        ``conversations`` (a multi-turn env's, one per completion: :mod:`.turns`): each is scored on its last turn's
        text and whole completion ids, plus the env's per-turn rewards; one the env failed is a failed member.
        ``policy_version``: the version that sampled them (the rewards' ``trainer_state.global_step``); ``training``
        False (an evaluation): the rewards' ``log_metric`` calls are dropped.
        """
        if conversations is None:
            texts, ids = [self.text(c) for c in completions], [list(c.token_ids) for c in completions]
        else:
            texts, ids = [c.last_text for c in conversations], [c.completion_ids for c in conversations]
        context = RewardContext(policy_version, self.max_steps, self.log_metric if training else None)
        scores = await self.scorer.score(
            self.rewards[task.env], task, texts, ids, self.reward_timeout_s.get(task.env, 60.0), context
        )
        for k, conv in enumerate(conversations or []):
            if conv.error is not None:
                scores.rewards[k], scores.errors[k] = None, conv.error
            elif scores.rewards[k] is not None:
                scores.rewards[k] += conv.reward
        return scores

    def close(self) -> None:
        """Stop the reward workers and let the envs' idle threads end (hung calls are not waited for)."""
        self.scorer.close()
        for calls in self.env_calls.values():
            calls.close()
