"""vLLM's own command-line parser for its OpenAI-compatible server, built once per test session.

What ``python -m vllm.entrypoints.openai.api_server`` parses its argv with (``make_arg_parser`` over a
``FlexibleArgumentParser``), so tests read rlrun's argv and the refused ``vllm_args`` as vLLM reads them.
Importing it costs vLLM's import (5–12 s on 2 cores): only the tests that read an argv use it.
"""

from __future__ import annotations

import argparse
import functools


@functools.cache
def vllm_parser() -> argparse.ArgumentParser:
    """The installed vLLM's server parser (cached: build it once)."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser(description="vLLM OpenAI-Compatible RESTful API server."))


def parse_vllm_argv(argv: list[str]) -> argparse.Namespace:
    """``argv`` (the server's arguments, no program) as vLLM's server parses it; ``SystemExit`` on one it refuses."""
    return vllm_parser().parse_args(argv)


def option_strings() -> dict[str, str]:
    """Every option string of vLLM's server parser (``--tensor-parallel-size``, ``-tp``, …) → its ``dest``."""
    return {o: action.dest for action in vllm_parser()._actions for o in action.option_strings}
