"""WeightFollower: brings each policy version the trainer publishes to the rollout servers.

The trainer publishes ``broadcasts/step_N/`` after step N; the follower loads the newest one into every
rollout server (:func:`~rlrun.orchestrator.weights.push_weights`: validate, then drain → pause →
reload → reset prefix cache → resume; with ``spec.weights.transport: collective`` sent in memory by the
trainer instead of the reload as soon as the trainer announces the version, before its broadcast is
written, the broadcast its fallback, :mod:`.weight_transfer`; a resume's first load and a catch-up always
reload the files; a LoRA run's adapter: load, no pause) and removes the older broadcasts — in a LoRA run,
those no server still holds as an adapter (vLLM reloads an adapter its cache evicted from the directory it
was loaded from), the rest at a later update.

Guarantees: the policy version only goes up; only broadcasts written by this attempt's trainer are loaded (a
dead attempt's may hold weights the resumed run never trained); weights that do not match the model are
refused before any server is touched; the version recorded at dispatch is never newer than the weights that
produce the tokens, and those are the weights the server held when the request was sent (a server gets no
request while it reloads, and reloads once the requests out are answered: :mod:`rlrun.rollout.client`). A
server that cannot be reached during an update (its node is going away) is returned as unreachable rather than
failing the run: the orchestrator benches it until it answers again and has caught up. Every update is
verified (the server's digest of what it holds against the published files':
:mod:`rlrun.rollout.verification`); a server whose update is not gets no request until a catch-up's is, and is
refused after failing again and again (:class:`~rlrun.orchestrator.served.UnverifiedServers`); the
trainer–sampler mismatch of each version with a probe is measured on the servers that took it
(:class:`~rlrun.orchestrator.served.MismatchGuard`).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from pathlib import Path

from rlrun.api.spec import RLRunSpec
from rlrun.orchestrator.served import MismatchGuard, UnverifiedServers, served_mismatch
from rlrun.orchestrator.weight_transfer import SenderWatch, TrainerTransfer, TransferTotals, check_routes
from rlrun.orchestrator.weights import AdapterReference, Reference, WeightPush, push_weights
from rlrun.probes import PROBE_FILE, read_probe
from rlrun.rollout.client import RolloutClient
from rlrun.rundir import RunDir, read_meta, step_dirs, written_by
from rlrun.weight_requests import Announced, InMemoryTransfer, read_announced, stopped_marker

log = logging.getLogger(__name__)


class WeightFollower:
    """Follows ``broadcasts/`` for one attempt.

    Args:
        run_dir: the run directory.
        attempt: this attempt's number (0: unnumbered, every broadcast counts).
        reference: what every weights directory must match (:data:`~rlrun.orchestrator.weights.Reference`: the
            model's tensor names, dtypes and shapes; a LoRA run's :class:`~rlrun.orchestrator.weights.AdapterReference`;
            None: unchecked full weights).
        max_mismatch_kl: ``spec.rollout.max_mismatch_kl`` (:class:`~rlrun.orchestrator.served.MismatchGuard`).
        transfer: how the trainer sends a new version in memory (``spec.weights.transport: collective``:
            :class:`~rlrun.orchestrator.weight_transfer.TrainerTransfer`); None: every server reloads the files. A
            resume's weights and a catch-up's are loaded from the files either way.
        sender: whether the trainer's sender is alive
            (:class:`~rlrun.orchestrator.weight_transfer.SenderWatch`): a version announced by a gone sender
            is not followed (its broadcast, once a restarted trainer writes it, is); None: every announcement
            is trusted.

    Attributes:
        version: the policy version the rollout servers hold (trainer steps).
        unverified: the servers whose updates failed verification, counted (refused after a few in a row).
        mismatch: the trainer–sampler mismatch of each probed version (``mismatch.last``: metrics.jsonl's
            ``served_mismatch_kl``).
        transfers: every server update's path, seconds and bytes, and the fallbacks from memory to the files.
    """

    @classmethod
    def from_spec(cls, spec: RLRunSpec, run_dir: RunDir, attempt: int) -> WeightFollower:
        """The follower of ``spec``'s run (its reference is set once the model is at hand)."""
        weights = spec.weights
        collective = weights.transport == "collective" and spec.model.lora is None
        transfer = TrainerTransfer(run_dir, weights.timeout_seconds) if collective else None
        sender = transfer.sender if transfer is not None else None
        return cls(run_dir, attempt, None, spec.rollout.max_mismatch_kl, transfer, sender)

    def __init__(
        self,
        run_dir: RunDir,
        attempt: int,
        reference: Reference,
        max_mismatch_kl: float | None = None,
        transfer: InMemoryTransfer | None = None,
        sender: SenderWatch | None = None,
    ) -> None:
        self.run_dir = run_dir
        self.transfer = transfer
        self.sender = sender
        self.transfers = TransferTotals()
        self.attempt = attempt
        self.reference = reference
        self.version = 0
        self.unverified = UnverifiedServers()
        self.mismatch = MismatchGuard(max_mismatch_kl)
        #: the last weight update (None before one) and every update's seconds together (validation, then each
        #: server's pause, reload and resume): what metrics.jsonl's ``weight_update_s`` and ``/metrics`` report
        self.last_push: WeightPush | None = None
        self.update_seconds = 0.0
        # the version, its sender and the servers it was sent to ahead of its files (_retrained)
        self._sent_ahead: tuple[int, str, set[str]] | None = None

    def weights_dir(self, version: int) -> Path | None:
        """Where the weights of ``version`` are: its broadcast, else its trainer checkpoint (None: neither)."""
        for p in (self.run_dir.broadcast(version), self.run_dir.trainer_checkpoint(version)):
            if p.is_dir():
                return p
        return None

    def newest_broadcast(self) -> int | None:
        """The newest broadcast this attempt's trainer published (None: none is there)."""
        return max(
            (n for n, p in step_dirs(self.run_dir.broadcasts).items() if written_by(p, self.attempt)), default=None
        )

    async def load(
        self,
        clients: list[RolloutClient],
        path: str | Path,
        version: int,
        in_memory: bool = False,
        announced: Announced | None = None,
    ) -> WeightPush:
        """Load the weights in ``path`` into ``clients`` as policy ``version`` (the version moves even when
        some servers were unreachable or not verified: they must catch up before serving again), then measure
        the version's mismatch on the servers verified, when ``path`` (or ``announced``) has a probe;
        ``in_memory``: sent by the trainer when the run does so (:attr:`transfer`), ``path`` the fallback;
        ``announced``: the trainer's announcement of ``version``, its broadcast ``path`` perhaps not written
        yet (:func:`~rlrun.orchestrator.weights.push_weights`).

        Raises:
            WeightsError: the weights do not match the model (no server was touched).
            RolloutError: a reachable server failed to reload.
            ServedWeightsUnverified: a server failed verification again and nothing can refuse it.
            SamplerMismatch: the mismatch passed ``spec.rollout.max_mismatch_kl`` versions in a row.
        """
        transfer = self.transfer if in_memory else None
        push = await push_weights(clients, path, version, self.reference, transfer, announced)
        self.version, self.last_push = version, push
        self.update_seconds += push.seconds
        for load in push.loads.values():
            self.transfers.add(load)
        for url, error in push.unreachable.items():
            log.warning("rollout server %s missed the update to policy %d: %s", url, version, error)
        self.unverified.record(push.verified, push.unverified, version)
        probe = announced.probe if announced is not None else None
        if probe is None and (Path(path) / PROBE_FILE).is_file():
            probe = await asyncio.to_thread(read_probe, path)
        if probe and push.verified:
            verified = [c for c in clients if c.base_url in push.verified]
            self.mismatch.observe(version, await served_mismatch(verified, probe, self.mismatch.unsafe))
        return push

    async def begin(self, clients: list[RolloutClient], step: int | None, model: str | Path) -> dict[str, str]:
        """Load the weights an attempt begins with: trainer checkpoint ``step``'s (a resume), else — when weights are
        checked (:attr:`reference`), as the servers may hold another run's — the initial ``model``'s as policy 0;
        returns the servers unreachable (base URL → error). A LoRA run begins a fresh run with nothing to load:
        policy 0 is the base model, which every server starts on and rlrun never changes.

        Raises:
            WeightsError, RolloutError: as :meth:`load`.
            TransportUnsupported: the run sends weights in memory and a server lacks vLLM's routes for it.
        """
        if self.transfer is not None and clients:
            await check_routes([c.base_url for c in clients])
        if step is not None:
            return (await self.load(clients, self.run_dir.trainer_checkpoint(step), step)).unreachable
        if self.reference is not None and not isinstance(self.reference, AdapterReference):
            return (await self.load(clients, model, 0)).unreachable
        return {}

    async def catch_up(self, clients: list[RolloutClient]) -> dict[str, str]:
        """Give servers that just joined the current policy (nothing to do at version 0: they start on it);
        returns those unreachable (base URL → error), all of them while the policy's files are not written
        yet (sent in memory ahead of them: the caller benches them and asks again).

        Raises:
            WeightsError, RolloutError: as :meth:`load`.
        """
        weights = self.weights_dir(self.version) if self.version > 0 else None
        if clients and weights is not None:
            return (await self.load(clients, weights, self.version)).unreachable
        if clients and self.version > 0:  # sent in memory before its broadcast is written: not yet
            return {c.base_url: f"policy {self.version}'s files are not written yet" for c in clients}
        return {}

    def _retrained(self, clients: list[RolloutClient]) -> dict[str, str]:
        """The servers that hold :attr:`version` as sent in memory ahead of its broadcast, once the broadcast
        is written by another sender than the one that sent it (base URL → why; empty when none): a trainer
        that died between the announcement and the write and was restarted retrained the version (the same
        batches, another floating-point order) and wrote its own. The caller benches them; their catch-up
        reloads the files, so every server holding the version holds the published one."""
        if self._sent_ahead is None:
            return {}
        version, sender, urls = self._sent_ahead
        meta = read_meta(self.run_dir.broadcast(version)) if version == self.version else {}
        if meta is None:  # not written yet
            return {}
        self._sent_ahead = None
        if not meta or meta.get("sender") == sender:
            return {}
        why = f"holds policy {version} as a trainer restarted since sent it; its files are the new trainer's"
        log.warning("policy %d was retrained by a restarted trainer: %s reload its files", version, urls)
        return {c.base_url: why for c in clients if c.base_url in urls and c.loaded_version == version}

    def announced(self) -> Announced | None:
        """The version this attempt's trainer announced past :attr:`version` (sending in memory only; None:
        none)."""
        if self.transfer is None:
            return None
        announced = read_announced(self.run_dir)
        if announced is None or announced.version <= self.version:
            return None
        # a sender stopped or gone sends nothing: the servers keep what they hold until the files come
        if stopped_marker(self.run_dir).exists() or (self.sender is not None and not self.sender.alive()):
            return None
        return announced if self.attempt in (0, announced.attempt) else None

    async def follow(self, clients: list[RolloutClient]) -> WeightPush | None:
        """Load the newest policy past :attr:`version` this attempt's trainer published — its broadcast, or,
        sending in memory, the version it announced before writing the broadcast
        (:mod:`rlrun.weight_requests`) — if any (None: there is none).

        Raises:
            WeightsError, RolloutError: as :meth:`load`.
        """
        if retrained := await asyncio.to_thread(self._retrained, clients):
            return WeightPush(0.0, unreachable=retrained)
        if self.sender is not None:  # at every pass: the sender is known alive when its first version comes
            await asyncio.to_thread(self.sender.look)
        dirs = step_dirs(self.run_dir.broadcasts)
        broadcasts = {n: p for n, p in dirs.items() if n > self.version and written_by(p, self.attempt)}
        announced = await asyncio.to_thread(self.announced)
        newest = max([*broadcasts, *([announced.version] if announced is not None else [])], default=None)
        if newest is None:
            await self._remove_old(clients, dirs)
            return None
        previous = self.version
        if announced is None or announced.version != newest:
            announced = None
        path = broadcasts.get(newest, self.run_dir.broadcast(newest))
        push = await self.load(clients, path, newest, in_memory=True, announced=announced)
        nothing_took_it = clients and not push.verified  # no server at all: nothing to send back
        if announced is not None and nothing_took_it and not await asyncio.to_thread(Path(path).is_dir):
            return await self._back_to(clients, previous, push)
        if announced is not None:  # what its broadcast must say it is, once written (_retrained)
            sent = {url for url, load in push.loads.items() if load.path == "collective"}
            self._sent_ahead = (newest, announced.sender, sent)
        paths = sorted({load.path for load in push.loads.values() if load.path is not None})
        how = f", {'+'.join(paths)}" if self.transfer is not None and paths else ""
        log.info("policy version %d -> %d (weight update %.3f s%s)", previous, newest, push.seconds, how)
        await self._remove_old(clients, step_dirs(self.run_dir.broadcasts))
        return push

    async def _remove_old(self, clients: list[RolloutClient], dirs: dict[int, Path]) -> None:
        """Remove the broadcasts in ``dirs`` older than the newest one of this attempt the servers were
        given (at most :attr:`version`: one sent ahead of its files counts once they are written), but those a
        LoRA run's servers still hold as adapters. At every pass: a version's files may come passes after
        it."""
        given = (n for n in sorted(dirs, reverse=True) if n <= self.version)
        keep = next((n for n in given if written_by(dirs[n], self.attempt)), None)
        held = {v for c in clients for v in c.adapters.held}  # vLLM reloads an evicted adapter from there
        old = [] if keep is None else [p for n, p in dirs.items() if n < keep and n not in held]
        if old:  # deleting weight files is I/O: off the event loop
            await asyncio.to_thread(lambda: [shutil.rmtree(p, ignore_errors=True) for p in old])

    async def _back_to(self, clients: list[RolloutClient], previous: int, failed: WeightPush) -> WeightPush:
        """The policy :attr:`version` just pushed reached no server in memory and has no files yet (its
        trainer died while sending?): every server reloads ``previous`` from its files and the follower stays
        at it (the newer one is followed again once its broadcast is written, or its sender answers), so no
        server is left benched on a version nothing can give it; ``failed``: that update (returned when
        ``previous`` has no files)."""
        back = self.weights_dir(previous)
        if back is None:
            return failed
        log.warning("policy %d reached no server and has no files yet: back to %d", self.version, previous)
        self._sent_ahead = None
        return await self.load(clients, back, previous)
