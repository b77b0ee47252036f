"""LoRA against full fine-tuning on the trainer (JSON on stdout): step time, publish time and bytes, part size.

The real :class:`~rlrun.training.trainer.Trainer` in this process, twice in the same run — ``full`` (no
``spec.model.lora``) and ``lora`` (``spec.model.lora`` of ``--rank`` on every linear layer of the attention and MLP,
the spec's default targets) — on the same ``--steps`` synthetic batches of ``--batch`` samples (prompts of 12 tokens,
completions of 24) with the manifest's other settings. Reported per side, over the steps after the first: the mean
``train_s`` (the step's compute), ``broadcast_s`` and ``broadcast_bytes`` (the publish for the rollout servers), the
trainer part's bytes, and the trainable parameters; ``ratios`` = lora / full from the same run.

Usage: ``python benchmarks/lora_trainer.py [--manifest examples/reverse-text.yaml] [--steps 6] [--batch 128]
[--rank 16] [--cache-dir DIR]`` (≈ 30 s on 2 CPU cores with the builtin tiny-reverse model).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _batches(run_dir, steps: int, batch: int, vocab: int) -> None:
    from rlrun.batch import write_batch
    from rlrun.samples import QueuedTrace, TrainingSample

    g = torch.Generator().manual_seed(0)
    for step in range(1, steps + 1):
        samples = [
            TrainingSample(
                torch.randint(2, vocab, (12,), generator=g).tolist(),
                torch.randint(2, vocab, (24,), generator=g).tolist(),
                [-2.0] * 24,
                float(torch.randn(1, generator=g)),
                0.5,
                QueuedTrace("reverse-text", step - 1, step, i),
            )
            for i in range(batch)
        ]
        write_batch(run_dir.rollout_batch(step), step, samples, pad_id=0)


def one_side(spec, model: str, run_root: Path, steps: int, batch: int) -> dict:
    from rlrun.rundir import RunDir
    from rlrun.training.trainer import Trainer

    run_dir = RunDir(run_root)
    trainer = Trainer(spec, run_dir, model, max_steps=steps)
    _batches(run_dir, steps, batch, trainer.policy.model.config.vocab_size)
    trainer.run()
    trainer.ledger.close()
    lines = [json.loads(x) for x in run_dir.trainer_metrics.read_text().splitlines()][1:]  # the first warms up
    part = run_dir.trainer_checkpoint(steps)
    return {
        "trainable_parameters": sum(p.numel() for p in trainer.policy.model.parameters() if p.requires_grad),
        "train_s_mean": round(statistics.mean(m["train_s"] for m in lines), 4),
        "broadcast_s_mean": round(statistics.mean(m["broadcast_s"] for m in lines), 4),
        "broadcast_bytes": lines[-1]["broadcast_bytes"],
        "part_bytes": sum(f.stat().st_size for f in part.iterdir()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--manifest", type=Path, default=ROOT / "examples" / "reverse-text.yaml")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--cache-dir", type=Path, default=None, help="model cache (default: rlrun's)")
    args = parser.parse_args()
    from rlrun.api.spec import LoraSpec
    from rlrun.manifest import load_manifest
    from rlrun.model.resolve import resolve_model

    full = load_manifest(args.manifest, checks="static").spec
    lora = full.model_copy(update={"model": full.model.model_copy(update={"lora": LoraSpec(rank=args.rank)})})
    model = resolve_model(full.model, args.cache_dir, envs=full.envs)
    with tempfile.TemporaryDirectory(prefix="rlrun-bench-lora-") as tmp:
        sides = {
            name: one_side(spec, model, Path(tmp) / name, args.steps, args.batch)
            for name, spec in (("full", full), ("lora", lora))
        }
    out = {
        "manifest": str(args.manifest),
        "steps": args.steps,
        "batch": args.batch,
        "rank": args.rank,
        **sides,
        "ratios": {k: round(sides["lora"][k] / sides["full"][k], 4) for k in sides["full"] if sides["full"][k]},
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
