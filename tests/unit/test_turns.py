"""Multi-turn episodes keep token fidelity: each turn's prompt extends the sampled stream with the env's answer, never
the history rendered again, so a chat template that rewrites past turns (Qwen3 drops earlier ``<think>`` blocks)
cannot make the trained ids differ from the sampled ones; env tokens are in the batch with loss mask 0. And a real
Orchestrator run with a multi-turn env on the fake server ends with the ledger check passing and turn metrics."""

from __future__ import annotations

import asyncio
import json
import math
import random

import httpx
import pytest
from rlrun.api.spec import SamplingSpec
from rlrun.batch import collate
from rlrun.envs.base import Reply, Task
from rlrun.envs.replies import TemplateError, reply_renderer
from rlrun.ledger import check_ledger
from rlrun.orchestrator.dispatcher import Dispatcher
from rlrun.orchestrator.episodes import EpisodeBuilder
from rlrun.orchestrator.groups import GroupRequest, GroupResult
from rlrun.rollout.client import RolloutClient
from rlrun.rollout.fake import fake_vllm_transport
from rlrun.rundir import RunDir, read_jsonl
from rlrun.samples import TrainingSample
from transformers import AutoTokenizer

from tests.support.manifests import parse
from tests.support.orchestrators import make_orchestrator, run_to_the_end


class ThreeTurns:
    """A multi-turn env: three model turns, answered ``ok1``, ``ok2`` (its state counts them)."""

    name = "three-turns"
    max_turns = 3

    def task(self, seed, index, split="train"):
        return Task(self.name, index, [{"role": "user", "content": "go"}], None)

    def start(self, task):
        return {"turn": 0}

    def respond(self, task, state, completion):
        turn = state["turn"] + 1
        return Reply(f"ok{turn}", False, {"turn": turn}, reward=0.25)

    def reward(self, task, completion):
        return 0.5


class Scripted(httpx.AsyncBaseTransport):
    """A server answering turn ``k`` of every conversation with ``turns[k]``'s tokens then EOS, recording prompts."""

    def __init__(self, tokenizer, turns: list[str]) -> None:
        self.turns = [[*tokenizer.encode(t, add_special_tokens=False), tokenizer.eos_token_id] for t in turns]
        self.prompts: list[list[int]] = []
        self.lengths: list[int] = []  # prompt lengths in the order first seen: turn k's is the k-th (streams grow)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path != "/v1/completions":
            return httpx.Response(200, json={})
        body = json.loads(request.content)
        self.prompts.append(body["prompt"])
        if len(body["prompt"]) not in self.lengths:
            self.lengths.append(len(body["prompt"]))
        k = self.lengths.index(len(body["prompt"]))
        ids = self.turns[k]
        choice = {"token_ids": ids, "logprobs": {"token_logprobs": [-0.5 - k] * len(ids)}, "finish_reason": "stop"}
        return httpx.Response(200, json={"choices": [dict(choice, index=i) for i in range(body["n"])]})


async def test_the_trained_ids_are_the_sampled_stream_with_env_tokens_masked(thinking_model):
    tokenizer = AutoTokenizer.from_pretrained(thinking_model)
    turns = ["<think>h</think>a", "b", "c"]  # the tiny model's context is 64 tokens
    server = Scripted(tokenizer, turns)
    env = ThreeTurns()
    results: asyncio.Queue[GroupResult] = asyncio.Queue()
    episodes = EpisodeBuilder.from_spec(tokenizer, {env.name: env}, parse("t", sampling={"max_tokens": 4}).spec)
    dispatcher = Dispatcher(
        ["http://s"],
        episodes,
        SamplingSpec(max_tokens=4),
        results,
        client_factory=lambda url: RolloutClient(url, transport=server),
    )
    task = env.task(0, 0)
    dispatcher.dispatch(GroupRequest(0, task, 2), 0)
    result = await asyncio.wait_for(results.get(), 10)
    await dispatcher.aclose()

    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    eos = [tokenizer.eos_token_id]
    prompt = encode("[u]go<|endoftext|>[a]")
    sampled = [encode(t) + eos for t in turns]
    answers = [encode(f"[u]ok{k}<|endoftext|>[a]") for k in (1, 2)]
    stream = sampled[0] + answers[0] + sampled[1] + answers[1] + sampled[2]
    assert result.error is None and len(result.episodes) == 2
    for ep in result.episodes:
        assert list(ep.prompt_ids) == prompt
        assert list(ep.completion_ids) == stream
        env_token = [math.isnan(x) for x in ep.logprobs]
        assert env_token == [False] * len(sampled[0]) + [True] * len(answers[0]) + [False] * len(sampled[1]) + [
            True
        ] * len(answers[1]) + [False] * len(sampled[2])
        assert [x for x in ep.logprobs if not math.isnan(x)] == [-0.5] * len(sampled[0]) + [-1.5] * len(sampled[1]) + [
            -2.5
        ] * len(sampled[2])
        assert ep.reward == pytest.approx(0.5 + 2 * 0.25)  # the last turn's reward plus the per-turn rewards
    assert result.scored.turns == {"num_turns": [3, 3], "tool_calls": [0, 0], "tool_errors": [0, 0]}
    # each turn was prompted with the stream itself; the history rendered again would differ (the template
    # strips the first turn's thinking), which is what the stream protects against
    assert server.prompts[2] == prompt + sampled[0] + answers[0]
    history = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": turns[0]},
        {"role": "user", "content": "ok1"},
        {"role": "assistant", "content": turns[1]},
        {"role": "user", "content": "ok2"},
    ]
    rerendered = encode(tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True))
    assert rerendered != prompt + stream[: -len(sampled[2])]

    sample = TrainingSample.from_episode(result.episodes[0], advantage=1.0)
    batch = collate([sample], pad_id=0)
    p = len(prompt)
    mask = batch["loss_mask"][0, p - 1 : p - 1 + len(stream)].tolist()
    assert mask == [not t for t in env_token]  # every sampled token once with mask 1, every env token 0
    assert not batch["old_logprobs"].isnan().any()


def test_a_template_that_does_not_end_an_assistant_turn_with_eos_is_refused(thinking_model):
    tokenizer = AutoTokenizer.from_pretrained(thinking_model)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(TemplateError, match="does not end an assistant message with the EOS token"):
        reply_renderer(tokenizer)([{"role": "user", "content": "x"}])


class Guesser(httpx.AsyncBaseTransport):
    """The fake vLLM server, except that a completion is a random digit 1–8 and EOS (a guess)."""

    def __init__(self, tokenizer) -> None:
        self.inner = fake_vllm_transport()
        self.digits = tokenizer.convert_tokens_to_ids(list("12345678"))
        self.eos = tokenizer.eos_token_id
        self.rng = random.Random(0)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path != "/v1/completions":
            return await self.inner.handle_async_request(request)
        n = json.loads(request.content)["n"]
        choices = [
            {
                "index": i,
                "token_ids": [self.rng.choice(self.digits), self.eos],
                "logprobs": {"token_logprobs": [-2.0, -0.1]},
                "finish_reason": "stop",
            }
            for i in range(n)
        ]
        return httpx.Response(200, json={"choices": choices})


async def test_a_run_with_a_multi_turn_env_ends_with_the_ledger_check_and_turn_metrics(tmp_path, thinking_model):
    envs = [{"name": "guess-number", "args": {"low": 1, "high": 12, "width": 8, "max_turns": 3}}]
    spec = parse(
        "guess",
        envs=envs,
        group_size=4,
        batch_size=8,
        max_off_policy_steps=1,
        max_steps=3,
        sampling={"max_tokens": 6},
        checkpoint={"interval": 1, "keep_last": 2},
    ).spec
    run_dir = RunDir(tmp_path / "run")
    orch = make_orchestrator(spec, run_dir, thinking_model, Guesser(AutoTokenizer.from_pretrained(thinking_model)))
    assert await asyncio.wait_for(run_to_the_end(orch), 60) == 3
    report = check_ledger(run_dir.root / "ledger")
    assert report.ok and report.trained == 24, report.problems
    lines = read_jsonl(run_dir.metrics)
    turns = [line["num_turns"] for line in lines if line.get("num_turns") is not None]
    assert turns and max(turns) > 1  # a wrong guess is answered higher or lower, and guessed again
    assert any(line["reward/guess-number"] > 0 for line in lines)  # some guesses hit the secret
    # no tool env: 0 calls per episode (null on a step that finished no episode since the one before)
    assert {line.get("tool_calls") for line in lines} <= {0, None} and 0 in {line.get("tool_calls") for line in lines}
