"""The builtin ``tiny-reverse`` model's recipe: every setting that determines its bytes, hence its cache key.

Apart from :mod:`rlrun.model.tiny` (which builds the model with torch and transformers) so that
finding the model in the cache (:func:`rlrun.model.resolve.builtin_model_dir`) imports neither: a
process that only needs the path (``rlrun rollout --fake``, the launcher) starts in a fraction of
the time.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass


@dataclass(frozen=True)
class TinyModelRecipe:
    """Everything that determines the builtin model's bytes (its cache key).

    Attributes:
        hidden_size / intermediate_size / num_hidden_layers / num_attention_heads /
        num_key_value_heads / head_dim: Qwen3 shape.
        max_position_embeddings: context length in tokens.
        sft_steps: supervised warm-start steps (batches of ``sft_batch_size`` tasks).
        sft_lr: AdamW learning rate of the warm start.
        seed: seeds weight init and the warm-start task stream.
    """

    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    max_position_embeddings: int = 64
    sft_steps: int = 90
    sft_batch_size: int = 64
    sft_lr: float = 3e-3
    seed: int = 1234
    format_version: int = 2  # 2: the warm start draws no held-out (eval) text

    def cache_key(self) -> str:
        """Short stable name for this recipe, used as the cache directory name."""
        fields = json.dumps(self.__dict__, sort_keys=True)
        return hashlib.sha256(fields.encode()).hexdigest()[:12]
