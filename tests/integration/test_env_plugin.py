"""An env from a third-party package: the one ``docs/envs.md`` shows, installed with pip from a local path (no
network), found by its entry point (``rlrun envs``) and trained for a few steps by ``rlrun local`` (rollouts
from the fake server, which answers a ``text=`` prompt with the text reversed, with errors: what this env asks)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from rlrun.ledger import check_ledger, read_ledger

from tests.support.manifests import SHORT_RUN, write_manifest
from tests.support.runs import local_argv, metrics

ROOT = Path(__file__).resolve().parents[2]


def doc_files(doc: Path) -> dict[str, str]:
    """The files a doc shows: each fenced block right after a ``<!-- file: PATH -->`` line, by PATH."""
    pattern = re.compile(r"<!-- file: (\S+) -->\n```\w*\n(.*?)```", re.DOTALL)
    return {path: body for path, body in pattern.findall(doc.read_text())}


def test_the_documented_package_installs_registers_its_env_and_trains(tmp_path, cache_dir, tiny_model):
    files = doc_files(ROOT / "docs" / "envs.md")
    assert set(files) == {"my-envs/pyproject.toml", "my-envs/my_envs/__init__.py"}
    assert sum(body.count("\n") for body in files.values()) <= 45  # "a complete package in about 30 lines"
    for path, body in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(body)
    site = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index"]
    subprocess.run([*pip, "--target", str(site), str(tmp_path / "my-envs")], check=True, timeout=300)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}

    listed = subprocess.run(
        [sys.executable, "-m", "rlrun", "envs", "--json"], env=env, capture_output=True, text=True, check=True
    )
    entries = {e["name"]: e for e in json.loads(listed.stdout)}
    assert entries["reverse-digits"] == {
        "name": "reverse-digits",
        "target": "my_envs:ReverseDigitsEnv",
        "source": "my-envs 0.1.0",
    }
    assert entries["dataset"]["source"] == "builtin"

    manifest = write_manifest(
        tmp_path / "m.yaml", base=SHORT_RUN, max_steps=3, envs=[{"name": "reverse-digits", "args": {"digits": 3}}]
    )
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        local_argv(manifest, run_dir, cache_dir), env=env, capture_output=True, text=True, timeout=480
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    # the env's own reward, named after it; the fake's errors make some completions wrong, some right
    assert all(0 < r["reward/reverse-digits"] < 1 for r in rows if r["reward/reverse-digits"] is not None)
    dispatched = [e for events in read_ledger(run_dir / "ledger").values() for e in events if e["e"] == "dispatched"]
    assert dispatched and {e["env"] for e in dispatched} == {"reverse-digits"}
    report = check_ledger(run_dir / "ledger")
    assert report.ok and report.trained > 0, report.problems
