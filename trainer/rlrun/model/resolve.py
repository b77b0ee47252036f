"""Turn ``spec.model`` into something transformers and vLLM can load.

``builtin: tiny-reverse`` becomes a directory under the model cache
(``$RLRUN_CACHE_DIR``, default ``~/.cache/rlrun``), built on first use under an
exclusive file lock so that concurrent processes (or pods sharing a volume) build
it once and the others wait. ``builtin: tiny`` is built the same way for the run's
envs (``spec.envs``, the warm start's data): its directory name holds a hash of the
recipe and the envs' fingerprint, so a run with other envs (or an edited dataset)
gets a model of its own. ``name`` is passed through unchanged: a Hugging Face id or
a local path, loaded by the standard code at ``revision`` (:func:`pretrained_kwargs`).
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path

from rlrun.api.spec import EnvSpec, ModelSpec, RLRunSpec
from rlrun.model.build_progress import BuildProgress, LineProgress, build_progress
from rlrun.model.recipe import TinyEnvsRecipe, TinyModelRecipe, envs_fingerprint

log = logging.getLogger(__name__)


class BuiltinModelError(ValueError):
    """A builtin model this process cannot name: ``tiny`` without envs, or for an env this process cannot build
    (its package or data missing here). Retrying cannot heal it (``permanent``, exit status 78)."""

    permanent = True
    reason = "BuiltinModelUnavailable"


def default_cache_dir() -> Path:
    """``$RLRUN_CACHE_DIR`` or ``~/.cache/rlrun``."""
    return Path(os.environ.get("RLRUN_CACHE_DIR") or Path.home() / ".cache" / "rlrun")


def tiny_recipe(envs: Sequence[EnvSpec]) -> TinyEnvsRecipe:
    """The builtin ``tiny`` model's recipe for a run with ``envs`` (builds each env to fingerprint it).

    Raises:
        BuiltinModelError: ``envs`` is empty (``tiny`` is warm-started on them), or an env cannot be built or read
            here (its package or data missing).
    """
    from rlrun.envs import EnvArgsError, UnknownEnvError

    if not envs:
        raise BuiltinModelError("the builtin model 'tiny' is built for the run's envs: spec.envs is empty")
    try:
        return TinyEnvsRecipe(envs=envs_fingerprint(envs))
    except (UnknownEnvError, EnvArgsError, OSError) as exc:
        raise BuiltinModelError(
            f"the builtin model 'tiny' is named after the run's envs (their args and data), and this process "
            f"cannot build one: {exc}. Every role that loads the model needs the envs' packages and data; or "
            "build it where they are (rlrun model init --manifest RUN.yaml DIR) and name DIR in model.name"
        ) from exc


def builtin_recipe(name: str, envs: Sequence[EnvSpec] = ()) -> TinyModelRecipe | TinyEnvsRecipe:
    """The recipe of builtin model ``name`` (``tiny``: for ``envs``).

    Raises:
        ValueError: an unknown ``name``.
        BuiltinModelError: see :func:`tiny_recipe`.
    """
    if name == "tiny-reverse":
        return TinyModelRecipe()
    if name == "tiny":
        return tiny_recipe(envs)
    raise ValueError(f"unknown builtin model {name!r}")


def builtin_model_dir(name: str, cache_dir: Path | None = None, envs: Sequence[EnvSpec] = ()) -> Path:
    """Where builtin model ``name`` lives in the cache: ``models/<name>-<recipe hash>``.

    Args:
        name: ``tiny-reverse`` or ``tiny``.
        cache_dir: the model cache (None: :func:`default_cache_dir`).
        envs: the run's envs (``spec.envs``); ``tiny`` needs them, ``tiny-reverse`` ignores them.

    Raises:
        ValueError: see :func:`builtin_recipe`.
    """
    return _model_dir(name, cache_dir, builtin_recipe(name, envs))


def _model_dir(name: str, cache_dir: Path | None, recipe: TinyModelRecipe | TinyEnvsRecipe) -> Path:
    return (cache_dir or default_cache_dir()) / "models" / f"{name}-{recipe.cache_key()}"


def ensure_builtin_model(
    name: str,
    cache_dir: Path | None = None,
    envs: Sequence[EnvSpec] = (),
    evaluate: bool = False,
    progress: BuildProgress | None = None,
) -> Path:
    """Build builtin model ``name`` into the cache unless it is there; returns its directory.

    ``evaluate``: a model built here scores greedy decoding on held-out tasks into its report
    (``rlrun_model.json``; a few seconds), as ``rlrun model init`` does. ``progress``: where a build shows its
    phases and warm-start steps (None: log lines every few seconds); a process waiting for another's build says so
    there.

    Raises:
        ValueError: see :func:`builtin_recipe`.
        rlrun.model.demonstrations.NoDemonstrationsError: ``tiny`` for envs none of which has answers.
    """
    recipe = builtin_recipe(name, envs)
    out = _model_dir(name, cache_dir, recipe)
    if (out / "config.json").is_file():
        return out
    progress = progress or LineProgress()
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another process builds it (a sibling role, a pod on the same volume): wait
            progress.phase(f"waiting for another process building builtin model {name} into {out}")
            fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "config.json").is_file():
            log.info("building builtin model %s into %s", name, out)
            if isinstance(recipe, TinyEnvsRecipe):
                from rlrun.model.tiny_envs import init_tiny_envs_model  # torch and transformers: only to build it

                init_tiny_envs_model(out, envs, recipe, evaluate=evaluate, progress=progress)
            else:
                from rlrun.model.tiny import init_tiny_model

                init_tiny_model(out, evaluate=evaluate, progress=progress)
    return out


def init_builtin_model(
    spec: RLRunSpec | None = None,
    out_dir: Path | None = None,
    sft_steps: int | None = None,
    cache_dir: Path | None = None,
    progress: BuildProgress | None = None,
) -> dict:
    """What ``rlrun model init`` does: build ``spec``'s builtin model (``tiny``: for its envs; no spec:
    ``tiny-reverse``) and return its report, showing the build on ``progress`` (None: on stderr, a bar on a terminal
    and a line every few seconds otherwise, so that stdout holds the report alone).

    Args:
        spec: the run whose model to build.
        out_dir: the directory to create; None: the cache, where runs find it (a model already there is not
            rebuilt: its stored report comes back), with its held-out evaluation.
        sft_steps: warm-start steps in place of the recipe's (``tiny``: the most); only with ``out_dir``.

    Returns:
        The build's report (``rlrun_model.json``), with ``path`` when built into the cache.

    Raises:
        ValueError: ``spec``'s model is not a builtin one, ``sft_steps`` without ``out_dir``, or see
            :func:`builtin_recipe`.
        FileExistsError: ``out_dir`` exists and is not empty.
    """
    if spec is not None and spec.model.builtin is None:
        raise ValueError(f"the manifest's model is {spec.model.identity}, not a builtin one: nothing to build")
    if progress is None:
        from rich.console import Console

        progress = build_progress(Console(stderr=True))
    name = spec.model.builtin if spec is not None else "tiny-reverse"
    envs = spec.envs if spec is not None else []
    recipe = builtin_recipe(name, envs)
    if out_dir is None:
        if sft_steps is not None:
            raise ValueError("--sft-steps makes a model the runs would not find in the cache: give OUT_DIR")
        path = ensure_builtin_model(name, cache_dir, envs, evaluate=True, progress=progress)
        return {"path": str(path), **json.loads((path / "rlrun_model.json").read_text())}
    if sft_steps is not None:
        recipe = dataclasses.replace(recipe, sft_steps=sft_steps)
    if isinstance(recipe, TinyEnvsRecipe):
        from rlrun.model.tiny_envs import init_tiny_envs_model

        return init_tiny_envs_model(out_dir, envs, recipe, progress=progress)
    from rlrun.model.tiny import init_tiny_model

    return init_tiny_model(out_dir, recipe, progress=progress)


def resolve_model(
    spec: ModelSpec, cache_dir: Path | None = None, envs: Sequence[EnvSpec] = (), progress: BuildProgress | None = None
) -> str:
    """A path or Hugging Face id for ``spec``, building the builtin model if needed.

    Args:
        spec: the run's ``spec.model``.
        cache_dir: the model cache (None: :func:`default_cache_dir`).
        envs: the run's ``spec.envs``: what ``builtin: tiny`` is built for (every caller passes them; the
            other models ignore them).
        progress: where a build is shown (None: log lines every few seconds).
    """
    if spec.builtin is not None:
        return str(ensure_builtin_model(spec.builtin, cache_dir, envs, progress=progress))
    assert spec.name is not None
    return spec.name


def pretrained_kwargs(spec: ModelSpec) -> dict[str, str]:
    """The keyword arguments every ``from_pretrained`` of ``spec``'s model takes (weights, tokenizer, config), so that
    the trainer, its reference policy, the orchestrator's tokenizer and ``rlrun local``'s checks load the revision
    vLLM serves (``rollout/server.py`` passes ``--revision``): ``{"revision": spec.revision}`` for a named model with
    a revision (a commit, tag or branch of the Hugging Face repo; a local directory ignores it, as transformers and
    vLLM do), ``{}`` otherwise (a builtin model is a directory built here, with no revision; a named one without a
    revision loads ``main``). The one owner of this rule (``docs/design.md``, "Model revision"): pass it at every
    ``from_pretrained`` of the run's model.

    Args:
        spec: the run's ``spec.model``.
    """
    if spec.builtin is None and spec.revision is not None:
        return {"revision": spec.revision}
    return {}


def load_tokenizer(model_path: str | Path, spec: ModelSpec):
    """The tokenizer of ``spec``'s model at ``model_path`` (a directory or a Hugging Face id), as
    ``AutoTokenizer.from_pretrained(model_path, **pretrained_kwargs(spec))`` loads it.

    A local directory whose ``tokenizer_config.json`` names its class (every tokenizer transformers saves does) is
    loaded by that class directly: ``AutoTokenizer``'s import pulls transformers' whole auto-model machinery and
    with it torch's compiler (≈ 2.5 s of the orchestrator's start on 2 cores, at every attempt; measured in
    ``docs/measurements.md``), although resolving the class is all it does here. A name, a config without a class, a
    class transformers does not export or one from the model's own code (``auto_map``) goes through ``AutoTokenizer``.

    Raises:
        OSError: no tokenizer at ``model_path`` (transformers' error).
    """
    import transformers

    config = Path(model_path) / "tokenizer_config.json"
    if config.is_file():
        settings = json.loads(config.read_text())
        name = settings.get("tokenizer_class")
        if isinstance(name, str) and "auto_map" not in settings:
            tokenizer_class = getattr(transformers, name, None)
            if tokenizer_class is not None:
                return tokenizer_class.from_pretrained(model_path, **pretrained_kwargs(spec))
    return transformers.AutoTokenizer.from_pretrained(model_path, **pretrained_kwargs(spec))
