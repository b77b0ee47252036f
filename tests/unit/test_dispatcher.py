"""Dispatcher: every dispatched request reaches the results queue exactly once, or is cancelled and counted."""

from __future__ import annotations

import asyncio
import json

import httpx
import torch
from rlrun.orchestrator.dispatcher import Dispatcher
from rlrun.orchestrator.groups import GroupRequest, GroupResult
from rlrun.orchestrator.weights import push_weights
from rlrun.rollout.fake import fake_vllm_transport
from safetensors.torch import save_file

from tests.support.dispatcher import CHARS, drain, make_dispatcher, never_answers
from tests.support.samples import task


async def test_a_group_split_into_requests_arrives_once_per_request_with_its_dispatch_version():
    dispatcher, results = make_dispatcher({"http://a": fake_vllm_transport(error_rate=0.0)}, members_per_request=3)
    dispatcher.pool.clients["http://a"].loaded_version = 5  # the server holds policy 5
    dispatcher.dispatch(GroupRequest(7, task(7), members=8, first_member=4), policy_version=5)
    assert dispatcher.inflight_samples == 8 and len(dispatcher.inflight) == 3  # 3 + 3 + 2 members
    got = await drain(results, 3)
    assert results.empty()
    assert sorted((r.request.first_member, r.request.members) for r in got) == [(4, 3), (7, 3), (10, 2)]
    episodes = sorted((e for r in got for e in r.episodes), key=lambda e: e.member)
    assert [e.member for e in episodes] == list(range(4, 12))
    assert {e.group_id for e in episodes} == {7} and {e.policy_version for e in episodes} == {5}
    # "ab=" reversed without errors: "ba", the full reward
    assert {e.reward for e in episodes} == {1.0}
    assert dispatcher.inflight_samples == 0 and dispatcher.outstanding_samples == 8  # delivered, not yet taken
    for r in got:
        dispatcher.take(r)
    assert dispatcher.outstanding_samples == 0 and dispatcher.emitted_requests() == []
    await dispatcher.aclose()


async def test_a_failing_endpoint_is_retried_on_another_one():
    calls = {"http://down": 0}

    def refuse(request: httpx.Request) -> httpx.Response:
        calls["http://down"] += 1
        raise httpx.ConnectError("connection refused", request=request)

    transports = {"http://down": httpx.MockTransport(refuse), "http://up": fake_vllm_transport(error_rate=0.0)}
    dispatcher, results = make_dispatcher(transports)
    for g in range(4):
        dispatcher.dispatch(GroupRequest(g, task(g), members=2), policy_version=0)
    got = await drain(results, 4, timeout=20)
    assert sorted(r.request.group_id for r in got) == [0, 1, 2, 3]
    assert calls["http://down"] >= 1 and dispatcher.failures == []
    await dispatcher.aclose()


async def test_a_request_failing_for_the_whole_retry_window_arrives_as_a_failed_result():
    def broken(request: httpx.Request) -> httpx.Response:
        return httpx.Response(500, text="boom")

    dispatcher, results = make_dispatcher({"http://a": httpx.MockTransport(broken)}, retry_window_s=0.3)
    dispatcher.dispatch(GroupRequest(1, task(1), members=2, first_member=6), policy_version=0)
    [result] = await drain(results, 1)
    assert result.episodes == [] and result.request.first_member == 6
    assert result.error.startswith("failed on every try for 0 s (RolloutError: http://a: completion failed with 500")
    assert dispatcher.failures == []  # a rollout failure is the orchestrator's to settle, not a crash
    assert dispatcher.emitted_requests() == [result.request]  # delivered, not yet taken
    await dispatcher.aclose()


async def test_a_hung_server_times_out_and_the_request_moves_to_another():
    transports = {"http://hung": never_answers(), "http://up": fake_vllm_transport(error_rate=0.0)}
    dispatcher, results = make_dispatcher(transports, timeout_s=0.2)
    dispatcher.dispatch(GroupRequest(1, task(1), members=4), policy_version=0)  # both idle: "hung" is tried first
    [result] = await drain(results, 1)
    assert result.error is None and len(result.episodes) == 4
    assert "http://hung" in dispatcher.pool.last_failure
    # the next request avoids the server that failed recently, though it is as idle as the other one
    dispatcher.dispatch(GroupRequest(2, task(2), members=4), policy_version=0)
    [result] = await drain(results, 1, timeout=0.19)
    assert result.error is None
    await dispatcher.aclose()


async def test_a_straggler_on_the_only_server_ends_as_a_failed_result_naming_the_timeout():
    dispatcher, results = make_dispatcher({"http://a": never_answers()}, retry_window_s=0.1, timeout_s=0.2)
    dispatcher.dispatch(GroupRequest(3, task(3), members=2), policy_version=0)
    [result] = await drain(results, 1)
    assert "no answer within 0 s (rollout.request_timeout_seconds)" in result.error
    assert dispatcher.inflight_samples == 0
    await dispatcher.aclose()


async def test_a_cancelled_request_never_delivers_a_result_even_if_its_try_completed():
    # asyncio.wait_for may hand back the answer of a try whose cancellation raced it: that result must not
    # reach the sink, which has already settled the request as cancelled (found in a default run: a group
    # cancelled as stale then got its members anyway)
    dispatcher, results = make_dispatcher({"http://a": never_answers()})
    request = GroupRequest(7, task(7), members=2)
    dispatcher.dispatch(request, policy_version=0)
    await asyncio.sleep(0.05)
    [cancelled] = dispatcher.cancel_stale(min_version=1)
    assert cancelled.request == request
    dispatcher._deliver(GroupResult(request, tokens=4))  # what the raced task would do next
    assert results.empty() and dispatcher.emitted_requests() == []
    await dispatcher.aclose()


async def test_cancelling_an_abandoned_group_stops_its_requests_and_unlists_delivered_ones():
    dispatcher, results = make_dispatcher({"http://a": never_answers()}, members_per_request=2)
    dispatcher.dispatch(GroupRequest(4, task(4), members=4), policy_version=0)
    dispatcher.dispatch(GroupRequest(5, task(5), members=2), policy_version=0)
    dispatcher.undelivered[(4, 9)] = GroupRequest(4, task(4), 1, 9)  # a result of group 4 already queued
    await asyncio.sleep(0.05)
    assert dispatcher.cancel_group(4) == 2
    assert [r.group_id for r in dispatcher.emitted_requests()] == [5]
    await asyncio.sleep(0.05)
    assert dispatcher.failures == [] and results.empty()
    await dispatcher.aclose()


async def test_cancel_stale_cancels_only_old_requests_and_says_which_groups_still_have_work_out():
    dispatcher, results = make_dispatcher({"http://a": never_answers()}, members_per_request=2)
    dispatcher.dispatch(GroupRequest(1, task(1), members=4), policy_version=0)  # two requests, both stale
    dispatcher.dispatch(GroupRequest(2, task(2), members=2), policy_version=0)
    dispatcher.dispatch(GroupRequest(2, task(2), members=2, first_member=2), policy_version=3)  # fresh
    await asyncio.sleep(0.05)
    cancelled = dispatcher.cancel_stale(min_version=2)
    assert [(c.request.group_id, c.request.first_member) for c in cancelled] == [(1, 0), (1, 2), (2, 0)]
    assert [c.others_out for c in cancelled] == [False, False, True]  # group 2 still has members 2–3 out
    assert {c.min_fresh_version for c in cancelled} == {2}
    assert dispatcher.cancelled_groups == 3 and dispatcher.inflight_samples == 2
    await asyncio.sleep(0.05)
    assert results.empty() and dispatcher.failures == []  # a cancelled request delivers nothing
    await dispatcher.aclose()


def test_requests_carry_the_prompt_tokens_and_sampling_settings():
    seen = []

    def record(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(200, json={"choices": []})

    async def main():
        dispatcher, _ = make_dispatcher({"http://a": httpx.MockTransport(record)}, retry_window_s=0.1)
        dispatcher.dispatch(GroupRequest(3, task(3), members=2), policy_version=0)
        await asyncio.sleep(0.3)
        await dispatcher.aclose()

    asyncio.run(main())
    assert seen[0]["prompt"] == [CHARS[c] for c in "ab="] and seen[0]["n"] == 2 and seen[0]["max_tokens"] == 8


def test_a_run_encodes_prompts_through_the_fast_backend_like_the_tokenizer_and_once_per_text(tiny_model):
    from rlrun.manifest import load_manifest
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    spec = load_manifest("examples/reverse-text.yaml").spec
    d = Dispatcher.from_spec(tokenizer, [], {}, spec, asyncio.Queue())
    prompts = ["beautiful is better=", "flat=", " two  spaces=", "ünïcode ß=", ""]
    encode = d.episodes.encode
    assert [list(encode(p)) for p in prompts] == [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    assert encode(prompts[0]) is encode(prompts[0])  # cached: the same ids object


class QueuedAcrossPause(httpx.AsyncBaseTransport):
    """vLLM with a request waiting in its queue: ``/pause`` answers at once (nothing is running), and the first
    completion is generated only after the ``/resume``, by the new weights; later ones at once."""

    def __init__(self) -> None:
        self.inner = fake_vllm_transport(error_rate=0.0)
        self.resumed = asyncio.Event()
        self.completions = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/resume":
            self.resumed.set()
        elif request.url.path == "/v1/completions":
            self.completions += 1
            if self.completions == 1:
                await self.resumed.wait()
        elif request.url.path == "/pause":
            return httpx.Response(200, json={})
        return await self.inner.handle_async_request(request)


async def test_a_completion_answered_after_its_servers_pause_is_asked_again_and_does_not_hold_the_update(tmp_path):
    weights = tmp_path / "step_1"
    weights.mkdir()
    save_file({"w": torch.zeros(2)}, str(weights / "model.safetensors"))
    server = QueuedAcrossPause()
    dispatcher, results = make_dispatcher({"http://a": server})
    [client] = dispatcher.pool.clients.values()
    client.drain_s = 0.2  # the update waits this long for the answer, then pauses anyway
    dispatcher.dispatch(GroupRequest(1, task(1), members=4), policy_version=0)
    await asyncio.sleep(0.05)
    t0 = asyncio.get_running_loop().time()
    await asyncio.wait_for(push_weights([client], weights, 1, None), 5)
    assert asyncio.get_running_loop().time() - t0 < 1.0
    [result] = await drain(results, 1)
    # its first answer came after the pause (generated by the new weights): discarded, the request asked again
    assert result.error is None and server.completions == 2 and client.loaded_version == 1
    await dispatcher.aclose()
