"""The run identity: the settings a checkpoint must share with the run that resumes it, and the refusal naming each
that differs.

Guarantee: a resume continues only the run that wrote the checkpoint — same model (with LoRA, the same base weights
and adapter settings), envs and their data, group size, and the algorithm's settings but those
:data:`SAFE_TO_CHANGE`; anything else is refused by field with both values and why (:func:`check_compatible`,
:class:`~rlrun.errors.CheckpointMismatch`, permanent). The trainer, the orchestrator and the launcher's preflight
check the same identity (:mod:`rlrun.checkpoint` re-exports it).
"""

from __future__ import annotations

import logging
from typing import Any

from rlrun.errors import CheckpointMismatch

log = logging.getLogger(__name__)


#: Algorithm settings (``spec.<key>``) a resume may change, with why; every other key of :func:`algorithm_settings`
#: must equal the checkpoint's (``docs/algorithms.md``, "Resuming with other settings").
SAFE_TO_CHANGE: dict[str, str] = {
    "optimizer.max_grad_norm": "a cap on each step's gradient norm, read from the spec at every step: no state kept "
    "in a checkpoint depends on it, and lowering it is the usual answer to a gradient spike",
}
#: Settings a checkpoint written before issue 38 did not record (their values then are unknown: not compared); a
#: setting added since is compared with its default, the only value such a run could have had.
UNRECORDED_BEFORE_ISSUE_38 = frozenset(
    {
        "optimizer.lr",
        "optimizer.betas",
        "optimizer.eps",
        "optimizer.weight_decay",
        "optimizer.max_grad_norm",
        "loss.clip_low",
        "loss.clip_high",
        "advantage.std_normalize",
    }
)
#: Why a setting matters to a resume, where its name alone does not say it.
_WHY = {"max_steps": "the horizon of spec.optimizer.lr_schedule: its decay ends there"}


def _flat(values: dict[str, Any], prefix: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}.{key}"))
        else:
            out[f"{prefix}.{key}"] = value
    return out


def _settings(optimizer: Any, loss: Any, advantage: Any, max_steps: int) -> dict[str, Any]:
    out = {
        **_flat(optimizer.model_dump(mode="json"), "optimizer"),
        **_flat(loss.model_dump(mode="json"), "loss"),
        **_flat(advantage.model_dump(mode="json"), "advantage"),
        "max_steps": max_steps if optimizer.lr_schedule != "constant" else None,  # a constant rate has no horizon
    }
    out.pop("loss.std_normalize_advantages", None)  # an alias: compared as the advantage.std_normalize it sets
    # the clip as it acts: ratio_clip is the shorthand for both bounds, and unset they are 0.2 (LossSpec.epsilon_*)
    out.pop("loss.ratio_clip", None)
    out["loss.clip_low"], out["loss.clip_high"] = loss.epsilon_low, loss.epsilon_high
    return out


def algorithm_settings(spec: Any) -> dict[str, Any]:
    """``{"optimizer.lr": 3e-4, …, "loss.clip_low": 0.2, …, "advantage.baseline": "group_mean", …, "max_steps":
    N}`` of an ``RLRunSpec``: every field of ``spec.optimizer``, ``spec.loss`` and ``spec.advantage`` (nested ones
    dotted, JSON values; the clip as its two bounds, whether set by ``ratio_clip`` or ``clip_low``/``clip_high``), and
    ``max_steps`` when the LR schedule decays (its horizon; None when constant): what trains the policy, so what a
    resume must keep (:func:`check_compatible`, but :data:`SAFE_TO_CHANGE`)."""
    return _settings(spec.optimizer, spec.loss, spec.advantage, spec.max_steps)


def _default_settings() -> dict[str, Any]:
    from rlrun.api.algorithm import AdvantageSpec, LossSpec, OptimizerSpec

    return _settings(OptimizerSpec(), LossSpec(), AdvantageSpec(), 0)


def lora_settings(lora: Any) -> dict[str, Any] | None:
    """``spec.model.lora`` as a checkpoint records it (``{"rank", "alpha", "dropout", "target_modules"}``, the
    targets sorted, each once: peft matches them as a set, so a name listed twice is the same adapter); None without
    LoRA (full fine-tuning)."""
    if lora is None:
        return None
    return {**lora.model_dump(mode="json"), "target_modules": sorted(set(lora.target_modules))}


def run_identity(spec: Any, envs: dict[str, Any] | None = None, base_model: str | None = None) -> dict[str, Any]:
    """The settings a checkpoint must share with the run that resumes it (``RLRunSpec`` in): the model, the envs,
    ``group_size``, ``algorithm`` (:func:`algorithm_settings`) and ``lora`` (:func:`lora_settings`).

    With ``envs`` (the run's envs by name: the orchestrator's), also ``env_data``: each env's ``fingerprint()``
    where it has one (a dataset env's files), so a resume over changed task data is refused. With ``base_model``
    (a LoRA trainer's: :func:`rlrun.training.lora.base_model_identity`), also that: the exact base weights an adapter
    was trained on.
    """
    identity = {
        "model": spec.model.identity,
        "envs": sorted(e.name for e in spec.envs),
        "group_size": spec.group_size,
        "algorithm": algorithm_settings(spec),
        "lora": lora_settings(spec.model.lora),
    }
    if base_model is not None:
        identity["base_model"] = base_model
    if envs is not None:
        identity["env_data"] = {
            name: env.fingerprint() for name, env in sorted(envs.items()) if callable(getattr(env, "fingerprint", None))
        }
    return identity


def _algorithm_diffs(saved: dict[str, Any] | None, current: dict[str, Any], source: str) -> list[str]:
    """The algorithm settings that differ from a checkpoint's ``saved`` ones (None: written before they were
    recorded), as ``spec.<key>: …`` lines; a change :data:`SAFE_TO_CHANGE` allows is logged instead."""
    defaults = _default_settings()
    diffs = []
    for key, value in current.items():
        if saved is None and key in UNRECORDED_BEFORE_ISSUE_38:
            continue
        before = (saved or {}).get(key, defaults.get(key))  # a setting the checkpoint predates: its default
        if before == value:
            continue
        if key in SAFE_TO_CHANGE:
            log.warning(
                "resume: spec.%s changed since %s (%r → %r), allowed: %s",
                key,
                source,
                before,
                value,
                SAFE_TO_CHANGE[key],
            )
            continue
        why = f" ({_WHY[key]})" if key in _WHY else ""
        diffs.append(f"spec.{key}: checkpoint has {before!r}, manifest has {value!r}{why}")
    return diffs


def _describe_lora(lora: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in lora.items())


def _lora_diffs(saved: dict[str, Any] | None, current: dict[str, Any] | None) -> list[str]:
    """Why a checkpoint's LoRA settings (None: it trained every weight) do not fit the manifest's, by field."""
    if saved == current:
        return []
    if saved is None:
        return [
            f"spec.model.lora: the checkpoint trained every weight of the model (it has no spec.model.lora) and the "
            f"manifest trains a LoRA adapter ({_describe_lora(current)}); a LoRA run trains on the base model's "
            "weights, so resuming would drop everything trained: remove spec.model.lora to resume, or start a new run"
        ]
    if current is None:
        return [
            f"spec.model.lora: the checkpoint trained a LoRA adapter ({_describe_lora(saved)}) and the manifest has no "
            "spec.model.lora (full fine-tuning): its parts hold the adapter alone, not the model's weights; set "
            "spec.model.lora as the checkpoint's to resume, or start a new run"
        ]
    from rlrun.api.spec import LoraSpec

    defaults = lora_settings(LoraSpec()) or {}
    diffs = [
        f"spec.model.lora.{key}: checkpoint has {saved.get(key, defaults.get(key))!r}, manifest has {value!r}"
        for key, value in current.items()
        if saved.get(key, defaults.get(key)) != value  # a setting the checkpoint predates: its default
    ]
    if diffs:
        diffs.append("(the adapter's settings shape its state and what it computes: a resume keeps them)")
    return diffs


def check_compatible(
    saved: dict[str, Any] | None,
    spec: Any,
    source: str,
    envs: dict[str, Any] | None = None,
    base_model: str | None = None,
) -> None:
    """Refuse to resume from a checkpoint whose :func:`run_identity` differs from ``spec``'s (and ``envs``',
    ``base_model``'s).

    A checkpoint without an identity (older format) is accepted, and a field only one side has is not compared,
    but for the algorithm settings: one the checkpoint lacks counts as its default (it was added since), and a
    checkpoint written before they were recorded is compared on those added since only
    (:data:`UNRECORDED_BEFORE_ISSUE_38`). A change :data:`SAFE_TO_CHANGE` allows is logged (``WARNING``), not
    refused. ``lora`` is always compared: a checkpoint without it predates LoRA, so it trained every weight; a LoRA
    checkpoint resumed without LoRA, or the reverse, is refused saying so.

    Raises:
        CheckpointMismatch: naming each differing field with both values.
    """
    if not saved:
        return
    current = run_identity(spec, envs, base_model)
    diffs = [
        f"spec.{key}: checkpoint has {saved.get(key)!r}, manifest has {value!r}"
        for key, value in current.items()
        if key in saved and key not in ("env_data", "algorithm", "lora", "base_model") and saved[key] != value
    ]
    diffs += _lora_diffs(saved.get("lora"), current["lora"])
    if "base_model" in saved and "base_model" in current and saved["base_model"] != current["base_model"]:
        diffs.append(
            f"spec.model: the checkpoint's adapter was trained on the base weights {saved['base_model']!r}, this "
            f"trainer loads {current['base_model']!r}; an adapter fits only the exact weights it was trained on (a "
            "builtin model's recipe changed, or model.revision): start a new run"
        )
    for name, fingerprint in current.get("env_data", {}).items():
        before = saved.get("env_data", {}).get(name)
        if before is not None and before != fingerprint:
            diffs.append(
                f"env {name}: its data changed since the checkpoint (fingerprint {before[:12]} → {fingerprint[:12]}); "
                "the task stream would differ from the one the run trained on: restore the data, or start a new run"
            )
    algorithm = _algorithm_diffs(saved.get("algorithm"), current["algorithm"], source)
    if algorithm:
        safe = ", ".join(f"spec.{k}" for k in SAFE_TO_CHANGE)
        diffs += [*algorithm, f"(of the algorithm's settings a resume may change {safe}; for others, start a new run)"]
    if diffs:
        raise CheckpointMismatch(
            f"{source} belongs to a run with different settings; refusing to resume:\n  " + "\n  ".join(diffs)
        )
