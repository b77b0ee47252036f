"""The table of owned vLLM arguments (:data:`rlrun.api.vllm_args.OWNED`) against the installed vLLM's server parser.

A vLLM upgrade that adds an alias of an owned argument, or an option rlrun would wrongly refuse, fails here. In
``processes/``: importing vLLM starts child processes (``cpuinfo`` runs ``file``).
"""

from __future__ import annotations

import pytest
from rlrun.api.vllm_args import OWNED, OWNED_OPTIONS, owned_option

from tests.support.vllm_parser import option_strings, parse_vllm_argv


@pytest.fixture(scope="module")
def vllm_options() -> dict[str, str]:
    return option_strings()


def test_every_option_string_vllm_has_for_an_owned_argument_is_refused(vllm_options):
    """Each owned flag exists in vLLM, and every other spelling vLLM has for the same argument is listed too."""
    for flag in OWNED:
        assert flag in vllm_options, f"vLLM has no {flag}: drop it from OWNED"
        dest = vllm_options[flag]
        spellings = [o for o, d in vllm_options.items() if d == dest]
        assert set(spellings) <= set(OWNED_OPTIONS), f"{flag}: vLLM also reads it as {spellings}"
        assert all(owned_option(o) == flag and owned_option(f"{o}=1") == flag for o in spellings)


def test_no_other_vllm_option_is_refused(vllm_options):
    wrongly = [o for o in vllm_options if o not in OWNED_OPTIONS and owned_option(o) is not None]
    assert wrongly == []


def test_what_is_refused_as_an_abbreviation_is_what_vllm_reads_as_the_owned_argument():
    """Not a hypothetical: vLLM's parser takes ``--tensor-par 2`` as tensor parallelism 2 and ``--sead`` nowhere."""
    assert parse_vllm_argv(["--tensor-par", "2", "--gpu-mem", "0.5"]).tensor_parallel_size == 2
    assert owned_option("--gpu-mem") == "--gpu-memory-utilization"
    with pytest.raises(SystemExit):
        parse_vllm_argv(["--sead", "1"])
    assert owned_option("--sead") is None
