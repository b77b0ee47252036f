"""The trainer's weights files (``rlrun.training.parts``) for a model with tied weights (Qwen3-0.6B's head is its
embedding): written once under the source's name, as ``save_pretrained`` writes them, and loaded back whole. Before,
safetensors refused the two names of one tensor: such a model could not checkpoint or publish at all."""

from __future__ import annotations

import pytest
import torch
from rlrun.errors import WeightsMismatch
from rlrun.orchestrator.weights import validate_weights_dir, weights_signature
from rlrun.rundir import RunDir
from rlrun.training.parts import load_weights, save_weights
from rlrun.training.trainer import Trainer
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config, Qwen3ForCausalLM

from tests.support.manifests import parse


def _tied(seed: int = 0) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        tie_word_embeddings=True,
    )
    return Qwen3ForCausalLM(config)


def test_a_tied_weight_is_written_once_and_loads_back_into_both_names(tmp_path):
    model = _tied()
    save_weights(model, tmp_path / "model.safetensors")
    names = set(load_file(str(tmp_path / "model.safetensors")))
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    other = _tied(seed=1)
    load_weights(other, tmp_path / "model.safetensors")
    assert torch.equal(other.lm_head.weight, model.model.embed_tokens.weight)
    assert other.lm_head.weight is other.model.embed_tokens.weight  # still one tensor


def test_a_missing_weight_that_is_not_tied_is_refused_by_name(tmp_path):
    state = {k: v for k, v in _tied().state_dict().items() if k not in ("lm_head.weight", "model.norm.weight")}
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightsMismatch, match=r"missing \['model.norm.weight'\]"):
        load_weights(_tied(), tmp_path / "model.safetensors")


def test_a_tied_model_trains_publishes_and_checkpoints(tmp_path):
    model_dir = tmp_path / "model"
    _tied().save_pretrained(model_dir)
    spec = parse("tied", max_steps=1).spec
    run_dir = RunDir(tmp_path / "run")
    trainer = Trainer(spec, run_dir, str(model_dir))  # checkpoints step 0
    trainer.publish(1)
    trainer.ledger.close()
    validate_weights_dir(run_dir.broadcast(1), weights_signature(model_dir))  # the names save_pretrained wrote
    validate_weights_dir(run_dir.trainer_checkpoint(0), weights_signature(model_dir))
