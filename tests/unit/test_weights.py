"""Weights checked before they reach vLLM (``rlrun.orchestrator.weights.validate_weights_dir``): names and shapes
must be the model's; a floating-point tensor may come in another floating-point dtype (the trainer publishes bf16 when
it computes in bf16), nothing else may. A LoRA run's adapters (``validate_adapter_dir``): the config says what
``spec.model.lora`` says, the tensors are exactly peft's for the model's targeted weights."""

from __future__ import annotations

import pytest
import torch
from rlrun.adapter_format import adapter_signature
from rlrun.api.spec import LoraSpec
from rlrun.errors import WeightsError, WeightsMismatch
from rlrun.orchestrator.weights import (
    AdapterReference,
    validate,
    validate_adapter_dir,
    validate_weights_dir,
    weights_reference,
    weights_signature,
)
from safetensors.torch import save_file

from tests.support.adapters import BASE, LORA, write_adapter
from tests.support.manifests import parse


def _dir(path, **tensors):
    path.mkdir()
    save_file(tensors, str(path / "model.safetensors"))
    return path


@pytest.fixture
def reference(tmp_path):
    return weights_signature(_dir(tmp_path / "ref", w=torch.zeros(4, 3), ids=torch.zeros(2, dtype=torch.int64)))


def test_a_floating_tensor_may_come_in_another_floating_dtype(tmp_path, reference):
    bf16 = _dir(tmp_path / "bf16", w=torch.zeros(4, 3, dtype=torch.bfloat16), ids=torch.zeros(2, dtype=torch.int64))
    assert validate_weights_dir(bf16, reference)["w"] == ("BF16", (4, 3))


@pytest.mark.parametrize(
    ("tensors", "problem"),
    [
        ({"w": torch.zeros(4, 2), "ids": torch.zeros(2, dtype=torch.int64)}, r"w: \('F32', \(4, 2\)\)"),
        ({"w": torch.zeros(4, 3, dtype=torch.int32), "ids": torch.zeros(2, dtype=torch.int64)}, r"w: \('I32'"),
        ({"w": torch.zeros(4, 3), "ids": torch.zeros(2)}, r"ids: \('F32'"),
        ({"w": torch.zeros(4, 3)}, "missing ids"),
        ({"w": torch.zeros(4, 3), "ids": torch.zeros(2, dtype=torch.int64), "x": torch.zeros(1)}, "unexpected x"),
    ],
)
def test_names_shapes_and_the_kind_of_dtype_must_match(tmp_path, reference, tensors, problem):
    with pytest.raises(WeightsMismatch, match=problem):
        validate_weights_dir(_dir(tmp_path / "bad", **tensors), reference)


# -- a LoRA run's adapters (issue 40) -----------------------------------------------------------------------


@pytest.fixture
def adapter_ref():
    return AdapterReference(LORA, adapter_signature(BASE, LORA))


def test_peft_writes_exactly_the_adapter_the_reference_expects_of_the_model(tiny_model, tmp_path):
    """The names and shapes come from peft itself (``save_pretrained`` of the tiny model wrapped by the spec's
    default targets), so a peft upgrade that renames them fails here, not in a run."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    lora = LoraSpec(rank=4, alpha=8.0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=list(lora.target_modules))
    get_peft_model(model, config).save_pretrained(tmp_path / "adapter")
    spec = parse(model={"builtin": "tiny-reverse", "lora": lora.model_dump()}).spec
    reference = weights_reference(spec, tiny_model)
    assert isinstance(reference, AdapterReference) and reference.lora == lora
    sig = validate_adapter_dir(tmp_path / "adapter", reference)
    layers = AutoModelForCausalLM.from_pretrained(tiny_model).config.num_hidden_layers
    assert len(sig) == 2 * 7 * layers  # lora_A and lora_B of 7 projections in every layer
    q = "base_model.model.model.layers.0.self_attn.q_proj"
    hidden = weights_signature(tiny_model)["model.layers.0.self_attn.q_proj.weight"][1]
    assert sig[f"{q}.lora_A.weight"][1] == (4, hidden[1]) and sig[f"{q}.lora_B.weight"][1] == (hidden[0], 4)
    assert weights_reference(parse().spec, tiny_model) == weights_signature(tiny_model)  # full weights: as before


def test_an_adapter_of_the_spec_and_the_model_passes_and_an_embedding_adapter_has_peft_s_embedding_names(
    tmp_path, adapter_ref
):
    assert validate(write_adapter(tmp_path / "ok"), adapter_ref).keys() == {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight",
        "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight",
        "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight",
    }
    lora = LoraSpec(rank=2, alpha=4.0, target_modules=["embed_tokens"])  # W [10, 4]: A [r, 10], B [4, r]
    emb = {"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(2, 10)}
    emb["base_model.model.model.embed_tokens.lora_embedding_B"] = torch.zeros(4, 2)
    reference = AdapterReference(lora, adapter_signature(BASE, lora))
    assert len(validate_adapter_dir(write_adapter(tmp_path / "emb", lora, tensors=emb), reference)) == 2


A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
D_A = "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"
D_B = "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"
GOOD = {A: (2, 4), B: (8, 2), D_A: (2, 16), D_B: (4, 2)}


@pytest.mark.parametrize(
    ("config", "tensors", "problem"),
    [
        # each way a config differs from the spec: tests/unit/test_adapter_format.py (config_problems)
        ({"r": 4}, None, r"adapter does not match spec\.model\.lora: r is 4, the spec says 2"),
        ({"use_dora": True, "bias": "all"}, None, r"lora: use_dora is True: plain LoRA expected; bias is 'all'"),
        ({}, {**GOOD, B: (8, 4)}, r"q_proj\.lora_B\.weight: \('F32', \(8, 4\)\) != \(8, 2\)"),  # a rank-4 B
        ({}, {A: (2, 4), B: (8, 2), D_A: (2, 16)}, "missing .*down_proj.lora_B.weight"),
        ({}, {**GOOD, "base_model.model.lm_head.lora_A.weight": (2, 4)}, "unexpected base_model.model.lm_head"),
        ({}, {k.replace("base_model.model.", ""): s for k, s in GOOD.items()}, "missing base_model.model.model"),
    ],
)
def test_an_adapter_that_is_not_the_spec_s_or_does_not_fit_the_model_is_refused(
    tmp_path, adapter_ref, config, tensors, problem
):
    made = None if tensors is None else {name: torch.zeros(shape) for name, shape in tensors.items()}
    with pytest.raises(WeightsMismatch, match=problem):
        validate_adapter_dir(write_adapter(tmp_path / "bad", tensors=made, **config), adapter_ref)


def test_an_adapter_with_integer_tensors_or_unreadable_files_is_refused(tmp_path, adapter_ref):
    ints = {name: torch.zeros(shape, dtype=torch.int32) for name, shape in GOOD.items()}
    with pytest.raises(WeightsMismatch, match=r"\('I32'"):
        validate_adapter_dir(write_adapter(tmp_path / "ints", tensors=ints), adapter_ref)
    torn = write_adapter(tmp_path / "torn")
    (torn / "adapter_model.safetensors").write_bytes(b"\x00" * 7)
    with pytest.raises(WeightsError, match="unreadable safetensors"):
        validate_adapter_dir(torn, adapter_ref)
    (torn / "adapter_config.json").write_text("{")
    with pytest.raises(WeightsError, match="unreadable adapter config"):
        validate_adapter_dir(torn, adapter_ref)
    full = _dir(tmp_path / "full", w=torch.zeros(4, 3))  # a full-weights directory where an adapter is due
    with pytest.raises(WeightsError, match=r"adapter_config\.json: unreadable"):
        validate(full, adapter_ref)


def test_without_the_model_s_files_only_the_config_and_the_tensors_parse_are_checked(tmp_path):
    spec = parse(model={"name": "org/model", "lora": LORA.model_dump()}).spec
    reference = weights_reference(spec, "org/model")  # a hub id: no directory here
    assert reference == AdapterReference(LORA, None)
    assert len(validate(write_adapter(tmp_path / "ok"), reference)) == 4
    with pytest.raises(WeightsMismatch, match="r is 8"):
        validate(write_adapter(tmp_path / "r8", r=8), reference)
