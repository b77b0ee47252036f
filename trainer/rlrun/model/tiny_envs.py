"""The builtin ``tiny`` model: ``tiny-reverse``'s Qwen3 shape, a chat tokenizer, a warm start on the run's envs.

So that RL on any env can be run and tested on a CPU with no download: a Qwen3 causal LM of
``tiny-reverse``'s shape (head dim 32 for vLLM's CPU attention, untied embeddings for vLLM's in-place
weight reload, 512 positions so the envs' chat prompts fit), the character-level tokenizer of
:mod:`rlrun.model.chat_tokenizer` (newline, printable ASCII, the other characters of the first
warm-start texts, and a chat template), and a short supervised warm start on demonstrations of the
run's own envs (:mod:`rlrun.model.demonstrations`): teacher forcing on the completion tokens and the
EOS after them, nothing on the prompt.

The warm start stops at mid-range on purpose: RL needs signal (greedy accuracy above 0) and something
left to learn (below 1), and envs differ by an order of magnitude in how fast a tiny model learns them
(reverse-text: ~100 steps; two-digit arithmetic: ~1000). So every ``sft_check_every`` steps greedy
decoding is scored by each env's own reward on ``sft_check_tasks`` train tasks of a seed namespace of
their own (never the eval split); the warm start stops at the first check whose share solved (reward
1), averaged over the envs, reaches ``sft_target``, or after ``sft_steps``.

Invariant: the same recipe (:class:`~rlrun.model.recipe.TinyEnvsRecipe`, whose ``envs`` field is the
envs' fingerprint) builds the same model (every draw is seeded, the stopping rule counts steps, never
time), and the model directory appears whole or not at all (assembled under a temporary name, then
renamed: :func:`rlrun.model.tiny.write_model_dir`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import logging
import os
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerFast, Qwen3ForCausalLM

from rlrun.api.spec import EnvSpec
from rlrun.envs import make_env
from rlrun.envs.base import SOLVED_REWARD, is_multi_turn
from rlrun.model.build_progress import BuildProgress, LineProgress
from rlrun.model.chat_tokenizer import build_chat_tokenizer, extra_characters
from rlrun.model.conversations import greedy_conversations
from rlrun.model.demonstrations import (
    CHECKS,
    DemonstrationStream,
    NoDemonstrationsError,
    Row,
    demonstration,
    packed,
    render_prompt,
)
from rlrun.model.recipe import TinyEnvsRecipe, envs_fingerprint
from rlrun.model.tiny import BUILD_THREADS, build_config, sft_optimizer, sft_step, torch_threads, write_model_dir

log = logging.getLogger(__name__)

#: The env seed of the held-out (``eval`` split) tasks :func:`evaluate_greedy` scores.
EVAL_SEED = 99
#: Tokens a greedy completion may run past its demonstration's length before it is cut.
SLACK_TOKENS = 16


def encode_batch(
    rows: Sequence[Row], tokenizer: PreTrainedTokenizerFast
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``(input_ids, attention_mask, labels)``, each ``[len(rows), T]`` (T: the longest row);
    labels are -100 except on each row's completion tokens and its EOS."""
    eos = tokenizer.eos_token_id
    encoded = []
    for row in rows:
        prompt = tokenizer.encode(row.prompt, add_special_tokens=False)
        completion = [*tokenizer.encode(row.completion, add_special_tokens=False), eos]
        encoded.append((prompt + completion, [-100] * len(prompt) + completion))
    width = max(len(ids) for ids, _ in encoded)
    ids = torch.full((len(rows), width), eos, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for r, (row_ids, row_labels) in enumerate(encoded):
        ids[r, : len(row_ids)] = torch.tensor(row_ids)
        mask[r, : len(row_ids)] = 1
        labels[r, : len(row_labels)] = torch.tensor(row_labels)
    return ids, mask, labels


@torch.no_grad()
def greedy_completions(
    model: Qwen3ForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    prompts: Sequence[str],
    max_new_tokens: Sequence[int],
    batch_size: int = 64,
) -> list[str]:
    """Greedy completions of the rendered ``prompts``, each cut at its EOS or after its ``max_new_tokens``,
    decoded without special tokens (what a reward reads).

    Prompts are decoded ``batch_size`` at a time, left-padded (sorted by length, so little padding); the
    result is the same as one prompt at a time.
    """
    eos = tokenizer.eos_token_id
    encoded = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    order = sorted(range(len(prompts)), key=lambda i: len(encoded[i]))
    texts = [""] * len(prompts)
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        width = max(len(encoded[i]) for i in chunk)
        ids = torch.tensor([[eos] * (width - len(encoded[i])) + encoded[i] for i in chunk])
        mask = torch.tensor([[0] * (width - len(encoded[i])) + [1] * len(encoded[i]) for i in chunk])
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=max(max_new_tokens[i] for i in chunk),
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos,
        )
        for i, row in zip(chunk, out[:, width:].tolist(), strict=True):
            row = row[: max_new_tokens[i]]
            texts[i] = tokenizer.decode(row[: row.index(eos)] if eos in row else row, skip_special_tokens=True)
    return texts


def score_rows(
    model: Qwen3ForCausalLM, tokenizer: PreTrainedTokenizerFast, env: Any, rows: Sequence[Row]
) -> dict[str, float]:
    """Greedy decoding of ``rows`` (one env's) scored: ``{"tasks", "exact_match", "solved", "reward"}`` — the
    count, the share whose completion is the demonstration exactly, the share the env's reward calls solved
    (1), and the mean reward."""
    context = model.config.max_position_embeddings
    caps = []
    for r in rows:
        completion = len(tokenizer.encode(r.completion, add_special_tokens=False))
        prompt = r.tokens - completion - 1
        caps.append(max(1, min(completion + SLACK_TOKENS, context - prompt)))
    if is_multi_turn(env):  # played to the end, turn by turn; exact_match: the last turn is the demonstration's
        generate = functools.partial(greedy_completions, model, tokenizer)
        cap = max(caps) if caps else 1
        texts, bonus = greedy_conversations(
            generate, tokenizer, env, [r.task for r in rows], [r.prompt for r in rows], cap
        )
        wanted = [env.demonstration(r.task)[-1] for r in rows]
    else:
        texts = greedy_completions(model, tokenizer, [r.prompt for r in rows], caps)
        bonus, wanted = [0.0] * len(rows), [r.completion for r in rows]
    rewards = [float(env.reward(r.task, t)) + b for r, t, b in zip(rows, texts, bonus, strict=True)]
    n = max(len(rows), 1)
    return {
        "tasks": len(rows),
        "exact_match": sum(t == w for w, t in zip(wanted, texts, strict=True)) / n,
        "solved": sum(x >= SOLVED_REWARD for x in rewards) / n,
        "reward": sum(rewards) / n,
    }


@dataclass
class WarmStart:
    """What a warm start did.

    Attributes:
        losses: each step's loss (nats per completion token).
        checks: each check's ``{"step", "solved"}`` (``solved``: per env name, the share of check tasks solved).
        rows: rows trained on.
        tokens: tokens trained on, padding included.
        stopped: why it stopped: ``target`` (a check reached ``sft_target``), ``tokens`` (``sft_max_tokens``) or
            ``steps`` (``sft_steps``).
    """

    losses: list[float] = field(default_factory=list)
    checks: list[dict[str, Any]] = field(default_factory=list)
    rows: int = 0
    tokens: int = 0
    stopped: str = "steps"


def warm_start(
    model: Qwen3ForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    batches: Iterator[list[Row]],
    checks: Sequence[tuple[str, Any, list[Row]]],
    recipe: TinyEnvsRecipe,
    progress: BuildProgress | None = None,
) -> WarmStart:
    """Teacher-forced SFT, one AdamW step per batch, until ``recipe.sft_target``, ``sft_max_tokens`` or ``sft_steps``.

    Args:
        batches: the warm-start batches (:func:`rlrun.model.demonstrations.packed`).
        checks: ``(env name, env, rows)`` to check progress on (module docstring); none: no early stop.
        recipe: learning rate (warm-up over 20 steps, then cosine to 0 at ``sft_steps``; gradient norm
            clipped to 1), step counts, target.
        progress: where each step, check and the end are shown (None: log lines, :class:`LineProgress`).
    """
    progress = progress or LineProgress()
    steps = recipe.sft_steps
    optim, sched = sft_optimizer(model, recipe.sft_lr, steps)
    done = WarmStart()
    progress.start("tiny warm start", steps, recipe.sft_max_tokens)
    for step in range(1, steps + 1):
        rows = next(batches)
        model.train()
        ids, mask, labels = encode_batch(rows, tokenizer)
        done.losses.append(sft_step(model, optim, sched, ids, mask, labels))
        done.rows += len(rows)
        done.tokens += ids.numel()
        progress.advance(step, done.losses[-1], done.tokens)
        if checks and step % recipe.sft_check_every == 0:
            model.eval()
            progress.checking(sum(len(tasks) for _, _, tasks in checks))
            solved = {name: score_rows(model, tokenizer, env, tasks)["solved"] for name, env, tasks in checks}
            done.checks.append({"step": step, "solved": solved})
            progress.checked(step, solved)
            if sum(solved.values()) / len(solved) >= recipe.sft_target:
                done.stopped = "target"
                break
        if done.tokens >= recipe.sft_max_tokens:
            done.stopped = "tokens"
            break
    progress.finish(done.stopped)
    model.eval()
    return done


def check_rows(
    envs: Sequence[tuple[str, Any]], tokenizer: PreTrainedTokenizerFast, recipe: TinyEnvsRecipe
) -> list[list[Row]]:
    """Per env (in order), ``recipe.sft_check_tasks`` train tasks of the
    :data:`~rlrun.model.demonstrations.CHECKS` namespace with usable demonstrations (none for an env without)."""
    checks = []
    for name, env in envs:
        context = recipe.max_position_embeddings
        stream = DemonstrationStream([(name, env)], [1.0], tokenizer, context, recipe.seed, CHECKS)
        try:
            checks.append(list(itertools.islice(stream, recipe.sft_check_tasks)))
        except NoDemonstrationsError:
            checks.append([])
    return checks


def evaluate_greedy(
    model: Qwen3ForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    envs: Sequence[tuple[str, Any]],
    n: int = 64,
    seed: int = EVAL_SEED,
) -> dict[str, dict[str, Any]]:
    """Greedy decoding on the first ``n`` held-out (``eval`` split) tasks of each env, those with a demonstration
    that fit the context.

    Returns:
        Per env name: :func:`score_rows`'s scores, or ``{"tasks": 0, "error": …}`` for an env that has no eval
        split (its ``task(…, "eval")`` raised ``ValueError``).
    """
    context = model.config.max_position_embeddings
    scores: dict[str, dict[str, Any]] = {}
    for name, env in envs:
        rows = []
        try:
            tasks = [env.task(seed, i, "eval") for i in range(n)]
        except ValueError as exc:
            scores[name] = {"tasks": 0, "error": str(exc)}
            continue
        for task in tasks:
            completion = demonstration(env, task, tokenizer)
            if completion is None:
                continue
            prompt = render_prompt(tokenizer, task)
            tokens = len(tokenizer.encode(prompt + completion, add_special_tokens=False)) + 1
            if tokens <= context:
                rows.append(Row(0, task, prompt, completion, tokens))
        scores[name] = score_rows(model, tokenizer, env, rows)
    return scores


def init_tiny_envs_model(
    out_dir: str | os.PathLike,
    env_specs: Sequence[EnvSpec],
    recipe: TinyEnvsRecipe | None = None,
    evaluate: bool = True,
    progress: BuildProgress | None = None,
) -> dict:
    """Build, warm-start on ``env_specs`` and save the builtin ``tiny`` model into ``out_dir`` (written atomically).

    Args:
        out_dir: the model directory to create.
        env_specs: the run's envs (``spec.envs``): what the warm start draws from, with their weights.
        recipe: the recipe (None: the default); its ``envs``, when empty, is filled in here with
            :func:`envs_fingerprint` of ``env_specs`` (the cache passes the recipe its directory is named after).
        evaluate: score greedy decoding on 64 held-out tasks per env (a second or two per env; a multi-turn env's
            conversations longer).
        progress: where the build's phases and the warm start's steps are shown (None: log lines).

    Returns:
        A report: recipe hash, envs, parameter count, vocabulary, what was drawn from each env, steps and
        rows trained, loss first/last, the checks, seconds, and (when ``evaluate``) per env the held-out
        scores of :func:`evaluate_greedy`.

    Raises:
        FileExistsError: ``out_dir`` exists and is not empty.
        ValueError: ``env_specs`` is empty.
        rlrun.model.demonstrations.NoDemonstrationsError: no env gives usable demonstrations.
        rlrun.envs.UnknownEnvError, rlrun.envs.EnvArgsError: an env cannot be built.
    """
    if not env_specs:
        raise ValueError("the builtin model 'tiny' is warm-started on the run's envs: give at least one (spec.envs)")
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty")
    recipe = recipe or TinyEnvsRecipe()
    if not recipe.envs:
        recipe = dataclasses.replace(recipe, envs=envs_fingerprint(env_specs))
    with torch_threads(BUILD_THREADS):
        return _build(out, env_specs, recipe, evaluate, progress or LineProgress())


def _build(
    out: Path, env_specs: Sequence[EnvSpec], recipe: TinyEnvsRecipe, evaluate: bool, progress: BuildProgress
) -> dict:
    t0 = time.perf_counter()
    random.seed(recipe.seed)
    torch.manual_seed(recipe.seed)
    progress.phase(f"building the tiny model for {', '.join(s.name for s in env_specs)}: drawing warm-start rows")
    envs = [(spec.name, make_env(spec)) for spec in env_specs]
    context = recipe.max_position_embeddings
    base = build_chat_tokenizer()  # renders and counts as the final one does (module docstring of chat_tokenizer)
    checks = check_rows(envs, base, recipe)
    exclude = [{r.prompt for r in rows} for rows in checks]
    stream = DemonstrationStream(envs, [s.weight for s in env_specs], base, context, recipe.seed, exclude=exclude)
    first = list(itertools.islice(stream, recipe.vocab_rows))
    extra = extra_characters(text for row in first for text in (row.prompt, row.completion))
    tokenizer = build_chat_tokenizer(extra, context)
    model = Qwen3ForCausalLM(build_config(recipe, tokenizer))
    batches = packed(itertools.chain(first, stream), recipe.sft_batch_size, recipe.sft_batch_tokens)
    checked = [(name, env, rows) for (name, env), rows in zip(envs, checks, strict=True) if rows]
    done = warm_start(model, tokenizer, batches, checked, recipe, progress)
    report: dict[str, Any] = {
        "builtin": "tiny",
        "recipe": recipe.cache_key(),
        "envs": json.loads(recipe.envs),
        "parameters": sum(p.numel() for p in model.parameters()),
        "vocabulary": len(tokenizer),
        "extra_characters": extra,
        "context": context,
        "sft_steps": len(done.losses),
        "sft_rows": done.rows,
        "sft_tokens": done.tokens,
        "sft_stopped": done.stopped,
        "drawn": [d.to_dict() for d in stream.draws],
        "sft_loss_first": done.losses[0] if done.losses else None,
        "sft_loss_last": done.losses[-1] if done.losses else None,
        "checks": done.checks,
        "sft_seconds": round(time.perf_counter() - t0, 2),
    }
    if evaluate:
        progress.phase("scoring greedy decoding on 64 held-out tasks per env")
        report["greedy"] = evaluate_greedy(model, tokenizer, envs)
    report["seconds"] = round(time.perf_counter() - t0, 2)
    write_model_dir(out, model, tokenizer, report)
    log.info(
        "built tiny model in %s: %d warm-start steps (stopped: %s), %.1f s",
        out,
        len(done.losses),
        done.stopped,
        report["seconds"],
    )
    return report
