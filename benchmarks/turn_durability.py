"""Tokens sampled again after a preemption, with turn-level durability and without (JSON on stdout).

One scenario, run twice in the same invocation with the same seed: the real Orchestrator (in process, the fake
trainer, :mod:`rlrun.orchestrator`) trains a 6-turn env (``tests.support.envs:UntilOne``) — the model answers
until it says ``1``, at most six turns — against a scripted server (answers drawn from a hash of the prompt) at
``--samples-per-s`` completions per second. At step ``--pause-at`` the orchestrator is paused (the snapshot a preemption
writes) and stopped, and a second attempt resumes to ``--steps``. Attempt 1 is the same in both runs (the env is
resumable: its turns are journaled); they differ in what the resume does with the conversations kept:

- ``kept``: turn-level durability: each is continued at its last durable turn;
- ``regenerated``: the baseline, as before turn-level durability (and as for an env that is not ``resumable``):
  each starts over from its first turn (the resume is told to drop them all).

Per run: ``tokens_regenerated`` — sampled tokens (not env tokens) of durable turns the resume threw away, which
the second attempt samples again; ``tokens_kept`` — those it continued from instead; ``conversations_continued``,
``turns_kept``; the server's completion tokens per attempt and the second attempt's ``seconds`` (noisy: the runs
diverge after the resume), for each of ``--repeats`` runs; ``total`` sums them. ``ratio``: kept ÷ regenerated of the
total tokens regenerated (lower is better).

Usage: ``python benchmarks/turn_durability.py [--pause-at 3] [--steps 8] [--samples-per-s 400] [--repeats 3]
[--cache-dir DIR]``
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the env: tests.support.envs
MAX_TURNS = 6
#: The env: answered ``no=`` until the model says ``1``, at most MAX_TURNS turns; a prompt per task.
ENV = {"name": "tests.support.envs:UntilOne", "args": {"max_turns": MAX_TURNS}}


class Server:
    """Answers member ``i`` of a request for ``prompt`` with ``1`` or ``2`` (then EOS) drawn from a hash of both, about
    a fifth ``1``, at ``samples_per_s``; counts the completion tokens sampled per attempt."""

    def __init__(self, tokenizer, samples_per_s: float) -> None:
        import httpx
        from rlrun.rollout.fake import fake_vllm_transport

        self.ids = {d: tokenizer.convert_tokens_to_ids(d) for d in "12"}
        self.eos = tokenizer.eos_token_id
        self.inner, self.rate, self.free_at = fake_vllm_transport(), samples_per_s, 0.0
        self.attempt = 1
        self.sampled: dict[int, int] = {}
        self.transport = httpx.MockTransport(self.handle)

    async def handle(self, request):
        import httpx

        if request.url.path != "/v1/completions":
            return await self.inner.handle_async_request(request)
        body = json.loads(request.content)
        prompt, n = tuple(body["prompt"]), body["n"]
        loop = asyncio.get_running_loop()
        self.free_at = max(self.free_at, loop.time()) + n / self.rate
        await asyncio.sleep(self.free_at - loop.time())
        choices = []
        for i in range(n):
            one = hashlib.sha256(f"{prompt}:{i}".encode()).digest()[0] < 52  # ≈ 1 in 5
            choices.append(
                {
                    "index": i,
                    "token_ids": [self.ids["1" if one else "2"], self.eos],
                    "logprobs": {"token_logprobs": [-1.0, -0.1]},
                    "finish_reason": "stop",
                }
            )
        self.sampled[self.attempt] = self.sampled.get(self.attempt, 0) + 2 * n
        return httpx.Response(200, json={"choices": choices})


def spec(steps: int):
    from rlrun.manifest import parse_manifest

    body = {
        "model": {"builtin": "tiny-reverse"},
        "envs": [ENV],
        "group_size": 4,
        "batch_size": 16,
        "max_off_policy_steps": 2,
        "max_steps": steps,
        "seed": 7,
        "checkpoint": {"interval": 1, "keep_last": 3},
        "sampling": {"max_tokens": 4},
        "rollout": {"max_inflight": 64},
    }
    doc = {"apiVersion": "rlrun.dev/v1alpha1", "kind": "RLRun", "metadata": {"name": "turns"}, "spec": body}
    return parse_manifest(doc).spec


def drop_all(restore_plan, plans: list):
    """``restore_plan`` that starts every kept conversation over (the baseline), keeping each plan in ``plans``."""

    def plan(*args, **kwargs):
        out = restore_plan(*args, **kwargs)
        out.dropped_conversations += [(c, "baseline") for c in out.continued]
        out.to_complete = [(g, task, n + sum(c.group_id == g for c in out.continued)) for g, task, n in out.to_complete]
        for c in out.continued:  # a group completed by its continued conversations alone needs its members again
            if c.group_id not in {g for g, _, _ in out.to_complete}:
                out.to_complete.append((c.group_id, c.task, sum(x.group_id == c.group_id for x in out.continued)))
        out.continued = []
        plans.append(out)
        return out

    return plan


def keep_plans(restore_plan, plans: list):
    def plan(*args, **kwargs):
        plans.append(restore_plan(*args, **kwargs))
        return plans[-1]

    return plan


async def scenario(mode: str, model: Path, root: Path, args) -> dict:
    import rlrun.orchestrator.resume as resume
    from rlrun.checkpoint import latest_complete_checkpoint
    from rlrun.orchestrator.loop import Orchestrator
    from rlrun.rollout.client import RolloutClient
    from rlrun.rundir import RunDir
    from rlrun.training.fake import start_fake_trainer
    from transformers import AutoTokenizer

    run_dir = RunDir(root)
    server = Server(AutoTokenizer.from_pretrained(model), args.samples_per_s)

    def orchestrator(attempt: int, resume: bool) -> Orchestrator:
        return Orchestrator(
            spec(args.steps),
            run_dir,
            ["http://fake:1"],
            str(model),
            resume=resume,
            attempt=attempt,
            poll_s=0.01,
            client_factory=lambda url: RolloutClient(url, transport=server.transport),
        )

    first = orchestrator(1, False)
    stop = start_fake_trainer(run_dir, model, args.steps, 1, attempt=1)
    run = asyncio.create_task(first.run())
    while first.shipped < args.pause_at:
        if run.done():
            run.result()
        await asyncio.sleep(0.005)
    paused = await first.pause()
    first.request_stop()
    await run
    stop.set()
    for thread in threading.enumerate():  # the trainer may be publishing a part: the resume must see it whole
        if thread.name == "fake-trainer":
            thread.join()
    server.attempt = 2
    plans: list = []
    original = resume.restore_plan
    resume.restore_plan = (keep_plans if mode == "kept" else drop_all)(original, plans)
    second = orchestrator(2, True)
    resumed = latest_complete_checkpoint(run_dir).step  # the pause's snapshot also completes parts saved after it
    stop = start_fake_trainer(run_dir, model, args.steps, 1, attempt=2, first_step=resumed)
    t0 = time.monotonic()
    try:
        assert await second.run() == args.steps
    finally:
        stop.set()
        resume.restore_plan = original
    report, [plan] = second.resume_report, plans
    return {
        "tokens_regenerated": sum(c.sampled_tokens for c, _ in plan.dropped_conversations),
        "tokens_kept": sum(c.sampled_tokens for c in plan.continued),
        "conversations_dropped": sorted({why for _, why in plan.dropped_conversations}),
        "tokens_sampled": {"attempt_1": server.sampled.get(1, 0), "attempt_2": server.sampled.get(2, 0)},
        "paused_at_step": paused.step,
        "resumed_from_step": resumed,
        "conversations_kept_by_pause": paused.conversations_kept,
        "conversations_continued": report.conversations_continued,
        "turns_kept": report.turns_kept,
        "members_requested": report.members_requested,
        "seconds": round(time.monotonic() - t0, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pause-at", type=int, default=3, help="pause once this many steps shipped")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--samples-per-s", type=float, default=400.0)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each mode (the pause lands at other turns)")
    parser.add_argument("--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "rlrun-bench-cache")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    from rlrun.model.resolve import ensure_builtin_model

    model = ensure_builtin_model("tiny-reverse", args.cache_dir)
    runs: dict[str, list[dict]] = {"kept": [], "regenerated": []}
    for _ in range(args.repeats):
        for mode in runs:
            with tempfile.TemporaryDirectory() as tmp:
                runs[mode].append(asyncio.run(scenario(mode, model, Path(tmp), args)))
    total = {
        mode: {k: sum(r[k] for r in rs) for k in ("tokens_regenerated", "tokens_kept")} for mode, rs in runs.items()
    }
    again = total["regenerated"]["tokens_regenerated"]
    out = {
        "env": f"{MAX_TURNS}-turn",
        "pause_at": args.pause_at,
        "steps": args.steps,
        "samples_per_s": args.samples_per_s,
        "runs": runs,
        "total": total,
        "ratio": {"tokens_regenerated": total["kept"]["tokens_regenerated"] / again if again else None},
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
