"""Bringing a new policy version to the rollout servers.

vLLM kills the whole server when a ``collective_rpc`` method raises, so weights
are validated here first: every ``*.safetensors`` file must parse and hold exactly
the tensor names and shapes of the reference (the initial model), each floating-point
where the reference's is (:func:`validate_weights_dir`). Only then does every server run its update
(:meth:`~rlrun.rollout.client.RolloutClient.update_weights`: no completion sent from its start to its resume; the
completions out answered first; pause(wait) → reload → reset prefix cache → resume).

A server that cannot be reached during its update (a transport error: its node is going
away, or its endpoint was removed and its client closed meanwhile) does not fail the
update of the others: it is reported as ``unreachable`` and the caller takes it out of use
until it has the current weights (:meth:`rlrun.orchestrator.endpoints.RolloutPool.bench`).
A server that answers with an error is not unreachable: that error is raised.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from safetensors import safe_open

from rlrun.errors import WeightsError, WeightsMismatch
from rlrun.rollout.client import RolloutClient

Signature = dict[str, tuple[str, tuple[int, ...]]]


def weights_signature(path: str | Path) -> Signature:
    """``{tensor name: (dtype, shape)}`` over every ``*.safetensors`` file in directory ``path``.

    Raises:
        WeightsError: no files, or a file whose header does not parse.
    """
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise WeightsError(f"{path}: no *.safetensors files")
    sig: Signature = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as fh:
                for name in fh.keys():  # noqa: SIM118 - safe_open has no __iter__
                    sl = fh.get_slice(name)
                    sig[name] = (str(sl.get_dtype()), tuple(sl.get_shape()))
        except Exception as exc:
            raise WeightsError(f"{f}: unreadable safetensors ({exc})") from None
    return sig


#: safetensors dtype names of floating-point tensors (``safe_open(...).get_slice(name).get_dtype()``).
FLOATING_DTYPES = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"})


def _kind(dtype: str) -> str:
    return "floating-point" if dtype in FLOATING_DTYPES else dtype


def validate_weights_dir(path: str | Path, reference: Signature | None) -> Signature:
    """Check ``path`` against ``reference`` (skipped when None); returns its signature.

    Names and shapes must equal the reference's; a dtype may differ between floating-point dtypes, not otherwise.
    Why: the trainer publishes its weights in the dtype it computes in and vLLM serves (bf16 under
    ``spec.trainer.precision`` bfloat16, float32 on a CPU: :mod:`rlrun.training.precision`), a checkpoint holds
    float32 master weights, and the initial model's files may be in either (Qwen3's are bf16, the builtin tiny
    models float32); vLLM's weight loaders copy each tensor into the parameter it serves, casting to that
    parameter's dtype, so a float tensor of any float dtype loads, while a missing, extra or reshaped one does not.

    Raises:
        WeightsError: no files, or one that does not parse.
        WeightsMismatch: missing, extra or reshaped tensors, or a tensor whose dtype is of another kind
            (up to five named).
    """
    sig = weights_signature(path)
    if reference is None:
        return sig
    problems = [f"missing {n}" for n in reference if n not in sig]
    problems += [f"unexpected {n}" for n in sig if n not in reference]
    problems += [
        f"{n}: {sig[n]} != {reference[n]}"
        for n in sig
        if n in reference and (sig[n][1] != reference[n][1] or _kind(sig[n][0]) != _kind(reference[n][0]))
    ]
    if problems:
        raise WeightsMismatch(f"{path}: weights do not match the model: " + "; ".join(problems[:5]))
    return sig


@dataclass(frozen=True)
class WeightPush:
    """What one weight update came to.

    Attributes:
        seconds: wall time of validation and every server's update, seconds.
        unreachable: the servers that could not be reached (base URL → the transport error):
            they may hold older weights and must not serve until they are given the current ones.
    """

    seconds: float
    unreachable: dict[str, str] = field(default_factory=dict)


def _unreachable(client: RolloutClient, error: BaseException) -> bool:
    # A closed client's request raises RuntimeError: its endpoint was removed while it updated.
    return isinstance(error, httpx.TransportError) or client.closed


async def push_weights(
    clients: list[RolloutClient], path: str | Path, version: int, reference: Signature | None
) -> WeightPush:
    """Validate ``path`` then update every server to it as policy ``version``.

    Every server's update runs to its end even when another's fails.

    Raises:
        WeightsError: validation failed (no server was touched).
        RolloutError: a reachable server failed to reload (the first such error).
    """
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await asyncio.to_thread(validate_weights_dir, path, reference)
    outcomes = await asyncio.gather(*(c.update_weights(str(path), version) for c in clients), return_exceptions=True)
    unreachable = {}
    for client, outcome in zip(clients, outcomes, strict=True):
        if not isinstance(outcome, BaseException):
            continue
        if isinstance(outcome, asyncio.CancelledError) or not _unreachable(client, outcome):
            raise outcome
        unreachable[client.base_url] = f"{type(outcome).__name__}: {outcome}"
    return WeightPush(loop.time() - t0, unreachable)
