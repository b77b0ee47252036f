"""The trainer's weight sender (``spec.weights.transport: collective``, issue 50): rank 0 sends the policy version it
holds in memory to a rollout server when the orchestrator asks.

Guarantee: a send is always of one whole published version, the one held: at each publish the trainer hands
:meth:`WeightSender.hold` the state it is about to write to ``broadcasts/step_N/`` (cast to the served dtype,
a copy of its own, never the live parameters) and the sender announces it
(:func:`rlrun.weight_requests.announce`) before the files are written, so the servers do not wait for the
files; a send never waits for a step boundary nor sees a half-applied optimizer step, and a request for any
other version is answered ``ok: false`` ("version N not held; holds M") at once. Every result names what was
sent (its digest, computed while it was sent): the orchestrator verifies the server against it and falls back
to the broadcast files on any failure (:mod:`rlrun.orchestrator.weight_transfer`), so nothing here needs to be
right for a server to serve the right weights — only for it to be fast.

One engine per server (:class:`rlrun.rollout.gloo_transfer.GlooTrainerWeightTransferEngine`: its own gloo group of
1 + the server's workers), opened at that server's first request and kept; after any failure it is shut down and
dropped, and the next request opens a new one (a restarted server is caught up from the files meanwhile). Requests
come through the run directory (:mod:`rlrun.weight_requests`); each server's are served in order on a thread of its
own, so one slow server does not hold another's. The threads are daemons and stop with :meth:`WeightSender.stop`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from rlrun.net import free_port
from rlrun.probes import ProbeSequence
from rlrun.roles import GLOO_BACKEND, POD_IP_ENV
from rlrun.rundir import RunDir
from rlrun.weight_requests import (
    BEAT_S,
    SendResult,
    announce,
    announced_file,
    beat,
    pending_requests,
    read_request,
    stopped_marker,
    write_result,
    write_stopped,
)
from rlrun.weights_digest import Digest

log = logging.getLogger(__name__)

#: How often the sender looks for requests, seconds.
POLL_S = 0.02

#: A trainer that finished stops serving once no request came for this long, seconds (:meth:`WeightSender.stop`).
QUIET_S = 5.0

#: ``open_engine(server, state, timeout_s) -> engine``: an engine sending to ``server``, its group open, with
#: ``send(state, version) -> (Digest, bytes, seconds)`` and ``shutdown()`` (tests pass fakes; :func:`open_gloo_engine`
#: opens the real one).
EngineFactory = Callable[[str, dict[str, torch.Tensor], float], Any]


def master_address() -> str:
    """Where the servers' workers reach this rank: ``$RLRUN_POD_IP`` (:data:`rlrun.roles.POD_IP_ENV`, the trainer
    pod's IP, set by the operator from the downward API), else 127.0.0.1 (``rlrun local``)."""
    return os.environ.get(POD_IP_ENV) or "127.0.0.1"


def server_workers(server: str, timeout_s: float) -> int:
    """The workers of the vLLM server at ``server`` over all its data-parallel replicas (``GET /get_world_size``).

    Raises:
        httpx.HTTPError: no answer, or an error status.
    """
    import httpx

    resp = httpx.get(f"{server.rstrip('/')}/get_world_size", timeout=timeout_s, trust_env=False)
    resp.raise_for_status()
    return int(resp.json()["world_size"])


def gloo_engine_class() -> Any:
    """The trainer's half of rlrun's gloo engine (``GlooTrainerWeightTransferEngine``) as vLLM's factory has it: rlrun's
    ``vllm.general_plugins`` entry point registers it (the trainer meets the rollout package's engine through vLLM's
    registry, as a server does, never by importing it), and the factory imports it (seconds: vLLM).

    Raises:
        KeyError: the entry point is not installed (rlrun not installed as a package).
    """
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    return WeightTransferTrainerFactory._registry[GLOO_BACKEND]()


def state_source(state: dict[str, torch.Tensor]) -> Any:
    """A vLLM ``WeightSource`` over ``state`` (:class:`rlrun.weight_source.StateDictSource`; imports vLLM)."""
    from rlrun.weight_source import StateDictSource

    return StateDictSource(state)


class GlooSend:
    """One server's ``GlooTrainerWeightTransferEngine`` (:mod:`rlrun.rollout.gloo_transfer`), sending a state dict."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def send(self, state: dict[str, torch.Tensor], version: int) -> tuple[Digest, int, dict[str, float]]:
        """One round of ``state`` as ``version``; returns the digest sent, the bytes and the round's phases, seconds.

        Raises:
            RuntimeError, requests.RequestException: the round failed (the group is unusable: :meth:`shutdown`).
        """
        self.engine.source = state_source(state)
        self.engine.send_weights(str(version))
        return self.engine.sent_digest, self.engine.sent_bytes, dict(self.engine.seconds)

    def shutdown(self) -> None:
        """Close the group."""
        self.engine.shutdown()


def open_gloo_engine(server: str, state: dict[str, torch.Tensor], timeout_s: float) -> GlooSend:
    """rlrun's gloo engine for ``server``: rank 0 of a group of 1 + its workers, at :func:`master_address` and a free
    port, rendezvous and each broadcast bounded by ``timeout_s``, driven through vLLM's HTTP client.

    Raises:
        RuntimeError, requests.RequestException: the server or its workers did not join.
    """
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, WeightTransferTrainerFactory

    engine = gloo_engine_class()
    world = 1 + server_workers(server, timeout_s)
    port = free_port("")  # the rendezvous store listens on every interface
    info = engine.init_info_cls(master_address(), port, world_size=world, timeout_s=timeout_s, rank=0)
    client = HTTPVLLMWeightSyncClient(server, timeout=timeout_s)
    return GlooSend(WeightTransferTrainerFactory.trainer_init(info, client=client, source=state_source(state)))


def held_copy(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``state`` as a broadcast writes it (floating-point tensors in ``dtype``, on the CPU), in tensors of its own:
    the live parameters may be among ``state``'s, and the next optimizer step must not change what is held."""
    return {
        k: v.detach().to("cpu", dtype=dtype if v.is_floating_point() else v.dtype, copy=True) for k, v in state.items()
    }


class WeightSender:
    """Serves the run directory's send requests from the version held (module docstring).

    Args:
        run_dir: the run directory.
        timeout_s: ``spec.weights.timeout_seconds``: one round's limit (rendezvous, each broadcast, each HTTP call).
        open_engine: how an engine for a server is opened (:data:`EngineFactory`).
        poll_s: how often to look for requests, seconds.

    Attributes:
        id: this sender's id (random): in its announcements and the broadcasts they announce.
        version: the version held (None: none yet).
        engines: the open engine of each server, by URL.
        sent: the version last sent to each server, by URL.
        totals: the sends of this process, together: ``{"sends", "failures", "seconds", "bytes"}`` (seconds of
            the rounds sent, their bytes): ``trainer_metrics.jsonl``'s ``weight_sends``.
    """

    def __init__(
        self, run_dir: RunDir, timeout_s: float, open_engine: EngineFactory = open_gloo_engine, poll_s: float = POLL_S
    ) -> None:
        self.run_dir = run_dir
        self.timeout_s = timeout_s
        self.open_engine = open_engine
        self.poll_s = poll_s
        self.id = uuid.uuid4().hex[:12]
        self.version: int | None = None
        self._state: dict[str, torch.Tensor] | None = None
        self._lock = threading.Lock()  # version and state change together
        self.engines: dict[str, Any] = {}
        self.sent: dict[str, int] = {}  # the version last sent to each server
        self.totals: dict[str, float] = {"sends": 0, "failures": 0, "seconds": 0.0, "bytes": 0}
        self._servers: dict[str, ThreadPoolExecutor] = {}  # one thread per server: its requests in order
        self._taken: set[str] = set()  # request ids handed to a server's thread and not yet answered
        self._active = time.monotonic()  # when a request was last taken or answered
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def hold(
        self,
        version: int,
        state: dict[str, torch.Tensor],
        attempt: int,
        probe: list[ProbeSequence] | None = None,
    ) -> None:
        """Hold ``state`` (the published weights, :func:`held_copy`) as ``version`` of ``attempt``, replacing
        the one held, then announce it with its ``probe`` (:func:`rlrun.weight_requests.announce`): the
        orchestrator may ask for it from then on, before its broadcast is written."""
        with self._lock:
            self.version, self._state = version, state
        signature = {name: (str(t.dtype), tuple(t.shape)) for name, t in state.items()}
        announce(self.run_dir, version, attempt, self.id, signature, probe)

    def totals_now(self) -> dict[str, float]:
        """A copy of :attr:`totals` (taken while no send is counted)."""
        with self._lock:
            return dict(self.totals)

    def start(self) -> WeightSender:
        """Start looking for requests on a daemon thread; returns self. What a sender before it left (its
        stop, its announcement) is removed first."""
        stopped_marker(self.run_dir).unlink(missing_ok=True)
        announced_file(self.run_dir).unlink(missing_ok=True)
        self._thread = threading.Thread(target=self._run, name="rlrun-weight-sender", daemon=True)
        self._thread.start()
        threading.Thread(target=self._beat, name="rlrun-weight-sender-beat", daemon=True).start()
        return self

    def _beat(self) -> None:  # its own thread: the first request may wait on vLLM's import in _run
        count = 0
        while not self._stop.is_set():
            try:
                beat(self.run_dir, self.id, count)
            except OSError as exc:
                log.warning("weight sender: heartbeat: %s", exc)
            count += 1
            self._stop.wait(BEAT_S)

    def stop(self, drain_s: float = 0.0) -> None:
        """Stop looking, let the rounds under way end (each bounded by :attr:`timeout_s`), close every engine, and
        say so in the run directory (:func:`rlrun.weight_requests.stopped_marker`: a request from then on fails at
        once, not at its timeout). ``drain_s``: first serve on, at most that long, until every server this sender
        has sent to was sent the version held (a trainer at its last step: the orchestrator's push of it is on its
        way), or no request came for :data:`QUIET_S` (the orchestrator gave that version by the files, or is gone)."""
        deadline = time.monotonic() + drain_s
        while time.monotonic() < deadline and time.monotonic() - self._active < QUIET_S:
            if all(self.sent.get(s) == self.version for s in list(self.engines)) and not self._taken:
                break
            time.sleep(self.poll_s)
        write_stopped(self.run_dir, self.version)
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        for pool in self._servers.values():
            pool.shutdown(wait=True)
        for server in list(self.engines):
            self._drop(server)

    def _run(self) -> None:
        if self.open_engine is open_gloo_engine:  # vLLM's import (seconds) before the first request, not in its pause
            try:
                gloo_engine_class()
            except Exception as exc:
                log.warning("weight sender: loading vLLM's weight-transfer engine failed: %s", exc)
        while not self._stop.wait(self.poll_s):
            try:
                self.poll()
            except Exception:  # never end the thread: the orchestrator falls back meanwhile
                log.exception("weight sender: looking for requests failed")

    def poll(self) -> None:
        """Hand each new request to its server's thread."""
        for path in pending_requests(self.run_dir):
            if path.stem in self._taken:
                continue
            request = read_request(path)
            if request is None:
                continue
            self._taken.add(request.id)
            self._active = time.monotonic()
            if request.server not in self._servers:
                self._servers[request.server] = ThreadPoolExecutor(1, thread_name_prefix="rlrun-weight-send")
            self._servers[request.server].submit(self._answer, path, request.id, request.server, request.version)

    def _answer(self, path: Path, request_id: str, server: str, version: int) -> None:
        try:
            result = self.send(server, version)
            write_result(self.run_dir, request_id, result)
        except Exception:
            log.exception("weight sender: answering request %s failed", request_id)
        finally:
            path.unlink(missing_ok=True)
            self._taken.discard(request_id)
            self._active = time.monotonic()

    def send(self, server: str, version: int) -> SendResult:
        """Send ``version`` to ``server`` if it is the one held (opening the server's engine when it has none); the
        result says what was sent, or why nothing was (the engine then dropped)."""
        with self._lock:
            held, state = self.version, self._state
        if held != version or state is None:
            return SendResult(False, version, error=f"version {version} not held; holds {held}")
        seconds: dict[str, float] = {}
        try:
            engine = self.engines.get(server)
            if engine is None:
                t0 = time.perf_counter()
                engine = self.engines[server] = self.open_engine(server, state, self.timeout_s)
                seconds["init"] = time.perf_counter() - t0
            digest, sent, phases = engine.send(state, version)
        except Exception as exc:
            self._drop(server)
            self._count(failures=1)
            why = f"{type(exc).__name__}: {exc}"[:500]
            log.warning("weight sender: version %d to %s failed: %s", version, server, why)
            return SendResult(False, version, error=why)
        seconds.update(phases)
        self.sent[server] = version
        self._count(sends=1, seconds=sum(seconds.values()), bytes=sent)
        log.info("weight sender: version %d to %s: %.1f MB, %s", version, server, sent / 1e6, _phases(seconds))
        return SendResult(True, version, digest.to_json(), sent, seconds)

    def _count(self, **added: float) -> None:
        with self._lock:  # the servers' threads send at once
            for key, value in added.items():
                self.totals[key] = round(self.totals[key] + value, 4)

    def _drop(self, server: str) -> None:
        """Shut ``server``'s engine down and forget it (the next request opens a new one)."""
        engine = self.engines.pop(server, None)
        if engine is not None:
            try:
                engine.shutdown()
            except Exception as exc:
                log.warning("weight sender: closing the engine of %s: %s", server, exc)


def _phases(seconds: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.3f} s" for k, v in seconds.items())
