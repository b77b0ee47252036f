"""Which modules a LoRA adapter (``spec.model.lora``) may wrap, checked before anything is wrapped.

Guarantee: every ``target_modules`` name selects at least one module of the model, and only linear layers of the
transformer blocks (:data:`WRAPPABLE`, never the LM head); otherwise the run is refused naming
``spec.model.lora.target_modules[i]``, the nearest of the model's wrappable names and all of them. The trainer checks
its model as loaded (:func:`rlrun.training.lora.wrap`); ``rlrun local`` makes the same check before any process
starts (:func:`check_targets`, on the meta device). No ``peft`` here: the launcher's check imports this module alone.
"""

from __future__ import annotations

import difflib

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from rlrun.adapter_format import targeted
from rlrun.api.spec import RLRunSpec
from rlrun.manifest import ManifestError
from rlrun.model.resolve import pretrained_kwargs

#: Layer types a ``target_modules`` name may select: the linear layers peft's LoRA wraps (``nn.Linear``, GPT-2's
#: ``Conv1D``), but the LM head. Not the head: the trainer computes logprobs from its weight in chunks
#: (:mod:`rlrun.training.logprobs`), which an adapter there would bypass. Not the embeddings: they sit in FSDP2's root
#: unit, which stays gathered after a forward, where disabling the adapter for the KL reference (peft clears
#: ``requires_grad``) would not reach the sharded parameter. A name selecting anything else (a block) is refused.
WRAPPABLE = (nn.Linear, Conv1D)


def _wrappable(model: nn.Module, module: nn.Module) -> bool:
    return isinstance(module, WRAPPABLE) and module is not model.get_output_embeddings()


def wrappable_names(model: nn.Module) -> list[str]:
    """The last names of ``model``'s modules LoRA can wrap (:data:`WRAPPABLE`), sorted, once each
    (``["down_proj", "gate_proj", "k_proj", "o_proj", …]``)."""
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if name and _wrappable(model, m)})


def target_problems(model: nn.Module, targets: list[str]) -> list[str]:
    """Why each of ``targets`` cannot be wrapped, as ``spec.model.lora.target_modules[i]: …`` lines (``[]``: all can).

    A target selects the modules whose name is it or ends with ``.<target>`` (peft's rule for a list:
    :func:`rlrun.adapter_format.targeted`); it must select at least one module, and only :data:`WRAPPABLE` ones. A
    name selecting none is answered with the nearest of the model's wrappable names (``difflib``) and all of them.
    """
    modules = [(name, m) for name, m in model.named_modules() if name]
    wrappable = wrappable_names(model)
    problems = []
    for i, target in enumerate(targets):
        field = f"spec.model.lora.target_modules[{i}]"
        chosen = [(n, m) for n, m in modules if targeted(n, [target])]
        if not chosen:
            near = difflib.get_close_matches(target, wrappable, n=1, cutoff=0.0)
            hint = f"did you mean {near[0]!r}? " if near else ""
            problems.append(
                f"{field}: {target!r} names no module of {type(model).__name__}; {hint}its layers LoRA can wrap: "
                f"{', '.join(wrappable)}"
            )
            continue
        head = model.get_output_embeddings()
        others = sorted({type(m).__name__ for _, m in chosen if not isinstance(m, WRAPPABLE)})
        if any(m is head for _, m in chosen):
            problems.append(
                f"{field}: {target!r} names the LM head, which the trainer does not wrap (it computes logprobs from "
                f"the head's weight in chunks); its layers LoRA can wrap: {', '.join(wrappable)}"
            )
        elif others:
            problems.append(
                f"{field}: {target!r} names {', '.join(others)} modules, which the trainer does not wrap (LoRA goes on "
                f"the linear layers of the transformer blocks); its layers LoRA can wrap: {', '.join(wrappable)}"
            )
    return problems


def require_wrappable(model: nn.Module, targets: list[str], source: str) -> None:
    """Refuse ``targets`` when any cannot be wrapped in ``model`` (:func:`target_problems`).

    Raises:
        ManifestError: naming ``source`` (where the check ran) and one line per target refused (permanent).
    """
    if problems := target_problems(model, targets):
        raise ManifestError(source, problems)


def check_targets(spec: RLRunSpec, model_path: str) -> None:
    """The trainer's target check (:func:`target_problems`), made by ``rlrun local`` before any process starts
    (``LocalLauncher.check_model``): on the model built from its config on the meta device (no weights read, no
    memory; 0.03 s for an 8B Qwen3), so a misspelt target is refused in seconds, not after the rollout servers
    started. Nothing to check without ``spec.model.lora``, nor for a hub model id not in
    this machine's Hugging Face cache (nothing is downloaded here).

    Raises:
        ManifestError: a ``target_modules`` name selects no module, or one LoRA cannot wrap (as
            :func:`rlrun.training.lora.wrap`).
    """
    if spec.model.lora is None:
        return
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        # the config of the revision the run serves and trains; no download before the run starts
        config = AutoConfig.from_pretrained(model_path, local_files_only=True, **pretrained_kwargs(spec.model))
    except OSError:  # a hub id not in the cache here: the trainer checks it with its model loaded
        return
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    require_wrappable(model, list(spec.model.lora.target_modules), f"(checked against the model {model_path})")
