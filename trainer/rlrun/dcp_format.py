"""The on-disk format of a sharded (DCP) trainer part: its layout, reading its metadata safely, and the
completeness rule's check for it (:func:`verify_sharded`).

Apart from the code that writes and loads such parts with a process group
(:mod:`rlrun.training.sharded_checkpoint`), so that :mod:`rlrun.checkpoint`, which every process
uses to find the newest complete checkpoint, reads it without importing the trainer.

Layout of a published part (e.g. ``checkpoints/step_N/trainer/``)::

    meta.json            rundir.write_meta: step, attempt, format "dcp", world_size, shards {file: bytes, sha256}
    dcp/.metadata        DCP's global metadata: every tensor's global shape and which file/offset holds each chunk
    dcp/__R_0.distcp     rank R's shard (DCP's FileSystemWriter naming; one file per writing rank)
    (anything the writer adds, e.g. the trainer's progress.json)

Safe loading (ARCHITECTURE invariant 5): DCP's ``FileSystemReader`` unpickles ``.metadata``;
here it is read by :func:`read_metadata` (the trainer's reader,
:class:`rlrun.training.sharded_checkpoint.SafeFileSystemReader`, calls it), whose unpickler resolves only DCP's
metadata classes, ``torch.Size``, dtypes and paths, so a crafted file cannot run code. Tensor data is
read as raw bytes and non-tensor values with ``torch.load(weights_only=True)`` (DCP's own reader).

Neither torch nor DCP is imported with this module (≈ 1.5 s and 3 s on 2 cores): ``rlrun local`` checks a run
directory's checkpoints through :mod:`rlrun.checkpoint` before it starts any process; they load when a part is read.
"""

from __future__ import annotations

import hashlib
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

from rlrun.errors import CheckpointError
from rlrun.rundir import META_FILE, read_json_part

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
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # "torch.strided" → torch.strided
    "torch": {"Size"},  # and dtypes, checked below
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only the globals DCP's ``.metadata`` uses (listed above); anything else is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        import torch  # here, not at import: the checkpoint rules are read where torch need not load (rlrun local)

        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in DCP metadata")


def read_metadata(path: Path) -> Metadata:
    """Unpickle DCP's ``.metadata`` at ``path`` with the allow-list unpickler.

    Raises:
        CheckpointError: missing, unreadable, or not DCP metadata; the message names ``path``.
    """
    from torch.distributed.checkpoint.metadata import Metadata

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


def sha256_of(path: Path) -> str:
    """The SHA-256 (hex) of the file at ``path``, read in 1 MiB chunks."""
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
        if deep and sha256_of(shard) != rec["sha256"]:
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
