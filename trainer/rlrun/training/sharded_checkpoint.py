"""Sharded trainer checkpoints with ``torch.distributed.checkpoint`` (DCP): each rank writes its part.

Guarantee: a sharded trainer part is either absent or whole, and whole means loadable by **any**
number of ranks. Every rank writes its own shard of the model and optimizer state into one
temporary directory; rank 0 renames it into place only after every rank's write returned
(:func:`rlrun.rundir.publish_dir`: fsync, rename, directory fsync), so a kill at any instant leaves
the previous checkpoint as it was. The layout on disk, its safe reading and the completeness rule's
check (:func:`~rlrun.dcp_format.verify_sharded`) are :mod:`rlrun.dcp_format`'s.

State saved: ``{"model": …, "optim": …}`` from ``torch.distributed.checkpoint.state_dict.get_state_dict``
— keys are fully qualified parameter names, the same for a plain and an FSDP2-sharded model, and
the optimizer state is keyed by those names too, so a part written by ``W`` ranks loads into
``W'`` ranks (2 → 1, 1 → 2): DCP plans each rank's reads from the global chunk table in
``.metadata`` (resharding).

Loading reads ``.metadata`` with :class:`~rlrun.dcp_format.SafeFileSystemReader` (no code runs from the file).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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

from rlrun.dcp_format import (
    METADATA_FILE,
    SHARD_SUFFIX,
    SHARDED_DIR,
    SHARDED_FORMAT,
    ShardedCheckpointInfo,
    read_metadata,
    sha256_of,
    verify_sharded,
)
from rlrun.errors import CheckpointError
from rlrun.rundir import publish_dir, write_meta
from rlrun.training.distributed import DataParallel

log = logging.getLogger(__name__)


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with :func:`rlrun.dcp_format.read_metadata`'s allow-list unpickler for ``.metadata``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # per-rank metadata is only written without rank coordination
            raise CheckpointError(f"{self.path}: per-rank DCP metadata is not supported")
        metadata = read_metadata(Path(self.path) / METADATA_FILE)
        if metadata.storage_meta is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata


# --- save / load ----------------------------------------------------------------------------------


def _own_shards(root: Path, rank: int) -> dict[str, dict[str, Any]]:
    """``{file: {"bytes", "sha256"}}`` of the shard files ``rank`` wrote (``__<rank>_*.distcp``)."""
    return {
        f.name: {"bytes": f.stat().st_size, "sha256": sha256_of(f)}
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
        part,
        info.step,
        info.world_size,
        dp.world_size,
    )
    return info
