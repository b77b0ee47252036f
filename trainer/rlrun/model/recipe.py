"""The builtin models' recipes: every setting that determines a model's bytes, hence its cache key.

:class:`TinyModelRecipe` is ``tiny-reverse``'s, :class:`TinyEnvsRecipe` is ``tiny``'s (built for the
run's envs, so its key holds their fingerprint: :func:`envs_fingerprint`). Apart from
:mod:`rlrun.model.tiny` and :mod:`rlrun.model.tiny_envs` (which build the models with torch and
transformers) so that finding a model in the cache (:func:`rlrun.model.resolve.builtin_model_dir`)
imports neither: a process that only needs the path (``rlrun rollout --fake``, the launcher) starts
in a fraction of the time.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlrun.api.spec import EnvSpec


@dataclass(frozen=True)
class QwenShapeRecipe:
    """The Qwen3 shape both builtin models share (head dim 32: vLLM's CPU attention needs ≥ 32), and the cache key
    of a recipe: a hash of every field, so changing any of them rebuilds the model.

    Attributes:
        hidden_size / intermediate_size / num_hidden_layers / num_attention_heads /
        num_key_value_heads / head_dim: Qwen3 shape.
    """

    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32

    def cache_key(self) -> str:
        """Short stable name for this recipe, used as the cache directory name."""
        fields = json.dumps(self.__dict__, sort_keys=True)
        return hashlib.sha256(fields.encode()).hexdigest()[:12]


@dataclass(frozen=True)
class TinyModelRecipe(QwenShapeRecipe):
    """Everything that determines the builtin model's bytes (its cache key).

    Attributes:
        hidden_size / intermediate_size / num_hidden_layers / num_attention_heads /
        num_key_value_heads / head_dim: Qwen3 shape.
        max_position_embeddings: context length in tokens.
        sft_steps: supervised warm-start steps (batches of ``sft_batch_size`` tasks).
        sft_lr: AdamW learning rate of the warm start.
        seed: seeds weight init and the warm-start task stream.
    """

    max_position_embeddings: int = 64
    sft_steps: int = 90
    sft_batch_size: int = 64
    sft_lr: float = 3e-3
    seed: int = 1234
    format_version: int = 2  # 2: the warm start draws no held-out (eval) text


@dataclass(frozen=True)
class TinyEnvsRecipe(QwenShapeRecipe):
    """Everything that determines the builtin ``tiny`` model's bytes (its cache key); see :mod:`rlrun.model.tiny_envs`.

    Attributes:
        hidden_size / intermediate_size / num_hidden_layers / num_attention_heads /
        num_key_value_heads / head_dim: Qwen3 shape (``tiny-reverse``'s).
        max_position_embeddings: context length in tokens (prompt + completion; RoPE, so no parameters).
        vocab_rows: the tokenizer holds the characters of the first ``vocab_rows`` warm-start rows.
        sft_steps: most supervised warm-start steps.
        sft_max_tokens: the warm start also stops once its batches held this many tokens, padding included: a
            bound on its time whatever the prompts' length (≈ 1.5 min on 2 cores).
        sft_batch_size: most rows (tasks) in one step.
        sft_batch_tokens: most tokens in one step, padding included (a step of long chat prompts holds fewer rows).
        sft_lr: AdamW peak learning rate (warm-up over 20 steps, then cosine to 0 at ``sft_steps``; a warm start
            stopped by its target or its tokens has not annealed, and RL learns better from it: ``docs/design.md``).
        sft_check_every: every so many steps, greedy decoding on ``sft_check_tasks`` train tasks per env
            (their own seed namespace) checks progress, and the warm start stops once the share solved,
            averaged over the envs, reaches ``sft_target``.
        sft_check_tasks: tasks per env of each check.
        sft_target: the share of check tasks solved at which the warm start stops: a start for RL, not the result —
            enough that groups of samples differ in reward (signal), far from 1 (something to learn).
        seed: seeds weight init and the warm start's task streams (string-seeded, :mod:`rlrun.model.demonstrations`).
        envs: :func:`envs_fingerprint` of the envs the warm start draws from (``""``: not given yet).
    """

    max_position_embeddings: int = 512
    vocab_rows: int = 4096
    sft_steps: int = 1000
    sft_max_tokens: int = 1_000_000
    sft_batch_size: int = 64
    sft_batch_tokens: int = 4096
    sft_lr: float = 5e-3
    sft_check_every: int = 25
    sft_check_tasks: int = 64
    sft_target: float = 0.25
    seed: int = 1234
    format_version: int = 1
    envs: str = ""


def envs_fingerprint(specs: Sequence[EnvSpec]) -> str:
    """What of the envs ``specs`` the ``tiny`` model's bytes depend on, as one JSON line.

    Per env, in order: ``name``, ``weight``, ``args`` and, when the env has ``fingerprint()`` (a digest
    of the data its tasks come from, e.g. a dataset's files), its value, so that editing a dataset
    rebuilds the model. Builds each env (:func:`rlrun.envs.make_env`; its errors propagate).
    """
    from rlrun.envs import make_env

    items = []
    for spec in specs:
        env = make_env(spec)
        fingerprint = getattr(env, "fingerprint", None)
        items.append(
            {
                "name": spec.name,
                "weight": spec.weight,
                "args": spec.args,
                "fingerprint": fingerprint() if callable(fingerprint) else None,
            }
        )
    return json.dumps(items, sort_keys=True, separators=(",", ":"), default=str)
