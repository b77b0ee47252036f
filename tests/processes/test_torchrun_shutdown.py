"""The installed ``torchrun`` reads ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, the variable the operator's trainer pods
and ``rlrun local`` set to the trainer's grace period: after forwarding SIGTERM to its ranks it waits that long,
not its default 30 s, before it SIGKILLs them. A rank saving on notice is thus bounded by the grace period
only. (torch < 2.12 ignores the variable and always waits 30 s; see ``rlrun_operator.builders._pod``.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from rlrun.roles import TORCHRUN_SHUTDOWN_TIMEOUT_ENV

from tests.support.polling import wait_for

#: A rank that takes SIGTERM as a notice and never finishes its "save".
SLOW_SAVER = """
import pathlib, signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: pathlib.Path(sys.argv[1], "noticed").touch())
pathlib.Path(sys.argv[1], "ready").touch()
time.sleep(120)
"""


def test_torchrun_kills_a_rank_still_saving_on_notice_after_the_shutdown_timeout_it_is_given(tmp_path):
    assert TORCHRUN_SHUTDOWN_TIMEOUT_ENV == "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
    script = tmp_path / "rank.py"
    script.write_text(SLOW_SAVER)
    env = {**os.environ, TORCHRUN_SHUTDOWN_TIMEOUT_ENV: "2", "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
    proc = subprocess.Popen(
        [*argv, "--max-restarts", "0", str(script), str(tmp_path)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for((tmp_path / "ready").exists, 120, "the rank to start")
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=25)  # torchrun's default would keep it 30 s
        waited = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert (tmp_path / "noticed").exists()  # the rank got its notice (forwarded once)
    assert 2 <= waited < 25
