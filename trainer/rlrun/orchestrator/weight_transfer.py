"""The orchestrator's half of weights in memory (``spec.weights.transport: collective``, issue 50): asking the trainer
to send a version to a paused rollout server, refusing servers that cannot take it, and counting both paths.

Guarantee: the orchestrator stays the one writer of what each server serves (drain, pause, send, verify, resume:
:mod:`rlrun.rollout.weight_load`); the trainer only sends when asked. A request that the trainer answers ``ok:
false``, or does not answer within ``spec.weights.timeout_seconds`` + :data:`MARGIN_S`, or that a stopped sender can
never answer (:func:`rlrun.weight_requests.stopped_marker`), or one whose heartbeat stopped (a killed trainer:
:data:`rlrun.weight_requests.SILENT_S`), raises :class:`~rlrun.weight_requests.TransferFailed` — the server
then falls back to the broadcast files, or, before they are written, serves nothing until it is caught up from
them; it never serves unverified. A run with ``collective`` whose
servers lack vLLM's weight-transfer routes (no ``VLLM_SERVER_DEV_MODE=1``, an older vLLM) is refused at start with
one line naming ``spec.weights.transport`` (:func:`check_routes`), not left to fall back at every step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass, field

import httpx

from rlrun.errors import OrchestratorError
from rlrun.rundir import RunDir
from rlrun.weight_requests import (
    BEAT_S,
    PATHS,
    SILENT_S,
    SendRequest,
    Sent,
    TransferFailed,
    WeightLoad,
    read_beat,
    read_result,
    results_dir,
    stopped_marker,
    write_request,
)
from rlrun.weights_digest import Digest

#: Seconds the orchestrator waits for a result past ``spec.weights.timeout_seconds`` (the trainer's own limit of a
#: round): the sender's poll, the files' writes, an engine's opening.
MARGIN_S = 30.0

#: How often the orchestrator looks for the result, seconds.
POLL_S = 0.02


class TransportUnsupported(OrchestratorError):
    """``spec.weights.transport: collective`` with a rollout server that lacks vLLM's weight-transfer routes; retrying
    cannot heal it (``permanent``: exit 78 with ``reason``)."""

    permanent = True
    reason = "TransportUnsupported"


class SenderWatch:
    """Whether the trainer's weight sender is alive: its heartbeat's count
    (:func:`rlrun.weight_requests.beat`) seen to change, on this process's own clock (no clocks compared
    across nodes).

    Args:
        run_dir: the run directory.
        silent_s: a sender whose count has not changed for this long, seconds, is gone.
    """

    def __init__(self, run_dir: RunDir, silent_s: float = SILENT_S) -> None:
        self.run_dir = run_dir
        self.silent_s = silent_s
        self._beat: tuple[str, int] | None = None
        self._looked: float | None = None  # the previous look
        self._first_look: float | None = None
        self._changed: float | None = None  # the look before the one that saw the count change

    def look(self) -> float:
        """Read the beat; returns the seconds since it was last seen to change (or since the first look, when
        it never was). A change is dated at the look before the one that saw it (it happened in between, and
        looks may be a training step apart): a sender dead for long is not taken for alive because its last
        beats came after the previous look. Reads a file: call it off the event loop."""
        now = time.monotonic()
        if self._looked is not None and now - self._looked < BEAT_S / 2:  # the file changes once a second
            return self._silent(now)
        seen = read_beat(self.run_dir)
        if self._looked is None:
            self._first_look = now
        elif seen != self._beat:
            self._changed = self._looked
        self._beat, self._looked = seen, now
        return self._silent(now)

    def _silent(self, now: float) -> float:
        since = self._changed if self._changed is not None else self._first_look
        return now - since  # type: ignore[operator]

    def alive(self) -> bool:
        """The count was seen to change within :attr:`silent_s` (a sender not yet seen beating is not
        alive)."""
        silent = self.look()
        return self._changed is not None and silent <= self.silent_s


class TrainerTransfer:
    """``transfer(url, version)`` (:data:`~rlrun.weight_requests.InMemoryTransfer`) through the run directory.

    Args:
        run_dir: the run directory.
        timeout_s: ``spec.weights.timeout_seconds``.
        poll_s: how often to look for the result, seconds.
    """

    def __init__(self, run_dir: RunDir, timeout_s: float, poll_s: float = POLL_S) -> None:
        self.run_dir = run_dir
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self.sender = SenderWatch(run_dir)

    async def __call__(self, url: str, version: int) -> Sent:
        """Ask the trainer to send ``version`` to the (paused) server at ``url``; what it sent.

        Raises:
            TransferFailed: the trainer answered ``ok: false`` or another version, stopped, or did not answer in time.
        """
        loop = asyncio.get_running_loop()
        request = SendRequest(url, version)
        path = await asyncio.to_thread(write_request, self.run_dir, request)
        deadline = loop.time() + self.timeout_s + MARGIN_S
        looked = -BEAT_S
        try:
            while (result := await asyncio.to_thread(read_result, self.run_dir, request.id)) is None:
                if stopped_marker(self.run_dir).exists():
                    raise TransferFailed(f"the trainer's weight sender has stopped (version {version} not sent)")
                if loop.time() > deadline:
                    raise TransferFailed(f"no answer from the trainer within {self.timeout_s + MARGIN_S:.0f} s")
                if loop.time() - looked >= BEAT_S:  # a killed trainer leaves no stopped marker
                    looked = loop.time()
                    if (silent := await asyncio.to_thread(self.sender.look)) > self.sender.silent_s:
                        gone = f"the trainer's weight sender is gone (no heartbeat for {silent:.0f} s)"
                        raise TransferFailed(gone)
                await asyncio.sleep(self.poll_s)
        except ValueError as exc:  # a result file that is no result
            raise TransferFailed(str(exc)) from None
        finally:
            path.unlink(missing_ok=True)
            (results_dir(self.run_dir) / f"{request.id}.json").unlink(missing_ok=True)
        if not result.ok:
            raise TransferFailed(f"the trainer did not send: {result.error}")
        if result.version != version or result.sent_digest is None:
            raise TransferFailed(f"the trainer answered for version {result.version}, asked {version}")
        return Sent(Digest.from_json(result.sent_digest), result.bytes, result.seconds)


async def check_routes(urls: list[str], transport: httpx.AsyncBaseTransport | None = None) -> None:
    """Refuse servers that cannot take weights in memory: each must answer vLLM's ``GET /get_world_size`` (a
    dev-mode route of vLLM's weight-transfer API).

    Raises:
        TransportUnsupported: one line naming ``spec.weights.transport``, the servers and what each answered.
    """
    async with httpx.AsyncClient(transport=transport, timeout=10.0, trust_env=False) as http:
        answers = await asyncio.gather(*(http.get(f"{u}/get_world_size") for u in urls), return_exceptions=True)
    bad = {}
    for url, answer in zip(urls, answers, strict=True):
        if isinstance(answer, BaseException):
            bad[url] = f"{type(answer).__name__}: {answer}" if str(answer) else type(answer).__name__
        elif answer.status_code != 200:
            bad[url] = f"{answer.status_code}"
    if bad:
        which = "; ".join(f"{u} answered GET /get_world_size with {why}" for u, why in bad.items())
        raise TransportUnsupported(
            f"spec.weights.transport is collective but {which}: serve vLLM 0.32 with VLLM_SERVER_DEV_MODE=1 "
            "(rlrun rollout does), or set spec.weights.transport: filesystem"
        )


@dataclass
class PathTotals:
    """One path's server updates in this attempt: how many, their seconds and bytes together."""

    updates: int = 0
    seconds: float = 0.0
    bytes: int = 0


@dataclass
class TransferTotals:
    """The servers' weight updates in this attempt by how the weights came (``filesystem``, ``collective``), and the
    in-memory sends that fell back to the files: what ``metrics.jsonl``'s ``weight_transfer`` and the Prometheus
    ``rlrun_weight_transfer_*`` series report."""

    paths: dict[str, PathTotals] = field(default_factory=lambda: {p: PathTotals() for p in PATHS})
    fallbacks: int = 0

    def add(self, load: WeightLoad) -> None:
        """Count one server's update."""
        if load.fallback is not None:
            self.fallbacks += 1
        if load.path is not None:
            totals = self.paths[load.path]
            totals.updates += 1
            totals.seconds += load.seconds
            totals.bytes += load.bytes

    def line(self) -> dict:
        """``{"filesystem": {"updates", "seconds", "bytes"}, "collective": {…}, "fallbacks": n}``."""
        return {
            **{p: {**dataclasses.asdict(t), "seconds": round(t.seconds, 4)} for p, t in self.paths.items()},
            "fallbacks": self.fallbacks,
        }
