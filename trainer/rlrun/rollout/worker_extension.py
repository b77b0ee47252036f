"""vLLM worker extension: reload the policy's weights from a directory of safetensors.

Loaded into every vLLM worker with ``--worker-extension-cls
rlrun.rollout.worker_extension.WeightReloadExtension`` and called through the dev
server's ``POST /collective_rpc``. vLLM kills the whole server when a method
called through ``collective_rpc`` raises, so these methods never raise: they
return ``{"ok": False, "error": …}`` instead, and the orchestrator validates the
files before it asks (``rlrun.rollout.weights.validate_weights_dir``).
"""

from __future__ import annotations

import time
import traceback
from pathlib import Path
from typing import Any


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
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
