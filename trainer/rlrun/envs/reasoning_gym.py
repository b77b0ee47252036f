"""`reasoning-gym`: the procedural tasks of the `reasoning-gym` library, one task or a weighted mixture.

Invariant: task ``index`` of ``split`` for ``seed`` is a pure function of the three (and of the env's
args and the reasoning-gym version: :meth:`ReasoningGymEnv.fingerprint`); streams of different seeds
share no item but by chance (see *Items*); and no ``eval`` question is ever a ``train`` question,
whatever the seeds (see *Splits*).

**Items.** reasoning-gym derives item ``i`` of a dataset seeded ``s`` from ``Random(s + i)``, so the
datasets of seeds ``s`` and ``s + 1`` are each other shifted by one. This env never hands a run's seed
to reasoning-gym. Task ``index`` of ``seed`` picks its mixture member with
``random.Random(f"{namespace}:{seed}:{index}")`` (namespace ``reasoning-gym`` for ``train``,
``reasoning-gym-eval`` for ``eval``; the member stays fixed while the item is redrawn, so a split's
mixture follows the weights exactly), then takes its draws ``d = 0, 1, …`` from **blocks**: reasoning-gym
datasets of :data:`BLOCK_ITEMS` items, each made with ``create_dataset(member, seed=S, size=BLOCK_ITEMS,
**config)`` where ``S`` is the first 8 bytes of SHA-256 of ``"{namespace}:{seed}:{member}:{index // B}:{d // A}"``
modulo ``2**32 - BLOCK_ITEMS`` (32 bits: some generators seed NumPy, which takes no more). Draw ``d`` is
item ``(index % B) * A + d % A`` of its block, with ``A`` = :data:`DRAWS_PER_BLOCK` of the split and
``B = BLOCK_ITEMS // A`` tasks per block. So one block (whose ``create_dataset`` may read word lists:
up to a few hundred ms for a few tasks, microseconds for most) serves ``B`` consecutive tasks, and the
generator seeds ``S + item`` of two blocks coincide only by chance: among ``n`` items of a run, about
``n² / 2**33`` pairs (about 100 in a million items), far fewer than the repeats a task's own question
space gives. ``Task.info["item"]`` records ``{"seed": S, "size": BLOCK_ITEMS, "index": item}``, which is
all ``create_dataset`` needs to make the item again.

**Cost.** Besides the generator itself, a task costs tens of microseconds, and a block's creation shared
by its tasks (about 0.25 ms a train task for spell_backward, which reads a word list per dataset). The generator's
own cost is reasoning-gym's: well under 1 ms for most tasks, tens of ms for a few (sokoban, zebra_puzzles),
and basic_arithmetic with division can take seconds on rare items (its divisor search is O(√n)). An eval
task costs about ten draws.

**Splits.** A question is **held out** when the first 8 hex digits of the SHA-256 of its text, read as a
number, are divisible by :data:`HELD_OUT_ONE_IN` (10): the ``eval`` stream redraws until it draws a held-out
question, the ``train`` stream until it draws one that is not (at most :data:`MAX_DRAWS` draws; a task
whose config gives too few distinct questions to hold any out raises). A draw whose generation raises
(basic_arithmetic divides by zero now and then) is skipped the same way. The question text alone decides,
whichever member made it, so no eval question equals a train question of any member.

**Prompt.** ``chat=True``: ``[{"role": "system", "content": system_prompt}, {"role": "user", "content":
question}]`` (no system message when ``system_prompt`` is ``""``). ``chat=False``: the plain text
``f"{system_prompt}\\n\\n{question}{answer_cue}"`` (``f"{question}{answer_cue}"`` when ``system_prompt`` is
``""``); the default cue is ``"\\n<answer>"`` for the ``tag`` format, ``"\\nAnswer: "`` for ``raw``.

**Answer extraction** (``answer_format``). ``tag``: the text between the last ``</answer>`` and the
last ``<answer>`` before it, stripped, looked for in the completion (with ``chat=False``, in
``answer_cue + completion``, so a cue ending in ``<answer>`` opens the tag); no such pair gives no
answer. ``raw``: the whole completion, stripped.

**Reward** (``scoring``). ``reasoning_gym`` (the default): reasoning-gym's own ``score_answer(extracted,
entry)`` of the task's member (``None`` when nothing was extracted: 0.0 for every scorer of reasoning-gym
0.1.25), clamped to ``[0, 1]``; a scorer that raises on a malformed answer scores 0.0. Beware its **partial
credit**: the base scorer (``ProceduralDataset.score_answer``, which most tasks keep — basic_arithmetic,
chain_sum, …) gives ``len(answer) / len(extracted)`` when the reference answer is a *substring* of the
extracted one: ``"9991"`` for ``1`` scores 0.25, so in a group of 4 where the rest score 0 that wrong answer
gets advantage +1.73 once std-normalised — the policy is pushed towards answers that merely contain the
right one. ``exact``: 1.0 when the task's scorer gives full credit (its own notion of right: a tolerance,
one of several valid answers), else 0.0 — no partial credit. The entry ``{"question", "answer",
"metadata"}`` is
rebuilt from the :class:`~rlrun.envs.base.Task` alone (its prompt, ``answer`` and ``info``, where
``info["task"]`` names the member), so a task
scores the same in another process, after a JSON round trip: ``info["metadata"]`` is the item's
metadata in JSON form and ``info["metadata_tuples"]`` the paths of the values that were tuples
(restored before scoring: some scorers compare grids as tuples). Dict keys that are not strings become
strings (no scorer of 0.1.25 reads such keys).

**Families.** A mixture's task records its member in ``info["family"]`` (:data:`rlrun.envs.base.FAMILY`), so
its scores are reported per task family besides the mixture's whole: ``reward/<env>/<member>`` in
``metrics.jsonl`` and ``per_env.<env>.per_family.<member>`` in ``eval.jsonl``.
"""

from __future__ import annotations

import hashlib
import math
import random
import threading
from collections import OrderedDict
from typing import Any

try:
    import reasoning_gym
    import reasoning_gym.factory
except ImportError as exc:  # resolve_env reports it as "env 'reasoning-gym' does not load: …"
    raise ImportError(
        f"the reasoning-gym env needs the reasoning-gym package (pip install reasoning-gym): {exc}"
    ) from exc

from rlrun.envs.base import FAMILY, SPLITS, Split, Task
from rlrun.envs.reasoning_gym_tasks import (
    Member,
    make_member,
    reasoning_gym_version,
    restore_tuples,
    to_json,
)

#: Bump when the mapping (seed, index, split) → item changes: :meth:`ReasoningGymEnv.fingerprint` holds it.
DERIVATION_VERSION = 1
#: Items in one block (one reasoning-gym dataset object serving consecutive tasks; module docstring).
BLOCK_ITEMS = 1024
#: Draws of one task that one block holds, per split: ``train`` keeps about 9 draws in 10, ``eval`` 1 in 10.
DRAWS_PER_BLOCK: dict[str, int] = {"train": 8, "eval": 64}
#: About one question in this many is held out for the ``eval`` split.
HELD_OUT_ONE_IN = 10
#: Most draws for one task before giving up (the task's question space is too small to split).
MAX_DRAWS = 1024
#: Seed namespace of each split's stream.
NAMESPACES: dict[str, str] = {"train": "reasoning-gym", "eval": "reasoning-gym-eval"}
#: Blocks kept per mixture member (the current ones of ``train`` and ``eval``, and a few behind).
BLOCKS_KEPT_PER_MEMBER = 4

ANSWER_FORMATS = ("tag", "raw")
#: How a completion's extracted answer is scored (module docstring, *Reward*).
SCORINGS = ("reasoning_gym", "exact")
OPEN_TAG = "<answer>"
CLOSE_TAG = "</answer>"
DEFAULT_SYSTEM_PROMPTS: dict[str, str] = {
    "tag": "Solve the problem. You may reason first; end with your final answer alone between "
    "<answer> and </answer>, e.g. <answer>your answer</answer>.",
    "raw": "Reply with the final answer only.",
}
DEFAULT_ANSWER_CUES: dict[str, str] = {"tag": "\n" + OPEN_TAG, "raw": "\nAnswer: "}

#: A setting a ~0.6M-parameter character-level model with a 64-token context learns a little on a CPU:
#: sums and differences of two numbers 0–10 (242 distinct questions, about 24 held out). With these args the
#: prompt is ``"Calculate 7 - 3.\nAnswer: "`` (25–27 characters) and the answer 1–3 characters (``-10`` to
#: ``20``), so prompt, answer and EOS fit in 30 tokens.
TINY_MODEL_ARGS: dict[str, Any] = {
    "task": "basic_arithmetic",
    "config": {
        "min_terms": 2,
        "max_terms": 2,
        "min_digits": 1,
        "max_digits": 1,
        "operators": ["+", "-"],
        "allow_parentheses": False,
        "allow_negation": False,
    },
    "chat": False,
    "system_prompt": "",
    "answer_format": "raw",
}


def held_out(question: str) -> bool:
    """Whether ``question`` belongs to the ``eval`` split (about one in :data:`HELD_OUT_ONE_IN`)."""
    return int(hashlib.sha256(question.encode()).hexdigest()[:8], 16) % HELD_OUT_ONE_IN == 0


def block_seed(namespace: str, seed: int, member: str, block: int, row: int) -> int:
    """The reasoning-gym seed of a block, in ``[0, 2**32 - BLOCK_ITEMS)`` (module docstring, *Items*)."""
    digest = hashlib.sha256(f"{namespace}:{seed}:{member}:{block}:{row}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % (2**32 - BLOCK_ITEMS)


def extract_answer(text: str, answer_format: str) -> str | None:
    """The answer in ``text``: ``tag``, the stripped text inside the last ``<answer>…</answer>`` (None: no such
    pair); ``raw``, all of ``text`` stripped."""
    if answer_format == "raw":
        return text.strip()
    end = text.rfind(CLOSE_TAG)
    start = text.rfind(OPEN_TAG, 0, end) if end >= 0 else -1
    if start < 0:
        return None
    return text[start + len(OPEN_TAG) : end].strip()


class ReasoningGymEnv:
    """Tasks of one reasoning-gym task, or of a weighted mixture (module docstring for the derivation).

    Args:
        task: one reasoning-gym task by name (``reasoning_gym.factory.DATASETS``), e.g. ``"basic_arithmetic"``.
        config: that task's config (its dataclass's fields but ``seed`` and ``size``), e.g. ``{"max_terms": 3}``.
        tasks: a mixture instead of ``task``: ``[{"name": str, "weight": float (default 1), "config": dict
            (default {})}, …]``, names distinct.
        answer_format: ``"tag"`` (the answer is inside the last ``<answer>…</answer>``) or ``"raw"`` (the whole
            completion is the answer).
        system_prompt: the instructions before the question (None: :data:`DEFAULT_SYSTEM_PROMPTS` of the format;
            ``""``: none).
        chat: a chat prompt (True) or a plain text (False).
        answer_cue: with ``chat=False``, the text after the question (None: :data:`DEFAULT_ANSWER_CUES` of the
            format); not allowed with ``chat=True``.
        scoring: ``"reasoning_gym"`` (the task's own scorer, partial credit included) or ``"exact"`` (1 only
        for an answer the scorer gives full credit, else 0); module docstring, *Reward*.

    :data:`TINY_MODEL_ARGS` is a setting the builtin tiny model can learn. Raises ``ValueError`` naming the arg
    for args it cannot use (:func:`make_member` for the tasks' own).
    """

    name = "reasoning-gym"

    def __init__(
        self,
        task: str | None = None,
        config: dict[str, Any] | None = None,
        tasks: list[dict[str, Any]] | None = None,
        answer_format: str = "tag",
        system_prompt: str | None = None,
        chat: bool = True,
        answer_cue: str | None = None,
        scoring: str = "reasoning_gym",
    ) -> None:
        if scoring not in SCORINGS:
            raise ValueError(f"reasoning-gym: scoring must be one of {list(SCORINGS)}, got {scoring!r}")
        if answer_format not in ANSWER_FORMATS:
            raise ValueError(
                f"reasoning-gym: answer_format must be one of {list(ANSWER_FORMATS)}, got {answer_format!r}"
            )
        if not isinstance(chat, bool):
            raise ValueError(f"reasoning-gym: chat must be true or false, got {chat!r}")
        if system_prompt is not None and not isinstance(system_prompt, str):
            raise ValueError(f"reasoning-gym: system_prompt must be a string, got {type(system_prompt).__name__}")
        if answer_cue is not None and (chat or not isinstance(answer_cue, str)):
            raise ValueError("reasoning-gym: answer_cue must be a string, and is only for chat: false")
        self.members = self._members(task, config, tasks)
        self.by_name = {m.name: m for m in self.members}
        self.weights = [m.weight for m in self.members]
        self.answer_format, self.scoring = answer_format, scoring
        self.system_prompt = DEFAULT_SYSTEM_PROMPTS[answer_format] if system_prompt is None else system_prompt
        self.chat = chat
        self.answer_cue = DEFAULT_ANSWER_CUES[answer_format] if answer_cue is None else answer_cue
        self._blocks: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
        self._blocks_kept = BLOCKS_KEPT_PER_MEMBER * len(self.members)
        self._draw_lock = threading.Lock()

    @staticmethod
    def _members(task: Any, config: Any, tasks: Any) -> list[Member]:
        if (task is None) == (tasks is None):
            raise ValueError("reasoning-gym: give exactly one of task (one task by name) and tasks (a mixture)")
        if task is not None:
            return [make_member("task", task, 1.0, {} if config is None else config)]
        if config is not None:
            raise ValueError("reasoning-gym: config is for task; a mixture gives each of its tasks a config")
        if not isinstance(tasks, list) or not tasks:
            raise ValueError("reasoning-gym: tasks must be a non-empty list of {name, weight, config}")
        members = []
        for i, spec in enumerate(tasks):
            where = f"tasks[{i}]"
            if not isinstance(spec, dict) or "name" not in spec:
                raise ValueError(f"reasoning-gym: {where}: must be a mapping with a name, got {spec!r:.80}")
            unknown = sorted(set(spec) - {"name", "weight", "config"})
            if unknown:
                raise ValueError(f"reasoning-gym: {where}: unknown keys {unknown} (keys: name, weight, config)")
            members.append(make_member(where, spec["name"], spec.get("weight", 1.0), spec.get("config") or {}))
        names = [m.name for m in members]
        dups = sorted({n for n in names if names.count(n) > 1})
        if dups:
            raise ValueError(f"reasoning-gym: tasks: {dups[0]!r} appears twice (merge its configs, or adjust weights)")
        return members

    def task(self, seed: int, index: int, split: Split = "train") -> Task:
        """Task ``index`` of ``split``'s stream for ``seed`` (module docstring: *Items*, *Splits*, *Prompt*).

        Raises:
            ValueError: ``split`` is neither ``train`` nor ``eval``.
            RuntimeError: no question of ``split`` in :data:`MAX_DRAWS` draws (reasoning-gym's last error
                chained when generating failed).
        """
        if split not in SPLITS:
            raise ValueError(f"reasoning-gym: split must be one of {list(SPLITS)}, got {split!r}")
        member, entry, item = self.draw(seed, index, split)
        metadata, tuples = to_json(entry["metadata"])
        info: dict[str, Any] = {"task": member.name, "item": item, "metadata": metadata}
        if tuples:
            info["metadata_tuples"] = tuples
        if len(self.members) > 1:  # a mixture's scores per member (module docstring, *Families*)
            info[FAMILY] = member.name
        answer = entry["answer"]
        return Task(
            env=self.name,
            index=index,
            prompt=self.prompt(entry["question"]),
            answer=None if answer is None else str(answer),
            info=info,
        )

    def draw(self, seed: int, index: int, split: Split) -> tuple[Member, dict[str, Any], dict[str, int]]:
        """``(member, entry, item)``: the reasoning-gym entry of task ``index`` and where it comes from
        (``{"seed", "size", "index"}`` of ``create_dataset``). Raises as :meth:`task` does."""
        namespace = NAMESPACES[split]
        member = random.Random(f"{namespace}:{seed}:{index}").choices(self.members, weights=self.weights)[0]
        per_block = DRAWS_PER_BLOCK[split]
        tasks_per_block = BLOCK_ITEMS // per_block
        want_held_out = split == "eval"
        failure: Exception | None = None
        with self._draw_lock:  # block cache, and generators that keep state (e.g. knights_knaves' rng)
            for d in range(MAX_DRAWS):
                dataset = self._block(namespace, seed, member, index // tasks_per_block, d // per_block)
                position = (index % tasks_per_block) * per_block + d % per_block
                try:
                    entry = dataset[position]
                except Exception as exc:  # e.g. basic_arithmetic's rare ZeroDivisionError
                    failure = exc
                    continue
                if held_out(entry["question"]) == want_held_out:
                    return member, entry, {"seed": dataset.seed, "size": BLOCK_ITEMS, "index": position}
        if failure is not None:
            raise RuntimeError(
                f"reasoning-gym: task {member.name!r} gave no {split} question in {MAX_DRAWS} draws (seed {seed}, "
                f"index {index}); generating raised, last: {failure!r}"
            ) from failure
        raise RuntimeError(
            f"reasoning-gym: task {member.name!r} gave no {split} question in {MAX_DRAWS} draws (seed {seed}, index "
            f"{index}): its config {member.config} makes too few distinct questions to hold one in "
            f"{HELD_OUT_ONE_IN} out; widen it"
        )

    def _block(self, namespace: str, seed: int, member: Member, block: int, row: int) -> Any:
        key = (namespace, seed, member.name, block, row)
        dataset = self._blocks.get(key)
        if dataset is None:
            s = block_seed(namespace, seed, member.name, block, row)
            dataset = reasoning_gym.create_dataset(member.name, seed=s, size=BLOCK_ITEMS, **member.config)
            self._blocks[key] = dataset
            while len(self._blocks) > self._blocks_kept:
                self._blocks.popitem(last=False)
        else:
            self._blocks.move_to_end(key)
        return dataset

    def prompt(self, question: str) -> str | list[dict[str, str]]:
        """The prompt of ``question`` (module docstring, *Prompt*)."""
        if self.chat:
            system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
            return [*system, {"role": "user", "content": question}]
        return self._plain_prefix() + question + self.answer_cue

    def _plain_prefix(self) -> str:
        return f"{self.system_prompt}\n\n" if self.system_prompt else ""

    def question(self, task: Task) -> str:
        """The question of ``task``, read back from its prompt (the whole prompt text when it has another form)."""
        if isinstance(task.prompt, list):
            users = [m["content"] for m in task.prompt if m.get("role") == "user"]
            return users[-1] if users else ""
        prefix, cue = self._plain_prefix(), self.answer_cue
        if task.prompt.startswith(prefix) and task.prompt.endswith(cue):
            return task.prompt[len(prefix) : len(task.prompt) - len(cue)]
        return task.prompt

    def entry(self, task: Task) -> dict[str, Any]:
        """The reasoning-gym entry ``{"question", "answer", "metadata"}`` of ``task``, rebuilt from its fields.

        Raises:
            ValueError: ``task.info`` names no task of this env's mixture.
        """
        name = task.info.get("task")
        if name not in self.by_name:
            raise ValueError(
                f"reasoning-gym: task {task.index} is of reasoning-gym task {name!r}, not one of this env's "
                f"{sorted(self.by_name)}"
            )
        metadata = restore_tuples(task.info.get("metadata", {}), task.info.get("metadata_tuples", []))
        return {"question": self.question(task), "answer": task.answer, "metadata": metadata}

    def extract(self, completion: str) -> str | None:
        """The answer in ``completion`` (module docstring, *Answer extraction*)."""
        text = completion if self.chat or self.answer_format == "raw" else self.answer_cue + completion
        return extract_answer(text, self.answer_format)

    def reward(self, task: Task, completion: str) -> float:
        """reasoning-gym's score of the answer extracted from ``completion``, in ``[0, 1]`` (a scorer that raises
        scores 0.0); with ``scoring: exact``, 1.0 for full credit and 0.0 for anything less. Thread-safe: each
        member's scorer runs under its own lock.

        Raises:
            ValueError: see :meth:`entry`.
        """
        entry = self.entry(task)
        member = self.by_name[task.info["task"]]
        answer = self.extract(completion)
        with member.lock:
            try:
                score = float(member.scorer.score_answer(answer, entry))
            except Exception:  # reasoning-gym's parsers raise on some malformed answers: a wrong answer
                return 0.0
        score = min(1.0, max(0.0, score)) if math.isfinite(score) else 0.0
        if self.scoring == "exact":
            return 1.0 if score >= 1.0 else 0.0
        return score

    def demonstration(self, task: Task) -> str | None:
        """The completion a solver would write: the reference answer in the answer format (None: the task has no
        reference answer). Its :meth:`reward` is the scorer's score of ``task.answer``."""
        if task.answer is None:
            return None
        if self.answer_format == "raw":
            return task.answer
        opened = not self.chat and self.answer_cue.endswith(OPEN_TAG)
        return f"{'' if opened else OPEN_TAG}{task.answer}{CLOSE_TAG}"

    def fingerprint(self) -> str:
        """What the task stream depends on besides the args: the reasoning-gym version and this derivation's."""
        return f"reasoning-gym=={reasoning_gym_version()}; derivation {DERIVATION_VERSION}"
