"""The builtin multi-turn envs: ``guess-number`` (hints until found) and ``calculator`` (a tool, then the answer) —
their answers, rewards, disjoint splits, and demonstrations that solve their tasks when played."""

from __future__ import annotations

import pytest
from rlrun.envs import make_env
from rlrun.envs.base import is_multi_turn
from rlrun.envs.calculator import CalculatorEnv, calculate
from rlrun.envs.guess_number import GuessNumberEnv
from rlrun.model.chat_tokenizer import build_chat_tokenizer
from rlrun.model.conversations import transcript
from rlrun.model.demonstrations import demonstration

from tests.support.manifests import parse


def test_guess_number_answers_higher_lower_and_ends_when_found():
    env = GuessNumberEnv(low=1, high=64, width=16, max_turns=7)
    task = env.task(0, 3)
    assert task.prompt[0]["content"] == f"Guess my number, {task.info['low']} to {task.info['high']}."
    assert task.info["high"] - task.info["low"] == 15 and task.info["low"] <= int(task.answer) <= task.info["high"]
    secret = int(task.answer)
    state = env.start(task)
    low = env.respond(task, state, str(secret - 1) if secret > 1 else "0")
    assert (low.message, low.done) == ("higher", False)
    high = env.respond(task, low.state, f" {secret + 1}\n")
    assert (high.message, high.done) == ("lower", False)
    junk = env.respond(task, high.state, "maybe")
    assert (junk.message, junk.done) == ("a number, please", False)
    found = env.respond(task, junk.state, str(secret))
    assert found.done and found.message is None
    assert found.state == {"guesses": [secret - 1 if secret > 1 else 0, secret + 1, None, secret]}
    assert env.reward(task, str(secret)) == 1.0 and env.reward(task, str(secret + 1)) == 0.0


def test_every_demonstration_is_a_binary_search_that_finds_the_secret_within_max_turns():
    env = GuessNumberEnv()  # ranges of 16 in 1..40, 6 turns: binary search needs at most 5
    for i in range(200):
        task = env.task(1, i)
        turns = env.demonstration(task)
        assert len(turns) <= 5 < env.max_turns and turns[-1] == task.answer


def test_every_number_is_a_training_secret_so_no_policy_scores_by_skipping_the_held_out_ones():
    env = GuessNumberEnv()
    train = {int(env.task(0, i).answer) for i in range(3000)}
    evals = {int(env.task(0, i, "eval").answer) for i in range(300)}
    assert train == set(range(1, 41)) and evals <= train


@pytest.mark.parametrize("env", [GuessNumberEnv(), CalculatorEnv()], ids=lambda e: e.name)
def test_no_eval_task_is_a_train_task(env):
    train = {str(env.task(s, i).prompt) + str(env.task(s, i).answer) for s in (0, 1) for i in range(300)}
    evals = {
        str(env.task(s, i, "eval").prompt) + str(env.task(s, i, "eval").answer) for s in (0, 1) for i in range(300)
    }
    assert train and evals and not train & evals


def test_calculate_evaluates_integer_arithmetic_only():
    assert calculate("12*(3+4)") == "84" and calculate("-5 - 7") == "-12"
    for bad in ("__import__('os')", "2**100", "1/2", "x", "1" * 70):
        with pytest.raises(ValueError):
            calculate(bad)


def test_calculator_answers_each_tool_call_and_ends_at_the_answer():
    env = CalculatorEnv(digits=2, operations="+-*")
    task = env.task(0, 5)
    assert task.info["tools"][0]["function"]["name"] == "calculate"
    call = env.demonstration(task)[0]
    reply = env.respond(task, env.start(task), call)
    assert not reply.done and reply.message == [{"role": "tool", "content": task.answer}]
    assert (reply.tool_calls, reply.tool_errors, reply.state) == (1, 0, {"tool_calls": 1})
    broken = env.respond(
        task, reply.state, '<tool_call>{"name": "calculate", "arguments": {"expression": "1/0"}}</tool_call>'
    )
    assert (broken.tool_calls, broken.tool_errors) == (1, 1)
    assert broken.message[0]["content"].startswith("error: ValueError")
    answer = env.respond(task, broken.state, task.answer)
    assert answer.done and env.reward(task, task.answer) == 1.0 and env.reward(task, "0") == 0.0


def test_a_demonstration_is_played_into_the_transcript_the_rollouts_would_make():
    tokenizer = build_chat_tokenizer()
    env = GuessNumberEnv(low=1, high=12, width=8, max_turns=4)
    task = next(t for t in (env.task(0, i) for i in range(500)) if t.answer == "7" and t.info["low"] == 1)
    assert demonstration(env, task, tokenizer) == (
        "4<|end|><|user|>higher<|end|><|assistant|>6<|end|><|user|>higher<|end|><|assistant|>7"
    )
    assert transcript(tokenizer, env, task, ["7", "7"]) is None  # the env ended the episode before the last turn
    assert transcript(tokenizer, env, task, ["1"] * 5) is None  # more turns than max_turns


def test_the_builtin_multi_turn_envs_are_found_by_name_with_their_args():
    spec = parse("mt", envs=[{"name": "guess-number", "args": {"high": 24}}, {"name": "calculator"}]).spec
    guess, calc = (make_env(e) for e in spec.envs)
    assert is_multi_turn(guess) and is_multi_turn(calc)
    assert (guess.high, guess.width) == (24, 16) and calc.max_turns == 3
    with pytest.raises(ValueError, match="max_turns must be ≥ 2"):
        CalculatorEnv(max_turns=1)
    with pytest.raises(ValueError, match="too few tasks to hold some out"):
        GuessNumberEnv(low=1, high=16)  # one range: holding out its secrets would leave them untrained


def doc_block(defines: str) -> dict:
    """The names a ``docs/envs.md`` Python block defining ``defines`` makes, once run."""
    import re
    from pathlib import Path

    text = (Path(__file__).parents[2] / "docs" / "envs.md").read_text()
    [block] = [b for b in re.findall(r"```python\n(.*?)```", text, re.DOTALL) if f"class {defines}" in b]
    names: dict = {}
    exec(compile(block, f"docs/envs.md:{defines}", "exec"), names)
    return names


def test_the_documented_multi_turn_env_plays_as_the_doc_says():
    env = doc_block("CountdownEnv")["CountdownEnv"]()
    task = env.task(0, 1)
    assert task.prompt == [{"role": "user", "content": "Count down from 3."}] and env.resumable
    going = env.respond(task, env.start(task), "2")
    assert (going.message, going.done, going.reward) == ("next", False, 0.1)
    done = env.respond(task, going.state, "0")
    assert done.done and done.state == {"said": ["2", "0"]} and env.reward(task, "0") == 1.0


def test_the_documented_tool_env_answers_its_tool_and_scores_the_answer():
    env = doc_block("LetterCountEnv")["LetterCountEnv"]()
    task = env.task(0, 1)  # "nested"
    assert task.info["tools"][0]["function"]["name"] == "lookup"
    call = '<tool_call>{"name": "lookup", "arguments": {"word": "nested"}}</tool_call>'
    reply = env.respond(task, env.start(task), call)
    assert reply.message == [{"role": "tool", "content": "6"}] and (reply.tool_calls, reply.tool_errors) == (1, 0)
    bad = env.respond(task, reply.state, '<tool_call>{"name": "lookup", "arguments": {}}</tool_call>')
    assert bad.tool_errors == 1 and bad.message[0]["content"].startswith("error: TypeError")
    answer = env.respond(task, bad.state, "6")
    assert answer.done and env.reward(task, "6") == 1.0
