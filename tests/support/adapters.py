"""LoRA adapter directories in peft's ``save_pretrained`` layout (:mod:`rlrun.adapter_format`), written without peft
(fast), for the tests of the adapter path (``tests/unit/test_weights.py`` checks that peft itself writes the same
names and shapes)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from rlrun.adapter_format import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, Signature, adapter_signature, tensor_names
from rlrun.api.spec import LoraSpec
from rlrun.rundir import publish_dir, write_meta
from safetensors.torch import save_file

#: A small model's weights: one attention projection, one MLP projection, an embedding and a norm.
BASE: Signature = {
    "model.embed_tokens.weight": ("F32", (10, 4)),
    "model.layers.0.self_attn.q_proj.weight": ("F32", (8, 4)),
    "model.layers.0.mlp.down_proj.weight": ("F32", (4, 16)),
    "model.norm.weight": ("F32", (4,)),
}
#: An adapter of :data:`BASE`'s two projections.
LORA = LoraSpec(rank=2, alpha=4.0, target_modules=["q_proj", "down_proj"])


def adapter_config(lora: LoraSpec, **overrides: Any) -> dict[str, Any]:
    """The fields of peft's ``adapter_config.json`` the rollout path reads, for ``lora`` (``overrides`` win)."""
    config = {"peft_type": "LORA", "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout}
    config |= {"target_modules": sorted(lora.target_modules), "bias": "none", "use_dora": False, "use_rslora": False}
    return config | overrides


def write_adapter(
    path: Path,
    lora: LoraSpec = LORA,
    base: Signature = BASE,
    tensors: dict[str, torch.Tensor] | None = None,
    **config: Any,
) -> Path:
    """An adapter directory at ``path`` for the model of weights ``base``: ``tensors`` (default: peft's for
    ``lora``, ``A`` random and ``B`` zero, as peft initialises them) and :func:`adapter_config` with ``config``."""
    path.mkdir(parents=True, exist_ok=True)
    if tensors is None:
        tensors = {}
        for module, (a, b) in adapter_signature(base, lora).items():
            name_a, name_b = tensor_names(module)
            tensors[name_a], tensors[name_b] = torch.randn(a), torch.zeros(b)
    save_file(tensors, str(path / ADAPTER_WEIGHTS_FILE))
    (path / ADAPTER_CONFIG_FILE).write_text(json.dumps(adapter_config(lora, **config)))
    return path


def publish_adapter(run_dir, step: int, attempt: int, lora: LoraSpec = LORA, base: Signature = BASE) -> Path:
    """``broadcasts/step_<step>/`` of a LoRA run as its trainer publishes it: an adapter and ``meta.json``."""

    def fill(tmp: Path) -> None:
        write_adapter(tmp, lora, base)
        write_meta(tmp, step, attempt)

    return publish_dir(run_dir.broadcast(step), fill)
