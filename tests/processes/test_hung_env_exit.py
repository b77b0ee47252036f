"""A finished orchestrator exits within seconds whatever its env threads are doing (issue 47, item 5): env
calls that hang for good (an env's ``start`` waiting on a sandbox that never answers) run in daemon threads
that nothing joins. Before, they ran in the event loop's default executor, which ``asyncio.run`` joins as it
returns, so a run that was done did not exit while one of them hung (minutes, or never). A real process is the
claim: the child runs the orchestrator role as ``rlrun orchestrator`` does
(:func:`rlrun.orchestrator.main.run_orchestrator`) against the fake rollout server over HTTP, with the fake
trainer, and the test times its exit after its ``orchestrator done`` line."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.support.manifests import SHORT_RUN, write_manifest

ROOT = Path(__file__).resolve().parents[2]

#: The child: the fake rollout server in a thread (its own loop, real HTTP), the fake trainer in another, then
#: the orchestrator role to its end; argv: manifest, run directory, model cache.
CHILD = """
import asyncio, logging, sys, threading
from pathlib import Path
from aiohttp import web
from rlrun.net import free_port
from rlrun.model.resolve import ensure_builtin_model
from rlrun.orchestrator.main import run_orchestrator
from rlrun.rollout.fake import fake_vllm_app
from rlrun.rundir import RunDir
from rlrun.training.fake import start_fake_trainer

logging.basicConfig(level=logging.INFO, stream=sys.stderr)
manifest, run_dir, cache = map(Path, sys.argv[1:4])
port, loop = free_port(), asyncio.new_event_loop()
runner = web.AppRunner(fake_vllm_app(error_rate=0.3))
loop.run_until_complete(runner.setup())
loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
threading.Thread(target=loop.run_forever, daemon=True).start()
start_fake_trainer(RunDir(run_dir), ensure_builtin_model("tiny-reverse", cache), 2, 1, attempt=1)
code = run_orchestrator(manifest, run_dir, [f"http://127.0.0.1:{port}"], cache_dir=cache, attempt=1)
print(f"returned {code}", file=sys.stderr, flush=True)
sys.exit(code)
"""


def test_a_finished_orchestrator_exits_within_seconds_while_env_calls_hang(tmp_path, tiny_model, cache_dir):
    envs = [{"name": "tests.support.envs:Hangs", "args": {"every": 5}, "reward_timeout_seconds": 3}]
    rollout = {**SHORT_RUN["rollout"], "max_group_retries": 0}  # a hung task's group is given up at once
    manifest = write_manifest(
        tmp_path / "run.yaml",
        base=SHORT_RUN,
        envs=envs,
        max_steps=2,
        batch_size=8,
        checkpoint={"interval": 1},
        rollout=rollout,
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    argv = [sys.executable, "-c", CHILD, str(manifest), str(tmp_path / "run"), str(cache_dir)]
    child = subprocess.Popen(argv, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    done_at: list[float] = []
    lines: list[str] = []

    def read() -> None:
        for line in child.stderr:  # type: ignore[union-attr]
            lines.append(line)
            if "orchestrator done" in line:
                done_at.append(time.monotonic())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        child.wait(timeout=120)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
    reader.join(5)
    exited_at = time.monotonic()
    log = "".join(lines[-40:])
    assert done_at, f"the run never finished:\n{log}"
    assert any("start failed: took longer than 3 s" in line for line in lines), log  # some starts did hang
    assert child.returncode == 0 and "returned 0" in log, log
    assert exited_at - done_at[0] < 10, f"exited {exited_at - done_at[0]:.1f} s after done:\n{log}"
