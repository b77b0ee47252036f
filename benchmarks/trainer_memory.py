"""One trainer step's peak memory and tokens/s against the tokens in the step (JSON on stdout), issue 37.

Each configuration runs in a child process of its own (so peaks never mix): the real
:class:`~rlrun.training.trainer.Trainer` (model load, its step-0 checkpoint, then two steps on batches written in
the run directory's format, as ``rlrun trainer`` takes them: a 2-sample warm-up step, then the measured one) on a
Qwen3-shaped model with random weights built from a config (nothing downloaded). Reported per configuration:

- ``step_peak_gib``: the kernel's peak resident set (``VmHWM``, reset through ``/proc/self/clear_refs`` just before)
  during the second step: the step's own peak, allocator warmed up; on a GPU ``torch.cuda.max_memory_allocated``;
- ``process_peak_gib``: the whole child's peak (``ru_maxrss``: imports, model load, checkpoint, both steps), what
  issue 37 measured ("1,024 tokens → 3.38 GiB, 4,096 → 10.16 GiB");
- ``step_s`` and ``tokens_per_s`` of the second step (``train_s``: forward, backward, clip, AdamW; not the
  weight broadcast), ``step_cpu_s`` (its CPU seconds, every thread: on shared cores the steadier measure),
  ``padding_share`` and ``micro_batches`` from its metrics;
- on a GPU ``mfu``: model FLOPs (``6 · N`` per token for the ``N`` non-embedding parameters plus the LM head, and
  ``12 · layers · hidden · T`` for attention, PaLM's appendix B count; the LM head's recompute in the backward is
  not counted) over the step's seconds and the GPU's dense bf16 peak (``--peak-tflops``; H100/H200 989).

Modes:

- CPU (default): Qwen3's vocabulary (151,936) on 2 layers of hidden 256 (untied head, as the issue's baseline),
  float32, samples of ``--sample-tokens`` (128: 64 prompt + 64 completion), steps of ``--tokens``
  (1k … 32k), activation checkpointing off and on. ``--source DIR`` runs the children against another rlrun source
  tree (its ``trainer/`` on ``PYTHONPATH``): ``git archive f9e37d4 trainer | tar -x -C DIR`` is the code before
  issue 37, whose step holds the ``[B, T, V]`` logits (use ``--checkpointing off``: it had no such setting).
  ``--spread`` adds the padding measurement: a batch with lengths spread 16–1,024 tokens, and the default
  example's shape (reverse-text: 128 samples of ≈ 9–30 tokens).
- ``--loss '{"kl_coef": 0.05}'``: the children's ``spec.loss`` (issue 38: the KL term's reference policy, the other
  objectives); its cost is the difference from a run without it.
- ``--lora '{"rank": 16}'``: the children's ``spec.model.lora`` (issue 40: a LoRA adapter on the frozen model, its
  gradients and AdamW state alone); its saving is the difference from a run without it.
- ``--gpu``: CUDA, bf16, a Qwen3-0.6B-shaped model (its config: 28 layers, hidden 1,024, tied head), samples of
  ``--sample-tokens`` (default 4,096), ``--micro-batch-tokens`` (default 16,384) and ``--chunk-tokens`` (default
  2,048); ``torchrun --nproc-per-node N`` children when ``--gpus N > 1`` (FSDP2 over the ranks; 1 GPU is the
  single-process path, autocast). Refuses to start without CUDA.

Usage: ``python benchmarks/trainer_memory.py [--tokens 1024,2048,…] [--checkpointing off,on] [--source DIR]
[--loss JSON] [--lora JSON] [--spread] [--gpu [--gpus N]]``. CPU, 2 cores: ≈ 10 min for 1k–16k with and without
checkpointing.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GIB = 1024**3
VOCAB = 151_936  # Qwen3's tokenizer
CPU_MODEL = {
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "tie_word_embeddings": False,
}
QWEN3_0_6B = {
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "tie_word_embeddings": True,
}
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0}  # dense bf16, vendor datasheets


def build_model(path: Path, shape: dict) -> Path:
    """A Qwen3 model with ``shape`` and Qwen3's vocabulary, random weights (seed 0), saved to ``path``."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=VOCAB, max_position_embeddings=40_960, rope_theta=1_000_000.0, **shape)
    Qwen3ForCausalLM(config).save_pretrained(path)
    return path


def lengths_for(kind: str, tokens: int, sample_tokens: int) -> list[int]:
    """Sample lengths of a batch: ``fixed`` (``tokens / sample_tokens`` samples of ``sample_tokens``), ``spread``
    (16–1,024 tokens, uniform, to ``tokens``: 4,096 with ``--spread``), ``example`` (the default example: 128
    reverse-text samples, prompt and completion of two words, 9–30 tokens)."""
    import random

    rng = random.Random(0)
    if kind == "fixed":
        return [sample_tokens] * max(1, tokens // sample_tokens)
    if kind == "example":
        return [rng.randint(9, 30) for _ in range(128)]
    out: list[int] = []
    while sum(out) < tokens:
        out.append(rng.randint(16, 1024))
    return out


def child(cfg: dict) -> dict | None:
    """One configuration, in this process: the measurements of the module docstring (None on ranks but 0)."""
    import torch
    from rlrun.batch import write_batch
    from rlrun.manifest import parse_manifest
    from rlrun.rundir import RunDir
    from rlrun.samples import QueuedTrace, TrainingSample
    from rlrun.training.trainer import Trainer

    gpu = cfg["gpu"]
    torch.set_num_threads(cfg["threads"]) if not gpu else None
    spec = {
        "model": {"name": cfg["model"]},
        "envs": [{"name": "reverse-text"}],
        "group_size": 2,
        "batch_size": 2,
        "max_steps": 2,
        "seed": 0,
    }
    if cfg["trainer"]:
        spec["trainer"] = cfg["trainer"]
    if cfg.get("loss"):
        spec["loss"] = cfg["loss"]
    if cfg.get("lora") is not None:
        spec["model"]["lora"] = cfg["lora"]
    run = parse_manifest(
        {"apiVersion": "rlrun.dev/v1alpha1", "kind": "RLRun", "metadata": {"name": "bench"}, "spec": spec}
    )
    run_dir = RunDir(Path(cfg["run_dir"]))
    g = torch.Generator().manual_seed(0)
    for step, lengths in ((1, cfg["lengths"][:2]), (2, cfg["lengths"])):  # a small warm-up step, the measured one
        samples = []
        for i, n in enumerate(lengths):
            ids = torch.randint(2, VOCAB, (n,), generator=g).tolist()
            p = n // 2
            lp = (-11.9 + 0.3 * torch.randn(n - p, generator=g)).tolist()  # ≈ the untrained model's log(1/V)
            trace = QueuedTrace("reverse-text", step - 1, step * 10_000 + i, 0)
            samples.append(TrainingSample(ids[:p], ids[p:], lp, 1.0 if i % 2 else -1.0, 0.5, trace))
        write_batch(run_dir.rollout_batch(step), step, samples, pad_id=0)
    kwargs = {}
    if gpu:
        from rlrun.training.distributed import init_from_env

        kwargs["dp"] = init_from_env()
    trainer = Trainer(run.spec, run_dir, cfg["model"], max_steps=2, **kwargs)
    trainer.train_step(1)  # warm-up: AdamW's state, the allocator's pools, the first-call costs
    if gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    else:
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM (Linux ≥ 4.0)
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    metrics = trainer.train_step(2)
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    if gpu:
        torch.cuda.synchronize()
        step_peak = torch.cuda.max_memory_allocated() / GIB
    else:
        hwm = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmHWM"))
        step_peak = int(hwm.split()[1]) * 1024 / GIB
    if not trainer.dp.is_main:
        return None
    tokens = sum(cfg["lengths"])
    out = {
        "tokens": tokens,
        "samples": len(cfg["lengths"]),
        "step_peak_gib": round(step_peak, 3),
        "process_peak_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB, 3),
        "step_s": metrics["train_s"],
        # CPU seconds of the step (all threads, user + system): on cores other processes share, what the step itself
        # costs, where wall seconds also count the waits for a core
        "step_cpu_s": round(cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime, 2),
        "tokens_per_s": round(tokens / metrics["train_s"], 1),
        **{k: metrics[k] for k in ("padding_share", "micro_batches") if k in metrics},
    }
    if gpu:
        out.update(gpu_flops(trainer.policy.model, tokens, max(cfg["lengths"]), metrics["train_s"], cfg["peak_tflops"]))
    return out


def gpu_flops(model, tokens: int, seq: int, seconds: float, peak_tflops: float) -> dict:
    """Model FLOPs utilisation (module docstring)."""
    cfg = model.config
    n = sum(p.numel() for name, p in model.named_parameters() if "embed_tokens" not in name)
    if cfg.tie_word_embeddings:
        n += cfg.vocab_size * cfg.hidden_size  # the head is the embedding, and does a matmul
    flops = tokens * (6 * n + 12 * cfg.num_hidden_layers * cfg.hidden_size * seq)
    achieved = flops / seconds / 1e12
    return {"model_tflops": round(achieved, 1), "mfu": round(achieved / peak_tflops, 4), "peak_tflops": peak_tflops}


def run_child(cfg: dict, source: Path | None, gpus: int, timeout_s: float) -> dict:
    """``cfg`` measured in a fresh process (or ``torchrun`` ranks); the error, if it failed."""
    env = dict(os.environ, OMP_NUM_THREADS=str(cfg["threads"]), HF_HUB_OFFLINE="1")
    if source is not None:
        env["PYTHONPATH"] = f"{source / 'trainer'}{os.pathsep}{env.get('PYTHONPATH', '')}"
    script = [str(Path(__file__).resolve()), "--child", json.dumps(cfg)]
    argv = [sys.executable, *script]
    if gpus > 1:
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}", *script]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"over {timeout_s:.0f} s"}
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout)[-600:]
        return {"error": f"exit {proc.returncode}: {tail}"}
    return {**json.loads(lines[-1]), "wall_s": round(time.monotonic() - t0, 1)}


def trainer_settings(args, checkpointing: bool) -> dict:
    settings = {}
    if args.source is None:  # the code under test has these settings (the code before issue 37 has none)
        settings["activation_checkpointing"] = checkpointing
        for key, value in (
            ("micro_batch_tokens", args.micro_batch_tokens),
            ("logprob_chunk_tokens", args.chunk_tokens),
        ):
            if value:
                settings[key] = value
        if args.gpu:
            settings["precision"] = "bfloat16"
    return settings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--tokens", default=None, help="tokens per step, comma-separated (CPU: 1024,…,32768)")
    parser.add_argument("--sample-tokens", type=int, default=None, help="tokens per sample (CPU 128, GPU 4096)")
    parser.add_argument("--checkpointing", default="off,on", help="activation checkpointing: off, on or off,on")
    parser.add_argument("--micro-batch-tokens", type=int, default=None, help="default: the spec's (GPU: 16384)")
    parser.add_argument("--chunk-tokens", type=int, default=None, help="default: the spec's (GPU: 2048)")
    parser.add_argument("--source", type=Path, default=None, help="another rlrun source tree (the 'before')")
    parser.add_argument("--loss", type=json.loads, default=None, help="spec.loss as JSON, e.g. '{\"kl_coef\": 0.05}'")
    parser.add_argument("--lora", type=json.loads, default=None, help="spec.model.lora as JSON, e.g. '{\"rank\": 16}'")
    parser.add_argument("--label", default=None, help="a name for this run in the output (default: after/before)")
    parser.add_argument("--spread", action="store_true", help="also the padding of a wide spread and of the example")
    parser.add_argument("--threads", type=int, default=2, help="torch threads per CPU child")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per configuration")
    parser.add_argument("--gpu", action="store_true", help="CUDA, bf16, the Qwen3-0.6B shape")
    parser.add_argument("--gpus", type=int, default=1, help="GPU ranks (torchrun) in --gpu mode")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the GPU's dense bf16 peak (default by name)")
    args = parser.parse_args()
    if args.child:
        result = child(json.loads(args.child))
        if result is not None:
            print(json.dumps(result), flush=True)
        return
    peak = None
    if args.gpu:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("--gpu: no CUDA device here (torch.cuda.is_available() is False); run it on a GPU machine")
        name = torch.cuda.get_device_name(0)
        peak = args.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
        if peak is None:
            raise SystemExit(f"--gpu: unknown peak bf16 TFLOP/s for {name!r}; pass --peak-tflops")
        args.micro_batch_tokens = args.micro_batch_tokens or 16_384
        args.chunk_tokens = args.chunk_tokens or 2048
    sample_tokens = args.sample_tokens or (4096 if args.gpu else 128)
    default_tokens = "16384,32768,65536" if args.gpu else "1024,2048,4096,8192,16384,32768"
    token_counts = [int(x) for x in (args.tokens or default_tokens).split(",")]
    checkpointing = [c == "on" for c in args.checkpointing.split(",")]
    label = args.label or ("before" if args.source else "after")
    out: dict = {
        "label": label,
        "source": str(args.source or ROOT),
        "mode": "gpu" if args.gpu else "cpu",
        "sample_tokens": sample_tokens,
        "loss": args.loss or {},
        "lora": args.lora,
        "results": [],
    }
    with tempfile.TemporaryDirectory(prefix="rlrun-trainer-memory-") as tmp:
        model = build_model(Path(tmp) / "model", QWEN3_0_6B if args.gpu else CPU_MODEL)
        out["model"] = {"vocab": VOCAB, **(QWEN3_0_6B if args.gpu else CPU_MODEL)}
        configs = [("fixed", n, c) for c in checkpointing for n in token_counts]
        if args.spread:
            configs += [("spread", 4096, False), ("example", 0, False)]
        for kind, n, ckpt in configs:
            cfg = {
                "gpu": args.gpu,
                "model": str(model),
                "run_dir": str(Path(tmp) / f"run-{kind}-{n}-{ckpt}"),
                "lengths": lengths_for(kind, n, sample_tokens),
                "trainer": trainer_settings(args, ckpt),
                "threads": args.threads,
                "peak_tflops": peak,
                "loss": args.loss,
                "lora": args.lora,
            }
            result = {"batch": kind, "checkpointing": ckpt, **run_child(cfg, args.source, args.gpus, args.timeout)}
            out["results"].append(result)
            print(json.dumps(result), file=sys.stderr, flush=True)  # progress
    out["load_average"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
