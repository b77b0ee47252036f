"""The builtin ``tiny`` model built for an env (a recipe cut down to seconds): tiny-reverse's Qwen3 shape with 512
positions, the chat tokenizer, a warm start that stops once its check tasks are half solved and leaves held-out
greedy accuracy above zero, generation that stops on the EOS ending an assistant turn, and a model directory that
appears whole."""

from __future__ import annotations

import hashlib
import json
import random

import pytest
import torch
from rlrun.api.spec import EnvSpec
from rlrun.envs.base import Task
from rlrun.model.build_progress import BuildProgress
from rlrun.model.demonstrations import NoDemonstrationsError
from rlrun.model.recipe import TinyEnvsRecipe
from rlrun.model.tiny_envs import greedy_completions, init_tiny_envs_model
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

#: A warm start of seconds: at most 60 steps of 32 rows, checked every 10 steps on 16 tasks.
QUICK = TinyEnvsRecipe(sft_steps=60, sft_batch_size=32, sft_check_every=10, sft_check_tasks=16, sft_target=0.5)


class SwapEnv:
    """Swap the two digits of a chat message (``"37"`` → ``"73"``); a fifth of the 100 pairs held out as eval."""

    name = "swap"

    def task(self, seed: int, index: int, split: str = "train") -> Task:
        rng = random.Random(f"swap:{split}:{seed}:{index}")
        while True:
            text = f"{rng.randint(0, 99):02d}"
            if (int(hashlib.sha256(text.encode()).hexdigest()[:8], 16) % 5 == 0) == (split == "eval"):
                return Task(self.name, index, [{"role": "user", "content": text}], text[::-1])

    def reward(self, task: Task, completion: str) -> float:
        return float(completion == task.answer)


class NoAnswerEnv(SwapEnv):
    """A :class:`SwapEnv` whose tasks have no answer."""

    def task(self, seed: int, index: int, split: str = "train") -> Task:
        return Task(self.name, index, "?", None)


SWAP = EnvSpec(name=f"{__name__}:SwapEnv")


class Recorded(BuildProgress):
    """Every call a build makes on its progress, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple] = []
        self.threads: set[int] = set()  # torch's threads at each step

    def phase(self, text: str) -> None:
        self.calls.append(("phase", text))

    def start(self, title: str, steps: int, tokens_budget: int | None = None) -> None:
        self.calls.append(("start", steps, tokens_budget))

    def advance(self, step: int, loss: float, tokens: int) -> None:
        self.calls.append(("advance", step, tokens))
        self.threads.add(torch.get_num_threads())

    def checked(self, step: int, solved: dict[str, float]) -> None:
        self.calls.append(("checked", step, solved))

    def finish(self, stopped: str) -> None:
        self.calls.append(("finish", stopped))


@pytest.fixture(scope="module")
def progress() -> Recorded:
    return Recorded()


@pytest.fixture(scope="module")
def swap_model(tmp_path_factory, progress):
    out = tmp_path_factory.mktemp("tiny") / "model"
    torch.set_num_threads(2)  # what the process had before the build (2 cores: torch's default here)
    report = init_tiny_envs_model(out, [SWAP], QUICK, progress=progress)
    progress.threads_after = torch.get_num_threads()
    return out, report


def test_the_build_runs_on_one_thread_and_gives_the_process_its_threads_back(swap_model, progress):
    """Two threads on two busy cores made each step 5–10× slower (issue 35); the build's bytes do not depend on it."""
    assert progress.threads == {1} and progress.threads_after == 2


def test_the_build_shows_every_step_each_check_and_its_phases(swap_model, progress):
    _, report = swap_model
    steps = report["sft_steps"]
    kinds = [c[0] for c in progress.calls]
    assert kinds == [
        "phase",
        "start",
        *(["advance"] * QUICK.sft_check_every + ["checked"]) * (steps // 10),
        "finish",
        "phase",
    ]
    assert progress.calls[1] == ("start", QUICK.sft_steps, QUICK.sft_max_tokens)
    advances = [c for c in progress.calls if c[0] == "advance"]
    assert [c[1] for c in advances] == list(range(1, steps + 1)) and advances[-1][2] == report["sft_tokens"]
    assert [(c[1], c[2]) for c in progress.calls if c[0] == "checked"] == [
        (c["step"], c["solved"]) for c in report["checks"]
    ]
    assert progress.calls[-2] == ("finish", "target") and "held-out" in progress.calls[-1][1]


def test_the_warm_start_stops_at_its_target_with_held_out_accuracy_above_zero(swap_model):
    _, report = swap_model
    assert report["sft_stopped"] == "target" and report["sft_steps"] < QUICK.sft_steps
    assert report["checks"][-1]["solved"][SWAP.name] >= 0.5
    assert report["sft_loss_last"] < report["sft_loss_first"]
    held_out = report["greedy"][SWAP.name]
    assert held_out["tasks"] == 64 and held_out["solved"] > 0
    (drawn,) = report["drawn"]
    assert drawn["held_for_checks"] > 0 and not drawn["checks_trained"]
    assert report["envs"] == [{"name": SWAP.name, "weight": 1.0, "args": {}, "fingerprint": None}]


def test_the_model_is_tiny_reverses_shape_with_512_positions_and_the_chat_tokenizer(swap_model):
    out, report = swap_model
    config = AutoConfig.from_pretrained(out)
    assert config.architectures == ["Qwen3ForCausalLM"] and config.head_dim == 32
    assert config.tie_word_embeddings is False and config.max_position_embeddings == 512
    tok = AutoTokenizer.from_pretrained(out)
    assert config.eos_token_id == tok.eos_token_id == GenerationConfig.from_pretrained(out).eos_token_id
    assert tok.model_max_length == 512 and config.vocab_size == 128 and report["vocabulary"] == 102
    assert json.loads((out / "rlrun_model.json").read_text())["recipe"] == report["recipe"]
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]


def test_greedy_generation_stops_at_the_end_of_the_assistant_turn(swap_model):
    out, _ = swap_model
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(out)
    prompt = tok.apply_chat_template([{"role": "user", "content": "12"}], add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([tok.encode(prompt, add_special_tokens=False)])
    generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False)
    new = generated[0, ids.shape[1] :].tolist()
    assert tok.eos_token_id in new and len(new) <= 4  # two digits and the end of the turn
    text = greedy_completions(model, tok, [prompt], [20])[0]
    assert text == tok.decode(new[: new.index(tok.eos_token_id)])


def test_envs_without_answers_are_refused_and_nothing_is_written(tmp_path):
    with pytest.raises(NoDemonstrationsError, match=r"no env of spec\.envs gives usable ones"):
        init_tiny_envs_model(tmp_path / "model", [EnvSpec(name=f"{__name__}:NoAnswerEnv")], QUICK)
    assert not list(tmp_path.iterdir())
    with pytest.raises(ValueError, match="at least one"):
        init_tiny_envs_model(tmp_path / "model", [], QUICK)
