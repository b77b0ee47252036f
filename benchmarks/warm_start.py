"""What the first run of each example pays for its builtin model: the build and warm start, from scratch. JSON on
stdout.

For each manifest (default: every example on a builtin model), ``rlrun model init --manifest M OUT_DIR`` builds its
model into an empty directory (as a first ``rlrun local`` does into the cache) and its report gives the warm start's
steps, tokens, why it stopped, its seconds and the held-out greedy share solved per env (64 tasks). ``wall_s`` is the
whole command (imports and the held-out scoring included). ``load`` is the 1-minute load average before and after:
above the core count, other work shared the machine and the times are inflated.

``--threads-ab N``: also times the first N warm-start steps of the first manifest's model with 1 torch thread and with
all cores, interleaved (3 rounds each), and reports each round and the ratio of the medians — why the ``tiny`` build
runs on one thread (``docs/design.md``, "The builtin tiny model for any env").

Usage: ``python benchmarks/warm_start.py [--manifests examples/reasoning-gym.yaml …] [--threads-ab 60]``
(2–6 min on 2 cores for the four examples).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ["reverse-text.yaml", "arithmetic-dataset.yaml", "reasoning-gym.yaml", "guess-number.yaml"]


def build(manifest: Path, out: Path) -> dict:
    """``rlrun model init`` of ``manifest``'s model into ``out``: its report's numbers and the command's wall time."""
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    argv = [sys.executable, "-m", "rlrun", "model", "init", str(out)]
    argv += ["--manifest", str(manifest)] if manifest.name != "reverse-text.yaml" else []  # tiny-reverse: no manifest
    proc = subprocess.run(argv, capture_output=True, text=True, check=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    report = json.loads((out / "rlrun_model.json").read_text())
    greedy = report.get("greedy") or {"reverse-text": {"solved": report.get("exact_match")}}
    return {
        "manifest": str(manifest.relative_to(ROOT)),
        "model": report["builtin"],
        "steps": report["sft_steps"],
        "tokens": report.get("sft_tokens"),
        "stopped": report.get("sft_stopped", "steps"),
        "warm_start_s": report.get("sft_seconds", report.get("seconds")),
        "wall_s": round(wall, 1),
        "held_out_greedy_solved": {env: scores.get("solved") for env, scores in greedy.items()},
        "load": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "progress_lines": len(proc.stderr.splitlines()),
    }


def threads_ab(manifest: Path, steps: int) -> dict:
    """Seconds of the first ``steps`` warm-start steps of ``manifest``'s ``tiny`` model, 1 thread vs all cores."""
    import itertools

    import torch
    from rlrun.envs import make_env
    from rlrun.manifest import load_manifest
    from rlrun.model.build_progress import BuildProgress
    from rlrun.model.chat_tokenizer import build_chat_tokenizer
    from rlrun.model.demonstrations import DemonstrationStream, packed
    from rlrun.model.recipe import TinyEnvsRecipe
    from rlrun.model.tiny import build_config
    from rlrun.model.tiny_envs import warm_start
    from transformers import Qwen3ForCausalLM

    spec = load_manifest(manifest).spec
    recipe = dataclasses.replace(TinyEnvsRecipe(), sft_steps=steps, sft_check_every=10**9)
    envs = [(s.name, make_env(s)) for s in spec.envs]
    tokenizer = build_chat_tokenizer()
    stream = DemonstrationStream(envs, [s.weight for s in spec.envs], tokenizer, 512, recipe.seed)
    rows = list(itertools.islice(stream, steps * recipe.sft_batch_size))
    cores = os.cpu_count() or 1
    rounds: dict[str, list[float]] = {"1": [], str(cores): []}
    for _ in range(3):
        for threads in (1, cores):
            torch.set_num_threads(threads)
            torch.manual_seed(0)
            model = Qwen3ForCausalLM(build_config(recipe, tokenizer))
            batches = packed(iter(rows), recipe.sft_batch_size, recipe.sft_batch_tokens)
            t0 = time.perf_counter()
            warm_start(model, tokenizer, batches, [], recipe, BuildProgress())
            rounds[str(threads)].append(round(time.perf_counter() - t0, 2))
    one, many = statistics.median(rounds["1"]), statistics.median(rounds[str(cores)])
    return {
        "manifest": str(manifest.relative_to(ROOT)),
        "steps": steps,
        "seconds": rounds,
        "all_cores_over_one": round(many / one, 2),
        "load_after": round(os.getloadavg()[0], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--manifests", nargs="*", type=Path, default=[ROOT / "examples" / e for e in EXAMPLES])
    parser.add_argument("--threads-ab", type=int, default=0, metavar="STEPS")
    args = parser.parse_args()
    manifests = [m if m.is_absolute() else (Path.cwd() / m).resolve() for m in args.manifests]
    out: dict = {"cores": os.cpu_count(), "builds": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i, manifest in enumerate(manifests):
            out["builds"].append(build(manifest, Path(tmp) / f"model-{i}"))
            print(json.dumps(out["builds"][-1]), file=sys.stderr)
    if args.threads_ab:
        tiny = next(m for m in manifests if m.name != "reverse-text.yaml")
        out["threads"] = threads_ab(tiny, args.threads_ab)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
