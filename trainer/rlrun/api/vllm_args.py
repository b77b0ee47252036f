"""``spec.rollout.vllm_args``: the vLLM server arguments a user may add, and the ones rlrun owns.

rlrun starts each rollout server itself (:func:`rlrun.rollout.server.vllm_command`) and decides the
arguments its correctness rests on: what model is served and under which name, where it listens, the
dtype (the trainer's: weights it publishes are in its compute dtype), the seed, the weight-reload
extension, the logprobs the trainer's ratio needs, the sampling defaults, the GPUs' layout and memory,
and LoRA (``spec.model.lora``): whether adapters are served (``--enable-lora``), the largest rank
(``--max-lora-rank``, the smallest of vLLM's choices ≥ ``spec.model.lora.rank``: an adapter of a larger
rank could not be loaded, and ``rank`` ≤ 512, vLLM's largest, is checked by the spec itself), and which
modules serve it (``--lora-target-modules``, left unset by rlrun: a subset would silently serve the adapter
without the other modules' updates, a policy the trainer does not train).
Every other vLLM argument passes through unchanged, after rlrun's (``--enable-prefix-caching``,
``--max-num-seqs 128``, ``--kv-cache-dtype fp8``, …).

**Defaults a user may change.** With LoRA, rlrun passes ``--max-loras`` (adapters in one batch, each a slot of
LoRA buffers vLLM allocates at start) = ``max_off_policy_steps + 2``, and a ``--max-loras`` in ``vllm_args``,
coming after, wins. Why that many: a request names the newest adapter of its server at the time it is sent
(:mod:`rlrun.rollout.adapters`), at least the version it is labelled with, so the adapters requests out name span
the versions that may still train — ``max_off_policy_steps + 1`` of them — plus one for requests of the version
just past the staleness bound, cancelled at the next cut. Fewer only costs throughput, never correctness: vLLM
keeps a request waiting until its adapter gets a slot. ``--max-cpu-loras`` (adapters cached in host memory) is left
to vLLM's default, ``--max-loras``, and may be set too; vLLM refuses to start with one smaller than
``--max-loras``. An adapter evicted from that cache is loaded again from its directory, which rlrun keeps while the
adapter is loaded (``docs/design.md``, "LoRA").

An owned argument is refused in every spelling vLLM's parser (``FlexibleArgumentParser``, an argparse
parser) accepts: ``--flag value`` and ``--flag=value``, underscores for dashes (``--tensor_parallel_size``),
a short alias (``-tp``), and an abbreviation (argparse's ``allow_abbrev``: ``--tensor-par`` means
``--tensor-parallel-size`` when no other option starts so). ``tests/unit/test_vllm_args.py`` checks the
table against vLLM's own parser: every option string of an owned argument is refused, and no other option
of vLLM's is.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, Field

#: The arguments rlrun owns: each flag, its aliases (vLLM's other option strings for it), and where its value comes
#: from (the sentence a refusal gives).
OWNED: dict[str, tuple[tuple[str, ...], str]] = {
    "--model": ((), "the served model is spec.model"),
    "--revision": ((), "the model's revision is spec.model.revision"),
    "--tokenizer": ((), "the orchestrator and trainer tokenize with the model's own tokenizer"),
    "--served-model-name": ((), "rlrun's client asks for the name rlrun serves"),
    "--host": ((), "the launcher (rlrun local, the operator's pod) picks the address"),
    "--port": ((), "the launcher (rlrun local, the operator's pod) picks the port"),
    "--uds": ((), "rlrun's client connects to a host and port"),
    "--api-key": ((), "rlrun's client sends no key (the rollout servers are reached only by the run's pods)"),
    "--ssl-keyfile": ((), "rlrun's client speaks plain HTTP"),
    "--ssl-certfile": ((), "rlrun's client speaks plain HTTP"),
    "--grpc": ((), "rlrun's client speaks HTTP"),
    "--headless": ((), "rlrun's client needs the API server"),
    "--config": ((), "a config file could set any of the arguments rlrun owns: give each in vllm_args"),
    "--dtype": ((), "vLLM serves the trainer's compute dtype: set spec.trainer.precision"),
    "--seed": ((), "set spec.seed"),
    "--worker-extension-cls": ((), "rlrun's weight reload is the worker extension"),
    "--logprobs-mode": ((), "the trainer's importance ratio needs the processed logprobs"),
    "--generation-config": ((), "sampling is spec.sampling alone, never a model's generation_config.json"),
    "--override-generation-config": ((), "sampling is spec.sampling alone: set it there"),
    "--max-model-len": ((), "set spec.rollout.max_model_len"),
    "--tensor-parallel-size": (("-tp",), "the tensor parallelism is the pod's GPUs: set spec.rollout.gpus"),
    "--pipeline-parallel-size": (("-pp",), "a rollout pod's GPUs serve one tensor-parallel engine (spec.rollout.gpus)"),
    "--data-parallel-size": (("-dp",), "more servers are spec.rollout.replicas, each its own pod"),
    "--gpu-memory-utilization": (("--device-memory-utilization",), "set spec.rollout.gpu_memory_utilization"),
    "--enable-lora": (("--no-enable-lora",), "LoRA adapters are served when spec.model.lora is set"),
    "--max-lora-rank": ((), "it follows the adapter's rank: set spec.model.lora.rank"),
    "--lora-target-modules": ((), "every module the adapter wraps is served: set spec.model.lora.target_modules"),
    "--weight-transfer-config": ((), "weights reach the servers as spec.weights.transport says: set it there"),
}
#: Every option string of an owned argument (long flags and short aliases).
OWNED_OPTIONS = tuple(o for flag, (aliases, _) in OWNED.items() for o in (flag, *aliases))
#: Most arguments in ``vllm_args``, and most characters in one.
MAX_ARGS = 128
MAX_ARG_LENGTH = 4096


def owned_option(arg: str) -> str | None:
    """The owned argument (a key of :data:`OWNED`) that ``arg``, one item of an argv, would set in vLLM's
    parser, or None.

    ``arg`` is an option when it starts with ``-`` and is no number (``-1``): its name is what comes before any
    ``=``, underscores read as dashes in a long one (``--a_b`` is ``--a-b``, as vLLM's parser reads it); it sets
    an owned argument when its name is an option string of one or a prefix of one (an abbreviation; an
    ambiguous one would not start the server either).
    """
    if not arg.startswith("-") or re.fullmatch(r"-[\d.]+", arg):
        return None
    name = arg.split("=", 1)[0]
    long = name.startswith("--")
    if long:
        name = "--" + name[2:].replace("_", "-")
    if name in ("-", "--"):
        return None
    for flag, (aliases, _) in OWNED.items():
        # a long name abbreviates long options only, a short one short options only (argparse)
        if any(o.startswith(name) for o in (flag, *aliases) if o.startswith("--") == long):
            return flag
    return None


def _no_owned_args(args: list[str]) -> list[str]:
    problems = []
    for arg in args:
        name = arg.split("=", 1)[0]
        if arg.startswith("-") and re.search(r"\s", name):
            problems.append(f'{arg!r}: one argument per item (write ["--flag", "value"] or "--flag=value")')
            continue
        flag = owned_option(arg)
        if flag is not None:
            spelled = "" if name == flag else f" (as {name!r})"
            problems.append(f"{flag}{spelled} is set by rlrun: {OWNED[flag][1]}")
    if problems:
        raise ValueError("; ".join(problems))
    return args


#: ``spec.rollout.vllm_args``: no argument rlrun owns.
VllmArgs = Annotated[
    list[Annotated[str, Field(min_length=1, max_length=MAX_ARG_LENGTH)]],
    Field(max_length=MAX_ARGS),
    AfterValidator(_no_owned_args),
]


def _cel_list(values: list[str]) -> str:
    return "[" + ", ".join(f"'{v}'" for v in values) + "]"


#: The owned option strings as CEL matches them: every option string, long ones also with underscores.
_CEL_OPTIONS = sorted({*OWNED_OPTIONS, *(f"--{o[2:].replace('-', '_')}" for o in OWNED_OPTIONS if o.startswith("--"))})

#: The CEL rules of the rollout's schema (``rlrun.api.crd``): the owned arguments as written in full, with or
#: without ``=value`` and with underscores, and one argument per item. Abbreviations are left to the operator,
#: which refuses them with this module's own check (a regular expression for every prefix would exceed the API
#: server's estimated cost budget for a list of strings).
VLLM_ARGS_CEL_RULES: dict[tuple[str, ...], list[dict[str, str]]] = {
    ("vllm_args", "[]"): [
        {
            "rule": f"!{_cel_list(_CEL_OPTIONS)}.exists(o, self == o || self.startsWith(o + '='))",
            "message": "an argument rlrun sets itself (" + ", ".join(OWNED) + "): set it through the spec "
            '(docs/design.md, "Rollout servers on GPUs")',
        },
        {
            "rule": "!self.matches('^-[^=]*\\\\s')",
            "message": "one argument per item: write [--flag, value] or --flag=value",
        },
    ]
}
