"""The real :class:`~rlrun.orchestrator.loop.Orchestrator` over fake rollout servers, and running it to the end.

``make_orchestrator(spec, run_dir, model)`` is the orchestrator a test drives in its own event loop: its rollout servers
are httpx transports in this process (:func:`rlrun.rollout.fake.fake_vllm_transport`, or a test's own faulty or
recording one), it polls every 10 ms instead of 50, and it is attempt 1 of the run unless told otherwise.
``run_to_the_end`` runs one with the fake trainer (:mod:`rlrun.training.fake`) until it has shipped ``max_steps``
batches; ``trainer_start_part`` is the trainer's step-0 checkpoint part, for an orchestrator run without a trainer
whose pause must pair its snapshot with a part (as the real trainer publishes it at start-up).
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Mapping
from pathlib import Path

import httpx
from rlrun.api.spec import RLRunSpec
from rlrun.checkpoint import TRAINER_PROGRESS_FILE, WEIGHTS_FILE
from rlrun.orchestrator.loop import Orchestrator
from rlrun.rollout.client import RolloutClient
from rlrun.rollout.fake import fake_vllm_transport
from rlrun.rundir import RunDir, publish_dir, write_meta
from rlrun.training.fake import start_fake_trainer

#: the URL of the one fake rollout server, where a test gives a single transport (or none)
FAKE_URL = "http://fake-rollout:1"


def make_orchestrator(
    spec: RLRunSpec,
    run_dir: RunDir,
    model: Path | str,
    servers: httpx.AsyncBaseTransport | Mapping[str, httpx.AsyncBaseTransport] | None = None,
    *,
    urls: list[str] | None = None,
    attempt: int = 1,
    resume: bool = False,
    poll_s: float = 0.01,
    **kwargs,
) -> Orchestrator:
    """The real orchestrator of ``spec`` in ``run_dir``, its rollout requests answered by ``servers``.

    Args:
        spec: the run's spec.
        run_dir: the run directory.
        model: the model directory (the tokenizer and the reference weights' shapes come from it).
        servers: what answers rollout requests: None, one fake vLLM server (a token replaced at random with
            probability 0.3); a transport, that one server; either at :data:`FAKE_URL` and at every URL set later.
            A mapping URL → transport: those servers, each at its URL only.
        urls: the rollout URLs it starts with (default: :data:`FAKE_URL`, or every server's of a mapping; ``[]``:
            none, as in a pod before the operator sends them).
        attempt: the attempt number (0 is the operator's first).
        resume: resume from the run directory's newest complete checkpoint.
        poll_s: seconds between the main loop's looks (the product's default: 0.05).
        kwargs: the rest of :class:`~rlrun.orchestrator.loop.Orchestrator`'s arguments (``max_steps``,
            ``control_port``, ``control_token``, ``run_uid``, ...).

    Raises:
        KeyError: at the first request to a URL that is none of ``servers``.
    """
    if servers is None:
        servers = fake_vllm_transport(error_rate=0.3)
    if isinstance(servers, Mapping):
        by_url = dict(servers)
        known, client_factory = list(by_url), lambda url: RolloutClient(url, transport=by_url[url])
    else:
        known, client_factory = [FAKE_URL], lambda url: RolloutClient(url, transport=servers)
    return Orchestrator(
        spec,
        run_dir,
        known if urls is None else urls,
        str(model),
        resume=resume,
        attempt=attempt,
        poll_s=poll_s,
        client_factory=client_factory,
        **kwargs,
    )


async def run_to_the_end(orch: Orchestrator, interval: int | None = None, first_step: int = 0, timeout_s=60.0) -> int:
    """Run ``orch`` with the fake trainer until it returns; the number of batches it shipped.

    Args:
        orch: an orchestrator not yet run.
        interval: the fake trainer checkpoints every this many steps (default: the spec's ``checkpoint.interval``).
        first_step: the step the trainer resumes after (a resumed attempt's checkpoint step).
        timeout_s: seconds the run may take.

    Raises:
        whatever the run raises; ``TimeoutError`` past ``timeout_s``. The fake trainer is stopped either way.
    """
    every = interval or orch.spec.checkpoint.interval
    model = Path(orch.model_path)
    stop = start_fake_trainer(orch.run_dir, model, orch.max_steps, every, attempt=orch.attempt, first_step=first_step)
    try:
        return await asyncio.wait_for(orch.run(), timeout_s)
    finally:
        stop.set()


def trainer_start_part(run_dir: RunDir, model: Path | str, attempt: int = 0) -> None:
    """The trainer's step-0 checkpoint part, as the trainer publishes it at start-up: the model's weights, its
    progress file and the attempt's stamp."""

    def part(tmp: Path) -> None:
        shutil.copy(Path(model) / WEIGHTS_FILE, tmp / WEIGHTS_FILE)
        (tmp / TRAINER_PROGRESS_FILE).write_text(json.dumps({"step": 0, "attempt": attempt}))
        write_meta(tmp, 0, attempt)

    run_dir.checkpoint(0).mkdir(parents=True, exist_ok=True)
    publish_dir(run_dir.trainer_checkpoint(0), part)
