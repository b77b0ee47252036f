"""Where the builtin models live in the cache: ``tiny-reverse`` under the same key as ever, ``tiny`` under a key
that follows the run's envs (names, weights, args, data) and nothing else; ``tiny`` for no envs, or for envs this
process cannot build, is refused with what to do."""

from __future__ import annotations

import json
import shutil

import pytest
from rlrun.api.spec import EnvSpec, ModelSpec
from rlrun.envs.base import Task
from rlrun.model.recipe import TinyEnvsRecipe, TinyModelRecipe
from rlrun.model.resolve import BuiltinModelError, builtin_model_dir, init_builtin_model, load_tokenizer, resolve_model

from tests.support.manifests import parse

#: ``TinyModelRecipe().cache_key()`` before the builtin ``tiny`` existed: tests and the default example rely on it.
TINY_REVERSE_KEY = "708fa35454b9"


class FileEnv:
    """An env whose tasks come from a file; ``fingerprint()`` digests it, as the dataset env does."""

    name = "file-env"

    def __init__(self, path: str) -> None:
        self.path = path

    def task(self, seed: int, index: int, split: str = "train") -> Task:
        return Task(self.name, index, "x=", "x")

    def reward(self, task: Task, completion: str) -> float:
        return float(completion == task.answer)

    def fingerprint(self) -> str:
        with open(self.path) as f:
            return f.read()


def test_tiny_reverse_keeps_its_cache_key(tmp_path):
    assert TinyModelRecipe().cache_key() == TINY_REVERSE_KEY
    assert builtin_model_dir("tiny-reverse", tmp_path).name == f"tiny-reverse-{TINY_REVERSE_KEY}"
    assert builtin_model_dir("tiny-reverse", tmp_path, [EnvSpec(name="reverse-text")]).name.endswith(TINY_REVERSE_KEY)


def test_tiny_cache_key_changed_with_the_shorter_warm_start_so_no_older_model_is_reused():
    """The 0.25 target (issue 35) builds other bytes than the 0.4 one: the key of the recipe without envs before it
    was ``ee43bf50c1fb``."""
    assert TinyEnvsRecipe().sft_target == 0.25 and TinyEnvsRecipe().cache_key() != "ee43bf50c1fb"


def test_tiny_cache_key_is_stable_for_the_same_envs_and_changes_with_them(tmp_path):
    def key(*envs: EnvSpec) -> str:
        return builtin_model_dir("tiny", tmp_path, list(envs)).name

    reverse = EnvSpec(name="reverse-text")
    assert key(reverse) == key(EnvSpec(name="reverse-text")) and key(reverse).startswith("tiny-")
    assert key(reverse) != TinyEnvsRecipe().cache_key()
    others = {
        key(EnvSpec(name="reverse-text", args={"max_words": 3, "max_chars": 24})),
        key(EnvSpec(name="reverse-text", weight=2.0)),
        key(reverse, EnvSpec(name="reverse-text", args={"max_words": 1})),
        key(EnvSpec(name="reverse-text", args={"max_words": 1}), reverse),
    }
    assert len(others) == 4 and key(reverse) not in others


def test_tiny_cache_key_follows_the_envs_data(tmp_path):
    data = tmp_path / "tasks.txt"
    data.write_text("one")
    spec = EnvSpec(name=f"{__name__}:FileEnv", args={"path": str(data)})
    before = builtin_model_dir("tiny", tmp_path, [spec])
    assert builtin_model_dir("tiny", tmp_path, [spec]) == before
    data.write_text("two")
    assert builtin_model_dir("tiny", tmp_path, [spec]) != before


def test_tiny_without_envs_or_with_an_env_this_process_cannot_build_is_refused(tmp_path):
    with pytest.raises(BuiltinModelError, match=r"spec\.envs is empty"):
        resolve_model(ModelSpec(builtin="tiny"), tmp_path)
    missing = EnvSpec(name=f"{__name__}:FileEnv", args={"path": str(tmp_path / "absent.txt")})
    with pytest.raises(BuiltinModelError, match=r"absent\.txt"):
        builtin_model_dir("tiny", tmp_path, [missing])
    with pytest.raises(BuiltinModelError, match=r"cannot build one: .*rlrun model init --manifest"):
        builtin_model_dir("tiny", tmp_path, [EnvSpec(name="no_such_package.envs:Env")])
    assert BuiltinModelError.permanent
    assert not list(tmp_path.iterdir())


def test_model_init_refuses_a_model_by_name_and_warm_start_steps_the_cache_would_not_find(tmp_path):
    named = parse(model={"name": "Qwen/Qwen3-0.6B"}).spec
    with pytest.raises(ValueError, match=r"Qwen/Qwen3-0\.6B@main, not a builtin one"):
        init_builtin_model(named, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="give OUT_DIR"):
        init_builtin_model(parse(model={"builtin": "tiny"}).spec, sft_steps=5, cache_dir=tmp_path)
    assert not list(tmp_path.iterdir())


def test_load_tokenizer_gives_what_autotokenizer_gives_without_its_imports(tiny_model, tmp_path):
    from transformers import AutoTokenizer

    loaded = load_tokenizer(tiny_model, ModelSpec(builtin="tiny-reverse"))
    auto = AutoTokenizer.from_pretrained(tiny_model)
    assert type(loaded) is type(auto)
    text = "reverse: hello world"
    assert loaded(text)["input_ids"] == auto(text)["input_ids"]
    assert (loaded.pad_token_id, loaded.eos_token_id, loaded.chat_template) == (
        auto.pad_token_id,
        auto.eos_token_id,
        auto.chat_template,
    )


@pytest.mark.parametrize("settings", [{"tokenizer_class": "NoSuchTokenizer"}, {"auto_map": {"AutoTokenizer": "x.Y"}}])
def test_load_tokenizer_leaves_a_class_it_cannot_name_to_autotokenizer(tiny_model, tmp_path, settings, monkeypatch):
    import transformers

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, **settings}))
    seen = []
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda path, **kw: seen.append(path) or "auto")
    assert load_tokenizer(model, ModelSpec(builtin="tiny-reverse")) == "auto"
    assert seen == [model]
