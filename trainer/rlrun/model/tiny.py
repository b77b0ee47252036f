"""The builtin ``tiny-reverse`` model: a ~0.6M-parameter Qwen3 built and warm-started here.

No weights can be downloaded on the machines this project targets, so the model
is made from scratch: a Qwen3-architecture causal LM (``Qwen3ForCausalLM``, head
dim 32 so vLLM's CPU attention accepts it, untied embeddings so vLLM's in-place
``reload_weights`` can update every tensor) with a character-level tokenizer
saved as a Hugging Face ``tokenizer.json``. A short supervised warm start on
``reverse-text`` (teacher forcing on the completion tokens only, fixed seed)
puts RL's starting reward mid-range: not zero, where GRPO has no signal, and not
perfect, where it has nothing to learn.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import shutil
import string
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from rlrun.envs.reverse_text import ReverseTextEnv, lcs_ratio
from rlrun.file_modes import open_to_readers, temp_sibling_dir
from rlrun.model.build_progress import BuildProgress, LineProgress
from rlrun.model.recipe import TinyEnvsRecipe, TinyModelRecipe

log = logging.getLogger(__name__)

EOS_TOKEN = "<|endoftext|>"
UNK_TOKEN = "<|unk|>"
#: Torch threads of a builtin model's build (both models). One: on 2 cores shared with other work, two threads made
#: each warm-start step 5–10× slower (OpenMP's threads wait for each other at every operation and one of them is
#: always descheduled: issue 35's 21.8 minutes); on an idle machine one takes ≈ 1.3× as long. The bytes do not depend on
#: it (the same safetensors on 1 and 2 threads, both models: ``docs/design.md``), so it is no part of a recipe.
BUILD_THREADS = 1
#: Printable ASCII without tabs/newlines: every character a prompt may hold.
CHARACTERS = "".join(c for c in string.printable if c not in "\t\n\r\x0b\x0c")


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level tokenizer: ids 0/1 are EOS and UNK, then one id per printable character.

    A BPE model with no merges splits any text into single characters; the
    ``Fuse`` decoder joins them back without separators.
    """
    vocab = {EOS_TOKEN: 0, UNK_TOKEN: 1}
    for ch in CHARACTERS:
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK_TOKEN))
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        model_max_length=TinyModelRecipe.max_position_embeddings,
        clean_up_tokenization_spaces=False,
    )


def build_config(recipe: TinyModelRecipe | TinyEnvsRecipe, tokenizer: PreTrainedTokenizerFast) -> Qwen3Config:
    """Qwen3 config for ``recipe`` (``tiny-reverse``'s or ``tiny``'s); vocab rounded up to a multiple of 64,
    every special id (BOS, EOS, padding) the tokenizer's EOS."""
    vocab_size = 64 * math.ceil(len(tokenizer) / 64)
    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_hidden_layers,
        num_attention_heads=recipe.num_attention_heads,
        num_key_value_heads=recipe.num_key_value_heads,
        head_dim=recipe.head_dim,
        max_position_embeddings=recipe.max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
        torch_dtype="float32",
    )


def _sft_batch(
    env: ReverseTextEnv, tokenizer: PreTrainedTokenizerFast, seed: int, start: int, size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``(input_ids, attention_mask, labels)``, each ``[size, T]``; labels -100 off the completion."""
    eos = tokenizer.eos_token_id
    rows = []
    for i in range(start, start + size):
        task = env.task(seed, i)
        prompt = tokenizer.encode(task.prompt)
        completion = [*tokenizer.encode(task.answer), eos]
        rows.append((prompt + completion, [-100] * len(prompt) + completion))
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((size, width), eos, dtype=torch.long)
    mask = torch.zeros((size, width), dtype=torch.long)
    labels = torch.full((size, width), -100, dtype=torch.long)
    for r, (row_ids, row_labels) in enumerate(rows):
        ids[r, : len(row_ids)] = torch.tensor(row_ids)
        mask[r, : len(row_ids)] = 1
        labels[r, : len(row_labels)] = torch.tensor(row_labels)
    return ids, mask, labels


def warm_start(
    model: Qwen3ForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    recipe: TinyModelRecipe,
    progress: BuildProgress | None = None,
) -> list[float]:
    """Supervised warm start on reverse-text; returns the loss (nats/token) of every step.

    The warm-start stream uses seed ``recipe.seed + 1_000_003`` so that it does not
    replay the RL run's task stream (which is seeded by the manifest). ``progress`` shows each step (None: log
    lines every few seconds).
    """
    progress = progress or LineProgress()
    env = ReverseTextEnv()
    optim, sched = sft_optimizer(model, recipe.sft_lr, recipe.sft_steps)
    losses = []
    model.train()
    progress.start("tiny-reverse warm start", recipe.sft_steps)
    tokens = 0
    for step in range(recipe.sft_steps):
        ids, mask, labels = _sft_batch(
            env, tokenizer, recipe.seed + 1_000_003, step * recipe.sft_batch_size, recipe.sft_batch_size
        )
        losses.append(sft_step(model, optim, sched, ids, mask, labels))
        tokens += ids.numel()
        progress.advance(step + 1, losses[-1], tokens)
    progress.finish("steps")
    model.eval()
    return losses


def sft_optimizer(
    model: Qwen3ForCausalLM, lr: float, steps: int
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """The warm starts' AdamW (no weight decay) at peak ``lr``: linear warm-up over 20 steps, then cosine to 0 at
    ``steps`` (the usual SFT schedule, e.g. transformers' ``get_cosine_schedule_with_warmup``)."""
    optim = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        optim, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * s / steps))
    )
    return optim, sched


@contextlib.contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """Torch's intra-op threads set to ``threads`` inside, restored after (the setting is process-wide)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def sft_step(
    model: Qwen3ForCausalLM,
    optim: torch.optim.Optimizer,
    sched: torch.optim.lr_scheduler.LRScheduler,
    ids: torch.Tensor,
    mask: torch.Tensor,
    labels: torch.Tensor,
) -> float:
    """One teacher-forced step on ``ids``/``mask``/``labels`` (each ``[rows, T]``; labels −100 off the completion),
    gradient norm clipped to 1; returns the loss (nats/token)."""
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    optim.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optim.step()
    sched.step()
    return loss.item()


@torch.no_grad()
def evaluate_greedy(
    model: Qwen3ForCausalLM, tokenizer: PreTrainedTokenizerFast, n: int = 128, seed: int = 99, max_new_tokens: int = 24
) -> dict[str, float]:
    """Greedy decoding on ``n`` held-out (``eval`` split) reverse-text tasks: ``{"exact_match", "similarity"}``
    (means in [0, 1])."""
    env = ReverseTextEnv()
    exact = sim = 0.0
    for i in range(n):
        task = env.task(seed, i, "eval")
        ids = torch.tensor([tokenizer.encode(task.prompt)])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.eos_token_id,
        )
        text = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        exact += float(text == task.answer)
        sim += lcs_ratio(text, task.answer)
    return {"exact_match": exact / n, "similarity": sim / n}


def init_tiny_model(
    out_dir: str | os.PathLike,
    recipe: TinyModelRecipe | None = None,
    evaluate: bool = True,
    progress: BuildProgress | None = None,
) -> dict:
    """Build, warm-start and save the builtin model into ``out_dir`` (written atomically).

    The directory is assembled under a temporary name beside ``out_dir`` and renamed
    into place, so a reader never sees a half-written model. ``progress`` shows the warm start and the phases
    (None: log lines).

    Returns:
        A report: parameter count, warm-start loss first/last, seconds, and (when
        ``evaluate``) greedy exact match and similarity on 128 held-out tasks.

    Raises:
        FileExistsError: ``out_dir`` exists and is not empty.
    """
    recipe = recipe or TinyModelRecipe()
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty")
    t0 = time.perf_counter()
    random.seed(recipe.seed)
    torch.manual_seed(recipe.seed)
    tokenizer = build_tokenizer()
    config = build_config(recipe, tokenizer)
    model = Qwen3ForCausalLM(config)
    progress = progress or LineProgress()
    with torch_threads(BUILD_THREADS):
        losses = warm_start(model, tokenizer, recipe, progress)
    report = {
        "builtin": "tiny-reverse",
        "recipe": recipe.cache_key(),
        "parameters": sum(p.numel() for p in model.parameters()),
        "sft_steps": recipe.sft_steps,
        "sft_loss_first": losses[0] if losses else None,
        "sft_loss_last": losses[-1] if losses else None,
    }
    if evaluate:
        progress.phase("scoring greedy decoding on 128 held-out tasks")
        with torch_threads(BUILD_THREADS):
            report.update(evaluate_greedy(model, tokenizer))
    report["seconds"] = round(time.perf_counter() - t0, 2)
    write_model_dir(out, model, tokenizer, report)
    log.info("built tiny-reverse model in %s: %s", out, report)
    return report


def write_model_dir(out: Path, model: Any, tokenizer: Any, report: dict) -> None:
    """Save ``model``, ``tokenizer`` and ``report`` (as ``rlrun_model.json``) into ``out``, atomically.

    The directory is assembled under a temporary name beside ``out`` and renamed into place, so a
    reader never sees a half-written model; ``out`` may exist if it is empty.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling_dir(out, "tmp")  # readable as a mkdir'd directory is: a cache other users mount
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "rlrun_model.json").write_text(json.dumps(report, indent=2) + "\n")
        open_to_readers(tmp)  # safetensors writes the weights 0600
        if out.exists():
            out.rmdir()
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
