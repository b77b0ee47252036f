"""A stand-in for vLLM's HTTP API, for tests and benchmarks of everything but inference.

:func:`fake_vllm_transport` returns an ``httpx.MockTransport`` that answers the routes the orchestrator uses.
Completions of a reverse-text prompt (text + one separator token) are the text reversed with each token
replaced at random with probability ``error_rate``, then EOS, cut at the request's ``max_tokens``
(``finish_reason: "length"``), so rewards and group rejections resemble a real run's. With ``samples_per_s``
set, completions are served at that aggregate rate (a model of a real server's throughput); without it they
are instant. ``GET /metrics`` reports the completions being generated as vLLM's ``vllm:num_requests_running``
(and ``vllm:num_requests_waiting`` 0). ``GET /version`` answers as vLLM does, ``{"version": …}``: the vLLM
version rlrun supports (:func:`rlrun.versions.imitated_vllm`: it imitates that vLLM's API), or the
``vllm_version`` it is given. A weight reload (``POST /collective_rpc`` with ``rlrun_reload_weights``) answers
as the worker extension does: ``ok`` when the directory holds ``*.safetensors`` files, an error naming the
directory otherwise; it takes ``reload_s`` seconds (a slow reload: a large model, a loaded machine). The
completions do not depend on the weights, but the fake **holds** them as the worker extension says: the
directory reloaded last is what ``rlrun_weights_digest`` digests (:func:`rlrun.weights_digest.files_digest`,
served float32 as on vLLM-CPU) and what prompt logprobs answer from (a sequence of its ``probe.json`` gets the
probe's logprobs: the server holds the trainer's weights; anything else −0.1, as its completions).
``noop_reload``: a reload answers ``ok`` and changes nothing (the server keeps its old weights: what the
verification must catch).

LoRA adapters as vLLM serves them with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``: ``POST /v1/load_lora_adapter``
(``{"lora_name", "lora_path", "load_inplace"}``) loads a directory holding ``adapter_config.json`` and
``adapter_model.safetensors`` (404 naming the path otherwise; 400 for the base model's name, or a name already
loaded without ``load_inplace``), ``POST /v1/unload_lora_adapter`` (``{"lora_name"}``) unloads one (404 for a
name not loaded), and a completion naming neither the base model nor a loaded adapter is answered 404 as vLLM
answers it. As vLLM 0.32, an adapter loaded with ``load_inplace`` is read from its directory again for every
completion naming it (vLLM: at every engine step), and a directory gone by then is a 500 (vLLM's engine dies);
``counts.adapter_reads`` counts every read. ``rlrun_adapter_digest`` digests the adapter loaded last as read
(:func:`rlrun.weights_digest.adapter_digest`). The transport's ``counts`` record the adapters loaded and the
model each completion named (:class:`ReloadCounts`), so tests can check the version rule and the unloading;
clearing ``counts.adapters`` is a server restart's loss of them.

A weight update keeps vLLM's semantics: ``POST /pause`` holds the completions that arrive until ``POST /resume``
and answers once those in flight are answered (``mode=wait``), ``POST /update_weight_version`` sets the version
served. What an orchestrator must never do is counted (:class:`ReloadCounts`, the transport's ``counts``; also
on ``/metrics`` as ``rlrun_fake_*``): a completion that arrives in a reload window (between ``/pause`` and
``/resume``: vLLM would generate it after the resume, on weights other than those the server held when it was
sent) and one still in flight when ``/pause`` arrives (vLLM answers it on the old weights only if it is already
running, else after the resume).

:func:`serve_fake_vllm` serves the same answers over real HTTP, in a process of its own as a
real vLLM is; ``rlrun rollout --fake`` runs it in place of vLLM (what a rollout pod or
``rlrun local`` then starts), so the orchestrator, trainer, operator and launcher can be
tested end to end without vLLM's start-up (≈30–60 s on 2 cores).
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import random
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from rlrun.adapter_format import missing_files
from rlrun.rollout.adapters import SERVED_MODEL_NAME
from rlrun.rollout.client import RolloutClient
from rlrun.versions import imitated_vllm


@dataclass
class ReloadCounts:
    """What a fake server saw of weight updates (module docstring).

    Attributes:
        reloads: weight reloads done.
        sent_in_reload: completions that arrived between a ``/pause`` and its ``/resume``.
        in_flight_at_pause: completions still being answered when a ``/pause`` arrived.
        version: the weight version served (the last ``/update_weight_version``).
        adapters: the LoRA adapters loaded: name → the directory it was loaded from.
        adapter_loads: adapter loads done (in place ones included).
        adapter_reads: times an adapter directory was read: one per load, and one per completion naming an
            adapter loaded with ``load_inplace`` (module docstring).
        weights: the directory whose weights the server holds (the last reload that changed something; None:
            the ones it started with).
        unloaded: the adapters unloaded, in order.
        served: the model each completion named (the base name or an adapter's), in the order they arrived.
    """

    reloads: int = 0
    sent_in_reload: int = 0
    in_flight_at_pause: int = 0
    version: str = "0"
    adapters: dict[str, str] = field(default_factory=dict)
    adapter_loads: int = 0
    adapter_reads: int = 0
    weights: str | None = None
    inplace: set[str] = field(default_factory=set)  # adapters loaded with load_inplace
    adapter_digests: dict[str, dict] = field(default_factory=dict)  # name → its digest, as read
    unloaded: list[str] = field(default_factory=list)
    served: list[str] = field(default_factory=list)


def fake_vllm_transport(
    samples_per_s: float | None = None,
    error_rate: float = 0.2,
    eos_id: int = 0,
    vocab: range = range(2, 97),
    seed: int = 0,
    reload_s: float = 0.0,
    vllm_version: str | None = None,
    noop_reload: bool = False,
    weights: str | None = None,
) -> httpx.MockTransport:
    """A transport answering ``/v1/completions``, ``/collective_rpc`` and the admin routes (see the module
    docstring); its ``counts`` attribute is its :class:`ReloadCounts`.

    Args:
        samples_per_s: aggregate completion rate (completions per second over all requests); None: instant.
        error_rate: probability that a completion token is replaced by a random one of ``vocab``.
        eos_id: the token that ends a completion.
        vocab: the token ids an error is drawn from.
        seed: seed of the errors (the same requests in the same order get the same answers).
        reload_s: seconds a weight reload takes.
        vllm_version: the vLLM version ``GET /version`` reports (None: the one rlrun supports).
        noop_reload: a weight reload answers ``ok`` and keeps the weights held (module docstring).
        weights: the directory of the weights it starts with (a vLLM server's model; None: none it could
        digest).
    """
    served_version = vllm_version if vllm_version is not None else imitated_vllm()
    rng = random.Random(seed)
    clock = {"free_at": 0.0, "running": 0}
    counts = ReloadCounts(weights=weights)
    state: dict = {"in_flight": 0, "loop": None}  # the events are made in (and for) the loop serving

    def events() -> tuple[asyncio.Event, asyncio.Event]:
        if state["loop"] is not asyncio.get_running_loop():  # a transport a test reuses in a later loop
            state["loop"] = asyncio.get_running_loop()
            state["resumed"], state["answered"] = asyncio.Event(), asyncio.Event()
            state["resumed"].set()
            state["answered"].set()
        return state["resumed"], state["answered"]

    async def complete(body: dict) -> httpx.Response:
        n = body.get("n", 1)
        if samples_per_s:
            loop = asyncio.get_running_loop()
            clock["free_at"] = max(clock["free_at"], loop.time()) + n / samples_per_s
            clock["running"] += n
            try:
                await asyncio.sleep(clock["free_at"] - loop.time())
            finally:
                clock["running"] -= n
        answer = body["prompt"][-2::-1]
        max_tokens = body.get("max_tokens") or len(answer) + 1
        choices = []
        for i in range(n):
            ids = [rng.choice(vocab) if rng.random() < error_rate else t for t in answer] + [eos_id]
            finish = "stop" if len(ids) <= max_tokens else "length"
            ids = ids[:max_tokens]
            choices.append(
                {
                    "index": i,
                    "token_ids": ids,
                    "logprobs": {"token_logprobs": [-0.1] * len(ids)},
                    "finish_reason": finish,
                }
            )
        return httpx.Response(200, json={"choices": choices})

    async def handler(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        resumed, answered = events()
        if path == "/metrics":  # what the orchestrator's liveness guard reads, as vLLM names it
            text = f'vllm:num_requests_running{{model_name="policy"}} {clock["running"]}\n'
            text += 'vllm:num_requests_waiting{model_name="policy"} 0\n'
            text += f"rlrun_fake_completions_sent_in_reload_total {counts.sent_in_reload}\n"
            text += f"rlrun_fake_completions_in_flight_at_pause_total {counts.in_flight_at_pause}\n"
            return httpx.Response(200, text=text)
        if path == "/version":
            return httpx.Response(200, json={"version": served_version})
        if path == "/v1/completions":
            body = json.loads(request.content)
            model = body.get("model") or SERVED_MODEL_NAME
            if model != SERVED_MODEL_NAME and model not in counts.adapters:
                return _not_found(f"The model `{model}` does not exist. Valid aliases: {SERVED_MODEL_NAME}.")
            if model in counts.inplace and (read := _read_adapter(model, counts)) is not None:
                return read  # its directory is gone: vLLM's engine dies
            if body.get("prompt_logprobs") is not None:
                return _prompt_logprobs(body["prompt"], counts.adapters.get(model, counts.weights))
            counts.served.append(model)
            if not resumed.is_set():
                counts.sent_in_reload += 1
                await resumed.wait()  # vLLM holds it until the resume
            state["in_flight"] += 1
            answered.clear()
            try:
                return await complete(json.loads(request.content))
            finally:
                state["in_flight"] -= 1
                if not state["in_flight"]:
                    answered.set()
        if path == "/pause":
            counts.in_flight_at_pause += state["in_flight"]
            resumed.clear()
            await answered.wait()  # mode=wait: those in flight are answered first
        elif path == "/resume":
            resumed.set()
        elif path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            return _adapter_call(path, json.loads(request.content or b"{}"), counts)
        elif path == "/update_weight_version":
            counts.version = str(json.loads(request.content or b"{}").get("new_version"))
        elif path == "/collective_rpc":
            body = json.loads(request.content or b"{}")
            if body.get("method") == "rlrun_reload_weights":
                await asyncio.sleep(reload_s)
                counts.reloads += 1
            return httpx.Response(200, json={"results": [_rpc_result(body, counts, noop_reload)]})
        return httpx.Response(200, json={})

    transport = httpx.MockTransport(handler)
    transport.counts = counts  # type: ignore[attr-defined]
    return transport


def _not_found(message: str) -> httpx.Response:
    """vLLM's 404 answer (its ``ErrorResponse`` body)."""
    return httpx.Response(404, json={"error": {"message": message, "type": "NotFoundError", "code": 404}})


def _adapter_call(path: str, body: dict, counts: ReloadCounts) -> httpx.Response:
    """``/v1/load_lora_adapter`` or ``/v1/unload_lora_adapter`` with ``body``, as vLLM 0.32 answers them
    (``vllm/entrypoints/openai/models/serving.py``): see the module docstring."""
    name = body.get("lora_name")
    if path == "/v1/unload_lora_adapter":
        if name not in counts.adapters:
            return _not_found(f"The lora adapter '{name}' cannot be found.")
        del counts.adapters[name]
        counts.unloaded.append(name)
        return httpx.Response(200, text=f"Success: LoRA adapter '{name}' removed successfully.")
    where = body.get("lora_path")
    if not name or not where:
        return httpx.Response(400, json={"error": {"message": "Both 'lora_name' and 'lora_path' must be provided."}})
    if name == SERVED_MODEL_NAME or (name in counts.adapters and not body.get("load_inplace")):
        return httpx.Response(400, json={"error": {"message": f"The lora adapter '{name}' has already been loaded."}})
    if missing_files(Path(where)):
        return _not_found(f"Loading lora {name} failed: No adapter found for {where}")
    counts.adapters.pop(name, None)  # a name loaded again is the newest
    counts.adapters[name] = where
    counts.adapter_loads += 1
    (counts.inplace.add if body.get("load_inplace") else counts.inplace.discard)(name)
    _read_adapter(name, counts)
    return httpx.Response(200, text=f"Success: LoRA adapter '{name}' added successfully.")


def _read_adapter(name: str, counts: ReloadCounts) -> httpx.Response | None:
    """Read adapter ``name``'s directory (counted) and keep its digest as held; the 500 vLLM answers when it
    is gone."""
    from rlrun.weights_digest import adapter_digest  # here: it imports torch, a slow start

    counts.adapter_reads += 1
    try:
        counts.adapter_digests[name] = adapter_digest(counts.adapters[name], _served_dtype()).to_json()
    except (OSError, ValueError, KeyError) as exc:
        return httpx.Response(500, json={"error": {"message": f"EngineDeadError: {exc}", "code": 500}})
    return None


def _served_dtype():
    """The dtype the fake serves (vLLM-CPU's), imported when first needed."""
    import torch

    return torch.float32


def _prompt_logprobs(prompt: list[int], weights: str | None) -> httpx.Response:
    """A prompt-logprobs answer (vLLM's shape: per token ``{"<id>": {"logprob", …}}``, None first) from the
    weights in directory ``weights``: a sequence of its probe gets the probe's logprobs (−0.1 where the probe
    has none)."""
    from rlrun.probes import read_probe

    probe = {tuple(p.ids): p.logprobs for p in (read_probe(weights) or [])} if weights else {}
    logprobs = probe.get(tuple(prompt), [None] * len(prompt))
    rows = [
        None if j == 0 else {str(t): {"logprob": -0.1 if lp is None else lp, "rank": 1}}
        for j, (t, lp) in enumerate(zip(prompt, logprobs, strict=True))
    ]
    choice = {"index": 0, "text": "", "token_ids": [0], "prompt_logprobs": rows, "finish_reason": "length"}
    return httpx.Response(200, json={"choices": [choice]})


def _rpc_result(body: dict, counts: ReloadCounts, noop_reload: bool) -> dict:
    """What the worker extension would answer to ``body`` (``{"method", "args"}``), holding the weights as the
    module docstring says (a digest reads the files, on the loop: ≈ 1 ms for the tiny model, as a worker
    blocks its own engine while it digests)."""
    from rlrun.weights_digest import Digest, files_digest  # here: it imports torch, a slow start

    method = body.get("method")
    if method == "rlrun_weights_digest":
        digest = files_digest(counts.weights, _served_dtype()) if counts.weights else Digest()
        return {"ok": True, "digest": digest.to_json(), "dtype": "torch.float32"}
    if method == "rlrun_adapter_digest":
        if not counts.adapters:
            return {"ok": False, "error": "no LoRA adapter loaded"}
        newest = list(counts.adapters)[-1]
        if newest not in counts.adapter_digests:  # its directory did not read as an adapter
            return {"ok": False, "error": f"adapter {newest} unreadable"}
        return {"ok": True, "digest": counts.adapter_digests[newest], "dtype": "torch.float32"}
    if method != "rlrun_reload_weights":
        return {"ok": True}
    [path] = body.get("args") or [""]
    count = len(list(Path(path).glob("*.safetensors")))
    if not count:
        return {"ok": False, "error": f"no *.safetensors files in {path}"}
    if not noop_reload:
        counts.weights = path
    return {"ok": True, "files": count, "seconds": 0.0}


def fake_vllm_app(**kwargs):
    """An ``aiohttp.web.Application`` answering as :func:`fake_vllm_transport` (``kwargs`` are its own),
    over real HTTP."""
    from aiohttp import web

    handler = fake_vllm_transport(**kwargs).handler

    async def answer(request: web.Request) -> web.Response:
        body = await request.read()
        resp = await handler(httpx.Request(request.method, str(request.url), content=body))
        kind = resp.headers.get("content-type", "application/json").split(";")[0]
        return web.Response(status=resp.status_code, body=resp.content, content_type=kind)

    app = web.Application()
    app.router.add_route("*", "/{path:.*}", answer)
    return app


def model_eos_id(model: str) -> int:
    """The EOS token id the fake ends its completions with for ``model`` (a directory): its ``config.json``'s
    ``eos_token_id`` (the first one when it lists several; 0 without one, or for a model that is no directory)."""
    config = Path(model) / "config.json"
    eos = json.loads(config.read_text()).get("eos_token_id") if config.is_file() else None
    return (eos[0] if isinstance(eos, list) else eos) or 0


def serve_fake_vllm(host: str, port: int, **kwargs) -> None:
    """Serve :func:`fake_vllm_app` on ``host:port`` until the process ends (blocking: run it in a process
    of its own)."""
    from aiohttp import web

    web.run_app(fake_vllm_app(**kwargs), host=host, port=port, print=None, access_log=None)


def fake_vllm_process(**kwargs) -> tuple[multiprocessing.Process, str]:
    """:func:`serve_fake_vllm` (``kwargs`` are its own) in a forked process of its own, on a free
    localhost port, as a benchmark's stand-in for a vLLM server on another machine: the process (a
    daemon; kill it when done) and its URL, once it listens.

    Raises:
        RuntimeError: it did not listen within 30 s.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = multiprocessing.get_context("fork").Process(
        target=serve_fake_vllm, args=("127.0.0.1", port), kwargs=kwargs, daemon=True
    )
    server.start()
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return server, f"http://127.0.0.1:{port}"
        except OSError:
            if time.monotonic() > deadline or not server.is_alive():
                server.kill()
                raise RuntimeError("the fake rollout server did not start listening") from None
            time.sleep(0.05)


def fake_client_factory(**kwargs):
    """A ``client_factory`` for the Orchestrator/Dispatcher whose clients all share one fake server."""
    transport = fake_vllm_transport(**kwargs)
    return lambda url: RolloutClient(url, transport=transport)
