"""Data-parallel trainer cost (JSON on stdout): step time on 1 vs 2 ranks (1 × 2 and 2 × 1), and checkpoint
write/load time sharded (DCP) vs unsharded (safetensors + ``torch.save``), for the builtin tiny model's architecture.

- ``step_s``: one trainer step (:func:`~rlrun.training.step.accumulate_gradients` at the spec's default
  micro-batch budget: forward, loss, backward; global-norm clip, AdamW) on a ``--batch-size``-row batch of
  reverse-text-sized samples (prompt 20, completion 24 tokens), median over ``--steps`` after one warm-up step:
  ``1x1_t1`` one process with 1 torch thread, ``1x1_t2`` one process with 2 threads, ``1x2_t1`` two
  gloo ranks (FSDP2, forked, localhost) with 1 thread each, each training half the rows.
- ``checkpoint_s``: median over ``--repeats`` of writing and of loading the model + AdamW state:
  ``unsharded`` as today's trainer part (``model.safetensors`` + ``optimizer.pt``, one process),
  ``dcp_1`` / ``dcp_2`` :func:`~rlrun.training.sharded_checkpoint.save_sharded` /
  :func:`~rlrun.training.sharded_checkpoint.load_sharded` on 1 / 2 ranks (publish included:
  hashes, fsyncs, rename), and ``bytes`` on disk for each.

The tiny model (0.6M parameters) is latency-bound: FSDP adds a per-block all-gather and
reduce-scatter to every step, which half a batch of compute saved may or may not pay for; on a shared
2-core machine contention dominates (2 threads in one process can be far slower than 1), so read the
numbers with ``load_average``, printed at the end. Measured once (load average 6–8 on 2 cores, 64
rows, 1536 tokens): step 1.04 s (1x1_t1), 5.0 s (1x1_t2), 0.81 s (1x2_t1); write / load 0.07 / 0.04 s
unsharded, 0.22 / 0.19 s DCP on 1 rank, 0.50 / 0.79 s DCP on 2 ranks (7.5–8.1 MB).

- ``trainer``: the real ``rlrun trainer`` on the default example (``examples/reverse-text.yaml``:
  its model and ``batch_size``), fed ``--trainer-steps`` batches of reverse-text-sized samples by a
  fake orchestrator (files written up front): ``1x1`` one process (today's path, 1 torch thread),
  ``1x2`` ``torchrun --nproc-per-node 2`` (gloo, 1 thread per rank), ``2x1`` two ``torchrun --nnodes 2
  --node-rank 0/1 --nproc-per-node 1`` commands on localhost with static rendezvous on
  ``127.0.0.1:<free port>`` (the operator's two trainer pods, :func:`two_node_launchers`). Reports the
  trainer's own ``train_s`` (median over the steps after the first), the command's wall time (until
  both nodes exit), which includes start-up, the step-0 and last-step checkpoints (unsharded for 1x1,
  sharded otherwise) and the per-step weight broadcast, and ``speedup_1x2`` / ``speedup_2x1``: 1x1's
  ``train_s`` over theirs, all from the same run. On one machine 2x1 and 1x2 differ only in how the
  ranks meet (two agents and a static rendezvous vs one agent), so their step times should agree; a
  real 2-node trainer adds the network between the nodes.

Usage: ``python benchmarks/step_time_ranks.py [--batch-size 64] [--steps 5] [--repeats 3] [--trainer-steps 6]``
(``benchmarks/step_time.py --ranks`` runs it and includes its JSON under ``ranks``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
from rlrun.api.spec import OptimizerSpec, TrainerSpec
from rlrun.batch import TrainBatch, collate
from rlrun.model.tiny import TinyModelRecipe, build_config, build_tokenizer
from rlrun.net import free_port
from rlrun.samples import QueuedTrace, TrainingSample
from rlrun.training.distributed import (
    DataParallel,
    clip_grad_norm_,
    init_from_env,
    rank_slice,
    shard_model,
    teardown,
)
from rlrun.training.objectives import LossSettings
from rlrun.training.sharded_checkpoint import load_sharded, save_sharded
from rlrun.training.step import StepSettings, accumulate_gradients
from safetensors.torch import load_file, save_file
from transformers import Qwen3ForCausalLM

OPT = OptimizerSpec()
ROOT = Path(__file__).resolve().parents[1]
MANIFEST = ROOT / "examples" / "reverse-text.yaml"


def make_batch(rows: int, prompt: int = 20, completion: int = 24) -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    samples = []
    for i in range(rows):
        ids = torch.randint(2, 97, (prompt + completion,), generator=g).tolist()
        lp = (-4.85 + 0.3 * torch.randn(completion, generator=g)).tolist()
        adv = 1.0 if i % 2 else -1.0
        samples.append(TrainingSample(ids[:prompt], ids[prompt:], lp, adv, 0.5, QueuedTrace("reverse-text", 0, i, 0)))
    return TrainBatch(**collate(samples, pad_id=0), meta={})


def build(init: Path, dp: DataParallel) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = Qwen3ForCausalLM(build_config(TinyModelRecipe(), build_tokenizer()))
    model.load_state_dict(load_file(str(init)))
    shard_model(model, dp)
    opt = torch.optim.AdamW(model.parameters(), lr=OPT.lr, betas=OPT.betas, eps=OPT.eps)
    return model, opt


def step(model, opt, batch: TrainBatch, dp: DataParallel) -> float:
    t0 = time.perf_counter()
    part = rank_slice(batch, dp.rank, dp.world_size)
    trainer = TrainerSpec()
    settings = StepSettings(1.0, 1.0, LossSettings(), trainer.micro_batch_tokens, trainer.logprob_chunk_tokens)
    opt.zero_grad(set_to_none=True)
    accumulate_gradients(model, part, torch.ones(part.num_samples, dtype=torch.bool), settings, dp)
    clip_grad_norm_(model.parameters(), OPT.max_grad_norm)
    opt.step()
    return time.perf_counter() - t0


def time_steps(model, opt, batch: TrainBatch, dp: DataParallel, steps: int) -> float:
    step(model, opt, batch, dp)  # warm-up
    return statistics.median(step(model, opt, batch, dp) for _ in range(steps))


def time_dcp(model, opt, dp: DataParallel, work: Path, repeats: int) -> dict:
    writes, loads = [], []
    part = work / f"dcp_{dp.world_size}" / "trainer"
    for _ in range(repeats):
        dp.barrier()
        t0 = time.perf_counter()
        save_sharded(part, model, opt, dp, step=1, attempt=0)
        writes.append(time.perf_counter() - t0)
        dp.barrier()
        t0 = time.perf_counter()
        load_sharded(part, model, opt, dp)
        loads.append(time.perf_counter() - t0)
    size = sum(f.stat().st_size for f in part.rglob("*") if f.is_file())
    return {"write": round(statistics.median(writes), 4), "load": round(statistics.median(loads), 4), "bytes": size}


def rank_main(rank: int, port: int, work: str, rows: int, steps: int, repeats: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1")
    os.environ.update(MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dp = init_from_env(timeout_s=300)
    model, opt = build(Path(work) / "init.safetensors", dp)
    out = {"step_s": time_steps(model, opt, make_batch(rows), dp, steps)}
    out["dcp"] = time_dcp(model, opt, dp, Path(work), repeats)
    if dp.is_main:
        (Path(work) / "ranks.json").write_text(json.dumps(out))
    teardown(dp)


def measure_trainer(steps: int, work: Path) -> dict:
    """``rlrun trainer`` on 1 process vs 2 ``torchrun`` ranks on one node (1x2) and on two (2x1) over the
    same ``steps`` batches (see module docstring)."""
    import yaml
    from rlrun.batch import write_batch
    from rlrun.manifest import load_manifest
    from rlrun.rundir import RunDir

    doc = yaml.safe_load(MANIFEST.read_text())
    doc["spec"]["checkpoint"]["interval"] = steps  # checkpoints at 0 and at the last step only
    manifest = work / "trainer.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    rows = load_manifest(manifest).spec.batch_size
    bindir = Path(sys.executable).parent
    out: dict = {"batch_size": rows, "steps": steps}
    for name, launchers in (
        ("1x1", [[str(bindir / "rlrun")]]),
        (
            "1x2",
            [
                [
                    str(bindir / "torchrun"),
                    "--standalone",
                    "--nnodes",
                    "1",
                    "--nproc-per-node",
                    "2",
                    "--max-restarts",
                    "0",
                    "--no-python",
                    str(bindir / "rlrun"),
                ]
            ],
        ),
        ("2x1", two_node_launchers(bindir)),
    ):
        run_dir = RunDir(work / f"trainer_{name}").ensure()
        g = torch.Generator().manual_seed(0)
        for s in range(1, steps + 1):
            samples = []
            for i in range(rows):
                ids = torch.randint(2, 97, (44,), generator=g).tolist()
                lp = (-4.85 + 0.6 * (torch.rand(24, generator=g) - 0.5)).tolist()
                adv = float(torch.randn(1, generator=g))
                samples.append(TrainingSample(ids[:20], ids[20:], lp, adv, 0.5, QueuedTrace("reverse-text", 0, s, i)))
            write_batch(run_dir.rollout_batch(s), s, samples, pad_id=0)
        trainer = ["trainer", str(manifest), "--run-dir", str(run_dir.root), "--max-steps", str(steps)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        env.pop("RLRUN_TERMINATION_LOG", None)
        t0 = time.perf_counter()
        logs = [work / f"trainer_{name}_node{node}.log" for node in range(len(launchers))]
        procs = []
        for launcher, log in zip(launchers, logs, strict=True):  # files, not pipes: no node blocks on a full pipe
            with open(log, "w") as fh:
                procs.append(subprocess.Popen([*launcher, *trainer], stdout=fh, stderr=subprocess.STDOUT, env=env))
        codes = wait_all(procs)
        wall = time.perf_counter() - t0
        for node, (code, log) in enumerate(zip(codes, logs, strict=True)):
            if code != 0:
                raise SystemExit(f"{name} trainer (node {node}) failed ({code}):\n{log.read_text()[-3000:]}")
        metrics = [json.loads(x) for x in run_dir.trainer_metrics.read_text().splitlines()]
        out[name] = {
            "ranks": metrics[-1].get("ranks", 1),  # the world the trainer saw (its metrics say so beyond 1)
            "train_s_median": round(statistics.median(m["train_s"] for m in metrics[1:]), 4),
            "wall_s": round(wall, 2),
        }
    for name in ("1x2", "2x1"):
        out[f"speedup_{name}"] = round(out["1x1"]["train_s_median"] / out[name]["train_s_median"], 2)
    return out


def wait_all(procs: list[subprocess.Popen]) -> list[int]:
    """Exit codes of ``procs`` once all have exited; a failed one kills the rest (a node left alone waits on
    its peer until its timeouts)."""
    while any(p.poll() is None for p in procs):
        if any(p.poll() not in (None, 0) for p in procs):
            for p in procs:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.1)
    return [p.returncode for p in procs]


def two_node_launchers(bindir: Path) -> list[list[str]]:
    """Two ``torchrun`` commands, one per trainer "node", both on localhost: ``--nnodes 2 --node-rank I
    --nproc-per-node 1`` with static rendezvous on ``127.0.0.1:<free port>``, as the operator's trainer pods
    run it (:func:`rlrun_operator.pods.trainer_command`), node 0 hosting the store."""
    port = str(free_port())
    return [
        [
            str(bindir / "torchrun"),
            "--nnodes",
            "2",
            "--nproc-per-node",
            "1",
            "--node-rank",
            str(node),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            port,
            "--rdzv-conf",
            "timeout=300",
            "--max-restarts",
            "0",
            "--no-python",
            str(bindir / "rlrun"),
        ]
        for node in (0, 1)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--trainer-steps", type=int, default=6, help="0: skip the real-trainer measurement")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rlrun-ranks-") as tmp:
        work = Path(tmp)
        torch.manual_seed(0)
        init = Qwen3ForCausalLM(build_config(TinyModelRecipe(), build_tokenizer()))
        save_file({k: v.contiguous() for k, v in init.state_dict().items()}, str(work / "init.safetensors"))
        batch = make_batch(args.batch_size)
        dp = init_from_env(env={})
        out: dict = {"batch_size": args.batch_size, "tokens": batch.num_loss_tokens, "step_s": {}, "checkpoint_s": {}}
        out["parameters"] = sum(p.numel() for p in init.parameters())
        for threads in (1, 2):
            torch.set_num_threads(threads)
            model, opt = build(work / "init.safetensors", dp)
            out["step_s"][f"1x1_t{threads}"] = round(time_steps(model, opt, batch, dp, args.steps), 4)
        torch.set_num_threads(1)

        writes, loads = [], []
        part = work / "unsharded"
        part.mkdir()
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            save_file(
                {k: v.detach().contiguous() for k, v in model.state_dict().items()}, str(part / "model.safetensors")
            )
            torch.save(opt.state_dict(), part / "optimizer.pt")
            for f in part.iterdir():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
            writes.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            model.load_state_dict(load_file(str(part / "model.safetensors")))
            opt.load_state_dict(torch.load(part / "optimizer.pt", weights_only=True))
            loads.append(time.perf_counter() - t0)
        out["checkpoint_s"]["unsharded"] = {
            "write": round(statistics.median(writes), 4),
            "load": round(statistics.median(loads), 4),
            "bytes": sum(f.stat().st_size for f in part.iterdir()),
        }
        out["checkpoint_s"]["dcp_1"] = time_dcp(model, opt, dp, work, args.repeats)

        # forked ranks inherit the imports; this process ran torch with 1 thread and has no process group
        rank_args = (free_port(), str(work), args.batch_size, args.steps, args.repeats)
        mp.start_processes(rank_main, args=rank_args, nprocs=2, start_method="fork")
        ranks = json.loads((work / "ranks.json").read_text())
        out["step_s"]["1x2_t1"] = round(ranks["step_s"], 4)
        out["checkpoint_s"]["dcp_2"] = ranks["dcp"]
        if args.trainer_steps:
            out["trainer"] = measure_trainer(args.trainer_steps, work)
    out["load_average"] = os.getloadavg()
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
