"""rlrun's ``vllm.general_plugins`` entry point: what vLLM loads in each of its processes (API server, engine core,
workers) before it builds anything.

Guarantee: loading the plugin costs vLLM nothing it does not use: :func:`register` names rlrun's weight-transfer
engines by module path (vLLM's factories import a backend's module when a server or trainer asks for it), so a
server started without ``--weight-transfer-config '{"backend": "rlrun_gloo"}'`` never imports
:mod:`rlrun.rollout.gloo_transfer`. Idempotent: vLLM may load a plugin more than once in a process.
"""

from __future__ import annotations

from rlrun.roles import GLOO_BACKEND  # the gloo engine's backend name (rlrun.rollout.gloo_transfer)

_ENGINE_MODULE = "rlrun.rollout.gloo_transfer"


def register() -> None:
    """Register both halves of :data:`GLOO_BACKEND` in vLLM's factories, lazily (the worker's
    ``GlooWeightTransferEngine``, the trainer's ``GlooTrainerWeightTransferEngine``); a trainer calls it too."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    if GLOO_BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(GLOO_BACKEND, _ENGINE_MODULE, "GlooWeightTransferEngine")
    if GLOO_BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(GLOO_BACKEND, _ENGINE_MODULE, "GlooTrainerWeightTransferEngine")
