"""The environment interface: a named source of tasks plus a reward function.

An env is deliberately small so that a new one is a single module: it produces
:class:`Task` objects deterministically from ``(seed, index, split)`` — which is what
lets the orchestrator's train source resume from a bare cursor — and scores a
decoded completion against a task with a reward in ``[0, 1]`` (1: solved).

Two splits: ``train`` feeds training, ``eval`` is held out for evaluation
(:mod:`rlrun.orchestrator.evaluation`). They must be disjoint *as tasks*, not only as
streams: two streams drawn from one small space overlap whatever their seeds (and a
generator that derives item ``i`` of seed ``s`` from ``Random(s + i)`` makes seed ``s + 1``
seed ``s`` shifted by one), so an env partitions its task space and draws each split from
its own part.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

#: The two task streams of an env: ``train`` (what the run trains on) and ``eval`` (held out: what
#: evaluation scores, never trained). An env guarantees that no eval task is a training task.
Split = Literal["train", "eval"]
SPLITS: tuple[Split, ...] = ("train", "eval")


#: A chat prompt: ``[{"role": "system" | "user" | "assistant", "content": str}, …]`` (the OpenAI / Hugging Face
#: chat format), rendered by the tokenizer's chat template (:mod:`rlrun.orchestrator.episodes`).
Messages = list[dict[str, str]]
#: Roles a chat prompt's messages may have.
MESSAGE_ROLES = ("system", "user", "assistant", "tool")
#: A reward at least this solves its task: the top reward, 1, up to rounding (rewards are in ``[0, 1]``). What the
#: sink calls a group "solved by all", the evaluation ``greedy_solved`` and ``pass@k``, the tiny model's build "solved".
SOLVED_REWARD = 1.0 - 1e-9
#: The :attr:`Task.info` key naming a task's family (a string): a reasoning-gym mixture's member, a dataset's
#: ``family`` column. Scores are also reported per family — training's ``reward/<env>/<family>`` in
#: ``metrics.jsonl``, evaluation's ``per_env.<env>.per_family`` in ``eval.jsonl`` — for at most
#: :data:`MAX_FAMILIES` families of an env (the first seen; more would flood the trackers).
FAMILY = "family"
MAX_FAMILIES = 32


@dataclass(frozen=True)
class Task:
    """One prompt to roll out.

    Attributes:
        env: name of the env that made the task.
        index: position of the task in the env's deterministic stream.
        prompt: a plain text shown to the model as is (no chat template), or a chat prompt
            (:data:`Messages`) rendered by the tokenizer's chat template with the generation prompt.
        answer: reference the reward compares against (None: the task has none, e.g. a dataset
            without an answer column).
        info: the task's other fields (a dataset row's other columns, a procedural task's
            metadata): handed to reward functions as keyword arguments; JSON-compatible.
    """

    env: str
    index: int
    prompt: str | Messages
    answer: str | None
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def is_chat(self) -> bool:
        """Whether the prompt is a list of chat messages (rendered by the chat template)."""
        return not isinstance(self.prompt, str)

    def to_dict(self) -> dict[str, Any]:
        """Plain, JSON-compatible form (used in shipped batches, snapshots and the journal)."""
        data = {"env": self.env, "index": self.index, "prompt": self.prompt, "answer": self.answer}
        return data | ({"info": self.info} if self.info else {})

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Task:
        """Inverse of :meth:`to_dict` (files written before ``info`` existed have none)."""
        return cls(
            env=data["env"],
            index=int(data["index"]),
            prompt=data["prompt"],
            answer=data["answer"],
            info=data.get("info") or {},
        )


def check_messages(messages: Any, where: str) -> Messages:
    """``messages`` if it is a non-empty chat prompt (:data:`Messages`), else ``ValueError`` naming ``where``.

    Raises:
        ValueError: not a list, empty, an item that is not ``{"role": str, "content": str}``, or an
            unknown role (:data:`MESSAGE_ROLES`).
    """
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: a chat prompt must be a non-empty list of messages, got {type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f'{where}[{i}]: a message must be {{"role": str, "content": str}}, got {m!r:.80}')
        if m["role"] not in MESSAGE_ROLES:
            raise ValueError(f"{where}[{i}].role: must be one of {list(MESSAGE_ROLES)}, got {m['role']!r}")
    return messages


class Env(Protocol):
    """What the orchestrator needs from an env.

    ``reward`` is the env's own reward, used when the env's spec names no ``rewards`` (then the named
    reward functions replace it: :mod:`rlrun.rewards`). Optional, found with ``getattr``:
    ``fingerprint() -> str`` — a digest of the data the env's tasks come from (a dataset env: its
    files' bytes); a checkpoint keeps it and a resume whose env data changed is refused;
    ``demonstration(task) -> str | None`` — the completion that solves ``task`` (default: ``task.answer``),
    what the builtin ``tiny`` model's warm start trains on (:mod:`rlrun.model.tiny_envs`);
    ``num_task_keys() -> int`` and ``task_key(seed, index) -> int`` — a finite task space (a dataset's rows): which
    of its ``num_task_keys()`` tasks train task ``index`` asks, what a curriculum keeps state of
    (:mod:`rlrun.orchestrator.difficulty`).
    """

    name: str

    def task(self, seed: int, index: int, split: Split = "train") -> Task:
        """Return task number ``index`` of ``split``'s stream seeded by ``seed`` (pure function; no eval task
        is ever a train task, whatever the seeds)."""
        ...

    def reward(self, task: Task, completion: str) -> float:
        """Score ``completion`` (decoded text up to EOS; for a chat prompt, the assistant message's content)
        for ``task``, in ``[0, 1]``. Runs in a worker thread, never on the orchestrator's event loop."""
        ...


EnvFactory = Callable[..., Env]


def has_task_keys(env: object) -> bool:
    """Whether ``env`` (an env, or its class) has a finite task space: ``num_task_keys()`` and
    ``task_key(seed, index)`` (the dataset env's rows), what a curriculum keeps per-task state of
    (:mod:`rlrun.orchestrator.difficulty`)."""
    return callable(getattr(env, "num_task_keys", None)) and callable(getattr(env, "task_key", None))


@dataclass(frozen=True)
class Reply:
    """What a multi-turn env answers to one model turn (:class:`MultiTurnEnv.respond`).

    Attributes:
        message: what the model is shown next: for a chat prompt, a message content (a ``user`` turn) or
            :data:`Messages` (e.g. ``{"role": "tool", …}`` results), rendered by the chat template; for a
            plain-text prompt, text appended as is. None: nothing (only with ``done``).
        done: the episode ends here (the env's verdict; ``max_turns`` also ends it).
        state: the env's state after this turn, JSON-compatible (what the next :meth:`~MultiTurnEnv.respond`
            gets).
        reward: the env's reward for this turn (None: none); an episode's per-turn rewards are added to
            its reward (:mod:`rlrun.orchestrator.turns`).
        tool_calls: tool calls made in the turn; tool_errors: of them, how many raised or timed out
            (metrics ``tool_calls`` / ``tool_errors``).
    """

    message: str | Messages | None
    done: bool
    state: Any = None
    reward: float | None = None
    tool_calls: int = 0
    tool_errors: int = 0


class MultiTurnEnv(Env, Protocol):
    """An env whose episode is a conversation: after each model turn it answers (an observation, a tool
    result, a user message) or says the episode is done (:mod:`rlrun.orchestrator.turns` plays it).

    A single-turn env is the one-turn case: it has no ``respond``. The episode's rewards (the env's own
    ``reward`` or ``spec.envs[].rewards``) score the **last** model turn's text, and each turn's
    :attr:`Reply.reward` is added.

    Attributes:
        max_turns: most model turns in an episode (≥ 1): the episode ends after the last one.
        resumable: optional (default False): whether :meth:`start`'s and :meth:`respond`'s state is all the env
            needs to go on (plain JSON, no process, sandbox or connection behind it). Then each turn is journaled
            and a preempted episode is continued at its last durable turn (:mod:`rlrun.orchestrator.conversations`);
            else it starts over from its first turn, as a single-turn request in flight does. The state kept is a
            copy taken when the turn is kept, so :meth:`respond` may change its state in place; a state that is
            not plain JSON stops the run with :class:`EnvStateError`.
        max_concurrent_calls: optional (default 32, :data:`rlrun.orchestrator.turns.ENV_THREADS`): how many of
            its :meth:`start` and :meth:`respond` calls run at once, in threads of its own; each is timed by
            its own run time (``spec.envs[].reward_timeout_seconds``), and one past it gives its turn up
            (``docs/envs.md``, "Timeouts and concurrency of env code").
    """

    max_turns: int

    def start(self, task: Task) -> Any:
        """The env's state before the first model turn (JSON-compatible). Runs in one of the env's threads,
        never on the orchestrator's loop, timed out at ``spec.envs[].reward_timeout_seconds`` of its own run
        time."""
        ...

    def respond(self, task: Task, state: Any, completion: str) -> Reply:
        """Answer model turn ``completion`` (its text up to EOS) given ``state``. Runs in one of the env's
        threads, never on the orchestrator's loop, timed as :meth:`start`; a tool call is bounded by its
        tool's own timeout (:mod:`rlrun.envs.tools`)."""
        ...


class EnvStateError(ValueError):
    """A ``resumable`` env's state that is not plain JSON (message names the env and what to do). Retrying cannot
    heal it (``permanent``; the orchestrator exits 78 with ``reason``)."""

    permanent = True
    reason = "EnvStateNotJSON"


def is_multi_turn(env: Env) -> bool:
    """Whether ``env`` plays conversations (:class:`MultiTurnEnv`: it has ``respond``)."""
    return callable(getattr(env, "respond", None))
