"""``rlrun trainer`` as 2 data-parallel ranks under a real ``torchrun`` (gloo, CPU), on batches a fake
orchestrator published: it takes the same steps as one process (weights within the tolerance of
``tests/unit/test_distributed_training.py``), writes sharded trainer parts that the completeness rule
accepts (and refuses once a shard is torn), and a run resumes across rank counts (2 → 1 and 1 → 2).
The run has a KL term and the sequence-mean aggregation (:data:`LOSS`): every trainer, on any number of ranks and
after any resume, holds the starting weights as its reference (sharded with ranks)."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from rlrun.batch import write_batch
from rlrun.checkpoint import WEIGHTS_FILE, latest_complete_checkpoint, save_orchestrator_progress
from rlrun.dcp_format import SHARDED_DIR, verify_sharded
from rlrun.ledger import read_ledger
from rlrun.manifest import load_manifest
from rlrun.roles import torchrun_command, trainer_command
from rlrun.rundir import META_FILE, RunDir
from rlrun.samples import QueuedTrace, TrainingSample
from rlrun.training.trainer import Trainer
from safetensors.torch import load_file

from tests.support.manifests import SHORT_RUN, write_manifest

STEPS = 3
#: Rows per batch: 5 (ranks get 3 and 2), 4, and 1 (rank 1 trains a weightless placeholder row).
LENGTHS = {1: [(4, 6), (7, 3), (3, 9), (5, 2), (6, 7)], 2: [(5, 5), (3, 8), (8, 2), (4, 4)], 3: [(5, 6)]}
TORCHRUN_TIMEOUT_S = 180
#: spec.loss of the run: the KL term's reference (loaded, sharded, reloaded on resume) and a per-sequence normaliser
LOSS = {"kl_coef": 0.1, "aggregation": "sequence_mean"}


def _samples(step: int) -> list[TrainingSample]:
    """Batch ``step``: sampling logprobs near the untrained model's, so some ratios are clipped."""
    g = torch.Generator().manual_seed(step)
    out = []
    for i, (p, c) in enumerate(LENGTHS[step]):
        ids = torch.randint(2, 97, (p + c,), generator=g).tolist()
        lp = (-math.log(128) + 0.6 * (torch.rand(c, generator=g) - 0.5)).tolist()
        adv = float(torch.randn(1, generator=g))
        out.append(TrainingSample(ids[:p], ids[p:], lp, adv, 0.5, QueuedTrace("reverse-text", 0, step, i)))
    return out


def _fake_orchestrator(run_dir: RunDir) -> None:
    """Publish every batch, as the orchestrator ships them (attempt 0: every batch counts)."""
    for step in range(1, STEPS + 1):
        write_batch(run_dir.rollout_batch(step), step, _samples(step), pad_id=0)


def _pair(run_dir: RunDir, step: int) -> None:
    """The orchestrator's part of ``step``: every batch was shipped."""
    save_orchestrator_progress(run_dir, step, {"step": step, "shipped": STEPS})


def two_ranks(manifest: Path, run_dir: RunDir, cache_dir: Path, resume: bool = False, **kwargs) -> list[str]:
    """torchrun's command line for ``rlrun trainer`` (attempt 0) as two ranks, as both launchers build it."""
    bindir = Path(sys.executable).parent  # the scripts of this interpreter's environment
    args = (str(manifest), str(run_dir.root), str(cache_dir), 0)
    trainer = trainer_command(*args, resume=resume, program=[str(bindir / "rlrun")], **kwargs)
    return torchrun_command(trainer, 2, launcher=[str(bindir / "torchrun")])


def _torchrun(manifest: Path, run_dir: RunDir, cache_dir: Path, max_steps: int, resume: bool = False) -> None:
    argv = two_ranks(manifest, run_dir, cache_dir, resume, max_steps=max_steps)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RLRUN_TERMINATION_LOG", None)
    log = run_dir.root.parent / f"{run_dir.root.name}.torchrun.log"
    with open(log, "w") as fh:
        proc = subprocess.run(argv, stdout=fh, stderr=subprocess.STDOUT, env=env, timeout=TORCHRUN_TIMEOUT_S)
    assert proc.returncode == 0, log.read_text()[-6000:]


def _weights(run_dir: RunDir, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir.broadcast(step) / WEIGHTS_FILE))


def _max_abs_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, cache_dir, tiny_model) -> dict:
    """Run every scenario once: ``two`` (2 ranks, steps 1–2, then 1 rank resumes to 3), ``one`` (1 process,
    steps 1–2, then to 3), ``one_to_two`` (``one``'s step-2 part resumed by 2 ranks to step 3)."""
    tmp = tmp_path_factory.mktemp("ranks")
    manifest = write_manifest(
        tmp / "m.yaml",
        base=SHORT_RUN,
        batch_size=4,
        max_steps=STEPS,
        checkpoint={"interval": 2, "keep_last": 2},
        loss=LOSS,
    )
    spec = load_manifest(manifest).spec
    two, one, one_to_two = RunDir(tmp / "two"), RunDir(tmp / "one"), RunDir(tmp / "one_to_two")
    for run_dir in (two, one):
        run_dir.ensure()
        _fake_orchestrator(run_dir)

    _torchrun(manifest, two, cache_dir, 2)
    Trainer(spec, one, str(tiny_model), max_steps=2).run()
    for run_dir in (two, one):
        _pair(run_dir, 2)
    out = {"spec": spec, "two": two, "one": one, "tmp": tmp, "at_2": {}}
    out["at_2"] = {n: {s: _weights(r, s) for s in (1, 2)} for n, r in (("two", two), ("one", one))}
    out["two_part_2"] = json.loads((two.trainer_checkpoint(2) / META_FILE).read_text())
    shutil.copytree(one.root, one_to_two.root)
    torn = RunDir(tmp / "torn")
    shutil.copytree(two.root, torn.root)
    out["torn"] = torn

    resumed = Trainer(spec, two, str(tiny_model), max_steps=STEPS, resume=True)  # 2 → 1
    out["two_resumed_from"] = resumed.step
    resumed.run()
    Trainer(spec, one, str(tiny_model), max_steps=STEPS, resume=True).run()
    _torchrun(manifest, one_to_two, cache_dir, STEPS, resume=True)  # 1 → 2
    return out


def test_two_ranks_publish_the_weights_of_one_process_after_each_step(runs):
    atol = 0.05 * runs["spec"].optimizer.lr  # test_distributed_training.py's WEIGHT_ATOL
    for step in (1, 2):
        assert _max_abs_diff(runs["at_2"]["two"][step], runs["at_2"]["one"][step]) <= atol, step
    # and they did train: the weights moved
    initial = load_file(str(runs["two"].trainer_checkpoint(0) / WEIGHTS_FILE))
    assert _max_abs_diff(runs["at_2"]["two"][1], initial) > 10 * atol


def test_two_ranks_write_a_sharded_part_the_completeness_rule_accepts(runs):
    meta = runs["two_part_2"]
    assert meta["format"] == "dcp" and meta["world_size"] == 2 and len(meta["shards"]) == 2
    assert runs["two_resumed_from"] == 2  # the newest complete checkpoint was the sharded step-2 part


def test_a_torn_shard_makes_the_completeness_rule_skip_the_part(runs):
    torn = runs["torn"]
    part = torn.trainer_checkpoint(2)
    assert latest_complete_checkpoint(torn).step == 2
    verify_sharded(part)
    shard = sorted((part / SHARDED_DIR).glob("*.distcp"))[0]
    with open(shard, "r+b") as fh:
        fh.truncate(shard.stat().st_size // 2)
    assert latest_complete_checkpoint(torn) is None  # step 0 has no orchestrator part


def test_only_rank_0_writes_the_ledger_and_metrics(runs):
    two = runs["two"]
    lines = [json.loads(x) for x in two.trainer_metrics.read_text().splitlines()]
    assert [m["step"] for m in lines if m.get("ranks") == 2] == [1, 2]
    trained = [
        e["step"]
        for (_, role), evs in read_ledger(two.root / "ledger").items()
        if role == "trainer"
        for e in evs
        if e["e"] == "trained"
    ]
    assert sorted(trained) == [1, 2, 3]  # 1–2 by rank 0 of the 2-rank run, 3 by the resumed single process


def test_a_two_rank_part_resumes_in_one_process_and_a_one_process_part_in_two_ranks(runs):
    atol = 0.05 * runs["spec"].optimizer.lr
    reference = _weights(runs["one"], STEPS)
    assert _max_abs_diff(_weights(runs["two"], STEPS), reference) <= atol  # 2 → 1
    one_to_two = RunDir(runs["tmp"] / "one_to_two")
    assert _max_abs_diff(_weights(one_to_two, STEPS), reference) <= atol  # 1 → 2
    meta = json.loads((one_to_two.trainer_checkpoint(STEPS) / META_FILE).read_text())
    assert meta["format"] == "dcp" and meta["world_size"] == 2
    verify_sharded(one_to_two.trainer_checkpoint(STEPS))


def test_every_trainer_holds_the_starting_weights_as_its_reference_on_any_ranks_and_after_any_resume(runs):
    """``kl_ref`` is 0 at step 1 (the policy is still the starting weights) and the same at every step on 2 ranks
    and in one process — step 3 included, trained by a trainer resumed 2 → 1, 1 → 1 and 1 → 2, each of which
    loaded its reference from the model path again."""

    def kl_ref(run_dir: RunDir) -> dict[int, float]:
        return {m["step"]: m["kl_ref"] for m in map(json.loads, run_dir.trainer_metrics.read_text().splitlines())}

    one = kl_ref(runs["one"])
    assert one[1] == pytest.approx(0.0, abs=1e-9) and 0 < one[2] < one[3]
    for other in (runs["two"], RunDir(runs["tmp"] / "one_to_two")):
        got = kl_ref(other)
        for step in range(1 if other is runs["two"] else STEPS, STEPS + 1):
            assert got[step] == pytest.approx(one[step], rel=1e-3, abs=1e-9), (other.root.name, step)


def test_a_notice_to_one_rank_makes_both_save_the_same_sharded_part(tmp_path, cache_dir, tiny_model):
    """SIGTERM to rank 1 only, while the ranks wait for batch 3: the flag all-reduce at the poll tells rank 0,
    and the two ranks write the notice part of step 2 together; one process resumes from it."""
    import psutil

    manifest = write_manifest(
        tmp_path / "m.yaml", base=SHORT_RUN, batch_size=4, max_steps=4, checkpoint={"interval": 10, "keep_last": 2}
    )
    run_dir = RunDir(tmp_path / "run").ensure()
    for step in (1, 2):
        write_batch(run_dir.rollout_batch(step), step, _samples(step), pad_id=0)
    argv = two_ranks(manifest, run_dir, cache_dir)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RLRUN_TERMINATION_LOG", None)
    log = tmp_path / "torchrun.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + TORCHRUN_TIMEOUT_S
        while not run_dir.broadcast(2).is_dir():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-6000:]
            time.sleep(0.1)
        ranks = {int(p.environ().get("RANK", -1)): p for p in psutil.Process(proc.pid).children()}
        ranks[1].send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    part = run_dir.trainer_checkpoint(2)
    progress = json.loads((part / "progress.json").read_text())
    assert progress["reason"] == "notice" and progress["world_size"] == 2, log.read_text()[-6000:]
    assert verify_sharded(part).world_size == 2
    assert (part / WEIGHTS_FILE).is_file()
    _pair(run_dir, 2)
    spec = load_manifest(manifest).spec
    assert Trainer(spec, run_dir, str(tiny_model), resume=True).step == 2
