"""Chat models for tests: the tiny model with a chat template of the test's choosing."""

from __future__ import annotations

import shutil
from pathlib import Path

from transformers import AutoTokenizer

#: Qwen3's rule in miniature: an assistant message before the last user message loses its ``<think>…</think>``.
STRIPPING_TEMPLATE = (
    "{%- set ns = namespace(last_user=0) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' and loop.index0 < ns.last_user and '</think>' in m['content'] -%}"
    "[a]{{ m['content'].split('</think>')[-1] }}<|endoftext|>"
    "{%- else -%}[{{ m['role'][0] }}]{{ m['content'] }}<|endoftext|>{%- endif -%}"
    "{%- endfor -%}{%- if add_generation_prompt -%}[a]{%- endif -%}"
)


def with_template(model: Path, out: Path, template: str) -> Path:
    """A copy of ``model`` at ``out`` whose tokenizer has the chat template ``template``; returns ``out``."""
    shutil.copytree(model, out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(out)
    return out
