"""``spec.model.revision`` is loaded everywhere the run's model is, not only by vLLM (``docs/design.md``, "Model
revision"): the trainer's weights and KL reference, the orchestrator's and ``rlrun evaluate``'s tokenizer, ``rlrun
local``'s prompt and LoRA target checks, and the rollout server's ``--revision``. transformers' loaders are replaced
(no network): each call is recorded with the revision it asks for, then answered from the tiny model's directory."""

from __future__ import annotations

import asyncio
import functools

import pytest
from rlrun.model.resolve import pretrained_kwargs
from rlrun.orchestrator.evaluation import evaluate_weights
from rlrun.orchestrator.prompts import check_prompts
from rlrun.rollout.server import vllm_command
from rlrun.rundir import RunDir
from rlrun.training.lora_targets import check_targets
from rlrun.training.trainer import Trainer
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from tests.support.manifests import parse
from tests.support.orchestrators import make_orchestrator

PINNED = {"name": "org/pinned-model", "revision": "0123abc"}
BUILTIN = {"builtin": "tiny-reverse"}


class Stop(Exception):
    """Raised by a recorded load where what follows it (rollout requests) is not this test's subject."""


class Loads:
    """transformers' ``from_pretrained`` of models, tokenizers and configs, recorded as ``(class, path, revision)``
    (None: no revision asked) and answered from ``tiny_model``, or stopped with :class:`Stop` while ``stop``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, tiny_model) -> None:
        self.calls: list[tuple[str, str, str | None]] = []
        self.stop = False
        self.loading = False
        for cls in (AutoModelForCausalLM, AutoConfig):
            monkeypatch.setattr(cls, "from_pretrained", self._recorder(cls.__name__, cls.from_pretrained, tiny_model))
        # A tokenizer loads through AutoTokenizer, or through the class its tokenizer_config.json names
        # (rlrun.model.resolve.load_tokenizer): either is the "tokenizer" load, recorded once.
        monkeypatch.setattr(
            AutoTokenizer, "from_pretrained", self._recorder("tokenizer", AutoTokenizer.from_pretrained, tiny_model)
        )
        by_class = PreTrainedTokenizerBase.from_pretrained.__func__

        def tokenizer_class_load(cls, path, *args, **kwargs):
            real = functools.partial(by_class, cls)
            return self._recorder("tokenizer", real, tiny_model)(path, *args, **kwargs)

        monkeypatch.setattr(PreTrainedTokenizerBase, "from_pretrained", classmethod(tokenizer_class_load))

    def _recorder(self, name, real, tiny_model):
        def from_pretrained(path, *args, **kwargs):
            revision = kwargs.pop("revision", None)
            if self.loading:  # transformers' own load of the config within a model's or tokenizer's
                return real(path, *args, **kwargs)
            self.calls.append((name, str(path), revision))
            if self.stop:
                raise Stop
            self.loading = True
            try:
                return real(tiny_model, *args, **kwargs)
            finally:
                self.loading = False

        return from_pretrained

    def revisions(self) -> set[str | None]:
        assert self.calls, "nothing was loaded"
        return {revision for _, _, revision in self.calls}


@pytest.fixture
def loads(monkeypatch, tiny_model) -> Loads:
    return Loads(monkeypatch, tiny_model)


@pytest.fixture(params=[(PINNED, "0123abc"), (BUILTIN, None)], ids=["named-with-revision", "builtin"])
def model(request, tiny_model) -> tuple[dict, str, str | None]:
    """``(spec.model, the model path the roles get, the revision every load must ask for)``."""
    spec, revision = request.param
    return spec, (spec["name"] if "name" in spec else str(tiny_model)), revision


def test_the_rule_a_named_model_with_a_revision_takes_it_and_no_other_model_takes_one():
    assert pretrained_kwargs(parse(model=PINNED).spec.model) == {"revision": "0123abc"}
    assert pretrained_kwargs(parse(model={"name": "org/pinned-model"}).spec.model) == {}
    assert pretrained_kwargs(parse(model=BUILTIN).spec.model) == {}


def test_the_trainer_loads_its_weights_and_its_kl_reference_at_the_revision(tmp_path, loads, model):
    spec, path, revision = model
    trainer = Trainer(parse(model=spec, loss={"kl_coef": 0.1}).spec, RunDir(tmp_path), path)
    trainer.ledger.close()
    assert [(name, p) for name, p, _ in loads.calls] == [("AutoModelForCausalLM", path)] * 2  # policy, reference
    assert loads.revisions() == {revision}


def test_the_orchestrator_loads_its_tokenizer_at_the_revision(tmp_path, loads, model):
    spec, path, revision = model
    orchestrator = make_orchestrator(parse(model=spec).spec, RunDir(tmp_path), path)
    loads.stop = True
    with pytest.raises(Stop):
        asyncio.run(orchestrator._wire())
    assert loads.calls == [("tokenizer", path, revision)]


def test_rlrun_evaluate_loads_its_tokenizer_at_the_revision(tmp_path, loads, model):
    spec, path, revision = model
    loads.stop = True
    with pytest.raises(Stop):
        asyncio.run(evaluate_weights("http://rollout:1", parse(model=spec).spec, path, None, 0, tmp_path / "e.jsonl"))
    assert loads.calls == [("tokenizer", path, revision)]


def test_rlrun_locals_prompt_check_loads_its_tokenizer_at_the_revision(loads, model):
    spec, path, revision = model
    check_prompts(parse(model=spec, rollout={"overlong_prompts": "refuse"}).spec, path)
    assert loads.calls == [("tokenizer", path, revision)]


def test_rlrun_locals_lora_target_check_reads_the_revisions_config(loads, model):
    spec, path, revision = model
    check_targets(parse(model={**spec, "lora": {"rank": 4}}).spec, path)
    assert loads.calls == [("AutoConfig", path, revision)]


def test_the_rollout_server_serves_the_revision(model):
    spec, path, revision = model
    argv = vllm_command(parse(model=spec).spec, path, "0.0.0.0", 8000, gpu=False, bf16=False)
    assert (argv[argv.index("--revision") + 1] if "--revision" in argv else None) == revision
