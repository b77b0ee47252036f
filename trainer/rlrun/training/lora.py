"""LoRA on the trainer (``spec.model.lora``): the model wrapped by ``peft``, its adapter's state in peft's saved layout,
and the adapter directory the trainer publishes and checkpoints.

Guarantee: with an :class:`Adapter`, only the adapter's parameters (each wrapped linear layer's ``lora_A`` and
``lora_B``) are trainable; the base weights are frozen (``requires_grad`` False: no gradient, no optimizer state) and
never written. The state :func:`adapter_state` returns and :func:`save_adapter` writes is peft's ``save_pretrained``
layout (:mod:`rlrun.adapter_format`, its one definition) — ``adapter_config.json`` and ``adapter_model.safetensors``
with tensors named ``base_model.model.<module path>.lora_A.weight`` / ``.lora_B.weight`` (no adapter-name infix) — so
the directory loads with ``peft.PeftModel.from_pretrained(base, dir)`` and with vLLM's LoRA loader (``docs/design.md``,
"LoRA").

The model keeps its own class and names: peft injects its LoRA layers in place (``get_peft_model``), and the trainer
goes on calling the Hugging Face model itself (its LM head, transformer blocks and config where it found them), so
FSDP2 shards it as any model (:func:`~rlrun.training.distributed.shard_model`, after :func:`wrap`). The ``peft``
wrapper is kept beside it for what only it knows: the saved names and :class:`AdapterOff`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from safetensors.torch import load_file, save_file
from torch import nn

from rlrun.adapter_format import ADAPTER_WEIGHTS_FILE, PEFT_PREFIX
from rlrun.api.spec import LoraSpec, ModelSpec
from rlrun.errors import WeightsMismatch
from rlrun.training.distributed import DataParallel
from rlrun.training.lora_targets import require_wrappable


@dataclass(frozen=True)
class Adapter:
    """A model with a LoRA adapter injected (:func:`wrap`).

    Attributes:
        peft: the ``peft`` wrapper (``PeftModel``); ``peft.get_base_model()`` is the trainer's model itself.
        names: ``{saved name: the model's parameter name}`` of every adapter parameter, in one order on every rank
            (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` →
            ``model.layers.0.self_attn.q_proj.lora_A.default.weight``).
    """

    peft: PeftModel
    names: dict[str, str]

    @property
    def model(self) -> nn.Module:
        """The Hugging Face model the adapter is injected into (the one the trainer trains, FSDP2-sharded with
        ranks)."""
        return self.peft.get_base_model()

    @property
    def config(self) -> LoraConfig:
        """The adapter's ``LoraConfig``."""
        return self.peft.peft_config["default"]


def lora_config(lora: LoraSpec) -> LoraConfig:
    """``spec.model.lora`` as peft's ``LoraConfig`` (peft records the model's ``name_or_path``, the path or id it was
    loaded from, as ``base_model_name_or_path`` in ``adapter_config.json``)."""
    alpha = int(lora.alpha) if float(lora.alpha).is_integer() else lora.alpha  # the int peft and vLLM document
    return LoraConfig(
        r=lora.rank,
        lora_alpha=alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )


def wrap(model: nn.Module, lora: LoraSpec) -> Adapter:
    """Inject a LoRA adapter of ``lora``'s settings into ``model`` in place (before FSDP2 sharding) and freeze the
    rest. The adapter starts as peft initialises it: ``A`` Kaiming-uniform from torch's RNG (seed it for the same
    adapter on every rank), ``B`` zero, so the wrapped model computes what the base model does.

    Raises:
        ManifestError: a ``target_modules`` name selects no module, or one LoRA cannot wrap (permanent: every line
            names ``spec.model.lora.target_modules[i]``), checked before anything is wrapped.
    """
    require_wrappable(model, list(lora.target_modules), "(checked by the trainer with its model loaded)")
    wrapped = get_peft_model(model, lora_config(lora))
    live = {k: v for k, v in model.named_parameters() if v.requires_grad}
    saved = get_peft_model_state_dict(wrapped, state_dict={f"{PEFT_PREFIX}{k}": v for k, v in live.items()})
    by_id = {id(v): k for k, v in live.items()}
    names = {s: by_id[id(v)] for s, v in saved.items()}
    if sorted(names.values()) != sorted(live):  # a trainable parameter peft would not save: never trained unseen
        raise RuntimeError(f"peft saves {sorted(names.values())} of the trainable {sorted(live)}")
    return Adapter(wrapped, names)


def adapter_state(
    adapter: Adapter, dp: DataParallel, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor] | None:
    """The adapter's whole state in the saved layout (CPU tensors in ``dtype``; None: as trained, float32) on rank 0,
    None on the other ranks. With ranks a collective: every rank all-gathers each adapter parameter (``DTensor``
    ``full_tensor``) in the same order, the base weights never (the adapter is all that moves)."""
    params = dict(adapter.model.named_parameters())
    out = {}
    for saved, name in adapter.names.items():
        p = params[name].detach()
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        if dp.is_main:
            out[saved] = full.to("cpu", dtype=dtype or full.dtype, copy=True).contiguous()
    return out if dp.is_main else None


def save_adapter(directory: Path, state: dict[str, torch.Tensor], adapter: Adapter) -> None:
    """Write ``state`` (:func:`adapter_state`) and the adapter's config into ``directory`` as peft's
    ``save_pretrained`` does: ``adapter_model.safetensors`` (metadata ``format: pt``) and ``adapter_config.json``
    (``inference_mode`` true, as peft saves it)."""
    save_file(state, str(directory / ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})
    config = copy.copy(adapter.config)
    config.inference_mode = True
    config.save_pretrained(str(directory))


def load_adapter(adapter: Adapter, directory: Path) -> None:
    """Load the adapter weights of ``directory`` (saved layout) into the model, on every rank alike (each rank reads
    the file and keeps its shards: ``set_model_state_dict`` with full tensors).

    Raises:
        WeightsMismatch: names or shapes differ from the adapter's (another rank, other target modules).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    path = directory / ADAPTER_WEIGHTS_FILE
    state = load_file(str(path))
    params = dict(adapter.model.named_parameters())
    missing, unexpected = sorted(set(adapter.names) - set(state)), sorted(set(state) - set(adapter.names))
    reshaped = [
        f"{k} {tuple(v.shape)} (the adapter's: {tuple(params[adapter.names[k]].shape)})"
        for k, v in state.items()
        if k in adapter.names and tuple(v.shape) != tuple(params[adapter.names[k]].shape)
    ]
    if missing or unexpected or reshaped:
        raise WeightsMismatch(
            f"{path}: the adapter does not fit this run's (spec.model.lora): missing {missing[:4]}"
            f"{' …' if len(missing) > 4 else ''}, unexpected {unexpected[:4]}{' …' if len(unexpected) > 4 else ''}, "
            f"reshaped {reshaped[:4]}"
        )
    mapped = {adapter.names[k]: v for k, v in state.items()}
    set_model_state_dict(adapter.model, mapped, options=StateDictOptions(full_state_dict=True, strict=False))


def base_model_identity(model: ModelSpec, model_path: str) -> str:
    """What names the base model's exact weights, for a LoRA checkpoint's identity: ``spec.model.identity`` and, for a
    builtin model, the directory it was built into, whose name carries its recipe's hash (``tiny-reverse-<hash>``,
    :func:`rlrun.model.resolve.builtin_model_dir`: another recipe, another directory). A named model is pinned by
    ``model.revision``."""
    if model.builtin is not None:
        return f"{model.identity} ({Path(model_path).name})"
    return model.identity


class AdapterOff:
    """The policy with its adapter disabled (peft's ``disable_adapter``), in eval mode for the call: the base model,
    i.e. the run's starting weights (``B`` starts at zero), as the KL term's reference (:mod:`rlrun.training.reference`)
    at no memory cost. Called as the model is (keyword arguments), and gives the model's LM head and config."""

    def __init__(self, adapter: Adapter) -> None:
        self.adapter = adapter

    @property
    def config(self) -> object:
        """The model's config."""
        return self.adapter.model.config

    def get_output_embeddings(self) -> nn.Module:
        """The model's LM head (its patching by :func:`~rlrun.training.logprobs.head_returns_token_stats` acts on the
        policy's head, which this forward runs)."""
        return self.adapter.model.get_output_embeddings()

    def __call__(self, **kwargs: object) -> object:
        model = self.adapter.model
        training = model.training
        model.eval()
        try:
            with self.adapter.peft.disable_adapter():
                return model(**kwargs)
        finally:
            model.train(training)
