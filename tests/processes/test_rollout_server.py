"""The argv a rollout server starts with (:func:`rlrun.rollout.server.vllm_command`), read by vLLM's own parser: what
rlrun means is what vLLM takes (the unit tests read the argv as strings). In ``processes/``: importing vLLM starts
child processes."""

from __future__ import annotations

import sys

from rlrun.rollout.server import WORKER_EXTENSION, vllm_command

from tests.support.manifests import parse
from tests.support.vllm_parser import parse_vllm_argv

SERVER = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]


def test_vllm_reads_a_gpu_servers_argv_as_one_tensor_parallel_engine_in_the_trainers_dtype():
    run = parse(
        model={"name": "Qwen/Qwen3-0.6B"},
        seed=7,
        rollout={
            "gpus": 8,
            "gpu_memory_utilization": 0.8,
            "max_model_len": 8192,
            "vllm_args": ["--enable-prefix-caching", "--max_num_seqs", "64"],
        },
    )
    argv = vllm_command(run.spec, "/models/qwen", "0.0.0.0", 8000, gpu=True, bf16=True)
    assert argv[:3] == SERVER
    args = parse_vllm_argv(argv[3:])
    assert (args.model, args.host, args.port, args.seed) == ("/models/qwen", "0.0.0.0", 8000, 7)
    assert (args.tensor_parallel_size, args.pipeline_parallel_size, args.data_parallel_size) == (8, 1, 1)
    assert (args.dtype, args.gpu_memory_utilization, args.max_model_len) == ("bfloat16", 0.8, 8192)
    assert (args.worker_extension_cls, args.logprobs_mode) == (WORKER_EXTENSION, "processed_logprobs")
    assert args.generation_config == "vllm" and args.enforce_eager is False
    assert args.enable_prefix_caching is True and args.max_num_seqs == 64


def test_vllm_reads_a_cpu_servers_argv_as_before():
    argv = vllm_command(parse().spec, "/models/tiny", "127.0.0.1", 8001, gpu=False, bf16=False)
    args = parse_vllm_argv(argv[3:])
    assert (args.tensor_parallel_size, args.dtype, args.enforce_eager, args.max_model_len) == (1, "float32", True, 64)


def test_vllm_reads_a_lora_servers_argv_with_the_user_s_max_loras_winning():
    run = parse(model={"builtin": "tiny-reverse", "lora": {"rank": 100}}, rollout={"vllm_args": ["--max-loras=7"]})
    args = parse_vllm_argv(vllm_command(run.spec, "/models/tiny", "127.0.0.1", 8001, gpu=False, bf16=False)[3:])
    assert (args.enable_lora, args.max_lora_rank, args.max_loras, args.max_cpu_loras) == (True, 128, 7, None)
