"""Prometheus on the orchestrator and the trainer: each ``/metrics`` scraped while it runs parses with
``prometheus_client``'s parser and holds every metric ``docs/observability.md`` lists (and the doc lists every
metric); the orchestrator's needs no token while its other routes do; the trainer's gauges follow its steps."""

from __future__ import annotations

import asyncio
import re
import socket
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from rlrun.orchestrator.prometheus import METRICS as ORCHESTRATOR_METRICS
from rlrun.rundir import RunDir, read_jsonl
from rlrun.training.fake import start_fake_trainer
from rlrun.training.prometheus import METRICS as TRAINER_METRICS
from rlrun.training.prometheus import TrainerMetrics, serve, serve_from_env

from tests.support.orchestrators import make_orchestrator
from tests.unit.test_rollout_faults import Faults, spec

DOC = Path(__file__).parents[2] / "docs" / "observability.md"
#: The orchestrator's gauges of the last shipped step (without ``rlrun_``) → their ``metrics.jsonl`` key.
LAST_STEP = {
    "reward_mean": "reward_mean",
    "reward_std": "reward_std",
    "staleness_mean_steps": "staleness_mean",
    "groups_zero_std_ratio": "frac_reward_zero_std",
    "groups_solved_all_ratio": "solved_all",
    "groups_solved_none_ratio": "solved_none",
    "episodes_truncated_ratio": "truncated_fraction",
    "rollout_tokens_per_second": "rollout_tokens_per_s",
    "step_duration_seconds": "step_time_s",
    "zero_spread_token_ratio": "zero_spread_token_fraction",
}


def exposed(metrics: dict) -> set[str]:
    """The names Prometheus shows (counters with ``_total``)."""
    return {f"{name}_total" if kind[0] == "counter" else name for name, kind in metrics.items()}


def scraped(text: str) -> dict[str, float]:
    """``{sample name: value}`` of a scrape (parsed the way Prometheus' own client library parses)."""
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


def documented(section: str) -> set[str]:
    text = DOC.read_text().split(f"### {section}\n", 1)[1].split("\n#", 1)[0]
    return set(re.findall(r"^\| `(rlrun_\w+)` \|", text, re.MULTILINE))


def test_the_doc_lists_every_metric_of_each_process():
    assert documented("Orchestrator") == exposed(ORCHESTRATOR_METRICS)
    assert documented("Trainer") == exposed(TRAINER_METRICS)


async def test_the_orchestrators_metrics_are_scraped_without_a_token_while_it_runs(tmp_path, tiny_model):
    run_dir = RunDir(tmp_path)
    orch = make_orchestrator(spec(), run_dir, tiny_model, Faults(), control_port=0, control_token="secret")
    # the trainer trains step 1 only: the run cannot end (and close its control server) while it is scraped
    stop = start_fake_trainer(run_dir, tiny_model, 1, 1, attempt=orch.attempt)
    run = asyncio.create_task(orch.run())
    try:
        while orch.checkpoints.last_step < 1:
            assert not run.done(), run.exception() if run.done() else None
            await asyncio.sleep(0.01)
        base = f"http://127.0.0.1:{orch.control.port}"
        async with httpx.AsyncClient() as client:
            answer = await client.get(f"{base}/metrics")
            refused = await client.get(f"{base}/status")  # the rest of the control server keeps its token
        orch.request_stop()
        await asyncio.wait_for(run, 30)
    finally:
        stop.set()
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/plain")
    assert refused.status_code == 401
    values = scraped(answer.text)
    last_step = {f"rlrun_{n}" for n in LAST_STEP}
    # no pause happened; no mismatch probe (the fake trainer publishes none)
    unmeasured = {"rlrun_pause_seconds", "rlrun_served_mismatch_kl_nats"}
    assert exposed(ORCHESTRATOR_METRICS) - last_step - unmeasured <= set(values)
    assert values["rlrun_step"] >= 1 and values["rlrun_max_steps"] == 2 and values["rlrun_last_checkpoint_step"] >= 1
    assert values["rlrun_episodes_finished_total"] >= 8 and values["rlrun_journal_fsyncs_total"] >= 1
    # the last shipped step's values, as metrics.jsonl has them (a step that scored nothing has no reward)
    [line] = [x for x in read_jsonl(run_dir.metrics) if x["step"] == values["rlrun_step"]]
    for name, key in LAST_STEP.items():
        assert values.get(f"rlrun_{name}") == (None if line[key] is None else pytest.approx(line[key])), name


def test_the_trainers_metrics_follow_its_steps_and_it_answers_healthz():
    metrics = TrainerMetrics()
    server = serve(metrics, 0, host="127.0.0.1")
    try:
        base = f"http://127.0.0.1:{server.server_port}"
        step = {
            "step": 7,
            "loss": 0.25,
            "grad_norm": 1.5,
            "entropy": 0.7,
            "mismatch_kl": 1e-7,
            "mismatch_kl_on_policy": None,
            "clip_fraction": 0.01,
            "tokens": 600,
            "train_s": 0.5,
            "wait_s": 2.0,
            "broadcast_s": 0.03,
            "broadcast_bytes": 532666,
        }
        metrics.observe(step)
        metrics.observe({**step, "step": 8})
        values = scraped(httpx.get(f"{base}/metrics").text)
        assert httpx.get(f"{base}/healthz").text == "ok\n"
    finally:
        server.shutdown()
    assert exposed(TRAINER_METRICS) - {"rlrun_trainer_mismatch_kl_on_policy_nats"} <= set(values)  # None: not set yet
    assert values["rlrun_trainer_step"] == 8 and values["rlrun_trainer_steps_total"] == 2
    assert values["rlrun_trainer_tokens_per_second"] == 1200 and values["rlrun_trainer_batch_wait_seconds"] == 2.0
    assert values["rlrun_trainer_broadcast_bytes"] == 532666 and values["rlrun_trainer_broadcast_seconds"] == 0.03


def test_a_metrics_port_in_use_is_a_warning_not_a_dead_trainer(monkeypatch, caplog):
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        monkeypatch.setenv("RLRUN_METRICS_PORT", str(busy.getsockname()[1]))
        assert serve_from_env(TrainerMetrics()) is None
    assert "trainer metrics not served" in caplog.text
    monkeypatch.setenv("RLRUN_METRICS_PORT", "http")
    with pytest.raises(ValueError, match="must be a port number"):
        serve_from_env(TrainerMetrics())
