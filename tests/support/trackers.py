"""Experiment trackers in tests: runs of the publisher over written metrics lines, and reading back what the
trackers wrote, offline: W&B's run files and TensorBoard's event files.

W&B (0.31) keeps an offline run in ``<run_dir>/wandb/offline-run-<time>-<id>/run-<id>.wandb``: the LevelDB log
format (32 KiB blocks of records, each a 7-byte header — CRC32, length, type: full / first / middle / last) after
a 7-byte file header (``:W&B``, magic, version), each record a ``wandb_internal_pb2.Record``. Its Python package no
longer ships a reader, so this one reads the format as documented by LevelDB (``doc/log_format.md``).
TensorBoard's files are read with TensorBoard's own ``EventAccumulator``, which applies ``purge_step``.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from rlrun.api.spec import RLRunSpec
from rlrun.rundir import RunDir
from rlrun.tracking.publisher import TrackerPublisher, read_state

from tests.support.fake_orchestrator import resume_report
from tests.support.manifests import manifest

#: Both trackers, W&B offline.
LOGGING = {"wandb": {"project": "rlrun-test", "mode": "offline"}, "tensorboard": {}}

_BLOCK = 32 * 1024
_HEADER = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _records(path: Path) -> list[bytes]:
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path}: not a W&B run file"
    out, partial, pos = [], b"", _HEADER
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # a block's trailer is zero-filled
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + _HEADER])
        if kind == 0 and length == 0:
            pos += left
            continue
        payload = data[pos + _HEADER : pos + _HEADER + length]
        pos += _HEADER + length
        if kind == _FULL:
            out.append(payload)
        elif kind == _FIRST:
            partial = payload
        elif kind == _MIDDLE:
            partial += payload
        elif kind == _LAST:
            out.append(partial + payload)
    return out


def wandb_offline_runs(run_dir: RunDir) -> list[tuple[str, list[tuple[int, dict[str, float]]]]]:
    """Each offline W&B run under ``<run_dir>/wandb``, oldest first: ``(run id, [(step, {key: value})])`` with the
    history rows in the order written (W&B's own ``_step``, ``_runtime``, ``_timestamp`` left out)."""
    from wandb.proto import wandb_internal_pb2

    runs = []
    for directory in sorted(run_dir.wandb.glob("offline-run-*")):
        paths = list(directory.glob("run-*.wandb"))
        run_id, rows = None, []
        if not paths:  # W&B's process was killed before it wrote anything
            runs.append((run_id, rows))
            continue
        [path] = paths
        for raw in _records(path):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(raw)
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run_id = record.run.run_id
            elif kind == "history":
                values = {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in record.history.item
                    if not (item.key or "/".join(item.nested_key)).startswith("_")
                }
                rows.append((record.history.step.num, values))
        runs.append((run_id, rows))
    return runs


def wandb_history(run_dir: RunDir) -> list[tuple[int, dict[str, float]]]:
    """The rows of the W&B run as W&B keeps them from its offline files in order: a resumed run starts past its
    last step, and a row whose step is less than the run's current one is ignored ("Steps must be monotonically
    increasing, so this data will be ignored"): a row not past the last one kept is ignored."""
    rows: list[tuple[int, dict[str, float]]] = []
    for _, history in wandb_offline_runs(run_dir):
        rows += [(step, dict(values)) for step, values in history if not rows or step > rows[-1][0]]
    return rows


def tensorboard_scalars(run_dir: RunDir, run_id: str | None = None) -> dict[str, list[tuple[int, float]]]:
    """``{tag: [(step, value)]}`` of every scalar of TensorBoard run ``run_id`` (default: the tracker run of
    ``tracking.json``) as TensorBoard shows them (purged steps gone)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_dir = run_dir.tensorboard / (run_id or read_state(run_dir)["run_id"])
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _append(path: Path, rows: list[dict]) -> None:
    with open(path, "a") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")


def attempt_lines(run_dir: RunDir, attempt: int, steps: range, evaluations: tuple[int, ...] | list[int] = ()) -> None:
    """What an attempt's processes append: an orchestrator and a trainer line per step, its evaluations."""
    _append(
        run_dir.metrics,
        [
            {
                "step": s,
                "attempt": attempt,
                "reward_mean": attempt + s / 100,
                "reward/env": 0.5,
                "restored": False,
                "per_env": {"env": {"finished": s}},
                "reward_std": None,
                "time": 1.0,
            }
            for s in steps
        ],
    )
    _append(
        run_dir.trainer_metrics,
        [{"step": s, "attempt": attempt, "loss": -attempt - s / 100, "checkpoint": True} for s in steps],
    )
    _append(
        run_dir.evaluations,
        [{"policy_version": v, "attempt": attempt, "greedy_solved": attempt + v / 100} for v in evaluations],
    )


def publisher(
    run_dir: RunDir,
    committed: list[int],
    attempt: int,
    run_uid: str | None = None,
    logging: dict = LOGGING,
    max_steps: int = 100,
) -> TrackerPublisher:
    """A publisher of a run of ``max_steps`` with ``logging`` that reads the newest complete checkpoint from
    ``committed[0]``."""
    spec = RLRunSpec.model_validate(manifest(logging=logging)["spec"])
    return TrackerPublisher(spec, run_dir, "my-run", run_uid, attempt, lambda: committed[0], max_steps, poll_s=0.05)


#: what a resume put back in the trackers' tests (a :func:`~tests.support.fake_orchestrator.resume_report`'s
#: fields): 3 groups (2 open, 1 requested) and 7 queued samples
PUT_BACK = dict(
    queued_traces=7,
    open_groups=2,
    requested_groups=1,
    finished_episodes_kept=3,
    members_requested=4,
    progress_only_would_lose=10,
)


def two_attempts(run_dir: RunDir, logging: dict) -> None:
    """Attempt 1 trains to step 7 with its newest checkpoint at 4 and is lost abruptly; attempt 2 resumes from 4
    and trains to 10 (its checkpoint). Attempt 1 evaluates versions 0, 2 and 6, attempt 2 versions 6 and 10."""
    committed = [-1]
    first = publisher(run_dir, committed, attempt=1, logging=logging)
    first.start(None)
    attempt_lines(run_dir, 1, range(1, 8), evaluations=[0, 2, 6])
    committed[0] = 4
    first.close()
    assert all(c["step"] == 4 for c in read_state(run_dir)["logged"].values())
    second = publisher(run_dir, committed, attempt=2, logging=logging)
    second.start(resume_report(4, **PUT_BACK))
    attempt_lines(run_dir, 2, range(5, 11), evaluations=[6, 10])
    committed[0] = 10
    second.close()
