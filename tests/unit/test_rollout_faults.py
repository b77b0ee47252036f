"""Rollout faults end bounded: a straggler or a failing request is retried a bounded number of times, then its
group is abandoned and counted, and the run reaches max_steps (issue 9's cases, on the real Orchestrator with
fake rollout endpoints and a fake trainer)."""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import pytest
import torch
from rlrun.ledger import check_ledger, read_ledger
from rlrun.orchestrator import endpoints
from rlrun.orchestrator.loop import Orchestrator
from rlrun.rollout.client import RolloutClient, RolloutError
from rlrun.rollout.fake import fake_vllm_transport
from rlrun.rundir import RunDir
from rlrun.training.fake import start_fake_trainer
from safetensors.torch import save_file

from tests.support.dispatcher import Mute
from tests.support.manifests import parse
from tests.support.orchestrators import make_orchestrator, run_to_the_end
from tests.support.polling import wait_for_async


def spec(**rollout):
    return parse(
        "faults",
        group_size=4,
        batch_size=8,
        max_off_policy_steps=1,
        max_steps=2,
        checkpoint={"interval": 1, "keep_last": 2},
        rollout={"request_timeout_seconds": 1, "retry_window_seconds": 1, **rollout},
    ).spec


class Faults(httpx.AsyncBaseTransport):
    """The fake vLLM server, except that the first ``hang`` completion requests never return and every
    request for the prompt of the first ``fail_first_prompt`` one answers 500."""

    def __init__(self, hang: int = 0, fail_first_prompt: bool = False, unusable: dict[int, dict] | None = None) -> None:
        self.inner = fake_vllm_transport(error_rate=0.3)
        self.hang = hang
        self.fail_first_prompt = fail_first_prompt
        self.failing_prompt = None
        self.completions = 0
        #: completion request number (1, 2, …) → what its last choice becomes (e.g. ``{"finish_reason": "abort"}``)
        self.unusable = unusable or {}
        self.hanging = 0

    async def metrics(self, request: httpx.Request) -> httpx.Response:
        text = (await self.inner.handle_async_request(request)).text  # the fake's own count, plus the stragglers
        running = int(text.split("vllm:num_requests_running", 1)[1].split()[1]) + self.hanging
        return httpx.Response(200, text=f'vllm:num_requests_running{{model_name="policy"}} {running}\n')

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            return await self.metrics(request)
        if request.url.path == "/v1/completions":
            self.completions += 1
            prompt = json.loads(request.content)["prompt"]
            if self.fail_first_prompt and self.failing_prompt is None:
                self.failing_prompt = prompt
            if prompt == self.failing_prompt:
                return httpx.Response(500, text="CUDA error: an illegal memory access was encountered")
            if self.completions <= self.hang:
                self.hanging += 1  # a straggler: the server works on it (its /metrics says so), slowly
                await asyncio.sleep(3600)
            if self.completions in self.unusable:
                answer = await self.inner.handle_async_request(request)
                body = json.loads(answer.content)
                body["choices"][-1].update(self.unusable[self.completions])
                return httpx.Response(200, json=body)
        return await self.inner.handle_async_request(request)


def events(run_dir: RunDir, kind: str) -> list[dict]:
    return [e for evs in read_ledger(run_dir.root / "ledger").values() for e in evs if e["e"] == kind]


async def test_a_straggler_is_timed_out_requested_again_and_the_run_ends_at_max_steps(tmp_path, tiny_model):
    run_dir = RunDir(tmp_path)
    transport = Faults(hang=1)  # the very first request never returns
    assert await run_to_the_end(make_orchestrator(spec(), run_dir, tiny_model, transport)) == 2
    [cancelled] = events(run_dir, "cancelled")
    assert cancelled["reason"] == "failed" and "no answer within 1 s" in cancelled["error"]
    assert events(run_dir, "abandoned") == []
    report = check_ledger(run_dir.root / "ledger")
    assert report.ok and report.steps == 2 and report.trained == 16, report.problems


async def test_a_request_failing_every_retry_has_its_group_abandoned_and_counted(tmp_path, tiny_model):
    run_dir = RunDir(tmp_path)
    transport = Faults(fail_first_prompt=True)  # e.g. a prompt that crashes the server, every time
    orch = make_orchestrator(spec(max_group_retries=2), run_dir, tiny_model, transport)
    assert await run_to_the_end(orch) == 2
    failed = [e for e in events(run_dir, "cancelled") if e["reason"] == "failed"]
    assert len({e["group"] for e in failed}) == 1 and len(failed) == 3  # the first try and 2 retries
    assert [e["first_member"] for e in failed] == [0, 4, 8]  # each retry with new member numbers
    [abandoned] = events(run_dir, "abandoned")
    assert abandoned["group"] == failed[0]["group"] and abandoned["reason"] == "requests_failed"
    assert orch.sink.counters.groups_abandoned == 1
    report = check_ledger(run_dir.root / "ledger")
    assert report.ok and report.steps == 2, report.problems


async def test_aborted_and_empty_completions_are_requested_again_and_never_scored(tmp_path, tiny_model):
    run_dir = RunDir(tmp_path)
    empty = {"token_ids": [], "logprobs": {"token_logprobs": []}, "finish_reason": "stop"}
    transport = Faults(unusable={1: {"finish_reason": "abort"}, 2: empty, 3: {"finish_reason": "repetition"}})
    orch = make_orchestrator(spec(members_per_request=2, max_group_retries=2), run_dir, tiny_model, transport)
    assert await run_to_the_end(orch) == 2
    failed = [e for e in events(run_dir, "cancelled") if e["reason"] == "failed"]
    assert [e["error"].split("unusable completion ")[1] for e in failed] == [
        "(finish_reason 'abort')",
        "(no tokens, finish_reason 'stop')",
        "(finish_reason 'repetition')",
    ]
    # none of the refused requests' members was scored, and each was requested again with new member numbers
    refused = {f"{e['group']}/{m}" for e in failed for m in range(e["first_member"], e["first_member"] + 2)}
    assert not refused & {e["id"] for e in events(run_dir, "finished")}
    assert events(run_dir, "abandoned") == [] and orch.sink.counters.groups_abandoned == 0
    report = check_ledger(run_dir.root / "ledger")
    assert report.ok and report.steps == 2 and report.trained == 16, report.problems


async def test_a_member_hanging_again_after_a_pause_and_resume_is_bounded_too(tmp_path, tiny_model):
    run_dir = RunDir(tmp_path)
    # attempt 1: the first request hangs and the timeout is long: the run wedges at step 1
    first = make_orchestrator(
        spec(request_timeout_seconds=600, retry_window_seconds=600), run_dir, tiny_model, Faults(hang=1)
    )
    stop = start_fake_trainer(run_dir, tiny_model, 2, 1, attempt=1)
    run = asyncio.create_task(first.run())
    try:
        while first.checkpoints.last_step < 1 or first.dispatcher.inflight_samples == 0:
            assert not run.done(), run.exception() if run.done() else None
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)
        assert first.shipped == 1 and first.dispatcher.inflight_samples == 4  # the hung group holds its budget
        paused = await first.pause()
        assert paused.step == 1 and paused.requested_groups == 1
        first.request_stop()
        await asyncio.wait_for(run, 10)
    finally:
        stop.set()
    # attempt 2 resumes; the re-requested members hang again, now past a 1 s timeout
    second = make_orchestrator(spec(), run_dir, tiny_model, Faults(hang=1), attempt=2, resume=True)
    assert await run_to_the_end(second, first_step=1) == 2
    assert second.resume_report.requested_groups == 1 and second.resume_report.members_requested == 4
    assert [e["reason"] for e in events(run_dir, "cancelled")] == ["failed"]
    report = check_ledger(run_dir.root / "ledger")
    assert report.ok and report.steps == 2 and report.rolled_back == 0, report.problems


async def test_no_retries_abandons_a_straggler_group_at_once(tmp_path, tiny_model):
    run_dir = RunDir(tmp_path)
    orch = make_orchestrator(spec(max_group_retries=0), run_dir, tiny_model, Faults(hang=1))
    assert await run_to_the_end(orch) == 2
    [abandoned] = events(run_dir, "abandoned")
    assert abandoned["ids"] == [] and orch.sink.counters.groups_abandoned == 1
    assert check_ledger(run_dir.root / "ledger").ok


async def test_a_pause_after_the_run_is_done_writes_nothing(tmp_path, tiny_model):
    """A pause racing the end of a run (the launcher's or operator's) must not snapshot the leftovers again."""
    run_dir = RunDir(tmp_path)
    orch = make_orchestrator(spec(), run_dir, tiny_model, Faults())
    assert await run_to_the_end(orch) == 2
    final = run_dir.orchestrator_checkpoint(2) / "progress.pt"
    written = final.stat().st_mtime_ns
    paused = await orch.pause()
    assert paused.step is None and paused.run_complete and paused.note == "the run is complete: nothing to save"
    assert orch.phase == "done" and final.stat().st_mtime_ns == written
    assert len(events(run_dir, "leftover")) <= 1 and check_ledger(run_dir.root / "ledger").ok


async def test_a_removed_endpoints_requests_are_requested_again_at_once_and_not_counted_as_retries(
    tmp_path, tiny_model
):
    run_dir = RunDir(tmp_path)
    transports = {"http://lost:1": Faults(hang=10**6), "http://up:1": Faults()}  # "lost" never answers
    orch = make_orchestrator(
        spec(request_timeout_seconds=600, retry_window_seconds=600, max_group_retries=0),
        run_dir,
        tiny_model,
        transports,
        urls=["http://lost:1"],
    )
    stop = start_fake_trainer(run_dir, tiny_model, orch.max_steps, 1, attempt=1)
    run = asyncio.create_task(orch.run())
    try:
        while orch.dispatcher is None or orch.dispatcher.inflight_samples == 0:
            assert not run.done(), run.exception() if run.done() else None
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        t0 = asyncio.get_running_loop().time()
        await orch.set_endpoints(["http://up:1"])  # the operator: the node of "lost" is gone
        assert await asyncio.wait_for(run, 10) == 2
        assert asyncio.get_running_loop().time() - t0 < 5
    finally:
        stop.set()
    cancelled = events(run_dir, "cancelled")
    assert cancelled and {e["reason"] for e in cancelled} == {"lost"}
    assert events(run_dir, "abandoned") == []  # max_group_retries 0, yet every group went on
    report = check_ledger(run_dir.root / "ledger")
    assert report.ok and report.steps == 2 and report.trained == 16, report.problems


class Vanishing(httpx.AsyncBaseTransport):
    """The fake vLLM server, until its node goes away during its first weight update after it served
    completions (``/pause``): from then on, while ``gone``, every request fails with a transport error,
    as a closed connection does."""

    def __init__(self) -> None:
        self.inner = fake_vllm_transport(error_rate=0.3)
        self.gone = False
        self.log: list[str] = []  # the paths it served, in order

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/pause" and "/v1/completions" in self.log and "vanished" not in self.log:
            self.gone = True
            self.log.append("vanished")
        if self.gone:
            raise httpx.ReadError("connection closed by peer", request=request)
        self.log.append(request.url.path)
        return await self.inner.handle_async_request(request)


def two_servers(run_dir: RunDir, model, transports: dict, max_steps: int = 2) -> Orchestrator:
    run_spec = spec(request_timeout_seconds=600, retry_window_seconds=600, max_group_retries=0)
    return make_orchestrator(run_spec, run_dir, model, transports, max_steps=max_steps)


async def test_a_server_lost_during_a_weight_update_is_benched_and_the_run_goes_on(tmp_path, tiny_model):
    run_dir = RunDir(tmp_path)
    lost = Vanishing()
    transports = {"http://lost:1": lost, "http://up:1": Faults()}
    orch = two_servers(run_dir, tiny_model, transports)
    assert await run_to_the_end(orch) == 2  # no ReadError out of the weight follower
    assert "vanished" in lost.log
    assert orch.policy_version >= 1  # the update went on for the server that stayed
    assert orch.dispatcher.pool.benched.keys() == {"http://lost:1"}
    assert "http://lost:1" not in orch.dispatcher.pool.clients
    report = check_ledger(run_dir.root / "ledger")
    assert report.ok and report.steps == 2 and report.trained == 16, report.problems


async def test_a_benched_server_that_answers_again_gets_the_current_weights_before_any_request(
    tmp_path, tiny_model, monkeypatch
):
    monkeypatch.setattr(endpoints, "REJOIN_EVERY_S", 0.05)  # the run is over in about a second
    run_dir = RunDir(tmp_path)
    back = Vanishing()
    transports = {"http://back:1": back, "http://up:1": Faults()}
    orch = two_servers(run_dir, tiny_model, transports, max_steps=4)
    # The trainer stops at step 2 until the server has rejoined: with instant rollouts and trainer, steps 2-4
    # could otherwise all be done before the first rejoin try after it answers again (seen once in CI).
    stop = start_fake_trainer(run_dir, tiny_model, 2, 1, attempt=1)
    run = asyncio.create_task(orch.run())
    try:
        while orch.dispatcher is None or "http://back:1" not in orch.dispatcher.pool.benched:
            assert not run.done(), run.exception() if run.done() else None
            await asyncio.sleep(0.01)
        benched_at = orch.policy_version
        back.gone = False  # the server answers again
        await wait_for_async(lambda: "http://back:1" in orch.dispatcher.pool.clients, 10, "the rejoin")
        await wait_for_async((run_dir.trainer_checkpoint(2) / "progress.json").is_file, 10, "trainer step 2")
        stop.set()
        stop = start_fake_trainer(run_dir, tiny_model, orch.max_steps, 1, attempt=1, first_step=2)
        assert await asyncio.wait_for(run, 30) == 4
    finally:
        stop.set()
    assert "http://back:1" in orch.dispatcher.pool.clients and not orch.dispatcher.pool.benched
    after = back.log[back.log.index("vanished") + 1 :]
    # The rejoin: health, then a whole weight update to the version current then, verified (the second RPC:
    # the served weights' digest); only then completions.
    update = ["/health", "/pause", "/collective_rpc", "/reset_prefix_cache", "/collective_rpc"]
    update += ["/update_weight_version", "/resume"]
    assert after[: len(update)] == update, after
    assert "/v1/completions" not in after[: len(update)]
    assert orch.policy_version >= benched_at
    report = check_ledger(run_dir.root / "ledger")
    assert report.ok and report.steps == 4, report.problems


async def test_a_server_answering_an_error_to_a_weight_update_still_fails_the_attempt(tmp_path, tiny_model):
    class RefusesReload(Faults):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            if request.url.path == "/collective_rpc":
                return httpx.Response(200, json={"results": [{"ok": False, "error": "shape mismatch"}]})
            return await super().handle_async_request(request)

    run_dir = RunDir(tmp_path)
    orch = two_servers(run_dir, tiny_model, {"http://bad:1": RefusesReload(), "http://up:1": Faults()})
    with pytest.raises(RolloutError, match=r"reload of .* failed"):
        await run_to_the_end(orch)


class Versioned(httpx.AsyncBaseTransport):
    """The fake vLLM server with vLLM's weight-update semantics: ``/pause`` holds new completions until
    ``/resume``; a reload takes ``reload_s`` and then the server holds the step in the reloaded path. Each
    completion's logprobs say which version generated it (``-(version + 1) / 100`` per token), and
    overlapping updates (a ``/pause`` while paused) are counted."""

    def __init__(self, reload_s: float) -> None:
        self.inner = fake_vllm_transport(error_rate=0.3)
        self.reload_s = reload_s
        self.held = 0
        self.paused = False
        self.resumed = asyncio.Event()
        self.resumed.set()
        self.overlaps = 0
        self.reloading: list[asyncio.Event] = []  # set when a reload of step_N starts, N = index
        self.served = 0

    def reload_started(self, step: int) -> asyncio.Event:
        while len(self.reloading) <= step:
            self.reloading.append(asyncio.Event())
        return self.reloading[step]

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/pause":
            self.overlaps += self.paused
            self.paused = True
            self.resumed.clear()
        elif path == "/resume":
            self.paused = False
            self.resumed.set()
        elif path == "/collective_rpc" and json.loads(request.content)["method"] == "rlrun_reload_weights":
            [weights] = json.loads(request.content)["args"]  # (the digest that verifies it: the inner fake's)
            step = int(re.search(r"step_(\d+)", weights).group(1)) if "step_" in weights else 0
            self.reload_started(step).set()
            await asyncio.sleep(self.reload_s)
            self.held = step
        elif path == "/v1/completions":
            await self.resumed.wait()  # vLLM holds requests that arrive while paused
            answer = json.loads((await self.inner.handle_async_request(request)).content)
            for c in answer["choices"]:
                c["logprobs"]["token_logprobs"] = [-(self.held + 1) / 100] * len(c["token_ids"])
            self.served += 1
            return httpx.Response(200, json=answer)
        return await self.inner.handle_async_request(request)


async def test_a_server_added_during_a_weight_update_never_serves_a_version_it_does_not_hold(tmp_path, tiny_model):
    run_dir = RunDir(tmp_path)
    old, new = Versioned(reload_s=0.5), Versioned(reload_s=0.2)
    transports = {"http://old:1": old, "http://new:1": new}
    orch = make_orchestrator(
        spec(members_per_request=2), run_dir, tiny_model, transports, urls=["http://old:1"], max_steps=4
    )
    labelled: list[tuple[int, int, str]] = []  # (label, version that generated it, episode id) of every episode
    add = orch.sink.add_episodes

    def add_episodes(group_id, task, episodes, next_step):
        labelled.extend((e.policy_version, round(-e.logprobs[0] * 100) - 1, e.episode_id) for e in episodes)
        return add(group_id, task, episodes, next_step)

    orch.sink.add_episodes = add_episodes
    stop = start_fake_trainer(run_dir, tiny_model, 1, 1, attempt=1)  # step 1 only, for now
    run = asyncio.create_task(orch.run())
    try:
        await asyncio.wait_for(old.reload_started(1).wait(), 30)  # the update to policy 1 is under way…
        await orch.set_endpoints(["http://old:1", "http://new:1"])  # …when a server joins (caught up to 0)
        await wait_for_async(lambda: orch.policy_version == 1, 10, "policy 1")
        # at policy 1 it ships what it may (v + 1 + max_off_policy_steps = 3 batches), old and new serving
        await wait_for_async(lambda: orch.shipped == 3, 10, "step 3 shipped")
        await wait_for_async((run_dir.trainer_checkpoint(1) / "progress.json").is_file, 10, "trainer step 1")
        stop.set()
        stop = start_fake_trainer(run_dir, tiny_model, orch.max_steps, 1, attempt=1, first_step=1)
        assert await asyncio.wait_for(run, 60) == 4
    finally:
        stop.set()
    newer = [(label, made, ep) for label, made, ep in labelled if label > made]
    assert newer == [], "episodes labelled with a newer policy than the weights that generated them"
    assert new.served > 0 and old.overlaps == 0 and new.overlaps == 0
    assert orch.dispatcher.pool.clients["http://new:1"].loaded_version == new.held == orch.policy_version
    report = check_ledger(run_dir.root / "ledger")
    assert report.ok and report.steps == 4, report.problems


async def test_weight_updates_of_one_server_never_overlap_nor_go_back(tmp_path):
    for n in (1, 2, 3):  # each its own weights: the fake's digest of what it holds verifies each reload
        (tmp_path / f"step_{n}").mkdir()
        save_file({"w": torch.full((2,), float(n))}, str(tmp_path / f"step_{n}" / "model.safetensors"))
    server = Versioned(reload_s=0.2)
    client = RolloutClient("http://slow:1", transport=server)
    step = lambda n: str(tmp_path / f"step_{n}")  # noqa: E731
    # a catch-up to policy 1 and the update to policy 2 reach the same server at once
    ran = await asyncio.gather(client.update_weights(step(1), 1), client.update_weights(step(2), 2))
    assert ran == [True, True] and server.overlaps == 0 and not server.paused
    assert client.loaded_version == server.held == 2
    late = await asyncio.gather(client.update_weights(step(3), 3), client.update_weights(step(1), 1))
    assert late == [True, False] and server.overlaps == 0  # the late catch-up to 1 does not take it back
    assert client.loaded_version == server.held == 3
    await client.aclose()


async def test_requests_a_server_lost_are_asked_again_within_seconds_not_at_the_timeout(
    tmp_path, tiny_model, quick_guard
):
    run_dir = RunDir(tmp_path)
    mute = Mute(running=0)
    orch = two_servers(run_dir, tiny_model, {"http://mute:1": mute, "http://up:1": Faults()})  # timeout 600 s
    t0 = time.monotonic()
    assert await run_to_the_end(orch) == 2
    assert time.monotonic() - t0 < 20  # not the 600 s request timeout
    lost = [e for e in events(run_dir, "cancelled") if e["reason"] == "lost"]
    assert mute.taken >= 1 and len(lost) == orch.liveness.lost_requests >= 1
    assert all(e["error"].startswith("rollout endpoint http://mute:1 reported no request running") for e in lost)
    assert [e for e in events(run_dir, "cancelled") if e["reason"] != "lost"] == []  # not counted as retries
    report = check_ledger(run_dir.root / "ledger")
    assert report.ok and report.steps == 2 and report.trained == 16, report.problems
