"""The builtin rewards score as their formulas say, in TRL's calling convention, and a reward spec loads
or fails with a typed error that says why."""

from __future__ import annotations

import functools
import threading
import uuid

import pytest
from rlrun.api.spec import RewardSpec
from rlrun.envs.reverse_text import lcs_length, lcs_ratio
from rlrun.rewards.builtin import BUILTIN_REWARDS, completion_text, exact, gold_text, lcs, math, regex
from rlrun.rewards.loading import (
    RewardArgsError,
    RewardImportError,
    UnknownRewardError,
    is_async_reward,
    load_reward,
)


def chat(text: str) -> list[dict[str, str]]:
    """A completion of a chat prompt, as TRL passes it."""
    return [{"role": "assistant", "content": text}]


def in_thread(func, **kwargs):
    """``func(**kwargs)`` called in a worker thread (as the scorer calls rewards); re-raises its error."""
    out: dict[str, object] = {}

    def run() -> None:
        try:
            out["value"] = func(**kwargs)
        except BaseException as exc:
            out["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=30)
    if "error" in out:
        raise out["error"]
    return out["value"]


# --- completion_text ---------------------------------------------------------------------------


def test_completion_text_reads_both_forms_and_the_last_assistant_message():
    assert completion_text("plain") == "plain"
    assert completion_text(chat("hi")) == "hi"
    messages = [{"role": "assistant", "content": "first"}, {"role": "tool", "content": "42"}]
    assert completion_text([*messages, {"role": "assistant", "content": "last"}]) == "last"
    assert completion_text(messages) == "first"
    assert completion_text([{"content": "no role"}]) == "no role"  # TRL's own examples omit the role
    parts = [{"type": "text", "text": "a"}, {"type": "image"}, {"type": "text", "text": "b"}]
    assert completion_text([{"role": "assistant", "content": parts}]) == "ab"
    assert completion_text([{"role": "assistant", "content": None}]) == ""
    assert completion_text([]) == ""


def test_completion_text_refuses_other_types():
    with pytest.raises(TypeError, match="str or a list of chat messages, got int"):
        completion_text(3)
    with pytest.raises(TypeError, match="chat message is a mapping"):
        completion_text(["not a message"])


# --- exact -------------------------------------------------------------------------------------


def test_exact_ignores_surrounding_whitespace_only():
    scores = exact(completions=[" 42\n", "42", "4 2", "43"], answer=["42", "\t42 ", "42", "42"])
    assert scores == [1.0, 1.0, 0.0, 0.0]


def test_exact_does_not_apply_without_an_answer_and_compares_non_str_answers_as_text():
    assert exact(completions=["x", "7", chat("7")], answer=[None, 7, "7"]) == [None, 1.0, 1.0]


def test_exact_refuses_lists_of_different_lengths():
    with pytest.raises(ValueError):
        exact(completions=["a", "b"], answer=["a"])


# --- lcs ---------------------------------------------------------------------------------------


def test_lcs_ratio_is_lcs_over_the_longer_length():
    # "kitten" / "sitting": LCS "ittn" (4), longer length 7
    assert lcs_length("kitten", "sitting") == 4
    assert lcs(completions=["kitten"], answer=["sitting"]) == [pytest.approx(4 / 7)]
    assert lcs(completions=["abc", "", "", chat("abd")], answer=["abc", "", "ab", "abc"]) == [
        1.0,
        1.0,
        0.0,
        pytest.approx(2 / 3),
    ]
    assert lcs(completions=["abc"], answer=[None]) == [None]


def test_lcs_ratio_still_importable_from_reverse_text():
    assert lcs_ratio("si tal", "si talf") == pytest.approx(6 / 7)


# --- math --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("answer", "completion", "expected"),
    [
        (r"\frac{1}{2}", "0.5", 1.0),
        ("0.5", r"The answer is $\frac{1}{2}$", 1.0),
        (r"\frac{1}{2}", r"The answer is $\frac{1}{2}$", 1.0),
        ("1/2", r"so \boxed{0.5}", 1.0),
        ("2", "3", 0.0),
        ("2", "The answer is 2", 1.0),
        (r"\frac{\sqrt{3}}{2}", r"Hence $x = \boxed{\frac{\sqrt{3}}{2}}$.", 1.0),
        (r"\frac{\sqrt{3}}{2}", r"Hence \boxed{\frac{1}{2}}", 0.0),
        ("(1, 2)", "$(1,2)$", 1.0),  # bare, (1, 2) would parse as its last number, 2
        ("x^2+1", "$1 + x^2$", 1.0),
        (r"so the answer is \boxed{5}.", r"I get \boxed{5}", 1.0),  # a full solution as the gold
        ("1,000", "1000", 1.0),
        ("7", "no number here", 0.0),
    ],
)
def test_math_verifies_equivalent_answers(answer, completion, expected):
    assert math(completions=[completion], answer=[answer]) == [expected]


def test_math_wraps_bare_answers_in_dollars_and_keeps_delimited_ones():
    assert gold_text(" 0.5 ") == "$0.5$"
    assert gold_text(r"\frac{1}{2}") == r"$\frac{1}{2}$"
    assert gold_text("$x$") == "$x$"
    assert gold_text(r"\(x\)") == r"\(x\)"
    assert gold_text(r"is \boxed{3}") == r"is \boxed{3}"


def test_math_skips_missing_or_unparseable_answers():
    assert math(completions=["1", "1", "1"], answer=[None, "", "1"]) == [None, None, 1.0]


def test_math_runs_in_a_worker_thread_with_chat_completions():
    # math-verify's default timeouts use signal.alarm, which raises ValueError outside the main thread
    completions = [chat(r"The answer is $\frac{1}{2}$"), chat(r"\boxed{3}"), chat("2")]
    scores = in_thread(math, completions=completions, answer=["0.5", "2", "2"], prompts=[[]] * 3)
    assert scores == [1.0, 0.0, 1.0]


# --- regex -------------------------------------------------------------------------------------


def test_regex_search_matches_anywhere():
    reward = regex(r"\d+")
    assert reward(completions=["abc 12", "none", chat("7")]) == [1.0, 0.0, 1.0]


def test_regex_fullmatch_needs_the_whole_text_and_dot_spans_newlines():
    reward = regex(r"<think>.*</think>\s*<answer>.*</answer>", mode="fullmatch")
    good = "<think>step 1\nstep 2</think>\n<answer>4</answer>"
    assert reward(completions=[good, good + " trailing", "<answer>4</answer>"]) == [1.0, 0.0, 0.0]


def test_regex_refuses_a_bad_pattern_or_mode_at_factory_time():
    with pytest.raises(ValueError, match="invalid regex pattern '\\(unclosed'"):
        regex("(unclosed")
    with pytest.raises(ValueError, match=r"regex mode must be one of \['search', 'fullmatch'\], got 'match'"):
        regex("a", mode="match")
    with pytest.raises(ValueError, match="regex pattern must be a str, got int"):
        regex(3)


# --- load_reward -------------------------------------------------------------------------------


def test_every_builtin_loads_by_name():
    assert set(BUILTIN_REWARDS) == {"exact", "lcs", "math", "regex"}
    assert load_reward(RewardSpec(name="exact")) is exact
    assert load_reward(RewardSpec(name="lcs")) is lcs
    assert load_reward(RewardSpec(name="math")) is math
    reward = load_reward(RewardSpec(name="regex", args={"pattern": "^ok", "mode": "search"}))
    assert reward(completions=["ok then", "not ok"], answer=[None, None]) == [1.0, 0.0]


def test_unknown_builtin_lists_the_builtin_rewards():
    with pytest.raises(UnknownRewardError, match=r"unknown reward 'exactly'; builtin rewards: \['exact', 'lcs'"):
        load_reward(RewardSpec(name="exactly"))


@pytest.mark.parametrize(
    ("name", "args", "message"),
    [
        ("regex", {}, "reward 'regex': bad args {}: .*pattern"),
        ("regex", {"pattern": "("}, "reward 'regex': bad args .*invalid regex pattern"),
        ("regex", {"pattern": "a", "flags": 2}, "reward 'regex': bad args .*flags"),
        ("exact", {"strip": False}, "reward 'exact': bad args .*strip"),
    ],
)
def test_args_a_builtin_refuses_name_the_reward(name, args, message):
    with pytest.raises(RewardArgsError, match=message):
        load_reward(RewardSpec(name=name, args=args))


def test_load_errors_are_value_errors():
    assert all(issubclass(e, ValueError) for e in (UnknownRewardError, RewardImportError, RewardArgsError))


USER_REWARDS = """
import asyncio

NOT_CALLABLE = 3


def length_reward(completions, **kwargs):
    return [float(len(c)) for c in completions]


async def async_reward(completions, answer, **kwargs):
    await asyncio.sleep(0)
    return [float(c == a) for c, a in zip(completions, answer)]


class AsyncCallable:
    async def __call__(self, completions, **kwargs):
        return [1.0 for _ in completions]


class SyncCallable:
    def __call__(self, completions, **kwargs):
        return [1.0 for _ in completions]


async_instance = AsyncCallable()
sync_instance = SyncCallable()
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch) -> str:
    """The name of a fresh module of reward functions (``USER_REWARDS``) on ``sys.path``."""
    name = f"user_rewards_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(USER_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_a_sync_function_path_loads_as_is(user_module):
    reward = load_reward(RewardSpec(function=f"{user_module}:length_reward"))
    assert reward.__module__ == user_module and reward.__name__ == "length_reward"
    assert not is_async_reward(reward)
    assert reward(prompts=["p", "p"], completions=["ab", "abc"], completion_ids=[[1], [2]]) == [2.0, 3.0]


async def test_an_async_function_path_loads_unwrapped(user_module):
    reward = load_reward(RewardSpec(function=f"{user_module}:async_reward"))
    assert is_async_reward(reward)
    assert await reward(completions=["a", "b"], answer=["a", "a"]) == [1.0, 0.0]


def test_is_async_reward_sees_async_call_methods_and_partials(user_module):
    assert is_async_reward(load_reward(RewardSpec(function=f"{user_module}:async_instance")))
    assert not is_async_reward(load_reward(RewardSpec(function=f"{user_module}:sync_instance")))
    assert not is_async_reward(load_reward(RewardSpec(function=f"{user_module}:AsyncCallable")))  # a class
    async_fn = load_reward(RewardSpec(function=f"{user_module}:async_reward"))
    assert is_async_reward(functools.partial(async_fn, answer=["a"]))
    assert not is_async_reward(exact) and not is_async_reward(regex("a"))


def test_a_module_that_does_not_import_says_so(tmp_path, monkeypatch):
    (tmp_path / "broken_rewards_mod.py").write_text("raise RuntimeError('needs a GPU')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RewardImportError, match="module 'no_such_rewards_mod' does not import: ModuleNotFoundError"):
        load_reward(RewardSpec(function="no_such_rewards_mod:f"))
    with pytest.raises(RewardImportError, match="does not import: RuntimeError: needs a GPU"):
        load_reward(RewardSpec(function="broken_rewards_mod:f"))


def test_a_missing_attribute_says_so(user_module):
    with pytest.raises(RewardImportError, match=f"module '{user_module}' has no attribute 'nope'"):
        load_reward(RewardSpec(function=f"{user_module}:nope"))


def test_a_non_callable_attribute_says_so(user_module):
    with pytest.raises(RewardImportError, match=f"{user_module}:NOT_CALLABLE is not callable"):
        load_reward(RewardSpec(function=f"{user_module}:NOT_CALLABLE"))
