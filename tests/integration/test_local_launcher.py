"""``rlrun local`` end to end: the launcher starts the rollout server (the fake one: vLLM is not the subject
here; ``test_preemption.py`` runs the launcher on real vLLM), the real trainer and the real orchestrator as
processes, shows progress, serves each process's Prometheus metrics, survives a child's death cleanly, and
preempts at a step."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families
from rlrun.checkpoint import latest_complete_checkpoint
from rlrun.ledger import check_ledger
from rlrun.orchestrator.prometheus import METRICS as ORCHESTRATOR_METRICS
from rlrun.rundir import RunDir
from rlrun.training.prometheus import METRICS as TRAINER_METRICS

from tests.support.manifests import PREEMPTION_RUN, SHORT_RUN, write_manifest
from tests.support.processes import alive, descendants, watch
from tests.support.runs import local_argv, metrics
from tests.unit.test_prometheus import exposed


def start_local(manifest, run_dir, cache_dir, *extra):
    return subprocess.Popen(
        local_argv(manifest, run_dir, cache_dir, *extra), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def scrape_once(proc, run_dir, into: dict) -> bool:
    """Once two steps are trained, scrape the orchestrator's and the trainer's ``/metrics`` (ports from their command
    line and environment) into ``into``; True once done."""
    if "trainer" in into or len(metrics(run_dir / "trainer_metrics.jsonl")) < 2:
        return "trainer" in into
    ports = {}
    for pid in descendants(proc.pid):
        try:
            p = psutil.Process(pid)
            argv = p.cmdline()
            if "orchestrator" in argv and "--control-port" in argv:
                ports["orchestrator"] = int(argv[argv.index("--control-port") + 1])
            elif "trainer" in argv and p.environ().get("RLRUN_METRICS_PORT"):
                ports["trainer"] = int(p.environ()["RLRUN_METRICS_PORT"])
        except (psutil.Error, ValueError):
            continue
    if len(ports) < 2:
        return False
    for role, port in ports.items():
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        into[role] = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    into["ports"] = ports
    return True


def test_local_runs_the_whole_stack(tmp_path, cache_dir, tiny_model):
    evaluation = {"enabled": True, "interval": 3, "tasks": 4, "samples_per_task": 2}
    manifest = write_manifest(tmp_path / "m.yaml", base=SHORT_RUN, evaluation=evaluation)
    run_dir = tmp_path / "run"
    proc = start_local(manifest, run_dir, cache_dir)
    scrapes: dict[str, dict[str, float]] = {}
    seen = watch(proc, timeout_s=480, until=lambda: scrape_once(proc, run_dir, scrapes) and False)
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, out
    # both processes' /metrics, scraped mid-run, parse and hold what docs/observability.md lists
    assert f"metrics (Prometheus): http://127.0.0.1:{scrapes['ports']['orchestrator']}/metrics" in out
    assert exposed(ORCHESTRATOR_METRICS) - {"rlrun_pause_seconds"} <= set(scrapes["orchestrator"])
    assert exposed(TRAINER_METRICS) <= set(scrapes["trainer"]) and scrapes["trainer"]["rlrun_trainer_step"] >= 2
    rows = metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    # the policy version advances with the trainer, and staleness never exceeds the bound
    versions = [r["policy_version"] for r in rows]
    assert versions == sorted(versions) and versions[-1] >= 4
    assert all(0 <= r["staleness_max"] <= 1 for r in rows)
    for key in ("reward_mean", "completion_len_mean", "staleness_mean", "queue", "rollout_tokens_per_s", "step_time_s"):
        assert all(r[key] is not None for r in rows), key
    trainer_rows = metrics(run_dir / "trainer_metrics.jsonl")
    assert [r["step"] for r in trainer_rows] == [1, 2, 3, 4, 5, 6]
    assert all(r["samples"] == 16 and r["entropy"] > 0 for r in trainer_rows)
    evaluations = metrics(run_dir / "eval.jsonl")  # at the start, (maybe) step 3, and the end
    assert evaluations[0]["policy_version"] == 0 and evaluations[-1]["policy_version"] == 6
    assert all(e["tasks"] == 4 and 0 <= e["greedy_solved"] <= 1 for e in evaluations)
    assert "held-out evaluation, 4 tasks, policy 0 → 6" in out and "greedy solved (exact match)" in out
    ckpt = latest_complete_checkpoint(RunDir(run_dir))
    assert ckpt is not None and ckpt.step == 6 and ckpt.orchestrator["shipped"] == 6
    assert not (run_dir / "checkpoints" / "step_3").exists()  # keep_last: 1
    assert "reward per step" in out and "done: 6 steps" in out
    for name in ("rollout-0", "trainer", "orchestrator"):
        assert (run_dir / "logs" / f"{name}.log").stat().st_size > 0
    assert len(seen) >= 3  # rollout server, trainer, orchestrator
    assert alive(seen) == [], "processes left behind"


def test_a_run_that_can_form_no_batch_stops_with_one_clear_message(tmp_path, cache_dir, tiny_model):
    # issue 36.1: a constant reward rejects every group; the orchestrator warns, then exits 78, and the launcher
    # says why in one message (from its exit report), not a traceback or the log's last lines
    envs = [{"name": "reverse-text", "rewards": [{"function": "tests.unit.test_no_signal:half"}]}]
    manifest = write_manifest(tmp_path / "m.yaml", base=SHORT_RUN, envs=envs, max_zero_spread_groups=30)
    run_dir = tmp_path / "run"
    proc = subprocess.run(local_argv(manifest, run_dir, cache_dir), capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    [error] = [line for line in out.splitlines() if "error:" in line]
    assert "error: orchestrator stopped: NoLearningSignal: no batch can form: " in error, out
    assert "100 % every member scored the same without solving it" in error and "group_size (4" in error
    assert "Traceback" not in out and "last lines of" not in out
    log = (run_dir / "logs" / "orchestrator.log").read_text()
    assert log.count("no batch can form") == 2 and "Traceback" not in log  # the warning, then the error
    report = json.loads((run_dir / "logs" / "orchestrator-exit.json").read_text())
    assert (report["outcome"], report["permanent"], report["reason"]) == ("error", True, "NoLearningSignal")


def test_local_refuses_a_used_run_dir_without_resume(tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "step_3").mkdir(parents=True)
    manifest = write_manifest(tmp_path / "m.yaml", base=SHORT_RUN)
    proc = start_local(manifest, run_dir, cache_dir)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 2
    assert "already holds a run" in out and "--resume" in out


# With vLLM, `rlrun rollout` execs into vLLM's server; the fake server stays `rlrun rollout`.
@pytest.mark.parametrize(("victim", "marker"), [("trainer", "-m rlrun trainer"), ("rollout-0", "-m rlrun rollout")])
def test_killing_a_child_mid_run_fails_the_launcher_and_leaves_no_orphans(
    tmp_path, cache_dir, tiny_model, victim, marker
):
    manifest = write_manifest(tmp_path / "m.yaml", base=SHORT_RUN, max_steps=200)
    run_dir = tmp_path / "run"
    proc = start_local(manifest, run_dir, cache_dir)
    seen = watch(proc, timeout_s=300, until=lambda: len(metrics(run_dir / "metrics.jsonl")) >= 2)
    assert proc.poll() is None, proc.communicate()[0]
    target = None
    for child in psutil.Process(proc.pid).children():  # direct children of the launcher
        if marker in " ".join(child.cmdline()):
            target = child.pid
    assert target is not None
    seen |= descendants(proc.pid)
    psutil.Process(target).send_signal(signal.SIGKILL)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 1, out
    assert f"{victim} (pid {target}) killed by signal 9" in out
    assert alive(seen) == [], "processes left behind"
    log = json.dumps(out)
    assert "last lines of" in log


def test_preempt_at_step_just_before_the_end_finishes_cleanly_and_a_resume_then_starts_nothing(
    tmp_path, cache_dir, tiny_model
):
    # The small manifest of test_preemption.py with max_steps 6 and K = 5. With a bound of 2 the
    # orchestrator may ship and checkpoint step 6 before the pause lands, or the pause may land and
    # the resumed attempt finish almost at once: both are right, and whichever happens must end in
    # exit 0 with every step trained, the ledger intact and no traceback.
    manifest = write_manifest(tmp_path / "m.yaml", base=PREEMPTION_RUN, max_steps=6)
    run_dir = tmp_path / "run"
    proc = start_local(manifest, run_dir, cache_dir, "--preempt-at-step", "5")
    out = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0, out[-5000:]
    assert "Traceback" not in out, out[-5000:]
    preempted = "Resuming with" in out
    assert preempted or "the run finished before the preemption after trainer step 5" in out, out[-3000:]
    assert f"{int(preempted)} preemption(s)" in out and "ledger: ok" in out
    assert sorted({r["step"] for r in metrics(run_dir / "metrics.jsonl")}) == [1, 2, 3, 4, 5, 6]
    ckpt = latest_complete_checkpoint(RunDir(run_dir))
    assert ckpt is not None and ckpt.step == 6
    # --resume of the finished run: says so, starts nothing, exit 0
    again = start_local(manifest, run_dir, cache_dir, "--resume")
    out = again.communicate(timeout=120)[0]
    assert again.returncode == 0, out
    assert "already complete" in out and "step 6" in out and "no process started" in out
    assert "done:" not in out and "reward per step" not in out


def test_preempt_at_step_only_trainer_restarts_only_the_trainer_and_recomputes_no_step(trainer_preempted_run):
    # SIGTERM to the trainer after step 2: it saves the step it has, the running orchestrator completes that
    # checkpoint, and the same trainer command with --resume (same attempt) carries on from it; the
    # orchestrator and the rollout server are never restarted (the run: conftest.py's trainer_preempted_run).
    run_dir, out, seen = trainer_preempted_run.run_dir, trainer_preempted_run.out, trainer_preempted_run.pids
    assert trainer_preempted_run.returncode == 0, out[-5000:]
    assert "Traceback" not in out, out[-5000:]
    assert "trainer-only preemption after trainer step 2" in out, out[-3000:]
    assert "trainer steps recomputed: 0; rollout server restarts: 0" in out and "1 preemption(s)" in out
    [record] = [json.loads(line) for line in (run_dir / "preemptions.jsonl").read_text().splitlines()]
    assert (record["only"], record["trainer_exit"], record["steps_recomputed"], record["rollout_restarts"]) == (
        "trainer",
        143,
        0,
        0,
    )
    saved = record["trainer_saved_step"]
    assert 2 <= saved < 10 and record["next_step"] == saved + 1 and record["notice_to_next_step_s"] > 0
    logs = run_dir / "logs"
    assert (logs / "trainer.log").read_text().count(f"restored trainer checkpoint step {saved} ") == 1
    assert (logs / "orchestrator.log").read_text().count("orchestrator running") == 1
    assert (logs / "rollout-0.log").read_text().count("rollout server: ") == 1
    rows = metrics(run_dir / "metrics.jsonl")
    assert sorted({r["step"] for r in rows}) == list(range(1, 11)) and {r["attempt"] for r in rows} == {1}
    versions = [r["policy_version"] for r in rows]
    assert versions == sorted(versions)
    report = check_ledger(run_dir / "ledger")
    assert report.ok and report.steps == 10 and report.rolled_back == 0, report.problems
    assert alive(seen) == [], "processes left behind"


def test_rlrun_eval_scores_a_saved_checkpoint_on_a_server_of_its_own(tmp_path, cache_dir, tiny_model):
    manifest = write_manifest(
        tmp_path / "m.yaml", base=SHORT_RUN, max_steps=2, checkpoint={"interval": 1, "keep_last": 3}
    )
    run_dir = tmp_path / "run"
    assert subprocess.run(local_argv(manifest, run_dir, cache_dir), capture_output=True, timeout=480).returncode == 0
    base = [sys.executable, "-m", "rlrun", "eval", str(run_dir), "--cache-dir", str(cache_dir), "--tasks", "5"]
    done = subprocess.run([*base, "--step", "1", "--json"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    line = json.loads(done.stdout.strip().splitlines()[-1])
    assert line["policy_version"] == 1 and line["tasks"] == 5 and set(line["per_env"]) == {"reverse-text"}
    assert not (run_dir / "eval.jsonl").exists()  # the orchestrator is its one writer (evaluation off here)
    table = subprocess.run(base, capture_output=True, text=True, timeout=300)  # the newest complete: step 2
    assert table.returncode == 0, table.stderr
    assert "evaluation of policy 2:" in table.stdout and "greedy solved" in table.stdout and "pass@" in table.stdout
    missing = subprocess.run([*base, "--step", "7"], capture_output=True, text=True, timeout=60)
    assert missing.returncode == 1 and "no checkpoint of step 7" in missing.stderr
