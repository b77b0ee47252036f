"""``rlrun local``'s decisions and messages, without vLLM: what a preemption step the run never
reaches does, how a restored batch is shown, a resume of a finished run, and the resume report
of an attempt that finishes before it is asked (tiny real child processes stand in for the
trainer and the orchestrator; nothing listens on the control port, as after an exit)."""

from __future__ import annotations

import io
import json
import signal
import sys
import time

import pytest
import torch
from rich.console import Console
from rlrun.api.control import ResumeReport
from rlrun.checkpoint import save_orchestrator_progress
from rlrun.launcher.local import LaunchError, LocalLauncher
from rlrun.launcher.preemption import preemption_skip_reason, resume_report_from_ledger, steps_recomputed
from rlrun.launcher.processes import Child, ChildDied, free_port, wait_http_ok
from rlrun.launcher.progress import label_restored, progress_cells, read_metrics, summary_table
from rlrun.manifest import parse_manifest
from rlrun.rundir import RunDir
from rlrun.training.trainer import end_torn_line
from safetensors.torch import save_file


def make_launcher(tmp_path, max_steps=None, resume=False, preempt_at_step=None) -> tuple[LocalLauncher, io.StringIO]:
    spec = {"model": {"builtin": "tiny-reverse"}, "envs": [{"name": "reverse-text"}], "max_steps": 6}
    doc = {"apiVersion": "rlrun.dev/v1alpha1", "kind": "RLRun", "metadata": {"name": "t"}, "spec": spec}
    out = io.StringIO()
    launcher = LocalLauncher(
        tmp_path / "m.yaml",
        parse_manifest(doc),
        tmp_path / "run",
        max_steps=max_steps,
        resume=resume,
        console=Console(file=out, width=400),
        preempt_at_step=preempt_at_step,
    )
    launcher.control_url = f"http://127.0.0.1:{free_port()}"  # nothing listens: an orchestrator that has exited
    return launcher, out


def complete_checkpoint(rd: RunDir, step: int) -> None:
    """Both parts of checkpoint ``step``, written with the real writers (so they verify)."""
    root = rd.trainer_checkpoint(step)
    root.mkdir(parents=True)
    save_file({"w": torch.ones(2)}, str(root / "model.safetensors"))
    (root / "progress.json").write_text(json.dumps({"step": step}))
    save_orchestrator_progress(rd, step, {"step": step, "shipped": step, "source": {"cursor": step * 10}})


def report(**kw) -> ResumeReport:
    base = dict(
        from_step=4, from_attempt=1, shipped=5, queued_traces=7, open_groups=2, requested_groups=1,
        finished_episodes_kept=3, dropped_stale=1, members_requested=5, progress_only_would_lose=10, time=1.0,
    )  # fmt: skip
    return ResumeReport(**{**base, **kw})


def write_ledger(rd: RunDir, attempt: int, events: list[dict], torn_tail: bool = False) -> None:
    (rd.root / "ledger").mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(ev) + "\n" for ev in events) + ('{"e": "disp' if torn_tail else "")
    (rd.root / "ledger" / f"attempt-{attempt}.orchestrator.jsonl").write_text(text)


def child(tmp_path, name: str, code: str) -> Child:
    return Child(name, [sys.executable, "-c", code], tmp_path / "logs" / f"{name}.log")


# -- --preempt-at-step K the run never reaches ----------------------------------------------------


@pytest.mark.parametrize("k", [6, 7, 60])
def test_preemption_at_or_past_the_last_step_is_skipped(k):
    reason = preemption_skip_reason(k, last_step=6, resumed_from=None)
    assert reason == (f"--preempt-at-step {k} is not before the run's last step 6: nothing would be left to preempt")


def test_preemption_before_the_last_step_happens():
    assert preemption_skip_reason(5, last_step=6, resumed_from=None) is None
    assert preemption_skip_reason(5, last_step=6, resumed_from=4) is None


def test_preemption_at_or_before_the_resumed_checkpoint_is_skipped():
    reason = preemption_skip_reason(4, last_step=10, resumed_from=4)
    assert reason is not None and "not after step 4, the checkpoint this run resumes from" in reason


def test_last_step_is_max_steps_override(tmp_path):
    launcher, _ = make_launcher(tmp_path, max_steps=4, preempt_at_step=4)
    assert launcher.max_steps == 4
    assert "last step 4" in preemption_skip_reason(launcher.preempt_at_step, launcher.max_steps, None)


# -- restored batches in the progress line and the table ------------------------------------------


def metrics_row(step, attempt, reward, tokens_per_s, step_time_s=1.0):
    return {
        "step": step, "attempt": attempt, "reward_mean": reward, "rollout_tokens_per_s": tokens_per_s,
        "step_time_s": step_time_s, "completion_len_mean": 6.0, "staleness_mean": 0.5, "staleness_max": 1,
        "queue": 3, "policy_version": step - 1,
    }  # fmt: skip


def test_restored_batches_are_the_rows_before_a_resumed_attempt_generates():
    rows = [
        metrics_row(3, 1, 0.5, 900.0),
        metrics_row(4, 2, None, 0.0, 0.004),  # shipped from the restored queue
        metrics_row(5, 2, None, 0.0, 0.003),  # a second one
        metrics_row(6, 2, 0.6, 800.0),
        metrics_row(7, 2, None, 0.0, 0.002),  # shipped from the queue mid-attempt: nothing restored
    ]
    label_restored(rows[:2], generating := set())
    label_restored(rows[2:], generating)  # rows arrive in pieces
    assert [r["restored"] for r in rows] == [False, True, True, False, False]


def test_progress_cells_of_a_restored_row_say_restored_not_zero():
    row = {**metrics_row(4, 2, None, 0.0, 0.004), "restored": True}
    cells = progress_cells(row, max_steps=6, elapsed_s=12.0)
    assert cells[:3] == ["step 4/6", "reward — (restored batch)", "— tok/s"]
    assert all("0.000" not in c and "0 tok/s" not in c for c in cells)


def test_progress_cells_of_other_rows():
    assert progress_cells(metrics_row(5, 1, 0.4567, 812.4), 6, 1.0)[1:3] == ["reward 0.457", "812 tok/s"]
    none_scored = {**metrics_row(7, 2, None, 0.0, 0.002), "restored": False}
    assert progress_cells(none_scored, 6, 1.0)[1:3] == ["reward — (none scored)", "0 tok/s"]
    assert progress_cells({}, 6, 0.0)[:3] == ["step 0/6", "reward —", "0 tok/s"]


def table_text(rows, max_rows=20) -> str:
    console = Console(file=io.StringIO(), width=200)
    console.print(summary_table(rows, max_rows=max_rows))
    return console.file.getvalue()


def test_summary_table_counts_restored_batches_in_neither_reward_nor_tokens_per_s():
    rows = [
        metrics_row(3, 1, 0.5, 900.0, 1.0),
        metrics_row(4, 2, None, 0.0, 0.004),
        metrics_row(5, 2, 0.7, 600.0, 2.0),
        metrics_row(6, 2, None, 0.0, 0.002),  # none scored mid-attempt: 0 tokens in 2 ms
    ]
    label_restored(rows, set())
    one_row = table_text(rows, max_rows=1).splitlines()
    line = next(x for x in one_row if "3–6" in x)
    # reward: mean of 0.5 and 0.7; tokens/s: (900·1 + 600·2 + 0) / (1 + 2 + 0.002) = 699.5
    assert "0.600" in line and "700" in line.split("│")[-2]
    per_step = table_text(rows)
    restored_line = next(x for x in per_step.splitlines() if x.strip("│ ").startswith("4 "))
    assert "— (restored)" in restored_line and restored_line.split("│")[-2].strip() == "—"


# -- --resume of a finished run ---------------------------------------------------------------------


def test_resume_of_a_complete_run_says_so_and_starts_nothing(tmp_path):
    launcher, out = make_launcher(tmp_path, resume=True)
    rd = RunDir(tmp_path / "run")
    complete_checkpoint(rd, 3)
    complete_checkpoint(rd, 6)
    assert launcher.run() == 0
    text = out.getvalue()
    assert "already complete" in text and "step 6" in text and "holds 6 trained steps" in text
    assert "last step is 6" in text and "no process started" in text
    assert launcher.children == []
    assert not (rd.root / "attempts.jsonl").exists() and not rd.logs.exists()


def test_resume_with_a_larger_max_steps_continues(tmp_path):
    launcher, _ = make_launcher(tmp_path, max_steps=8, resume=True)
    complete_checkpoint(RunDir(tmp_path / "run"), 6)
    assert launcher._already_complete() is None
    assert launcher._resumed_from == 6


# -- the resume report of an attempt that finished at once ------------------------------------------


def test_resume_report_is_read_from_the_ledger(tmp_path):
    rd = RunDir(tmp_path)
    expected = report()
    events = [
        {"e": "resumed", "from_attempt": 1, "snapshot_line": 40, "step": 4, "report": expected.model_dump(mode="json")},
        {"e": "redispatch_requested", "group": 3, "members": [2, 3], "first_member": 2},
    ]
    write_ledger(rd, 2, events, torn_tail=True)
    assert resume_report_from_ledger(rd.root / "ledger", 2) == expected
    assert resume_report_from_ledger(rd.root / "ledger", 3) is None  # no such attempt


def test_a_start_over_has_no_resume_report(tmp_path):
    rd = RunDir(tmp_path)
    write_ledger(rd, 2, [{"e": "resumed", "from_attempt": 1, "snapshot_line": -1, "step": 0, "removed_batches": []}])
    assert resume_report_from_ledger(rd.root / "ledger", 2) is None


def test_resume_report_wait_reads_the_ledger_when_the_orchestrator_exits_0_at_once(tmp_path):
    launcher, _ = make_launcher(tmp_path)
    launcher.health_timeout_s = 5  # the deadline a wait that ignored the exit would run into
    launcher.attempt = 2
    expected = report(from_step=4, shipped=6)
    write_ledger(RunDir(tmp_path / "run"), 2, [{"e": "resumed", "report": expected.model_dump(mode="json")}])
    trainer = child(tmp_path, "trainer", "pass")
    orch = child(tmp_path, "orchestrator", "pass")
    orch.proc.wait(timeout=30)
    t0 = time.monotonic()
    assert launcher._await_resume_report(trainer, orch) == (expected, True)
    assert time.monotonic() - t0 < 2
    trainer.stop()
    orch.stop()


def test_resume_report_wait_fails_when_the_orchestrator_dies(tmp_path):
    launcher, _ = make_launcher(tmp_path)
    trainer = child(tmp_path, "trainer", "import time; time.sleep(30)")
    orch = child(tmp_path, "orchestrator", "raise SystemExit(3)")
    orch.proc.wait(timeout=30)
    with pytest.raises(ChildDied, match=r"orchestrator .* exited with code 3"):
        launcher._await_resume_report(trainer, orch)
    trainer.stop()
    orch.stop()


# -- a pause that meets an orchestrator which has just exited ------------------------------------------


def test_pause_of_an_orchestrator_that_exited_0_means_the_run_finished(tmp_path):
    launcher, _ = make_launcher(tmp_path, preempt_at_step=5)
    orch = child(tmp_path, "orchestrator", "import time; time.sleep(0.5)")  # exits 0 while the pause fails
    assert launcher._pause(orch) is None
    orch.stop()


def test_failed_pause_of_a_running_orchestrator_is_an_error_naming_its_log(tmp_path):
    launcher, _ = make_launcher(tmp_path, preempt_at_step=5)
    launcher.exit_grace_s = 0.3
    orch = child(tmp_path, "orchestrator", "import time; time.sleep(30)")
    with pytest.raises(
        LaunchError, match=r"pause after trainer step 5 failed .* orchestrator runs on; see .*orchestrator\.log"
    ):
        launcher._pause(orch)
    orch.stop()


def test_run_that_finishes_before_the_pause_lands_is_told_and_summarized(tmp_path):
    launcher, out = make_launcher(tmp_path, preempt_at_step=5)
    rd = RunDir(tmp_path / "run").ensure()
    rd.trainer_metrics.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 7)))
    rd.metrics.write_text("".join(json.dumps(metrics_row(s, 1, 0.5, 900.0)) + "\n" for s in range(1, 7)))
    orch = launcher._start("orchestrator", [sys.executable, "-c", "pass"])  # done and gone
    trainer = launcher._start("trainer", [sys.executable, "-c", "import time; time.sleep(1.5)"])  # still saving
    rows = launcher._follow(trainer, orch, model_path="unused")
    launcher.stop_all()
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert "the run finished before the preemption after trainer step 5 landed: no preemption" in out.getvalue()
    assert launcher.preemptions == []


#: A stand-in orchestrator control server: GET /status says ``phase``; POST /pause answers a snapshot
#: of step ``pause_step`` and the process exits 0 right after, as a done orchestrator does.
FAKE_CONTROL = """
import json, os, sys, threading
from http.server import BaseHTTPRequestHandler, HTTPServer
port, phase, pause_step = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
class H(BaseHTTPRequestHandler):
    def answer(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
    def do_GET(self):
        self.answer({"ok": True} if self.path == "/healthz" else {"phase": phase, "attempt": 1, "step": 6,
                    "policy_version": 5, "max_steps": 6})
    def do_POST(self):
        self.answer({"step": pause_step, "path": "p", "time": 1.0, "queued_traces": 2, "open_groups": 0,
                     "requested_groups": 0, "finished_episodes_kept": 0})
        threading.Timer(0.3, os._exit, (0,)).start()
    def log_message(self, *a):
        pass
HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


@pytest.mark.parametrize(
    ("phase", "pause_step", "told"),
    [("done", 6, "landed"), ("running", 6, "landed (the pause completed the last checkpoint, step 6)")],
)
def test_a_pause_that_meets_the_end_of_the_run_restarts_nothing(tmp_path, phase, pause_step, told):
    launcher, _ = make_launcher(tmp_path, preempt_at_step=5)
    launcher.health_timeout_s = 5  # if it did restart, fail fast
    port = launcher.control_url.rsplit(":", 1)[1]
    trainer = launcher._start("trainer", [sys.executable, "-c", "import time; time.sleep(60)"])
    orch = launcher._start("orchestrator", [sys.executable, "-c", FAKE_CONTROL, port, phase, str(pause_step)])
    try:
        wait_http_ok(f"{launcher.control_url}/healthz", orch, timeout_s=30)
        assert launcher._preempt("unused", trainer, orch) is None
        assert launcher._preempt_skipped == f"the run finished before the preemption after trainer step 5 {told}"
        assert launcher.children == [trainer, orch] and launcher.preemptions == []
        assert trainer.poll() is None  # no notice: nothing is left to preempt
        assert launcher.preemption_records == []
        assert not (tmp_path / "run" / "attempts.jsonl").exists()
    finally:
        launcher.stop_all()


def test_read_metrics_skips_a_torn_line_and_keeps_a_partial_tail_for_later(tmp_path):
    path = tmp_path / "metrics.jsonl"
    # step 2 was torn by a kill, and the next attempt appended step 3 to the same line
    path.write_text('{"step": 1}\n{"step": 2, "rew{"step": 3}\n{"step": 4}\n{"step": 5')
    rows, offset = read_metrics(path)
    assert rows == [{"step": 1}, {"step": 4}]
    with open(path, "a") as fh:
        fh.write("}\n")
    assert read_metrics(path, offset) == ([{"step": 5}], path.stat().st_size)


# -- Child.signal_group ---------------------------------------------------------------------------

# Counts the SIGTERMs that reach it at the C level (one wakeup-fd byte per delivery: Python's own
# handler would run once for two signals that land before it gets to run), writes the count to
# argv[1] after a second of quiet, and exits 0.
COUNT_SIGTERMS = r"""
import os, signal, sys, time
path = sys.argv[1]
r, w = os.pipe()
os.set_blocking(r, False)
os.set_blocking(w, False)
signal.signal(signal.SIGTERM, lambda *_: None)
signal.set_wakeup_fd(w, warn_on_full_buffer=False)
with open(path, "w") as f:
    f.write("ready")
count, deadline = 0, time.monotonic() + 30
while time.monotonic() < deadline:
    time.sleep(0.01)
    try:
        count += len(os.read(r, 100))
    except BlockingIOError:
        continue
    deadline = time.monotonic() + 1.0
with open(path, "w") as f:
    f.write(str(count))
"""


def test_signal_group_sends_sigterm_once_to_a_process_of_the_group(tmp_path):
    """A second SIGTERM means "exit now, skip the snapshot" to the orchestrator: the killpg must be all it gets."""
    counted = tmp_path / "sigterms"
    proc = Child("counter", [sys.executable, "-c", COUNT_SIGTERMS, str(counted)], tmp_path / "counter.log")
    try:
        deadline = time.monotonic() + 10
        while not (counted.exists() and counted.read_text() == "ready"):
            assert time.monotonic() < deadline, proc.tail()
            time.sleep(0.02)
        proc.signal_group(signal.SIGTERM)
        assert proc.proc.wait(timeout=10) == 0
        assert counted.read_text() == "1"
    finally:
        proc.kill()


# -- the trainer's notice and trainer-only restarts -----------------------------------------------


def write_trainer_ledger(rd: RunDir, attempt: int, steps: list[int], torn_tail: bool = False) -> None:
    (rd.root / "ledger").mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps({"e": "trained", "step": s, "ids": [f"g{s}/0"]}) + "\n" for s in steps)
    (rd.root / "ledger" / f"attempt-{attempt}.trainer.jsonl").write_text(text + ('{"e": "trai' if torn_tail else ""))


def test_steps_recomputed_counts_every_training_of_a_step_after_its_first(tmp_path):
    rd = RunDir(tmp_path)
    write_trainer_ledger(rd, 1, [1, 2, 3, 4, 5], torn_tail=True)  # killed after step 5
    write_trainer_ledger(rd, 2, [4, 5, 6])  # resumed from checkpoint 3: steps 4 and 5 again
    assert steps_recomputed(rd.root / "ledger") == 2
    write_trainer_ledger(rd, 2, [6])  # resumed from 5, saved on notice: nothing again
    assert steps_recomputed(rd.root / "ledger") == 0


def test_a_restarted_trainer_ends_its_predecessors_torn_line_before_appending(tmp_path):
    path = tmp_path / "attempt-1.trainer.jsonl"
    path.write_text('{"e": "trained", "step": 1}\n{"e": "trai')
    end_torn_line(path)
    end_torn_line(path)  # a whole last line is left as it is
    with open(path, "a") as fh:
        fh.write('{"e": "trained", "step": 2}\n')
    assert path.read_text().splitlines()[-1] == '{"e": "trained", "step": 2}'
    end_torn_line(tmp_path / "missing.jsonl")  # nothing to do
    assert not (tmp_path / "missing.jsonl").exists()


def test_only_without_preempt_at_step_is_refused(tmp_path):
    from rlrun import cli
    from typer.testing import CliRunner

    manifest = tmp_path / "m.yaml"
    spec = {"model": {"builtin": "tiny-reverse"}, "envs": [{"name": "reverse-text"}]}
    manifest.write_text(
        json.dumps({"apiVersion": "rlrun.dev/v1alpha1", "kind": "RLRun", "metadata": {"name": "t"}, "spec": spec})
    )
    result = CliRunner().invoke(
        cli.app, ["local", str(manifest), "--only", "trainer", "--run-dir", str(tmp_path / "r")]
    )
    assert result.exit_code == 2 and "--only needs --preempt-at-step" in result.output
    result = CliRunner().invoke(cli.app, ["local", str(manifest), "--only", "nodes", "--preempt-at-step", "2"])
    assert result.exit_code == 2
