import pytest
from rlrun.api.spec import EnvSpec
from rlrun.envs import EnvArgsError, ReverseTextEnv, UnknownEnvError, make_env
from rlrun.envs.reverse_text import lcs_length, lcs_ratio, zen_words


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        ("", "", 0),
        ("abc", "", 0),
        ("abcde", "ace", 3),
        ("ace", "abcde", 3),
        ("abc", "abc", 3),
        ("abc", "xyz", 0),
        ("aab", "ab", 2),
    ],
)
def test_lcs_length(a, b, expected):
    assert lcs_length(a, b) == expected


def test_reward_is_one_only_for_exact_reversal():
    env = ReverseTextEnv()
    task = env.task(seed=0, index=0)
    assert env.reward(task, task.answer) == 1.0
    assert env.reward(task, task.answer + "x") < 1.0


@pytest.mark.parametrize(
    ("completion", "target", "expected"),
    [
        ("si talf", "si talf", 1.0),
        ("si tal", "si talf", 6 / 7),  # one character missing
        ("si talfx", "si talf", 7 / 8),  # one character extra
        ("flat is", "si talf", 1 / 7),  # unreversed: distinct characters in opposite order, LCS 1
        ("", "si talf", 0.0),
        ("", "", 1.0),
    ],
)
def test_lcs_ratio_on_hand_made_strings(completion, target, expected):
    assert lcs_ratio(completion, target) == pytest.approx(expected)


def test_tasks_are_deterministic_and_in_format():
    env = ReverseTextEnv(max_words=2, max_chars=16)
    a = [env.task(7, i) for i in range(50)]
    b = [env.task(7, i) for i in range(50)]
    assert a == b
    assert [env.task(8, i) for i in range(50)] != a
    words = set(zen_words())
    for t in a:
        assert t.prompt.endswith("=")
        text = t.prompt[:-1]
        assert t.answer == text[::-1]
        assert 1 <= len(text.split(" ")) <= 2 and len(text) <= 16
        assert set(text.split(" ")) <= words


def test_zen_words_are_the_pep20_vocabulary():
    words = zen_words()
    assert len(words) == 84
    assert {"beautiful", "explicit", "namespaces", "readability"} <= set(words)


def test_make_env_rejects_unknown_env_and_bad_args():
    with pytest.raises(ValueError, match="unknown env 'nope'"):
        make_env(EnvSpec(name="nope"))
    with pytest.raises(ValueError, match="reverse-text"):
        make_env(EnvSpec(name="reverse-text", args={"max_chars": 3}))
    with pytest.raises(ValueError, match="bad args"):
        make_env(EnvSpec(name="reverse-text", args={"colour": "red"}))


def test_make_env_errors_are_typed():
    with pytest.raises(UnknownEnvError):
        make_env(EnvSpec(name="nope"))
    with pytest.raises(EnvArgsError):  # a keyword the env does not take
        make_env(EnvSpec(name="reverse-text", args={"colour": "red"}))
    with pytest.raises(EnvArgsError) as info:  # a value its constructor refuses: its own message kept
        make_env(EnvSpec(name="reverse-text", args={"max_words": 0}))
    assert str(info.value) == "reverse-text: max_words must be ≥ 1, got 0"
    assert issubclass(UnknownEnvError, ValueError) and issubclass(EnvArgsError, ValueError)


def test_exact_reward_is_one_for_the_reversal_and_zero_for_a_near_miss():
    env = ReverseTextEnv(reward="exact")
    task = env.task(seed=0, index=0)
    assert env.reward(task, task.answer) == 1.0
    assert env.reward(task, task.answer[:-1]) == 0.0 and env.reward(task, "") == 0.0


def test_min_words_bounds_the_texts_and_bad_args_are_refused():
    env = ReverseTextEnv(min_words=2, max_words=2, max_chars=16)
    assert all(
        len(env.task(3, i, split).prompt[:-1].split(" ")) == 2 for split in ("train", "eval") for i in range(200)
    )
    for args, message in (
        ({"min_words": 3}, "min_words must be between 1 and max_words"),
        ({"reward": "f1"}, "reward"),
    ):
        with pytest.raises(EnvArgsError, match=message):
            make_env(EnvSpec(name="reverse-text", args=args))
