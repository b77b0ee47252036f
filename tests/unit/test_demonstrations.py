"""What the ``tiny`` model is warm-started on: train tasks of the run's envs in their weights, each taught its
demonstration (else its answer), from a seed namespace of its own; tasks without either, longer than the context,
or held for the checks are skipped; no env with answers is refused, naming what each env lacked."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
from rlrun.envs.base import Task
from rlrun.envs.reverse_text import ReverseTextEnv
from rlrun.model.chat_tokenizer import build_chat_tokenizer
from rlrun.model.demonstrations import (
    CHECKS,
    PROBE_LIMIT,
    WARM_START,
    DemonstrationStream,
    NoDemonstrationsError,
    Row,
    demonstration,
    env_seed,
    packed,
)


class CountEnv:
    """Task ``i``: a chat prompt asking for the successor of a number; answers only where ``answered(i)``."""

    name = "count"

    def __init__(self, answered=lambda i: True, distinct: int = 1000) -> None:
        self.answered = answered
        self.distinct = distinct
        self.seeds: set[int] = set()

    def task(self, seed: int, index: int, split: str = "train") -> Task:
        self.seeds.add(seed)
        n = (seed + index) % self.distinct
        prompt = [{"role": "user", "content": f"{n}+1"}]
        return Task(self.name, index, prompt, str(n + 1) if self.answered(index) else None)

    def reward(self, task: Task, completion: str) -> float:
        return float(completion == task.answer)


class WorkedEnv(CountEnv):
    """A :class:`CountEnv` with worked solutions."""

    def demonstration(self, task: Task) -> str:
        return f"{task.prompt[0]['content']}={task.answer}"


def stream(envs, weights=None, max_tokens=512, seed=1234, **kw) -> DemonstrationStream:
    return DemonstrationStream(
        [(e.name, e) for e in envs], weights or [1.0] * len(envs), build_chat_tokenizer(), max_tokens, seed, **kw
    )


def test_the_completion_is_the_envs_demonstration_when_it_has_one_else_the_answer():
    task = CountEnv().task(0, 41)
    assert demonstration(CountEnv(), task, build_chat_tokenizer()) == "42"
    assert demonstration(WorkedEnv(), task, build_chat_tokenizer()) == "41+1=42"


def test_a_chat_prompt_is_rendered_with_the_generation_prompt_and_counted_with_eos():
    row = next(stream([CountEnv()]))
    assert row.prompt.startswith("<|user|>") and row.prompt.endswith("<|end|><|assistant|>")
    content = row.task.prompt[0]["content"]
    assert row.tokens == 1 + len(content) + 2 + len(row.completion) + 1


def test_the_warm_start_draws_train_tasks_from_a_seed_no_run_would_use():
    env = CountEnv()
    list(itertools.islice(stream([env]), 10))
    (seed,) = env.seeds
    assert seed == env_seed(WARM_START, 1234) and seed > 2**40
    assert env_seed(WARM_START, 1234) != env_seed(WARM_START, 1235) != env_seed(CHECKS, 1234)


def test_the_same_seed_draws_the_same_rows_in_the_weights_proportions():
    envs = [ReverseTextEnv(), CountEnv()]
    first = [(r.env, r.prompt) for r in itertools.islice(stream(envs, [3.0, 1.0]), 400)]
    again = [(r.env, r.prompt) for r in itertools.islice(stream(envs, [3.0, 1.0]), 400)]
    assert first == again
    share = Counter(env for env, _ in first)[0] / 400
    assert 0.68 < share < 0.82


def test_tasks_without_answers_are_skipped_and_counted():
    s = stream([CountEnv(answered=lambda i: i % 3 == 0)])
    rows = list(itertools.islice(s, 10))
    assert all(r.task.index % 3 == 0 for r in rows)
    assert s.draws[0].used == 10 and s.draws[0].no_answer == 18


def test_rows_longer_than_the_context_are_skipped():
    s = stream([ReverseTextEnv(max_words=3, max_chars=40)], max_tokens=20)
    rows = list(itertools.islice(s, 50))
    assert max(r.tokens for r in rows) <= 20 and s.draws[0].too_long > 0


def test_an_env_without_answers_is_no_longer_drawn_and_none_at_all_is_refused():
    mixed = stream([CountEnv(answered=lambda i: False), ReverseTextEnv()])
    assert {r.env for r in itertools.islice(mixed, 200)} == {1}
    assert mixed.draws[0].asked == PROBE_LIMIT
    with pytest.raises(NoDemonstrationsError, match=r"count: 64 of 64 tasks without an answer.*tiny-reverse"):
        next(stream([CountEnv(answered=lambda i: False)]))


def test_an_env_without_answers_is_reported_once_not_by_the_check_stream_too(caplog):
    """Issue 36: "no answer in 64 tasks" was printed twice, by the stream of the check tasks and the warm start's."""
    envs = [CountEnv(answered=lambda i: False), ReverseTextEnv()]
    with caplog.at_level("WARNING", logger="rlrun.model.demonstrations"):
        list(itertools.islice(stream(envs, namespace=CHECKS), 100))
        list(itertools.islice(stream(envs), 100))
    said = [r.getMessage() for r in caplog.records]
    assert said == ["warm start: env count gave no answer in 64 tasks in a row; not drawing from it"]


def test_probe_finds_what_the_warm_start_would_refuse_before_it_starts(caplog):
    from rlrun.model.demonstrations import probe_demonstrations

    tokenizer = build_chat_tokenizer()
    with caplog.at_level("WARNING"):
        none = probe_demonstrations([("count", CountEnv(answered=lambda i: False))], tokenizer, 512, 1234)
        some = probe_demonstrations(
            [("count", CountEnv(answered=lambda i: False)), ("reverse-text", ReverseTextEnv())], tokenizer, 512, 1234
        )
    assert isinstance(none, NoDemonstrationsError) and "count: 64 of 64 tasks without an answer" in str(none)
    assert some is None and not caplog.records  # silent: validate says it in its own words


def test_check_prompts_are_not_trained_on_unless_they_are_nearly_all_the_env_has():
    held = {f"<|user|>{n}+1<|end|><|assistant|>" for n in range(0, 1000, 2)}
    s = stream([CountEnv()], exclude=[held])
    rows = list(itertools.islice(s, 100))
    assert not any(r.prompt in held for r in rows) and s.draws[0].held_for_checks > 0
    tiny = stream([CountEnv(distinct=10)], exclude=[{f"<|user|>{n}+1<|end|><|assistant|>" for n in range(10)}])
    assert next(tiny).prompt and tiny.draws[0].checks_trained


def rows_of(lengths: list[int]) -> list[Row]:
    return [Row(0, CountEnv().task(0, i), "p", "c", n) for i, n in enumerate(lengths)]


def test_batches_hold_at_most_the_row_and_padded_token_budgets():
    batches = list(packed(iter(rows_of([10, 10, 10, 30, 30, 5, 100, 3])), max_rows=3, max_tokens=64))
    assert [[r.tokens for r in b] for b in batches] == [[10, 10, 10], [30, 30], [5], [100], [3]]
