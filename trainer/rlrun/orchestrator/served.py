"""What the rollout servers serve, checked after each weight update: servers that keep failing the
verification, and the trainer–sampler mismatch of each policy version.

Guarantees: a server whose updates fail verification :data:`MAX_UNVERIFIED` times in a row (its weights after
a reload are not the published ones: :mod:`rlrun.rollout.verification`) is refused — never used again while it
is listed, logged as an error naming it and both digests — and a run left with no server to use stops with one
line (:class:`ServedWeightsUnverified`); the mismatch of every policy version that has a probe
(:mod:`rlrun.probes`) is measured on every server that took it, and a run whose mismatch passes
``spec.rollout.max_mismatch_kl`` warns at the first version that does and stops once :data:`MISMATCH_VERSIONS`
versions in a row did (:class:`SamplerMismatch`): a mismatch that lasts is weights, model code or numerics
that differ between the trainer and vLLM, which the importance ratio was never meant to correct (issue 47: a
server that kept its old weights drove ``mismatch_kl`` to 1.9 and ``ratio_max`` to 140 over 10 steps, with no
warning).

Policy objects that own no task: :class:`~rlrun.orchestrator.follower.WeightFollower` calls them after each
push.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import httpx

from rlrun.errors import OrchestratorError
from rlrun.probes import ProbeSequence, mismatch_kl
from rlrun.rollout.client import RolloutClient, RolloutError

log = logging.getLogger(__name__)

#: Verification failures in a row after which a server is refused (each a reload: a broken one is not retried
#: for ever, a one-off failure is).
MAX_UNVERIFIED = 3
#: Policy versions in a row whose mismatch passes the threshold before the run stops (one warns).
MISMATCH_VERSIONS = 3


class ServedWeightsUnverified(OrchestratorError):
    """Every rollout server was refused for serving other weights than the published ones after
    :data:`MAX_UNVERIFIED` updates in a row (the message names them and both digests). Retrying the same
    images cannot heal it (``permanent``)."""

    permanent = True
    reason = "WeightsUnverified"


class SamplerMismatch(OrchestratorError):
    """The trainer–sampler mismatch passed ``spec.rollout.max_mismatch_kl`` at :data:`MISMATCH_VERSIONS`
    policy versions in a row (the message has the values). Retrying the same spec cannot heal it
    (``permanent``)."""

    permanent = True
    reason = "SamplerMismatch"


class UnverifiedServers:
    """Counts each server's verification failures in a row and says which to refuse.

    ``refuse(urls)``: takes the servers ``{url: why}`` out of use for good (bound by
    :meth:`rlrun.orchestrator.endpoints.EndpointMembership.bind`); without one, the run stops at once.
    """

    def __init__(self) -> None:
        self.in_a_row: dict[str, int] = {}
        self.total = 0  # server updates not verified, in this attempt (Prometheus)
        self.refuse: Callable[[dict[str, str]], None] | None = None

    def record(self, verified: list[str], unverified: dict[str, str], version: int) -> None:
        """One update's outcome: ``verified`` URLs, and ``unverified`` ones with why; refuses those that
        failed :data:`MAX_UNVERIFIED` times in a row.

        Raises:
            ServedWeightsUnverified: one is due and nothing can refuse it (no membership bound).
        """
        for url in verified:
            self.in_a_row.pop(url, None)
        due = {}
        self.total += len(unverified)
        for url, why in unverified.items():
            self.in_a_row[url] = count = self.in_a_row.get(url, 0) + 1
            what = "rollout server %s: policy %d not verified (%d in a row), no request until it is: %s"
            log.warning(what, url, version, count, why)
            if self.in_a_row[url] >= MAX_UNVERIFIED:
                times, why = f"{MAX_UNVERIFIED} times in a row", why.removeprefix(f"{url}: ")
                due[url] = f"{url} served other weights than the published ones {times}: {why}"
                del self.in_a_row[url]
        if due and self.refuse is None:
            raise ServedWeightsUnverified("; ".join(due.values()))
        if due:
            self.refuse(due)


async def served_mismatch(
    clients: list[RolloutClient], probe: list[ProbeSequence], unsafe: dict[str, bool] | None = None
) -> dict[str, float]:
    """The mismatch KL (nats/token, :func:`rlrun.probes.mismatch_kl`) of each server of ``clients`` on
    ``probe``: its prompt logprobs of the probe's sequences against the trainer's. A server that cannot answer
    (transport error, error status) is left out: the probe is a measurement, never a reason to fail an
    update. So is a server a prompt-logprobs request can kill (LoRA on vLLM-CPU:
    :meth:`~rlrun.rollout.client.RolloutClient.probes_unsafe`), asked once per URL and kept in ``unsafe``."""

    async def one(client: RolloutClient) -> tuple[str, float | None]:
        try:
            if unsafe is not None and client.base_url not in unsafe:
                unsafe[client.base_url] = await client.probes_unsafe()
                if unsafe[client.base_url]:
                    log.info("mismatch probe not sent to %s: LoRA on vLLM-CPU dies of it", client.base_url)
            if unsafe is not None and unsafe[client.base_url]:
                return client.base_url, None
            answers = [await client.prompt_logprobs(s.ids) for s in probe]  # one at a time: the client's rule
        except (RolloutError, httpx.HTTPError, RuntimeError) as exc:  # RuntimeError: its client was closed
            log.info("mismatch probe on %s not measured: %s", client.base_url, exc)
            return client.base_url, None
        total, tokens = 0.0, 0
        for sequence, served in zip(probe, answers, strict=True):
            kl, n = mismatch_kl(sequence.logprobs, served)
            total, tokens = total + kl, tokens + n
        return client.base_url, total / tokens if tokens else None

    results = await asyncio.gather(*(one(c) for c in clients))
    return {url: kl for url, kl in results if kl is not None}


class MismatchGuard:
    """Warns when a policy version's mismatch (the largest over the servers) passes ``threshold`` (None:
    never), stops the run after :data:`MISMATCH_VERSIONS` such versions in a row (module docstring).

    Attributes:
        last: the mismatch of the newest version measured, its largest over the servers (None: none measured).
        above: versions in a row above the threshold.
    """

    def __init__(self, threshold: float | None) -> None:
        self.threshold = threshold
        self.unsafe: dict[str, bool] = {}  # servers a probe would kill (served_mismatch), by URL
        self.last: float | None = None
        self.above = 0
        self._version = -1  # the newest version observed: a catch-up measuring it again counts no new version

    def observe(self, version: int, per_server: dict[str, float]) -> None:
        """The mismatch of ``version`` on each server (again for a version already observed: a server caught
        up to it, whose value counts only when it is the version's largest).

        Raises:
            SamplerMismatch: the :data:`MISMATCH_VERSIONS`-th version in a row above the threshold.
        """
        if not per_server:
            return
        url, value = max(per_server.items(), key=lambda item: item[1])
        if version <= self._version and (self.last is None or value <= self.last):
            return
        if version > self._version:
            self._version, self.last = version, value
        else:  # the same version, larger on the server caught up: it replaces the version's count
            self.above, self.last = max(0, self.above - 1), value
        if self.threshold is None or self.last <= self.threshold:
            self.above = 0
            return
        self.above += 1
        what = (
            f"the trainer–sampler mismatch of policy {version} is {self.last:.3g} nats/token on {url}, above "
            f"spec.rollout.max_mismatch_kl {self.threshold:g} ({self.above} version(s) in a row)"
        )
        if self.above >= MISMATCH_VERSIONS:
            raise SamplerMismatch(
                f"{what}: the rollout servers do not serve what the trainer computes (weights, model code "
                "or dtype differ: check spec.trainer.precision against the servers' dtype, and the vLLM "
                "version), or raise the threshold"
            )
        log.warning("%s; the run stops at %d in a row", what, MISMATCH_VERSIONS)
