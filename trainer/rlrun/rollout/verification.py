"""Checking that a rollout server holds what was published, after every weight or adapter update.

Guarantee (ARCHITECTURE.md, invariant 8): an update counts — the client's ``loaded_version`` moves to it, and
with it the requests the dispatcher sends — only once the digest the server's workers compute over what they
hold equals the digest of the published files as that server holds them (:mod:`rlrun.weights_digest`).
Otherwise the update raises :class:`~rlrun.rollout.errors.WeightsUnverified`: a full-weights server is left at
:data:`UNVERIFIED` (its weights are unknown: no completion goes to it,
:meth:`rlrun.rollout.client.RolloutClient.complete` refuses one) and a LoRA server at the adapter it held
before, which it still serves as verified; the orchestrator's periodic catch-up asks again
(:meth:`rlrun.orchestrator.endpoints.EndpointMembership.catch_up_lagging`).

A worker that cannot compare its weights (quantized, key/value heads replicated over tensor-parallel ranks:
the digest's multiset is then not the files') says why; the update counts, with a warning once per server and
reason — rlrun refuses no such server, and says it was not checked.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from rlrun.rollout.errors import WeightsUnverified
from rlrun.weights_digest import Digest, adapter_digest, dtype_of, files_digest

log = logging.getLogger(__name__)

#: ``loaded_version`` of a server whose weights are unknown (a reload that was not verified, or failed part
#: way): below every policy version, so the dispatcher never picks it.
UNVERIFIED = -1

_warned: set[tuple[str, str]] = set()  # (server, why) of the weights that could not be compared, warned once


class Expected:
    """The digest the published directory ``path`` has as each served dtype holds it, computed once per dtype,
    off the event loop, for every client of one update (``adapter``: a LoRA adapter's directory,
    :func:`~rlrun.weights_digest.adapter_digest`; else full weights,
    :func:`~rlrun.weights_digest.files_digest`)."""

    def __init__(self, path: str | Path, adapter: bool) -> None:
        self.path = Path(path)
        self.adapter = adapter
        self._digests: dict[str, asyncio.Future[Digest]] = {}

    def prefetch(self, dtype: str) -> None:
        """Start digesting the files as a server serving ``dtype`` holds them, before any server answers: the
        trainer publishes in the dtype the servers serve, so the digest a reload is checked against is ready
        when the reload ends (one pass over the files in a thread: ≈ 3 GB/s on one core here)."""
        self._start(dtype)

    async def of(self, dtype: str) -> Digest:
        """The digest as a server serving ``dtype`` holds the files (``"torch.bfloat16"``; several,
        comma-separated: each value as published, no cast).

        Raises:
            OSError, ValueError: the files cannot be read.
        """
        return await asyncio.shield(self._start(dtype))

    def _start(self, dtype: str) -> asyncio.Future[Digest]:
        if dtype not in self._digests:
            served = None if "," in dtype else dtype_of(dtype)
            if self.adapter:
                work = asyncio.to_thread(adapter_digest, self.path, served)
            else:
                work = asyncio.to_thread(files_digest, self.path, served)
            self._digests[dtype] = future = asyncio.ensure_future(work)
            future.add_done_callback(lambda f: f.cancelled() or f.exception())  # an unused prefetch's error
        return self._digests[dtype]


class SentDigest(Expected):
    """What a server must serve after an in-memory send (``spec.weights.transport: collective``): the digest of the
    tensors the trainer sent, as sent (the dtype the servers serve), whatever dtype a worker reports."""

    def __init__(self, digest: Digest, version: int) -> None:
        super().__init__(f"policy {version} sent in memory", adapter=False)
        self.digest = digest

    async def of(self, dtype: str) -> Digest:
        return self.digest

    def prefetch(self, dtype: str) -> None:
        pass


def _answers(base_url: str, results: list, what: str) -> list[dict]:
    """The workers' answers, each ``{"ok": True, …}``.

    Raises:
        WeightsUnverified: no answer, or a worker that failed.
    """
    if not results or any(not isinstance(r, dict) or not r.get("ok") for r in results):
        raise WeightsUnverified(f"{base_url}: no digest of the {what} it holds: {results}")
    return results


def _unverifiable(base_url: str, answers: list[dict]) -> bool:
    """Whether a worker said its weights cannot be compared (warned once per server and reason)."""
    why = next((a.get("why") or "no digest" for a in answers if a.get("digest") is None), None)
    if why is not None and (base_url, why) not in _warned:
        _warned.add((base_url, why))
        log.warning("rollout server %s: weights not verifiable (%s); updates count unchecked", base_url, why)
    return why is not None


async def verify_weights(base_url: str, results: list, expected: Expected) -> Digest | None:
    """Check the workers' answers to ``rlrun_weights_digest`` (``results``, one per worker: each its share)
    against the published weights; returns the server's digest (None: not comparable, warned).

    Raises:
        WeightsUnverified: a worker failed, or the sum of their digests is not the files' (both named).
        OSError, ValueError: the published files cannot be read.
    """
    answers = _answers(base_url, results, "weights")
    if _unverifiable(base_url, answers):
        return None
    served = sum((Digest.from_json(a["digest"]) for a in answers), Digest())
    want = await expected.of(answers[0].get("dtype") or "torch.float32")
    if served != want:
        raise WeightsUnverified(
            f"{base_url}: after loading {expected.path} it serves other weights ({served}; the files: {want})"
        )
    return served


async def verify_adapter(base_url: str, name: str, results: list, expected: Expected) -> Digest:
    """Check the workers' answers to ``rlrun_adapter_digest`` (``results``: each rank holds the whole adapter)
    against the published adapter, loaded as ``name``; returns its digest.

    Raises:
        WeightsUnverified: a worker failed, or one holds another adapter than the files (both digests named).
        OSError, ValueError: the published files cannot be read.
    """
    answers = _answers(base_url, results, f"adapter {name}")
    want = await expected.of(answers[0].get("dtype") or "torch.float32")
    for answer in answers:
        served = Digest.from_json(answer.get("digest") or {})
        if served != want:
            raise WeightsUnverified(
                f"{base_url}: adapter {name} loaded from {expected.path} is not the published one "
                f"({served}; the files: {want})"
            )
    return want
