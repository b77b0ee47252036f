"""Turn ``spec.model`` into something transformers and vLLM can load.

``builtin: tiny-reverse`` becomes a directory under the model cache
(``$RLRUN_CACHE_DIR``, default ``~/.cache/rlrun``), built on first use under an
exclusive file lock so that concurrent processes (or pods sharing a volume) build
it once and the others wait. ``name`` is passed through unchanged: a Hugging Face
id or a local path, loaded by the standard code.
"""

from __future__ import annotations

import fcntl
import logging
import os
from pathlib import Path

from rlrun.api.spec import ModelSpec
from rlrun.model.recipe import TinyModelRecipe

log = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    """``$RLRUN_CACHE_DIR`` or ``~/.cache/rlrun``."""
    return Path(os.environ.get("RLRUN_CACHE_DIR") or Path.home() / ".cache" / "rlrun")


def builtin_model_dir(name: str, cache_dir: Path | None = None) -> Path:
    """Where builtin model ``name`` lives in the cache (the path includes the recipe's hash)."""
    if name != "tiny-reverse":
        raise ValueError(f"unknown builtin model {name!r}")
    return (cache_dir or default_cache_dir()) / "models" / f"tiny-reverse-{TinyModelRecipe().cache_key()}"


def ensure_builtin_model(name: str, cache_dir: Path | None = None) -> Path:
    """Build builtin model ``name`` into the cache unless it is there; returns its directory."""
    out = builtin_model_dir(name, cache_dir)
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "config.json").is_file():
            from rlrun.model.tiny import init_tiny_model  # torch and transformers: only to build it

            log.info("building builtin model %s into %s", name, out)
            init_tiny_model(out, evaluate=False)
    return out


def resolve_model(spec: ModelSpec, cache_dir: Path | None = None) -> str:
    """A path or Hugging Face id for ``spec``, building the builtin model if needed."""
    if spec.builtin is not None:
        return str(ensure_builtin_model(spec.builtin, cache_dir))
    assert spec.name is not None
    return spec.name
