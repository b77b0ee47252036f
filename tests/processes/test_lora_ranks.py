"""LoRA on 2 FSDP2 ranks (gloo, forked, the real ``Trainer``): the ranks take the single-process steps, publish the
adapter gathered on rank 0, write an unsharded adapter part, and parts move across rank counts (2 → 1 and 1 → 2)
continuing as the uninterrupted single-process run. The run has a KL term, whose reference on ranks is the sharded
policy with its adapter disabled.

One module fixture runs everything once: in this process the uninterrupted run U (steps 1–3, parts at 2 and 3);
on 2 forked ranks a run R to step 2 and a run C resumed from U's part of step 2 (1 → 2) to step 3; back here R
resumed from its 2-rank part (2 → 1) to step 3. Tolerance: ``0.05 · lr`` on the adapter (AdamW moves an element by
≈ lr whatever its gradient's float error; as ``test_distributed_training.py``).
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
from rlrun.adapter_format import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, is_b
from rlrun.batch import write_batch
from rlrun.checkpoint import save_orchestrator_progress
from rlrun.net import free_port
from rlrun.rundir import META_FILE, RunDir
from rlrun.samples import QueuedTrace, TrainingSample
from rlrun.training.distributed import init_from_env, teardown
from rlrun.training.trainer import Trainer
from safetensors.torch import load_file

from tests.support.manifests import parse
from tests.support.processes import run_forked_ranks

WORLD = 2
LR = 0.01
SPEC = parse(
    "lora-ranks",
    model={"builtin": "tiny-reverse", "lora": {"rank": 4, "target_modules": ["q_proj", "v_proj"]}},
    max_steps=3,
    checkpoint={"interval": 2},
    optimizer={"lr": LR},
    loss={"kl_coef": 0.1},
    trainer={"micro_batch_tokens": 16},
).spec
#: Rows per batch: 5 (ranks get 3 and 2), 4, 3.
LENGTHS = {
    1: [(4, 6), (7, 3), (3, 9), (5, 2), (6, 7)],
    2: [(5, 5), (3, 8), (8, 2), (4, 4)],
    3: [(5, 6), (3, 3), (6, 2)],
}
SPAWN_TIMEOUT_S = 180


def _batches(run_dir: RunDir) -> None:
    for step, lengths in LENGTHS.items():
        g = torch.Generator().manual_seed(step)
        samples = []
        for i, (p, c) in enumerate(lengths):
            ids = torch.randint(2, 60, (p + c,), generator=g).tolist()
            lp = (-math.log(64) + 0.6 * (torch.rand(c, generator=g) - 0.5)).tolist()
            adv = float(torch.randn(1, generator=g))
            samples.append(
                TrainingSample(ids[:p], ids[p:], lp, adv, 0.5, QueuedTrace("reverse-text", step - 1, step, i))
            )
        write_batch(run_dir.rollout_batch(step), step, samples, pad_id=0)


def _run(run_dir: RunDir, model: str, **kwargs) -> None:
    trainer = Trainer(SPEC, run_dir, model, **kwargs)
    trainer.run()
    if trainer.ledger is not None:
        trainer.ledger.close()


def _rank_main(rank: int, port: int, work: str, model: str) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    dp = init_from_env(timeout_s=120)
    _run(RunDir(Path(work) / "R"), model, max_steps=2, dp=dp)
    _run(RunDir(Path(work) / "C"), model, resume=True, dp=dp)  # from the single process's part of step 2
    teardown(dp)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model) -> dict[str, RunDir]:
    work = tmp_path_factory.mktemp("lora-ranks")
    dirs = {name: RunDir(work / name) for name in ("U", "R", "C")}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for run_dir in dirs.values():
            _batches(run_dir)
        _run(dirs["U"], str(tiny_model))
        dirs["C"].checkpoint(2).mkdir(parents=True)
        shutil.copytree(dirs["U"].trainer_checkpoint(2), dirs["C"].trainer_checkpoint(2))
        save_orchestrator_progress(dirs["C"], 2, {"step": 2, "shipped": 2})
        run_forked_ranks(_rank_main, (free_port(), str(work), str(tiny_model)), WORLD, SPAWN_TIMEOUT_S)
        save_orchestrator_progress(dirs["R"], 2, {"step": 2, "shipped": 2})
        _run(dirs["R"], str(tiny_model), resume=True)  # from the 2-rank part
    finally:
        torch.set_num_threads(threads)
    return dirs


def _adapter(run_dir: RunDir, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir.broadcast(step) / ADAPTER_WEIGHTS_FILE))


def _assert_close(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and len(a) == 4 * 2 * 2  # 4 layers × (q_proj, v_proj) × (A, B)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0.05 * LR, msg=k)


def test_two_lora_ranks_take_the_single_process_steps(runs):
    u, r = runs["U"], runs["R"]
    _assert_close(_adapter(r, 1), _adapter(u, 1))
    _assert_close(_adapter(r, 2), _adapter(u, 2))
    moved = max(float(v.abs().max()) for k, v in _adapter(u, 2).items() if is_b(k))
    assert moved > 10 * 0.05 * LR  # B started at zero: the tolerance above is far smaller than the steps
    lines = [json.loads(x) for x in r.trainer_metrics.read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3] and lines[0]["ranks"] == 2 and lines[0]["kl_ref"] == pytest.approx(0)
    assert lines[1]["kl_ref"] > 0  # the reference (the adapter disabled) stayed the base model
    assert lines[0]["broadcast_bytes"] == sum(f.stat().st_size for f in r.broadcast(1).iterdir())


def test_two_lora_ranks_write_one_unsharded_adapter_part(runs):
    part = runs["R"].trainer_checkpoint(2)
    assert {p.name for p in part.iterdir()} == {
        ADAPTER_CONFIG_FILE,
        ADAPTER_WEIGHTS_FILE,
        "optimizer.pt",
        "progress.json",
        META_FILE,
    }
    assert "format" not in json.loads((part / META_FILE).read_text())
    assert json.loads((part / "progress.json").read_text())["world_size"] == 2
    optimizer = torch.load(part / "optimizer.pt", weights_only=True)
    assert len(optimizer["state"]) == 16 and all(s["exp_avg"].dim() == 2 for s in optimizer["state"].values())


def test_a_lora_part_moves_across_rank_counts_and_continues_as_the_uninterrupted_run(runs):
    u = _adapter(runs["U"], 3)
    _assert_close(_adapter(runs["C"], 3), u)  # 1 → 2
    _assert_close(_adapter(runs["R"], 3), u)  # 2 → 1
