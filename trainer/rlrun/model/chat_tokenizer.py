"""The builtin ``tiny`` model's tokenizer: one token per character, six special tokens, a compact chat template.

Every character costs a token in a character-level tokenizer, so the chat template adds as few as it
can: one token naming each message's role and one ending it, no newlines or spaces of its own::

    <|system|>Answer briefly.<|end|><|user|>12+7=<|end|><|assistant|>

is the rendering of a system and a user message with the generation prompt (3 + 2 + 1 special tokens
around the messages' characters); the assistant's reply is its content followed by ``<|end|>``.

``<|end|>`` is at once the end of a turn, the EOS token (``tokenizer.eos_token_id``, the
``eos_token_id`` of the model's config, which vLLM stops on and the orchestrator cuts completions
at) and the padding token. So the token that ends an assistant turn and the token that ends
generation are one: a model warm-started on ``answer<|end|>`` stops where its chat turn ends, and the
completion the reward reads (decoded without special tokens) is the assistant message's content.

Ids are fixed by position: the special tokens (:data:`SPECIAL_TOKENS`, ids 0–5), then ``"\\n"`` and
the 95 printable ASCII characters (:data:`BASE_CHARACTERS`, ids 6–101), then any ``extra``
characters the envs' texts hold (sorted by code point, so the same texts give the same ids).
Anything else encodes as ``<|unk|>``.
"""

from __future__ import annotations

import string
from collections.abc import Iterable

from tokenizers import AddedToken, Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

END_TOKEN = "<|end|>"
UNK_TOKEN = "<|unk|>"
#: Role markers: a message of role ``r`` opens with ``<|r|>`` (the roles of :data:`rlrun.envs.base.MESSAGE_ROLES`).
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|tool|>")
#: Every special token, in id order (``<|end|>`` is id 0: EOS, end of turn and padding).
SPECIAL_TOKENS = (END_TOKEN, UNK_TOKEN, *ROLE_TOKENS)
#: Newline and printable ASCII (space to ``~``): what the vocabulary always holds, whatever the envs.
BASE_CHARACTERS = "\n" + "".join(c for c in string.printable if c not in "\t\n\r\x0b\x0c")

#: The chat template (Jinja, ``tokenizer.chat_template``): ``<|role|>content<|end|>`` per message, then
#: ``<|assistant|>`` with ``add_generation_prompt``; a role outside :data:`ROLE_TOKENS` is an error.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] -%}"
    "{{ raise_exception('unknown chat role ' ~ message['role'] ~ ': the tiny model knows system, user, "
    "assistant and tool') }}"
    "{%- endif -%}"
    "<|{{ message['role'] }}|>{{ message['content'] }}" + END_TOKEN + "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)


def extra_characters(texts: Iterable[str]) -> str:
    """The characters of ``texts`` that :data:`BASE_CHARACTERS` lacks, sorted by code point, each once."""
    seen: set[str] = set()
    for text in texts:
        seen.update(text)
    return "".join(sorted(seen - set(BASE_CHARACTERS)))


def build_chat_tokenizer(extra: str = "", max_length: int = 512) -> PreTrainedTokenizerFast:
    """The character-level tokenizer with :data:`CHAT_TEMPLATE` (module docstring for the ids).

    Args:
        extra: characters to add after :data:`BASE_CHARACTERS` (:func:`extra_characters` of the envs' texts);
            ones already in the vocabulary are ignored.
        max_length: ``model_max_length``: the model's context in tokens.

    A BPE model with no merges splits any text into single characters (special tokens are matched
    first, as added tokens); the ``Fuse`` decoder joins them back without separators.
    """
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in BASE_CHARACTERS + extra:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK_TOKEN))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=END_TOKEN,
        pad_token=END_TOKEN,
        unk_token=UNK_TOKEN,
        additional_special_tokens=list(ROLE_TOKENS),
        model_max_length=max_length,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
