"""Sharded trainer checkpoints with ``torch.distributed.checkpoint`` (DCP): each rank writes its part.

Guarantee: a sharded trainer part is either absent or whole, and whole means loadable by **any**
number of ranks. Every rank writes its own shard of the model and optimizer state into one
temporary directory; rank 0 renames it into place only after every rank's write returned
(:func:`rlrun.rundir.publish_dir`: fsync, rename, directory fsync), so a kill at any instant leaves
the previous checkpoint as it was. :func:`verify_sharded` is the completeness rule's check for
this format: it names the first file that is missing, torn or unreadable.

Layout of a published part (e.g. ``checkpoints/step_N/trainer/``)::

    meta.json            rundir.write_meta: step, attempt, format "dcp", world_size, shards {file: bytes, sha256}
    dcp/.metadata        DCP's global metadata: every tensor's global shape and which file/offset holds each chunk
    dcp/__R_0.distcp     rank R's shard (DCP's FileSystemWriter naming; one file per writing rank)
    (anything ``extra`` writes, e.g. the trainer's progress.json)

State saved: ``{"model": …, "optim": …}`` from ``torch.distributed.checkpoint.state_dict.get_state_dict``
— keys are fully qualified parameter names, the same for a plain and an FSDP2-sharded model, and
the optimizer state is keyed by those names too, so a part written by ``W`` ranks loads into
``W'`` ranks (2 → 1, 1 → 2): DCP plans each rank's reads from the global chunk table in
``.metadata`` (resharding).

Safe loading (ARCHITECTURE invariant 5): DCP's ``FileSystemReader`` unpickles ``.metadata``;
here it is read by :class:`SafeFileSystemReader`, whose unpickler resolves only DCP's metadata
classes, ``torch.Size``, dtypes and paths, so a crafted file cannot run code. Tensor data is
read as raw bytes and non-tensor values with ``torch.load(weights_only=True)`` (DCP's own reader).
"""

from __future__ import annotations

import hashlib
import logging
import pickle
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from rlrun.errors import CheckpointError
from rlrun.rundir import META_FILE, publish_dir, read_json_part, write_meta
from rlrun.training.distributed import DataParallel

log = logging.getLogger(__name__)

#: Subdirectory of a part that holds DCP's files.
SHARDED_DIR = "dcp"
#: DCP's global metadata file (``torch.distributed.checkpoint.filesystem._metadata_fn``).
METADATA_FILE = ".metadata"
#: ``meta.json`` ``format`` of a sharded part.
SHARDED_FORMAT = "dcp"
#: DCP's shard file suffix.
SHARD_SUFFIX = ".distcp"

_HASH_CHUNK = 1 << 20


# --- safe metadata reading ------------------------------------------------------------------------

_ALLOWED_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # "torch.strided" → torch.strided
    "torch": {"Size"},  # and dtypes, checked below
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}  # fmt: skip


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only the globals DCP's ``.metadata`` uses (listed above); anything else is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in DCP metadata")


def read_metadata(path: Path) -> Metadata:
    """Unpickle DCP's ``.metadata`` at ``path`` with the allow-list unpickler.

    Raises:
        CheckpointError: missing, unreadable, or not DCP metadata; the message names ``path``.
    """
    try:
        with open(path, "rb") as fh:
            metadata = _MetadataUnpickler(fh).load()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except Exception as exc:  # any unpickling failure means a torn or foreign file
        raise CheckpointError(f"{path}: unreadable ({type(exc).__name__}: {exc})") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise CheckpointError(f"{path}: not DCP checkpoint metadata ({type(metadata).__name__})")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with :func:`read_metadata`'s allow-list unpickler for ``.metadata``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # per-rank metadata is only written without rank coordination
            raise CheckpointError(f"{self.path}: per-rank DCP metadata is not supported")
        metadata = read_metadata(Path(self.path) / METADATA_FILE)
        if metadata.storage_meta is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata


# --- verification ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardedCheckpointInfo:
    """What :func:`verify_sharded` found.

    Attributes:
        path: the part directory.
        step / attempt: from ``meta.json``.
        world_size: ranks that wrote it.
        shards: ``{file name: bytes}`` of every shard file.
        entries: number of tensor chunks and byte objects ``.metadata`` indexes.
    """

    path: Path
    step: int
    attempt: int
    world_size: int
    shards: dict[str, int] = field(default_factory=dict)
    entries: int = 0


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def verify_sharded(part: str | Path, deep: bool = False) -> ShardedCheckpointInfo:
    """Check that the sharded part ``part`` is whole (the completeness rule's check for this format).

    Checks, in order: ``meta.json`` parses and says format ``"dcp"``; ``dcp/.metadata`` exists and
    parses (safe unpickler); every file it names exists and is long enough for every
    ``(offset, length)`` extent it records (a truncated, torn shard fails here); every shard in
    ``meta.json`` has its recorded size; with ``deep``, also its SHA-256 (reads every byte: for a
    resume decision on large models leave it off, the size checks catch torn writes).

    Returns:
        A :class:`ShardedCheckpointInfo`.

    Raises:
        CheckpointError: the first failed check; the message names the file and the reason.
    """
    part = Path(part)
    meta_path = part / META_FILE
    meta = read_json_part(meta_path)
    if not isinstance(meta, dict) or meta.get("format") != SHARDED_FORMAT or not isinstance(meta.get("shards"), dict):
        raise CheckpointError(f"{meta_path}: not a sharded ({SHARDED_FORMAT}) checkpoint part")
    root = part / SHARDED_DIR
    metadata = read_metadata(root / METADATA_FILE)
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or "/" in name or name.startswith("."):
            raise CheckpointError(f"{root / METADATA_FILE}: bad shard reference {name!r}")
        needed[name] = max(needed.get(name, 0), int(info.offset) + int(info.length))
    for name in sorted(needed):
        shard = root / name
        try:
            size = shard.stat().st_size
        except FileNotFoundError:
            raise CheckpointError(f"{shard}: missing (named by {root / METADATA_FILE})") from None
        if size < needed[name]:
            raise CheckpointError(f"{shard}: torn: {size} bytes, {METADATA_FILE} needs at least {needed[name]}")
    shards: dict[str, int] = {}
    for name, rec in sorted(meta["shards"].items()):
        shard = root / name
        try:
            size = shard.stat().st_size
        except FileNotFoundError:
            raise CheckpointError(f"{shard}: missing (listed in {meta_path})") from None
        if size != rec["bytes"]:
            raise CheckpointError(f"{shard}: {size} bytes, {meta_path} records {rec['bytes']}")
        if deep and _sha256(shard) != rec["sha256"]:
            raise CheckpointError(f"{shard}: checksum mismatch (file is corrupt)")
        shards[name] = size
    missing = sorted(set(needed) - set(shards))
    if missing:
        raise CheckpointError(f"{meta_path}: does not list shard {missing[0]} that {METADATA_FILE} names")
    return ShardedCheckpointInfo(
        path=part,
        step=int(meta["step"]),
        attempt=int(meta["attempt"]),
        world_size=int(meta.get("world_size", 1)),
        shards=shards,
        entries=len(metadata.storage_data),
    )


# --- save / load ----------------------------------------------------------------------------------


def _own_shards(root: Path, rank: int) -> dict[str, dict[str, Any]]:
    """``{file: {"bytes", "sha256"}}`` of the shard files ``rank`` wrote (``__<rank>_*.distcp``)."""
    return {
        f.name: {"bytes": f.stat().st_size, "sha256": _sha256(f)}
        for f in sorted(root.glob(f"__{rank}_*{SHARD_SUFFIX}"))
    }


@contextmanager
def _single_process_quiet(dp: DataParallel) -> Iterator[None]:
    """Silence DCP's "assuming the intent is to save/load in a single process" warning when that is the intent."""
    with warnings.catch_warnings():
        if not dp.distributed:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _broadcast(dp: DataParallel, value: Any) -> Any:
    """Rank 0's ``value`` on every rank (``broadcast_object_list``; pickles plain data only)."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _write_shards(state: dict[str, Any], root: Path, dp: DataParallel) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Every rank: ``dcp.save`` into ``root``, then hash its own files; gathered to rank 0.

    Returns:
        On rank 0, ``(shards, errors)``: every rank's ``{file: {bytes, sha256}}`` merged, and the
        ranks that could not read their files back; ``({}, [])`` elsewhere.

    Raises:
        Whatever ``dcp.save`` raises (on every rank: DCP propagates a rank's failure to all).
    """
    with _single_process_quiet(dp):
        dcp.save(state, storage_writer=FileSystemWriter(root), no_dist=not dp.distributed)
    try:
        mine: dict[str, Any] = {"files": _own_shards(root, dp.rank)}
    except OSError as exc:
        mine = {"error": f"rank {dp.rank}: {exc}"}
    if not dp.distributed:
        parts = [mine]
    else:
        parts = [None] * dp.world_size if dp.is_main else None
        dist.gather_object(mine, parts, dst=0)
        if not dp.is_main:
            return {}, []
    shards: dict[str, dict[str, Any]] = {}
    errors = []
    for p in parts:
        if "error" in p:
            errors.append(p["error"])
        else:
            shards.update(p["files"])
    return shards, errors


def save_sharded(
    final: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    dp: DataParallel,
    step: int,
    attempt: int,
    extra: Callable[[Path], None] | None = None,
    **meta_fields: Any,
) -> Path:
    """Publish the sharded checkpoint part ``final`` (layout in the module docstring). A collective:
    every rank calls it with the same arguments.

    Protocol: rank 0 creates the temporary directory (:func:`rlrun.rundir.publish_dir`) and
    broadcasts its path; every rank ``dcp.save``\\ s its shard into ``<tmp>/dcp/`` and hashes its
    own files; rank 0 gathers the hashes, writes ``meta.json`` (:func:`rlrun.rundir.write_meta`)
    and whatever ``extra(tmp)`` writes, then ``publish_dir`` fsyncs and renames; rank 0 finally
    broadcasts success or its error, so every rank returns or raises together.

    Args:
        final: the part directory to publish (replaced if it exists).
        model: the (FSDP2-sharded or plain) model; optimizer: its optimizer.
        dp: the group. step / attempt / meta_fields: recorded in ``meta.json``.
        extra: run on rank 0 with the temporary directory, to add files (the trainer's ``progress.json``).

    Returns:
        ``final`` as a ``Path``.

    Raises:
        CheckpointError: on a rank other than 0 when rank 0 failed (its message is included).
        Whatever failed on rank 0 (the temporary directory is removed, ``final`` is untouched).
    """
    final = Path(final)
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    if not dp.is_main:
        tmp = _broadcast(dp, None)
        if tmp is None:
            raise CheckpointError(f"{final}: rank 0 could not create the temporary directory")
        _write_shards(state, Path(tmp) / SHARDED_DIR, dp)
        outcome = _broadcast(dp, None)
        if outcome != "ok":
            raise CheckpointError(f"{final}: not published: {outcome}")
        return final

    stage = "start"

    def fill(tmp: Path) -> None:
        nonlocal stage
        if dp.distributed:
            _broadcast(dp, str(tmp))
        stage = "writing"
        shards, errors = _write_shards(state, tmp / SHARDED_DIR, dp)
        stage = "written"  # every rank now waits for rank 0's outcome
        if errors:
            raise CheckpointError(f"{tmp / SHARDED_DIR}: cannot read back a shard ({'; '.join(errors)})")
        write_meta(tmp, step, attempt, format=SHARDED_FORMAT, world_size=dp.world_size, shards=shards, **meta_fields)
        if extra is not None:
            extra(tmp)

    try:
        path = publish_dir(final, fill)
    except BaseException as exc:
        if dp.distributed and stage == "start":
            _broadcast(dp, None)
        elif dp.distributed and stage == "written":
            _broadcast(dp, f"rank 0: {type(exc).__name__}: {exc}")
        raise
    if dp.distributed:
        _broadcast(dp, "ok")
    return path


def load_sharded(
    part: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None, dp: DataParallel
) -> ShardedCheckpointInfo:
    """Load a sharded part into ``model`` (and ``optimizer``) on any number of ranks. A collective.

    Every rank verifies the part (:func:`verify_sharded`, shallow), then reads the chunks that
    overlap its own shards (``dcp.load`` plans the reads from ``.metadata``: a part written by
    ``W`` ranks loads into ``W'``), then ``set_state_dict`` puts them in place. The model must
    already be sharded (:func:`rlrun.training.distributed.shard_model`) and the optimizer built on
    its parameters; its hyper-parameters (lr, betas, …) are those saved.

    Returns:
        What :func:`verify_sharded` found.

    Raises:
        CheckpointError: the part is incomplete (names the file).
        torch.distributed.checkpoint.api.CheckpointException / RuntimeError: the saved tensors do
            not fit the model (other names or shapes).
    """
    part = Path(part)
    info = verify_sharded(part)
    reader = SafeFileSystemReader(part / SHARDED_DIR)
    if optimizer is None:
        state: dict[str, Any] = {"model": get_model_state_dict(model)}
        with _single_process_quiet(dp):
            dcp.load(state, storage_reader=reader, no_dist=not dp.distributed)
        set_model_state_dict(model, state["model"])
    else:
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        with _single_process_quiet(dp):
            dcp.load(state, storage_reader=reader, no_dist=not dp.distributed)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    log.info(
        "loaded sharded checkpoint %s (step %d, written by %d ranks) on %d ranks",
        part, info.step, info.world_size, dp.world_size,
    )  # fmt: skip
    return info
