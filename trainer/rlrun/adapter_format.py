"""A LoRA run's adapter directory (``spec.model.lora``): peft's ``save_pretrained`` layout, defined once.

Guarantee: one definition of peft's saved layout for its writer and its readers — the file names, the tensor names
(``base_model.model.<module path>.lora_A.weight`` / ``.lora_B.weight``; an embedding's ``lora_embedding_A`` /
``lora_embedding_B``), which modules a target list wraps (:func:`targeted`), the shapes an adapter of a model holds
(:func:`adapter_signature`), what its ``adapter_config.json`` must say (:func:`config_problems`) and whether a
directory holds an adapter rather than full weights (:func:`holds_adapter`). The trainer writes through it
(:mod:`rlrun.training.lora`), the orchestrator validates through it (:mod:`rlrun.orchestrator.weights`), checkpoints,
the fake server, ``rlrun eval`` and the tests read through it. Neither torch nor peft: the orchestrator and the fake
server import it.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

from rlrun.api.lora import LoraSpec

#: The adapter's tensors, in its broadcasts and trainer parts alike (the rollout servers load the directory as a
#: vLLM LoRA adapter).
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
#: peft's ``LoraConfig`` as ``save_pretrained`` writes it.
ADAPTER_CONFIG_FILE = "adapter_config.json"
#: The files of an adapter directory (vLLM loads a directory holding both).
ADAPTER_FILES = (ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE)
#: The prefix peft's saved layout puts before a module path (``PeftModel`` → ``LoraModel`` → the model).
PEFT_PREFIX = "base_model.model."

#: ``{tensor name: (safetensors dtype name, shape)}`` of a directory's ``*.safetensors`` files.
Signature = dict[str, tuple[str, tuple[int, ...]]]
#: ``{module path: (lora_A shape, lora_B shape)}`` of an adapter (:func:`adapter_signature`).
AdapterModules = dict[str, tuple[tuple[int, ...], tuple[int, ...]]]


def targeted(module: str, targets: Collection[str]) -> bool:
    """Whether peft wraps ``module`` (a dotted module path) for ``target_modules`` ``targets``: its name is one of
    them or ends with ``.`` + one (``peft.tuners.tuners_utils.check_target_module_exists``, peft 0.21)."""
    return any(module == t or module.endswith(f".{t}") for t in targets)


def holds_adapter(directory: Path) -> bool:
    """Whether a published directory (a broadcast or trainer part) holds a LoRA adapter rather than full weights:
    its :data:`ADAPTER_WEIGHTS_FILE` is there."""
    return (directory / ADAPTER_WEIGHTS_FILE).is_file()


def missing_files(directory: Path) -> list[str]:
    """The files of :data:`ADAPTER_FILES` ``directory`` lacks (``[]``: it holds a whole adapter)."""
    return [f for f in ADAPTER_FILES if not (directory / f).is_file()]


def tensor_names(module: str, embedding: bool = False) -> tuple[str, str]:
    """peft's saved names of ``module``'s ``A`` and ``B``: ``base_model.model.<module>.lora_A.weight`` and
    ``.lora_B.weight``; an embedding's (``embedding``) ``.lora_embedding_A`` and ``.lora_embedding_B``."""
    stem = PEFT_PREFIX + module
    if embedding:
        return f"{stem}.lora_embedding_A", f"{stem}.lora_embedding_B"
    return f"{stem}.lora_A.weight", f"{stem}.lora_B.weight"


def is_b(name: str) -> bool:
    """Whether the saved tensor ``name`` is a ``B`` factor (``lora_B`` or ``lora_embedding_B``): the one a server
    multiplies by the scaling ``alpha / r`` when it folds the adapter in (Hu et al. 2021, eq. 4)."""
    return ".lora_B." in name or name.endswith((".lora_B", ".lora_embedding_B"))


def adapter_signature(base: Signature, lora: LoraSpec) -> AdapterModules:
    """What peft's ``save_pretrained`` writes for a rank-``lora.rank`` adapter of the model whose weights are
    ``base``: ``{module: (lora_A shape, lora_B shape)}`` for every 2-D ``<module>.weight`` of ``base`` that a target
    wraps (:func:`targeted`), ``lora_A`` ``[r, in]`` and ``lora_B`` ``[out, r]`` for a weight ``[out, in]`` (Hu et al.
    2021, eq. 3: ``W + B·A``, ``B`` out × r, ``A`` r × in). An embedding's (``lora_embedding_A`` ``[r, rows]``,
    ``lora_embedding_B`` ``[cols, r]``) is derived from the same pair by :func:`expected_tensors`."""
    r = lora.rank
    return {
        name.removesuffix(".weight"): ((r, shape[1]), (shape[0], r))
        for name, (_, shape) in base.items()
        if name.endswith(".weight") and len(shape) == 2 and targeted(name.removesuffix(".weight"), lora.target_modules)
    }


def expected_tensors(modules: AdapterModules, present: Collection[str]) -> dict[str, tuple[int, ...]]:
    """``{tensor name: shape}`` an adapter of ``modules`` (:func:`adapter_signature`) holds: each module's two tensors
    (:func:`tensor_names`), an embedding's where ``present`` (the names the file holds) has its ``lora_embedding_A``:
    ``A`` ``[r, rows]`` and ``B`` ``[cols, r]`` of a weight ``[rows, cols]``."""
    expected: dict[str, tuple[int, ...]] = {}
    for module, (a, b) in modules.items():
        emb_a, emb_b = tensor_names(module, embedding=True)
        if emb_a in present:
            expected |= {emb_a: (a[0], b[0]), emb_b: (a[1], b[1])}
        else:
            name_a, name_b = tensor_names(module)
            expected |= {name_a: a, name_b: b}
    return expected


def config_problems(config: dict, lora: LoraSpec) -> list[str]:
    """How a peft ``adapter_config.json`` (parsed) differs from ``lora`` (what vLLM would serve differently), one
    sentence each (``[]``: it says what the spec says: ``peft_type`` LORA, ``r``, ``lora_alpha``, the set of
    ``target_modules``; no DoRA, rsLoRA, per-module rank or alpha, bias or ``modules_to_save``)."""
    targets = config.get("target_modules")
    problems = [
        f"{key} is {config.get(key)!r}, the spec says {want!r}"
        for key, want in (("peft_type", "LORA"), ("r", lora.rank), ("lora_alpha", lora.alpha))
        if config.get(key) != want
    ]
    if not isinstance(targets, list) or set(targets) != set(lora.target_modules):
        problems.append(f"target_modules is {targets!r}, the spec says {sorted(lora.target_modules)}")
    problems += [  # each a function vLLM serves as peft computes it, not the trainer's (alpha / r on every module)
        f"{key} is {config[key]!r}: plain LoRA expected"
        for key in ("use_dora", "use_rslora", "rank_pattern", "alpha_pattern")
        if config.get(key)
    ]
    if config.get("bias", "none") != "none":
        problems.append(f"bias is {config['bias']!r}: 'none' expected")
    if config.get("modules_to_save"):
        problems.append(f"modules_to_save is {config['modules_to_save']!r}: the adapter alone expected")
    return problems
