"""``rlrun local``'s handling of its children: tiny real child processes stand in for the trainer and the
orchestrator (an orchestrator that exits at once or dies, one that answers a pause and exits, a stand-in
for torchrun after a notice; nothing listens on the control port, as after an exit), and a signal to a
child's process group reaches it once."""

from __future__ import annotations

import json
import signal
import sys
import time

import pytest
from rlrun.launcher.local import LocalLauncher
from rlrun.launcher.preemption import LaunchError
from rlrun.launcher.processes import Child, ChildDied, role_exit_code, wait_http_ok
from rlrun.rundir import RunDir

from tests.support.fake_orchestrator import resume_report
from tests.support.launcher import RESUMED, make_launcher, metrics_row, write_ledger
from tests.support.polling import wait_for


def child(tmp_path, name: str, code: str) -> Child:
    return Child(name, [sys.executable, "-c", code], tmp_path / "logs" / f"{name}.log")


def test_resume_report_wait_reads_the_ledger_when_the_orchestrator_exits_0_at_once(tmp_path):
    launcher, _ = make_launcher(tmp_path, preempt_at_step=3)
    launcher.health_timeout_s = 5  # the deadline a wait that ignored the exit would run into
    launcher.attempt = 2
    expected = resume_report(4, **{**RESUMED, "shipped": 6})
    write_ledger(RunDir(tmp_path / "run"), 2, [{"e": "resumed", "report": expected.model_dump(mode="json")}])
    trainer = child(tmp_path, "trainer", "pass")
    orch = child(tmp_path, "orchestrator", "pass")
    orch.proc.wait(timeout=30)
    t0 = time.monotonic()
    assert launcher.drill.await_resume_report(trainer, orch) == (expected, True)
    assert time.monotonic() - t0 < 2
    trainer.stop()
    orch.stop()


def test_resume_report_wait_fails_when_the_orchestrator_dies(tmp_path):
    launcher, _ = make_launcher(tmp_path, preempt_at_step=3)
    trainer = child(tmp_path, "trainer", "import time; time.sleep(30)")
    orch = child(tmp_path, "orchestrator", "raise SystemExit(3)")
    orch.proc.wait(timeout=30)
    with pytest.raises(ChildDied, match=r"orchestrator .* exited with code 3"):
        launcher.drill.await_resume_report(trainer, orch)
    trainer.stop()
    orch.stop()


def test_pause_of_an_orchestrator_that_exited_0_means_the_run_finished(tmp_path):
    launcher, _ = make_launcher(tmp_path, preempt_at_step=5)
    orch = child(tmp_path, "orchestrator", "import time; time.sleep(0.5)")  # exits 0 while the pause fails
    assert launcher.drill.pause(orch) is None
    orch.stop()


def test_failed_pause_of_a_running_orchestrator_is_an_error_naming_its_log(tmp_path):
    launcher, _ = make_launcher(tmp_path, preempt_at_step=5)
    launcher.drill.exit_grace_s = 0.3
    orch = child(tmp_path, "orchestrator", "import time; time.sleep(30)")
    with pytest.raises(
        LaunchError, match=r"pause after trainer step 5 failed .* orchestrator runs on; see .*orchestrator\.log"
    ):
        launcher.drill.pause(orch)
    orch.stop()


def test_run_that_finishes_before_the_pause_lands_is_told_and_summarized(tmp_path):
    launcher, out = make_launcher(tmp_path, preempt_at_step=5)
    rd = RunDir(tmp_path / "run").ensure()
    rd.trainer_metrics.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 7)))
    rd.metrics.write_text("".join(json.dumps(metrics_row(s, 1, 0.5, 900.0)) + "\n" for s in range(1, 7)))
    orch = launcher._start("orchestrator", [sys.executable, "-c", "pass"])  # done and gone
    trainer = launcher._start("trainer", [sys.executable, "-c", "import time; time.sleep(1.5)"])  # still saving
    rows = launcher._follow(trainer, orch)
    launcher.stop_all()
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert "the run finished before the preemption after trainer step 5 landed: no preemption" in out.getvalue()
    assert launcher.drill.pauses == []


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
        assert launcher.drill.preempt(trainer, orch) is None
        assert launcher.drill.skipped == f"the run finished before the preemption after trainer step 5 {told}"
        assert launcher.children == [trainer, orch] and launcher.drill.pauses == []
        assert trainer.poll() is None  # no notice: nothing is left to preempt
        assert launcher.drill.records == []
        assert not (tmp_path / "run" / "attempts.jsonl").exists()
    finally:
        launcher.stop_all()


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
        wait_for(lambda: counted.exists() and counted.read_text() == "ready", 10, "the counter to start")
        proc.signal_group(signal.SIGTERM)
        assert proc.proc.wait(timeout=10) == 0
        assert counted.read_text() == "1"
    finally:
        proc.kill()


#: Stands in for the trainer's process at its notice (SIGTERM), by ``argv[2]``:
#: ``saved`` — torchrun after it forwarded SIGTERM to ranks that saved on notice: rank 0's exit report says
#: ``interrupted`` (what ``rlrun trainer`` writes before exiting 143), and torchrun itself exits 1 (its
#: ``SignalException``), as the real one does; ``died`` — exits 1 with no report; ``finished`` — a trainer that
#: trained its last step and wrote ``complete``, then met the notice before it could ignore SIGTERM to exit
#: (``rlrun.role_exit.exiting``): killed by SIGTERM.
TRAINER_AT_A_NOTICE = """
import os, pathlib, signal, sys, time
from rlrun.api.control import ExitReport, write_exit_report

def notice(*_):
    if sys.argv[2] == "saved":
        write_exit_report(ExitReport(role="trainer", outcome="interrupted", step=3, max_steps=6, message="saved"))
    os._exit(1)

if sys.argv[2] == "finished":
    write_exit_report(ExitReport(role="trainer", outcome="complete", step=6, max_steps=6, message="trained"))
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
else:
    signal.signal(signal.SIGTERM, notice)
pathlib.Path(sys.argv[1]).touch()
time.sleep(60)
"""


def _trainer_stand_in(launcher: LocalLauncher, tmp_path, how: str) -> Child:
    """The trainer's process as :data:`TRAINER_AT_A_NOTICE` ``how`` plays it, once it is ready for the notice."""
    ready = tmp_path / f"ready-{how}"
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER_AT_A_NOTICE)
    launcher._trainer_command = lambda resume: [sys.executable, str(script), str(ready), how]
    child = launcher.start_trainer(resume=False)
    wait_for(lambda: ready.exists() or child.poll() is not None, 30, "the stand-in trainer")
    assert child.poll() is None, child.log_path.read_text()
    return child


def test_a_trainer_under_torchrun_that_saved_on_notice_counts_as_exit_143_not_torchruns_1(tmp_path):
    launcher, _ = make_launcher(tmp_path, trainer={"processes_per_node": 2})
    code, _ = launcher.notice_trainer(_trainer_stand_in(launcher, tmp_path, "saved"))
    assert code == 143  # the trainer-only restart goes on instead of calling the trainer dead


def test_a_trainer_under_torchrun_without_this_exits_report_keeps_torchruns_status(tmp_path):
    launcher, _ = make_launcher(tmp_path, trainer={"processes_per_node": 2})
    stale = launcher._trainer_exit_report_path()
    stale.parent.mkdir(parents=True, exist_ok=True)
    stale.write_text('{"role": "trainer", "outcome": "interrupted", "step": 2, "max_steps": 6}')  # an earlier exit's
    code, _ = launcher.notice_trainer(_trainer_stand_in(launcher, tmp_path, "died"))
    assert code == 1  # a failure stays a failure: the earlier trainer's report is not read as this one's
    assert role_exit_code(None, stale, under_torchrun=True) is None  # killed
    assert role_exit_code(1, tmp_path / "none.json", under_torchrun=False) == 1  # no report: its own status


def test_a_trainer_that_finished_and_met_the_notice_while_exiting_finished_the_run(tmp_path):
    launcher, _ = make_launcher(tmp_path)
    code, _ = launcher.notice_trainer(_trainer_stand_in(launcher, tmp_path, "finished"))
    assert code == 0  # not a dead trainer: its exit report says it trained the last step
