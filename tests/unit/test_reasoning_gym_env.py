"""The builtin `reasoning-gym` env: pure, unshifted task streams, disjoint splits, reasoning-gym's own scoring."""

from __future__ import annotations

import dataclasses
import json
import random
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import reasoning_gym
from rlrun.api.spec import EnvSpec
from rlrun.envs import EnvArgsError, make_env
from rlrun.envs import reasoning_gym as rg_env
from rlrun.envs.base import Task
from rlrun.envs.reasoning_gym import TINY_MODEL_ARGS, ReasoningGymEnv, held_out

SMALL = TINY_MODEL_ARGS["config"]  # sums and differences of two numbers 0–10: 242 questions
#: basic_arithmetic's default expressions without division (whose generator can take seconds on rare items).
LARGE = {"operators": ["+", "-", "*"]}


@pytest.fixture(scope="module")
def arithmetic() -> ReasoningGymEnv:
    """basic_arithmetic with a large question space, chat prompt, tag format."""
    return ReasoningGymEnv(task="basic_arithmetic", config=LARGE)


@pytest.fixture(scope="module")
def small() -> ReasoningGymEnv:
    return ReasoningGymEnv(task="basic_arithmetic", config=SMALL)


def questions(env: ReasoningGymEnv, seed: int, n: int, split: str = "train") -> list[str]:
    return [env.question(env.task(seed, i, split)) for i in range(n)]


def test_a_task_is_a_pure_function_of_seed_index_and_split(arithmetic: ReasoningGymEnv) -> None:
    in_order = [arithmetic.task(7, i, split) for split in ("train", "eval") for i in range(150)]
    other = ReasoningGymEnv(task="basic_arithmetic", config=LARGE)
    calls = [(split, i) for split in ("train", "eval") for i in range(150)]
    random.Random(0).shuffle(calls)
    for split, i in calls:  # another order, other seeds in between: other blocks cached, some evicted
        other.task(8 + i % 3, 1000 * i, split)
        assert other.task(7, i, split) == in_order[i + (150 if split == "eval" else 0)]


def test_seed_one_is_not_seed_zero_shifted_by_one(arithmetic: ReasoningGymEnv) -> None:
    raw0 = reasoning_gym.create_dataset("basic_arithmetic", seed=0, size=10)
    raw1 = reasoning_gym.create_dataset("basic_arithmetic", seed=1, size=10)
    assert raw0[1]["question"] == raw1[0]["question"]  # the trap: reasoning-gym's seed s + 1 is seed s shifted
    q0, q1 = questions(arithmetic, 0, 400), questions(arithmetic, 1, 400)
    assert len(set(q0) & set(q1)) / 400 < 0.02
    assert sum(a == b for a, b in zip(q0[1:], q1[:-1], strict=True)) < 5


def test_mixture_follows_its_weights_in_both_splits() -> None:
    env = ReasoningGymEnv(
        tasks=[{"name": "basic_arithmetic", "weight": 3, "config": SMALL}, {"name": "gcd", "config": {}}]
    )
    for split, n in (("train", 2000), ("eval", 600)):
        counts = Counter(env.task(0, i, split).info["task"] for i in range(n))
        assert set(counts) == {"basic_arithmetic", "gcd"}
        assert counts["basic_arithmetic"] / n == pytest.approx(0.75, abs=0.04)


def test_no_eval_question_is_a_train_question_whatever_the_seeds(small: ReasoningGymEnv) -> None:
    train = set(questions(small, 0, 3000)) | set(questions(small, 1, 1000))
    evals = set(questions(small, 0, 300, "eval")) | set(questions(small, 5, 300, "eval"))
    assert len(train) > 150 and len(evals) > 12  # both splits cover their part of the 242 questions
    assert not train & evals
    assert all(held_out(q) for q in evals) and not any(held_out(q) for q in train)


def test_a_task_too_small_to_hold_out_raises_naming_its_config(small, monkeypatch) -> None:
    monkeypatch.setattr(rg_env, "held_out", lambda question: False)
    with pytest.raises(RuntimeError, match="too few distinct questions"):
        small.task(0, 0, "eval")


def test_the_reference_answer_in_tags_scores_one_and_a_wrong_one_less(small: ReasoningGymEnv) -> None:
    for i in range(20):
        task = small.task(3, i)
        wrong = str(int(task.answer) + 1)
        assert small.reward(task, f"I add them up.\n<answer> {task.answer} </answer>") == 1.0
        assert small.reward(task, small.demonstration(task)) == 1.0
        assert small.reward(task, f"<answer>{wrong}</answer>") < 1.0
        assert small.reward(task, f"<answer>{wrong}</answer> no: <answer>{task.answer}</answer>") == 1.0
        assert small.reward(task, f"<answer>{task.answer}</answer> no: <answer>{wrong}</answer>") < 1.0


def test_a_completion_without_a_closed_answer_tag_scores_zero(small: ReasoningGymEnv) -> None:
    task = small.task(3, 0)
    for completion in (task.answer, f"<answer>{task.answer}", f"{task.answer}</answer>", ""):
        assert small.reward(task, completion) == 0.0


def test_raw_format_scores_the_whole_stripped_completion() -> None:
    env = ReasoningGymEnv(task="basic_arithmetic", config=SMALL, answer_format="raw")
    task = env.task(0, 0)
    assert "<answer>" not in task.prompt[0]["content"]
    assert env.reward(task, f"  {task.answer}\n") == 1.0
    assert env.reward(task, f"<answer>{task.answer}</answer>") < 1.0
    assert env.demonstration(task) == task.answer


def test_chat_prompt_and_plain_prompt_with_its_answer_cue(small: ReasoningGymEnv) -> None:
    task = small.task(0, 0)
    system, user = task.prompt
    assert system == {"role": "system", "content": rg_env.DEFAULT_SYSTEM_PROMPTS["tag"]}
    assert user["role"] == "user" and user["content"].startswith("Calculate ")
    plain = ReasoningGymEnv(task="basic_arithmetic", config=SMALL, chat=False)
    text = plain.task(0, 0)
    assert text.prompt == f"{rg_env.DEFAULT_SYSTEM_PROMPTS['tag']}\n\n{user['content']}\n<answer>"
    assert plain.reward(text, f"{text.answer}</answer>") == 1.0  # the cue opened the tag
    assert plain.demonstration(text) == f"{text.answer}</answer>"
    assert ReasoningGymEnv(task="basic_arithmetic", config=SMALL, system_prompt="").task(0, 0).prompt == [user]


def test_tiny_model_args_fit_a_64_character_context() -> None:
    env = ReasoningGymEnv(**TINY_MODEL_ARGS)
    tasks = [env.task(0, i) for i in range(500)]
    assert all(t.prompt.startswith("Calculate ") and t.prompt.endswith(".\nAnswer: ") for t in tasks)
    prompts, answers = [len(t.prompt) for t in tasks], [len(t.answer) for t in tasks]
    assert (min(prompts), max(prompts), min(answers), max(answers)) == (25, 27, 1, 3)
    assert env.reward(tasks[0], tasks[0].answer) == 1.0


def test_reward_after_a_json_round_trip_in_another_env_instance(small: ReasoningGymEnv) -> None:
    task = small.task(11, 4)
    copy = Task.from_dict(json.loads(json.dumps(task.to_dict())))
    assert copy == task
    assert set(task.info) == {"task", "item", "metadata", "metadata_tuples"}  # difficulty ranges are tuples
    assert task.info["item"]["size"] == rg_env.BLOCK_ITEMS
    assert ReasoningGymEnv(task="basic_arithmetic", config=SMALL).reward(copy, f"<answer>{task.answer}</answer>") == 1.0


def test_the_rebuilt_entry_is_the_generated_one_tuples_included() -> None:
    env = ReasoningGymEnv(task="complex_arithmetic")  # metadata holds tuples: num1, num2, result
    for i in range(5):
        task = Task.from_dict(json.loads(json.dumps(env.task(2, i).to_dict())))
        _, entry, item = env.draw(2, i, "train")
        assert task.info["metadata_tuples"]
        assert env.entry(task) == entry
        regenerated = reasoning_gym.create_dataset("complex_arithmetic", seed=item["seed"], size=item["size"])[
            item["index"]
        ]
        assert regenerated == entry  # info["item"] is enough to make the item again


def test_reward_is_thread_safe(small: ReasoningGymEnv) -> None:
    tasks = [small.task(1, i) for i in range(200)]
    completions = [f"<answer>{t.answer if i % 3 else int(t.answer) + 1}</answer>" for i, t in enumerate(tasks)]
    sequential = [small.reward(t, c) for t, c in zip(tasks, completions, strict=True)]
    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(small.reward, tasks, completions)) == sequential


def test_a_task_costs_well_under_a_millisecond_on_the_train_stream() -> None:
    env = ReasoningGymEnv(task="basic_arithmetic", config=LARGE)  # expressions of 2–6 terms of 1–4 digits
    start = time.perf_counter()
    for i in range(1000):  # blocks of 128 tasks: 8 dataset creations included
        env.task(42, i)
    train_ms = (time.perf_counter() - start) * 1000 / 1000
    start = time.perf_counter()
    for i in range(100):
        env.task(42, i, "eval")
    eval_ms = (time.perf_counter() - start) * 1000 / 100
    print(f"reasoning-gym basic_arithmetic: {train_ms:.3f} ms per train task, {eval_ms:.3f} ms per eval task")
    assert train_ms < 20 and eval_ms < 50


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"task": "basic_arithmetc"}, r"unknown task 'basic_arithmetc' \(did you mean basic_arithmetic, .*DATASETS"),
        ({"task": "composite"}, "give the env's `tasks` arg"),
        ({"task": "basic_arithmetic", "config": {"no_such_field": 1}}, "rejects config.*no_such_field"),
        ({"task": "basic_arithmetic", "config": {"min_terms": 0}}, "min_terms must be positive"),
        ({"task": "basic_arithmetic", "config": {"seed": 3}}, "must not set seed or size"),
        ({"task": "basic_arithmetic", "answer_format": "xml"}, "answer_format must be one of"),
        ({"task": "basic_arithmetic", "answer_cue": "="}, "answer_cue"),
        ({}, "exactly one of task"),
        ({"task": "gcd", "tasks": [{"name": "gcd"}]}, "exactly one of task"),
        ({"tasks": []}, "non-empty list"),
        ({"tasks": [{"name": "gcd"}, {"name": "gcd", "weight": 2}]}, "'gcd' appears twice"),
        ({"tasks": [{"name": "gcd", "weight": 0}]}, r"tasks\[0\]: weight must be a positive number"),
        ({"tasks": [{"name": "gcd", "cfg": {}}]}, r"tasks\[0\]: unknown keys \['cfg'\]"),
    ],
)
def test_args_it_cannot_use_raise_value_error_naming_the_arg(args: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ReasoningGymEnv(**args)


def test_the_registry_builds_it_and_reports_bad_args() -> None:
    env = make_env(EnvSpec(name="reasoning-gym", args={"task": "gcd"}))
    assert env.task(0, 0).env == "reasoning-gym"
    with pytest.raises(EnvArgsError, match="unknown task 'nope'"):
        make_env(EnvSpec(name="reasoning-gym", args={"task": "nope"}))


def test_unknown_split_and_foreign_task_raise(small: ReasoningGymEnv) -> None:
    with pytest.raises(ValueError, match="split must be one of"):
        small.task(0, 0, "test")
    foreign = ReasoningGymEnv(task="gcd").task(0, 0)
    with pytest.raises(ValueError, match="reasoning-gym task 'gcd', not one of this env's"):
        small.reward(foreign, "<answer>1</answer>")


def test_fingerprint_names_the_reasoning_gym_version(small: ReasoningGymEnv) -> None:
    assert small.fingerprint() == f"reasoning-gym=={rg_env.reasoning_gym_version()}; derivation 1"


def test_substring_credit_is_reasoning_gyms_and_exact_scoring_gives_none(small: ReasoningGymEnv) -> None:
    exact = ReasoningGymEnv(task="basic_arithmetic", config=SMALL, scoring="exact")
    task = next(t for i in range(50) if (t := small.task(0, i)).answer == "1")
    wrong = "<answer>9991</answer>"  # holds the answer: the base scorer gives len("1") / len("9991")
    assert small.reward(task, wrong) == 0.25 and exact.reward(task, wrong) == 0.0
    assert small.reward(task, "<answer>1</answer>") == exact.reward(task, "<answer>1</answer>") == 1.0
    with pytest.raises(ValueError, match=r"scoring must be one of \['reasoning_gym', 'exact'\], got 'x'"):
        ReasoningGymEnv(task="basic_arithmetic", config=SMALL, scoring="x")


def mixture() -> ReasoningGymEnv:
    return ReasoningGymEnv(tasks=[{"name": "basic_arithmetic", "config": SMALL}, {"name": "chain_sum"}])


def test_a_mixtures_training_scores_are_reported_per_task_family(tmp_path) -> None:
    from types import SimpleNamespace

    from rlrun.orchestrator.metrics import StepMetrics
    from rlrun.orchestrator.sink import TrainSink

    from tests.support.samples import episode

    env = mixture()
    tasks = [env.task(0, i) for i in range(12)]
    assert {t.info["family"] for t in tasks} == {"basic_arithmetic", "chain_sum"}
    assert "family" not in ReasoningGymEnv(task="chain_sum").task(0, 0).info  # one task: the env's family
    sink = TrainSink(group_size=2, batch_size=2, max_off_policy_steps=1)
    metrics = StepMetrics(tmp_path / "metrics.jsonl", 1)
    metrics.start()
    for g, t in enumerate(tasks):
        rewards = [1.0, 0.5] if t.info["family"] == "chain_sum" else [0.0, 0.5]
        eps = [dataclasses.replace(episode(g, m, r, 0), task=t) for m, r in enumerate(rewards)]
        metrics.add_scores(t.env, eps, {})
        sink.add_episodes(g, t, eps, next_step=1)
    batch = sink.take_batch(1)
    line = metrics.shipped(1, batch, 0, sink, SimpleNamespace(inflight_samples=0, cancelled_groups=0))
    metrics.close()
    assert line["reward/reasoning-gym/chain_sum"] == 0.75
    assert line["reward/reasoning-gym/basic_arithmetic"] == 0.25
    assert 0.25 < line["reward/reasoning-gym"] < 0.75
