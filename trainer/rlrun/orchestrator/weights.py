"""Bringing a new policy version to the rollout servers.

vLLM kills the whole server when a ``collective_rpc`` method raises, so weights
are validated here first: every ``*.safetensors`` file must parse and hold exactly
the tensor names and shapes of the reference (the initial model), each floating-point
where the reference's is (:func:`validate_weights_dir`). Only then does every server run its update
(:meth:`~rlrun.rollout.client.RolloutClient.update_weights`: no completion sent from its start to its resume; the
completions out answered first; pause(wait) → reload → reset prefix cache → resume).

A LoRA run (``spec.model.lora``) publishes adapters, and its reference is an :class:`AdapterReference`
(:func:`weights_reference` decides which a run has): an adapter directory must hold a peft ``adapter_config.json``
that says what the spec says (rank, alpha, target modules; plain LoRA) and an ``adapter_model.safetensors`` whose
tensors are exactly those peft writes for the base model's weights the targets wrap, shaped from the base model's
(:func:`validate_adapter_dir`; peft's layout and rules: :mod:`rlrun.adapter_format`). vLLM refuses a bad adapter with an
error rather than dying, but it would load one of another rank or scaling and serve a policy the trainer does not train.
Only then is it loaded on every server (:meth:`~rlrun.rollout.client.RolloutClient.update_adapter`: no pause).

Every server's update is **verified** before it counts: the digest its workers compute over what they hold
must equal the published files' (:mod:`rlrun.rollout.verification`; one
:class:`~rlrun.rollout.verification.Expected` per push, so the files are digested once per served dtype, off
the event loop). A server whose update is not verified is reported as ``unverified``: it gets no request until
an update to the current version is verified (the caller's catch-up asks again;
:mod:`rlrun.orchestrator.follower` refuses a server that fails again and again).

A server that cannot be reached during its update (a transport error: its node is going
away, or its endpoint was removed and its client closed meanwhile) does not fail the
update of the others: it is reported as ``unreachable`` and the caller takes it out of use
until it has the current weights (:meth:`rlrun.orchestrator.endpoints.RolloutPool.bench`).
A server that answers with an error is not unreachable: that error is raised.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx
from safetensors import safe_open

from rlrun.adapter_format import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_WEIGHTS_FILE,
    AdapterModules,
    Signature,
    adapter_signature,
    config_problems,
    expected_tensors,
    holds_adapter,
)
from rlrun.api.spec import LoraSpec, RLRunSpec
from rlrun.errors import WeightsError, WeightsMismatch
from rlrun.rollout.client import Expected, RolloutClient, WeightsUnverified
from rlrun.weight_requests import Announced, AnnouncedSignature, FilesPending, InMemoryTransfer, WeightLoad


def _file_signature(f: Path, sig: Signature) -> None:
    try:
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():  # noqa: SIM118 - safe_open has no __iter__
                sl = fh.get_slice(name)
                sig[name] = (str(sl.get_dtype()), tuple(sl.get_shape()))
    except Exception as exc:
        raise WeightsError(f"{f}: unreadable safetensors ({exc})") from None


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
        _file_signature(f, sig)
    return sig


#: safetensors dtype names of floating-point tensors (``safe_open(...).get_slice(name).get_dtype()``).
FLOATING_DTYPES = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"})


#: safetensors dtype names → the name a worker reports its served dtype by (``str(torch.dtype)``).
TORCH_DTYPES = {
    "F64": "torch.float64",
    "F32": "torch.float32",
    "F16": "torch.float16",
    "BF16": "torch.bfloat16",
}


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
    check_signature(sig, reference, str(path))
    return sig


def check_signature(sig: Signature, reference: Signature | None, where: str) -> None:
    """Check the tensors ``sig`` (of the weights ``where`` names) against ``reference`` as
    :func:`validate_weights_dir` does (skipped when None).

    Raises:
        WeightsMismatch: missing, extra or reshaped tensors, or a tensor whose dtype is of another kind.
    """
    if reference is None:
        return
    problems = [f"missing {n}" for n in reference if n not in sig]
    problems += [f"unexpected {n}" for n in sig if n not in reference]
    problems += [
        f"{n}: {sig[n]} != {reference[n]}"
        for n in sig
        if n in reference and (sig[n][1] != reference[n][1] or _kind(sig[n][0]) != _kind(reference[n][0]))
    ]
    if problems:
        raise WeightsMismatch(f"{where}: weights do not match the model: " + "; ".join(problems[:5]))


def announced_signature(announced: AnnouncedSignature) -> Signature:
    """An announced version's tensors (:class:`rlrun.weight_requests.Announced`: ``torch.bfloat16``) named
    as the files' are (``BF16``, …), to be checked against the model by :func:`check_signature`."""
    names = {torch_name: name for name, torch_name in TORCH_DTYPES.items()}
    return {n: (names.get(dtype, dtype), shape) for n, (dtype, shape) in announced.items()}


@dataclass(frozen=True)
class AdapterReference:
    """What every adapter directory of a LoRA run must hold (:func:`validate_adapter_dir`).

    Attributes:
        lora: the run's ``spec.model.lora`` (rank, alpha, target modules).
        modules: the modules the adapter wraps and the shapes of their ``lora_A``, ``lora_B``
            (:func:`rlrun.adapter_format.adapter_signature`); None when the base model's files are not at hand (a hub
            model id): then only the config and that the tensors parse are checked.
    """

    lora: LoraSpec
    modules: AdapterModules | None


#: A run's reference for its weight directories: the base model's signature (full weights), an
#: :class:`AdapterReference` (LoRA), or None (full weights, unchecked).
Reference = Signature | AdapterReference | None


def weights_reference(spec: RLRunSpec, model_path: str | Path) -> Reference:
    """The reference a run checks its weights directories against: with ``spec.model.lora`` an
    :class:`AdapterReference` (its shapes from ``model_path``'s weights when it is a directory), else the signature
    of ``model_path``'s weights (None when it is no directory). Reads files: call it off the event loop.

    Raises:
        WeightsError: the model directory's weights do not parse.
    """
    base = weights_signature(model_path) if Path(model_path).is_dir() else None
    if spec.model.lora is None:
        return base
    return AdapterReference(spec.model.lora, None if base is None else adapter_signature(base, spec.model.lora))


def validate_adapter_dir(path: str | Path, reference: AdapterReference) -> Signature:
    """Check the adapter directory ``path`` against ``reference``; returns its tensors' signature.

    Its ``adapter_config.json`` must parse and match the spec (:func:`rlrun.adapter_format.config_problems`); its
    ``adapter_model.safetensors`` must parse and hold, for each module of ``reference.modules``, exactly peft's two
    tensors (:func:`rlrun.adapter_format.expected_tensors`: ``base_model.model.<module>.lora_A.weight`` and
    ``.lora_B.weight``; an embedding's ``lora_embedding_A`` and ``lora_embedding_B``) of the expected shapes,
    floating-point, and no other tensor.

    Raises:
        WeightsError: a file missing or that does not parse.
        WeightsMismatch: a config that says another adapter, or missing, extra or reshaped tensors (up to five named).
    """
    path = Path(path)
    try:
        config = json.loads((path / ADAPTER_CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise WeightsError(f"{path / ADAPTER_CONFIG_FILE}: unreadable adapter config ({exc})") from None
    if not isinstance(config, dict):
        raise WeightsError(f"{path / ADAPTER_CONFIG_FILE}: not a JSON object")
    if problems := config_problems(config, reference.lora):
        raise WeightsMismatch(f"{path}: adapter does not match spec.model.lora: " + "; ".join(problems))
    if not holds_adapter(path):
        raise WeightsError(f"{path}: no {ADAPTER_WEIGHTS_FILE}")
    sig: Signature = {}
    _file_signature(path / ADAPTER_WEIGHTS_FILE, sig)
    if reference.modules is None:
        return sig
    expected = expected_tensors(reference.modules, sig)
    problems = [f"missing {n}" for n in expected if n not in sig]
    problems += [f"unexpected {n}" for n in sig if n not in expected]
    problems += [
        f"{n}: {sig[n]} != {expected[n]}"
        for n in sig
        if n in expected and (sig[n][1] != expected[n] or _kind(sig[n][0]) != "floating-point")
    ]
    if problems:
        raise WeightsMismatch(f"{path}: adapter does not fit the model: " + "; ".join(problems[:5]))
    return sig


def validate(path: str | Path, reference: Reference) -> Signature:
    """:func:`validate_adapter_dir` for an :class:`AdapterReference`, else :func:`validate_weights_dir`."""
    if isinstance(reference, AdapterReference):
        return validate_adapter_dir(path, reference)
    return validate_weights_dir(path, reference)


@dataclass(frozen=True)
class WeightPush:
    """What one weight update came to.

    Attributes:
        seconds: wall time of validation and every server's update, seconds.
        unreachable: the servers that could not be reached (base URL → the transport error), and those whose
            in-memory send failed before the version's files were written
            (:class:`~rlrun.weight_requests.FilesPending`): they may hold older or unknown weights and must
            not serve until they are given the current ones.
        unverified: the servers reached whose update was not verified (base URL → why: both digests): they
            serve no request until an update to the current version is (:mod:`rlrun.rollout.verification`).
        verified: the servers whose update is verified (base URLs).
        loads: how each server's weight update that ran went (the path its weights came by, seconds, bytes, a
            fallback from memory to the files: :class:`~rlrun.weight_requests.WeightLoad`; none for adapters).
    """

    seconds: float
    unreachable: dict[str, str] = field(default_factory=dict)
    unverified: dict[str, str] = field(default_factory=dict)
    verified: list[str] = field(default_factory=list)
    loads: dict[str, WeightLoad] = field(default_factory=dict)


def _unreachable(client: RolloutClient, error: BaseException) -> bool:
    # A closed client's request raises RuntimeError: its endpoint was removed while it updated. A send that
    # failed before the version's files were written leaves the server to be caught up from them, as one
    # unreachable is.
    return isinstance(error, (httpx.TransportError, FilesPending)) or client.closed


async def push_weights(
    clients: list[RolloutClient],
    path: str | Path,
    version: int,
    reference: Reference,
    transfer: InMemoryTransfer | None = None,
    announced: Announced | None = None,
) -> WeightPush:
    """Validate ``path`` then update every server to it as policy ``version``: an adapter update when
    ``reference`` is an :class:`AdapterReference` (a LoRA run), else a weight update — sent in memory by the
    trainer with ``transfer`` (``spec.weights.transport: collective``), the files in ``path`` its fallback
    (:mod:`rlrun.rollout.weight_load`). ``announced``: the trainer's announcement of ``version``; while
    ``path`` is not written yet, its tensors are validated instead of the files' (the files then come before
    any fallback reads them).

    Every server's update runs to its end even when another's fails, and is verified (module docstring).

    Raises:
        WeightsError: validation failed (no server was touched).
        RolloutError: a reachable server failed to reload (the first such error).
    """
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    written = announced is None or transfer is None or await asyncio.to_thread(Path(path).is_dir)
    if written:
        signature = await asyncio.to_thread(validate, path, reference)
    else:
        signature = announced_signature(announced.signature)  # type: ignore[union-attr]
        where = f"policy {version} as the trainer announced it"
        check_signature(signature, reference, where)  # type: ignore[arg-type]
    adapter = isinstance(reference, AdapterReference)
    where = str(Path(path).absolute()) if adapter else str(path)  # vLLM reloads an evicted adapter from it
    expected = Expected(where, adapter)
    published = {TORCH_DTYPES.get(dtype) for dtype, _ in signature.values()}
    # servers serve the dtype the trainer publishes in
    if written and len(published) == 1 and None not in published:
        expected.prefetch(published.pop())  # so the digest their reload is checked against is ready in time
    updates = (
        c.update_adapter(where, version, expected) if adapter else c.update_weights(where, version, expected, transfer)
        for c in clients
    )
    outcomes = await asyncio.gather(*updates, return_exceptions=True)
    push = WeightPush(0.0)
    for client, outcome in zip(clients, outcomes, strict=True):
        if outcome is not False and not adapter and getattr(client, "last_load", None) is not None:
            push.loads[client.base_url] = client.last_load
        if not isinstance(outcome, BaseException):
            push.verified.append(client.base_url)
        elif isinstance(outcome, WeightsUnverified):
            push.unverified[client.base_url] = str(outcome)
        elif isinstance(outcome, asyncio.CancelledError) or not _unreachable(client, outcome):
            raise outcome
        else:
            push.unreachable[client.base_url] = f"{type(outcome).__name__}: {outcome}"
    return replace(push, seconds=loop.time() - t0)
