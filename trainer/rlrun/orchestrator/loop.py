"""The orchestrator's main loop: dispatch, collect, ship, follow the trainer.

Flow control. A rollout dispatched at policy version ``v`` can train at most in
batch ``v + 1 + max_off_policy_steps``, so at version ``v`` with ``shipped``
batches out, rollouts can still fill ``v + 1 + max_off_policy_steps − shipped``
batches. The loop dispatches new groups only while queued + open + in-flight
samples stay below that many batches (and in-flight samples below
``rollout.max_inflight``): it never produces work that is stale on arrival, and
with ``max_off_policy_steps = 0`` it is exactly synchronous on-policy RL.

Checkpoints. When the trainer publishes ``checkpoints/step_N/trainer/``, the
orchestrator writes its own part, ``progress.pt`` (batches shipped, data cursor),
which completes step N. Batches shipped after step N stay on disk until a
complete checkpoint past them exists, so a resume from N finds them and the
trainer trains each exactly once; the resumed orchestrator adopts them rather
than shipping new batches under the same step numbers.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import time
from pathlib import Path

from transformers import AutoTokenizer

from rlrun.batch import write_batch
from rlrun.checkpoint import (
    check_compatible,
    complete_steps,
    latest_complete_checkpoint,
    prune_checkpoints,
    run_identity,
    save_orchestrator_progress,
)
from rlrun.envs import make_env
from rlrun.orchestrator.dispatcher import Dispatcher, GroupResult
from rlrun.orchestrator.sink import TrainSink
from rlrun.orchestrator.source import TrainSource
from rlrun.orchestrator.weights import Signature, push_weights, weights_signature
from rlrun.rollout.client import RolloutClient
from rlrun.rundir import RunDir, step_dirs
from rlrun.spec import RLRunSpec

log = logging.getLogger(__name__)


class OrchestratorError(RuntimeError):
    """The orchestrator cannot go on (message says why and what to do)."""


class Orchestrator:
    """One run's orchestrator.

    Args:
        spec: the run's spec.
        run_dir: shared run directory.
        rollout_urls: base URLs of the rollout servers.
        model_path: the initial model (tokenizer and reference weight shapes come from it).
        max_steps: last step to ship (default ``spec.max_steps``).
        resume: continue from the newest complete checkpoint.
        health_timeout_s: how long to wait for every rollout server to answer ``/health``.
        poll_s: how often to look for trainer output, seconds.
        client_factory: makes a rollout client from a URL (benchmarks pass an instant fake).
    """

    def __init__(
        self,
        spec: RLRunSpec,
        run_dir: RunDir,
        rollout_urls: list[str],
        model_path: str,
        max_steps: int | None = None,
        resume: bool = False,
        health_timeout_s: float = 600.0,
        poll_s: float = 0.05,
        client_factory=RolloutClient,
    ) -> None:
        self.client_factory = client_factory
        self.spec = spec
        self.run_dir = run_dir.ensure()
        self.rollout_urls = rollout_urls
        self.model_path = model_path
        self.max_steps = max_steps or spec.max_steps
        self.resume = resume
        self.health_timeout_s = health_timeout_s
        self.poll_s = poll_s
        self.envs = {e.name: make_env(e) for e in spec.envs}
        self.source = TrainSource([(self.envs[e.name], e.weight) for e in spec.envs], spec.seed)
        self.sink = TrainSink(
            spec.group_size, spec.batch_size, spec.max_off_policy_steps, spec.loss.std_normalize_advantages
        )
        self.results: asyncio.Queue[GroupResult] = asyncio.Queue()
        self.shipped = 0
        self.policy_version = 0
        self.last_saved_checkpoint = 0
        self.reference: Signature | None = None
        self._tokens_since_ship = 0
        self._last_ship_time = time.monotonic()
        self._metrics_file = None

    # -- set-up -------------------------------------------------------------------------------

    async def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.health_timeout_s
        pending = set(self.dispatcher.clients)
        while pending:
            for url in list(pending):
                if await self.dispatcher.clients[url].healthy():
                    pending.discard(url)
            if pending:
                if time.monotonic() > deadline:
                    raise OrchestratorError(
                        f"rollout servers not healthy after {self.health_timeout_s:.0f} s: {sorted(pending)}"
                    )
                await asyncio.sleep(1.0)

    def _check_fresh_run_dir(self) -> None:
        leftovers = [p for p in (self.run_dir.checkpoints, self.run_dir.rollouts) if step_dirs(p)]
        if leftovers:
            raise OrchestratorError(
                f"{self.run_dir.root} already holds a run ({', '.join(str(p) for p in leftovers)}); "
                "resume it with --resume or choose another --run-dir"
            )

    async def _restore(self) -> None:
        ckpt = await asyncio.to_thread(latest_complete_checkpoint, self.run_dir)
        if ckpt is None:
            log.info("resume: no complete checkpoint in %s; starting from step 0", self.run_dir.root)
            self._check_fresh_run_dir()
            return
        state = ckpt.orchestrator
        check_compatible(state.get("identity"), self.spec, str(self.run_dir.orchestrator_checkpoint(ckpt.step)))
        self.source.load_state(state["source"])
        self.policy_version = ckpt.step
        self.last_saved_checkpoint = ckpt.step
        self.shipped = int(state.get("shipped", ckpt.step))
        # Batches shipped after the snapshot are still on disk: adopt them (the trainer trains them).
        on_disk = step_dirs(self.run_dir.rollouts)
        while self.shipped + 1 in on_disk:
            self.shipped += 1
        self.run_dir.remove_steps_after(self.run_dir.rollouts, self.shipped)
        self.run_dir.remove_steps_after(self.run_dir.broadcasts, ckpt.step)
        weights = self.run_dir.trainer_checkpoint(ckpt.step)
        await push_weights(list(self.dispatcher.clients.values()), weights, ckpt.step, self.reference)
        log.info(
            "resume: step %d, policy version %d, %d batches shipped, task cursor %d (weights from %s)",
            ckpt.step, self.policy_version, self.shipped, self.source.cursor, weights,
        )  # fmt: skip

    # -- the loop ------------------------------------------------------------------------------

    def _fill(self) -> None:
        """Dispatch new groups while the flow-control budget (module docstring) allows."""
        k = self.spec.max_off_policy_steps
        g = self.spec.group_size
        last_useful_step = min(self.policy_version + 1 + k, self.max_steps)
        budget = self.spec.batch_size * (last_useful_step - self.shipped)
        committed = len(self.sink.queue) + self.sink.open_members + self.dispatcher.outstanding_samples
        while committed < budget and self.dispatcher.inflight_samples + g <= self.spec.rollout.max_inflight:
            self.dispatcher.dispatch(self.source.next_group(g), self.policy_version)
            committed += g

    async def _maybe_ship(self) -> None:
        while self.shipped < self.max_steps:
            step = self.shipped + 1
            batch = self.sink.take_batch(step)
            if batch is None:
                return
            await asyncio.to_thread(write_batch, self.run_dir.rollout_batch(step), step, batch, self.pad_id)
            self.shipped = step
            self._write_metrics(step, batch)
            cancelled = self.dispatcher.cancel_stale(self.sink.min_fresh(step + 1))
            if cancelled:
                log.info("cancelled %d in-flight groups that can no longer train", cancelled)

    def _write_metrics(self, step: int, batch) -> None:
        now = time.monotonic()
        elapsed = max(now - self._last_ship_time, 1e-9)
        rewards = self.sink.drain_recent_rewards()
        staleness = [(step - 1) - s.trace.policy_version for s in batch]
        c = self.sink.counters
        line = {
            "step": step,
            "policy_version": self.policy_version,
            "reward_mean": sum(rewards) / len(rewards) if rewards else None,
            "episodes_scored": len(rewards),
            "batch_reward_mean": sum(s.reward for s in batch) / len(batch),
            "completion_len_mean": sum(len(s.completion_ids) for s in batch) / len(batch),
            "staleness_mean": sum(staleness) / len(staleness),
            "staleness_max": max(staleness),
            "queue": len(self.sink.queue),
            "open_groups": len(self.sink.open_groups),
            "inflight": self.dispatcher.inflight_samples,
            "groups_rejected": c.groups_rejected,
            "samples_dropped_stale": c.samples_dropped_stale,
            "groups_cancelled": self.dispatcher.cancelled_groups,
            "rollout_tokens_per_s": self._tokens_since_ship / elapsed,
            "step_time_s": elapsed,
            "time": time.time(),
        }
        self._tokens_since_ship = 0
        self._last_ship_time = now
        self._metrics_file.write(json.dumps(line) + "\n")
        self._metrics_file.flush()
        log.info(
            "shipped step %d: reward %.3f, staleness %.2f (max %d), queue %d, %.0f tok/s, %.2f s",
            step, line["reward_mean"] or 0.0, line["staleness_mean"], line["staleness_max"],
            line["queue"], line["rollout_tokens_per_s"], elapsed,
        )  # fmt: skip

    async def _follow_trainer(self) -> None:
        """Load new broadcasts into the rollout servers; complete trainer checkpoints with our part."""
        while True:
            broadcasts = step_dirs(self.run_dir.broadcasts)
            newest = max(broadcasts, default=0)
            if newest > self.policy_version:
                seconds = await push_weights(
                    list(self.dispatcher.clients.values()), broadcasts[newest], newest, self.reference
                )
                log.info("policy version %d -> %d (weight update %.3f s)", self.policy_version, newest, seconds)
                self.policy_version = newest
                for n, p in broadcasts.items():
                    if n < newest:
                        shutil.rmtree(p, ignore_errors=True)
                self._fill()
            for n in sorted(step_dirs(self.run_dir.checkpoints)):
                if n > self.last_saved_checkpoint and (self.run_dir.trainer_checkpoint(n) / "progress.json").is_file():
                    await self._save_checkpoint(n)
            await asyncio.sleep(self.poll_s)

    def snapshot(self, step: int) -> dict:
        """The orchestrator's part of checkpoint ``step``: plain data, taken on the event loop."""
        return {
            "step": step,
            "shipped": self.shipped,
            "policy_version": self.policy_version,
            "source": self.source.state(),
            "identity": run_identity(self.spec),
            "time": time.time(),
        }

    async def _save_checkpoint(self, step: int) -> None:
        state = self.snapshot(step)  # copied on the loop; written in a thread
        path = await asyncio.to_thread(save_orchestrator_progress, self.run_dir, step, state)
        self.last_saved_checkpoint = step
        removed = await asyncio.to_thread(prune_checkpoints, self.run_dir, self.spec.checkpoint.keep_last)
        kept = complete_steps(self.run_dir)
        if kept:
            for n, p in step_dirs(self.run_dir.rollouts).items():
                if n <= kept[0]:
                    shutil.rmtree(p, ignore_errors=True)
        log.info("checkpoint step %d complete (%s); pruned %s", step, path, removed or "nothing")

    def _done(self) -> bool:
        return self.shipped >= self.max_steps and self.last_saved_checkpoint >= self.max_steps

    async def run(self) -> int:
        """Run until batch ``max_steps`` is shipped and its checkpoint completed; returns the step.

        Raises:
            OrchestratorError: unusable run dir or rollout servers that never get healthy.
            CheckpointMismatch: ``--resume`` against a checkpoint of a different run.
        """
        tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, self.model_path)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if Path(self.model_path).is_dir():
            self.reference = await asyncio.to_thread(weights_signature, self.model_path)
        self.dispatcher = Dispatcher(
            self.rollout_urls,
            encode=lambda text: tokenizer.encode(text, add_special_tokens=False),
            decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
            eos_id=tokenizer.eos_token_id,
            envs=self.envs,
            sampling=self.spec.sampling,
            results=self.results,
            client_factory=self.client_factory,
        )
        try:
            await self._wait_healthy()
            if self.resume:
                await self._restore()
            else:
                self._check_fresh_run_dir()
            self._metrics_file = open(self.run_dir.metrics, "a")  # noqa: SIM115 - open for the run
            follower = asyncio.create_task(self._follow_trainer())
            self._last_ship_time = time.monotonic()
            log.info(
                "orchestrator running: step %d of %d, endpoints %s", self.shipped, self.max_steps, self.rollout_urls
            )
            self._fill()
            while not self._done():
                if follower.done():
                    follower.result()  # re-raises its error
                if self.dispatcher.failures:
                    raise self.dispatcher.failures[0]
                try:
                    results = [await asyncio.wait_for(self.results.get(), timeout=self.poll_s)]
                except asyncio.TimeoutError:
                    results = []
                while not self.results.empty():
                    results.append(self.results.get_nowait())
                for result in results:
                    self.dispatcher.take(result)
                    self._tokens_since_ship += result.tokens
                    self.sink.add_episodes(
                        result.request.group_id, result.request.task, result.episodes, self.shipped + 1
                    )
                await self._maybe_ship()
                self._fill()
            follower.cancel()
            log.info("orchestrator done: %d steps shipped and checkpointed", self.shipped)
            return self.shipped
        finally:
            await self.dispatcher.aclose()
            if self._metrics_file is not None:
                self._metrics_file.close()
