"""Dispatcher: turns group requests into rollouts on the rollout servers.

Guarantee: every dispatched request reaches the results queue exactly once — as a
:class:`GroupResult` with its episodes, or with its ``error`` when it failed — or not at
all because it was cancelled (counted in ``cancelled_groups``); each episode carries the
policy version that was current when its group was dispatched. No request waits forever.

One request with ``n = members`` samples a whole group (they share the prompt) unless
``rollout.members_per_request`` splits it, so that members finish at different times. Each try of a request
goes to the server the :class:`~rlrun.orchestrator.endpoints.RolloutPool` picks (one holding the version the
request is labelled with and not reloading: the label is never newer than the weights that produce the
tokens). A request that fails on a server — a transport error, an error answer, or no answer within
``rollout.request_timeout_seconds`` — is retried (tenacity), on a server that has not failed recently when
there is one, for up to ``rollout.retry_window_seconds``; then its result carries the error, so the
orchestrator can request the members again or abandon the group (:mod:`~rlrun.orchestrator.cancellation`). An
answer with a completion that cannot be trained (``UnusableCompletion``: no tokens, ``abort``, ``error``…)
fails the request at once, to be requested again within ``rollout.max_group_retries``: never scored (a reward
0 would bias its siblings' advantages); so does a refusal (a 4xx,
:class:`~rlrun.rollout.rejections.RequestRejected`: the same request gets the same answer anywhere), never
retried as a server fault. A prompt refused as longer than the server's context
(:class:`~rlrun.rollout.rejections.ContextExceeded`, where rlrun did not know that context) stops the run at
once with one line naming ``spec.rollout.max_model_len``
(:class:`~rlrun.orchestrator.episodes.ServerContextTooSmall`); a later turn of a multi-turn episode refused so
ends that episode truncated (:mod:`.turns`). Each delivered request's outcome goes to the run's
:class:`~rlrun.orchestrator.failing.FailureStreak`, which stops a run whose requests keep failing. A server
the pool takes out of use (removed from the endpoint set, or benched) loses the requests in flight on it:
:meth:`Dispatcher.lose_on` cancels them at once and returns them for settling as ``lost`` (a
:class:`~rlrun.orchestrator.cancellation.GroupCancellation`, as :meth:`Dispatcher.cancel_stale` returns). A
multi-turn env's request samples every member's first turn at once, then each member's next turns one request
each (:mod:`.turns`; same retries and version rule); its members share one fate.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from tenacity import AsyncRetrying, retry_if_exception, stop_after_delay, wait_exponential

from rlrun.api.spec import RLRunSpec, SamplingSpec
from rlrun.envs.base import Env
from rlrun.orchestrator.endpoints import RolloutPool
from rlrun.orchestrator.episodes import EpisodeBuilder
from rlrun.orchestrator.failing import FailureKind, FailureStreak
from rlrun.orchestrator.groups import GroupCancellation, GroupRequest, GroupResult, KeptConversation
from rlrun.orchestrator.turns import Conversation, TurnIO, go_on, is_env_failure, play_all, sum_sampled
from rlrun.rollout.client import (
    Completion,
    ContextExceeded,
    RequestRejected,
    RolloutClient,
    RolloutError,
    ServerReloading,
    UnusableCompletion,
)
from rlrun.timeouts import describe_failure

log = logging.getLogger(__name__)

#: What a failed try of a request raises: the server is gone, answered an error, or took too long.
_REQUEST_ERRORS = (httpx.TransportError, RolloutError, asyncio.TimeoutError)
#: The setting a try's time limit (``request_timeout_s``) comes from, as a timed-out try's failure names it.
TIMEOUT_SETTING = "rollout.request_timeout_seconds"


def _retried_in_place(exc: BaseException) -> bool:
    """A failed try worth another (the server may answer next time); an unusable completion or a refusal is
    not."""
    return isinstance(exc, _REQUEST_ERRORS) and not isinstance(exc, (UnusableCompletion, RequestRejected))


def _key(request: GroupRequest) -> tuple[int, int]:
    return (request.group_id, request.first_member)


@dataclass
class _Inflight:  # a request in flight: its task, what it asks, its label, and its current try
    task: asyncio.Task
    request: GroupRequest
    policy_version: int
    url: str | None = None  # the endpoint its current try waits on (None between tries)
    sent_at: float = 0.0  # when its current try was sent (monotonic seconds)


class Dispatcher:
    """Runs group requests against a set of rollout endpoints.

    Args:
        endpoints: base URLs of the rollout servers (its :attr:`pool` begins with them).
        episodes: makes prompts' token ids and scored episodes (:class:`EpisodeBuilder`).
        sampling: sampling parameters.
        results: the ``asyncio.Queue[GroupResult]`` finished and failed requests go to.
        retry_window_s: how long a request keeps being retried before it fails, seconds.
        client_factory: ``client_factory(url: str) -> RolloutClient`` for each endpoint (tests and
            benchmarks pass fakes).
        members_per_request: split a group into requests of at most this many members (None: one request).
        request_timeout_s: most seconds one try of a request may take on one server.
        streak: the failed requests in a row that stop the run (default: :class:`FailureStreak`'s own limits).

    Attributes:
        pool: the rollout servers in use (:class:`~rlrun.orchestrator.endpoints.RolloutPool`), which picks each try's.
        failures: unexpected exceptions of request tasks (bugs, not rollout failures): the
            orchestrator re-raises the first.
    """

    def __init__(
        self,
        endpoints: list[str],
        episodes: EpisodeBuilder,
        sampling: SamplingSpec,
        results: asyncio.Queue[GroupResult],
        retry_window_s: float = 120.0,
        client_factory: Callable[[str], RolloutClient] = RolloutClient,
        members_per_request: int | None = None,
        request_timeout_s: float = 300.0,
        streak: FailureStreak | None = None,
    ) -> None:
        self.pool = RolloutPool(endpoints, client_factory, retry_window_s)
        self.streak = streak if streak is not None else FailureStreak()
        self._context_told = False  # whether a multi-turn turn refused for the context was logged (once)
        self.inflight: dict[tuple[int, int], _Inflight] = {}
        self.cancelled_groups = 0
        self.episodes = episodes
        self.sampling = sampling
        self.results = results
        self.retry_window_s = retry_window_s
        self.request_timeout_s = request_timeout_s
        self.members_per_request = members_per_request
        # results put on the queue and not yet taken by the consumer, by (group id, first member)
        self.undelivered: dict[tuple[int, int], GroupRequest] = {}
        self.failures: list[BaseException] = []
        #: ``keep_turn(conversation)``: a multi-turn episode's turn to keep (the orchestrator journals it); None: none
        #: kept
        self.keep_turn: Callable[[KeptConversation], None] | None = None

    @classmethod
    def from_spec(
        cls,
        tokenizer: Any,
        endpoints: list[str],
        envs: dict[str, Env],
        spec: RLRunSpec,
        results: asyncio.Queue[GroupResult],
        client_factory: Callable[[str], RolloutClient] = RolloutClient,
    ) -> Dispatcher:
        """The dispatcher of a run: its episodes made with a Hugging Face ``tokenizer`` and the envs' rewards
        (:meth:`EpisodeBuilder.from_spec`); sampling, ``members_per_request``, the request timeout, the retry
        window and the failure streak's limits from ``spec``."""
        return cls(
            endpoints,
            episodes=EpisodeBuilder.from_spec(tokenizer, envs, spec),
            sampling=spec.sampling,
            results=results,
            retry_window_s=spec.rollout.retry_window_seconds,
            client_factory=client_factory,
            members_per_request=spec.rollout.members_per_request,
            request_timeout_s=spec.rollout.request_timeout_seconds,
            streak=FailureStreak.from_spec(spec),
        )

    def lose_on(self, urls: list[str], why: str) -> list[GroupCancellation]:
        """Cancel the requests whose current try waits on a server in ``urls`` (the pool took it out of use:
        removed or benched), returned as ``lost`` cancellations (:meth:`lose`) to settle before the caller's next
        ``await``. A request between tries (its last server failed) is not lost: its next try picks among the
        servers left."""
        return self.lose([_key(e.request) for e in self.inflight.values() if e.url in urls], why)

    def lose(self, keys: list[tuple[int, int]], why: str) -> list[GroupCancellation]:
        """Cancel in-flight requests ``keys`` (their server is gone, or not working on them: :mod:`.liveness`), returned
        as ``lost`` cancellations (``rollout endpoint <url> <why>``) to settle before the caller's next ``await``."""
        lost = [self.inflight.pop(k) for k in keys if k in self.inflight]
        for entry in lost:
            entry.task.cancel()
        self.cancelled_groups += len(lost)
        return [
            GroupCancellation(
                e.request, None, self.has_work_out(e.request.group_id), "lost", f"rollout endpoint {e.url} {why}"
            )
            for e in lost
        ]

    @property
    def inflight_samples(self) -> int:
        """Completions requested and not yet returned."""
        return sum(f.request.members for f in self.inflight.values())

    @property
    def outstanding_samples(self) -> int:
        """Samples dispatched that the consumer has not yet taken: in flight or waiting in the queue."""
        return self.inflight_samples + sum(r.members for r in self.undelivered.values())

    def emitted_requests(self) -> list[GroupRequest]:
        """Requests dispatched whose results have not reached the consumer (in flight or queued).

        These are ``emitted_train_groups`` of a sink snapshot: their results are not saved,
        so a resume re-requests them (same task, same group id).
        """
        return [f.request for f in self.inflight.values()] + list(self.undelivered.values())

    def has_work_out(self, group_id: int) -> bool:
        """Whether a request of the group is in flight or delivered and not yet taken."""
        return any(r.group_id == group_id for r in self.emitted_requests())

    def take(self, result: GroupResult) -> GroupResult:
        """Mark ``result`` (got from the results queue) as taken by the consumer."""
        key = _key(result.request)
        self.undelivered.pop(key, None)
        # The task's done-callback may not have run yet; the request is no longer in flight either way,
        # and a snapshot must not list it as emitted once its episodes are in the sink.
        self.inflight.pop(key, None)
        return result

    def dispatch(self, request: GroupRequest, policy_version: int) -> None:
        """Start rolling out ``request`` with the current policy ``policy_version``, in requests of at most
        ``members_per_request`` members (each a :class:`GroupRequest` of its own, same group id)."""
        if request.resume_from is not None:  # a continued episode keeps its first turn's version (its staleness)
            parts = [request]
            policy_version = request.resume_from.policy_version
        else:
            size = self.members_per_request or request.members
            parts = [
                GroupRequest(request.group_id, request.task, min(size, request.next_member - first), first)
                for first in range(request.first_member, request.next_member, size)
            ]
        for part in parts:
            task = asyncio.get_running_loop().create_task(self._run(part, policy_version))
            self.inflight[_key(part)] = _Inflight(task, part, policy_version)
            task.add_done_callback(lambda t, key=_key(part): self._done(key, t))

    def _done(self, key: tuple[int, int], task: asyncio.Task) -> None:
        entry = self.inflight.get(key)
        raised = not task.cancelled() and task.exception() is not None
        if entry is not None and entry.task is task and not raised:
            del self.inflight[key]
        if raised:  # the run stops on it; listed until then, so the stop records its group as left over
            self.failures.append(task.exception())

    async def _sample(
        self, request: GroupRequest, prompt_ids: Sequence[int], n: int, policy_version: int, failed: set[str]
    ) -> list[Completion]:
        """``n`` completions of ``prompt_ids`` for ``request``, retried (module docstring) on servers holding
        ``policy_version``; ``failed``: the servers that failed this request (shared by its turns).

        Raises:
            UnusableCompletion, RequestRejected: at once; a request error once ``retry_window_s`` has passed.
        """
        entry = self.inflight.get(_key(request))  # registered by dispatch before the request's task runs
        members = f"group {request.group_id} members {request.first_member}–{request.next_member - 1}"
        async for attempt in AsyncRetrying(
            retry=retry_if_exception(_retried_in_place),
            stop=stop_after_delay(self.retry_window_s),
            wait=wait_exponential(multiplier=0.5, max=5),
            reraise=True,
        ):
            with attempt:
                while True:
                    url = await self.pool.pick(failed, policy_version)
                    if entry is not None:  # a multi-turn request's members share it: the latest try is shown
                        entry.url, entry.sent_at = url, time.monotonic()
                    try:
                        with self.pool.sending(url, n) as client:
                            completions = await asyncio.wait_for(
                                client.complete(prompt_ids, self.sampling, n=n), self.request_timeout_s
                            )
                        self.streak.answered()  # a server answers: the rollout streak ends (failing.py)
                        return completions
                    except ServerReloading as exc:  # not the server's failure: ask again at once
                        if exc.answered_after_pause:
                            log.info("%s: %s; asked again", members, exc)
                        continue
                    except (UnusableCompletion, RequestRejected):
                        raise  # the server works; the request or its answer is what cannot be used
                    except _REQUEST_ERRORS as exc:
                        failed.add(url)
                        self.pool.note_failure(url)
                        why = describe_failure(exc, self.request_timeout_s, TIMEOUT_SETTING)
                        log.warning("%s failed on %s: %s", members, url, why)
                        raise
                    finally:
                        if entry is not None and entry.url == url:
                            entry.url = None

    async def _run(self, request: GroupRequest, policy_version: int) -> None:
        kept = request.resume_from  # a multi-turn episode continued at its last durable turn
        prompt_ids = kept.prompt_ids if kept is not None else self.episodes.prompt_ids(request.task)
        failed: set[str] = set()  # endpoints that failed this request: a healthy one is tried first
        members = f"group {request.group_id} members {request.first_member}–{request.next_member - 1}"
        completions, conversations = None, None
        try:
            if kept is not None or self.episodes.multi_turn(request.task):
                env = self.episodes.envs[request.task.env]
                io = self._turn_io(request, policy_version, failed)
            if kept is not None:
                conversations = [await go_on(env, request.task, Conversation.from_kept(kept), io, kept.member)]
            else:
                completions = await self._sample(request, prompt_ids, request.members, policy_version, failed)
                if self.episodes.multi_turn(request.task):  # each member's conversation goes on on its own
                    conversations = await play_all(env, request.task, prompt_ids, completions, io, request.first_member)
        except ContextExceeded as exc:  # the first turn: the prompt itself does not fit the server's context
            raise self.episodes.context_refused(request.task, len(prompt_ids), exc) from None
        except (UnusableCompletion, RequestRejected) as exc:
            log.warning("%s: %s", members, exc)
            kind = "unusable" if isinstance(exc, UnusableCompletion) else "rejected"
            self._deliver(GroupResult(request, error=str(exc)), kind)
            return
        except _REQUEST_ERRORS as exc:
            error = (
                f"failed on every try for {self.retry_window_s:.0f} s "
                f"({describe_failure(exc, self.request_timeout_s, TIMEOUT_SETTING)})"
            )
            log.warning("%s %s", members, error)
            self._deliver(GroupResult(request, error=error), "server")
            return
        scored = await self.episodes.episodes(request, policy_version, prompt_ids, completions, conversations)
        if conversations is None:
            tokens = sum(len(c.token_ids) for c in completions or [])
        else:  # sampled in this request: a continued conversation's earlier turns were counted when sampled
            tokens = sum_sampled(conversations) - (kept.sampled_tokens if kept is not None else 0)
        failed = None
        if scored.failed and not scored.episodes:  # every member's reward, or env, failed
            env = all(is_env_failure(error, request.task.env) for _, error in scored.failed)
            failed = "env" if env else "reward"
        self._deliver(GroupResult(request, scored, tokens), failed)

    def _turn_io(self, request: GroupRequest, policy_version: int, failed: set[str]) -> TurnIO:
        """How ``request``'s conversations sample turns (this dispatcher's retried requests) and keep them
        (:attr:`keep_turn`, when the env says its state can be restored: ``resumable``)."""
        keep = None
        if self.keep_turn is not None and getattr(self.episodes.envs[request.task.env], "resumable", False):

            def keep(member: int, conv: Conversation) -> None:
                self.keep_turn(conv.kept(request.group_id, member, request.task, policy_version))

        io = self.episodes.turn_io(request.task, lambda ids: self._turn(request, ids, policy_version, failed))
        return dataclasses.replace(io, keep=keep)

    async def _turn(self, request: GroupRequest, ids: list[int], policy_version: int, failed: set[str]) -> Completion:
        try:
            return (await self._sample(request, ids, 1, policy_version, failed))[0]
        except ContextExceeded as exc:  # the episode ends truncated (turns.py); said once per attempt
            if not self._context_told:
                self._context_told = True
                log.warning(
                    "env %s: a turn of %d tokens was refused by the rollout server as longer than its "
                    "context (%s): such episodes end at their last turn (length), at the cost of one "
                    "refused request each; set spec.rollout.max_model_len to the server's context to end "
                    "them before it",
                    request.task.env,
                    len(ids),
                    exc.context or exc.message[:120],
                )
            raise

    def _deliver(self, result: GroupResult, failed: FailureKind | None = None) -> None:
        """Put ``result`` on the results queue, unless its request was cancelled meanwhile; its outcome
        (``failed``: how it failed, None: it delivered an episode) goes to the failure streak first.

        Raises:
            RequestsFailing: the streak reached its limit (the request's task fails with it: the run stops).
        """
        key = _key(result.request)
        entry = self.inflight.get(key)
        if entry is None or entry.task is not asyncio.current_task():
            # Cancelled meanwhile (cancel_stale, cancel_group): its members were settled as cancelled, so its
            # result must never reach the sink. asyncio.wait_for can return a result whose cancellation
            # raced it (Python < 3.12), so the task may get here after being cancelled.
            return
        if failed is None:
            self.streak.delivered()
        else:
            error = result.error or result.scored.failed[0][1]
            self.streak.failed(failed, result.request.task.env, error)
        self.undelivered[key] = result.request
        self.results.put_nowait(result)

    def cancel_stale(self, min_version: int) -> list[GroupCancellation]:
        """Cancel in-flight requests dispatched before policy ``min_version`` (they can no longer train).

        Returns one :class:`GroupCancellation` per cancelled request, in dispatch order, each saying
        whether other requests of its group are still out once all of them are cancelled.
        """
        cancelled = []
        for entry in list(self.inflight.values()):
            if entry.policy_version < min_version:
                entry.task.cancel()
                del self.inflight[_key(entry.request)]
                cancelled.append(entry.request)
        self.cancelled_groups += len(cancelled)
        return [GroupCancellation(r, min_version, self.has_work_out(r.group_id)) for r in cancelled]

    def cancel_group(self, group_id: int) -> int:
        """Cancel every request of an abandoned group: in flight ones stop, delivered ones stop counting as
        emitted (their results, if already queued, are still consumed). Returns how many were cancelled."""
        cancelled = 0
        for key in [k for k in self.inflight if k[0] == group_id]:
            self.inflight.pop(key).task.cancel()
            cancelled += 1
        for key in [k for k in self.undelivered if k[0] == group_id]:
            del self.undelivered[key]
        return cancelled

    async def aclose(self) -> None:
        """Cancel everything in flight and close the HTTP clients."""
        tasks = [e.task for e in self.inflight.values()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.inflight.clear()
        await self.pool.aclose()
        self.episodes.close()
