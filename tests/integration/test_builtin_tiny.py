"""``model: {builtin: tiny}`` end to end: ``rlrun model init --manifest`` builds it into the cache for the manifest's
envs — the default recipe, on reverse-text — leaving held-out greedy accuracy strictly between 0 and 1, and
``rlrun local`` trains on that model from the cache without building it again."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from rlrun.model.resolve import builtin_model_dir

from tests.support.manifests import SHORT_RUN, parse, write_manifest
from tests.support.runs import local_argv, metrics

TINY = {"model": {"builtin": "tiny"}}


def printed_report(stdout: str) -> dict:
    """The JSON report ``rlrun model init`` prints after its log lines."""
    lines = stdout.splitlines()
    return json.loads("\n".join(lines[lines.index("{") :]))


@pytest.fixture(scope="module")
def built(tmp_path_factory, cache_dir):
    """The manifest, and ``rlrun model init --manifest``'s report of the model it built into the cache."""
    manifest = write_manifest(tmp_path_factory.mktemp("tiny") / "m.yaml", base=SHORT_RUN, **TINY)
    argv = [sys.executable, "-m", "rlrun", "model", "init", "--manifest", str(manifest), "--cache-dir", str(cache_dir)]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=True).stdout
    return manifest, printed_report(out)


def test_model_init_builds_tiny_for_the_manifests_envs_with_mid_range_greedy_accuracy(built, cache_dir):
    manifest, report = built
    envs = parse(base=SHORT_RUN, **TINY).spec.envs
    assert report["path"] == str(builtin_model_dir("tiny", cache_dir, envs))
    assert report["builtin"] == "tiny" and report["sft_stopped"] == "target"
    assert 0 < report["greedy"]["reverse-text"]["solved"] < 1
    stored = builtin_model_dir("tiny", cache_dir, envs) / "rlrun_model.json"
    before = stored.stat().st_mtime_ns
    again = subprocess.run(
        [sys.executable, "-m", "rlrun", "model", "init", "-m", str(manifest), "--cache-dir", str(cache_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert printed_report(again) == report and stored.stat().st_mtime_ns == before


def test_local_trains_on_tiny_from_the_cache(built, tmp_path, cache_dir):
    manifest, report = built
    proc = subprocess.run(
        local_argv(manifest, tmp_path / "run", cache_dir), capture_output=True, text=True, timeout=480
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"model: {report['path']}" in proc.stdout.replace("\n", "")
    assert [r["step"] for r in metrics(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
