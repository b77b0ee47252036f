"""peft's adapter directory, defined once (``rlrun.adapter_format``): a target list selects the modules peft wraps,
a directory holds an adapter by its weights file, an adapter of a model has peft's names and shapes, and an
``adapter_config.json`` that is not ``spec.model.lora``'s is refused field by field; no torch, no peft imported."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from rlrun import adapter_format
from rlrun.adapter_format import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_WEIGHTS_FILE,
    adapter_signature,
    config_problems,
    expected_tensors,
    holds_adapter,
    is_b,
    missing_files,
    targeted,
)

from tests.support.adapters import BASE, LORA, adapter_config


@pytest.mark.parametrize(
    ("module", "targets"),
    [
        ("model.layers.0.self_attn.q_proj", ["q_proj"]),
        ("model.layers.0.self_attn.q_proj", ["self_attn.q_proj"]),
        ("model.layers.0.self_attn.q_proj", ["model.layers.0.self_attn.q_proj"]),
        ("model.layers.0.self_attn.q_proj", ["proj"]),
        ("model.layers.0.self_attn.q_proj", ["xq_proj", "q"]),
        ("model.layers.0.self_attn", ["q_proj", "v_proj"]),
        ("lm_head", ["lm_head"]),
    ],
)
def test_a_target_list_selects_exactly_the_modules_peft_wraps(module, targets):
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists

    assert targeted(module, targets) == bool(check_target_module_exists(LoraConfig(target_modules=targets), module))


def test_a_directory_holds_an_adapter_by_its_weights_file_and_a_whole_one_has_its_config_too(tmp_path):
    assert not holds_adapter(tmp_path) and missing_files(tmp_path) == [ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE]
    (tmp_path / "model.safetensors").write_bytes(b"")  # full weights
    assert not holds_adapter(tmp_path)
    (tmp_path / ADAPTER_WEIGHTS_FILE).write_bytes(b"")
    assert holds_adapter(tmp_path) and missing_files(tmp_path) == [ADAPTER_CONFIG_FILE]
    (tmp_path / ADAPTER_CONFIG_FILE).write_text("{}")
    assert missing_files(tmp_path) == []


def test_the_b_factors_are_what_a_server_scales_by_alpha_over_r_and_nothing_else():
    a, b = adapter_format.tensor_names("model.layers.0.mlp.down_proj")
    emb_a, emb_b = adapter_format.tensor_names("model.embed_tokens", embedding=True)
    assert [is_b(n) for n in (a, b, emb_a, emb_b)] == [False, True, False, True]
    assert not is_b("base_model.model.model.layers.0.mlp.lora_Bx.weight")  # a module merely named so


def test_an_adapter_of_a_model_has_peft_s_names_and_shapes_for_its_targeted_2d_weights():
    modules = adapter_signature(BASE, LORA)  # rank 2 on q_proj [8, 4] and down_proj [4, 16]; not the embedding, norm
    assert modules == {
        "model.layers.0.self_attn.q_proj": ((2, 4), (8, 2)),
        "model.layers.0.mlp.down_proj": ((2, 16), (4, 2)),
    }
    assert expected_tensors(modules, present=()) == {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": (2, 4),
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": (8, 2),
        "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight": (2, 16),
        "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight": (4, 2),
    }
    embedding = adapter_signature(BASE, LORA.model_copy(update={"target_modules": ["embed_tokens"]}))
    emb_a = "base_model.model.model.embed_tokens.lora_embedding_A"  # W [10, 4]: A [r, 10], B [4, r]
    assert expected_tensors(embedding, present={emb_a}) == {emb_a: (2, 10), emb_a.replace("_A", "_B"): (4, 2)}


@pytest.mark.parametrize(
    ("config", "problem"),
    [
        ({"r": 4}, "r is 4, the spec says 2"),
        ({"lora_alpha": 16}, "lora_alpha is 16, the spec says 4.0"),
        ({"target_modules": ["q_proj"]}, "target_modules is ['q_proj'], the spec says ['down_proj', 'q_proj']"),
        ({"use_dora": True}, "use_dora is True: plain LoRA expected"),
        ({"use_rslora": True}, "use_rslora is True: plain LoRA expected"),
        ({"bias": "all"}, "bias is 'all': 'none' expected"),
        # per-module scaling vLLM 0.32 applies as peft does (PEFTHelper.get_rank_and_scaling): another function
        ({"alpha_pattern": {"q_proj": 64}}, "alpha_pattern is {'q_proj': 64}: plain LoRA expected"),
        ({"rank_pattern": {"q_proj": 1}}, "rank_pattern is {'q_proj': 1}: plain LoRA expected"),
        ({"peft_type": "IA3"}, "peft_type is 'IA3', the spec says 'LORA'"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save is ['lm_head']: the adapter alone expected"),
    ],
)
def test_an_adapter_config_that_is_not_the_spec_s_is_refused_by_field(config, problem):
    assert config_problems(adapter_config(LORA), LORA) == []
    assert config_problems(adapter_config(LORA, **config), LORA) == [problem]


def test_the_format_imports_the_standard_library_and_the_spec_alone():
    """No torch, no peft (nor safetensors' torch API): the orchestrator and the fake server import it."""
    tree = ast.parse(Path(adapter_format.__file__).read_text())
    imported = {n.module for n in tree.body if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names}
    assert imported == {"__future__", "collections.abc", "pathlib", "rlrun.api.lora"}
