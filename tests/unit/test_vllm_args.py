"""``spec.rollout.vllm_args``: what rlrun owns is refused, naming the field and the setting that decides it, in
every spelling (``=value``, underscores, aliases, abbreviations); the rest passes through. The table itself is
checked against vLLM's own parser in ``tests/processes/test_vllm_args.py`` (importing vLLM starts children)."""

from __future__ import annotations

import pytest
from rlrun.api.vllm_args import OWNED
from rlrun.manifest import ManifestError

from tests.support.manifests import parse


def refusal(args: list[str]) -> list[str]:
    """The manifest errors of ``rollout.vllm_args: args`` (empty: accepted)."""
    try:
        parse(rollout={"vllm_args": args})
    except ManifestError as exc:
        return exc.errors
    return []


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--tensor-parallel-size", "2"], "--tensor-parallel-size"),
        (["--tensor-parallel-size=2"], "--tensor-parallel-size"),
        (["--tensor_parallel_size", "2"], "--tensor-parallel-size"),
        (["-tp", "2"], "--tensor-parallel-size"),
        (["-tp=2"], "--tensor-parallel-size"),
        (["--tensor-par", "2"], "--tensor-parallel-size"),  # argparse's abbreviation
        (["--dtype", "float16"], "--dtype"),
        (["--dtype=bfloat16"], "--dtype"),
        (["--enable-prefix-caching", "--model", "other/model"], "--model"),
        (["--port=9000"], "--port"),
        (["--host", "0.0.0.0"], "--host"),
        (["--served-model-name", "x"], "--served-model-name"),
        (["--worker-extension-cls", "my.Ext"], "--worker-extension-cls"),
        (["--logprobs-mode=raw_logprobs"], "--logprobs-mode"),
        (["--gpu-memory-utilization", "0.5"], "--gpu-memory-utilization"),
        (["--device-memory-utilization=0.5"], "--gpu-memory-utilization"),
        (["--max-model-len", "4096"], "--max-model-len"),
        (["--generation-config", "auto"], "--generation-config"),
        (["--config", "serve.yaml"], "--config"),
        (["-pp", "2"], "--pipeline-parallel-size"),
        (["--enable-lora"], "--enable-lora"),
        (["--no-enable-lora"], "--enable-lora"),
        (["--max-lora-rank", "64"], "--max-lora-rank"),
        (["--max_lora_rank=64"], "--max-lora-rank"),
        (["--lora-target-modules", "q_proj"], "--lora-target-modules"),
    ],
)
def test_an_owned_argument_is_refused_naming_the_field_and_where_it_is_set(args, flag):
    errors = refusal(args)
    assert len(errors) == 1 and errors[0].startswith(f"spec.rollout.vllm_args: {flag}"), errors
    assert OWNED[flag][1] in errors[0]


def test_the_dtype_and_parallelism_refusals_say_which_setting_decides():
    (error,) = refusal(["--dtype", "float16", "-tp", "4"])
    assert "set spec.trainer.precision" in error and "set spec.rollout.gpus" in error


def test_other_arguments_pass_through_unchanged():
    args = ["--enable-prefix-caching", "--max-num-seqs", "128", "--kv-cache-dtype=fp8", "-q", "fp8"]
    args += ["--max_num_batched_tokens", "8192", "--swap-space", "-1", "--tokenizer-mode", "auto"]
    assert parse(rollout={"vllm_args": args}).spec.rollout.vllm_args == args


def test_an_option_and_its_value_in_one_item_is_refused():
    (error,) = refusal(["--max-num-seqs 128"])
    assert "one argument per item" in error


def test_the_lora_refusals_point_at_spec_model_lora_and_its_slots_pass_through():
    (error,) = refusal(["--max-lora-rank", "512"])
    assert "set spec.model.lora.rank" in error
    assert refusal(["--max-loras", "4", "--max-cpu-loras", "8", "--lora-dtype", "bfloat16"]) == []


@pytest.mark.parametrize("rank", [0, 513, 1024])
def test_a_rank_no_vllm_server_can_serve_is_refused_naming_the_field(rank):
    """rlrun owns ``--max-lora-rank`` and starts vLLM with the smallest of its choices ≥ the rank, so a rank larger
    than the server's is one above 512, vLLM's largest: refused with the manifest."""
    with pytest.raises(ManifestError) as exc:
        parse(model={"builtin": "tiny-reverse", "lora": {"rank": rank}})
    (error,) = exc.value.errors
    assert error.startswith("spec.model.lora.rank:"), error
    assert parse(model={"builtin": "tiny-reverse", "lora": {"rank": 512}}).spec.model.lora.served_max_rank == 512
