"""What a weight update loads inside its pause (:meth:`rlrun.rollout.client.RolloutClient.update_weights`): the
version in memory from the trainer when the run sends weights so (``spec.weights.transport: collective``), else, and
whenever that fails, from the version's broadcast files.

Guarantee (ARCHITECTURE.md, invariant 8, on both paths): the server resumes only verified. An in-memory send
counts once the workers' digest equals the digest of what the trainer sent
(:class:`~rlrun.rollout.verification.SentDigest`: a send that moved nothing or part is caught here, vLLM
#57022); any failure of it — the trainer's answer ``ok: false``, no answer within
``spec.weights.timeout_seconds``, a digest that differs, a worker's error — is one warning naming the server
and why, a counted fallback (:attr:`WeightLoad.fallback`), and the reload of the same version from its
broadcast files, verified against the files as every file-system reload is. The follower pushes a version as
soon as the trainer announces it, before its broadcast is written (:mod:`rlrun.weight_requests`): a fallback
first waits for the files, at most :data:`FILES_WAIT_S`; files that do not come (the trainer died meanwhile)
leave the server unverified (:class:`~rlrun.rollout.errors.WeightsUnverified`: no request until a catch-up's
update is verified). Only a server that cannot be reached ends the update at once (the caller benches it).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Protocol

from rlrun.rollout.errors import RolloutError, WeightsUnverified
from rlrun.rollout.verification import Expected, SentDigest, verify_weights
from rlrun.weight_requests import InMemoryTransfer, TransferFailed, WeightLoad

log = logging.getLogger(__name__)

#: Most time a fallback waits for the version's broadcast to be written, seconds: the trainer writes it right
#: after announcing the version (16 GB at 100 MB/s, a slow shared volume, takes 160 s).
FILES_WAIT_S = 600.0

#: How often a fallback looks for the broadcast, seconds.
FILES_POLL_S = 0.1


class RolloutServer(Protocol):
    """What a load needs of :class:`rlrun.rollout.client.RolloutClient` (which calls it: no import back)."""

    base_url: str

    async def reset_prefix_cache(self) -> None: ...

    async def collective_rpc(self, method: str, *args: str) -> list: ...

    async def reload_weights(self, path: str) -> list[dict]: ...


async def _verified(client: RolloutServer, expected: Expected) -> None:
    """Reset the prefix cache, then check the workers' digest against ``expected``."""
    await client.reset_prefix_cache()
    served = await client.collective_rpc("rlrun_weights_digest")
    await verify_weights(client.base_url, served, expected)


async def load_weights(
    client: RolloutServer,
    path: str,
    version: int,
    expected: Expected,
    transfer: InMemoryTransfer | None,
    record: WeightLoad,
) -> None:
    """Load ``version`` into the paused server of ``client``: in memory through ``transfer`` when given, verified
    against what was sent; else, or when that fails, from the files in ``path``, verified against ``expected``
    (module docstring). Fills ``record`` as it goes.

    Raises:
        WeightsUnverified: the weights served after the file reload are not the files'.
        RolloutError: a worker failed to reload the files.
        httpx.HTTPError: the server could not be reached.
    """
    loop = asyncio.get_running_loop()
    if transfer is not None:
        t0 = loop.time()
        try:
            sent = await transfer(client.base_url, version)
            await _verified(client, SentDigest(sent.digest, version))
        except (TransferFailed, RolloutError, asyncio.TimeoutError) as exc:  # and WeightsUnverified, a worker's error
            why = str(exc) or type(exc).__name__
            record.fallback = why
            log.warning(
                "rollout server %s: policy %d in memory failed (%s); reloading it from the files",
                client.base_url,
                version,
                why,
            )
        else:
            record.path, record.seconds, record.bytes = "collective", loop.time() - t0, sent.bytes
            return
    t0 = loop.time()
    if transfer is not None:
        await _files_written(client.base_url, path, version)
    await client.reload_weights(path)
    await _verified(client, expected)
    record.path, record.seconds = "filesystem", loop.time() - t0
    record.bytes = await asyncio.to_thread(_files_bytes, path)


async def _files_written(base_url: str, path: str, version: int) -> None:
    """Wait until the broadcast ``path`` is published (a directory: :func:`rlrun.rundir.publish_dir` renames
    it in whole), at most :data:`FILES_WAIT_S`.

    Raises:
        WeightsUnverified: it was not.
    """
    deadline = asyncio.get_running_loop().time() + FILES_WAIT_S
    while not await asyncio.to_thread(Path(path).is_dir):
        if asyncio.get_running_loop().time() > deadline:
            raise WeightsUnverified(
                f"{base_url}: policy {version} in memory failed and its broadcast {path} was not written "
                f"within {FILES_WAIT_S:.0f} s"
            )
        await asyncio.sleep(FILES_POLL_S)


def _files_bytes(path: str) -> int:
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))
