"""The run directory's exchange between the orchestrator and the trainer's weight sender (``spec.weights.transport:
collective``, issue 50): a send request and its result, one JSON file each.

Layout::

    <run_dir>/weight_transfer/requests/<id>.json   {"server": url, "version": N}            (orchestrator)
    <run_dir>/weight_transfer/results/<id>.json    {"ok", "version", "sent_digest", "bytes",
                                                    "seconds", "error"}                     (trainer's rank 0)
    <run_dir>/weight_transfer/stopped.json         {"version": N}: the sender stopped        (trainer's rank 0)
    <run_dir>/weight_transfer/held.json            {"version", "attempt", "sender", "signature", "probe"}:
                                                    the version held, announced             (trainer's rank 0)
    <run_dir>/weight_transfer/beat.json            {"sender", "beat": n}: its heartbeat, each second
                                                                                            (trainer's rank 0)

Guarantee: each file is published whole (:func:`rlrun.rundir.write_file_atomic`: a reader sees nothing or all of
it), a request is answered at most once (the sender removes it once its result is written), and a result names the
version it sent, so an answer is never taken for another version's. Only the orchestrator writes requests and
reads results; only the trainer's sender reads requests and writes results (:mod:`rlrun.training.weight_sender`,
:mod:`rlrun.orchestrator.weight_transfer`).

The announcement (``held.json``) takes the broadcast files off the servers' critical path (issue 50, part 5):
the trainer announces a version as soon as its sender holds it, before it writes ``broadcasts/step_N/``, with
what the orchestrator would otherwise read from the files before it touches a server — the tensors' names,
dtypes and shapes (checked against the model as the files are) and the mismatch probe. The files follow
(checkpoints, catch-up and the fallback read them, and their ``meta.json`` names the sender that announced
them); a server whose send fails before they are written resumes unverified and is caught up from them
(:mod:`rlrun.rollout.weight_load`). The heartbeat lets the orchestrator tell a sender that is slow from one
that is gone (a trainer killed holds no ``stopped.json``) without comparing clocks across nodes: it counts,
and the orchestrator watches the count change on its own clock (:data:`SILENT_S`).

Beside them, the carriers the rollout client, the orchestrator and the trainer share (a foundation module, so the
process packages import it rather than each other): what was sent (:class:`Sent`), a failed send
(:class:`TransferFailed`), how one server's update went (:class:`WeightLoad`).
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from rlrun.probes import ProbeSequence, probe_data, probe_from_data
from rlrun.rundir import RunDir, write_file_atomic
from rlrun.weights_digest import Digest

#: The exchange's folder under the run directory.
FOLDER = "weight_transfer"


def requests_dir(run_dir: RunDir) -> Path:
    """Where the orchestrator's send requests are."""
    return run_dir.root / FOLDER / "requests"


def results_dir(run_dir: RunDir) -> Path:
    """Where the sender's results are."""
    return run_dir.root / FOLDER / "results"


@dataclass(frozen=True)
class SendRequest:
    """Send policy ``version`` to the rollout server at ``server`` (its base URL); ``id`` names both files."""

    server: str
    version: int
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])


@dataclass(frozen=True)
class SendResult:
    """What a send came to.

    Attributes:
        ok: the round ran to its end (the server is then verified against :attr:`sent_digest`).
        version: the version asked for.
        sent_digest: :meth:`rlrun.weights_digest.Digest.to_json` of what was sent (None when not ``ok``).
        bytes: the bytes broadcast.
        seconds: the round's phases (:attr:`rlrun.rollout.gloo_transfer.GlooTrainerWeightTransferEngine.seconds`,
            and ``init`` when the server's group was opened for it).
        error: why not ``ok`` (empty when ``ok``).
    """

    ok: bool
    version: int
    sent_digest: dict[str, int] | None = None
    bytes: int = 0
    seconds: dict[str, float] = field(default_factory=dict)
    error: str = ""


def write_request(run_dir: RunDir, request: SendRequest) -> Path:
    """Publish ``request`` (atomically); returns its file."""
    path = requests_dir(run_dir) / f"{request.id}.json"
    body = {"server": request.server, "version": request.version}
    write_file_atomic(path, json.dumps(body).encode(), fault_points=False)
    return path


def read_request(path: Path) -> SendRequest | None:
    """The request in ``path`` (None: gone, or not a request: a stray file)."""
    try:
        body: Any = json.loads(path.read_text())
        return SendRequest(str(body["server"]), int(body["version"]), path.stem)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def pending_requests(run_dir: RunDir) -> list[Path]:
    """The requests not answered yet, oldest name first (temporary files of a write under way are not listed)."""
    folder = requests_dir(run_dir)
    return sorted(folder.glob("*.json")) if folder.is_dir() else []


def write_result(run_dir: RunDir, request_id: str, result: SendResult) -> Path:
    """Publish the result of request ``request_id`` (atomically); returns its file."""
    path = results_dir(run_dir) / f"{request_id}.json"
    write_file_atomic(path, json.dumps(asdict(result)).encode(), fault_points=False)
    return path


def stopped_marker(run_dir: RunDir) -> Path:
    """The file a sender that stopped leaves (removed when one starts): no request is answered while it is there."""
    return run_dir.root / FOLDER / "stopped.json"


def write_stopped(run_dir: RunDir, version: int | None) -> None:
    """Say that the sender stopped, holding ``version``."""
    write_file_atomic(stopped_marker(run_dir), json.dumps({"version": version}).encode(), fault_points=False)


def read_result(run_dir: RunDir, request_id: str) -> SendResult | None:
    """The result of request ``request_id`` (None: not written yet).

    Raises:
        ValueError: a result file that is no result (the message names it).
    """
    path = results_dir(run_dir) / f"{request_id}.json"
    try:
        body = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    try:
        return SendResult(**body)
    except TypeError as exc:
        raise ValueError(f"{path}: not a weight-send result ({exc})") from None


#: How often the sender beats, seconds.
BEAT_S = 1.0

#: A sender whose beat has not changed for this long, seconds, is taken for gone (its trainer died).
SILENT_S = 15.0


def beat_file(run_dir: RunDir) -> Path:
    """The sender's heartbeat (module docstring)."""
    return run_dir.root / FOLDER / "beat.json"


def beat(run_dir: RunDir, sender: str, count: int) -> None:
    """Publish the ``count``-th beat of the sender ``sender`` (its id: a restarted sender's count starts
    again). Renamed in whole but not fsynced: a beat lost to a crash says what the crash says, and an fsync on
    a shared volume busy with a broadcast's write could stall it past :data:`SILENT_S`."""
    path = beat_file(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"sender": sender, "beat": count}))
    os.replace(tmp, path)


def read_beat(run_dir: RunDir) -> tuple[str, int] | None:
    """The sender's last beat: its id and count (None: none, or unreadable)."""
    try:
        body = json.loads(beat_file(run_dir).read_text())
        return str(body["sender"]), int(body["beat"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def announced_file(run_dir: RunDir) -> Path:
    """The sender's announcement of the version it holds (module docstring)."""
    return run_dir.root / FOLDER / "held.json"


#: ``{tensor name: (dtype, shape)}``: a version's tensors as the announcement names them
#: (``str(torch.dtype)``).
AnnouncedSignature = dict[str, tuple[str, tuple[int, ...]]]


@dataclass(frozen=True)
class Announced:
    """A version the trainer's sender holds, announced before its broadcast is written.

    Attributes:
        version: the policy version (trainer steps).
        attempt: the attempt whose trainer holds it.
        sender: the announcing sender's id (:attr:`rlrun.training.weight_sender.WeightSender.id`), also in the
            version's broadcast ``meta.json``: a restarted trainer that retrains the version writes another.
        signature: its tensors (:data:`AnnouncedSignature`).
        probe: its mismatch probe (:mod:`rlrun.probes`; None: none).
    """

    version: int
    attempt: int
    sender: str
    signature: AnnouncedSignature
    probe: list[ProbeSequence] | None = None


def announce(
    run_dir: RunDir,
    version: int,
    attempt: int,
    sender: str,
    signature: AnnouncedSignature,
    probe: list[ProbeSequence] | None,
) -> None:
    """Publish ``sender``'s announcement of ``version`` (atomically), replacing the one before."""
    body = {
        "version": version,
        "attempt": attempt,
        "sender": sender,
        "signature": {name: [dtype, list(shape)] for name, (dtype, shape) in signature.items()},
        "probe": None if probe is None else probe_data(probe, version),
    }
    write_file_atomic(announced_file(run_dir), json.dumps(body).encode(), fault_points=False)


def read_announced(run_dir: RunDir) -> Announced | None:
    """The version the sender last announced (None: none, or a file that is no announcement)."""
    try:
        body: Any = json.loads(announced_file(run_dir).read_text())
        tensors = body["signature"].items()
        signature = {str(n): (str(d), tuple(int(x) for x in shape)) for n, (d, shape) in tensors}
        probe = None if body.get("probe") is None else probe_from_data(body["probe"])
        return Announced(int(body["version"]), int(body["attempt"]), str(body["sender"]), signature, probe)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


#: The two ways weights reach a server (the metrics' ``path`` label).
WeightPath = Literal["filesystem", "collective"]
PATHS: tuple[WeightPath, ...] = ("filesystem", "collective")


class TransferFailed(RuntimeError):
    """An in-memory send that did not run to its end (the message says why): the server falls back to the files."""


class FilesPending(RuntimeError):
    """An in-memory send failed before the version's broadcast was written: the server resumed unverified,
    serving nothing, and is caught up from the files once they are there (the orchestrator benches it
    meanwhile)."""


@dataclass(frozen=True)
class Sent:
    """What the trainer sent to one server.

    Attributes:
        digest: the digest of the tensors sent (what the server must serve after it).
        bytes: the bytes broadcast.
        seconds: the round's phases as the trainer clocked them.
    """

    digest: Digest
    bytes: int
    seconds: dict[str, float] = field(default_factory=dict)


#: ``transfer(server URL, version) -> Sent``: has the trainer send ``version`` to the server in memory (the caller has
#: paused it). Raises :class:`TransferFailed` (or ``asyncio.TimeoutError``) when it did not.
InMemoryTransfer = Callable[[str, int], Awaitable[Sent]]


@dataclass
class WeightLoad:
    """How one server's weight update went (:attr:`rlrun.rollout.client.RolloutClient.last_load`, filled by
    :func:`rlrun.rollout.weight_load.load_weights`).

    Attributes:
        path: how the weights it now serves came: ``collective`` (in memory) or ``filesystem`` (None: it did not
            get them).
        seconds: that path's seconds (send or reload, prefix-cache reset, verification).
        bytes: what that path moved (the bytes sent; the broadcast's files).
        fallback: why the in-memory send was not used (None: it was, or none was tried).
    """

    path: WeightPath | None = None
    seconds: float = 0.0
    bytes: int = 0
    fallback: str | None = None
