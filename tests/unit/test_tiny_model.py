import json

import torch
from rlrun.model.tiny import CHARACTERS, build_tokenizer
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer


def test_char_tokenizer_round_trips_every_character():
    tok = build_tokenizer()
    text = "si talf = " + CHARACTERS
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == len(text)
    assert tok.decode(ids) == text
    assert tok.decode([*tok.encode("ab", add_special_tokens=False), tok.eos_token_id], skip_special_tokens=True) == "ab"


def test_builtin_model_shape_and_warm_start(tiny_model):
    config = AutoConfig.from_pretrained(tiny_model)
    assert config.model_type == "qwen3" and config.architectures == ["Qwen3ForCausalLM"]
    assert config.head_dim >= 32 and config.tie_word_embeddings is False
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    n = sum(p.numel() for p in model.parameters())
    assert n < 2_000_000
    assert (tiny_model / "tokenizer.json").is_file()
    tok = AutoTokenizer.from_pretrained(tiny_model)
    assert tok.decode(tok.encode("flat is=", add_special_tokens=False)) == "flat is="
    report = json.loads((tiny_model / "rlrun_model.json").read_text())
    assert report["parameters"] == n
    # the warm start learned something: loss fell well below the uniform-guess level ln(128) ≈ 4.85
    assert report["sft_loss_last"] < 1.5 < report["sft_loss_first"]


def test_builtin_model_greedy_reward_is_mid_range(tiny_model):
    from rlrun.model.tiny import evaluate_greedy

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(tiny_model)
    scores = evaluate_greedy(model, tok, n=64)
    # RL must start with room to improve and with signal: neither ~0 nor ~1.
    assert 0.1 < scores["exact_match"] < 0.8
    assert 0.5 < scores["similarity"] < 0.95
