"""The orchestrator: wires the stages together and runs the main loop.

Each stage keeps its own policy (the map is in ``docs/design.md``): source, dispatcher, sink, flow control,
cancellation, weight follower, checkpoint manager (its docstring has the consistent cut with the trainer), and
:mod:`.resume` for how an attempt begins. This module passes results between them, ships batches, and pauses.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from collections.abc import Callable

from rlrun.api.control import OrchestratorPhase, PauseResult, ResumeReport, StatusReport
from rlrun.api.spec import RLRunSpec
from rlrun.batch import write_batch
from rlrun.envs import make_env
from rlrun.ledger import LEDGER_VERSION, Ledger, LedgerEvent
from rlrun.model.resolve import load_tokenizer
from rlrun.orchestrator.admission import Admission
from rlrun.orchestrator.cancellation import settle
from rlrun.orchestrator.checkpointing import CheckpointManager, capture_of
from rlrun.orchestrator.control import ControlServer, status_report
from rlrun.orchestrator.conversations import KeptConversations
from rlrun.orchestrator.curriculum import Curriculum
from rlrun.orchestrator.difficulty import TaskDifficulty
from rlrun.orchestrator.dispatcher import Dispatcher
from rlrun.orchestrator.endpoints import EndpointMembership
from rlrun.orchestrator.evaluation import EvalRounds, Evaluator
from rlrun.orchestrator.flow import FlowControl, dispatch_round, hold_reason
from rlrun.orchestrator.follower import WeightFollower
from rlrun.orchestrator.groups import GroupCancellation, GroupResult
from rlrun.orchestrator.journal import Journal
from rlrun.orchestrator.journal_files import FRESH_BASE
from rlrun.orchestrator.liveness import LivenessGuard, stall_accounting
from rlrun.orchestrator.metrics import StepMetrics
from rlrun.orchestrator.prometheus import registry_for
from rlrun.orchestrator.prompts import PromptLimit
from rlrun.orchestrator.resume import Stages, begin_attempt, record_stop
from rlrun.orchestrator.signals import TerminationHandler
from rlrun.orchestrator.sink import TrainSink
from rlrun.orchestrator.source import TrainSource
from rlrun.orchestrator.view import view_of
from rlrun.orchestrator.weights import weights_reference
from rlrun.rollout.client import RolloutClient
from rlrun.rundir import RunDir, run_dir_attempt, write_file_atomic
from rlrun.timeouts import within
from rlrun.tracking.publisher import AT_PAUSE_S, TrackerPublisher

log = logging.getLogger(__name__)

#: GIL switch interval of the orchestrator process, seconds. Snapshots are serialized in a
#: thread; with Python's default 5 ms the event loop can wait that long for the GIL at each
#: switch (measured p99 7.2 ms at 10k queued traces), with 1 ms it waited 3.4 ms at p99.
LOOP_SWITCH_INTERVAL_S = 0.001


class Orchestrator:
    """One attempt of one run's orchestrator.

    Args:
        spec: the run's spec.
        run_dir: shared run directory.
        rollout_urls: base URLs of the rollout servers (none: wait for ``PUT /rollout-endpoints``).
        model_path: the initial model (tokenizer and reference weight shapes come from it).
        max_steps: last step to ship (default ``spec.max_steps``).
        resume: continue from the newest complete checkpoint (start over when there is none).
        attempt: this attempt's number (the launcher or operator counts them; 0 = unnumbered).
        control_port: port of the control server (None: no server; 0: any free port).
        control_host: address of the control server.
        control_token: its bearer token.
        health_timeout_s: how long to wait for every rollout server to answer ``/health``, seconds.
        poll_s: how often to look for results and trainer output, seconds.
        client_factory: ``client_factory(url: str) -> RolloutClient`` (benchmarks pass an instant fake).
        run_uid: the run's uid (``--run-uid``): attempts are then numbered per run directory.
        name: the run's name (the RLRun's ``metadata.name``), for the experiment trackers.
        journal: keep the episode journal (:mod:`.journal`): finished episodes are durable before
            they count, so an abrupt kill loses none (False: only benchmarks' baselines).

    Attributes:
        attempt_number: ``attempt`` as given (``GET /status`` echoes it).
        attempt: the run-directory attempt (:func:`rlrun.rundir.run_dir_attempt`; ``attempt``
            without a run uid): what checkpoints, batches and the ledger are stamped with.
    """

    def __init__(
        self,
        spec: RLRunSpec,
        run_dir: RunDir,
        rollout_urls: list[str],
        model_path: str,
        max_steps: int | None = None,
        resume: bool = False,
        attempt: int = 0,
        control_port: int | None = None,
        control_host: str = "127.0.0.1",
        control_token: str | None = None,
        health_timeout_s: float = 600.0,
        poll_s: float = 0.05,
        client_factory: Callable[[str], RolloutClient] = RolloutClient,
        run_uid: str | None = None,
        journal: bool = True,
        name: str = "rlrun",
    ) -> None:
        self.spec = spec
        self.run_dir = run_dir.ensure()
        self.attempt_number = attempt
        attempt = run_dir_attempt(self.run_dir, run_uid, attempt)
        self.rollout_urls = [u.rstrip("/") for u in rollout_urls]
        self.model_path = model_path
        self.max_steps = max_steps or spec.max_steps
        self.resume = resume
        self.attempt = attempt
        self.health_timeout_s = health_timeout_s
        self.poll_s = poll_s
        self.client_factory = client_factory
        self.ledger = Ledger(self.run_dir.ledger, attempt, "orchestrator")
        self.envs = {e.name: make_env(e) for e in spec.envs}
        self.curriculum = Curriculum(spec.curriculum, TaskDifficulty(self.envs, spec.seed), spec.seed, self.ledger)
        self.source = TrainSource([(self.envs[e.name], e.weight) for e in spec.envs], spec.seed, 0, self.curriculum)
        self.sink = TrainSink.from_spec(spec, record=self.ledger.record)
        self.sink.difficulty = self.curriculum.difficulty  # told what each task's groups scored
        self.flow = FlowControl.from_spec(spec, self.max_steps)
        self.checkpoints = CheckpointManager(
            self.run_dir, attempt, spec.checkpoint.keep_last, self.ledger, lambda step: capture_of(self, step)
        )
        self.weights = WeightFollower.from_spec(spec, self.run_dir, attempt)
        self.metrics = StepMetrics(self.run_dir.metrics, attempt, self.weights, self.curriculum)
        committed = lambda: self.checkpoints.last_step  # noqa: E731 - read from the publisher's thread
        self.tracking = TrackerPublisher(spec, self.run_dir, name, run_uid, attempt, committed, self.max_steps)
        self.results: asyncio.Queue[GroupResult | None] = asyncio.Queue()  # None: wake up, episodes admitted
        self.use_journal = journal
        self.journal: Journal | None = None  # opened once the attempt has begun (its base is known)
        self.admission = Admission()
        self.kept = KeptConversations(self.ledger)  # multi-turn episodes at their last durable turn
        self.retries = spec.rollout.max_group_retries
        self.endpoints = EndpointMembership()
        self.liveness = LivenessGuard(spec)  # and the guard of a run whose groups all have zero reward spread
        self.evaluation = EvalRounds()
        self.dispatcher: Dispatcher | None = None
        self.shipped = 0
        self.hold_below = 0  # nothing is dispatched while the servers hold an older policy (a resume's: _begin)
        #: the last batch cut from the queue, shipped or being written: flow control counts it shipped (it trains)
        self.cut = 0
        self.phase: OrchestratorPhase = "starting"
        self.paused = False
        self.last_pause: PauseResult | None = None
        self.resume_report: ResumeReport | None = None
        self.control: ControlServer | None = None
        if control_port is not None:
            self.control = ControlServer(self, control_host, control_port, control_token or "", registry_for(self.view))
        deadline = spec.preemption.snapshot_timeout_seconds
        # paused, it pairs the trainer's save on notice before it stops, leaving a margin for that write
        pair = lambda left: self.checkpoints.pair_notice_save(left - max(1.0, 0.1 * deadline))  # noqa: E731
        self.termination = TerminationHandler(self.pause, self.request_stop, deadline, pair)
        self._pause_result: asyncio.Future[PauseResult] | None = None
        self._follower: asyncio.Task | None = None  # the follower loop (:meth:`_follow_trainer`), once running
        self._stop = asyncio.Event()

    @property
    def policy_version(self) -> int:
        """The policy version the rollout servers hold."""
        return self.weights.version

    async def set_endpoints(self, endpoints: list[str]) -> None:
        """Replace the rollout endpoints (``PUT /rollout-endpoints``; :meth:`.endpoints.EndpointMembership.set`:
        new ones get the current weights first, requests on removed ones are requested again at once).

        Raises:
            WeightsError, RolloutError: a new server could not be given the current weights.
        """
        self.rollout_urls = [e.rstrip("/") for e in endpoints]
        if self.dispatcher is not None:
            await self.endpoints.set(self.rollout_urls)
        log.info("rollout endpoints now %s", sorted(self.rollout_urls))

    def status(self) -> StatusReport:
        """What ``GET /status`` answers (:func:`.control.status_report`)."""
        return status_report(self.view())

    #: ``view(detail=False)``: this orchestrator now, read-only (:func:`.view.view_of`)
    view = view_of

    async def pause(self) -> PauseResult:
        """Stop dispatching and shipping, write the snapshot, and return its counts (idempotent).

        Before it has started (waiting for rollout servers, restoring) this attempt holds no work;
        once done, the final checkpoint holds everything: then nothing is written (a snapshot would
        pair an empty sink with a trainer part, or record the leftovers twice), the newest complete
        checkpoint stays what a next attempt resumes from, and the answer says so (``step`` None).
        While paused (until stopped), every newer trainer part of this attempt — the trainer's save on
        notice — is completed with this same snapshot (:mod:`.checkpointing`), so it is the one resumed from.
        The experiment trackers close before it answers (:mod:`rlrun.tracking.publisher`).

        Raises:
            OrchestratorError: no trainer part to pair the snapshot with.
            OSError: the snapshot could not be written.
        """
        if self._pause_result is None:
            self.paused = True
            before = self.phase
            self.phase = "pausing"
            self._pause_result = asyncio.get_running_loop().create_future()
            try:
                if before in ("starting", "done"):
                    note = "paused before starting" if before == "starting" else "the run is complete"
                    result = PauseResult.nothing_to_save(time.time(), f"{note}: nothing to save", before == "done")
                    log.info("%s: no snapshot needed", note)
                else:
                    result = PauseResult.of_checkpoint(await self.checkpoints.save_pause())
                    await asyncio.to_thread(self.tracking.close, AT_PAUSE_S)  # what W&B holds, recorded (publisher.py)
                self.last_pause = result
                self.phase = "done" if before == "done" else "paused"
                self._pause_result.set_result(result)
            except BaseException as exc:
                self._pause_result.set_exception(exc)
                self._pause_result.exception()  # mark retrieved
                self.phase = "failed"
                raise
        return await asyncio.shield(self._pause_result)

    def request_stop(self) -> None:
        """Make :meth:`run` return (after a pause, the process then exits)."""
        self._stop.set()

    # -- the work -----------------------------------------------------------------------------

    def _dispatch_within_budget(self) -> None:
        """Dispatch groups (resume requests first) while :class:`FlowControl` allows (:func:`.flow.dispatch_round`)."""
        if not self.paused:
            v = self.policy_version
            dispatch_round(
                self.flow, self.source, self.sink, self.dispatcher, self.ledger, v, self.cut, self.hold_below
            )

    def _settle(self, cancellations: list[GroupCancellation]) -> None:
        settle(cancellations, self.sink, self.source, self.dispatcher, self.ledger, self.retries, self.kept)

    async def _ship_ready_batches(self) -> None:
        """Ship every batch the queue can fill, then cancel in-flight work that can no longer train."""
        while self.shipped < self.max_steps and not self.paused:
            # Cutting a batch and counting it shipped straddle an await (the file write): a snapshot
            # taken in between would hold the batch neither in its queue nor as shipped, and a resume
            # would lose it. The checkpoint lock keeps snapshots out of that window.
            async with self.checkpoints.lock:
                if self.paused:
                    return
                step = self.shipped + 1
                batch = self.sink.take_batch(step)
                if batch is None:
                    return
                self.cut = step  # from here the batch is neither queued nor shipped: counted as shipped
                path = self.run_dir.rollout_batch(step)
                await asyncio.to_thread(write_batch, path, step, batch, self.pad_id, self.attempt)
                self.shipped = step
                self.ledger.write(LedgerEvent.SHIPPED, step=step, ids=[s.trace.episode_id for s in batch])
            self.metrics.shipped(step, batch, self.policy_version, self.sink, self.dispatcher)
            cancellations = self.dispatcher.cancel_stale(self.sink.min_fresh(step + 1))
            self._settle(cancellations)
            if cancellations:
                log.info("cancelled %d in-flight requests that can no longer train", len(cancellations))

    async def _follow_trainer(self) -> None:
        """Load each new policy into the rollout servers; complete each new trainer part with ours."""
        while True:
            if not self.paused and not self.evaluation.holding:  # a round holds the weights it scores
                before = self.policy_version
                push = await self.weights.follow(self._clients())
                if push is not None:
                    self.endpoints.bench(push.unreachable)
                    self._dispatch_within_budget()
                    self.evaluation.updated(before, self.policy_version)
            if not self.paused:
                await self.endpoints.look()
                await self.liveness.check()
            # Paused: the trainer's save on notice is completed with the pause snapshot (checkpointing.py).
            if not self.paused or self.checkpoints.paused_capture is not None:
                await self.checkpoints.complete_new_trainer_parts()
            await asyncio.sleep(self.poll_s)

    def _progress(self) -> tuple[int, int] | None:  # what moves while the run does (None: not running)
        return None if self.paused or self.phase != "running" else (self.shipped, self.sink.counters.episodes_finished)

    def _clients(self) -> list[RolloutClient]:
        return list(self.dispatcher.pool.clients.values()) if self.dispatcher is not None else []

    async def _load_last(self) -> None:  # the last step's weights, for the final evaluation
        await self.weights.load(self._clients(), self.weights.weights_dir(self.max_steps), self.max_steps)

    def _done(self) -> bool:
        return self.shipped >= self.max_steps and self.checkpoints.last_step >= self.max_steps

    async def _begin(self) -> None:
        """Resume, start over, or start fresh (:func:`.resume.begin_attempt`), and load the matching weights."""
        spec_json = self.spec.model_dump_json(indent=2).encode()  # what `rlrun eval RUN_DIR` evaluates with
        await asyncio.to_thread(write_file_atomic, self.run_dir.spec_file, spec_json, False)
        stages = Stages(self.source, self.sink, self.ledger, self.kept)
        restored = await begin_attempt(self.resume, self.run_dir, self.spec, stages)
        if self.use_journal:
            base = restored.journal_base if restored is not None else FRESH_BASE
            self.journal = await Journal.open(self.run_dir, self.attempt, base, self.admission.on_durable)
            self.checkpoints.journal = self.admission.journal = self.journal
        if restored is not None:
            self.shipped = restored.shipped
            self.cut = restored.shipped
            self.resume_report = restored.report
            self.checkpoints.resumed_from(restored.step)
            self.hold_below = restored.policy_version
            if self.hold_below > restored.step:
                log.info("resume: %s", hold_reason(self.hold_below, restored.step))
        step = restored.step if restored is not None else None
        self.endpoints.bench(await self.weights.begin(self._clients(), step, self.model_path))

    async def run(self) -> int:
        """Run until batch ``max_steps`` is shipped and checkpointed, or a pause then stop; returns the step.

        Its teardown is a checklist (:class:`contextlib.AsyncExitStack`): each stage registers its close as it starts
        (a failed set-up closes what had started), and they run in reverse. The journal, metrics and trackers start
        after the control server and close after it: their closes are registered first, and do nothing if not started.

        Raises:
            OrchestratorError: unusable run dir, rollout servers that never get healthy, or no batch can form.
            UnsupportedVersion: a first rollout server's vLLM is outside rlrun's pins (:mod:`rlrun.versions`).
            CheckpointMismatch: ``--resume`` against a checkpoint of a different run.
            WeightsError, RolloutError: weights that cannot be loaded into the rollout servers.
        """
        sys.setswitchinterval(LOOP_SWITCH_INTERVAL_S)
        self.ledger.write(LedgerEvent.STARTED, role="orchestrator", ledger_version=LEDGER_VERSION)
        self.termination.install()
        async with contextlib.AsyncExitStack() as teardown:
            teardown.callback(self.ledger.close)
            # the trackers log what is final: the last steps, the last evaluation
            teardown.push_async_callback(asyncio.to_thread, self.tracking.close)
            teardown.callback(self.metrics.close)
            teardown.push_async_callback(self._close_journal)  # after the dispatcher: nothing is journaled then
            if self.control is not None:
                await self.control.start()
                teardown.push_async_callback(self.control.stop)
            await self._wire()
            teardown.push_async_callback(self.dispatcher.aclose)
            teardown.push(self._record_stop)  # an exit callback: it sees the error the run ends with
            teardown.push_async_callback(lambda: self.checkpoints.finish(self._done()))
            teardown.push_async_callback(self._stop_work)
            return await self._run_attempt()

    async def _wire(self) -> None:
        """Make the dispatcher (the tokenizer loaded off the loop) and bind the stages to it and each other."""
        tokenizer = await asyncio.to_thread(load_tokenizer, self.model_path, self.spec.model)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.weights.reference = await asyncio.to_thread(weights_reference, self.spec, self.model_path)
        self.dispatcher = Dispatcher.from_spec(
            tokenizer, self.rollout_urls, self.envs, self.spec, self.results, self.client_factory
        )
        self.dispatcher.episodes.tell_rewards(self.max_steps, self.metrics.log_metric)  # TRL's trainer arguments
        self.endpoints.bind(
            self.dispatcher.pool, self.dispatcher.lose_on, self.weights, self._settle, self._dispatch_within_budget
        )
        evaluator = Evaluator.from_spec(
            self.spec, self.envs, tokenizer, self.run_dir.evaluations, self.attempt, self.dispatcher.episodes
        )
        self.evaluation.bind(evaluator, self._clients, self.max_steps, self.metrics)
        report = lambda: stall_accounting(self.view(detail=True))  # noqa: E731
        self.liveness.bind(self.dispatcher, self._settle, self._progress, report, self.sink)
        self.admission.bind(
            self.sink,
            self.source,
            self.dispatcher,
            self.ledger,
            self.metrics,
            self.results,
            self._settle,
            next_step=lambda: self.cut + 1,
            holding=lambda: self.paused or self.phase == "done",
            kept=self.kept,
        )

    async def _run_attempt(self) -> int:
        """Begin the attempt, then pass results, ship batches and dispatch until done or stopped; returns the step."""
        await PromptLimit(self.spec, self.ledger, self.metrics).start(self.dispatcher.episodes, self.source)
        await self.endpoints.start(self.health_timeout_s, self._stop)  # healthy, and of a vLLM within rlrun's pins
        if self._stop.is_set():  # stopped (SIGTERM after a pause) before it started
            log.info("stopped before starting")
            return self.shipped
        await self._begin()
        self.evaluation.start(self.policy_version)
        self.metrics.start()
        await asyncio.to_thread(self.tracking.start, self.resume_report)  # its imports, before the loop is busy
        if not self.paused:  # a pause during set-up stands
            self.phase = "running"
        self._follower = asyncio.create_task(self._follow_trainer())
        log.info(
            "orchestrator running (attempt %d, run-directory attempt %d): step %d of %d, endpoints %s",
            self.attempt_number,
            self.attempt,
            self.shipped,
            self.max_steps,
            self.rollout_urls,
        )
        await self._ship_ready_batches()  # a restored full batch ships at once
        self._dispatch_within_budget()
        while not self._done() and not self._stop.is_set():
            if self._follower.done():
                self._follower.result()  # re-raises its error
            if self.dispatcher.failures:
                raise self.dispatcher.failures[0]
            if self.paused:  # wait to be stopped; results are regenerated after resume
                await asyncio.sleep(self.poll_s)
                continue
            try:
                results = [await within(self.results.get(), self.poll_s)]  # a cancel is never lost (timeouts.py)
            except asyncio.TimeoutError:
                results = []
            if self.paused:  # a snapshot was taken meanwhile and lists these as emitted: they are re-run
                continue
            while not self.results.empty():
                results.append(self.results.get_nowait())
            for result in results:
                if result is not None:  # None only wakes the loop (episodes admitted)
                    self.admission.consume(result)
            await self._ship_ready_batches()
            self._dispatch_within_budget()
        if self._done():
            self.phase = "done"
            log.info("orchestrator done: %d steps shipped and checkpointed", self.shipped)
            await self.evaluation.finish(self._load_last)  # held, after any reload under way: it always runs
        return self.shipped

    # -- the teardown (run's checklist) --------------------------------------------------------

    async def _stop_work(self) -> None:
        """Nothing counts from here (the next attempt replays what is journaled); evaluation and follower stop."""
        self.admission.stopped = True
        self.evaluation.cancel()
        if self._follower is not None:
            self._follower.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._follower

    def _record_stop(self, kind: type[BaseException] | None, error: BaseException | None, tb: object) -> None:
        """The attempt's last ledger lines (:func:`.resume.record_stop`) with the error it ends with (None: none)."""
        out = self.dispatcher.emitted_requests()
        outcome = "complete" if self.phase == "done" else "paused" if self.paused else None
        record_stop(Stages(self.source, self.sink, self.ledger, self.kept), out, self.shipped, outcome, error)

    async def _close_journal(self) -> None:  # nothing to do for a journal never opened
        if self.journal is not None:
            await self.journal.aclose()
