"""Chat prompts: rendered once, in the orchestrator, by the tokenizer's chat template; vLLM receives token ids, and
the trainer trains exactly the token ids the server returned — compared id for id (and logprob for logprob) between
what the (fake) server answered and the shipped batches of a real Orchestrator run — a completion that stopped
keeping its EOS (trained, with its logprob) and one cut by ``max_tokens`` none. A prompt that leaves no room for
``max_tokens`` stops the run naming the task."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from rlrun.batch import read_batch
from rlrun.envs.base import Task
from rlrun.orchestrator import checkpointing
from rlrun.orchestrator.episodes import EpisodeBuilder, PromptTooLongError
from rlrun.rollout.fake import fake_vllm_transport
from rlrun.rundir import RunDir, step_dirs
from transformers import AutoTokenizer

from tests.support.chat_models import with_template
from tests.support.manifests import parse
from tests.support.orchestrators import make_orchestrator, run_to_the_end

#: A compact chat template: each message as ``[<role initial>]<content>``, the generation prompt ``=``.
TEMPLATE = (
    "{% for m in messages %}[{{ m['role'][0] }}]{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}={% endif %}"
)
WORDS = ["flat", "is", "better", "than", "nested", "simple", "complex", "sparse", "dense", "ugly", "special", "cases"]


@pytest.fixture
def chat_model(tmp_path, tiny_model):
    """The tiny model with :data:`TEMPLATE` as its tokenizer's chat template."""
    return with_template(tiny_model, tmp_path / "chat-model", TEMPLATE)


class Recorder(httpx.AsyncBaseTransport):
    """The fake vLLM server (cutting some answers at ``max_tokens``), keeping every prompt and choice it answered."""

    def __init__(self) -> None:
        self.inner = fake_vllm_transport(error_rate=0.3)
        self.answered: list[tuple[tuple[int, ...], tuple[int, ...], tuple[float, ...], str]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        if request.url.path == "/v1/completions":
            prompt = tuple(json.loads(request.content)["prompt"])
            for c in json.loads(response.content)["choices"]:
                self.answered.append(
                    (prompt, tuple(c["token_ids"]), tuple(c["logprobs"]["token_logprobs"]), c["finish_reason"])
                )
        return response


def test_a_chat_prompt_is_rendered_by_the_template_once_and_encoded_without_special_tokens(chat_model):
    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    spec = parse("chat").spec
    builder = EpisodeBuilder.from_spec(tokenizer, {}, spec)
    task = Task("dataset", 0, [{"role": "system", "content": "be brief"}, {"role": "user", "content": "flat"}], "talf")
    assert builder.prompt_text(task) == "[s]be brief[u]flat="
    assert list(builder.prompt_ids(task)) == tokenizer.encode("[s]be brief[u]flat=", add_special_tokens=False)
    assert builder.prompt_text(task) is builder.prompt_text(task)  # rendered once
    plain = Task("reverse-text", 0, "flat=", "talf")
    assert builder.prompt_text(plain) == "flat="  # a plain prompt is sent as is, no template


def test_a_prompt_without_room_for_max_tokens_is_refused_naming_the_task(chat_model):
    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    builder = EpisodeBuilder.from_spec(tokenizer, {}, parse("chat", sampling={"max_tokens": 24}).spec)
    assert builder.max_prompt_tokens == 64 - 24  # the tiny model's context less max_tokens
    with pytest.raises(PromptTooLongError, match=r"env dataset task 7: the prompt is 45 tokens, and at most 40 fit"):
        builder.prompt_ids(Task("dataset", 7, [{"role": "user", "content": "x" * 41}], None))


async def test_the_trainer_trains_exactly_the_ids_and_logprobs_the_server_returned(tmp_path, chat_model, monkeypatch):
    keep = checkpointing.step_dirs  # trained batches stay for the comparison: retention prunes no rollouts dir
    monkeypatch.setattr(checkpointing, "step_dirs", lambda parent: {} if parent.name == "rollouts" else keep(parent))
    data = tmp_path / "chat.jsonl"
    # the answer is what the fake answers to the rendered prompt, errors aside: the LCS reward then tells members apart
    rows = [{"prompt": [{"role": "user", "content": w}], "answer": f"[s]rev[u]{w}"[::-1]} for w in WORDS]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    envs = [{"name": "dataset", "args": {"path": str(data), "system_prompt": "rev"}, "rewards": [{"name": "lcs"}]}]
    spec = parse(
        "chat",
        envs=envs,
        group_size=4,
        batch_size=8,
        max_off_policy_steps=1,
        max_steps=3,
        sampling={"max_tokens": 14},
        checkpoint={"interval": 1, "keep_last": 2},
    ).spec
    run_dir = RunDir(tmp_path / "run")
    recorder = Recorder()
    orch = make_orchestrator(spec, run_dir, chat_model, recorder)
    assert await asyncio.wait_for(run_to_the_end(orch), 60) == 3
    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    answered = {(p, c): (lp, finish) for p, c, lp, finish in recorder.answered}
    prompts = {tuple(tokenizer.encode(f"[s]rev[u]{w}=", add_special_tokens=False)) for w in WORDS}
    assert {p for p, _ in answered} <= prompts  # vLLM got the rendered template's ids
    seen_finish = set()
    for step_dir in step_dirs(run_dir.rollouts).values():
        batch = read_batch(step_dir)
        for row in range(batch.num_samples):
            length = int(batch.attention_mask[row].sum())
            ids = batch.input_ids[row, :length].tolist()
            mask = batch.loss_mask[row, : length - 1].tolist()
            start = mask.index(True) + 1  # the first completion token
            prompt, completion = tuple(ids[:start]), tuple(ids[start:])
            assert all(mask[start - 1 :]) and not any(mask[: start - 1])
            logprobs, finish = answered[(prompt, completion)]  # exactly a (prompt, completion) the server returned
            assert batch.old_logprobs[row, start - 1 : length - 1].tolist() == pytest.approx(logprobs)
            assert (completion[-1] == tokenizer.eos_token_id) == (finish == "stop")  # EOS trained iff it stopped
            seen_finish.add(finish)
    assert seen_finish == {"stop", "length"}
