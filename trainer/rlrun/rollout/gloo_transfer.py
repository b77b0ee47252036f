"""Weights from a trainer to vLLM workers in memory, over a torch.distributed gloo group, through vLLM's own
weight-transfer API (issue 50, part 2: the engine that runs where no CUDA is, so the whole path runs here).

Guarantee: a round either loads into every worker exactly the tensors the trainer's :class:`WeightSource`
yields, each received whole by a gloo broadcast from the trainer (rank 0) and loaded through the model's own
``load_weights`` inside vLLM's layerwise reload (what vLLM's ``nccl`` engine does), or it raises on both sides.
A round that "succeeds" having moved nothing or part (vLLM #57022) is not caught here: the caller compares
the digest the workers serve (``rlrun_weights_digest``, :mod:`rlrun.rollout.worker_extension`) with
:attr:`GlooTrainerWeightTransferEngine.sent_digest`, as the file-system path compares it with the files'.

Two halves, one per process, registered under :data:`BACKEND` by :func:`rlrun.rollout.vllm_plugin.register` (the
``vllm.general_plugins`` entry point of rlrun's package: every vLLM process that loads plugins can create them, and
imports this module only when it does):

- :class:`GlooWeightTransferEngine`, in each vLLM worker (``--weight-transfer-config '{"backend": "rlrun_gloo"}'``):
  created by vLLM's worker at ``load_model`` on the worker's device (``cpu`` on vLLM-CPU), driven by the dev-mode
  routes ``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``.
- :class:`GlooTrainerWeightTransferEngine`, in the trainer (``WeightTransferTrainerFactory.trainer_init`` with a
  :class:`GlooTrainerInitInfo`): opens rank 0 and drives those routes through any ``VLLMWeightSyncClient``
  (vLLM's ``HTTPVLLMWeightSyncClient`` for one server), the ``update_weights`` call concurrent with its
  broadcasts, as vLLM's ``NCCLTrainerWeightTransferEngine`` does.

The group: trainer rank 0, each worker ``rank_offset + dp_index · (TP·PP) + rank`` (vLLM's own numbering,
``nccl_common.worker_init_process_group``), ``world_size`` = 1 + all workers; a rendezvous over a TCPStore the
trainer hosts at ``master_address:master_port`` (``vllm.distributed.utils.stateless_init_torch_distributed_process_
group``: nothing of the global ``torch.distributed`` state is touched on either side). One tensor per broadcast,
unpacked (vLLM's packed producer/consumer, ``packed_tensor.py``, is CUDA-streams only); a worker posts the next
receive before loading the current tensor, and the trainer digests a tensor while gloo sends it.

Runs use it with ``spec.weights.transport: collective``: the trainer's :mod:`rlrun.training.weight_sender` drives the
trainer's half, :mod:`rlrun.rollout.weight_load` verifies each round (``tests/integration/test_weight_transfer.py``
tests the engine alone, ``benchmarks/weight_transfer.py`` measures it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
)
from vllm.distributed.weight_transfer.nccl_engine import (
    NCCLTrainerWeightTransferEngine,
    NCCLWeightTransferUpdateInfo,
)

from rlrun.rollout.vllm_plugin import GLOO_BACKEND

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from vllm.config import VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig

    from rlrun.weights_digest import Digest

#: Under vLLM's logger, so the workers' lines land in the server's log with vLLM's own (rlrun configures no
#: logging inside vLLM's processes).
log = logging.getLogger(f"vllm.{__name__}")

#: The name both halves register under (:func:`rlrun.rollout.vllm_plugin.register`), what ``--weight-transfer-config``
#: names.
BACKEND = GLOO_BACKEND

#: How long a broadcast (or the rendezvous) may wait for a peer before gloo raises, seconds: one tensor of a
#: large model over TCP, with margin (the trainer's own timeout for the HTTP calls is the client's).
DEFAULT_TIMEOUT_S = 600.0

#: Per-round wire info: the parameters' names, dtype names (``"float32"``) and full shapes, in broadcast order.
#: vLLM's NCCL one, reused (same fields, same length checks).
GlooWeightTransferUpdateInfo = NCCLWeightTransferUpdateInfo


@dataclass(kw_only=True)
class GlooWeightTransferInitInfo(WeightTransferInitInfo):
    """What a worker needs to join the group (the body of ``/init_weight_transfer_engine``'s ``init_info``).

    Attributes:
        master_address: host of the trainer's TCPStore (rank 0's rendezvous).
        master_port: its port.
        rank_offset: rank of the first worker (1: one trainer rank before the workers).
        world_size: trainer ranks + every worker of every server joining this group.
        timeout_s: rendezvous and per-broadcast timeout, seconds.
    """

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_s: float = DEFAULT_TIMEOUT_S


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    """The trainer's side of the rendezvous (``rank``, keyword-only, from :class:`TrainerInitInfo`: 0 sends).

    Attributes:
        master_address: host the trainer's TCPStore listens on, reachable from every worker.
        master_port: a free port there.
        world_size: 1 + the workers of every server that joins (vLLM's ``/get_world_size``, summed).
        timeout_s: rendezvous and per-broadcast timeout, seconds.
    """

    backend: ClassVar[str] = BACKEND

    master_address: str
    master_port: int
    world_size: int
    timeout_s: float = DEFAULT_TIMEOUT_S


def open_group(address: str, port: int, rank: int, world_size: int, timeout_s: float) -> ProcessGroup:
    """A gloo process group of ``world_size`` ranks over a TCPStore at ``address:port`` (rank 0 hosts it), outside
    ``torch.distributed``'s global state (vLLM's stateless helper).

    Raises:
        RuntimeError, DistStoreError: a peer did not arrive within ``timeout_s`` (torch's message names the store).
    """
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    return stateless_init_torch_distributed_process_group(
        address, port, rank, world_size, backend="gloo", timeout=timedelta(seconds=timeout_s)
    )


def close_group(group: ProcessGroup) -> None:
    """Shut ``group`` down (its TCP connections; the store with rank 0's)."""
    group.shutdown()


def broadcast(group: ProcessGroup, tensor: torch.Tensor, async_op: bool = False) -> Any:
    """Broadcast ``tensor`` (CPU, contiguous) from the group's rank 0 into every rank's ``tensor``, in place;
    ``async_op``: return its ``Work`` at once (``.wait()`` before reading ``tensor``), else wait.

    ``group_src``, not ``src``: a stateless group is not in ``torch.distributed``'s rank map (vLLM's helper
    warns that ``broadcast`` by global rank cannot be used on it).
    """
    return torch.distributed.broadcast(tensor, group=group, group_src=0, async_op=async_op)


class GlooWeightTransferEngine(WeightTransferEngine[GlooWeightTransferInitInfo, NCCLWeightTransferUpdateInfo]):
    """The worker's half: joins the trainer's gloo group at ``/init_weight_transfer_engine``, receives each
    parameter of a round by broadcast into a fresh CPU tensor of the announced dtype and shape, and loads it
    through ``model.load_weights`` between vLLM's ``initialize_layerwise_reload`` (``/start_weight_update``) and
    ``finalize_layerwise_reload`` (``/finish_weight_update``), so vLLM's own loading rules (fused q/k/v and
    gate/up, the padded vocabulary, CPU GEMM pre-packing) apply as at start-up.
    """

    init_info_cls = GlooWeightTransferInitInfo
    update_info_cls = NCCLWeightTransferUpdateInfo

    def __init__(
        self,
        config: WeightTransferConfig,
        vllm_config: VllmConfig,
        device: torch.device,
        model: torch.nn.Module,
    ) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: ProcessGroup | None = None
        self.rank: int | None = None

    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
        """Join the group as ``rank_offset`` + this worker's rank over all data-parallel replicas.

        Raises:
            RuntimeError: the trainer's store did not answer within ``timeout_s``.
        """
        if self.group is not None:  # a new trainer (or membership): leave the old group first
            self.shutdown()
        parallel = self.parallel_config
        worker_rank = parallel.data_parallel_index * parallel.world_size + parallel.rank
        self.rank = init_info.rank_offset + worker_rank
        self.group = open_group(
            init_info.master_address,
            init_info.master_port,
            self.rank,
            init_info.world_size,
            init_info.timeout_s,
        )
        log.info(
            "rlrun_gloo: joined %s:%d as rank %d of %d",
            init_info.master_address,
            init_info.master_port,
            self.rank,
            init_info.world_size,
        )

    def start_weight_update(self) -> None:
        """Begin vLLM's layerwise reload: each layer is re-materialized once all its weights have arrived."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        """End the layerwise reload (a layer that received nothing keeps the tensors it had)."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def receive_weights(self, update_info: NCCLWeightTransferUpdateInfo) -> None:
        """Receive the round's parameters in ``update_info``'s order and load each through ``model.load_weights``,
        the next one's receive posted before the current one loads (gloo fills it meanwhile): at most two
        received tensors held at a time. Logs the round: tensors, bytes, seconds waiting for data, seconds
        loading.

        Raises:
            RuntimeError: no group (``/init_weight_transfer_engine`` not called), or a broadcast failed or timed
                out (gloo's message; the group is unusable afterwards: init again).
        """
        if self.group is None:
            raise RuntimeError(f"{BACKEND}: /update_weights before /init_weight_transfer_engine joined a group")
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        specs = list(zip(update_info.names, update_info.dtype_names, update_info.shapes, strict=True))
        waited = loading = 0.0
        nbytes = 0
        with disable_mtp_completeness_check():
            pending = self._post_receive(specs[0]) if specs else None
            for i in range(len(specs)):
                name, weight, work = pending
                t0 = time.perf_counter()
                work.wait()
                t1 = time.perf_counter()
                pending = self._post_receive(specs[i + 1]) if i + 1 < len(specs) else None
                self.model.load_weights([(name, weight.to(self.device))])
                loading += time.perf_counter() - t1
                waited += t1 - t0
                nbytes += weight.numel() * weight.element_size()
                del weight
        log.info(
            "%s: received %d tensors, %.1f MB: %.3f s waiting for data, %.3f s loading",
            BACKEND,
            len(specs),
            nbytes / 1e6,
            waited,
            loading,
        )

    def _post_receive(self, spec: tuple[str, str, list[int]]) -> tuple[str, torch.Tensor, Any]:
        """Post the receive of one ``(name, dtype name, shape)`` into a fresh CPU tensor; its ``Work`` to wait on."""
        name, dtype_name, shape = spec
        weight = torch.empty(shape, dtype=getattr(torch, dtype_name), device="cpu")
        return name, weight, broadcast(self.group, weight, async_op=True)

    def shutdown(self) -> None:
        """Leave the group (``/shutdown_weight_transfer_engine``, and at the worker's shutdown)."""
        if self.group is not None:
            close_group(self.group)
            self.group = None


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """The trainer's half: rank 0 of the group, sending its :class:`WeightSource` each round.

    Attributes:
        group: the gloo group (None on a non-sender rank, and after :meth:`shutdown`).
        sent_digest: the :class:`~rlrun.weights_digest.Digest` of the tensors the last round sent, as sent
            (their wire dtype): what the workers serve after it when they serve that dtype or a wider one
            (``rlrun_weights_digest``); None before the first round.
        sent_bytes: the bytes the last round broadcast.
        seconds: the last round's phases, seconds: ``start`` (``/start_weight_update``), ``broadcast`` (this rank's
            sends), ``update`` (until ``/update_weights`` answered: the workers received and loaded all),
            ``finish`` (``/finish_weight_update``: vLLM's layerwise finalize).
    """

    init_info_cls = GlooTrainerInitInfo

    def __init__(
        self,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
        is_sender: bool = True,
    ) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.group: ProcessGroup | None = None
        self.sent_digest: Digest | None = None
        self.sent_bytes = 0
        self.seconds: dict[str, float] = {}

    @classmethod
    def trainer_init(
        cls,
        init_info: GlooTrainerInitInfo,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
    ) -> GlooTrainerWeightTransferEngine:
        """Open rank 0 while the workers join (``/init_weight_transfer_engine`` on a side thread: both block in
        the same rendezvous). A non-sender rank returns at once: it only iterates the source each round.

        Raises:
            ValueError: no ``source``.
            RuntimeError, DistStoreError, requests.HTTPError: the workers did not join (the server's answer or
                the store's timeout).
        """
        if source is None:
            raise ValueError(f"{BACKEND}: the trainer engine sends a WeightSource each round; none was given")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        if not engine.is_sender:
            return engine
        worker_info = GlooWeightTransferInitInfo(
            master_address=init_info.master_address,
            master_port=init_info.master_port,
            rank_offset=1,
            world_size=init_info.world_size,
            timeout_s=init_info.timeout_s,
        )
        with ThreadPoolExecutor(max_workers=1) as pool:
            joined = pool.submit(client.init_weight_transfer_engine, asdict(worker_info))
            engine.group = open_group(
                init_info.master_address, init_info.master_port, 0, init_info.world_size, init_info.timeout_s
            )
            joined.result()
        return engine

    def send_weights(self, weight_version: str | None = None) -> None:
        """One round: ``/start_weight_update``, ``/update_weights`` (the workers receive) concurrent with this
        rank's broadcasts of the source, then ``/finish_weight_update`` with ``weight_version`` (vLLM commits it
        with the weights). Sets :attr:`sent_digest`, :attr:`sent_bytes` and :attr:`seconds`.

        Raises:
            ValueError: the source's iteration disagrees with its ``metadata()`` (the parameter named).
            RuntimeError: a broadcast failed or timed out; requests.HTTPError: a route failed (the server's
                error). The group is unusable after either: :meth:`shutdown` and ``trainer_init`` again.
        """
        assert self.source is not None  # trainer_init refuses none
        meta = self.source.metadata()
        if not self.is_sender:
            for _ in self.source:  # stay in the source's own collectives (an FSDP gather)
                pass
            return
        update_info = GlooWeightTransferUpdateInfo(
            names=[m.name for m in meta],
            dtype_names=[str(m.dtype).removeprefix("torch.") for m in meta],
            shapes=[list(m.shape) for m in meta],
        )
        t0 = time.perf_counter()
        self.client.start_weight_update()
        t1 = time.perf_counter()
        pool = ThreadPoolExecutor(max_workers=1)
        try:
            received = pool.submit(self.client.update_weights, asdict(update_info))
            self._broadcast(meta)
            t2 = time.perf_counter()
            received.result()
        finally:
            # never join the HTTP thread after a failed broadcast: the workers may still wait in theirs
            pool.shutdown(wait=False)
        t3 = time.perf_counter()
        self.client.finish_weight_update(weight_version)
        t4 = time.perf_counter()
        self.seconds = {"start": t1 - t0, "broadcast": t2 - t1, "update": t3 - t1, "finish": t4 - t3}

    def _broadcast(self, meta: list[ParamMeta]) -> None:
        """Broadcast each tensor of the source, checked against ``meta`` (vLLM's NCCL trainer's check: a source
        whose two channels disagree would split the stream differently on each side), adding up its digest while
        gloo's thread sends it (both only read it)."""
        from rlrun.weights_digest import Digest, tensor_digest

        assert self.group is not None and self.source is not None
        digest, sent = Digest(), 0
        for _name, tensor in _checked(self.source, meta):
            wire = tensor.detach().to("cpu").contiguous()
            work = broadcast(self.group, wire, async_op=True)
            digest += tensor_digest(wire)
            work.wait()
            sent += wire.numel() * wire.element_size()
        self.sent_digest, self.sent_bytes = digest, sent

    def shutdown(self) -> None:
        """Close the group (the workers' side closes at ``/shutdown_weight_transfer_engine``)."""
        if self.group is not None:
            close_group(self.group)
            self.group = None


def _checked(source: WeightSource, meta: list[ParamMeta]) -> Iterator[tuple[str, torch.Tensor]]:
    """``source``'s pairs, each checked against ``meta`` (vLLM's ``NCCLTrainerWeightTransferEngine._checked_iter``).

    Raises:
        ValueError: a name, dtype or shape that ``metadata()`` did not declare there, or a count that differs.
    """
    return NCCLTrainerWeightTransferEngine._checked_iter(source, meta)


def weight_checker(base_url: str, action: str, baseline: dict[str, str] | None = None, timeout: float = 300) -> Any:
    """vLLM's ``POST /weight_checker`` (dev mode): ``checksum`` → ``{name: sha256}`` of every parameter as the
    workers hold it; ``compare`` with ``baseline`` → ``{"match": bool, "mismatches": [names]}``. It compares a
    server with itself (an earlier checksum), not with what was sent (:mod:`rlrun.weights_digest` says why).

    Raises:
        requests.HTTPError: the route failed (no dev mode: 404).
    """
    import requests

    body: dict[str, Any] = {"action": action}
    if baseline is not None:
        body["baseline"] = baseline
    resp = requests.post(f"{base_url.rstrip('/')}/weight_checker", json=body, timeout=timeout)
    resp.raise_for_status()
    data = resp.json()
    return data["checksums"] if action == "checksum" else data
