"""Checkpoints: which step is complete, how each part is verified, and retention.

A step ``N`` is **complete** when both parts exist and verify:
``checkpoints/step_N/trainer/`` (published atomically by the trainer; its
``progress.json`` and ``model.safetensors`` parse — a LoRA run's ``adapter_config.json`` and
``adapter_model.safetensors`` instead; a part whose ``meta.json`` says
``format: "dcp"``, written by several trainer ranks, must also pass
:func:`rlrun.dcp_format.verify_sharded`: every DCP shard present and whole) and
``checkpoints/step_N/orchestrator/progress.pt`` (written atomically by the
orchestrator; schema version known, checksum matches). Resume always starts from
the newest complete step; a step that fails verification is skipped with a log
line naming the file and the reason, and the previous complete step is used.

``progress.pt`` is a ``torch.save`` of plain data only — ``{"schema_version",
"sha256", "payload"}`` where ``payload`` is a JSON string — so loading it with
``torch.load(weights_only=True)`` executes no code from the file.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors import safe_open

from rlrun.adapter_format import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, holds_adapter
from rlrun.dcp_format import SHARDED_FORMAT, verify_sharded
from rlrun.errors import CheckpointError
from rlrun.rundir import META_FILE, RunDir, read_json_part, step_dirs, write_file_atomic

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

PROGRESS_SCHEMA_VERSION = 1
PROGRESS_FILE = "progress.pt"
TRAINER_PROGRESS_FILE = "progress.json"
#: A full-weights run's weights; a LoRA run's (``spec.model.lora``) are the adapter alone, in its broadcasts and
#: trainer parts alike (:mod:`rlrun.adapter_format`: peft's layout).
WEIGHTS_FILE = "model.safetensors"


def _digest(payload: str, tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256(payload.encode())
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"|{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(memoryview(t.numpy()).cast("B"))  # no copy; hashlib releases the GIL on large buffers
    return h.hexdigest()


def write_progress(fh, state: dict[str, Any], tensors: dict[str, torch.Tensor] | None = None) -> None:
    """Serialize orchestrator ``state`` (JSON-compatible) and bulk ``tensors`` into ``progress.pt`` format,
    written to the binary file ``fh``.

    Token ids, logprobs and per-sample numbers travel as tensors (compact, cheap to checksum);
    everything else as one JSON string. The SHA-256 covers both. ``torch.save`` straight to a
    file releases the GIL while writing (measured: 1.3 ms longest event-loop stall for 78 MB,
    against 20 ms through a ``BytesIO``).
    """
    import torch  # here: rlrun local reads the checkpoint rules without loading torch (≈ 1.5–3 s)

    tensors = {k: v.detach().cpu().contiguous() for k, v in (tensors or {}).items()}
    payload = json.dumps(state, separators=(",", ":"), sort_keys=True)
    torch.save(
        {
            "schema_version": PROGRESS_SCHEMA_VERSION,
            "sha256": _digest(payload, tensors),
            "payload": payload,
            "tensors": tensors,
        },
        fh,
    )


def encode_progress(state: dict[str, Any], tensors: dict[str, torch.Tensor] | None = None) -> bytes:
    """:func:`write_progress` into bytes."""
    buf = io.BytesIO()
    write_progress(buf, state, tensors)
    return buf.getvalue()


def decode_progress(data: bytes, source: str) -> dict[str, Any]:
    """Inverse of :func:`encode_progress`: the state, with the tensors under ``state["tensors"]``.

    Raises:
        CheckpointError: unreadable file, unknown schema version, or checksum mismatch.
    """
    import torch

    try:
        obj = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception as exc:
        raise CheckpointError(f"{source}: unreadable ({type(exc).__name__}: {exc})") from None
    if not isinstance(obj, dict) or "payload" not in obj:
        raise CheckpointError(f"{source}: not an rlrun progress file")
    version = obj.get("schema_version")
    if version != PROGRESS_SCHEMA_VERSION:
        raise CheckpointError(f"{source}: schema version {version}, this rlrun reads {PROGRESS_SCHEMA_VERSION}")
    payload = obj["payload"]
    tensors = obj.get("tensors") or {}
    if _digest(payload, tensors) != obj.get("sha256"):
        raise CheckpointError(f"{source}: checksum mismatch (file is corrupt)")
    state = json.loads(payload)
    state["tensors"] = tensors
    return state


def save_orchestrator_progress(
    run_dir: RunDir, step: int, state: dict[str, Any], tensors: dict[str, torch.Tensor] | None = None
) -> Path:
    """Write ``checkpoints/step_N/orchestrator/progress.pt`` atomically (fsync, rename, dir fsync)."""
    path = run_dir.orchestrator_checkpoint(step) / PROGRESS_FILE
    write_file_atomic(path, lambda fh: write_progress(fh, state, tensors))
    return path


def load_orchestrator_progress(run_dir: RunDir, step: int) -> dict[str, Any]:
    """Read and verify the orchestrator part of step ``step``.

    Raises:
        CheckpointError: missing or invalid.
    """
    path = run_dir.orchestrator_checkpoint(step) / PROGRESS_FILE
    if not path.is_file():
        raise CheckpointError(f"{path}: missing")
    return decode_progress(path.read_bytes(), str(path))


def part_format(root: Path) -> str | None:
    """``meta.json``'s ``format`` of the part ``root`` (None: unsharded, or no readable ``meta.json``)."""
    try:
        meta = json.loads((root / META_FILE).read_text())
    except (OSError, ValueError):
        return None
    return meta.get("format") if isinstance(meta, dict) else None


def load_trainer_progress(run_dir: RunDir, step: int) -> dict[str, Any]:
    """Read and verify the trainer part of step ``step``: its ``progress.json`` and weights header (a LoRA part's: the
    adapter's, and its config parses).

    Raises:
        CheckpointError: missing, unparsable, or for another step.
    """
    root = run_dir.trainer_checkpoint(step)
    progress = root / TRAINER_PROGRESS_FILE
    data = read_json_part(progress)
    if data.get("step") != step:
        raise CheckpointError(f"{progress}: says step {data.get('step')}, expected {step}")
    if part_format(root) == SHARDED_FORMAT:
        # A part written by several ranks: its DCP shards must be whole too (the full weights file
        # beside them, checked below, is what the orchestrator loads into vLLM).
        verify_sharded(root)
    weights = root / WEIGHTS_FILE
    if not weights.is_file() and holds_adapter(root):  # a LoRA run's part: the adapter alone
        weights = root / ADAPTER_WEIGHTS_FILE
        read_json_part(root / ADAPTER_CONFIG_FILE)
    if not weights.is_file():  # safetensors' own message would name the file a second time
        raise CheckpointError(f"{weights}: missing")
    try:
        with safe_open(str(weights), framework="pt") as fh:
            if not list(fh.keys()):
                raise CheckpointError(f"{weights}: holds no tensors")
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"{weights}: unreadable ({str(exc).replace(str(weights), 'the file')})") from None
    return data


@dataclass(frozen=True)
class CompleteCheckpoint:
    """A verified complete step: its number and both parts' progress data."""

    step: int
    trainer: dict[str, Any]
    orchestrator: dict[str, Any]


def latest_complete_checkpoint(run_dir: RunDir) -> CompleteCheckpoint | None:
    """The newest step whose trainer and orchestrator parts both verify, or None.

    Steps that fail verification are logged (``WARNING``, with file and reason) and skipped.
    """
    for step in sorted(step_dirs(run_dir.checkpoints), reverse=True):
        try:
            trainer = load_trainer_progress(run_dir, step)
            orchestrator = load_orchestrator_progress(run_dir, step)
        except CheckpointError as exc:
            log.warning("checkpoint step %d is not usable, falling back to an older one: %s", step, exc)
            continue
        return CompleteCheckpoint(step, trainer, orchestrator)
    return None


def complete_steps(run_dir: RunDir) -> list[int]:
    """Steps whose two parts are both present (cheap existence check, no verification), ascending."""
    return sorted(
        n
        for n, p in step_dirs(run_dir.checkpoints).items()
        if (p / "trainer" / TRAINER_PROGRESS_FILE).is_file() and (p / "orchestrator" / PROGRESS_FILE).is_file()
    )


#: Verification results of orchestrator parts by (path, mtime ns, size): each file is checked once.
_verified: dict[tuple[str, int, int], bool] = {}


def _file_key(path: Path) -> tuple[str, int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return (str(path), st.st_mtime_ns, st.st_size)


def mark_verified(path: Path) -> None:
    """Record that the ``progress.pt`` at ``path`` is good (its writer just wrote and fsynced it)."""
    key = _file_key(path)
    if key is not None:
        _verified[key] = True


def usable_steps(run_dir: RunDir) -> list[int]:
    """Complete steps whose two parts verify, ascending (what a resume may start from).

    The trainer part is checked every time (its header only); an orchestrator part's checksum
    once per file version (cached by path, mtime and size), so calling this after every save is
    cheap. A step that fails is logged (``WARNING``) when first seen.
    """
    usable = []
    for step in complete_steps(run_dir):
        progress = run_dir.orchestrator_checkpoint(step) / PROGRESS_FILE
        key = _file_key(progress)
        try:
            load_trainer_progress(run_dir, step)
        except CheckpointError as exc:
            log.warning("checkpoint step %d is not usable: %s", step, exc)
            continue
        if key is not None and key not in _verified:
            _verified[key] = _verifies(run_dir, step)
        if key is not None and _verified[key]:
            usable.append(step)
    return usable


def _verifies(run_dir: RunDir, step: int) -> bool:
    try:
        load_orchestrator_progress(run_dir, step)
    except CheckpointError as exc:
        log.warning("checkpoint step %d is not usable: %s", step, exc)
        return False
    return True


def prune_checkpoints(run_dir: RunDir, keep_last: int) -> list[int]:
    """Delete all but the ``keep_last`` newest **usable** steps (both parts verify), and every other
    step older than the newest usable one (incomplete or damaged: a crash left it; it can never be
    resumed from). Steps newer than the newest usable one are left alone (being written, or to be
    skipped with a warning at resume). Returns the deleted steps.

    Verifying matters: a torn newer part counted as complete would push the only good
    checkpoint out of retention, and the next resume would start over from step 0.
    """
    usable = usable_steps(run_dir)
    keep = set(usable[-keep_last:])
    newest = usable[-1] if usable else None
    removed = []
    for n, p in step_dirs(run_dir.checkpoints).items():
        if n in keep or newest is None or n > newest:
            continue
        shutil.rmtree(p, ignore_errors=True)
        if p.exists():  # something wrote into it meanwhile; the next prune tries again
            log.warning("checkpoint %s could not be removed completely", p)
            continue
        removed.append(n)
    return sorted(removed)
