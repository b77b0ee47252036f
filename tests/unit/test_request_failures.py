"""A request error that never heals ends bounded (issue 47, item 4). A prompt a server refuses as longer than
its context (vLLM's 400 "maximum context length") stops the run at once with one line naming
``spec.rollout.max_model_len``, and a later turn of a multi-turn episode refused so ends that episode
truncated, as when the context is known; any other refusal (a 4xx) fails its request at once; none is retried
as a server fault (before: 1,879 tries in 6 minutes, 63 groups abandoned, no step, no stop). And requests that
keep failing, of any kind, stop the run with one message after a bounded number in a row
(``orchestrator/failing.py``)."""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections import Counter

import httpx
import pytest
from rlrun.api.spec import SamplingSpec
from rlrun.envs.base import Reply, Task
from rlrun.errors import classify_error
from rlrun.ledger import check_ledger
from rlrun.orchestrator.dispatcher import Dispatcher
from rlrun.orchestrator.episodes import EpisodeBuilder, ServerContextTooSmall
from rlrun.orchestrator.failing import LIMIT, EnvFailing, RequestsFailing, RequestsRejected
from rlrun.orchestrator.groups import GroupRequest, GroupResult
from rlrun.rollout.client import RolloutClient, RolloutError
from rlrun.rollout.fake import fake_vllm_transport
from rlrun.rollout.rejections import ContextExceeded, RequestRejected, completion_error
from rlrun.rundir import RunDir

from tests.support.dispatcher import drain, make_dispatcher
from tests.support.manifests import parse
from tests.support.orchestrators import make_orchestrator, run_to_the_end
from tests.support.polling import wait_for_async
from tests.support.samples import task

#: vLLM 0.32's context refusals, as its source words them (``rollout/rejections.py`` names each place), and
#: the context each says.
CONTEXT_REFUSALS = [
    (
        "This model's maximum context length is 16 tokens. However, your prompt contains 20 input tokens, "
        "which exceeds this limit even without any output tokens. Please reduce the length of the input "
        "prompt. (parameter=input_tokens, value=20)",
        16,
    ),
    ("Input length (20) exceeds model's maximum context length (16).", 16),
    (
        "The decoder prompt (length 20) is longer than the maximum model length of 16. Make sure that "
        "`max_model_len` is no smaller than the number of text tokens.",
        16,
    ),
    (
        "The decoder prompt (length 16) plus the number of requested output tokens (at least 1) is longer "
        "than the maximum model length of 16. Make sure that `max_model_len` is no smaller than the number "
        "of text tokens (prompt + requested output tokens).",
        16,
    ),
]
#: A refusal that is not for the context (vLLM's ``SamplingParams`` check).
TEMPERATURE_REFUSAL = "temperature must be non-negative, got -1.0. (parameter=temperature, value=-1.0)"


def vllm_400(message: str, param: str | None = None) -> httpx.Response:
    """vLLM's answer to a request it refuses (``create_error_response``: its ``ErrorResponse`` body)."""
    error = {"message": message, "type": "BadRequestError", "param": param, "code": 400}
    return httpx.Response(400, json={"error": error})


class ContextLimited(httpx.AsyncBaseTransport):
    """A rollout server whose context is ``context`` tokens: it refuses a longer prompt as vLLM 0.32 does;
    else the fake vLLM server answers (``answer``: the same completion ids for every prompt instead). Counts
    the refusals."""

    def __init__(self, context: int, answer: list[int] | None = None) -> None:
        self.inner = fake_vllm_transport(error_rate=0.3)
        self.context, self.answer = context, answer
        self.refused: Counter[int] = Counter()  # prompt length → refusals
        self.answered = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path != "/v1/completions":
            return await self.inner.handle_async_request(request)
        body = json.loads(request.content)
        n = len(body["prompt"])
        if n > self.context:
            self.refused[n] += 1
            return vllm_400(
                f"This model's maximum context length is {self.context} tokens. However, your prompt "
                f"contains {n} input tokens, which exceeds this limit even without any output tokens. Please "
                f"reduce the length of the input prompt. (parameter=input_tokens, value={n})",
                "input_tokens",
            )
        self.answered += 1
        if self.answer is None:
            return await self.inner.handle_async_request(request)
        choice = {"token_ids": self.answer, "logprobs": {"token_logprobs": [-0.1] * len(self.answer)}}
        choices = [dict(choice, index=i, finish_reason="stop") for i in range(body["n"])]
        return httpx.Response(200, json={"choices": choices})


@pytest.mark.parametrize(("message", "context"), CONTEXT_REFUSALS)
async def test_vllms_context_refusals_are_told_apart_from_server_faults(message, context):
    refused = completion_error("http://s", 400, json.dumps({"error": {"message": message, "code": 400}}))
    assert isinstance(refused, ContextExceeded) and refused.context == context and refused.message == message
    other = completion_error("http://s", 400, vllm_400(TEMPERATURE_REFUSAL).text)
    assert type(other) is RequestRejected and other.status == 400 and TEMPERATURE_REFUSAL in str(other)
    for status in (500, 503, 404, 408, 429):  # a server fault, an adapter the server lost, "later": retried
        assert type(completion_error("http://s", status, "boom")) is RolloutError
    client = RolloutClient("http://s", transport=httpx.MockTransport(lambda request: vllm_400(message)))
    with pytest.raises(ContextExceeded) as raised:
        await client.complete([1] * 20, SamplingSpec(max_tokens=4))
    assert raised.value.context == context
    await client.aclose()


async def test_a_prompt_longer_than_the_servers_context_stops_the_run_at_once_naming_the_setting():
    server = ContextLimited(context=2)  # the prompt "ab=" is 3 tokens
    dispatcher, results = make_dispatcher({"http://a": server}, retry_window_s=30.0)
    dispatcher.dispatch(GroupRequest(1, task(1), members=4), policy_version=0)
    await wait_for_async(lambda: dispatcher.failures, 2.0, what="the run's stop")
    [stop] = dispatcher.failures
    assert isinstance(stop, ServerContextTooSmall) and classify_error(stop) == (True, "ServerContextTooSmall")
    assert "refused the prompt of 3 tokens as longer than its context (its context is 2 tokens)" in str(stop)
    assert "set spec.rollout.max_model_len: 2 so that every prompt is measured against it" in str(stop)
    assert server.refused == {3: 1} and results.empty()  # asked once, never retried as a server fault
    assert "http://a" not in dispatcher.pool.last_failure  # nor counted as the server's failure
    await dispatcher.aclose()


async def test_another_refusal_fails_its_request_at_once_and_is_never_retried():
    sent = []

    def refuse(request: httpx.Request) -> httpx.Response:
        sent.append(request.url.path)
        return vllm_400(TEMPERATURE_REFUSAL, "temperature")

    dispatcher, results = make_dispatcher({"http://a": httpx.MockTransport(refuse)}, retry_window_s=30.0)
    dispatcher.dispatch(GroupRequest(1, task(1), members=2), policy_version=0)
    [result] = await drain(results, 1, timeout=2.0)  # not after the 30 s retry window
    assert result.episodes == []
    assert result.error.startswith("http://a: completion refused with 400: temperature")
    assert sent == ["/v1/completions"] and dispatcher.failures == []
    assert "http://a" not in dispatcher.pool.last_failure
    await dispatcher.aclose()


class SaysNo:
    """A multi-turn env with plain-text prompts ``abcd=``: it answers every model turn ``no=``, up to 10
    turns."""

    name = "says-no"
    max_turns = 10

    def task(self, seed: int, index: int, split: str = "train") -> Task:
        return Task(self.name, index, "abcd=", None)

    def start(self, task: Task) -> dict:
        return {}

    def respond(self, task: Task, state: dict, completion: str) -> Reply:
        return Reply("no=", False, state)

    def reward(self, task: Task, completion: str) -> float:
        return 0.5


async def test_a_turn_longer_than_the_servers_context_ends_the_episode_truncated(caplog):
    """Every turn is ``x`` + EOS (2 tokens) and every answer ``no=`` (3): turn k's prompt is 5k tokens, so a
    server whose context is 14 answers turns 1 and 2 and refuses turn 3 (15 tokens). The episode ends at turn
    2, ``length``, without the answer it could not be prompted with, and trains — as when the context is known
    (there the turn is not even sent)."""
    chars = {c: i + 1 for i, c in enumerate("abcdnox=")}
    env = SaysNo()
    server = ContextLimited(context=14, answer=[chars["x"], 0])
    results: asyncio.Queue[GroupResult] = asyncio.Queue()
    episodes = EpisodeBuilder(
        encode=lambda text: [chars[c] for c in text],
        decode=lambda ids: "".join({v: k for k, v in chars.items()}.get(i, "") for i in ids),
        eos_id=0,
        envs={env.name: env},
    )
    client_factory = lambda url: RolloutClient(url, transport=server)  # noqa: E731
    dispatcher = Dispatcher(["http://a"], episodes, SamplingSpec(max_tokens=4), results, 30.0, client_factory)
    with caplog.at_level(logging.WARNING, logger="rlrun.orchestrator.dispatcher"):
        dispatcher.dispatch(GroupRequest(0, env.task(0, 0), members=2), policy_version=0)
        [result] = await drain(results, 1, timeout=5.0)
    assert result.error is None and dispatcher.failures == []
    turn, answer = [chars["x"], 0], [chars[c] for c in "no="]
    for episode in result.episodes:
        assert list(episode.completion_ids) == turn + answer + turn  # turn 3's prompt would not fit: not kept
        assert episode.finish_reason == "length" and episode.reward == 0.5
        assert [math.isnan(x) for x in episode.logprobs] == [False, False, True, True, True, False, False]
    assert result.scored.turns["num_turns"] == [2, 2]
    assert server.refused == {15: 2}  # each member's third turn, asked once
    told = [r.getMessage() for r in caplog.records if "longer than its context" in r.getMessage()]
    assert len(told) == 1 and "set spec.rollout.max_model_len" in told[0]  # said once
    await dispatcher.aclose()


class Broken(SaysNo):
    """:class:`SaysNo` whose ``start`` always raises (its sandbox is gone)."""

    name = "broken"

    def start(self, task: Task) -> dict:
        raise ConnectionError("the sandbox is gone")


def refusing(request: httpx.Request) -> httpx.Response:
    return vllm_400(TEMPERATURE_REFUSAL, "temperature")


def broken(request: httpx.Request) -> httpx.Response:
    return httpx.Response(500, text="Internal Server Error")


@pytest.mark.parametrize(
    ("server", "env", "error", "permanent", "says"),
    [
        (refusing, None, RequestsRejected, True, "were refused by the server"),
        (broken, None, RequestsFailing, False, "failed on every try"),
        (None, Broken(), EnvFailing, True, "env calls (start, respond) of 64 requests in a row failed"),
    ],
    ids=["refused", "server_fault", "env_fails"],
)
async def test_requests_that_keep_failing_stop_the_run_with_one_message(
    server,
    env,
    error,
    permanent,
    says,
    caplog,
):
    transport = httpx.MockTransport(server) if server is not None else fake_vllm_transport()
    envs = [env] if env is not None else None
    dispatcher, results = make_dispatcher({"http://a": transport}, retry_window_s=0.05, envs=envs)
    tasks = [env.task(0, g) if env is not None else task(g) for g in range(LIMIT + 6)]
    with caplog.at_level(logging.WARNING, logger="rlrun.orchestrator.failing"):
        for g, t in enumerate(tasks):
            dispatcher.dispatch(GroupRequest(g, t, members=2), policy_version=0)
        await wait_for_async(lambda: dispatcher.failures, 10.0, what="the run's stop")
    stop = dispatcher.failures[0]
    assert type(stop) is error and classify_error(stop)[0] is permanent
    assert says in str(stop) and f"Stopped after {LIMIT} such requests in a row" in str(stop)
    assert results.qsize() == LIMIT - 1  # each failed request before it was delivered
    warned = [r.getMessage() for r in caplog.records if "in a row" in r.getMessage()]
    assert len(warned) == 1 and f"The run stops at {LIMIT} in a row" in warned[0]  # once per streak
    await dispatcher.aclose()


async def test_a_run_where_requests_fail_between_successes_never_stops():
    """Three requests in four are refused at once, the fourth answered and scored (slower: its rewards run in
    a thread). The rollout streak ends at each answer, not at its scoring, so the quick refusals in between
    never add up to the limit however the scoring lags."""
    good = fake_vllm_transport(error_rate=0.0)
    sent = Counter()

    async def every_fourth(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/completions":
            sent["completions"] += 1
            if sent["completions"] % 4:
                return vllm_400(TEMPERATURE_REFUSAL, "temperature")
        return await good.handle_async_request(request)

    dispatcher, results = make_dispatcher({"http://a": httpx.MockTransport(every_fourth)})
    for g in range(4 * LIMIT):
        dispatcher.dispatch(GroupRequest(g, task(g), members=2), policy_version=0)
    got = await drain(results, 4 * LIMIT)
    assert dispatcher.failures == [] and sum(r.error is None for r in got) == LIMIT
    assert dispatcher.streak.longest <= 3
    await dispatcher.aclose()


async def test_a_run_whose_server_context_is_smaller_than_rlrun_believes_stops_at_once(tmp_path, tiny_model):
    """The issue's run, on the fake server: every prompt is longer than the server's context and rlrun was not
    told. Before, 1,879 tries in 6 minutes and no stop; now the first refusal stops the run with one line,
    nothing is asked twice, and the ledger checks."""
    checkpoint, rollout = {"interval": 1, "keep_last": 2}, {"max_inflight": 32}
    spec = parse("ctx", group_size=4, batch_size=8, max_steps=3, checkpoint=checkpoint, rollout=rollout).spec
    server = ContextLimited(context=2)
    orch = make_orchestrator(spec, RunDir(tmp_path), tiny_model, server)
    setting = r"set spec\.rollout\.max_model_len: 2 so that every prompt"
    with pytest.raises(ServerContextTooSmall, match=setting):
        await run_to_the_end(orch, timeout_s=30)
    assert orch.shipped == 0 and server.answered == 0
    # the requests dispatched at once (32 in flight / 4), each asked once
    assert 1 <= sum(server.refused.values()) <= 8
    report = check_ledger(tmp_path / "ledger")
    assert report.ok, report.problems
