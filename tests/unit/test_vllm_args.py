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
