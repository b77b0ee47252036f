"""What a weight update loads inside its pause (:meth:`rlrun.rollout.client.RolloutClient.update_weights`): the
version in memory from the trainer when the run sends weights so (``spec.weights.transport: collective``), else, and
whenever that fails, from the version's broadcast files.

Guarantee (ARCHITECTURE.md, invariant 8, on both paths): the server serves only verified. An in-memory send
counts once the workers' digest equals the digest of what the trainer sent
(:class:`~rlrun.rollout.verification.SentDigest`: a send that moved nothing or part is caught here, vLLM
#57022); any failure of it — the trainer's answer ``ok: false``, no answer within
``spec.weights.timeout_seconds``, a digest that differs, a worker's error — is one warning naming the server
and why, a counted fallback (:attr:`WeightLoad.fallback`), and the reload of the same version from its
broadcast files, verified against the files as every file-system reload is. The follower pushes a version
as soon as the trainer announces it, before its broadcast is written (:mod:`rlrun.weight_requests`): a send
that fails before the files are there does not wait for them inside the pause — the server resumes
unverified, serving nothing, and the update raises :class:`~rlrun.weight_requests.FilesPending` (the
orchestrator benches the server and catches it up from the files once they are written). Only a server that
cannot be reached ends the update at once (the caller benches it).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Protocol

from rlrun.rollout.errors import RolloutError
from rlrun.rollout.verification import Expected, SentDigest, verify_weights
from rlrun.weight_requests import FilesPending, InMemoryTransfer, TransferFailed, WeightLoad

log = logging.getLogger(__name__)


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
        FilesPending: the in-memory send failed and ``path`` is not written yet (the server holds unknown
            weights: the caller leaves it unverified).
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
            # announced, not written yet: no wait inside the pause
            if not await asyncio.to_thread(Path(path).is_dir):
                raise FilesPending(
                    f"policy {version} in memory failed ({why}) before its files were written: it serves "
                    "nothing until caught up from them"
                ) from None
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
    await client.reload_weights(path)
    await _verified(client, expected)
    record.path, record.seconds = "filesystem", loop.time() - t0
    record.bytes = await asyncio.to_thread(_files_bytes, path)


def _files_bytes(path: str) -> int:
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))
