"""What a rollout server serves is verified after every update (issue 47, item 2; ARCHITECTURE.md invariant
8): the digest of what it holds against the published files', layout-free (:mod:`rlrun.weights_digest`); a
reload that changed nothing is caught at the first update and the server gets no request until verified, then
is refused; the trainer–sampler mismatch of every version is measured on its probe, warns, then stops the run.
Against the fake vLLM (:mod:`rlrun.rollout.fake`), which holds the directory it reloaded last, or keeps its
weights (``noop_reload``)."""

from __future__ import annotations

import json
import logging

import httpx
import pytest
import torch
from rlrun.api.spec import SamplingSpec
from rlrun.orchestrator.endpoints import EndpointMembership
from rlrun.orchestrator.follower import WeightFollower
from rlrun.orchestrator.served import MAX_UNVERIFIED, MismatchGuard, SamplerMismatch, ServedWeightsUnverified
from rlrun.orchestrator.weights import push_weights
from rlrun.probes import ProbeSequence, write_probe
from rlrun.rollout.client import RolloutClient, WeightsUnverified
from rlrun.rollout.fake import fake_vllm_transport
from rlrun.rollout.verification import UNVERIFIED
from rlrun.rundir import RunDir, publish_broadcast, write_meta
from rlrun.weights_digest import Digest, files_digest, tensor_digest
from safetensors.torch import save_file

from tests.support.dispatcher import make_dispatcher

WEIGHTS = {"q": (8, 4), "k": (4, 4), "v": (4, 4), "norm": (4,)}


def write_weights(directory, seed: int, dtype=torch.float32):
    """A weights directory of :data:`WEIGHTS`, its values drawn from ``seed``."""
    directory.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {name: torch.randn(shape, generator=gen).to(dtype) for name, shape in WEIGHTS.items()}
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


def publish(run_dir: RunDir, version: int, seed: int, probe: list[ProbeSequence] | None = None):
    """``broadcasts/step_<version>/``: weights of ``seed`` and, given one, the version's probe."""

    def fill(tmp):
        write_weights(tmp, seed)
        if probe is not None:
            write_probe(tmp, probe, version)
        write_meta(tmp, version, 1)

    return publish_broadcast(run_dir.broadcast(version), fill, 1)[0]


def test_the_digest_of_weights_is_the_same_whatever_vllm_s_layout_and_changes_with_any_value():
    """vLLM fuses q, k and v into one parameter, shards it over ranks and widens bf16 to float32 on a CPU: the
    digest of the values is the files', and a value changed (a stale or partial load) changes it."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, generator=gen).to(torch.bfloat16) for s in ((8, 4), (4, 4), (4, 4)))
    files = tensor_digest(q) + tensor_digest(k) + tensor_digest(v)
    fused = torch.cat([q, k, v]).float()  # qkv_proj, served in float32
    shards = tensor_digest(fused[:8]) + tensor_digest(fused[8:])  # two tensor-parallel ranks' shares
    assert tensor_digest(fused) == files == shards
    assert files.elements == 64
    touched = fused.clone()
    touched[3, 1] += 1e-3
    assert tensor_digest(touched) != files
    assert Digest.from_json(files.to_json()) == files


def test_the_digest_of_files_read_from_their_bytes_is_the_tensors_as_the_server_holds_them(tmp_path):
    """float32 and bf16 tensors are summed from the file's bytes (a bf16 pattern shifted), −0.0 as +0.0 (a
    matrix product may give a zero either sign); a cast that rounds (float32 served bf16) goes through
    torch."""
    x = torch.randn(100, 7).to(torch.bfloat16)
    y = torch.randn(33)
    x[0, 0], y[3] = -0.0, -0.0
    save_file({"x": x, "y": y}, str(tmp_path / "model.safetensors"))
    x[0, 0], y[3] = 0.0, 0.0
    assert files_digest(tmp_path, torch.float32) == tensor_digest(x.float()) + tensor_digest(y)
    assert files_digest(tmp_path, None) == tensor_digest(x) + tensor_digest(y)
    assert files_digest(tmp_path, torch.bfloat16) == tensor_digest(x) + tensor_digest(y.to(torch.bfloat16))


async def test_a_reload_that_changes_nothing_is_caught_at_the_first_update_and_gets_no_request(tmp_path):
    """Issue 47: a worker extension whose reload answered ok and loaded nothing went unnoticed for a whole
    run."""
    start, new = write_weights(tmp_path / "v0", seed=0), write_weights(tmp_path / "v1", seed=1)
    noop = fake_vllm_transport(noop_reload=True, weights=str(start))
    healthy = fake_vllm_transport(weights=str(start))
    clients = [RolloutClient("http://noop", transport=noop), RolloutClient("http://ok", transport=healthy)]
    try:
        push = await push_weights(clients, new, 1, None)
        assert push.verified == ["http://ok"] and list(push.unverified) == ["http://noop"]
        why = push.unverified["http://noop"]
        assert f"after loading {new} it serves other weights" in why and "the files:" in why
        assert [c.loaded_version for c in clients] == [UNVERIFIED, 1]
        with pytest.raises(WeightsUnverified, match="not verified; nothing was sent"):
            await clients[0].complete([5, 6, 1], SamplingSpec())
        assert noop.counts.served == [] and noop.counts.version == "0"  # nor was the version set
        await clients[1].complete([5, 6, 1], SamplingSpec())
    finally:
        for c in clients:
            await c.aclose()
    assert files_digest(new, torch.float32) != files_digest(start, torch.float32)


async def test_a_server_that_keeps_failing_verification_is_refused_and_the_run_goes_on_with_the_others(
    tmp_path, caplog
):
    """The server not verified is asked again at each periodic look (a one-off failure heals) and refused at
    the :data:`MAX_UNVERIFIED`-th failure in a row; left with none, the run stops in one line."""
    run_dir = RunDir(tmp_path / "run")
    start = write_weights(tmp_path / "v0", seed=0)
    servers = {
        "http://noop": fake_vllm_transport(noop_reload=True, weights=str(start)),
        "http://ok": fake_vllm_transport(weights=str(start)),
    }
    dispatcher, _ = make_dispatcher(servers)
    follower = WeightFollower(run_dir, 1, None)
    members = EndpointMembership()
    members.bind(dispatcher.pool, dispatcher.lose_on, follower, lambda lost: None, lambda: None)
    publish(run_dir, 1, seed=1)
    with caplog.at_level(logging.WARNING):
        push = await follower.follow(list(dispatcher.pool.clients.values()))
        assert list(push.unverified) == ["http://noop"]  # caught at the first update
        for _ in range(MAX_UNVERIFIED - 1):
            await members.catch_up_lagging()
    assert "http://noop" in dispatcher.pool.refused and list(dispatcher.pool.clients) == ["http://ok"]
    assert servers["http://noop"].counts.reloads == MAX_UNVERIFIED
    assert "policy 1 not verified (1 in a row)" in caplog.text and "served other weights" in caplog.text
    assert dispatcher.pool.clients["http://ok"].loaded_version == 1
    await dispatcher.aclose()
    # a run whose every server fails: it stops, naming them
    alone, _ = make_dispatcher({"http://noop": fake_vllm_transport(noop_reload=True, weights=str(start))})
    follower = WeightFollower(run_dir, 1, None)
    members.bind(alone.pool, alone.lose_on, follower, lambda lost: None, lambda: None)
    await follower.follow(list(alone.pool.clients.values()))
    with pytest.raises(ServedWeightsUnverified, match="no rollout server left to use: http://noop served"):
        for _ in range(MAX_UNVERIFIED - 1):
            await members.catch_up_lagging()
    # at every look from then on (a refusal inside a PUT /rollout-endpoints fails that request only)
    with pytest.raises(ServedWeightsUnverified):
        await members.look()
    await alone.aclose()


class Skewed(httpx.AsyncBaseTransport):
    """The fake vLLM whose prompt logprobs are off by ``skew`` nats (a server computing another function of
    the same weights: another dtype, other model code)."""

    def __init__(self, skew: float, **kwargs) -> None:
        self.inner = fake_vllm_transport(**kwargs)
        self.skew = skew

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        if request.url.path != "/v1/completions" or "prompt_logprobs" not in json.loads(request.content):
            return response
        body = json.loads(await response.aread())
        for row in body["choices"][0]["prompt_logprobs"][1:]:
            for entry in row.values():
                entry["logprob"] += self.skew
        return httpx.Response(200, json=body)


async def test_the_mismatch_of_each_version_is_measured_on_its_probe_warns_then_stops(tmp_path, caplog):
    """The signal exists at every version, whatever the staleness of the batches (the trainer's on-policy
    mismatch is None whenever ``max_off_policy_steps`` ≥ 1): 0 on a server that holds the trainer's weights,
    the k3 KL of the skew on one that does not compute the same; above ``max_mismatch_kl`` one version warns,
    three stop the run."""
    probe = [ProbeSequence([3, 4, 9, 5, 6, 0], [None, None, None, -0.7, -1.2, -0.1])]
    run_dir = RunDir(tmp_path / "run")
    start = write_weights(tmp_path / "v0", seed=0)
    healthy = WeightFollower(run_dir, 1, None, max_mismatch_kl=0.05)
    ok = RolloutClient("http://ok", transport=fake_vllm_transport(weights=str(start)))
    skewed = RolloutClient("http://skewed", transport=Skewed(0.5, weights=str(start)))
    publish(run_dir, 1, seed=1, probe=probe)
    await healthy.follow([ok])
    assert healthy.mismatch.last == 0.0
    follower = WeightFollower(run_dir, 1, None, max_mismatch_kl=0.05)
    k3 = 2.718281828459045**-0.5 - 1 + 0.5  # d = trainer − served = −0.5 at each of the 3 sampled tokens
    with caplog.at_level(logging.WARNING, logger="rlrun.orchestrator.served"):
        await follower.follow([ok, skewed])
        assert follower.mismatch.last == pytest.approx(k3) and follower.mismatch.above == 1
        warned = "mismatch of policy 1 is 0.107 nats/token on http://skewed, above spec.rollout"
        assert f"{warned}.max_mismatch_kl 0.05 (1 version(s) in a row)" in caplog.text
        publish(run_dir, 2, seed=2, probe=probe)
        await follower.follow([ok, skewed])
        publish(run_dir, 3, seed=3, probe=probe)
        with pytest.raises(SamplerMismatch, match=r"policy 3 is 0.107 nats/token .* \(3 version\(s\) in a"):
            await follower.follow([ok, skewed])
    for c in (ok, skewed):
        await c.aclose()


def test_the_mismatch_guard_counts_versions_in_a_row_and_none_never_stops():
    guard = MismatchGuard(0.05)
    for version, value in enumerate((0.1, 0.2, 0.01, 0.1, 0.1), start=1):  # one under the threshold: from 0
        guard.observe(version, {"a": value})
    assert guard.above == 2
    guard.observe(5, {"b": 0.12})  # a server caught up to version 5 later: the same version, not another one
    assert guard.above == 2 and guard.last == 0.12
    with pytest.raises(SamplerMismatch):
        guard.observe(6, {"a": 0.01, "b": 0.3})
    never = MismatchGuard(None)
    for _ in range(5):
        never.observe(1, {"a": 9.0})
    assert never.last == 9.0 and never.above == 0


async def test_the_mismatch_probe_skips_a_server_it_would_kill_and_asks_once():
    from rlrun.orchestrator.served import served_mismatch
    from rlrun.probes import ProbeSequence

    asked: list[str] = []

    def server(lora: bool):
        def handler(request: httpx.Request) -> httpx.Response:
            asked.append(f"{request.url.host}{request.url.path}")
            if request.url.path == "/server_info":
                config = {"lora_config": {"max_lora_rank": 8} if lora else None, "device_config": {"device": "cpu"}}
                return httpx.Response(200, json={"vllm_config": config})
            prompt = json.loads(request.content)["prompt"]
            rows = [None] + [{str(t): {"logprob": -1.0}} for t in prompt[1:]]
            return httpx.Response(200, json={"choices": [{"prompt_logprobs": rows}]})

        return httpx.MockTransport(handler)

    clients = [
        RolloutClient("http://lora:8000", transport=server(True)),
        RolloutClient("http://full:8000", transport=server(False)),
    ]
    probe = [ProbeSequence(ids=[5, 6, 7], logprobs=[None, -1.0, -1.0])]
    unsafe: dict[str, bool] = {}
    assert await served_mismatch(clients, probe, unsafe) == {"http://full:8000": pytest.approx(0.0)}
    assert await served_mismatch(clients, probe, unsafe) == {"http://full:8000": pytest.approx(0.0)}
    assert unsafe == {"http://lora:8000": True, "http://full:8000": False}
    assert asked.count("lora/server_info") == 1 and "lora/v1/completions" not in asked
    for client in clients:
        await client.aclose()
