"""The mismatch probe of a policy version: token sequences with the trainer's logprobs under the published
weights.

Why: the trainer's ``mismatch_kl_on_policy`` compares its logprobs with vLLM's on the samples of the weights
it holds, and with ``max_off_policy_steps ≥ 1`` a batch holds none (the trainer trains step ``s`` on weights
``s − 1`` while the samples of ``s − 1`` are still being generated): in the default asynchronous setting the
one signal of a trainer–sampler mismatch never existed (issue 47: None at every step, while a rollout server
that silently kept its old weights drove ``mismatch_kl`` to 1.9 and ``ratio_max`` to 140). The probe compares
the same weights on both sides, whatever the staleness: when the trainer publishes version ``N`` it writes,
beside the weights, a few sequences of the batch it just trained (prompt and sampled completion) with the
log-probabilities its new weights give their sampled tokens (``probe.json``); once a rollout server holds
``N`` the orchestrator asks it for the same log-probabilities (vLLM's prompt logprobs, one prefill) and takes
:func:`mismatch_kl` over them. Both at temperature 1 and over the whole vocabulary: vLLM's prompt logprobs
skip the sampling processors (``gpu_model_runner. _get_prompt_logprobs_dict``, vLLM 0.32), so the probe
measures the weights and the model code, not the sampling settings (which the batch's own logprobs already
carry).

The file is written by the trainer and read by the orchestrator (and the fake rollout server), so its format
lives here, apart from both.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

#: The file beside a broadcast's weights (``broadcasts/step_N/probe.json``).
PROBE_FILE = "probe.json"
#: Sequences in a probe: the first of the trained batch (a prefill each on every rollout server per update).
PROBE_SEQUENCES = 4
#: Largest log-ratio a token adds (``e³⁰`` nats already says the two sides sample different policies).
MAX_LOG_RATIO = 30.0


@dataclass(frozen=True)
class ProbeSequence:
    """One probe sequence.

    Attributes: ids: its token ids, prompt then completion. logprobs: per token, the trainer's log-probability
        (nats, temperature 1) of ``ids[j]`` given ``ids[:j]``, at
            the sampled tokens; None elsewhere (the prompt, an env's answer in a multi-turn episode, position
            0).
    """

    ids: list[int]
    logprobs: list[float | None]


def probe_data(sequences: list[ProbeSequence], version: int) -> dict:
    """The probe of policy ``version`` as ``probe.json`` holds it (and the weight sender's announcement:
    :mod:`rlrun.weight_requests`): ``{"version", "sequences": [{"ids", "logprobs"}, …]}``."""
    return {"version": version, "sequences": [{"ids": s.ids, "logprobs": s.logprobs} for s in sequences]}


def probe_from_data(data: object) -> list[ProbeSequence] | None:
    """The sequences of :func:`probe_data`'s ``data``; None when it is not a probe."""
    try:
        sequences = data["sequences"]  # type: ignore[index]
        return [ProbeSequence(list(s["ids"]), list(s["logprobs"])) for s in sequences]
    except (KeyError, TypeError):
        return None


def write_probe(directory: Path, sequences: list[ProbeSequence], version: int) -> None:
    """Write ``directory/probe.json`` for policy ``version`` (inside a :func:`rlrun.rundir.publish_dir`
    fill)."""
    (directory / PROBE_FILE).write_text(json.dumps(probe_data(sequences, version)))


def read_probe(directory: str | Path) -> list[ProbeSequence] | None:
    """The probe written beside the weights in ``directory``; None when there is none or it does not parse (a
    checkpoint part, the initial model, a broadcast written before the probe: nothing to compare)."""
    try:
        return probe_from_data(json.loads((Path(directory) / PROBE_FILE).read_text()))
    except (OSError, ValueError):
        return None


def mismatch_kl(trainer: list[float | None], served: list[float | None]) -> tuple[float, int]:
    """``(Σ k3, tokens)`` over the positions where both give a log-probability: the k3 estimate ``exp(d) − 1 −
    d`` with ``d = trainer − served`` (J. Schulman, "Approximating KL divergence", 2020; the trainer's
    ``rlrun.training.step.mismatch_kl``), so the mean is in nats per token, ≈ 0 for the same weights.

    Raises:
        ValueError: the two lists are not as long.
    """
    total, tokens = 0.0, 0
    for mine, theirs in zip(trainer, served, strict=True):
        if mine is None or theirs is None:
            continue
        d = mine - theirs
        d = max(min(d, MAX_LOG_RATIO), -MAX_LOG_RATIO)  # vLLM answers −9999 for a −inf prompt logprob
        total += math.expm1(d) - d
        tokens += 1
    return total, tokens
