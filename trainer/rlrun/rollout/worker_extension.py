"""vLLM worker extension: reload the policy's weights from safetensors files, and say what each worker holds.

Loaded into every vLLM worker with ``--worker-extension-cls
rlrun.rollout.worker_extension.WeightReloadExtension`` and called through the dev
server's ``POST /collective_rpc``. vLLM kills the whole server when a method
called through ``collective_rpc`` raises, so these methods never raise: they
return ``{"ok": False, "error": …}`` instead, and the orchestrator validates the
files before it asks (``rlrun.rollout.weights.validate_weights_dir``).

What a server holds is checked, never assumed (ARCHITECTURE.md, invariant 8): after a reload the client asks
each worker for the digest of the weights it serves (:meth:`WeightReloadExtension.rlrun_weights_digest`),
after an adapter load the digest of the adapter it loaded last
(:meth:`WeightReloadExtension.rlrun_adapter_digest`), and compares them with the published files'
(:mod:`rlrun.weights_digest`, :mod:`rlrun.rollout.verification`).
"""

from __future__ import annotations

import time
import traceback
from pathlib import Path
from typing import Any


def _failed(exc: Exception) -> dict[str, Any]:
    return {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}


def _packed_weight(module, dtype):
    """A linear layer's weight as vLLM-CPU's GEMM holds it: on a CPU vLLM packs it for oneDNN (or another
    kernel, ``dispatch_cpu_unquantized_gemm``) and leaves the parameter empty, so the values are read from the
    kernel itself: ``cpu_linear(I)`` is ``I·Wᵀ = Wᵀ``, each value a product by 1 plus zeros (exact).
    ``[K, N]``."""
    import torch

    k = getattr(module, "input_size_per_partition", None) or module.input_size
    return module.cpu_linear(torch.eye(k, dtype=dtype), None, None)


def _owned_values(model) -> tuple[list, str | None]:
    """The tensors of ``model``'s parameters this rank counts in the server's digest, and why the server's
    weights cannot be compared (None: they can). Each value once over the ranks: a tensor-parallel shard on
    every rank, a replicated parameter on rank 0 alone; a vocabulary-parallel table without its padding rows
    (vLLM pads the vocabulary to a multiple of 64 and zero-fills the rows past the checkpoint's,
    ``VocabParallelEmbedding``)."""
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
    from vllm.model_executor.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    rank, size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    values, seen = [], set()
    for module in model.modules():
        if size > 1 and isinstance(module, QKVParallelLinear) and module.num_kv_head_replicas > 1:
            return [], f"key/value heads replicated over {size} tensor-parallel ranks"
        for name, param in module.named_parameters(recurse=False):
            if id(param) in seen:  # a tied weight (an LM head sharing the embedding) is one tensor
                continue
            seen.add(id(param))
            sharded = isinstance(module, (VocabParallelEmbedding, ColumnParallelLinear)) or (
                isinstance(module, RowParallelLinear) and name == "weight"
            )
            if size > 1 and not sharded and rank != 0:
                continue
            if isinstance(module, VocabParallelEmbedding):
                param = param[: module.shard_indices.num_org_elements]
            elif name == "weight" and param.numel() == 0 and hasattr(module, "cpu_linear"):
                param = _packed_weight(module, param.dtype)
            values.append(param)
    dtypes = {str(v.dtype) for v in values}
    if any(not v.is_floating_point() for v in values):
        return [], f"quantized parameters ({sorted(dtypes)})"
    return values, None


class WeightReloadExtension:
    """Mixed into vLLM's worker class; ``self.model_runner`` is the worker's model runner."""

    def rlrun_reload_weights(self, path: str) -> dict[str, Any]:
        """Load every ``*.safetensors`` tensor under ``path`` into the served model, in place.

        Returns:
            ``{"ok": True, "tensors": n, "seconds": s}`` or ``{"ok": False, "error": msg}``.
        """
        try:
            from safetensors.torch import safe_open

            t0 = time.perf_counter()
            files = sorted(Path(path).glob("*.safetensors"))
            if not files:
                return {"ok": False, "error": f"no *.safetensors files in {path}"}
            count = 0

            def tensors():
                nonlocal count
                for f in files:
                    with safe_open(str(f), framework="pt", device="cpu") as fh:
                        for name in fh.keys():  # noqa: SIM118 - safe_open has no __iter__
                            count += 1
                            yield name, fh.get_tensor(name)

            self.model_runner.reload_weights(weights_iterator=tensors(), is_checkpoint_format=True)
            return {"ok": True, "tensors": count, "seconds": round(time.perf_counter() - t0, 4)}
        except Exception as exc:  # never let an exception reach vLLM: it would kill the server
            return _failed(exc)

    def rlrun_weights_digest(self) -> dict[str, Any]:
        """The digest of the weights this worker serves (:mod:`rlrun.weights_digest`: its share of the
        server's, which the client adds up over the workers).

        Returns:
            ``{"ok": True, "digest": {"elements", "bits"}, "dtype": "torch.float32", "seconds": s}``;
            ``"digest": None`` with ``"why"`` when the weights cannot be compared (quantized, key/value heads
            replicated over ranks); ``{"ok": False, "error": msg}``.
        """
        try:
            from rlrun.weights_digest import Digest, tensor_digest

            t0 = time.perf_counter()
            values, why = _owned_values(self.model_runner.get_model())
            if why is not None:
                return {"ok": True, "digest": None, "why": why}
            total = sum((tensor_digest(v) for v in values), Digest())
            dtypes = sorted({str(v.dtype) for v in values})
            return {
                "ok": True,
                "digest": total.to_json(),
                "dtype": ",".join(dtypes),
                "seconds": time.perf_counter() - t0,
            }
        except Exception as exc:  # never let an exception reach vLLM: it would kill the server
            return _failed(exc)

    def rlrun_adapter_digest(self) -> dict[str, Any]:
        """The digest of the LoRA adapter this worker loaded last (the highest id: vLLM numbers each adapter
        name it is given from a counter), as it holds it: every tensor of its ``LoRAModel``, the scaling
        folded into ``B`` (:func:`rlrun.weights_digest.adapter_digest` computes the same from the files). Each
        rank holds the whole adapter (vLLM slices it only into the layers' buffers), so each answers the whole
        digest.

        Returns:
            ``{"ok": True, "digest": {…}, "dtype": "torch.float32", "adapter_id": n}``, ``{"ok": False,
            "error": msg}`` (none loaded included).
        """
        try:
            import torch

            from rlrun.weights_digest import Digest, tensor_digest

            held = self.model_runner.lora_manager._adapter_manager.list_adapters()  # id -> vLLM's LoRAModel
            if not held:
                return {"ok": False, "error": "no LoRA adapter loaded"}
            newest = max(held)
            tensors = []
            for weights in held[newest].loras.values():
                for t in (weights.lora_a, weights.lora_b):  # a list for q/k/v or gate/up packed in one module
                    tensors += [x for x in (t if isinstance(t, list) else [t]) if x is not None]
            total = sum((tensor_digest(t) for t in tensors), Digest())
            dtype = str(tensors[0].dtype) if tensors else str(torch.float32)
            return {"ok": True, "digest": total.to_json(), "dtype": dtype, "adapter_id": newest}
        except Exception as exc:  # never let an exception reach vLLM: it would kill the server
            return _failed(exc)
