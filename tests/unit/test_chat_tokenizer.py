"""The builtin ``tiny`` model's tokenizer: one token per character of printable ASCII and newline, and a chat
template that costs one token per role and one per turn, whose end-of-turn token is the EOS generation stops on."""

from __future__ import annotations

import jinja2
import pytest
from rlrun.model.chat_tokenizer import (
    BASE_CHARACTERS,
    END_TOKEN,
    ROLE_TOKENS,
    SPECIAL_TOKENS,
    build_chat_tokenizer,
    extra_characters,
)
from transformers import AutoTokenizer

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "12+7=\nok?"}]


def test_printable_ascii_and_newline_round_trip_one_token_per_character():
    tok = build_chat_tokenizer()
    text = "line one\n" + BASE_CHARACTERS + "\n~{}"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == len(text)
    assert tok.decode(ids) == text
    assert len(BASE_CHARACTERS) == 96 and tok.unk_token_id not in ids


def test_special_tokens_come_first_and_end_is_eos_and_padding():
    tok = build_chat_tokenizer()
    assert tok.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == list(range(6))
    assert tok.eos_token == tok.pad_token == END_TOKEN and tok.eos_token_id == 0
    assert tok.encode("<|user|>hi", add_special_tokens=False) == [
        tok.convert_tokens_to_ids("<|user|>"),
        *tok.encode("hi"),
    ]


def test_chat_template_renders_a_role_token_and_an_end_token_per_message_then_the_generation_prompt():
    tok = build_chat_tokenizer()
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert text == "<|system|>Be brief.<|end|><|user|>12+7=\nok?<|end|><|assistant|>"
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert ids == tok.encode(text, add_special_tokens=False)
    assert len(ids) == len("Be brief.") + len("12+7=\nok?") + 5  # 2 roles + 2 ends + the generation prompt
    without = tok.apply_chat_template(MESSAGES, add_generation_prompt=False, tokenize=False)
    assert without == text.removesuffix("<|assistant|>")


def test_an_assistant_turn_ends_with_eos_and_decodes_to_its_content():
    tok = build_chat_tokenizer()
    turn = tok.apply_chat_template([*MESSAGES, {"role": "assistant", "content": "19"}], tokenize=False)
    assert turn.endswith("<|assistant|>19<|end|>")
    ids = tok.encode(turn, add_special_tokens=False)
    assert ids[-1] == tok.eos_token_id
    reply = ids[ids.index(tok.convert_tokens_to_ids("<|assistant|>")) + 1 :]
    assert tok.decode(reply, skip_special_tokens=True) == "19"


def test_every_message_role_has_a_token_and_an_unknown_role_is_refused():
    tok = build_chat_tokenizer()
    for token in ROLE_TOKENS:
        role = token[2:-2]
        rendered = tok.apply_chat_template([{"role": role, "content": "x"}], tokenize=False)
        assert rendered == f"{token}x{END_TOKEN}"
    with pytest.raises(jinja2.TemplateError, match="unknown chat role narrator"):
        tok.apply_chat_template([{"role": "narrator", "content": "x"}], tokenize=False)


def test_extra_characters_follow_ascii_in_code_point_order_and_others_are_unknown():
    extra = extra_characters(["naïve × 3", "ok\t", "Ωmega"])
    assert extra == "\t×ïΩ"
    tok = build_chat_tokenizer(extra)
    assert tok.convert_tokens_to_ids(list(extra)) == list(range(6 + 96, 6 + 96 + 4))
    assert tok.decode(tok.encode("naïve × Ω", add_special_tokens=False)) == "naïve × Ω"
    assert tok.encode("日", add_special_tokens=False) == [tok.unk_token_id]


def test_saved_tokenizer_loads_with_its_template_and_context(tmp_path):
    build_chat_tokenizer("é", max_length=512).save_pretrained(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert tok.model_max_length == 512 and tok.eos_token_id == 0
    assert tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False).endswith("<|assistant|>")
    assert tok.decode(tok.encode("café\n", add_special_tokens=False)) == "café\n"
