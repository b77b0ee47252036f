"""LoRA on the trainer (``rlrun.training.lora``): the wrap freezes the base and refuses target modules the model
lacks before wrapping anything; the adapter's state is peft's saved layout, loadable by ``PeftModel.from_pretrained``
with the same logits; the optimizer holds the adapter alone; the adapter disabled is the base model (the KL term's
reference); and the run identity refuses a LoRA checkpoint resumed without LoRA, the reverse, and a changed setting
or base model, by field."""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel
from rlrun.adapter_format import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE
from rlrun.api.spec import LoraSpec
from rlrun.errors import CheckpointMismatch, WeightsMismatch
from rlrun.identity import check_compatible, run_identity
from rlrun.manifest import ManifestError
from rlrun.training.distributed import single_process
from rlrun.training.lora import AdapterOff, adapter_state, load_adapter, save_adapter, wrap
from rlrun.training.schedule import new_optimizer
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

from tests.support.manifests import parse

IDS = torch.tensor([[3, 17, 42, 8, 61, 5]])


def _base(seed: int = 0) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
    )
    return Qwen3ForCausalLM(config)


def _moved(adapter) -> None:
    """Give every ``lora_B`` a value (it starts at zero: the adapter then computes nothing)."""
    with torch.no_grad():
        for name, p in adapter.model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn_like(p))


def test_the_wrap_freezes_the_base_and_the_optimizer_holds_the_adapter_alone():
    model = _base()
    base = {k: v.clone() for k, v in model.state_dict().items()}
    adapter = wrap(model, LoraSpec(rank=4, alpha=8, target_modules=["q_proj", "v_proj"]))
    assert adapter.model is model  # the trainer keeps calling its own model
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert len(trainable) == 2 * 2 * 2  # 2 layers × (q_proj, v_proj) × (A, B)
    assert all(".lora_A.default." in n or ".lora_B.default." in n for n in trainable)
    optimizer = new_optimizer(model, parse("lora").spec)
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    assert held == {id(p) for n, p in model.named_parameters() if n in trainable}
    # per layer: q_proj A [4, 32], B [32, 4]; v_proj A [4, 32], B [16, 4] (one key-value head of 16)
    assert sum(p.numel() for g in optimizer.param_groups for p in g["params"]) == 2 * (
        4 * 32 + 32 * 4 + 4 * 32 + 16 * 4
    )
    # a step moves the adapter alone: the base weights (now under .base_layer) are bit for bit the same
    model.train()
    model(input_ids=IDS, labels=IDS).loss.backward()
    optimizer.step()
    after = {k.replace(".base_layer", ""): v for k, v in model.state_dict().items() if "lora_" not in k}
    assert after.keys() == base.keys() and all(torch.equal(after[k], base[k]) for k in base)
    assert all(optimizer.state[p]["step"] == 1 for g in optimizer.param_groups for p in g["params"])


def test_activation_checkpointing_non_reentrant_reaches_the_adapter_behind_frozen_embeddings():
    """The trainer enables activation checkpointing (``use_reentrant: False``) before the wrap: the adapter's
    gradients inside checkpointed blocks are those without checkpointing, though no block input requires a gradient
    (the embeddings are frozen)."""
    grads = []
    for checkpointing in (False, True):
        model = _base()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        torch.manual_seed(1)
        adapter = wrap(model, LoraSpec(rank=4))
        _moved(adapter)
        model.train()
        model(input_ids=IDS, labels=IDS).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    assert model.is_gradient_checkpointing
    assert all(g is not None and g.abs().max() > 0 for g in grads[1].values())
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, msg=name)


def test_a_target_module_the_model_lacks_is_refused_by_field_with_the_nearest_name_before_wrapping():
    model = _base()
    with pytest.raises(ManifestError) as info:
        wrap(model, LoraSpec(target_modules=["q_proj", "q_prj", "mlp", "lm_head", "embed_tokens"]))
    lines = str(info.value).splitlines()[1:]
    wrappable = "its layers LoRA can wrap: down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj"
    assert lines == [
        f"  spec.model.lora.target_modules[1]: 'q_prj' names no module of Qwen3ForCausalLM; did you mean 'q_proj'? "
        f"{wrappable}",
        "  spec.model.lora.target_modules[2]: 'mlp' names Qwen3MLP modules, which the trainer does not wrap (LoRA goes "
        f"on the linear layers of the transformer blocks); {wrappable}",
        "  spec.model.lora.target_modules[3]: 'lm_head' names the LM head, which the trainer does not wrap (it "
        f"computes logprobs from the head's weight in chunks); {wrappable}",
        "  spec.model.lora.target_modules[4]: 'embed_tokens' names Embedding modules, which the trainer does not wrap "
        f"(LoRA goes on the linear layers of the transformer blocks); {wrappable}",
    ]
    text = str(info.value)
    assert "target_modules[0]" not in text
    assert not any("lora_" in n for n, _ in model.named_parameters())  # nothing was wrapped
    assert all(p.requires_grad for p in model.parameters())


def test_the_adapter_dir_is_peft_s_layout_and_loads_with_peft_giving_the_same_logits(tmp_path):
    _base().save_pretrained(tmp_path / "base")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    adapter = wrap(model, LoraSpec(rank=8, alpha=16, target_modules=["q_proj", "k_proj", "down_proj"]))
    _moved(adapter)
    state = adapter_state(adapter, single_process())
    assert "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight" in state
    assert all(
        k.startswith("base_model.model.model.layers.") and k.endswith((".lora_A.weight", ".lora_B.weight"))
        for k in state
    )
    assert len(state) == 2 * 3 * 2 and all(v.dtype == torch.float32 for v in state.values())
    (tmp_path / "adapter").mkdir()
    save_adapter(tmp_path / "adapter", state, adapter)
    assert {p.name for p in (tmp_path / "adapter").iterdir()} == {ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE}
    assert load_file(str(tmp_path / "adapter" / ADAPTER_WEIGHTS_FILE)).keys() == state.keys()
    model.eval()
    with torch.no_grad():
        ours = model(input_ids=IDS).logits
        loaded = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(tmp_path / "base"), tmp_path / "adapter"
        )
        theirs = loaded(input_ids=IDS).logits
        plain = AutoModelForCausalLM.from_pretrained(tmp_path / "base")(input_ids=IDS).logits
    assert loaded.peft_config["default"].r == 8 and loaded.peft_config["default"].lora_alpha == 16
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-6)
    assert (ours - plain).abs().max() > 1e-3  # the adapter does something: the check above can fail
    # in bf16 (the broadcast's dtype) the same names, half the bytes
    half = adapter_state(adapter, single_process(), torch.bfloat16)
    assert half.keys() == state.keys() and all(v.dtype == torch.bfloat16 for v in half.values())


def test_an_adapter_loads_back_into_a_fresh_wrap_and_one_of_another_rank_is_refused(tmp_path):
    spec = LoraSpec(rank=4, target_modules=["q_proj"])
    adapter = wrap(_base(), spec)
    _moved(adapter)
    save_adapter(tmp_path, adapter_state(adapter, single_process()), adapter)
    other = wrap(_base(), spec)
    load_adapter(other, tmp_path)
    mine, theirs = adapter_state(adapter, single_process()), adapter_state(other, single_process())
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    with pytest.raises(WeightsMismatch, match=r"does not fit this run's \(spec.model.lora\).*reshaped"):
        load_adapter(wrap(_base(), LoraSpec(rank=8, target_modules=["q_proj"])), tmp_path)
    with pytest.raises(WeightsMismatch, match=r"missing \['base_model.model.model.layers.0.self_attn.v_proj"):
        load_adapter(wrap(_base(), LoraSpec(rank=4, target_modules=["q_proj", "v_proj"])), tmp_path)


def test_the_adapter_disabled_is_the_base_model_and_the_policy_stays_as_it_was():
    plain = _base()
    adapter = wrap(_base(), LoraSpec(rank=4))
    _moved(adapter)
    adapter.model.train()
    reference = AdapterOff(adapter)
    assert reference.get_output_embeddings() is adapter.model.lm_head and reference.config is adapter.model.config
    plain.eval()
    with torch.no_grad():
        torch.testing.assert_close(reference(input_ids=IDS).logits, plain(input_ids=IDS).logits, rtol=0, atol=1e-6)
        assert adapter.model.training  # put back in train mode
        adapter.model.eval()
        assert (adapter.model(input_ids=IDS).logits - plain(input_ids=IDS).logits).abs().max() > 1e-3  # enabled again


LORA = {"builtin": "tiny-reverse", "lora": {"rank": 8, "target_modules": ["v_proj", "q_proj"]}}


def test_a_lora_checkpoint_resumed_without_lora_and_the_reverse_are_refused_saying_why():
    lora, full = parse(model=LORA).spec, parse().spec
    with pytest.raises(CheckpointMismatch) as info:
        check_compatible(run_identity(lora, base_model="b"), full, "ckpt")
    assert (
        "spec.model.lora: the checkpoint trained a LoRA adapter (rank 8, alpha 32.0, dropout 0.0, "
        "target_modules ['q_proj', 'v_proj']) and the manifest has no spec.model.lora (full fine-tuning): its "
        "parts hold the adapter alone" in str(info.value)
    )
    with pytest.raises(CheckpointMismatch, match="the checkpoint trained every weight of the model"):
        check_compatible(run_identity(full), lora, "ckpt", base_model="b")
    # a checkpoint from before LoRA (no `lora` key) trained every weight: it resumes without LoRA, not with it
    old = {k: v for k, v in run_identity(full).items() if k != "lora"}
    check_compatible(old, full, "ckpt")
    with pytest.raises(CheckpointMismatch, match="the checkpoint trained every weight"):
        check_compatible(old, lora, "ckpt", base_model="b")


def test_a_changed_lora_setting_or_base_model_is_refused_by_field():
    saved = run_identity(parse(model=LORA).spec, base_model="builtin:tiny-reverse (tiny-reverse-aaa)")
    same = parse(model={**LORA, "lora": {"rank": 8, "target_modules": ["q_proj", "v_proj"]}}).spec  # order: a set
    check_compatible(saved, same, "ckpt", base_model="builtin:tiny-reverse (tiny-reverse-aaa)")
    twice = parse(model={**LORA, "lora": {"rank": 8, "target_modules": ["v_proj", "q_proj", "q_proj"]}}).spec
    check_compatible(saved, twice, "ckpt", base_model="builtin:tiny-reverse (tiny-reverse-aaa)")  # a set: the same
    other = parse(model={**LORA, "lora": {"rank": 16, "alpha": 16, "target_modules": ["q_proj"]}}).spec
    with pytest.raises(CheckpointMismatch) as info:
        check_compatible(saved, other, "ckpt", base_model="builtin:tiny-reverse (tiny-reverse-aaa)")
    text = str(info.value)
    assert "spec.model.lora.rank: checkpoint has 8, manifest has 16" in text
    assert "spec.model.lora.alpha: checkpoint has 32.0, manifest has 16.0" in text
    assert "spec.model.lora.target_modules: checkpoint has ['q_proj', 'v_proj'], manifest has ['q_proj']" in text
    assert "dropout" not in text
    with pytest.raises(
        CheckpointMismatch, match=r"trained on the base weights 'builtin:tiny-reverse \(tiny-reverse-aaa\)'"
    ):
        check_compatible(saved, same, "ckpt", base_model="builtin:tiny-reverse (tiny-reverse-bbb)")
