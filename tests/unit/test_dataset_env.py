"""The `dataset` env: rows of local files as a pure, epoch-permuted task stream with disjoint splits."""

from __future__ import annotations

import csv
import datetime
import importlib.util
import json
import os
import socket
import string
from pathlib import Path

import pytest
from rlrun.api.spec import EnvSpec
from rlrun.envs import EnvArgsError, make_env
from rlrun.envs.dataset import DatasetEnv

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = "examples/data/arithmetic.jsonl"


def problems(n: int, start: int = 0) -> list[dict]:
    return [{"prompt": f"{i}+1=", "answer": str(i + 1), "level": i % 3} for i in range(start, start + n)]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write(path: Path, rows: list[dict]) -> Path:
    """``rows`` to ``path`` in the format its extension names."""
    if path.suffix == ".jsonl":
        return write_jsonl(path, rows)
    if path.suffix == ".json":
        path.write_text(json.dumps(rows))
    elif path.suffix == ".csv":
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    elif path.suffix == ".parquet":
        import datasets

        datasets.Dataset.from_list(rows).to_parquet(str(path))
    return path


def epoch_prompts(env: DatasetEnv, seed: int = 0, epoch: int = 0, split: str = "train") -> list:
    n = env.num_rows(split)
    return [json.dumps(env.task(seed, epoch * n + i, split).prompt) for i in range(n)]


# Formats and paths


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv", ".parquet"])
def test_every_format_reads_to_the_same_tasks_in_file_order(tmp_path, suffix):
    rows = problems(5)
    env = DatasetEnv(path=str(write(tmp_path / f"data{suffix}", rows)), shuffle=False)
    tasks = [env.task(seed=0, index=i) for i in range(5)]
    assert [(t.prompt, t.answer, t.info) for t in tasks] == [
        (r["prompt"], r["answer"], {"level": r["level"]}) for r in rows
    ]
    assert all(t.env == "dataset" and t.index == i for i, t in enumerate(tasks))


def test_csv_keeps_prompt_and_answer_cells_as_written_and_only_empty_cells_missing(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text("prompt,answer,note,n\n001+006=,007,NA,3\n1+1=,,,\n")
    env = DatasetEnv(path=str(path), shuffle=False)
    first, second = env.task(0, 0), env.task(0, 1)
    assert (first.prompt, first.answer, first.info) == ("001+006=", "007", {"note": "NA", "n": 3})
    assert (second.answer, second.info) == (None, {"note": None, "n": None})


def test_a_glob_reads_every_matching_file_in_sorted_order(tmp_path):
    write_jsonl(tmp_path / "b.jsonl", problems(2, start=10))
    write_jsonl(tmp_path / "a.jsonl", problems(2))
    (tmp_path / "sub").mkdir()
    write_jsonl(tmp_path / "sub" / "c.jsonl", problems(1, start=20))
    flat = DatasetEnv(path=str(tmp_path / "*.jsonl"), shuffle=False)
    assert [flat.task(0, i).prompt for i in range(4)] == ["0+1=", "1+1=", "10+1=", "11+1="]
    deep = DatasetEnv(path=str(tmp_path / "**" / "*.jsonl"), shuffle=False)
    assert deep.num_rows() == 5


def test_a_directory_reads_its_files_of_supported_extensions_but_not_subdirectories(tmp_path):
    write_jsonl(tmp_path / "b.jsonl", problems(2, start=10))
    write_jsonl(tmp_path / "a.jsonl", problems(2))
    write_jsonl(tmp_path / ".hidden.jsonl", problems(1, start=30))
    (tmp_path / "README.md").write_text("not data")
    (tmp_path / "sub").mkdir()
    write_jsonl(tmp_path / "sub" / "c.jsonl", problems(1, start=20))
    env = DatasetEnv(path=str(tmp_path), shuffle=False)
    assert [env.task(0, i).prompt for i in range(4)] == ["0+1=", "1+1=", "10+1=", "11+1="]
    assert env.num_rows() == 4


def test_format_reads_files_whatever_their_extension(tmp_path):
    write_jsonl(tmp_path / "rows.txt", problems(3))
    assert DatasetEnv(path=str(tmp_path / "rows.txt"), format="jsonl").num_rows() == 3


def test_a_relative_path_resolves_against_the_current_directory(tmp_path, monkeypatch):
    write_jsonl(tmp_path / "rows.jsonl", problems(3))
    monkeypatch.chdir(tmp_path)
    env = DatasetEnv(path="rows.jsonl")
    monkeypatch.chdir(REPO)  # read once, by the constructor
    assert env.num_rows() == 3


def test_max_rows_reads_only_the_first_rows(tmp_path):
    env = DatasetEnv(path=str(write_jsonl(tmp_path / "d.jsonl", problems(10))), max_rows=4, shuffle=False)
    assert [env.task(0, i).prompt for i in range(4)] == ["0+1=", "1+1=", "2+1=", "3+1="]
    assert env.num_rows() == 4


def test_reading_never_opens_a_network_connection(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the dataset env opened a network connection")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    assert DatasetEnv(path=str(write_jsonl(tmp_path / "d.jsonl", problems(3)))).num_rows() == 3


# Prompts, answers, info


def test_chat_prompts_become_message_lists(tmp_path):
    chat = [{"role": "user", "content": "2+2?"}]
    env = DatasetEnv(path=str(write_jsonl(tmp_path / "d.jsonl", [{"prompt": chat, "answer": "4"}])))
    task = env.task(0, 0)
    assert task.is_chat and task.prompt == chat and task.answer == "4"


def test_system_prompt_turns_a_text_prompt_into_system_and_user_messages(tmp_path):
    env = DatasetEnv(path=str(write_jsonl(tmp_path / "d.jsonl", problems(1))), system_prompt="Add.")
    assert env.task(0, 0).prompt == [{"role": "system", "content": "Add."}, {"role": "user", "content": "0+1="}]


def test_system_prompt_goes_first_unless_the_messages_start_with_their_own(tmp_path):
    user = {"role": "user", "content": "2+2?"}
    own = {"role": "system", "content": "Be terse."}
    rows = [{"prompt": [user], "answer": "4"}, {"prompt": [own, user], "answer": "4"}]
    env = DatasetEnv(path=str(write_jsonl(tmp_path / "d.jsonl", rows)), system_prompt="Add.", shuffle=False)
    assert env.task(0, 0).prompt == [{"role": "system", "content": "Add."}, user]
    assert env.task(0, 1).prompt == [own, user]


def test_messages_with_different_keys_keep_each_their_own(tmp_path):
    rows = [
        {"prompt": [{"role": "user", "content": "a", "name": "x"}]},
        {"prompt": [{"role": "user", "content": "b"}]},
    ]
    for path in (write_jsonl(tmp_path / "d.jsonl", rows), write(tmp_path / "d.parquet", rows)):
        env = DatasetEnv(path=str(path), shuffle=False)
        assert env.task(0, 1).prompt == [{"role": "user", "content": "b"}], path.suffix


def test_every_other_column_goes_into_info(tmp_path):
    rows = [{"prompt": "p", "answer": "a", "id": 7, "tags": ["x", "y"], "meta": {"source": "s"}, "score": 0.5}]
    task = DatasetEnv(path=str(write_jsonl(tmp_path / "d.jsonl", rows))).task(0, 0)
    assert task.info == {"id": 7, "tags": ["x", "y"], "meta": {"source": "s"}, "score": 0.5}
    json.dumps(task.to_dict(), allow_nan=False)


def test_info_columns_picks_the_columns_that_go_into_info(tmp_path):
    rows = [{"prompt": "p", "answer": "a", "id": 7, "tags": ["x"]}]
    env = DatasetEnv(path=str(write_jsonl(tmp_path / "d.jsonl", rows)), info_columns=["id"])
    assert env.task(0, 0).info == {"id": 7}


def test_dates_in_info_become_iso_strings_and_bytes_are_refused_unless_left_out(tmp_path):
    rows = [{"prompt": "p", "when": datetime.datetime(2024, 5, 1, 12, 30), "day": datetime.date(2024, 5, 2)}]
    rows[0]["blob"] = b"\x00\x01"
    path = str(write(tmp_path / "d.parquet", rows))
    with pytest.raises(ValueError, match=r"row 1: blob: a bytes value is not JSON-compatible.*info_columns"):
        DatasetEnv(path=path)
    task = DatasetEnv(path=path, info_columns=["when", "day"]).task(0, 0)
    assert task.info == {"when": "2024-05-01T12:30:00", "day": "2024-05-02"}


def test_integer_answers_become_text(tmp_path):
    env = DatasetEnv(path=str(write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1=", "answer": 2}])))
    assert env.task(0, 0).answer == "2"


def test_without_an_answer_column_tasks_have_no_answer_and_the_env_reward_refuses_them(tmp_path):
    env = DatasetEnv(path=str(write_jsonl(tmp_path / "d.jsonl", [{"prompt": "p", "topic": "t"}])))
    task = env.task(0, 0)
    assert task.answer is None and task.info == {"topic": "t"}
    with pytest.raises(ValueError, match=r"no answer.*name rewards in the manifest"):
        env.reward(task, "anything")


def test_answer_none_leaves_a_column_named_answer_in_info(tmp_path):
    env = DatasetEnv(path=str(write_jsonl(tmp_path / "d.jsonl", problems(1))), answer=None)
    task = env.task(0, 0)
    assert task.answer is None and task.info == {"answer": "1", "level": 0}


def test_reward_is_exact_match_of_the_stripped_completion(tmp_path):
    env = DatasetEnv(path=str(write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1=", "answer": " 2\n"}])))
    task = env.task(0, 0)
    assert env.reward(task, "2") == 1.0
    assert env.reward(task, "  2 \n") == 1.0
    assert env.reward(task, "22") == 0.0


# The stream


@pytest.fixture
def ten(tmp_path) -> DatasetEnv:
    return DatasetEnv(path=str(write_jsonl(tmp_path / "d.jsonl", problems(10))))


def test_a_task_is_a_pure_function_of_seed_index_and_split(ten, tmp_path):
    forward = [ten.task(5, i) for i in range(25)]
    backward = [ten.task(5, i) for i in reversed(range(25))][::-1]
    assert forward == backward
    assert all(t.index == i for i, t in enumerate(forward))
    again = DatasetEnv(path=str(tmp_path / "d.jsonl"))
    assert [again.task(5, i) for i in range(25)] == forward
    mine = ten.task(5, 3)  # a task's parts are its own: mutating them changes no later task
    mine.info["level"] = "changed"
    assert ten.task(5, 3) == forward[3]


def test_every_epoch_visits_each_row_exactly_once_in_its_own_order(ten):
    epochs = [epoch_prompts(ten, seed=1, epoch=e) for e in range(4)]
    rows = sorted(json.dumps(r["prompt"]) for r in problems(10))
    assert all(sorted(e) == rows for e in epochs)
    assert len({tuple(e) for e in epochs}) == 4
    assert [ten.epoch(i) for i in (0, 9, 10, 19, 20, 35)] == [0, 0, 1, 1, 2, 3]


def test_adjacent_seeds_draw_unrelated_orders_not_shifted_copies(ten):
    a, b = epoch_prompts(ten, seed=7), epoch_prompts(ten, seed=8)
    assert a != b
    for shift in range(1, 10):
        assert a[shift:] != b[:-shift] and b[shift:] != a[:-shift]


def test_shuffle_false_keeps_file_order_every_epoch(tmp_path):
    env = DatasetEnv(path=str(write_jsonl(tmp_path / "d.jsonl", problems(4))), shuffle=False)
    assert [env.task(9, i).prompt for i in range(8)] == ["0+1=", "1+1=", "2+1=", "3+1="] * 2


def test_a_negative_index_is_refused(ten):
    with pytest.raises(ValueError, match="index must be ≥ 0"):
        ten.task(0, -1)


# Splits


def test_eval_fraction_holds_out_rows_disjoint_from_train_whatever_the_row_order(tmp_path):
    rows = problems(200)
    env = DatasetEnv(path=str(write_jsonl(tmp_path / "d.jsonl", rows)), eval_fraction=0.2)
    train, held = set(epoch_prompts(env)), set(epoch_prompts(env, split="eval"))
    assert not train & held
    assert len(train | held) == 200
    assert 20 <= len(held) <= 60
    reversed_env = DatasetEnv(path=str(write_jsonl(tmp_path / "r.jsonl", rows[::-1])), eval_fraction=0.2)
    assert set(epoch_prompts(reversed_env, split="eval")) == held


def test_rows_with_equal_prompts_fall_on_the_same_side(tmp_path):
    rows = problems(100) + [{"prompt": r["prompt"], "answer": "other"} for r in problems(100)]
    env = DatasetEnv(path=str(write_jsonl(tmp_path / "d.jsonl", rows)), eval_fraction=0.3)
    assert not set(epoch_prompts(env)) & set(epoch_prompts(env, split="eval"))
    assert env.num_rows() + env.num_rows("eval") == 200


def test_eval_path_is_the_eval_split_and_its_prompts_are_not_trained_on(tmp_path):
    rows = problems(50)
    env = DatasetEnv(
        path=str(write_jsonl(tmp_path / "train.jsonl", rows)),
        eval_path=str(write_jsonl(tmp_path / "eval.jsonl", rows[:20] + problems(30, start=100))),
    )
    assert env.num_rows() == 30  # the 20 rows also in eval_path are not trained on
    assert not set(epoch_prompts(env)) & set(epoch_prompts(env, split="eval"))
    assert env.num_rows("eval") == 50
    assert env.epoch(120, split="eval") == 2


def test_without_eval_path_or_eval_fraction_there_is_no_eval_split(ten):
    with pytest.raises(ValueError, match="no eval split: set eval_path or eval_fraction"):
        ten.task(0, 0, split="eval")


# Fingerprint


def test_fingerprint_follows_the_files_bytes_and_stream_args_not_their_location_or_mtime(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    path = write_jsonl(tmp_path / "a" / "d.jsonl", problems(5))
    write_jsonl(tmp_path / "b" / "d.jsonl", problems(5))
    first = DatasetEnv(path=str(path)).fingerprint()
    assert DatasetEnv(path=str(tmp_path / "b" / "d.jsonl")).fingerprint() == first  # same data mounted elsewhere
    os.utime(path, (1, 1))
    assert DatasetEnv(path=str(path)).fingerprint() == first
    assert DatasetEnv(path=str(path), shuffle=False).fingerprint() != first
    assert DatasetEnv(path=str(path), system_prompt="Add.").fingerprint() != first
    path.write_bytes(path.read_bytes().replace(b"4+1=", b"4+2="))
    assert DatasetEnv(path=str(path)).fingerprint() != first


# Errors (each names the arg; make_env turns them into EnvArgsError)


@pytest.mark.parametrize(
    ("files", "args", "message"),
    [
        ({}, {"path": "nothing-*.jsonl"}, r"path 'nothing-\*\.jsonl' matches no file"),
        ({"d.txt": "x"}, {"path": "d.txt"}, r"unsupported extension '\.txt'.*or set format"),
        ({"d.jsonl": "", "e.csv": "p\n"}, {"path": "."}, r"mixes formats \['csv', 'json'\]"),
        ({"d.jsonl": ""}, {"path": "d.jsonl"}, r"path 'd\.jsonl' has no rows"),
        ({"d.csv": "prompt,answer\n"}, {"path": "d.csv"}, r"path 'd\.csv' has no rows"),
        (
            {"d.jsonl": '{"prompt": "a"}\n{"prompt": \n'},
            {"path": "d.jsonl"},
            r"path 'd\.jsonl': line 2, column 12: not valid JSON \(Expecting value\)",
        ),
        (
            {"d.jsonl": '{"question": "a", "id": 1}\n'},
            {"path": "d.jsonl"},
            r"prompt column 'prompt' is not in path 'd\.jsonl'; its columns: \['question', 'id'\]",
        ),
        (
            {"d.jsonl": '{"prompt": "a", "answer": "b"}\n'},
            {"path": "d.jsonl", "answer": "solution"},
            r"answer column 'solution' is not in path 'd\.jsonl'; its columns: \['prompt', 'answer'\]",
        ),
        (
            {"d.jsonl": '{"prompt": "a"}\n{"prompt": 3}\n'},
            {"path": "d.jsonl"},
            r"path 'd\.jsonl' row 2: prompt: must be a string or a list of chat messages, got int",
        ),
        (
            {"d.jsonl": '{"prompt": "a"}\n{"prompt": ""}\n'},
            {"path": "d.jsonl"},
            r"path 'd\.jsonl' row 2: prompt: empty",
        ),
        (
            {"d.jsonl": '{"prompt": [{"role": "robot", "content": "hi"}]}\n'},
            {"path": "d.jsonl"},
            r"row 1: prompt\[0\]\.role: must be one of",
        ),
        (
            {"d.jsonl": '{"prompt": "a", "answer": 0.5}\n'},
            {"path": "d.jsonl"},
            r"row 1: answer: must be a string, got float",
        ),
        (
            {"d.jsonl": '{"prompt": "a"}\n'},
            {"path": "d.jsonl", "eval_path": "d.jsonl", "eval_fraction": 0.1},
            "not both",
        ),
        (
            {"d.jsonl": '{"prompt": "a"}\n'},
            {"path": "d.jsonl", "eval_fraction": 1.0},
            r"eval_fraction must be .*\[0, 1\)",
        ),
        ({"d.jsonl": '{"prompt": "a"}\n'}, {"path": "d.jsonl", "eval_fraction": 1e-9}, "holds out none of the 1 rows"),
        ({"d.jsonl": '{"prompt": "a"}\n'}, {"path": "d.jsonl", "eval_path": "d.jsonl"}, "no train row is left"),
        ({"d.jsonl": '{"prompt": "a"}\n'}, {"path": "d.jsonl", "format": "xml"}, "format must be one of"),
        ({"d.jsonl": '{"prompt": "a"}\n'}, {"path": "d.jsonl", "info_columns": ["id"]}, r"info_columns: 'id'"),
        ({}, {"path": "hf://datasets/gsm8k"}, "only local files"),
        (
            {"d.jsonl": '{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "c" "answer": "d"}\n'},
            {"path": "d.jsonl"},
            r"^dataset: path 'd\.jsonl': line 3, column 16: not valid JSON \(Expecting ',' delimiter\)$",
        ),
        (
            {"a.jsonl": '{"prompt": "a"}\n', "b.jsonl": '{"prompt": "b"}\n\n{"prompt": }\n'},
            {"path": "*.jsonl"},
            r"^dataset: path '\*\.jsonl': b\.jsonl line 3, column 12: not valid JSON \(Expecting value\)$",
        ),
        (
            {"d.json": '[\n  {"prompt": "a"},\n  {"prompt" "b"}\n]\n'},
            {"path": "d.json"},
            r"^dataset: path 'd\.json': line 3, column 13: not valid JSON \(Expecting ':' delimiter\)$",
        ),
        (
            {"d.jsonl": '{"prompt": "a", "solution": "b"}\n'},
            {"path": "d.jsonl", "demonstration": "solutions"},
            r"demonstration column 'solutions' is not in path 'd\.jsonl'; its columns: \['prompt', 'solution'\]",
        ),
        (
            {"d.jsonl": '{"prompt": "a", "solution": "b", "level": 1}\n'},
            {"path": "d.jsonl", "demonstration": "solution", "info_columns": ["level"]},
            r"demonstration column 'solution' is left out of info_columns: add it",
        ),
    ],
)
def test_each_refusal_names_the_arg(tmp_path, monkeypatch, files, args, message):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=message):
        DatasetEnv(**args)
    with pytest.raises(EnvArgsError, match=message):
        make_env(EnvSpec(name="dataset", args=args))


def test_a_malformed_line_is_said_once_without_the_loaders_own_log(tmp_path, capfd):
    write_jsonl(tmp_path / "d.jsonl", problems(3))
    with open(tmp_path / "d.jsonl", "a") as f:
        f.write('{"prompt": "x",}\n')
    with pytest.raises(ValueError, match=r"line 4, column 16: not valid JSON"):
        DatasetEnv(path=str(tmp_path / "d.jsonl"))
    assert "Failed to load JSON" not in capfd.readouterr().err  # datasets' ERROR line before it raises


# A TRL-format dataset: prompt and solution (issue 36)


def test_demonstration_names_the_warm_starts_column_and_the_rewards_still_get_it_by_name(tmp_path):
    """TRL's format has ``prompt`` and ``solution``: the rewards read ``solution``, and the builtin tiny model's warm
    start needs a completion to teach. ``demonstration: solution`` gives it one without renaming the column
    (``answer: solution`` would hand it to the rewards as ``answer``)."""
    from rlrun.rewards.scoring import reward_kwargs

    rows = [{"prompt": [{"role": "user", "content": f"{i}+1="}], "solution": str(i + 1)} for i in range(5)]
    env = DatasetEnv(path=str(write_jsonl(tmp_path / "d.jsonl", rows)), demonstration="solution")
    task = env.task(0, 0)
    assert task.answer is None and env.demonstration(task) == task.info["solution"]
    assert reward_kwargs(task, ["2"], [[1]])["solution"] == [task.info["solution"]]
    plain = DatasetEnv(path=str(write_jsonl(tmp_path / "a.jsonl", problems(3))))
    assert plain.demonstration(plain.task(0, 0)) == plain.task(0, 0).answer  # default: the answer
    assert plain.fingerprint() == DatasetEnv(path=str(tmp_path / "a.jsonl"), demonstration="answer").fingerprint()


# The example file


def test_the_example_file_loads_as_short_printable_arithmetic(monkeypatch):
    monkeypatch.chdir(REPO)
    env = DatasetEnv(path=EXAMPLE, eval_fraction=0.1)
    assert env.num_rows() + env.num_rows("eval") == 2000
    assert 100 <= env.num_rows("eval") <= 300
    for i in range(env.num_rows()):
        task = env.task(0, i)
        assert len(task.prompt) <= 12 and len(task.answer) <= 4
        assert set(task.prompt + task.answer) <= set(string.printable) - set(string.whitespace)
        assert env.reward(task, task.answer) == 1.0


def test_the_example_script_regenerates_the_committed_file(tmp_path):
    spec = importlib.util.spec_from_file_location("make_arithmetic", REPO / "examples/data/make_arithmetic.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--out", str(tmp_path / "a.jsonl")])
    assert (tmp_path / "a.jsonl").read_bytes() == (REPO / EXAMPLE).read_bytes()
